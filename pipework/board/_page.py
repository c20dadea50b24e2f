"""The jobs page (``GET /ui/jobs``): the download centre. The caller's jobs and their files,
live, in one HTML file.

The browser keeps the caller's job tickets (``id:token``, as a 202 answer hands them out) in
``localStorage``; a ticket is added in the form or in the address's fragment
(``/ui/jobs#ID:TOKEN,ID:TOKEN``, which never reaches the server), also when only the
fragment changes (``hashchange``). The server is the source of truth: the page lists the
jobs with ``GET /jobs`` (the tickets in ``X-Job-Tickets``; the search by name, state and
date goes with it as ``q``, ``status``, ``from`` and ``to``) every few seconds, and follows
them live in one SSE stream, ``GET /jobs/events`` (read with ``fetch``, since EventSource
cannot send headers). A ticket the server does not know is shown as unknown and kept until
the user forgets it: a restart must not make the page drop what the server may still have.

When the server authenticates the download centre (``[server] jobs_auth``), ``GET /jobs``
answers 401 and the page asks for the credential once: an API key or a bearer token, kept
in ``sessionStorage`` (this tab only, gone when it closes; never a cookie, which the
browser would send by itself) and sent in the header the 401's ``WWW-Authenticate`` names
(``ApiKey ... header="..."``, else ``Authorization: Bearer``). The listing and the stream
are then the identity's jobs, and the tickets' besides.

Each row: the state in the seed's colours (running blue, done green, failed red with the
reason on hover, expired grey), progress, rows, size, created, finished, expiry, the
download (a short-lived signed link from the listing: the token never goes in a URL) and
the "downloaded" mark. Ticked rows download as one zip (``POST /jobs/downloads`` signs its
link). When a followed job ends while the page is in the background, a desktop
notification says so (the Notification API, once the user allowed it). No build step, no
third-party script; the Content-Security-Policy allows only this page's own script.
"""

from __future__ import annotations

import base64
import hashlib
from typing import Final

from quart import Response

__all__ = ["jobs_page"]

_SCRIPT: Final = r"""
"use strict";
const KEY = "pipework.jobs";
const CREDENTIAL = "pipework.credential";
const TERMINAL = new Set(["done", "failed", "cancelled", "expired"]);
const rows = new Map();
const ended = new Set();
const latest = new Map();
let controller = null;
let listing = null;
let listedOnce = false;

const $ = (q) => document.querySelector(q);
function tickets() {
  try { return JSON.parse(localStorage.getItem(KEY) || "[]"); } catch { return []; }
}
function save(list) { localStorage.setItem(KEY, JSON.stringify([...new Set(list)])); }
// The credential of [server] jobs_auth, this tab's only: {header, value}.
function credential() {
  try { return JSON.parse(sessionStorage.getItem(CREDENTIAL) || "null"); } catch { return null; }
}
function withCredential(headers) {
  const c = credential();
  if (c) headers[c.header] = c.value;
  return headers;
}
// What a 401's WWW-Authenticate asks for: the API key's header, else a bearer token.
let challenge = "";
function signIn(value) {
  value = value.trim();
  if (!value) return;
  const key = /ApiKey\b[^]*?header="([^"]+)"/i.exec(challenge);
  const jwt = /^[\w-]+\.[\w-]+\.[\w-]*$/.test(value) && /Bearer\b/i.test(challenge);
  const c = key && !jwt ? { header: key[1], value }
    : { header: "Authorization", value: "Bearer " + value };
  sessionStorage.setItem(CREDENTIAL, JSON.stringify(c));
  follow(); relist();
}
function signOut() {
  sessionStorage.removeItem(CREDENTIAL);
  for (const id of [...rows.keys()]) drop(id);
  if (controller) controller.abort();
  relist();
}
function needSignIn(answer, body) {
  challenge = answer.headers.get("WWW-Authenticate") || "";
  const refused = credential() !== null;
  sessionStorage.removeItem(CREDENTIAL);
  $("#signin").hidden = false;
  $("#who").hidden = true;
  say(refused ? "signing in failed: " + (body.detail || body.title)
    : "sign in to list your jobs (an API key or a token)");
}
function tokenOf(id) {
  const t = tickets().find((x) => x.startsWith(id + ":"));
  return t ? t.slice(id.length + 1) : "";
}
function addTickets(text) {
  const found = text.split(/[\s,]+/).filter((t) => /^[\w-]+:[\w-]+$/.test(t));
  if (found.length) { save([...tickets(), ...found]); follow(); relist(); }
}
function forget(id) {
  save(tickets().filter((t) => !t.startsWith(id + ":")));
  drop(id); follow(); relist();
}
function drop(id) {
  const tr = rows.get(id);
  if (tr) { tr.remove(); rows.delete(id); }
}

function when(iso) {
  if (!iso) return "";
  const d = new Date(iso);
  const p = (n) => String(n).padStart(2, "0");
  return `${d.getFullYear()}-${p(d.getMonth() + 1)}-${p(d.getDate())} ` +
    `${p(d.getHours())}:${p(d.getMinutes())}`;
}
function bytes(n) {
  if (n === null || n === undefined) return "";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : String(n)) + " " + units[i];
}

function row(id) {
  let tr = rows.get(id);
  if (!tr) {
    tr = document.createElement("tr");
    tr.id = "job-" + id;
    tr.innerHTML = '<td><input type="checkbox" class="pick" disabled></td>' +
      '<td class="name"></td><td class="id"></td><td class="status"></td>' +
      '<td><progress max="1" value="0"></progress> <span class="pct"></span></td>' +
      '<td class="rows num"></td><td class="size num"></td><td class="created"></td>' +
      '<td class="finished"></td><td class="expires"></td>' +
      '<td class="result"></td><td class="mark"></td>';
    tr.querySelector(".id").textContent = id;
    tr.querySelector(".pick").setAttribute("aria-label", "pick " + id);
    tr.querySelector(".pick").addEventListener("change", picked);
    $("#jobs tbody").append(tr);
    rows.set(id, tr);
  }
  return tr;
}

function setState(tr, state, error) {
  const cell = tr.querySelector(".status");
  cell.textContent = state;
  cell.className = "status " + state;
  cell.title = error ? (error.detail || error.title || "") : "";
  tr.dataset.status = state;
}

function setProgress(tr, job) {
  const bar = tr.querySelector("progress");
  const pct = tr.querySelector(".pct");
  const p = job.progress;
  if (job.status === "done") { bar.value = 1; pct.textContent = "100%"; }
  else if (p && p.total) {
    bar.value = Math.min(p.done / p.total, 1);
    pct.textContent = Math.round(100 * bar.value) + "%" + (p.message ? " " + p.message : "");
  } else if (p) { bar.removeAttribute("value"); pct.textContent = String(p.done); }
}

// A job's document from the stream: its state and progress, live.
function update(job) {
  const tr = rows.get(job.id);
  if (!tr) return;  // not listed (filtered out, or not yet): the next listing decides
  const before = tr.dataset.status;
  setState(tr, before === "expired" ? "expired" : job.status, job.error);
  setProgress(tr, job);
  if (!TERMINAL.has(before) && TERMINAL.has(job.status)) finished(job.id, job.status);
}

// A followed job ended: list again (its file and link), and tell a user who looks away.
function finished(id, status) {
  if (ended.has(id)) return;
  ended.add(id);
  relist();
  if (document.visibilityState === "visible") return;
  if (!("Notification" in window) || Notification.permission !== "granted") return;
  const tr = rows.get(id);
  const name = (tr && tr.querySelector(".name").textContent) || id;
  const note = new Notification(`${name}: ${status}`, {
    body: status === "done" ? "Ready in the download centre." : `The job ended: ${status}.`,
    tag: "pipework-" + id,
  });
  note.onclick = () => { window.focus(); note.close(); };
}

// A job as the listing has it: everything, its file and the file's signed link included.
function show(entry) {
  const tr = row(entry.id);
  const file = entry.file;
  latest.set(entry.id, entry);
  const before = tr.dataset.status;
  tr.querySelector(".name").textContent = file ? file.name : entry.chain;
  setState(tr, entry.state, entry.error);
  setProgress(tr, entry);
  const followed = before && before !== "unknown" && !TERMINAL.has(before);
  if (followed && TERMINAL.has(entry.state)) {
    finished(entry.id, entry.state);
  }
  if (TERMINAL.has(entry.state)) ended.add(entry.id);
  const count = file && file.rows !== null ? file.rows
    : entry.progress ? entry.progress.done : null;
  tr.querySelector(".rows").textContent = count === null ? "" : count.toLocaleString("en");
  tr.querySelector(".size").textContent = file ? bytes(file.size) : "";
  tr.querySelector(".created").textContent = when(entry.created_at);
  tr.querySelector(".finished").textContent = when(entry.finished_at);
  const until = file && file.keep_until ? file.keep_until : entry.retain_until;
  tr.querySelector(".expires").textContent = entry.state === "expired" ? "expired" : when(until);
  const cell = tr.querySelector(".result");
  cell.replaceChildren();
  const pick = tr.querySelector(".pick");
  pick.disabled = !(file && file.href);
  if (pick.disabled) pick.checked = false;
  if (file && file.href) {
    const a = document.createElement("a");
    a.className = "download";
    a.href = file.href;
    a.download = file.name;
    a.textContent = "download";
    a.addEventListener("click", (e) => downloading(e, entry.id));
    cell.append(a);
  } else if (file && entry.state === "expired") {
    cell.textContent = "file deleted";
  } else if (!file && entry.links && entry.links.result && tokenOf(entry.id)) {
    const a = document.createElement("a");
    a.href = entry.links.result;
    a.textContent = entry.state === "done" ? "result" : "error";
    a.addEventListener("click", (e) => { e.preventDefault(); openResult(entry.id, a.href); });
    cell.append(a);
  }
  const mark = tr.querySelector(".mark");
  const downloaded = file && file.downloaded_at;
  mark.textContent = downloaded ? "\u2713 downloaded" : "";
  mark.title = downloaded ? "downloaded " + when(file.downloaded_at) : "";
  tr.classList.toggle("downloaded", Boolean(downloaded));
}

function showMissing(id) {
  const tr = row(id);
  latest.delete(id);
  setState(tr, "unknown", { detail: "the server knows no job with this id and token" });
  const cell = tr.querySelector(".result");
  cell.replaceChildren();
  const b = document.createElement("button");
  b.textContent = "forget";
  b.className = "forget";
  b.addEventListener("click", () => forget(id));
  cell.append(b);
}

function downloading(e, id) {
  const entry = latest.get(id);
  const expires = entry && entry.file ? Date.parse(entry.file.href_expires_at) : 0;
  if (!(expires - Date.now() > 20000)) {  // about to expire: a fresh link first
    e.preventDefault();
    relist().then(() => {
      const fresh = rows.has(id) && rows.get(id).querySelector("a.download");
      if (fresh) fresh.click();
    });
    return;
  }
  setTimeout(relist, 1500);  // the mark, once the file is through
}

async function openResult(id, href) {
  const answer = await fetch(href, { headers: { "X-Job-Token": tokenOf(id) } });
  const blob = await answer.blob();
  window.open(URL.createObjectURL(blob), "_blank");
}

function picked() {
  const n = document.querySelectorAll(".pick:checked").length;
  $("#batch").disabled = n === 0;
  $("#batch").textContent = n ? `Download ${n} as zip` : "Download selected as zip";
}

async function batch() {
  const ids = [...document.querySelectorAll(".pick:checked")]
    .map((c) => c.closest("tr").id.slice(4));
  if (!ids.length) return;
  const answer = await fetch("/jobs/downloads", {
    method: "POST",
    headers: withCredential({
      "X-Job-Tickets": tickets().join(","), "Content-Type": "application/json",
    }),
    body: JSON.stringify({ ids }),
  });
  const body = await answer.json();
  if (!answer.ok) { say(body.detail || body.title); return; }
  const a = document.createElement("a");
  a.href = body.href;
  a.download = "";
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(relist, 1500);
}

function say(text) { $("#note").textContent = text || ""; }

function filters() {
  const params = new URLSearchParams();
  const fields = [["q", "#q"], ["status", "#state"], ["from", "#from"], ["to", "#to"]];
  for (const [name, field] of fields) {
    const value = $(field).value.trim();
    if (value) params.set(name, value);
  }
  return params;
}

async function relist() {
  const list = tickets();
  const signed = credential() !== null;
  $("#empty").hidden = list.length > 0 || signed;
  if (listing) listing.abort();
  const mine = listing = new AbortController();
  try {
    // Asked even without tickets: a 401 says the server lists jobs by identity.
    const headers = withCredential(list.length ? { "X-Job-Tickets": list.join(",") } : {});
    const answer = await fetch("/jobs?" + filters(), { headers, signal: mine.signal });
    const body = await answer.json();
    if (answer.status === 401) {
      for (const id of [...rows.keys()]) drop(id);
      needSignIn(answer, body);
      return;
    }
    if (!answer.ok) { say(body.detail || body.title); return; }
    $("#signin").hidden = true;
    $("#who").hidden = !signed;
    $("#empty").hidden = list.length > 0 || body.jobs.length > 0;
    say("");
    // An identity's job started elsewhere since the stream opened: follow it too (the
    // stream follows the identity's jobs as they were when it opened).
    const fresh = signed && listedOnce &&
      body.jobs.some((e) => !rows.has(e.id) && !TERMINAL.has(e.state));
    listedOnce = true;
    const listed = [];
    for (const entry of body.jobs) { show(entry); listed.push(entry.id); }
    for (const id of body.missing) { showMissing(id); listed.push(id); }
    for (const id of [...rows.keys()]) if (!listed.includes(id)) drop(id);
    const tbody = $("#jobs tbody");
    for (const id of listed) tbody.append(rows.get(id));  // in the listing's order
    picked();
    if (fresh) follow();
  } catch (e) {
    if (e.name !== "AbortError") say("the server cannot be reached; trying again");
  }
}

function dispatch(block) {
  let event = "message", data = "";
  for (const line of block.split("\n")) {
    if (line.startsWith("event:")) event = line.slice(6).trim();
    else if (line.startsWith("data:")) data += line.slice(5).trim();
  }
  if (!data) return;
  const body = JSON.parse(data);
  // "missing" and "delete": what the server still has of the job is the listing's to say.
  if (event !== "missing" && event !== "delete" && body.data) update(body.data);
}

async function follow() {
  if (controller) controller.abort();
  const list = tickets();
  if (!list.length && !credential()) return;
  const mine = controller = new AbortController();
  const state = $("#live");
  try {
    const headers = withCredential({ "Accept": "text/event-stream" });
    if (list.length) headers["X-Job-Tickets"] = list.join(",");
    const answer = await fetch("/jobs/events", { headers, signal: mine.signal });
    if (answer.status === 401) { state.textContent = "signed out"; return; }
    state.textContent = "live";
    const reader = answer.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value;
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        dispatch(buffer.slice(0, end));
        buffer = buffer.slice(end + 2);
      }
    }
  } catch (e) {
    if (e.name === "AbortError") return;
  }
  if (mine !== controller) return;
  state.textContent = "reconnecting";
  setTimeout(() => { if (mine === controller) { follow(); relist(); } }, 2000);
}

function askToNotify() {
  if ("Notification" in window && Notification.permission === "default") {
    Notification.requestPermission().then(notifyState);
  }
}
function notifyState() {
  const b = $("#notify");
  const can = "Notification" in window;
  b.textContent = can && Notification.permission === "granted" ? "Notifications on" : "Notify me";
  b.disabled = !can || Notification.permission !== "default";
}

function takeHash() {
  if (location.hash.length > 1) {
    const text = decodeURIComponent(location.hash.slice(1));
    history.replaceState(null, "", location.pathname + location.search);
    addTickets(text);
  }
}

$("#add").addEventListener("submit", (e) => {
  e.preventDefault();
  const input = $("#ticket");
  addTickets(input.value);
  input.value = "";
  askToNotify();
});
$("#search").addEventListener("submit", (e) => { e.preventDefault(); relist(); });
$("#signin").addEventListener("submit", (e) => {
  e.preventDefault();
  const input = $("#credential");
  signIn(input.value);
  input.value = "";
});
$("#signout").addEventListener("click", signOut);
for (const field of ["#state", "#from", "#to"]) $(field).addEventListener("change", relist);
let typing = null;
$("#q").addEventListener("input", () => {
  clearTimeout(typing);
  typing = setTimeout(relist, 250);
});
$("#batch").addEventListener("click", batch);
$("#notify").addEventListener("click", askToNotify);
window.addEventListener("hashchange", takeHash);
notifyState();
if (location.hash.length > 1) takeHash(); else { follow(); relist(); }
setInterval(relist, 8000);
"""

_PAGE: Final = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>Downloads - pipework</title>
<link rel="icon" href="data:,">
<style>
  body { font: 15px/1.4 system-ui, sans-serif; margin: 2rem; color: #222; }
  h1 { font-size: 1.4rem; margin: 0 0 1rem; }
  table { border-collapse: collapse; min-width: 60rem; }
  th, td { text-align: left; padding: .4rem .6rem; border-bottom: 1px solid #ddd; }
  td { white-space: nowrap; }
  td.id { font-family: ui-monospace, monospace; font-size: .75rem; color: #666; }
  td.num { text-align: right; font-variant-numeric: tabular-nums; }
  .status { font-weight: 600; }
  .queued, .suspended { color: #555; }
  .running { color: #0b62c4; }
  .done { color: #137a2e; }
  .failed { color: #b3261e; cursor: help; }
  .expired, .cancelled, .unknown { color: #888; }
  tr[data-status="expired"] td, tr[data-status="unknown"] td { color: #888; }
  .mark { color: #137a2e; font-size: .85rem; }
  progress { width: 8rem; vertical-align: middle; }
  #live { font-size: .8rem; color: #666; margin-left: .5rem; }
  form { margin: .6rem 0; }
  #ticket { width: 28rem; font-family: ui-monospace, monospace; }
  #note { color: #b3261e; min-height: 1.2em; margin: .3rem 0; }
</style>
</head>
<body>
<h1>Your jobs and downloads <span id="live">connecting</span></h1>
<form id="add"><input id="ticket" placeholder="job id:token" aria-label="job ticket">
<button>Follow</button> <button type="button" id="notify">Notify me</button></form>
<form id="search">
<input id="q" type="search" placeholder="name or id" aria-label="search by name or id">
<select id="state" aria-label="state"><option value="">any state</option>
<option value="queued,running,suspended">running</option><option>done</option>
<option>failed</option><option>expired</option><option>cancelled</option></select>
<label>from <input id="from" type="date"></label> <label>to <input id="to" type="date"></label>
<button>Search</button>
<button type="button" id="batch" disabled>Download selected as zip</button>
</form>
<form id="signin" hidden><input id="credential" type="password" autocomplete="off"
placeholder="API key or token" aria-label="API key or token"> <button>Sign in</button></form>
<p id="who" hidden>Signed in: your jobs are listed. <button type="button" id="signout">Sign
out</button></p>
<p id="note" role="status"></p>
<p id="empty">No jobs yet: add a ticket (the job's id and token, as id:token).</p>
<table id="jobs">
<thead><tr><th></th><th>Name</th><th>Job</th><th>State</th><th>Progress</th><th>Rows</th>
<th>Size</th><th>Created</th><th>Finished</th><th>Expires</th><th></th><th></th></tr></thead>
<tbody></tbody>
</table>
<script>SCRIPT</script>
</body>
</html>
"""

_HTML: Final = _PAGE.replace("<script>SCRIPT</script>", f"<script>{_SCRIPT}</script>").encode()
_SCRIPT_HASH: Final = base64.b64encode(hashlib.sha256(_SCRIPT.encode()).digest()).decode()
_CSP: Final = (
    "default-src 'none'; connect-src 'self'; style-src 'unsafe-inline'; "
    f"script-src 'sha256-{_SCRIPT_HASH}'; img-src 'self' data:; form-action 'none'; "
    "frame-ancestors 'none'"
)


async def jobs_page() -> Response:
    response = Response(_HTML, content_type="text/html; charset=utf-8")
    response.headers["Content-Security-Policy"] = _CSP
    response.headers["Cache-Control"] = "no-cache"
    response.headers["X-Content-Type-Options"] = "nosniff"
    return response
