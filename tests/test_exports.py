"""The public surface: exactly these names, each reporting ``pipework`` as its module, and
docs and examples that use nothing else."""

from __future__ import annotations

import argparse
import builtins
import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import pipework as pw
from pipework import _errors

ROOT = Path(__file__).resolve().parent.parent

PUBLIC = [
    "MISSING",
    "Adaptive",
    "Admission",
    "BackendError",
    "BackendUnreachable",
    "Backends",
    "BorrowTimeout",
    "BranchEnd",
    "BreakerSpec",
    "CallbackSigner",
    "Catalogue",
    "Chain",
    "ConfigError",
    "ConfigProblem",
    "Container",
    "ContainerConfig",
    "Context",
    "DeadlineExceeded",
    "Engine",
    "ErrorInfo",
    "FileResults",
    "Gateway",
    "GatewayConfig",
    "GraphNode",
    "HealthSpec",
    "HedgeSpec",
    "HostSpec",
    "HttpCall",
    "InternalError",
    "InvalidTransition",
    "JobCancelled",
    "JobFailed",
    "JobGone",
    "JobNotFound",
    "JobView",
    "JsonFormatter",
    "KeyStatistics",
    "MemoryEventQueue",
    "MemoryJobStore",
    "MergeConflict",
    "MergePolicy",
    "Metrics",
    "OutlierSpec",
    "Overloaded",
    "OwnedFiles",
    "Parallel",
    "Pipe",
    "PipeContractError",
    "PipeworkError",
    "PoolConfig",
    "PoolConfigError",
    "PoolStatistics",
    "Progress",
    "QueueStatistics",
    "Refusals",
    "RegistrationError",
    "Registry",
    "Rejected",
    "RequestUse",
    "ResourcePool",
    "ResourcePoolClosed",
    "ResourcePoolError",
    "ResourcePoolStatistics",
    "ResourceStartupError",
    "ResultFile",
    "RetrySpec",
    "Route",
    "Serial",
    "Service",
    "SignalError",
    "StateError",
    "Status",
    "StoreUnavailable",
    "TemplateError",
    "TemplateSyntaxError",
    "WeightedPool",
    "Weights",
    "__version__",
    "all_of",
    "any_of",
    "branch",
    "build_registry",
    "config_from_dict",
    "create_app",
    "graph",
    "http_pipe",
    "load_config",
    "loads_config",
    "node",
    "quorum",
    "serial",
]


def test_all_is_pinned_and_sorted() -> None:
    assert pw.__all__ == PUBLIC
    # Every name re-exported with `import X as X` is public, so listed too.
    source = (ROOT / "pipework" / "__init__.py").read_text(encoding="utf-8")
    reexported = set(re.findall(r"import (\w+) as \1$", source, re.MULTILINE))
    assert reexported <= set(pw.__all__)
    assert sorted(pw.__all__, key=lambda n: (not n.isupper(), n)) == pw.__all__
    for name in pw.__all__:
        assert hasattr(pw, name), name


def test_public_classes_and_functions_live_in_pipework() -> None:
    for name in pw.__all__:
        value = getattr(pw, name)
        if isinstance(value, type) or callable(value):
            assert value.__module__ == "pipework", name
            assert value.__name__ == name, name


def test_every_error_is_a_pipework_error() -> None:
    errors = [getattr(pw, n) for n in pw.__all__ if isinstance(getattr(pw, n), type)]
    errors = [e for e in errors if issubclass(e, BaseException)]
    assert len(errors) >= 15
    for error in errors:
        assert issubclass(error, pw.PipeworkError), error


# A line of the tree in pipework._errors' docstring: the root at the margin, every other
# class after a connector, its extra bases in parentheses.
_TREE_LINE = re.compile(
    r"^    (?P<indent>(?:[│ ]   )*)(?P<connector>[├└]── )?(?P<name>[A-Z]\w*)"
    r"(?: \((?P<extra>\w+(?:, \w+)*)\))?(?: |$)"
)


def _drawn_error_tree() -> dict[str, tuple[str, ...]]:
    """Each class drawn in the tree, with its bases as drawn: its parent in the tree, then
    the bases in parentheses (the root: none drawn)."""
    assert _errors.__doc__ is not None
    drawn: dict[str, tuple[str, ...]] = {}
    path: list[str] = []
    for line in _errors.__doc__.splitlines():
        found = _TREE_LINE.match(line)
        if found is None or (found["indent"] and not found["connector"]):
            continue
        if found["connector"]:
            depth = len(found["indent"]) // 4 + 1
        else:
            assert not drawn, f"a second root: {line.strip()}"
            depth = 0
        name = found["name"]
        assert name not in drawn, f"{name} is drawn twice"
        assert len(path) >= depth, f"{name} is drawn below no parent"
        del path[depth:]
        extra = tuple(found["extra"].split(", ")) if found["extra"] else ()
        drawn[name] = (*path[-1:], *extra)
        path.append(name)
    return drawn


def test_the_error_tree_in_the_errors_docstring_is_the_exported_errors() -> None:
    drawn = _drawn_error_tree()
    exported = {
        name: value
        for name in pw.__all__
        if isinstance(value := getattr(pw, name), type) and issubclass(value, BaseException)
    }
    assert sorted(drawn) == sorted(exported)
    assert drawn["PipeworkError"] == ()
    assert pw.PipeworkError.__bases__ == (Exception,)
    for name, bases in drawn.items():
        if name == "PipeworkError":
            continue
        real = tuple(base.__name__ for base in exported[name].__bases__)
        assert bases == real, f"{name}: drawn on {bases}, defined on {real}"
        # Each drawn base is pipework's exported class or the builtin of that name.
        for base, cls in zip(bases, exported[name].__bases__, strict=True):
            assert cls is getattr(pw, base, None) or cls is getattr(builtins, base, None), base


def test_the_tree_parser_reads_nesting_and_extra_bases() -> None:
    # The parser itself, on the tree's shapes: a continuation line, a second level, extras.
    drawn = _drawn_error_tree()
    assert drawn["Rejected"] == ("Overloaded",)
    assert drawn["BorrowTimeout"] == ("ResourcePoolError", "TimeoutError")
    assert drawn["JobNotFound"] == ("PipeworkError", "LookupError")
    assert drawn["ConfigError"] == ("PipeworkError", "ValueError")


def test_exceptions_defined_outside_the_errors_module_are_named_in_it() -> None:
    """An exception class of pipework that is not one of the exported errors is internal to
    its layer, and the errors module's docstring says where it lives and what it becomes."""
    doc = _errors.__doc__
    assert doc is not None
    elsewhere = set()
    for info in pkgutil.walk_packages(pw.__path__, "pipework."):
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if (
                inspect.isclass(value)
                and issubclass(value, BaseException)
                and value.__module__ == info.name
                and not name.startswith("_")
            ):
                elsewhere.add(name)
    assert "Suspend" in elsewhere  # the walk sees the modules
    assert elsewhere.isdisjoint(pw.__all__)
    missing = sorted(name for name in elsewhere if f"``{name}``" not in doc)
    assert missing == []


# `pipework._x` and `pipework.<sub>._x` are private: docs and examples show only what a user
# may rely on.
_PRIVATE = re.compile(r"\bpipework(?:\.[a-z]+)*\._[a-z]\w*")


def _documents() -> list[Path]:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    examples = ROOT / "examples"
    return docs + sorted(
        path for pattern in ("*.py", "*.md", "*.toml") for path in examples.rglob(pattern)
    )


def test_docs_and_examples_import_only_public_names() -> None:
    found = []
    for path in _documents():
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if ("import" in line or "from " in line) and _PRIVATE.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert found == []


def test_docs_and_examples_name_only_exported_attributes() -> None:
    """``pw.Name`` in the docs and examples is a name ``pipework`` exports, and a
    ``python = "module:attribute"`` import path names no private module of pipework."""
    found = []
    for path in _documents():
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            where = f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
            for name in re.findall(r"\bpw\.([A-Za-z_]\w*)", line):
                if name not in pw.__all__:
                    found.append(where)
            for target in re.findall(r'python\s*=\s*"([^"]+)"', line):
                if _PRIVATE.search(target):
                    found.append(where)
    assert found == []


def test_the_cli_synopsis_in_the_http_docs_lists_every_form_and_flag() -> None:
    from pipework.__main__ import build_parser

    text = (ROOT / "docs" / "http-api.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^```(\w*)\n(.*?)^```$", text, re.DOTALL | re.MULTILINE)
    (synopsis,) = [body for language, body in blocks if "pipework serve" in body and not language]
    parser = build_parser()
    flags = {f for action in parser._actions for f in action.option_strings}
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    # Flags hidden from --help are the supervisor's own way of talking to its workers
    # (`serve --workers N`), not the user's: exactly these, so no user flag hides here.
    hidden: set[str] = set()
    for name, command in commands.choices.items():
        assert f"pipework {name} " in synopsis, f"`pipework {name}` is not in the synopsis"
        for action in command._actions:
            if action.help == argparse.SUPPRESS:
                hidden.update(action.option_strings)
                continue
            flags.update(action.option_strings)
            for choice in action.choices or ():
                if action.option_strings:
                    assert str(choice) in synopsis, f"{name} {action.option_strings}: {choice}"
    assert hidden == {"--listen-fd", "--ready-fd"}
    flags -= {"-h"}
    missing = sorted(flag for flag in flags if flag not in synopsis)
    assert missing == [], "flags the synopsis leaves out"
