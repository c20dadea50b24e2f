"""The W3C trace context a request came with, as backend calls pass it on: ``traceparent``
and ``tracestate`` (Trace Context) and ``baggage`` (Baggage). Pure functions, no I/O.

A field is passed on only when well-formed, never repaired: a backend's tracer would
take a mangled one for its own. ``tracestate`` belongs to its ``traceparent`` and is
dropped without one (Trace Context §3.3: a vendor that cannot read ``traceparent`` ignores
``tracestate``). Both list fields may come in several lines (RFC 9110 §5.3); they are
joined with ``,``, empty members left out.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Final

__all__ = ["baggage", "traceparent", "tracestate"]

_TRACEPARENT: Final = re.compile(r"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}\Z")
_ZERO_IDS: Final = re.compile(r"^..-0{32}-|-0{16}-")

# Trace Context §3.3.1: key = simple-key / tenant-id "@" system-id, value = 0*255(chr)
# nblk-chr; at most 32 members, each key once.
_KEY_CHARS: Final = r"[a-z0-9_\-*/]"
_STATE_MEMBER: Final = re.compile(
    rf"(?:[a-z]{_KEY_CHARS}{{0,255}}|[a-z0-9]{_KEY_CHARS}{{0,240}}@[a-z]{_KEY_CHARS}{{0,13}})"
    r"=([\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e])\Z"
)
_MAX_STATE_MEMBERS: Final = 32

# Baggage §3.3.1: key OWS "=" OWS value *( OWS ";" OWS property ), a key being a token and
# a value baggage-octets; at most 64 members and 8192 bytes.
_TOKEN: Final = r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_OCTETS: Final = r"[\x21\x23-\x2b\x2d-\x3a\x3c-\x5b\x5d-\x7e]*"
_OWS: Final = r"[ \t]*"
_BAGGAGE_MEMBER: Final = re.compile(
    rf"{_TOKEN}{_OWS}={_OWS}{_OCTETS}(?:{_OWS};{_OWS}{_TOKEN}(?:{_OWS}={_OWS}{_OCTETS})?)*\Z"
)
_MAX_BAGGAGE_MEMBERS: Final = 64
_MAX_BAGGAGE_BYTES: Final = 8192


def traceparent(value: str | None) -> str | None:
    """``value`` (the request's first ``traceparent``), lower-cased, when well-formed and
    its ids are not all zeros; else None."""
    if value is None:
        return None
    value = value.strip().lower()
    if _TRACEPARENT.match(value) and not _ZERO_IDS.search(value):
        return value
    return None


def _members(values: Iterable[str]) -> list[str]:
    return [m for value in values for member in value.split(",") if (m := member.strip(" \t"))]


def tracestate(values: Iterable[str]) -> str | None:
    """The request's ``tracestate`` lines as one, when every member is well-formed, no key
    repeats and there are at most 32 members; else (or when empty) None."""
    members = _members(values)
    if not members or len(members) > _MAX_STATE_MEMBERS:
        return None
    keys = set()
    for member in members:
        if _STATE_MEMBER.match(member) is None:
            return None
        keys.add(member.partition("=")[0])
    if len(keys) != len(members):
        return None
    return ",".join(members)


def baggage(values: Iterable[str]) -> str | None:
    """The request's ``baggage`` lines as one, when every member is well-formed, there are
    at most 64 and they hold at most 8192 bytes; else (or when empty) None."""
    members = _members(values)
    if not members or len(members) > _MAX_BAGGAGE_MEMBERS:
        return None
    if any(_BAGGAGE_MEMBER.match(member) is None for member in members):
        return None
    joined = ",".join(members)
    return joined if len(joined) <= _MAX_BAGGAGE_BYTES else None
