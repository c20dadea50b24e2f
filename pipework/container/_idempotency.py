"""``Idempotency-Key``: a client retrying a submission gets the job it already started.

The table maps (route, key) to the job it started, with that job's token, for as long as
the job can still be read (its deadline plus the store's retention). A key is claimed
*before* the job is submitted, so two requests racing with one key start one job: the
second waits for the first to finish submitting. The table is bounded (least recently
used keys go first) and lives in this process.

A key is bound to a fingerprint of the request (method, path and the decoded input), so a
key reused for a different request is refused rather than answered with another
request's job and token. What a request does with a key already claimed is decided in
``_modes_core`` (:func:`~._modes_core.key_step`); this module keeps the table.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Final

import cachetools
import msgpack
import trio

__all__ = ["Claim", "IdempotencyTable", "fingerprint"]

# How long a claim may stay unbound (its submission is in flight) before it is dropped.
_PENDING_TTL: Final = 60.0


def fingerprint(method: str, path: str, state: dict[str, Any]) -> str:
    """A digest of the request that is independent of the order of map keys."""
    packed = msgpack.packb([method, path, _ordered(state)], use_bin_type=True)
    return hashlib.sha256(packed).hexdigest()


def _ordered(value: Any) -> Any:
    if isinstance(value, dict):
        return [[key, _ordered(value[key])] for key in sorted(value, key=repr)]
    if isinstance(value, list | tuple):
        return [_ordered(item) for item in value]
    return value


@dataclass(eq=False)
class Claim:
    """A key's entry: unbound (``job_id`` None) while its submission is in flight."""

    fingerprint: str
    token: str
    expires: float
    job_id: str | None = None
    settled: trio.Event = field(default_factory=trio.Event)


class IdempotencyTable:
    """At most ``max_keys`` keys; each lasts until its claim's ``expires`` (trio time)."""

    def __init__(self, max_keys: int = 10_000) -> None:
        if max_keys < 1:
            raise ValueError(f"max_keys must be at least 1, got {max_keys}")
        self._claims: cachetools.TLRUCache[str, Claim] = cachetools.TLRUCache(
            maxsize=max_keys, ttu=_until, timer=trio.current_time
        )

    def __len__(self) -> int:
        return len(self._claims)

    def get(self, key: str) -> Claim | None:
        return self._claims.get(key)

    def claim(self, key: str, fingerprint: str, token: str) -> Claim:
        """Claim ``key`` for a submission about to be made (the caller checked it is free)."""
        claim = Claim(fingerprint, token, trio.current_time() + _PENDING_TTL)
        self._claims[key] = claim
        return claim

    def bind(self, key: str, claim: Claim, job_id: str, expires: float) -> None:
        """The submission succeeded: the key now names ``job_id`` until ``expires``."""
        claim.job_id = job_id
        claim.expires = expires
        if self._claims.get(key) is claim:
            self._claims[key] = claim  # re-insert: the cache reads the expiry on insertion
        claim.settled.set()

    def forget(self, key: str, claim: Claim) -> None:
        """Drop ``claim`` (its submission failed, or its job is gone or was cancelled)."""
        if self._claims.get(key) is claim:
            del self._claims[key]
        claim.settled.set()


def _until(key: str, claim: Claim, now: float) -> float:
    return claim.expires
