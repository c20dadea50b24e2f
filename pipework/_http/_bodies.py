"""Request and response bodies: JSON by default, msgpack when the client sends or accepts it;
a raw value (bytes with their content type) as its bytes.

Reading a body is bounded twice: by size (413 as soon as it is over the limit, without
reading the rest) and by time. Decoding refuses what job state could not hold, with the
problem a client can act on (400 malformed, 415 unsupported type).
"""

from __future__ import annotations

import base64
import json
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any, Final, NoReturn

import msgpack
import trio
from quart import Request
from werkzeug.http import parse_options_header, parse_set_header

from ..pipes._state import as_raw
from ._problems import Problem

__all__ = [
    "JSON",
    "MSGPACK",
    "OCTET_STREAM",
    "choose_media_type",
    "content_length",
    "decode",
    "decode_object",
    "dumps_json",
    "encode",
    "raw_answer",
    "read_body",
]

JSON: Final = "application/json"
MSGPACK: Final = "application/msgpack"
_MSGPACK_TYPES: Final = frozenset({MSGPACK, "application/x-msgpack", "application/vnd.msgpack"})
_OFFERED: Final = [JSON, *sorted(_MSGPACK_TYPES)]
# type "/" subtype, both RFC 9110 tokens.
_TOKEN: Final = r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_MEDIA_TYPE: Final = re.compile(f"{_TOKEN}/{_TOKEN}\\Z")
#: How deep a request's body may nest (objects and arrays); deeper is a 400. Job state
#: is walked recursively (checked, fingerprinted, merged), so the bound is the container's.
MAX_DEPTH: Final = 100


def is_msgpack(media_type: str) -> bool:
    return media_type in _MSGPACK_TYPES


def choose_media_type(request: Request) -> str:
    """What to answer in: the best of JSON and msgpack for ``Accept``; JSON when the client
    accepts neither (a body it may not parse beats a bare 406 from a gateway)."""
    if "Accept" not in request.headers:
        return JSON
    return str(request.accept_mimetypes.best_match(_OFFERED, default=JSON))


async def read_body(
    request: Request,
    *,
    limit: int,
    time_limit: float,
    headers: Mapping[str, str] | None = None,
) -> bytes:
    """The request body, at most ``limit`` bytes (413 beyond), sent within ``time_limit``
    seconds (408 after). ``headers``: the request's, first value by lowercase name, when
    the caller has them (see ``_request.read_headers``)."""
    declared = request.content_length if headers is None else content_length(headers)
    if declared is not None and declared > limit:
        _too_large(limit)
    if declared == 0 and _declared_empty(request, headers):
        return b""  # nothing to wait for: no time limit to keep
    body = request.body
    if _arrived(body):
        # The server handed the whole body over with the headers (a small body does
        # arrive with them): it is taken as it is, with no time limit to keep.
        whole = b"".join([chunk async for chunk in body])
        if len(whole) > limit:
            _too_large(limit)
        return whole
    data = bytearray()
    with trio.move_on_after(time_limit) as scope:
        async for chunk in request.body:
            data += chunk
            if len(data) > limit:
                _too_large(limit)
    if scope.cancelled_caught:
        raise Problem(
            408,
            "Request Timeout",
            f"the request body did not arrive within {time_limit:g}s",
            slug="body-timeout",
        )
    return bytes(data)


def content_length(headers: Mapping[str, str]) -> int | None:
    """The declared body length, as werkzeug reads it: None when the body is chunked or
    its length is not declared, 0 for a value that is not a plain non-negative integer."""
    encoding = headers.get("transfer-encoding")
    if encoding is not None and "chunked" in parse_set_header(encoding):
        return None
    declared = headers.get("content-length")
    if declared is None:
        return None
    declared = declared.strip(" \t")
    return int(declared) if declared.isascii() and declared.isdigit() else 0


def _declared_empty(request: Request, headers: Mapping[str, str] | None) -> bool:
    """``Content-Length: 0`` as such (werkzeug reads a malformed length as 0 too)."""
    value = request.headers.get("Content-Length") if headers is None else headers["content-length"]
    return value is not None and value.strip(" \t") == "0"


def _arrived(body: object) -> bool:
    """Whether quart's body holds the whole request body already (reading it will not
    wait). Quart has no public word for it; anything unexpected reads as "not yet"."""
    complete = getattr(body, "_complete", None)
    is_set = getattr(complete, "is_set", None)
    return is_set is not None and getattr(body, "_must_raise", True) is None and bool(is_set())


def _too_large(limit: int) -> NoReturn:
    raise Problem(
        413,
        "Content Too Large",
        f"the request body is over this endpoint's limit of {limit} bytes",
        slug="body-too-large",
        limit=limit,
    )


def decode(data: bytes, content_type: str | None, *, what: str = "request body") -> Any:
    """Decode a JSON or msgpack body by its ``Content-Type`` header (a bare media type
    will do); an empty body is None. JSON is UTF-8 only (RFC 8259); a body nests at most
    :data:`MAX_DEPTH` levels."""
    if not data:
        return None
    media_type, charset = _media_type(content_type, what)
    if media_type == JSON or media_type.endswith("+json"):
        if charset not in (None, "utf-8", "utf8"):
            raise _unsupported(f"the {what} is JSON in {charset}; JSON is sent as UTF-8 (RFC 8259)")
        value = _decode_json(data, what)
    elif is_msgpack(media_type):
        value = _decode_msgpack(data, what)
    else:
        raise _unsupported(
            f"the {what} is {media_type}; send application/json or application/msgpack"
        )
    if _depth_over(value, MAX_DEPTH):
        raise Problem(
            400,
            "Malformed body",
            f"the {what} nests deeper than {MAX_DEPTH} levels",
            slug="malformed",
        )
    return value


def decode_object(data: bytes, content_type: str | None, *, what: str = "request body") -> Any:
    """Like :func:`decode`, but a body that is there must be an object (a msgpack map):
    its members become job state. None only when there is no body at all."""
    value = decode(data, content_type, what=what)
    if data and not isinstance(value, dict):
        raise Problem(
            400,
            "Malformed body",
            f"the {what} must be a JSON object or msgpack map, not "
            f"{'null' if value is None else type(value).__name__}: its members become the "
            "job's state",
            slug="body-not-an-object",
        )
    return value


def _media_type(content_type: str | None, what: str) -> tuple[str, str | None]:
    if content_type is None or not content_type.strip():
        raise _unsupported(
            f"the {what} has no Content-Type; send application/json or application/msgpack"
        )
    if content_type == JSON:
        return JSON, None  # the common case, without parsing
    media_type, options = parse_options_header(content_type)
    media_type = media_type.lower()
    if not _MEDIA_TYPE.match(media_type):
        shown = content_type if len(content_type) <= 80 else content_type[:77] + "..."
        raise _unsupported(
            f"the {what}'s Content-Type {shown!r} is not a media type (type/subtype); "
            "send application/json or application/msgpack"
        )
    charset = options.get("charset")
    return media_type, None if charset is None else charset.lower()


def _unsupported(detail: str) -> Problem:
    return Problem(415, "Unsupported Media Type", detail, slug="unsupported-media-type")


def _depth_over(value: Any, limit: int) -> bool:
    """Whether ``value`` nests deeper than ``limit`` containers (walked without recursion)."""
    pending: list[tuple[Any, int]] = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, dict):
            children: Iterable[Any] = item.values()
        elif isinstance(item, list | tuple):
            children = item
        else:
            continue
        if depth > limit:
            return True
        pending.extend((child, depth + 1) for child in children)
    return False


def _malformed(what: str, kind: str, error: BaseException) -> Problem:
    detail = f"the {what} is not valid {kind}: {error}"
    return Problem(400, "Malformed body", detail, slug="malformed")


def _refuse_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    # 1e400 parses to inf, which no JSON answer could carry back.
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of range for a number")
    return value


# Made once: json.loads and json.dumps build a new decoder or encoder on every call that
# passes options.
_DECODER: Final = json.JSONDecoder(parse_constant=_refuse_constant, parse_float=_finite)


def _decode_json(data: bytes, what: str) -> Any:
    try:
        # Decoded here, strictly: json.loads would take UTF-16 and UTF-32 bodies as well.
        text = data.decode("utf-8")
        if text.startswith("\ufeff"):  # as json.loads refuses it
            raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", text, 0)
        return _DECODER.decode(text)
    except (ValueError, RecursionError) as exc:
        raise _malformed(what, "JSON", exc) from None


def _refuse_ext(code: int, data: bytes) -> NoReturn:
    raise ValueError(f"msgpack extension type {code} cannot be job state")


class _BytesKey(ValueError):
    pass


def _str_keys(value: dict[Any, Any]) -> dict[Any, Any]:
    # strict_map_key refuses every key but str and bytes; job state, and the JSON it is
    # answered in, has string keys only, so bytes go too (at any depth: this runs per map).
    for key in value:
        if not isinstance(key, str):
            shown = repr(key) if len(key) <= 32 else f"{key[:32]!r}..."
            raise _BytesKey(f"a map key is bytes ({shown})")
    return value


def _decode_msgpack(data: bytes, what: str) -> Any:
    try:
        # Timestamps decode to datetime, which the state check then refuses by its key path.
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            object_hook=_str_keys,
            ext_hook=_refuse_ext,
            timestamp=3,
        )
    except _BytesKey as exc:
        detail = f"in the {what}, {exc}: map keys must be strings (msgpack str, not bin)"
        raise Problem(400, "Malformed body", detail, slug="malformed") from None
    except (ValueError, TypeError, RecursionError, msgpack.UnpackException) as exc:
        raise _malformed(what, "msgpack", exc) from None


#: What a raw answer whose type is unknown (or not a valid header value) is sent as.
OCTET_STREAM: Final = "application/octet-stream"
# A Content-Type an answer can carry: visible ASCII, single spaces or tabs inside.
_HEADER_VALUE: Final = re.compile(r"[\x21-\x7e](?:[ \t]*[\x21-\x7e])*\Z")


def raw_answer(value: Any) -> tuple[bytes, str] | None:
    """The bytes and content type a raw value (``pipes._state.raw_value``) is answered
    with, as it is, whatever the client accepts; None for any other value."""
    raw = as_raw(value)
    if raw is None:
        return None
    content_type, data = raw
    if content_type is None or _HEADER_VALUE.match(content_type) is None:
        content_type = OCTET_STREAM
    return data, content_type


def encode(value: Any, media_type: str) -> bytes:
    """Encode a result. In JSON, bytes become base64 strings (JSON has no bytes)."""
    if is_msgpack(media_type):
        return bytes(msgpack.packb(value, use_bin_type=True))
    return dumps_json(value).encode()


def dumps_json(value: Any) -> str:
    try:
        return _ENCODER.encode(value)
    except (ValueError, TypeError) as exc:
        raise Problem(
            500,
            "Result not representable",
            f"the result cannot be written as JSON ({exc}); ask for application/msgpack",
            slug="unrepresentable",
        ) from None


def _bytes(value: object) -> str:
    if isinstance(value, bytes | bytearray | memoryview):
        return base64.b64encode(bytes(value)).decode("ascii")
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


_ENCODER: Final = json.JSONEncoder(
    separators=(",", ":"), ensure_ascii=False, allow_nan=False, default=_bytes
)
