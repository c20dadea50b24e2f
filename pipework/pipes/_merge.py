"""Snapshot and merge: how parallel branches share a job's state without seeing each other.

Each branch runs on :func:`snapshot` of the parent's state, a deep copy. When it succeeds the
engine keeps only its :func:`delta`: the top-level keys it added, changed or removed. At the
join, :func:`merge` applies the deltas of the branches that count, in **declaration order**
(the engine sorts them so; completion order never matters), under a :class:`MergePolicy`.

A key one branch changed takes that branch's value. A key several branches changed is
combined by the key's rule (``strict`` unless the policy says otherwise):

``strict``   equal values are kept; different ones raise :class:`MergeConflict`. Removing a
             key counts as a value: a removal against a change is a conflict.
``first``    the first branch (declaration order) that changed the key wins; ``last``, the last.
``append``   each changing branch's new value becomes one item: the parent's list (``[]`` if
             absent) followed by one value per branch. For one result per branch
             (``state["price"] = 12``), not for branches that append to a list themselves.
``extend``   for a list every branch appends to: each branch's new list must start with the
             parent's list, and what follows is its additions. Result: the parent's list,
             then each branch's additions. A branch that edited existing items conflicts.
``sum``      for counters: the parent's number (``0`` if absent) plus each branch's change
             (its new number minus the parent's).
``update``   for dicts: the parent's dict (``{}`` if absent), then each branch's sub-key
             changes against it (set or removed) in order; on a shared sub-key, the later
             branch wins, as with ``dict.update``.
a function   ``fn(key, parent_value, changes)``: ``parent_value`` may be :data:`MISSING`,
             ``changes`` lists ``(branch, new value or MISSING)`` in declaration order; return
             the merged value, or :data:`MISSING` to remove the key.

Reducers apply even when one branch changed the key, so a rule means the same for any count.
A branch a reducer cannot combine (it removed the key, wrote the wrong type, or rewrote an
``extend`` list) raises :class:`MergeConflict` with a note saying why.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, TypeAlias, get_args

import msgpack

from .._errors import MergeConflict, RegistrationError
from ._state import check_value

__all__ = [
    "MISSING",
    "Delta",
    "MergeFunction",
    "MergePolicy",
    "MergeRule",
    "delta",
    "merge",
    "merge_strict",
    "packed_state",
    "same_value",
    "snapshot",
    "unpacked_state",
]


class _Missing(enum.Enum):
    MISSING = "MISSING"

    def __repr__(self) -> str:
        return "MISSING"


#: Stands for "no value": a key absent from the parent, or removed by a branch.
MISSING: Final = _Missing.MISSING

ReducerName: TypeAlias = Literal["strict", "first", "last", "append", "extend", "sum", "update"]
MergeFunction: TypeAlias = Callable[[str, Any, Sequence[tuple[str, Any]]], Any]
MergeRule: TypeAlias = ReducerName | MergeFunction
_NAMES: Final = frozenset(get_args(ReducerName))


def snapshot(state: dict[str, Any]) -> dict[str, Any]:
    """Return a deep copy of ``state``, the copy a branch works on.

    Raises :class:`StateError` naming the first value msgpack cannot store.
    """
    return unpacked_state(packed_state(state))


def packed_state(state: dict[str, Any]) -> bytes:
    """``state`` packed for :func:`unpacked_state` (several copies from one packing).

    Raises :class:`StateError` naming the first value msgpack cannot store.
    """
    try:
        return msgpack.packb(state)  # type: ignore[no-any-return]  # msgpack ships no types
    except (TypeError, ValueError, OverflowError):
        check_value(state, root="state")  # raises with the key path
        raise


def unpacked_state(packed: bytes) -> dict[str, Any]:
    """A fresh deep copy of the state :func:`packed_state` packed."""
    copy: dict[str, Any] = msgpack.unpackb(packed, strict_map_key=False)
    return copy


def same_value(a: Any, b: Any) -> bool:
    """Equal as msgpack would store them: ``1``, ``1.0`` and ``True`` differ, NaN equals NaN,
    a tuple equals the list it becomes."""
    if a is b:
        return True
    kind = type(a)
    if kind is type(b) and kind in _PLAIN:  # the common case: no NaN, no bool among ints
        return bool(a == b)
    kind = _kind(a)
    if kind is not _kind(b):
        return False
    if kind is dict:
        return len(a) == len(b) and all(k in b and same_value(v, b[k]) for k, v in a.items())
    if kind is list:
        return len(a) == len(b) and all(map(same_value, a, b))
    if kind is float:
        return bool(a == b or (math.isnan(a) and math.isnan(b)))
    return bool(a == b)


#: Types whose values msgpack stores as they compare: equal exactly when ``==`` says so.
_PLAIN: Final = frozenset({str, int, bytes, type(None)})


def _kind(value: Any) -> type:
    # Order matters: bool is an int subclass, and msgpack keeps the two apart.
    for kind in (bool, int, float, str, dict):
        if isinstance(value, kind):
            return kind
    if isinstance(value, list | tuple):
        return list
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes
    return type(value)


@dataclass(frozen=True, slots=True)
class Delta:
    """What one branch did to the top level of its snapshot.

    ``changed`` maps each key it added or changed to its new value; ``removed`` lists the
    keys it deleted, in the parent's key order.
    """

    changed: Mapping[str, Any] = field(default_factory=dict)
    removed: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.changed or self.removed)

    def value(self, key: str) -> Any:
        """The branch's new value for ``key``: :data:`MISSING` if it removed it."""
        return MISSING if key in self.removed else self.changed[key]

    @property
    def touched(self) -> tuple[str, ...]:
        """Every key the branch added, changed or removed."""
        return (*self.changed, *self.removed)

    def to_wire(self) -> dict[str, Any]:
        """A plain dict msgpack can store; :meth:`from_wire` reads it back."""
        return {"changed": dict(self.changed), "removed": list(self.removed)}

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any]) -> Delta:
        return cls(changed=dict(wire["changed"]), removed=tuple(wire["removed"]))


def delta(before: Mapping[str, Any], after: Mapping[str, Any]) -> Delta:
    """The top-level keys ``after`` added, changed or removed relative to ``before``."""
    changed = {k: v for k, v in after.items() if k not in before or not same_value(before[k], v)}
    if before.keys() <= after.keys():  # the common case: nothing removed
        return Delta(changed=changed)
    return Delta(changed=changed, removed=tuple([k for k in before if k not in after]))


@dataclass(frozen=True, slots=True)
class MergePolicy:
    """How :func:`merge` combines a key several branches changed.

    ``default`` is the rule for every key not named in ``keys``; a rule is a reducer name or a
    function (see the module docstring). ``MergePolicy(keys={"items": "extend"})`` merges
    ``items`` by extending and keeps every other key strict.
    """

    default: MergeRule = "strict"
    keys: Mapping[str, MergeRule] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # A private copy: a caller mutating its dict later must not bypass the check below.
        object.__setattr__(self, "keys", dict(self.keys))
        for key, rule in [("default", self.default), *self.keys.items()]:
            if not callable(rule) and not (isinstance(rule, str) and rule in _NAMES):
                raise RegistrationError(
                    f"unknown merge rule {rule!r} for {key!r}; use one of "
                    f"{', '.join(sorted(_NAMES))}, or a function"
                )

    def rule(self, key: str) -> MergeRule:
        return self.keys.get(key, self.default)

    @classmethod
    def of(cls, policy: MergePolicy | MergeRule | None) -> MergePolicy:
        """Accept a policy, a single rule for every key, or ``None`` for strict."""
        if policy is None:
            return cls()
        if isinstance(policy, Mapping):
            raise RegistrationError(
                f"merge={policy!r}: expected a MergePolicy, a rule name or a function; "
                "for rules per key write merge=MergePolicy(keys={...})"
            )
        return policy if isinstance(policy, MergePolicy) else cls(default=policy)


def merge(
    state: Mapping[str, Any],
    deltas: Sequence[tuple[str, Delta]],
    policy: MergePolicy | MergeRule | None = None,
    *,
    where: str = "",
) -> dict[str, Any]:
    """Apply ``(branch name, delta)`` pairs to ``state`` in the order given; return a new dict.

    ``state`` must be the state the branches' snapshots were taken from: reducers measure
    each branch's change against it. Inputs are not modified, but the result shares values
    with them (it is a shallow copy): drop the deltas afterwards. ``where`` (the stage path)
    goes into any :class:`MergeConflict`.
    """
    rules = policy if isinstance(policy, MergePolicy) else MergePolicy.of(policy)
    if rules.default == "strict" and not rules.keys:
        merged = merge_strict(state, deltas)
        if merged is not None:
            return merged
    touched: dict[str, list[tuple[str, Any]]] = {}
    for branch, d in deltas:
        if d.removed:
            for key in d.touched:
                touched.setdefault(key, []).append((branch, d.value(key)))
            continue
        for key, value in d.changed.items():
            changes = touched.get(key)
            if changes is None:
                touched[key] = [(branch, value)]
            else:
                changes.append((branch, value))
    merged = dict(state)
    for key, changes in touched.items():
        rule = rules.rule(key)
        parent = state.get(key, MISSING)
        if callable(rule):
            value = rule(key, parent, changes)
        else:
            value = _REDUCERS[rule](key, parent, changes, where)
        if value is MISSING:
            merged.pop(key, None)
        else:
            merged[key] = value
    return merged


def merge_strict(
    state: Mapping[str, Any], deltas: Sequence[tuple[str, Delta]]
) -> dict[str, Any] | None:
    """:func:`merge` when every key is strict and no branch removed a key (most stages):
    each key takes the first branch's value, with no list of changes per key. None when a
    removal or two branches that disagree need the general path (which raises the same
    :class:`MergeConflict` it always does)."""
    first: dict[str, Any] = {}
    for _, d in deltas:
        if d.removed:
            return None
        for key, value in d.changed.items():
            if key not in first:
                first[key] = value
            elif not same_value(first[key], value):
                return None
    merged = dict(state)
    merged.update(first)
    return merged


_Changes: TypeAlias = list[tuple[str, Any]]


def _refuse(key: str, changes: _Changes, where: str, why: str) -> MergeConflict:
    error = MergeConflict(key, tuple(branch for branch, _ in changes), where)
    error.add_note(why)
    return error


def _strict(key: str, parent: Any, changes: _Changes, where: str) -> Any:
    first = changes[0][1]
    if all(same_value(first, value) for _, value in changes[1:]):
        return first
    raise MergeConflict(key, tuple(branch for branch, _ in changes), where)


def _append(key: str, parent: Any, changes: _Changes, where: str) -> Any:
    base = _base(key, parent, changes, where, "append", list, [])
    for branch, value in changes:
        if value is MISSING:
            raise _refuse(key, [(branch, value)], where, "merge rule 'append': it removed the key")
    return [*base, *(value for _, value in changes)]


def _extend(key: str, parent: Any, changes: _Changes, where: str) -> Any:
    base = _base(key, parent, changes, where, "extend", list, [])
    merged = list(base)
    for branch, value in changes:
        if not isinstance(value, list) or not same_value(value[: len(base)], base):
            raise _refuse(
                key,
                [(branch, value)],
                where,
                "merge rule 'extend': the branch must only add items after the parent's list "
                "(it removed the key, replaced the list, or changed existing items)",
            )
        merged.extend(value[len(base) :])
    return merged


def _sum(key: str, parent: Any, changes: _Changes, where: str) -> Any:
    base = _base(key, parent, changes, where, "sum", int | float, 0)
    total = base
    for branch, value in changes:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _refuse(
                key,
                [(branch, value)],
                where,
                "merge rule 'sum': the branch's value is not a number",
            )
        total += value - base
    return total


def _update(key: str, parent: Any, changes: _Changes, where: str) -> Any:
    base = _base(key, parent, changes, where, "update", dict, {})
    merged = dict(base)
    for branch, value in changes:
        if not isinstance(value, dict):
            raise _refuse(
                key,
                [(branch, value)],
                where,
                "merge rule 'update': the branch's value is not a dict",
            )
        inner = delta(base, value)
        merged.update(inner.changed)
        for sub in inner.removed:
            merged.pop(sub, None)
    return merged


def _base(
    key: str, parent: Any, changes: _Changes, where: str, rule: str, kind: Any, empty: Any
) -> Any:
    """The parent's value a reducer starts from, checked against the type it needs."""
    if parent is MISSING:
        return empty
    if isinstance(parent, bool) or not isinstance(parent, kind):
        raise _refuse(
            key,
            changes,
            where,
            f"merge rule {rule!r}: the parent's value is a "
            f"{type(parent).__name__}, not a {getattr(kind, '__name__', 'number')}",
        )
    return parent


_REDUCERS: Final[dict[str, Callable[[str, Any, _Changes, str], Any]]] = {
    "strict": _strict,
    "first": lambda key, parent, changes, where: changes[0][1],
    "last": lambda key, parent, changes, where: changes[-1][1],
    "append": _append,
    "extend": _extend,
    "sum": _sum,
    "update": _update,
}
