"""Every Mermaid diagram in the docs parses with mermaid's own parser.

``scripts/ensure-tools`` (run by ``make test``) installs the parser, pinned by
``scripts/mermaid/package-lock.json``, into ``.tools/mermaid``; ``check.mjs`` there runs it
through node over each ``mermaid`` block. Without node or the parser these tests fail: a
diagram that does not render on the page is a broken doc.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECK = ROOT / ".tools" / "mermaid" / "check.mjs"


def documents() -> list[Path]:
    found = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "examples").rglob("*.md")]
    return sorted(path for path in found if "```mermaid" in path.read_text(encoding="utf-8"))


def mermaid_check(*paths: Path) -> subprocess.CompletedProcess[str]:
    node = shutil.which("node")
    assert node is not None, "node is missing: run scripts/ensure-tools (package nodejs)"
    assert (CHECK.parent / "node_modules" / "mermaid").is_dir(), (
        "mermaid's parser is missing: run scripts/ensure-tools"
    )
    assert CHECK.read_bytes() == (ROOT / "scripts" / "mermaid" / "check.mjs").read_bytes(), (
        "the installed check.mjs is stale: run scripts/ensure-tools"
    )
    return subprocess.run(
        [node, str(CHECK), *map(str, paths)],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )


def test_every_diagram_in_the_docs_parses() -> None:
    paths = documents()
    assert len(paths) >= 5, paths
    done = mermaid_check(*paths)
    assert done.returncode == 0, done.stdout + done.stderr
    counted = done.stdout.splitlines()[-1]
    assert counted.endswith(" diagrams, 0 that do not parse"), counted
    assert int(counted.split()[0]) >= 15


def test_the_check_rejects_a_diagram_that_does_not_parse(tmp_path: Path) -> None:
    # A semicolon ends a sequence message early: GitHub shows "Unable to render".
    page = tmp_path / "bad.md"
    page.write_text(
        "# Bad\n\n```mermaid\nsequenceDiagram\n    A->>B: resolved; merge b, c\n```\n\n"
        "```mermaid\nflowchart TD\n    a --> b\n```\n",
        encoding="utf-8",
    )
    done = mermaid_check(page)
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"{page}:4: Parse error"), lines
    assert lines[-1] == "2 diagrams, 1 that do not parse"
