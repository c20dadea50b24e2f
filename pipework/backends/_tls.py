"""The TLS context of an ``https://`` service's connections (:func:`client_context`), from
its PEM files, loaded by :mod:`pipework._tls` so that a file that cannot be used raises
:class:`~pipework._tls.TlsFileError` naming its setting (``ca_bundle``, ``client_key``...).
"""

from __future__ import annotations

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
    TLS). Raises :class:`TlsFileError`."""
    context = ssl.create_default_context()
    if ca_bundle is not None:
        # Only the bundle's CAs: a private CA is the point of giving one.
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        load_cas(context, "ca_bundle", ca_bundle)
    if not verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    if client_cert is not None and client_key is not None:
        load_chain(context, ("client_cert", client_cert), ("client_key", client_key))
    context.set_alpn_protocols(list(CLIENT_ALPN))
    return context
