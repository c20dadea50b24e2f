"""The public surface: exactly these names, each reporting ``pipework`` as its module, and
docs and examples that use nothing else."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pipework as pw

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
    "Gateway",
    "GatewayConfig",
    "GraphNode",
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
    "Overloaded",
    "Parallel",
    "Pipe",
    "PipeContractError",
    "PipeworkError",
    "PoolConfig",
    "PoolConfigError",
    "PoolStatistics",
    "Progress",
    "QueueStatistics",
    "RegistrationError",
    "Registry",
    "Rejected",
    "ResourcePool",
    "ResourcePoolClosed",
    "ResourcePoolError",
    "ResourcePoolStatistics",
    "ResourceStartupError",
    "Route",
    "Serial",
    "Service",
    "SignalError",
    "StateError",
    "Status",
    "StoreUnavailable",
    "TemplateError",
    "WeightedPool",
    "Weights",
    "__version__",
    "all_of",
    "any_of",
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
