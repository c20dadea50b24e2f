"""The report example's parts that need no browser: the worker protocol's framing, the
config's validation, the templates' start-up checks, and the input's validation."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

import msgpack
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from examples.report import run
from examples.report.config import (
    DEFAULT_CONFIG,
    DEFAULT_TEMPLATES,
    ReportConfig,
    ReportConfigError,
    config_from_dict,
    load_config,
)
from examples.report.content import FIELDS, KINDS, Invalid, prepare, validate
from examples.report.pdf import WorkerSettings
from examples.report.protocol import FrameDecoder, ProtocolError, encode
from examples.report.service import serve
from examples.report.templates import TemplateLoadError, load_templates

SAMPLE = Path(__file__).resolve().parent.parent / "examples" / "report" / "sample.json"

messages = st.fixed_dictionaries(
    {"type": st.sampled_from(["render", "pdf", "error"])},
    optional={
        "id": st.integers(0, 2**31),
        "html": st.text(max_size=200),
        "pdf": st.binary(max_size=300),
        "timeout": st.floats(0.1, 60),
    },
)


@given(st.lists(messages, max_size=8), st.lists(st.integers(1, 50), min_size=1))
def test_frames_come_back_whole_whatever_pieces_they_arrive_in(
    sent: list[dict[str, Any]], cuts: list[int]
) -> None:
    stream = b"".join(encode(m) for m in sent)
    decoder = FrameDecoder()
    received: list[dict[str, Any]] = []
    position, n = 0, 0
    while position < len(stream):
        size = cuts[n % len(cuts)]
        decoder.feed(stream[position : position + size])
        position, n = position + size, n + 1
        while (message := decoder.next_message()) is not None:
            received.append(message)
    assert received == sent
    assert decoder.pending == 0


def test_a_frame_over_the_limit_or_not_a_typed_map_is_a_protocol_error() -> None:
    decoder = FrameDecoder(max_frame=10)
    decoder.feed((11).to_bytes(4, "big"))
    with pytest.raises(ProtocolError, match="over the limit of 10"):
        decoder.next_message()
    for body in (msgpack.packb([1, 2]), msgpack.packb({"id": 1}), b"\xc1"):
        decoder = FrameDecoder()
        decoder.feed(len(body).to_bytes(4, "big") + body)
        with pytest.raises(ProtocolError):
            decoder.next_message()


def test_the_shipped_config_loads_with_the_seeds_settings() -> None:
    config = load_config(DEFAULT_CONFIG)
    assert (config.pool_size, config.borrow_timeout) == (4, 30.0)
    assert (config.pdf.launch_timeout, config.pdf.render_timeout) == (30.0, 30.0)
    assert config.templates == DEFAULT_TEMPLATES
    assert config.storage is None
    assert config.pdf.chromium == "/usr/bin/chromium"


def test_config_problems_are_all_reported_each_with_its_key() -> None:
    data = {
        "server": {"port": "80", "timout": 5},
        "pdf": {"pool_size": 0, "borrow_timeout": -1, "render_timeout": True, "size": 2},
        "templates": {"directory": ""},
        "cache": {},
    }
    with pytest.raises(ReportConfigError) as caught:
        config_from_dict(data, base=Path("/srv"), source="report.toml")
    problems = caught.value.problems
    assert problems == [
        "server.port: must be a port number from 0 to 65535, not '80'",
        "server.timout: unknown key; did you mean 'timeout'? (known: host, port, "
        "shutdown_grace, timeout)",
        "pdf.pool_size: must be a whole number from 1 to 64, not 0",
        "pdf.borrow_timeout: must be a number of seconds above 0, not -1",
        "pdf.render_timeout: must be a number of seconds above 0, not True",
        "pdf.size: unknown key; did you mean 'pool_size'? (known: borrow_timeout, chromium, "
        "launch_timeout, pool_size, render_timeout, trace)",
        "templates.directory: must be a non-empty string",
        "cache: unknown key (known: pdf, server, storage, templates)",
    ]
    assert str(caught.value).startswith("report.toml: server.port: ")


def test_config_paths_are_relative_to_the_file(tmp_path: Path) -> None:
    path = tmp_path / "report.toml"
    path.write_text('[templates]\ndirectory = "t"\n[storage]\ndirectory = "out"\n')
    config = load_config(path)
    assert config.templates == tmp_path / "t"
    assert config.storage == tmp_path / "out"
    path.write_text("[pdf\n")
    with pytest.raises(ReportConfigError, match="is not valid TOML"):
        load_config(path)


def write_templates(directory: Path, **texts: str) -> Path:
    directory.mkdir(exist_ok=True)
    for kind, text in texts.items():
        (directory / f"{kind}.html").write_text(text, encoding="utf-8")
    return directory


def test_templates_fill_escaped_values_and_markup_the_service_built(tmp_path: Path) -> None:
    directory = write_templates(
        tmp_path / "t",
        achievement="<h1>{{ student }}</h1>{{chart|html}}",
        outlook="{{ exam }}",
    )
    templates = load_templates(directory, KINDS, FIELDS)
    page = templates.render("achievement", {"student": "<b>Lin</b>", "chart": "<svg/>"})
    assert page == "<h1>&lt;b&gt;Lin&lt;/b&gt;</h1><svg/>"


def test_every_template_problem_is_reported_with_its_file_and_line(tmp_path: Path) -> None:
    directory = write_templates(
        tmp_path / "t", achievement="<p>\n{{ studnet }}\n{{ exam\n</p>", outlook=""
    )
    (directory / "outlook.html").unlink()
    with pytest.raises(TemplateLoadError) as caught:
        load_templates(directory, KINDS, FIELDS)
    first, second, third = caught.value.problems
    assert first.startswith(f"{directory}/achievement.html:2: unknown placeholder 'studnet'")
    assert "did you mean 'student'?" in first
    assert second.startswith(f"{directory}/achievement.html:3: '{{{{ exam' is not a placeholder")
    assert third == f"{directory}/outlook.html: missing (the 'outlook' report's template)"


def test_the_shipped_templates_load_and_use_only_known_placeholders() -> None:
    templates = load_templates(DEFAULT_TEMPLATES, KINDS, FIELDS)
    request = validate(json.loads(SAMPLE.read_text()))
    values = prepare(request, dt.datetime(2026, 12, 1, 8, 0, tzinfo=dt.UTC))
    for kind in KINDS:
        page = templates.render(kind, values)
        assert "{{" not in page
        assert "Lin Wei" in page
        assert "<svg" in page


async def test_a_broken_template_fails_start_up_before_any_worker_starts(
    tmp_path: Path,
) -> None:
    directory = write_templates(tmp_path / "t", achievement="{{ student", outlook="ok")
    # A browser that cannot start: had start-up got that far, it would fail differently.
    config = ReportConfig(
        port=0, templates=directory, pdf=WorkerSettings(chromium=str(tmp_path / "none"))
    )
    with trio.fail_after(10), pytest.raises(TemplateLoadError, match=r"achievement\.html:1"):
        await serve(config, stop=trio.Event())


def test_the_command_says_why_it_did_not_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_templates(tmp_path / "templates", achievement="{{ nope }}", outlook="x")
    path = tmp_path / "report.toml"
    path.write_text('[templates]\ndirectory = "templates"\n[pdf]\nchromium = "/nowhere/chrome"\n')
    assert run.main(["--config", str(path)]) == 1
    error = capsys.readouterr().err
    assert error.startswith("report: not started: the report templates cannot be used:")
    assert "achievement.html:1: unknown placeholder 'nope'" in error
    path.write_text("[pdf]\npool_size = 0\n")
    assert run.main(["--config", str(path)]) == 1
    assert f"{path}: pdf.pool_size: must be a whole number" in capsys.readouterr().err
    # Good templates, a browser that is not there: the first worker fails, nothing runs.
    path.write_text('[pdf]\nchromium = "/nowhere/chrome"\nlaunch_timeout = 60\n')
    assert run.main(["--config", str(path), "--port", "0"]) == 1
    error = capsys.readouterr().err
    assert "report: not started: resource pool 'pdf': making resource 1 of 4 failed" in error
    assert "could not launch /nowhere/chrome" in error
    assert "executable doesn't exist at /nowhere/chrome" in error


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"kind": "summary"}, "kind: must be one of achievement, outlook, not 'summary'"),
        ({"student": ""}, "student: must be a non-empty string of at most 80 characters"),
        ({"days": []}, "days: must be a list of 1 to 60 days studied"),
        ({"exam_date": "13/12/2026"}, "exam_date: must be a date as YYYY-MM-DD"),
        ({"exam_date": "2026-11-01"}, "exam_date: must not be before the last day studied"),
        (
            {"days": [{"date": "2026-11-24", "studied": 10, "correct": 11}]},
            "days[0].correct: must be a whole number from 0 to 10, not 11",
        ),
        (
            {"days": [{"date": "2026-11-24", "studied": 1, "correct": 1}] * 2},
            "days: each date may appear once",
        ),
    ],
)
def test_bad_input_is_refused_naming_the_field(change: dict[str, Any], message: str) -> None:
    body = {**json.loads(SAMPLE.read_text()), **change}
    with pytest.raises(Invalid) as caught:
        validate(body)
    assert str(caught.value) == message
    assert Invalid.http_status == 422


def test_settings_made_in_python_are_checked_too() -> None:
    with pytest.raises(ReportConfigError) as caught:
        ReportConfig(pool_size=0, borrow_timeout=0)
    assert caught.value.problems == [
        "pdf.pool_size: must be a whole number from 1 to 64, not 0",
        "pdf.borrow_timeout: must be a number of seconds above 0, not 0",
    ]
    with pytest.raises(ValueError, match=r"pdf\.render_timeout must be a number of seconds above"):
        WorkerSettings(render_timeout=-1)
