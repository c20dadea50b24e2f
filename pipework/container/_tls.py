"""The server's TLS: its certificate, its key and (for mutual TLS) the CA its clients'
certificates must chain to, loaded into one :class:`ssl.SSLContext` that hypercorn serves
with, and swapped for new files without dropping a connection (:class:`CertificateSwitch`).

How the swap works: hypercorn wraps its listening socket in a ``trio.SSLListener`` with the
one context it was given, for good. That context's ``sni_callback`` runs on every new
connection's ClientHello -- with or without SNI in it (``server_name`` None) -- and moves
the connection onto the context in force (``SSLObject.context``), whose certificate, key
and CA store it then uses. A connection already open keeps the context it shook hands with
(OpenSSL copies the certificate into each connection), so it goes on as it was. Loading a
new chain into the live context instead (``load_cert_chain`` on it) would also reach only
new connections, but it cannot drop a client CA, and a key that does not match its
certificate would leave the live context half-changed; a context built whole, and only then
put in force, can fail without touching what serves.

What cannot change by a swap: whether client certificates are asked for, and whether they
are required -- OpenSSL sets a connection's verify mode from the context it was accepted
on, before the callback runs. Those need a restart (the reload says so).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from typing import Final, Literal

from .._tls import load_cas, load_chain

__all__ = ["ALPN", "CLIENT_AUTH", "CertificateSwitch", "ClientAuth", "ServerTls", "server_context"]

ClientAuth = Literal["required", "optional"]
CLIENT_AUTH: Final = ("required", "optional")
#: Offered in this order: HTTP/2 to a client that speaks it, else HTTP/1.1 (hypercorn
#: serves both on one socket; RFC 7540 §3.3).
ALPN: Final = ("h2", "http/1.1")


@dataclass(frozen=True, slots=True)
class ServerTls:
    """``[server] tls_cert``, ``tls_key``, ``tls_client_ca``, ``tls_client_auth``: file
    paths (PEM), as given (relative ones from the working directory), and whether a client
    certificate is ``required`` or ``optional`` when ``client_ca`` is set."""

    cert: str
    key: str
    client_ca: str | None = None
    client_auth: ClientAuth = "required"

    def verify_mode(self) -> ssl.VerifyMode:
        if self.client_ca is None:
            return ssl.CERT_NONE
        return ssl.CERT_REQUIRED if self.client_auth == "required" else ssl.CERT_OPTIONAL


def server_context(tls: ServerTls) -> ssl.SSLContext:
    """A server context of ``tls``'s files, checked: raises
    :class:`~pipework._tls.TlsFileError` for a file that cannot be read, does not
    parse, or holds a key that is not the certificate's. TLS 1.2 at least, no compression,
    ALPN ``h2`` then ``http/1.1`` (as hypercorn's own context)."""
    # Not ssl.create_default_context(CLIENT_AUTH): it would trust the system's CAs for
    # client certificates, so any publicly issued one would pass mutual TLS. The bare
    # context's defaults are as safe otherwise (no compression, server cipher preference).
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2  # RFC 7540 §9.2
    context.options |= ssl.OP_NO_COMPRESSION  # RFC 7540 §9.2.1
    context.set_alpn_protocols(list(ALPN))
    load_chain(context, ("tls_cert", tls.cert), ("tls_key", tls.key))
    if tls.client_ca is not None:
        load_cas(context, "tls_client_ca", tls.client_ca)
        context.verify_mode = tls.verify_mode()
    return context


class CertificateSwitch:
    """The context hypercorn serves with (:attr:`context`), and the one in force for new
    connections, swapped by :meth:`use` (see the module's docstring)."""

    __slots__ = ("_current", "context", "tls")

    def __init__(self, tls: ServerTls) -> None:
        self.tls = tls
        self.context = server_context(tls)
        self._current = self.context
        self.context.sni_callback = self._choose

    def restart_needed(self, tls: ServerTls) -> str | None:
        """Why ``tls`` cannot be put in force by a swap, or None if it can."""
        if tls.verify_mode() != self.tls.verify_mode():
            return (
                "whether client certificates are asked for (tls_client_ca) or required "
                "(tls_client_auth) changes only at a restart"
            )
        return None

    def use(self, tls: ServerTls, context: ssl.SSLContext) -> None:
        """Put ``context`` (:func:`server_context` of ``tls``) in force for new connections;
        those open keep theirs."""
        self._current, self.tls = context, tls

    def _choose(self, connection: ssl.SSLObject, server_name: str | None, _: object) -> None:
        if self._current is not self.context:
            connection.context = self._current
