// Parses every ```mermaid block of the Markdown files given on the command line with
// mermaid's own parser (the one that renders them on GitHub and in the docs site) and
// prints one line per diagram that does not parse: FILE:LINE: the parser's message.
// Exits 1 when any does not, 2 when no diagram was found at all.
import { readFileSync } from "node:fs";
import DOMPurify from "dompurify";
import mermaid from "mermaid";

// Outside a browser DOMPurify has no DOM to sanitize with and leaves out its API; parsing
// needs none of it (sanitizing is for rendering labels), so it passes text through here.
if (typeof DOMPurify.addHook !== "function") {
  DOMPurify.addHook = () => {};
  DOMPurify.removeHook = () => {};
  DOMPurify.removeHooks = () => {};
  DOMPurify.sanitize = (text) => text;
}

let found = 0;
let failed = 0;
for (const file of process.argv.slice(2)) {
  const lines = readFileSync(file, "utf8").split("\n");
  for (let i = 0; i < lines.length; i++) {
    if (lines[i].trim() !== "```mermaid") continue;
    const start = i + 1;
    let end = start;
    while (end < lines.length && lines[end].trim() !== "```") end++;
    found++;
    try {
      await mermaid.parse(lines.slice(start, end).join("\n"));
    } catch (error) {
      failed++;
      const message = String(error?.message ?? error).split("\n").join(" | ");
      console.log(`${file}:${start + 1}: ${message}`);
    }
    i = end;
  }
}
console.log(`${found} diagrams, ${failed} that do not parse`);
process.exit(failed ? 1 : found ? 0 : 2);
