"""The lean client of one ``http://`` service: an :class:`HttpCall` rendered straight to
h11's request parts and sent through a keep-alive :class:`~._pool.Pool`.

It builds the same request the httpx path builds (same target, query encoding, headers and
JSON body; ``Accept-Encoding: gzip, deflate``) without httpx's request and URL models,
which cost more than the exchange itself, and reads the answer with the same rules: the
status checked against ``accept``, ``max_response_bytes`` counted on the decoded body,
JSON parsed, other text decoded with its charset (or, for a raw call, its bytes kept with
their content type). What fails is raised as the same
:class:`~pipework.BackendError` texts, or as the lean client's own exceptions
(:mod:`._failures`) for the caller to translate.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator, Mapping
from contextlib import AbstractAsyncContextManager
from typing import Any, Final
from urllib.parse import urlencode

from .._errors import BackendError
from ..pipes._state import raw_value
from ._h1 import ACCEPT_ENCODING, Answer
from ._http_spec import (
    HttpCall,
    Service,
    check_header_value,
    forwarded_headers,
    passed_headers,
    raw_body,
)
from ._http_template import TemplateError, render_body
from ._pool import Pool, ResponseTooLarge
from ._stream import StreamTimeouts, UpstreamAnswer, open_stream

__all__ = ["ServiceClient", "decode_answer", "too_big", "unaccepted"]

_DEFAULTS: Final = (
    ("accept", "Accept", "*/*"),
    ("accept-encoding", "Accept-Encoding", ACCEPT_ENCODING.decode()),
)


class ServiceClient:
    """Calls to one ``http://`` service over a pool sized by its :class:`Service`."""

    def __init__(self, service: Service, user_agent: str, pool: Pool | None = None) -> None:
        url = service.url
        if url.scheme != "http":
            raise ValueError(f"the lean client speaks plain http, not {url.scheme}")
        self.service = service
        port = url.port if url.port is not None else 80
        self.pool = pool or Pool(
            url.host,
            port,
            max_connections=service.max_connections,
            max_idle=service.max_keepalive,
            idle_timeout=service.keepalive_expiry,
            connect_timeout=(
                service.timeout if service.connect_timeout is None else service.connect_timeout
            ),
        )
        self._base = url.raw_path.rstrip(b"/").decode("ascii")
        self._raw_base = self._base.encode("ascii")
        self._host = url.netloc
        # Service headers over the client's own, as httpx merges them; lower name -> pair.
        base: dict[str, tuple[str, str]] = {"user-agent": ("User-Agent", user_agent)}
        for name, value in service.headers.items():
            base[name.lower()] = (name, value)
        self._headers = base

    async def aclose(self) -> None:
        await self.pool.aclose()

    def stream(
        self,
        method: bytes,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        body: AsyncIterator[bytes] | None,
        *,
        length: int | None,
        timeouts: StreamTimeouts,
        deadline: float = math.inf,
    ) -> AbstractAsyncContextManager[UpstreamAnswer]:
        """A streamed exchange with the service (:mod:`._stream`): ``headers`` are sent as
        they are (but for framing), with the service's ``Host`` unless they hold one; an
        origin-form ``target`` (``/path?query``) goes under the service's base path. The
        service's own headers (``headers``, ``User-Agent``) are not added: a streamed
        request is passed through, not made."""
        if target.startswith(b"/"):
            target = self._raw_base + target
        return open_stream(
            self.pool,
            method,
            target,
            headers,
            body,
            host=self._host,
            length=length,
            timeouts=timeouts,
            deadline=deadline,
        )

    def prepare(
        self,
        call: HttpCall,
        state: Mapping[str, Any],
        extra: Mapping[str, str] | None = None,
    ) -> tuple[bytes, bytes, list[tuple[bytes, bytes]], bytes | None]:
        """The request's method, target, headers and body, from ``state``; ``extra`` headers
        (the request id, ``traceparent``) go last. Raises :class:`TemplateError` for what the
        state cannot fill (nothing is sent)."""
        target = self._base + call.path.render_path(state)
        pairs: list[tuple[str, str]] = []
        for name, template in call.query:
            pairs.extend((name, value) for value in template.render_query(state, name))
        if pairs:
            target += "?" + urlencode(pairs)
        headers = dict(self._headers)
        if call.pass_headers:
            for name, value in passed_headers(state, call.pass_headers).items():
                headers[name] = (name, value)  # lower-case already
        if call.forward_headers is not None:
            for name, value in forwarded_headers(state, call.forward_headers).items():
                headers[name.lower()] = (name, value)
        for name, template in call.headers:
            rendered = template.render_header(state, name)
            if rendered is not None:
                problem = check_header_value(name, rendered)
                if problem is not None:
                    raise TemplateError(problem)
                headers[name.lower()] = (name, rendered)
        body: bytes | None = None
        if call.body is not None:
            try:
                body = json.dumps(
                    render_body(call.body, state), separators=(",", ":"), allow_nan=False
                ).encode()
            except (TypeError, ValueError) as exc:
                raise TemplateError(f"the body cannot be sent as JSON: {exc}") from None
            headers.setdefault("content-type", ("Content-Type", "application/json"))
        elif call.body_from is not None:
            body, content_type = raw_body(state, call.body_from)
            if content_type is not None:
                headers.setdefault("content-type", ("Content-Type", content_type))
        if extra:
            for name, value in extra.items():
                headers[name.lower()] = (name, value)
        for lowered, name, value in _DEFAULTS:
            headers.setdefault(lowered, (name, value))
        wire = [(b"Host", self._host)]
        wire += [(name.encode(), value.encode()) for name, value in headers.values()]
        if body is not None:
            wire.append((b"Content-Length", str(len(body)).encode()))
        elif call.method in ("POST", "PUT", "PATCH"):
            wire.append((b"Content-Length", b"0"))
        return call.method.encode(), target.encode("ascii"), wire, body

    async def call(
        self,
        call: HttpCall,
        state: Mapping[str, Any],
        deadline: float,
        extra: Mapping[str, str] | None = None,
    ) -> Any:
        """Make ``call`` by ``deadline`` (trio time); return the answer's body, decoded."""
        method, target, headers, body = self.prepare(call, state, extra)
        service = self.service
        try:
            answer = await self.pool.request(
                method,
                target,
                headers,
                body,
                deadline=deadline,
                max_bytes=service.max_response_bytes,
            )
        except ResponseTooLarge as exc:
            status = exc.status
        else:
            if answer.status not in call.accept:
                raise unaccepted(service, call, answer.status)
            return _decode(service, call, answer)
        # Raised out here, not in the handler: the error holds no ResponseTooLarge as its
        # context, nor the frames that one came through.
        if status not in call.accept:
            raise unaccepted(service, call, status)
        raise too_big(service, status)


def _decode(service: Service, call: HttpCall, answer: Answer) -> Any:
    content_type = answer.header(b"content-type")
    if call.raw:
        return raw_value(
            None if content_type is None else content_type.decode("latin-1"), answer.body
        )
    text = "" if content_type is None else content_type.decode("latin-1")
    return decode_answer(service, answer.status, text, answer.body)


def unaccepted(service: Service, call: HttpCall, status: int) -> BackendError:
    return BackendError(
        f"service {service.name!r} answered HTTP {status}; "
        f"the pipe accepts {call.describe_accept()}",
        service=service.name,
        status=status,
    )


def too_big(service: Service, status: int) -> BackendError:
    return BackendError(
        f"service {service.name!r} answered with more than {service.max_response_bytes} "
        "bytes (its max_response_bytes)",
        service=service.name,
        status=status,
    )


def decode_answer(service: Service, status: int, content_type: str, body: bytes) -> Any:
    """An answer's body as the pipe keeps it: None when empty, parsed JSON for a JSON media
    type, else text in the charset the Content-Type names (UTF-8 if none or unknown)."""
    if not body:
        return None
    media, _, params = content_type.partition(";")
    media = media.strip().lower()
    if media == "application/json" or media.endswith("+json"):
        try:
            return json.loads(body)
        except ValueError:
            raise BackendError(
                f"service {service.name!r} answered with invalid JSON",
                service=service.name,
                status=status,
            ) from None
    charset = "utf-8"
    for param in params.split(";"):
        key, _, value = param.partition("=")
        if key.strip().lower() == "charset" and value.strip(' "'):
            charset = value.strip(' "')
            break
    try:
        return body.decode(charset, errors="replace")
    except LookupError:
        return body.decode("utf-8", errors="replace")
