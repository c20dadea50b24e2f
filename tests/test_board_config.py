"""``[boards.NAME]`` in the gateway file: checked like every other section."""

from __future__ import annotations

import pytest

from pipework import ConfigError, loads_config

BOARDS = """
[boards.orders]
window = 0.1
max_batch = 500
keep_all = true
history = 32
max_followers = 2000
max_followers_per_resource = 100
write_token_env = "ORDERS_WRITE"
read_token_env = "ORDERS_READ"

[boards.news]
public_read = true
write_token_env = "NEWS_WRITE"
"""


def test_boards_load_and_take_their_tokens_from_the_environment() -> None:
    config = loads_config(BOARDS)
    assert sorted(config.boards) == ["news", "orders"]
    orders = config.boards["orders"].spec({"ORDERS_WRITE": "w", "ORDERS_READ": "r"})
    assert (orders.write_token, orders.read_token, orders.public_read) == ("w", "r", False)
    assert orders.settings.window == 0.1
    assert orders.settings.keep_all
    assert orders.settings.max_per_resource == 100
    news = config.boards["news"].spec({})
    assert news.write_token is None  # unset variable: no HTTP writes at all
    assert news.public_read
    assert config.summary()["boards"] == 2


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[boards.jobs]\npublic_read = true", "boards.jobs: the board name 'jobs' is the job"),
        ("[boards.a]\nwindwo = 1", "boards.a.windwo: unknown key; did you mean 'window'?"),
        ("[boards.a]\nhistory = 0", "boards.a.history"),
        (
            '[boards.a]\nwrite_token = "x"\nwrite_token_env = "X"',
            "boards.a.write_token: set write_token or write_token_env, not both",
        ),
        ('[boards."a b"]\npublic_read = true', "board name 'a b' may use only"),
        ("boards = 3", "boards: expected a table of boards"),
    ],
)
def test_board_problems_are_reported_with_their_key_path(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        loads_config(text)
    assert message in str(raised.value)


def test_a_board_nobody_can_use_is_warned_about() -> None:
    config = loads_config("[boards.quiet]\nwindow = 0.5\n")
    warnings = [str(w) for w in config.warnings]
    assert any("nothing can write to this board" in w for w in warnings)
    assert any("nobody can follow this board" in w for w in warnings)
