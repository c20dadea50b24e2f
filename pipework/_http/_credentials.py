"""Credentials a request brings: the bearer token it names, and whether a secret matches.

One place for both, so every API that takes a token (admin, boards, jobs) reads and
compares it alike. A header value reaches a handler as text decoded from Latin-1, a query
value as text decoded from UTF-8: either may hold any character. ``hmac.compare_digest``
refuses text with a character outside ASCII (a ``TypeError``: a 500), so secrets are
compared as UTF-8 bytes; a credential that is not the secret, however malformed, is then
simply not the secret, and the caller answers it as any wrong one.
"""

from __future__ import annotations

import hmac
from typing import Final

__all__ = ["bearer_token", "same_secret"]

_BEARER: Final = "bearer "


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` value (the scheme in any case);
    None for no value or another scheme."""
    if authorization is None or authorization[: len(_BEARER)].lower() != _BEARER:
        return None
    return authorization[len(_BEARER) :].strip()


def same_secret(given: str | None, expected: str | None) -> bool:
    """Whether ``given`` (from a request) is ``expected``, in time that does not depend on
    where they differ. False when either is None; never raises for any text."""
    if given is None or expected is None:
        return False
    return hmac.compare_digest(_utf8(given), _utf8(expected))


def _utf8(text: str) -> bytes:
    # surrogatepass: a lone surrogate (text decoded with surrogateescape, say) is still
    # bytes to compare, not an error.
    return text.encode("utf-8", "surrogatepass")
