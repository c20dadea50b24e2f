"""The Lua scripts Redis runs for pipework: files under ``lua/`` (package data), each read
once, when the module that runs it is imported. A script goes by its SHA1 (``EVALSHA``), and
its text only when Redis does not know it yet (``NOSCRIPT``: a new or restarted server).
Each file's header says what its KEYS and ARGV are and what it answers."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from importlib.resources import files

__all__ = ["Script", "load", "terminal_statuses"]


@dataclass(frozen=True, slots=True)
class Script:
    name: str
    source: str
    #: The SHA1 of ``source``, hex: what ``EVALSHA`` names.
    sha: str


def load(name: str) -> Script:
    """The script in ``lua/{name}.lua``."""
    source = files("pipework.redis").joinpath("lua", f"{name}.lua").read_text(encoding="utf-8")
    return Script(name, source, hashlib.sha1(source.encode()).hexdigest())


def terminal_statuses(script: Script) -> set[str]:
    """The statuses in the script's ``local terminal = {...}`` table (a script that tells
    finished jobs apart lists them itself; the store checks them against the engine's)."""
    table = re.search(r"^local terminal = \{(.*)\}$", script.source, re.MULTILINE)
    if table is None:
        raise RuntimeError(f"lua/{script.name}.lua has no table of terminal statuses")
    return set(re.findall(r"\['(\w+)'\] = true", table.group(1)))
