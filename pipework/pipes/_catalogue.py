"""The catalogue: pipes and chains by name, checked when they are registered.

It sits in ``pipes`` so that the dispatcher can make one without knowing of routes, the
gateway file or HTTP; see the Layers section of docs/design.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, overload

from .._errors import RegistrationError
from ._pipe import Pipe, PipeFunction, is_seconds
from ._stages import Chain, Serial, StageItem, check_unmarked, resolve

__all__ = ["Catalogue"]


class Catalogue:
    """Pipes and chains by name: what an :class:`~pipework.Engine` runs jobs on.

    ``@catalogue.pipe`` registers a pipe; ``catalogue.chain(name, ...)`` resolves pipe names
    at once, so an unknown name fails here, not when a job reaches it. The dispatcher only
    looks chains up (``get_chain``); :class:`pipework.Registry` adds HTTP routes on top.
    """

    def __init__(self) -> None:
        self._pipes: dict[str, Pipe] = {}
        self._chains: dict[str, Chain] = {}

    @overload
    def pipe(self, fn: PipeFunction, /) -> Pipe: ...

    @overload
    def pipe(
        self,
        fn: None = None,
        /,
        *,
        name: str | None = None,
        key: str | None = None,
        timeout: float | None = None,
        blocking: bool = False,
        optional: bool = False,
        fallback: Mapping[str, Any] | Pipe | None = None,
    ) -> Callable[[PipeFunction], Pipe]: ...

    def pipe(
        self,
        fn: PipeFunction | None = None,
        /,
        *,
        name: str | None = None,
        key: str | None = None,
        timeout: float | None = None,
        blocking: bool = False,
        optional: bool = False,
        fallback: Mapping[str, Any] | Pipe | None = None,
    ) -> Pipe | Callable[[PipeFunction], Pipe]:
        """Register a pipe; usable as ``@catalogue.pipe`` or ``@catalogue.pipe(key=...)``.
        ``optional`` and ``fallback``: see :class:`Pipe`."""

        def register(function: PipeFunction) -> Pipe:
            pipe = Pipe(
                function,
                name or function.__name__,
                key,
                timeout,
                blocking,
                optional=optional,
                fallback=fallback,
            )
            self.add_pipe(pipe)
            return pipe

        return register(fn) if fn is not None else register

    def add_pipe(self, pipe: Pipe) -> Pipe:
        if pipe.name in self._pipes and self._pipes[pipe.name] is not pipe:
            raise RegistrationError(f"a pipe named {pipe.name!r} is already registered")
        self._pipes[pipe.name] = pipe
        return pipe

    def get_pipe(self, name: str) -> Pipe:
        try:
            return self._pipes[name]
        except KeyError:
            known = ", ".join(sorted(self._pipes)) or "none"
            raise RegistrationError(f"unknown pipe {name!r} (registered: {known})") from None

    def chain(
        self,
        name: str,
        *items: StageItem,
        timeout: float | None = None,
        key: str = "default",
        result: str | None = None,
    ) -> Chain:
        """Register a chain: ``items`` run in order (a single stage may be passed as is)."""
        if not isinstance(name, str) or not name:
            raise RegistrationError(f"a chain's name must be a non-empty string, got {name!r}")
        if name in self._chains:
            raise RegistrationError(f"a chain named {name!r} is already registered")
        if not items:
            raise RegistrationError(f"chain {name!r} needs at least one pipe or stage")
        if timeout is not None and not is_seconds(timeout):
            raise RegistrationError(
                f"chain {name!r}: timeout must be a positive number of seconds or None, "
                f"got {timeout!r}"
            )
        if not isinstance(key, str) or not key:
            raise RegistrationError(
                f"chain {name!r}: key (the admission key of its pipes without one) must be a "
                f"non-empty string, got {key!r}"
            )
        if result is not None and not isinstance(result, str):
            raise RegistrationError(
                f"chain {name!r}: result must name a state key (a string) or be None, "
                f"got {result!r}"
            )
        for index, item in enumerate(items):
            check_unmarked(f"chain {name!r}", f"item {index}", item)
        root_item = items[0] if len(items) == 1 and isinstance(items[0], Serial) else Serial(items)
        root = resolve(root_item, self.get_pipe)
        assert isinstance(root, Serial)
        chain = Chain(name, root, timeout, key, result)
        self._chains[name] = chain
        return chain

    def get_chain(self, name: str) -> Chain:
        try:
            return self._chains[name]
        except KeyError:
            known = ", ".join(sorted(self._chains)) or "none"
            raise RegistrationError(f"unknown chain {name!r} (registered: {known})") from None

    @property
    def chains(self) -> dict[str, Chain]:
        return dict(self._chains)

    @property
    def pipes(self) -> dict[str, Pipe]:
        return dict(self._pipes)
