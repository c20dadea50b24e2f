"""What a package index shows and what ``make run`` installs: the license, the project's
metadata, README links that work away from the repository, and a run-only install."""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def project() -> dict[str, Any]:
    data: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    return data["project"]  # type: ignore[no-any-return]  # tomllib returns Any


def test_license_file_and_metadata_agree() -> None:
    meta = project()
    assert meta["license"] == "MIT"
    assert meta["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert text.startswith("MIT License\n")
    assert "Permission is hereby granted, free of charge" in text


def test_authors_classifiers_and_urls() -> None:
    meta = project()
    assert meta["authors"]
    assert all(author.get("name") for author in meta["authors"])
    classifiers = set(meta["classifiers"])
    assert {
        "Programming Language :: Python :: 3.11",
        "Framework :: Trio",
        "Typing :: Typed",
    } <= classifiers
    # A license classifier would contradict the SPDX expression (PEP 639).
    assert not any(c.startswith("License ::") for c in classifiers)
    urls = meta["urls"]
    assert {"Homepage", "Documentation", "Repository", "Issues"} <= set(urls)
    assert all(url.startswith("https://") for url in urls.values())


def test_readme_links_work_on_a_package_index_page() -> None:
    """A package index shows README.md away from the repository: relative links break
    there. Every link is absolute, and each into the repository names a file it has."""
    repository = project()["urls"]["Repository"].rstrip("/")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    assert links
    for link in links:
        assert re.match(r"https?://", link), f"README.md links to {link!r}: make it absolute"
        if link.startswith(repository + "/"):
            where = re.match(rf"{re.escape(repository)}/(?:blob|tree)/main/([^#]*)", link)
            assert where is not None, link
            assert (ROOT / where.group(1)).exists(), f"README.md links to a missing {link}"


def test_make_run_installs_only_what_running_needs_and_says_so() -> None:
    done = subprocess.run(
        ["make", "--dry-run", "--always-make", "-C", str(ROOT), "run"],
        capture_output=True,
        text=True,
        check=True,
    )
    commands = done.stdout
    installs = [line for line in commands.splitlines() if "pip install" in line]
    assert any(line.rstrip().endswith("install --progress-bar off -e .") for line in installs)
    assert not any("[test]" in line or "--quiet" in line for line in installs), installs
    assert "installing pipework and its runtime dependencies" in commands
    assert "examples.gateway.run" in commands
