"""Job state must survive msgpack: checked where state enters a job, with the key path."""

from __future__ import annotations

from typing import Any

import msgpack

from .._errors import StateError

__all__ = ["as_raw", "check_state", "check_value", "raw_value", "storable_part"]

_SCALARS = (str, bytes, int, float, bool, type(None))


def raw_value(content_type: str | None, data: bytes) -> dict[str, Any]:
    """A body kept as it is: its bytes and their media type (None: none was given). Plain
    state, stored as msgpack stores bytes; answered as those bytes when it is a result."""
    return {"content_type": content_type, "data": data}


def as_raw(value: object) -> tuple[str | None, bytes] | None:
    """The content type and bytes of a raw value (:func:`raw_value`: a table of exactly
    ``content_type``, a string or None, and ``data``, bytes); None for anything else."""
    if type(value) is not dict or len(value) != 2:
        return None
    content_type = value.get("content_type", False)
    data = value.get("data")
    if type(data) is not bytes or not (content_type is None or type(content_type) is str):
        return None
    return content_type, data


def check_state(state: object, *, root: str = "state") -> dict[str, Any]:
    """Return ``state`` if it is a dict with string keys that msgpack can store; else raise
    :class:`StateError` naming the key path of the first offending value."""
    if not isinstance(state, dict):
        raise StateError(f"{root} must be a dict, got {type(state).__name__}", path=root)
    for key in state:
        if not isinstance(key, str):
            raise StateError(
                f"{root}[{key!r}]: top-level state keys must be strings, not {type(key).__name__}",
                path=f"{root}[{key!r}]",
            )
    # check_value, inline (the engine checks the state after every pipe)
    try:
        packer = _packers.pop()
    except IndexError:
        packer = msgpack.Packer()
    try:
        packer.pack(state)
    except (TypeError, ValueError, OverflowError) as exc:
        raise _unstorable(state, root, exc) from exc
    _packers.append(packer)
    return state


#: Packers kept for reuse: ``msgpack.packb`` makes a new one per call, and each allocates a
#: megabyte buffer. A caller takes one off the list and puts it back (list pops and appends
#: are atomic, so threads never share one); a packer that raised is dropped, not reused.
_packers: list[msgpack.Packer] = []


def check_value(value: object, *, root: str = "value") -> None:
    """Raise :class:`StateError` with the key path if msgpack cannot store ``value``."""
    try:
        packer = _packers.pop()
    except IndexError:
        packer = msgpack.Packer()
    try:
        # The C packer is the fast path; only a failure pays for the walk that names the path.
        packer.pack(value)
    except (TypeError, ValueError, OverflowError) as exc:
        raise _unstorable(value, root, exc) from exc
    _packers.append(packer)


def _unstorable(value: object, root: str, exc: Exception) -> StateError:
    """The StateError for a value the packer refused, naming the path of what it refused."""
    path, why = _find(value, root, 0)
    if not path:  # the packer refused what the walk accepts: say what it said
        path, why = root, f"a value msgpack cannot store ({exc})"
    return StateError(
        f"{path} holds {why}, which job state cannot store "
        "(use str, bytes, int, float, bool, None, list or dict)",
        path=path,
    )


# The C packer's own nesting bound; the walk stops there too (and stays far from Python's).
_MAX_DEPTH = 511


def _find(value: object, path: str, depth: int) -> tuple[str, str]:
    """The path of the first value msgpack cannot store and what it is; ("", "") if none."""
    if depth > _MAX_DEPTH:
        return path, f"a value nested deeper than {_MAX_DEPTH} levels"
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, _SCALARS) or _lone_surrogate(key):
                return f"{path}[{_short(key)}]", _describe(key)
            inner = f"{path}.{key}" if isinstance(key, str) else f"{path}[{key!r}]"
            found = _find(item, inner, depth + 1)
            if found[0]:
                return found
        return "", ""
    if isinstance(value, list | tuple):
        for index, item in enumerate(value):
            found = _find(item, f"{path}[{index}]", depth + 1)
            if found[0]:
                return found
        return "", ""
    if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**64:
        return path, f"an integer out of range ({_short(value)}; msgpack takes -2**63 to 2**64-1)"
    if isinstance(value, str) and _lone_surrogate(value):
        return path, _describe(value)
    if isinstance(value, _SCALARS):
        return "", ""
    return path, _describe(value)


def _lone_surrogate(value: object) -> bool:
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _describe(value: object) -> str:
    if _lone_surrogate(value):
        return f"str {_short(value)}, which is not valid Unicode (it holds a lone surrogate)"
    return f"{type(value).__name__} {_short(value)}"


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def storable_part(state: dict[str, Any]) -> dict[str, Any]:
    """The top-level entries of ``state`` that job state can store: what is kept of a job
    whose pipe wrote something unstorable (the job fails, and its record must still be
    written)."""
    kept = {}
    for key, value in state.items():
        if not isinstance(key, str):
            continue
        try:
            check_value(value)
        except StateError:
            continue
        kept[key] = value
    return kept
