"""The TLS context of an ``https://`` service's connections (:func:`client_context`), from
its PEM files, loaded by :mod:`pipework._tls` so that a file that cannot be used raises
:class:`~pipework._tls.TlsFileError` naming its setting (``ca_bundle``, ``client_key``...).
"""

from __future__ import annotations

import functools
import ssl
from typing import Final

from .._tls import TlsFileError, load_cas, load_chain

__all__ = ["CLIENT_ALPN", "TlsFileError", "client_context"]

#: What the lean client speaks: ALPN says so, so that a server offering HTTP/2 first
#: does not pick it (RFC 7301).
CLIENT_ALPN: Final = ("http/1.1",)


def client_context(
    *,
    ca_bundle: str | None = None,
    client_cert: str | None = None,
    client_key: str | None = None,
    verify: bool = True,
) -> ssl.SSLContext:
    """The context of an ``https://`` service's connections: the server's certificate
    checked against ``ca_bundle`` (the system's CAs without it) and its name, unless
    ``verify`` is false; ``client_cert`` and ``client_key`` presented when asked (mutual
    TLS). Raises :class:`TlsFileError`, having read the named files first.

    Loading the system's CAs costs a quarter of a second on a busy machine, so it is done
    only when they are trusted: once per process for the services that name no file (they
    share that context), else for each context that needs them, after its own files."""
    if ca_bundle is None and client_cert is None and verify:
        return _system_context()
    context = _bare_context()
    if ca_bundle is not None:
        # Only the bundle's CAs: a private CA is the point of giving one.
        load_cas(context, "ca_bundle", ca_bundle)
    if not verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    if client_cert is not None and client_key is not None:
        load_chain(context, ("client_cert", client_cert), ("client_key", client_key))
    if ca_bundle is None and verify:
        context.load_default_certs(ssl.Purpose.SERVER_AUTH)
    return context


def _bare_context() -> ssl.SSLContext:
    """A client context that checks the server's certificate and name (against no CA yet)
    as ``ssl.create_default_context`` sets one up, without loading the system's CAs."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(list(CLIENT_ALPN))
    return context


@functools.cache
def _system_context() -> ssl.SSLContext:
    """The context of every service trusting the system's CAs with no file of its own:
    one per process (a context serves any number of connections)."""
    context = _bare_context()
    context.load_default_certs(ssl.Purpose.SERVER_AUTH)
    return context
