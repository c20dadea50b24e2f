"""The lean client of one ``http://`` or ``https://`` service: an :class:`HttpCall`
rendered straight to h11's request parts and sent through a keep-alive
:class:`~._pool.Pool` per host (TLS under it for ``https://``), each try chosen, retried or
hedged by the service's resilience core (:mod:`._hosts_core`).

It builds the same request the httpx path builds (same target, query encoding, headers and
JSON body; ``Accept-Encoding: gzip, deflate``) without httpx's request and URL models,
which cost more than the exchange itself, and reads the answer with the same rules: the
status checked against ``accept``, ``max_response_bytes`` counted on the decoded body,
JSON parsed, other text decoded with its charset (or, for a raw call, its bytes kept with
their content type). What fails is raised as the same
:class:`~pipework.BackendError` texts, or as the lean client's own exceptions
(:mod:`._failures`) for the caller to translate.

**The driver of the resilience core.** A call begins with :meth:`ServiceCore.begin`: a
refusal (the breaker open, every host drained) raises :class:`~pipework.Overloaded` (503
with ``Retry-After``) before anything is sent. Its tries then go to the hosts the core picks
(:mod:`._client_tries`: retries, hedges). The call's result is its answering try's: the
answer decoded, or that try's failure raised as it came from the pool.

**Where the rest is.** :class:`ServiceClient` is this module's request and call over the
client's parts, each a module of its own: its hosts and their pools (:mod:`._client_hosts`),
the tries of a call (:mod:`._client_tries`), active health checks (:mod:`._client_health`),
the proxy's streamed exchanges and websockets (:mod:`._client_proxy`), and how an answer
is read (:mod:`._answers`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final
from urllib.parse import urlencode

import trio

from ._answers import decode, refused, too_big, unaccepted
from ._call_core import Refusal
from ._client_health import HealthChecks
from ._client_proxy import ProxyCalls
from ._client_tries import CallNote, Tries, TryEnd
from ._h1 import ACCEPT_ENCODING
from ._http_spec import (
    HttpCall,
    check_header_value,
    forwarded_headers,
    passed_headers,
    raw_body,
)
from ._http_template import TemplateError, render_body

__all__ = ["ServiceClient"]

_DEFAULTS: Final = (
    ("accept", "Accept", "*/*"),
    ("accept-encoding", "Accept-Encoding", ACCEPT_ENCODING.decode()),
)


class ServiceClient(ProxyCalls, Tries, HealthChecks):
    """Calls to one ``http://`` or ``https://`` service: a pool per host, each sized by its
    :class:`Service`, and the service's resilience core choosing the hosts. ``pool``
    replaces the pool of a one-host service (tests); ``core`` is one a reload carries over
    (:meth:`ServiceCore.reconfigure` is applied to it); ``rng`` seeds a new core."""

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
        note: CallNote | None = None,
    ) -> Any:
        """Make ``call`` by ``deadline`` (trio time); return the answer's body, decoded.
        Raises :class:`~pipework.Overloaded` when the core refuses the call, the
        answering try's failure (:mod:`._failures`) when it had no answer. ``note`` is
        told the answering try's host and the retries."""
        request = self.prepare(call, state, extra)
        core = self.core
        begun = core.begin(trio.current_time(), method=call.method, deadline=deadline)
        if isinstance(begun, Refusal):
            self.report()
            raise refused(self.service, begun)
        note = note or CallNote()
        try:
            done = await self._drive(begun, request, note)
        finally:
            begun.end(trio.current_time())
            self.report()
        note.host = done.host
        return self._result(call, done)

    def _result(self, call: HttpCall, done: TryEnd) -> Any:
        if done.failure is not None:
            raise done.failure
        status = done.outcome.status
        assert status is not None
        if status not in call.accept:
            raise unaccepted(self.service, call, status)
        if done.answer is None:
            raise too_big(self.service, status)
        return decode(self.service, call, done.answer)
