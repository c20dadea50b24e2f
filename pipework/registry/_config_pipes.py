"""The ``[pipes.NAME]`` section: built-in HTTP calls and Python functions."""

from __future__ import annotations

import importlib
import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Final, TypeAlias

from .._errors import RegistrationError
from ..backends._http import Backends, http_pipe
from ..backends._http_spec import (
    DEFAULT_ACCEPT,
    METHODS,
    HttpCall,
    check_header_name,
    check_pass_header,
)
from ..backends._http_template import Template, TemplateSyntaxError
from ..pipes._pipe import Pipe, PipeFunction, RequestUse
from ._config_problems import Collector, KeyPath, close_match, describe_value
from ._config_read import Table, check_name, open_table

__all__ = ["HttpPipeConfig", "PipeConfig", "PythonPipeConfig", "read_pipes"]

HTTP_KEYS: Final = (
    "service",
    "method",
    "path",
    "query",
    "headers",
    "body",
    "forward_headers",
    "pass_headers",
    "body_from",
    "into",
    "raw",
    "accept",
    "key",
    "timeout",
)
PYTHON_KEYS: Final = ("python", "key", "timeout", "blocking")
_IDENT: Final = r"[A-Za-z_][A-Za-z0-9_]*"
_REF: Final = re.compile(rf"({_IDENT}(?:\.{_IDENT})*):({_IDENT}(?:\.{_IDENT})*)\Z")
_STATUS_CLASS: Final = re.compile(r"[1-5]xx\Z")


@dataclass(frozen=True, slots=True)
class HttpPipeConfig:
    """A pipe that calls a service (``[pipes.NAME]`` with ``service = ...``)."""

    name: str
    call: HttpCall
    key: str
    timeout: float | None = None

    def build(self, backends: Backends) -> Pipe:
        return http_pipe(self.name, self.call, backends, key=self.key, timeout=self.timeout)

    @property
    def request_use(self) -> RequestUse | None:
        return self.call.request_use

    def describe(self) -> str:
        return f"{self.call.method} {self.call.service} {self.call.path.text}"


@dataclass(frozen=True, slots=True)
class PythonPipeConfig:
    """A pipe that runs a Python function (``[pipes.NAME]`` with ``python = "mod:fn"``)."""

    name: str
    ref: str
    function: PipeFunction
    key: str | None = None
    timeout: float | None = None
    blocking: bool = False

    def build(self, backends: Backends) -> Pipe:
        return Pipe(self.function, self.name, self.key, self.timeout, self.blocking)

    @property
    def request_use(self) -> RequestUse | None:
        return None

    def describe(self) -> str:
        return f"python {self.ref}"


PipeConfig: TypeAlias = HttpPipeConfig | PythonPipeConfig


def read_pipes(c: Collector, value: Any, services: Collection[str]) -> dict[str, PipeConfig]:
    """Every pipe that reads without errors (the others are reported)."""
    path: KeyPath = ("pipes",)
    if value is None:
        return {}
    if not isinstance(value, dict):
        c.error(path, "expected a table of pipes, one [pipes.NAME] each")
        return {}
    pipes: dict[str, PipeConfig] = {}
    for name, spec in value.items():
        where = (*path, name)
        if not check_name(c, where, name, "pipe"):
            continue
        pipe: PipeConfig | None = None
        if not isinstance(spec, dict):
            c.error(where, f"expected a table, got {describe_value(spec)}")
        elif "python" in spec and "service" in spec:
            c.error(where, "set service (an HTTP call) or python (a function), not both")
        elif "python" in spec:
            t = open_table(
                c, where, spec, PYTHON_KEYS, hint="a python pipe takes " + _list(PYTHON_KEYS)
            )
            pipe = _python_pipe(name, t) if t is not None else None
        elif "service" in spec:
            t = open_table(c, where, spec, HTTP_KEYS, hint="an HTTP pipe takes " + _list(HTTP_KEYS))
            pipe = _http_pipe(name, t, services) if t is not None else None
        else:
            c.error(where, "set service (a built-in HTTP call) or python (a function)")
        if pipe is not None and not c.failed(where):
            pipes[name] = pipe
    return pipes


def _list(keys: tuple[str, ...]) -> str:
    return ", ".join(keys)


def _http_pipe(name: str, t: Table, services: Collection[str]) -> HttpPipeConfig | None:
    c = t.c
    service = t.string("service", None, required=True)
    if service is not None and service not in services:
        guess = close_match(service, services)
        also = f"did you mean {guess!r}?" if guess else f"declared: {', '.join(services) or 'none'}"
        c.error(t.at("service"), f"unknown service {service!r}; {also}")
    method = t.string("method", "GET").upper()
    if method not in METHODS:
        c.error(t.at("method"), f"unknown method {method!r}; expected one of: {', '.join(METHODS)}")
    path = _template(t, "path", t.string("path", None, required=True), path=True)
    query = [(k, _template(t, ("query", k), v)) for k, v in t.string_table("query").items()]
    headers = []
    for header, text in t.string_table("headers").items():
        problem = check_header_name(header)
        if problem is not None:
            c.error((*t.at("headers"), header), problem)
        headers.append((header, _template(t, ("headers", header), text)))
    body = _body(c, t.at("body"), t.data["body"]) if "body" in t else None
    into = _into(t, name)
    accept = _accept(t)
    key = t.string("key", service or name)
    timeout = t.number("timeout", None)
    forward = t.string("forward_headers", None)
    passing = _pass_headers(t)
    body_from = t.string("body_from", None)
    if body_from is not None and "body" in t:
        c.error(
            t.at("body_from"),
            "set body (a JSON body) or body_from (a raw one: the request's, or a state key's), "
            "not both",
        )
    raw = t.boolean("raw", False)
    if raw and into is None and "into" in t:
        c.error(t.at("raw"), "raw = true keeps the answer's bytes, but into = false keeps nothing")
    if c.failed(t.path) or service is None or path is None:
        return None
    call = HttpCall(
        service,
        path,
        method,
        tuple((k, v) for k, v in query if v is not None),
        tuple((k, v) for k, v in headers if v is not None),
        body,
        forward,
        into,
        accept,
        passing,
        body_from,
        raw,
    )
    return HttpPipeConfig(name, call, key, timeout)


def _pass_headers(t: Table) -> frozenset[str]:
    """The header names of ``pass_headers``, lower-case; each problem at its index."""
    if "pass_headers" not in t:
        return frozenset()
    value = t.data["pass_headers"]
    if not isinstance(value, list):
        t.c.error(
            t.at("pass_headers"),
            'expected an array of header names (["X-Tenant", "Authorization"], or "*" for '
            f"every end-to-end one), got {describe_value(value)}",
        )
        return frozenset()
    names: set[str] = set()
    for i, item in enumerate(value):
        where = (*t.at("pass_headers"), i)
        if not isinstance(item, str):
            t.c.error(where, f"expected a header name, got {describe_value(item)}")
            continue
        problem = check_pass_header(item)
        if problem is not None:
            t.c.error(where, problem)
        elif item.lower() in names:
            t.c.warn(where, f"{item!r} is named twice (header names are case-insensitive)")
        names.add(item.lower())
    return frozenset(names)


def _template(
    t: Table, key: str | tuple[str, str], text: str | None, *, path: bool = False
) -> Template | None:
    if text is None:
        return None
    where = t.at(key) if isinstance(key, str) else (*t.path, *key)
    try:
        return Template.parse_path(text) if path else Template.parse(text)
    except TemplateSyntaxError as exc:
        t.c.error(where, str(exc))
        return None


def _body(c: Collector, path: KeyPath, value: Any) -> Any:
    """The body with each string parsed as a template; problems reported at their path."""
    if isinstance(value, str):
        try:
            return Template.parse(value)
        except TemplateSyntaxError as exc:
            c.error(path, str(exc))
            return None
    if isinstance(value, dict):
        return {k: _body(c, (*path, k), v) for k, v in value.items()}
    if isinstance(value, list):
        return [_body(c, (*path, i), v) for i, v in enumerate(value)]
    if isinstance(value, bool | int | float):
        return value
    c.error(path, f"{describe_value(value)} cannot be sent as JSON; quote it as a string")
    return None


def _into(t: Table, name: str) -> str | None:
    value = t.data.get("into", name)
    if value is False:
        return None
    if not isinstance(value, str) or not value:
        t.c.error(t.at("into"), f"expected a state key or false, got {describe_value(value)}")
        return None
    return value


def _accept(t: Table) -> frozenset[int]:
    if "accept" not in t:
        return DEFAULT_ACCEPT
    value = t.data["accept"]
    if not isinstance(value, list) or not value:
        t.c.error(t.at("accept"), 'expected a non-empty array of statuses (200, "2xx", ...)')
        return DEFAULT_ACCEPT
    statuses: set[int] = set()
    for i, item in enumerate(value):
        if isinstance(item, str) and _STATUS_CLASS.match(item):
            start = int(item[0]) * 100
            statuses.update(range(start, start + 100))
        elif isinstance(item, int) and not isinstance(item, bool) and 100 <= item <= 599:
            statuses.add(item)
        else:
            t.c.error(
                (*t.at("accept"), i),
                f'expected a status from 100 to 599 or a class like "2xx", '
                f"got {describe_value(item)}",
            )
    return frozenset(statuses) or DEFAULT_ACCEPT


def _python_pipe(name: str, t: Table) -> PythonPipeConfig | None:
    c = t.c
    ref = t.string("python", None, required=True)
    key = t.string("key", None)
    timeout = t.number("timeout", None)
    blocking = t.boolean("blocking", False)
    if ref is None:
        return None
    function = _import(c, t.at("python"), ref)
    if function is None:
        return None
    try:
        Pipe(function, name, key, timeout, blocking)
    except RegistrationError as exc:
        c.error(t.at("python"), str(exc))
        return None
    return PythonPipeConfig(name, ref, function, key, timeout, blocking)


def _import(c: Collector, path: KeyPath, ref: str) -> PipeFunction | None:
    match = _REF.match(ref)
    if match is None:
        c.error(path, f"{ref!r} is not an import path; write it as 'package.module:function'")
        return None
    module_name, attribute = match.groups()
    try:
        found: Any = importlib.import_module(module_name)
    except Exception as exc:  # a module's own import-time failure is the user's to see
        c.error(path, f"cannot import module {module_name!r}: {type(exc).__name__}: {exc}")
        return None
    for part in attribute.split("."):
        try:
            found = getattr(found, part)
        except AttributeError:
            c.error(path, f"module {module_name!r} has no attribute {attribute!r}")
            return None
    if isinstance(found, Pipe):
        found = found.fn
    if not callable(found):
        c.error(path, f"{ref!r} is {describe_value(found)}, not a function")
        return None
    function: PipeFunction = found
    return function
