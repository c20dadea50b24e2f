"""``pipework check`` misses nothing a server would trip over: the environment variables
the file names, routes under any path the container serves itself (``/ui`` and
``/boards`` included), and every problem of one service at once."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipework.__main__ import main

PIPE_AND_ROUTE = """
[pipes.hello]
python = "tests.test_config_corpus:enrich"

[routes.hello]
method = "GET"
path = "/hello"
chain = ["hello"]
"""

ENVIRONMENT = (
    """
[server]
admin_token_env = "CHECK_TEST_ADMIN"
callback_secret_env = "CHECK_TEST_SECRET"

[store]
backend = "redis"
url_env = "CHECK_TEST_STORE"

[boards]
backplane = "redis"
url_env = "CHECK_TEST_BOARDS"

[boards.orders]
write_token_env = "CHECK_TEST_WRITE"
read_token_env = "CHECK_TEST_READ"
"""
    + PIPE_AND_ROUTE
)

VARIABLES = (
    "CHECK_TEST_ADMIN",
    "CHECK_TEST_SECRET",
    "CHECK_TEST_STORE",
    "CHECK_TEST_BOARDS",
    "CHECK_TEST_WRITE",
    "CHECK_TEST_READ",
)


def check(tmp_path: Path, text: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    path = tmp_path / "gateway.toml"
    path.write_text(text)
    status = main(["check", str(path)])
    captured = capsys.readouterr()
    lines = (captured.err + captured.out).replace(str(path), "F").splitlines()
    return status, lines


def test_check_reports_every_unset_variable_the_file_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CHECK_TEST_READ", "")  # empty is unset, as the server reads it
    status, lines = check(tmp_path, ENVIRONMENT, capsys)
    assert status == 1
    said = "names the environment variable"
    assert lines == [
        "F: 2 errors, 4 warnings",
        f"  F:3: warning: server.admin_token_env: {said} 'CHECK_TEST_ADMIN', which is not "
        "set: the admin API would be off",
        f"  F:4: warning: server.callback_secret_env: {said} 'CHECK_TEST_SECRET', which is "
        "not set: callback URLs would be signed with PIPEWORK_CALLBACK_SECRET, the job "
        "store's secret or one made at start",
        f"  F:8: error: store.url_env: {said} 'CHECK_TEST_STORE', which is not set: the job "
        "store has no URL",
        f"  F:12: error: boards.url_env: {said} 'CHECK_TEST_BOARDS', which is not set: the "
        "board backplane has no URL",
        f"  F:15: warning: boards.orders.write_token_env: {said} 'CHECK_TEST_WRITE', which "
        "is not set: the board would take no HTTP writes",
        f"  F:16: warning: boards.orders.read_token_env: {said} 'CHECK_TEST_READ', which is "
        "not set: only the write token could read the board",
    ]


def test_check_passes_once_the_variables_are_set(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in VARIABLES:
        monkeypatch.setenv(name, "redis://127.0.0.1:1/0")
    status, lines = check(tmp_path, ENVIRONMENT, capsys)
    assert status == 0
    assert not [line for line in lines if "environment variable" in line]


@pytest.mark.parametrize("path", ["/ui", "/ui/jobs", "/boards/orders", "/boards/a/b/c"])
def test_check_reports_a_route_under_the_board_paths(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], path: str
) -> None:
    prefix = path.split("/")[1]
    status, lines = check(tmp_path, PIPE_AND_ROUTE.replace('"/hello"', f'"{path}"'), capsys)
    assert (status, lines) == (
        1,
        [
            "F: 1 error",
            f"  F:7: error: routes.hello.path: path '{path}' is under /{prefix}, which the "
            "container serves itself",
        ],
    )


def test_check_reports_every_problem_of_one_service(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    service = """
[services.users]
base_url = "ftp://users.internal"
reserv = 3
reserve = 10
limit = 4

[pipes.get]
service = "users"
path = "/u"

[routes.get]
path = "/u"
chain = ["get"]
"""
    status, lines = check(tmp_path, service, capsys)
    assert (status, lines) == (
        1,
        [
            "F: 3 errors",
            "  F:3: error: services.users.base_url: 'ftp://users.internal' must start with "
            "http:// or https://",
            "  F:4: error: services.users.reserv: unknown key; did you mean 'reserve'?",
            "  F:5: error: services.users.reserve: reserve 10 is above limit 4: the key could "
            "never use all of its reserve; lower the reserve or raise the limit",
        ],
    )


def test_a_bad_service_name_does_not_hide_its_other_problems(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, lines = check(
        tmp_path, '[services."bad name"]\nbase_url = "ftp://x"\n' + PIPE_AND_ROUTE, capsys
    )
    assert status == 1
    assert any("services.\"bad name\".base_url: 'ftp://x' must start with" in x for x in lines)
