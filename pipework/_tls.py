"""PEM files loaded into a TLS context, checked so that a problem names the setting it came
from: the server's (:mod:`pipework.container._tls`) and each ``https://`` service's
(:mod:`pipework.backends._tls`) contexts load theirs here.

A file that cannot be read, does not parse, or holds a key that is not its certificate's
raises :class:`TlsFileError` with the setting's name (``tls_key``, ``client_cert``...) and
what to do; ``pipework check`` reports it at that key, a reload refuses it.
"""

from __future__ import annotations

import ssl

__all__ = ["TlsFileError", "load_cas", "load_chain"]


class TlsFileError(ValueError):
    """A TLS file that cannot be used; ``key`` names the setting that gave it."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message


def _no_password() -> str:
    # An encrypted key would otherwise make OpenSSL prompt on the terminal, and wait.
    return ""


def _readable(key: str, path: str) -> None:
    try:
        with open(path, "rb") as file:
            file.read(1)
    except OSError as exc:
        raise TlsFileError(key, f"cannot read {path!r}: {exc.strerror or exc}") from None


def load_cas(context: ssl.SSLContext, key: str, path: str) -> None:
    """Trust the certificates of PEM file ``path`` (setting ``key``) in ``context``."""
    _readable(key, path)
    try:
        context.load_verify_locations(cafile=path)
    except ssl.SSLError as exc:
        raise TlsFileError(
            key, f"{path!r} holds no PEM certificate that could be read ({exc.reason or exc})"
        ) from None


def load_chain(context: ssl.SSLContext, cert: tuple[str, str], key: tuple[str, str]) -> None:
    """Load a certificate chain and its private key into ``context``: ``cert`` and ``key``
    are each (setting, path)."""
    (cert_key, cert_path), (key_key, key_path) = cert, key
    _readable(cert_key, cert_path)
    _readable(key_key, key_path)
    scratch = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        scratch.load_verify_locations(cafile=cert_path)
    except ssl.SSLError as exc:
        raise TlsFileError(
            cert_key,
            f"{cert_path!r} holds no PEM certificate that could be read ({exc.reason or exc})",
        ) from None
    try:
        context.load_cert_chain(cert_path, key_path, password=_no_password)
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise TlsFileError(
                key_key,
                f"the key in {key_path!r} is not the key of the certificate in "
                f"{cert_path!r}: give the pair issued together",
            ) from None
        raise TlsFileError(
            key_key,
            f"{key_path!r} holds no PEM private key that could be read ({exc.reason or exc}); "
            "an encrypted key is not supported: decrypt it, and keep the file private",
        ) from None
