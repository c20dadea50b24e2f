"""``[boards]``' own keys: the backplane that carries the boards' writes between processes,
checked like every other section, each mistake named by its key path."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipework import ConfigError, loads_config
from pipework.__main__ import main
from pipework.redis._backplane import RedisBackplane

REDIS = """
[boards]
backplane = "redis"
url_env = "BOARDS_REDIS"
prefix = "shop"

[boards.news]
public_read = true
write_token_env = "NEWS_WRITE"
"""


def test_the_local_backplane_is_the_default() -> None:
    config = loads_config("[boards.news]\npublic_read = true\nwrite_token_env = 'W'\n")
    assert config.backplane.backplane == "local"
    assert config.backplane.build({}) is None  # the container's own, in-process


def test_a_redis_backplane_is_built_from_the_file_and_the_environment() -> None:
    config = loads_config(REDIS)
    assert list(config.boards) == ["news"]  # [boards]' own keys are not boards
    plane = config.backplane.build({"BOARDS_REDIS": "redis://127.0.0.1:6390/2"})
    assert isinstance(plane, RedisBackplane)
    assert (plane.url, plane.prefix) == ("redis://127.0.0.1:6390/2", "shop")
    with pytest.raises(
        ConfigError, match=r"boards\.url_env: names .*'BOARDS_REDIS', which is not set"
    ):
        config.backplane.build({})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[boards]\nbackplane = "zookeeper"', "boards.backplane"),
        ('[boards]\nbackplane = "redis"', 'boards.url: backplane = "redis" needs url'),
        ('[boards]\nbackplane = "redis"\nurl = "http://x"', "boards.url: expected a URL"),
        (
            '[boards]\nbackplane = "redis"\nurl = "redis://x"\nurl_env = "X"',
            "boards.url: set url or url_env, not both",
        ),
        ('[boards]\nprefix = "a:b"', "boards.prefix: a key prefix may not contain ':'"),
        (
            "[boards.url]\npublic_read = true",
            "boards.url: 'url' is one of [boards]' own keys",
        ),
        ("[boards]\nbackplane = 3", "boards.backplane"),
    ],
)
def test_backplane_problems_are_reported_with_their_key_path(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        loads_config(text)
    assert message in str(raised.value)


def test_a_url_without_the_redis_backplane_is_warned_about() -> None:
    config = loads_config('[boards]\nurl = "redis://127.0.0.1/0"\n')
    assert any("boards.url" in str(w) and "only with" in str(w) for w in config.warnings)


def test_boards_on_the_local_backplane_are_refused_with_several_workers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text("[boards.news]\npublic_read = true\nwrite_token_env = 'W'\n")
    assert main(["serve", str(path), "--port", "0", "--workers", "2"]) == 1
    err = capsys.readouterr().err
    assert "cannot serve with --workers 2 and the local board backplane" in err
    assert "board(s) 'news'" in err
    assert 'backplane = "redis"' in err
