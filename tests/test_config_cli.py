"""The ``check``, ``routes`` and ``graph`` helpers of the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipework._cli_config import check, graph, routes

CONFIGS = Path(__file__).parent / "configs"
# One line in the file (TOML inline tables cannot span lines), two here.
GRAPH = (
    '{ graph = { A = "price_a", B = { pipe = "price_b", after = ["A"] }, '
    'C = { pipe = "audit", detach = true } } }'
)
SMALL = """
[services.users]
base_url = "http://users.internal"

[services.pricing]
base_url = "http://pricing.internal"
limit = 4

[pipes.get_user]
service = "users"
path = "/users/{user_id}"

[pipes.price_a]
service = "pricing"
path = "/a"

[pipes.price_b]
service = "pricing"
method = "POST"
path = "/b"

[pipes.audit]
service = "users"
method = "PUT"
path = "/audit"

[routes.order]
method = "POST"
path = "/orders/{user_id}"
timeout = 5
result = "price"
chain = [
  "get_user",
  { any_of = ["price_a", ["price_b", "get_user"]], timeout = 1 },
  GRAPH,
]

[routes.user]
method = "GET"
path = "/users/{user_id}"
mode = "async"
chain = [{ quorum = ["get_user", "get_user", "get_user"], k = 2 }]
""".replace("GRAPH", GRAPH)


@pytest.fixture
def small(tmp_path: Path) -> Path:
    path = tmp_path / "gateway.toml"
    path.write_text(SMALL, encoding="utf-8")
    return path


def test_check_a_valid_file(small: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert check(small) == 0
    out, err = capsys.readouterr()
    assert out == f"{small}: valid: 2 services, 4 pipes, 2 routes; 64 workers (0 reserved)\n"
    assert err == ""


def test_check_prints_warnings(capsys: pytest.CaptureFixture[str]) -> None:
    path = CONFIGS / "valid" / "warnings.toml"
    assert check(path) == 0
    out, err = capsys.readouterr()
    assert (
        out
        == f"{path}: valid: 2 services, 2 pipes, 0 routes; 64 workers (0 reserved); 5 warnings\n"
    )
    assert f"{path}:12: warning: pipes.get_user: no route uses this pipe\n" in err
    assert len(err.splitlines()) == 5


def test_check_an_invalid_file_prints_every_problem(
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = CONFIGS / "invalid" / "weights.toml"
    assert check(path) == 1
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert lines[0] == f"{path}: 7 errors"
    assert lines[1] == (
        f"  {path}:2: error: pool.max_workers: reserves add up to 14 (users=6, pricing=6, "
        "search=2) but max_workers is 10; lower a reserve or raise max_workers"
    )
    assert len(lines) == 8


def test_check_a_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert check(tmp_path / "nope.toml") == 1
    assert "error: cannot read the file: No such file or directory" in capsys.readouterr().err


def test_routes_lists_resolved_chains(small: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert routes(small) == 0
    assert capsys.readouterr().out.splitlines() == [
        "ROUTE  METHOD  PATH               MODE   TIMEOUT        CHAIN",
        "order  POST    /orders/{user_id}  sync   5s             get_user > "
        "any_of[timeout=1s](price_a, (price_b > get_user)) > "
        "graph(A: price_a; B: price_b after A; C: audit detached)",
        "user   GET     /users/{user_id}   async  30s (default)  "
        "quorum[k=2](get_user, get_user, get_user)",
    ]


def test_routes_show_the_server_default_timeout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text(SMALL + "\n[server]\ndefault_timeout = 12\n", encoding="utf-8")
    assert routes(path) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows[2].startswith("user   GET     /users/{user_id}   async  12s (default)  quorum")


def test_check_json_of_a_valid_file(small: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert check(small, format="json") == 0
    out, err = capsys.readouterr()
    document = json.loads(out)
    assert document["valid"] is True
    assert document["source"] == str(small)
    assert (document["services"], document["pipes"], document["routes"]) == (2, 4, 2)
    assert document["errors"] == []
    assert document["warnings"] == []
    assert err == ""


def test_check_json_lists_every_problem(capsys: pytest.CaptureFixture[str]) -> None:
    path = CONFIGS / "invalid" / "weights.toml"
    assert check(path, format="json") == 1
    out, err = capsys.readouterr()
    document = json.loads(out)
    assert document["valid"] is False
    assert len(document["errors"]) == 7
    assert document["errors"][0] == {
        "path": "pool.max_workers",
        "line": 2,
        "message": "reserves add up to 14 (users=6, pricing=6, search=2) but max_workers is "
        "10; lower a reserve or raise max_workers",
    }
    assert err == ""


def test_check_json_carries_warnings(capsys: pytest.CaptureFixture[str]) -> None:
    path = CONFIGS / "valid" / "warnings.toml"
    assert check(path, format="json") == 0
    document = json.loads(capsys.readouterr().out)
    assert len(document["warnings"]) == 5
    assert {"path": "pipes.get_user", "line": 12, "message": "no route uses this pipe"} in (
        document["warnings"]
    )


def test_graph_into_a_closed_pipe_ends_quietly(small: Path) -> None:
    """`pipework graph FILE | head -1`: the reader is gone, no BrokenPipeError traceback."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pipework", "graph", str(small)],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            check=False,
            timeout=60,
        )
    finally:
        os.close(write_end)
    assert done.stderr == ""
    assert done.returncode == 1


def test_routes_of_an_invalid_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert routes(CONFIGS / "invalid" / "syntax.toml") == 1
    assert "error: invalid TOML" in capsys.readouterr().err


GRAPH_OF_ORDER = """\
flowchart TD
    n1(["POST /orders/{user_id}<br/>mode: sync"])
    n2["get_user<br/>GET users /users/{user_id}"]
    n1 --> n2
    n3{{"any_of[timeout=1s]"}}
    n2 --> n3
    n4["price_a<br/>GET pricing /a"]
    n3 --> n4
    n5["price_b<br/>POST pricing /b"]
    n3 --> n5
    n6["get_user<br/>GET users /users/{user_id}"]
    n5 --> n6
    n7(("first success"))
    n4 --> n7
    n6 --> n7
    n8{{"graph"}}
    n7 --> n8
    n9["A: price_a<br/>GET pricing /a"]
    n8 --> n9
    n10["B: price_b<br/>POST pricing /b"]
    n9 --> n10
    n11["C: audit<br/>PUT users /audit"]
    n8 -. detached .-> n11
    n12(("join"))
    n10 --> n12
    n13(["respond: state.price"])
    n12 --> n13"""


def test_graph_to_stdout(small: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert graph(small) == 0
    out = capsys.readouterr().out
    assert out.startswith("# Route `order`\n\n`POST /orders/{user_id}` (sync) runs `get_user > ")
    assert f"```mermaid\n{GRAPH_OF_ORDER}\n```\n" in out
    assert "# Route `user`" in out
    assert 'n6(("2 of 3"))' in out


def test_graph_to_a_directory(
    small: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_dir = tmp_path / "diagrams" / "chains"
    assert graph(small, out_dir) == 0
    assert sorted(p.name for p in out_dir.iterdir()) == ["order.md", "user.md"]
    assert GRAPH_OF_ORDER in (out_dir / "order.md").read_text(encoding="utf-8")
    assert capsys.readouterr().out.splitlines() == [
        str(out_dir / "order.md"),
        str(out_dir / "user.md"),
    ]


def test_graph_draws_composite_graph_nodes_as_subgraphs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert graph(CONFIGS / "valid" / "full.toml") == 0
    out = capsys.readouterr().out
    assert "    subgraph n" in out
    assert '_1 ["B"]' in out
    assert '{{"all_of[settle]"}}' in out
    assert '(("all settle"))' in out


def test_routes_lists_proxy_routes_too(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text(
        SMALL
        + """
[routes.shop]
proxy = "users"
prefix = "/shop"
strip_prefix = true
methods = ["GET", "POST"]
chain = ["get_user"]
""",
        encoding="utf-8",
    )
    assert routes(path) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows[-1].split() == [
        "shop", "GET,HEAD,POST", "/shop/...", "proxy", "none",
        "get_user", ">", "proxy", "to", "users", "(prefix", "stripped)",
    ]  # fmt: skip
