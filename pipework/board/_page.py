"""The jobs page (``GET /ui/jobs``): the caller's jobs, live, in one HTML file.

The browser keeps the caller's job tickets (``id:token``, as a 202 answer hands them out) in
``localStorage``; a ticket is added in the form or in the address's fragment
(``/ui/jobs#ID:TOKEN,ID:TOKEN``, which never reaches the server). The page follows all of
them in one SSE stream, ``GET /jobs/events`` with the tickets in ``X-Job-Tickets`` (read
with ``fetch``, since EventSource cannot send headers), and redraws a row on every event:
status in colour, a progress bar, the error on hover, a link to the result. No build step,
no third-party script; the Content-Security-Policy allows only this page's own script.
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
const rows = new Map();
let controller = null;

function tickets() {
  try { return JSON.parse(localStorage.getItem(KEY) || "[]"); } catch { return []; }
}
function save(list) { localStorage.setItem(KEY, JSON.stringify([...new Set(list)])); }
function tokenOf(id) {
  const t = tickets().find((x) => x.startsWith(id + ":"));
  return t ? t.slice(id.length + 1) : "";
}
function addTickets(text) {
  const found = text.split(/[\s,]+/).filter((t) => /^[\w-]+:[\w-]+$/.test(t));
  if (found.length) { save([...tickets(), ...found]); follow(); }
}

function row(id) {
  let tr = rows.get(id);
  if (!tr) {
    tr = document.createElement("tr");
    tr.id = "job-" + id;
    tr.innerHTML = '<td class="id"></td><td class="chain"></td><td class="status"></td>' +
      '<td><progress max="1" value="0"></progress> <span class="pct"></span></td>' +
      '<td class="result"></td>';
    tr.querySelector(".id").textContent = id;
    document.querySelector("#jobs tbody").prepend(tr);
    rows.set(id, tr);
  }
  return tr;
}

function show(job) {
  const tr = row(job.id);
  const status = tr.querySelector(".status");
  status.textContent = job.status;
  status.className = "status " + job.status;
  status.title = job.error ? (job.error.detail || job.error.title) : "";
  tr.dataset.status = job.status;
  tr.querySelector(".chain").textContent = job.chain;
  const bar = tr.querySelector("progress");
  const pct = tr.querySelector(".pct");
  const p = job.progress;
  if (job.status === "done") { bar.value = 1; pct.textContent = "100%"; }
  else if (p && p.total) {
    bar.value = Math.min(p.done / p.total, 1);
    pct.textContent = Math.round(100 * bar.value) + "%" + (p.message ? " " + p.message : "");
  } else if (p) { bar.removeAttribute("value"); pct.textContent = String(p.done); }
  const cell = tr.querySelector(".result");
  if (job.links && job.links.result && !cell.firstChild) {
    const a = document.createElement("a");
    a.href = job.links.result;
    a.textContent = job.status === "done" ? "result" : "error";
    a.addEventListener("click", (e) => { e.preventDefault(); openResult(job.id, a.href); });
    cell.append(a);
  }
}

async function openResult(id, href) {
  const answer = await fetch(href, { headers: { "X-Job-Token": tokenOf(id) } });
  const blob = await answer.blob();
  window.open(URL.createObjectURL(blob), "_blank");
}

function dispatch(block) {
  let event = "message", data = "";
  for (const line of block.split("\n")) {
    if (line.startsWith("event:")) event = line.slice(6).trim();
    else if (line.startsWith("data:")) data += line.slice(5).trim();
  }
  if (!data) return;
  const body = JSON.parse(data);
  if (event === "missing") {
    save(tickets().filter((t) => !t.startsWith(body.id + ":")));
  } else if (event === "delete") {
    const tr = rows.get(body.id);
    if (tr) { tr.remove(); rows.delete(body.id); }
  } else if (body.data) {
    show(body.data);
  }
}

async function follow() {
  if (controller) controller.abort();
  const list = tickets();
  document.querySelector("#empty").hidden = list.length > 0;
  if (!list.length) return;
  controller = new AbortController();
  const state = document.querySelector("#live");
  try {
    const answer = await fetch("/jobs/events", {
      headers: { "X-Job-Tickets": list.join(","), "Accept": "text/event-stream" },
      signal: controller.signal,
    });
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
  state.textContent = "reconnecting";
  setTimeout(follow, 2000);
}

document.querySelector("#add").addEventListener("submit", (e) => {
  e.preventDefault();
  const input = document.querySelector("#ticket");
  addTickets(input.value);
  input.value = "";
});
if (location.hash.length > 1) {
  addTickets(decodeURIComponent(location.hash.slice(1)));
  history.replaceState(null, "", location.pathname);
}
follow();
"""

_PAGE: Final = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>Jobs - pipework</title>
<link rel="icon" href="data:,">
<style>
  body { font: 15px/1.4 system-ui, sans-serif; margin: 2rem; color: #222; }
  h1 { font-size: 1.4rem; margin: 0 0 1rem; }
  table { border-collapse: collapse; min-width: 48rem; }
  th, td { text-align: left; padding: .45rem .8rem; border-bottom: 1px solid #ddd; }
  td.id { font-family: ui-monospace, monospace; font-size: .85rem; }
  .status { font-weight: 600; border-radius: .3rem; }
  .queued, .suspended { color: #555; }
  .running { color: #0b62c4; }
  .done { color: #137a2e; }
  .failed, .expired { color: #b3261e; cursor: help; }
  .cancelled { color: #888; }
  progress { width: 10rem; vertical-align: middle; }
  #live { font-size: .8rem; color: #666; margin-left: .5rem; }
  form { margin: 1rem 0; }
  #ticket { width: 32rem; font-family: ui-monospace, monospace; }
</style>
</head>
<body>
<h1>Your jobs <span id="live">connecting</span></h1>
<form id="add"><input id="ticket" placeholder="job id:token" aria-label="job ticket">
<button>Follow</button></form>
<p id="empty">No jobs yet: add a ticket (the job's id and token, as id:token).</p>
<table id="jobs">
<thead><tr><th>Job</th><th>Route</th><th>Status</th><th>Progress</th><th></th></tr></thead>
<tbody></tbody>
</table>
<script>SCRIPT</script>
</body>
</html>
"""

_HTML: Final = _PAGE.replace("SCRIPT", _SCRIPT).encode()
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
