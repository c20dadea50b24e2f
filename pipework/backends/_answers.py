"""What a service's answer is to the call that asked for it: the value a pipe keeps (JSON
parsed, text decoded with its charset, a raw call's bytes kept with their content type), or
the :class:`~pipework.BackendError` of an answer the call does not take (a status it does
not accept, more than ``max_response_bytes``), the :class:`~pipework.Overloaded` of a call
the service's core refused, and what a pool's failure says about the host it went to.

Separate from the client (:mod:`._client`): both clients read answers by these rules (the
httpx path in :mod:`._http` too), and none of it does I/O.
"""

from __future__ import annotations

import json
from typing import Any

from .._errors import BackendError, Overloaded
from ..pipes._state import raw_value
from ._call_core import Refusal
from ._failures import CallTimeout, ConnectFailed, ConnectionBroken, TransportFailure
from ._h1 import Answer, StaleConnection
from ._http_spec import HttpCall, Service
from ._outlier_core import Failure

__all__ = ["decode", "decode_answer", "failure_of", "refused", "too_big", "unaccepted"]


def failure_of(exc: TransportFailure) -> Failure:
    """What a pool's failure says about the host (see :class:`Failure`)."""
    if isinstance(exc, ConnectFailed):
        return Failure.CONNECT
    if isinstance(exc, CallTimeout):
        return Failure.CONNECT if exc.phase == "connect" else Failure.TIMEOUT
    if isinstance(exc, ConnectionBroken) and isinstance(exc.__cause__, StaleConnection):
        return Failure.RESET  # closed before any byte of the answer
    return Failure.BROKEN


def refused(service: Service, refusal: Refusal) -> Overloaded:
    """The error of a call the service's core refused: 503 with ``Retry-After``."""
    return Overloaded(
        f"{refusal.message} (retry after {refusal.retry_after:g} s)",
        reason=refusal.reason,
        retry_after=refusal.retry_after,
        service=service.name,
    )


def decode(service: Service, call: HttpCall, answer: Answer) -> Any:
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
