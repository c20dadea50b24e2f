"""The Redis job store's Lua scripts (``lua/store_*.lua``), loaded and checked, and their
commands as the store sends them: the arguments every call sends alike encoded once, and
the formats a write's whole command is built with as bytes (far fewer small objects than
an argument each), with the mark of a write sent again (:data:`_AGAIN`).

Separate from the store: what goes on the wire for a script, no state and no I/O.
"""

from __future__ import annotations

from typing import Final

from ..dispatcher._status import TERMINAL, Status
from ._scripts import Script, load, terminal_statuses
from ._wire import encode_args

__all__ = ["_AGAIN", "_SHAS", "_SOURCES", "_bulk", "_sent_again"]


def _load(name: str) -> Script:
    """The store's script ``name`` (``lua/store_{name}.lua``). A script that tells finished
    jobs apart lists the terminal statuses itself: the engine's, or this module refuses to
    load."""
    script = load(f"store_{name}")
    wanted = {status.value for status in TERMINAL}
    if "local terminal" in script.source and terminal_statuses(script) != wanted:
        raise RuntimeError(f"lua/store_{name}.lua's terminal statuses are not {sorted(wanted)}")
    return script


_SCRIPTS: Final = {
    name: _load(name)
    for name in (
        "create",
        "update",
        "status",
        "awaited",
        "delete",
        "expire",
        "list",
        "release",
        "owned",
    )
}
#: The scripts' sources and SHA1s by name (a store's calls name the script they run).
_SOURCES: Final = {name: script.source for name, script in _SCRIPTS.items()}
_SHAS: Final = {name: script.sha for name, script in _SCRIPTS.items()}

#: The update script's last argument when the record may have any version.
_ANY_VERSION: Final = encode_args([""])

#: Before a version argument: the write is sent again after its round trip failed, and the
#: script answers as if it wrote it if the record holds it already (lua/store_update.lua).
_AGAIN: Final = "="

#: Arguments an update sends often, encoded once: a status, whether it is terminal.
_STATUS_ARG: Final = {s: encode_args([s.value]) for s in Status}
_TERMINAL_ARG: Final = {s: encode_args(["1" if s in TERMINAL else "0"]) for s in Status}
_NOT_FINISHED_ARG: Final = encode_args([repr(0.0)])
_NO_TOKEN_ARG: Final = encode_args([""])


#: The update script's command (see _update_command): head, the job's key, the finished
#: set, the tombstones' hash, the stream if any, the blob, and the rest already encoded.
_UPDATE_FORMAT: Final = b"%b$%d\r\n%b%b\r\n%b%b%b$%d\r\n%b\r\n%b$%d\r\n%b\r\n%b%b%b%b%b%b"
#: The create script's command (see create).
_CREATE_FORMAT: Final = b"%b$%d\r\n%b%b\r\n%b%b$%d\r\n%b\r\n%b$%d\r\n%b\r\n$%d\r\n%b\r\n%b%b%b"
#: create's owner and creation time for a job without an owner (see lua/store_create.lua).
_NO_OWNER: Final = encode_args(["", ""])
#: The status script's command (see update_status).
_STATUS_FORMAT: Final = b"%b$%d\r\n%b%b\r\n%b$%d\r\n%b\r\n$%d\r\n%b\r\n%b$%d\r\n%b\r\n"


def _bulk(data: bytes) -> bytes:
    """One argument as a RESP bulk string."""
    return b"$%d\r\n%b\r\n" % (len(data), data)


def _version_arg(expected: str) -> bytes:
    """The update script's last argument: the version the record must have (see _AGAIN)."""
    return _ANY_VERSION if expected == "" else encode_args([expected])


def _entry_tail(entry: tuple[str, bytes, bytes] | None) -> bytes:
    """The update script's arguments after the version: the entry's field and value."""
    return b"" if entry is None else _bulk(entry[1]) + _bulk(entry[2])


def _sent_again(command: bytes, expected: str, entry: tuple[str, bytes, bytes] | None) -> bytes:
    """The update script's ``command`` marked as sent again (see _AGAIN): its version
    argument, before the entry's, replaced."""
    tail = _entry_tail(entry)
    cut = len(command) - len(tail) - len(_version_arg(expected))
    return command[:cut] + _version_arg(_AGAIN + expected) + tail
