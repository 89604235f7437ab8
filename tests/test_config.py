"""The environment contract's timeouts: SWARMFD_TIMEOUT and SWARMFD_INIT_TIMEOUT (plain data)."""

from __future__ import annotations

import io

import pytest

import swarmfd as fd
from swarmfd.config import Config, ConfigError, config_from_env

GROUP = {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1"}


def test_init_timeout_defaults_to_the_collective_timeout() -> None:
    """Without SWARMFD_INIT_TIMEOUT, init waits as long as a collective may."""
    cfg = config_from_env({**GROUP, "SWARMFD_TIMEOUT": "30"})
    assert (cfg.timeout, cfg.init_timeout, cfg.join_timeout) == (30.0, None, 30.0)
    assert config_from_env(GROUP).join_timeout == 300.0


def test_init_timeout_from_the_environment_and_overrides() -> None:
    """SWARMFD_INIT_TIMEOUT sets how long init waits; an argument wins over it."""
    env = {**GROUP, "SWARMFD_TIMEOUT": "30", "SWARMFD_INIT_TIMEOUT": "600"}
    cfg = config_from_env(env)
    assert (cfg.timeout, cfg.join_timeout) == (30.0, 600.0)
    assert config_from_env(env, init_timeout=5.5).join_timeout == 5.5


@pytest.mark.parametrize("value", ["0", "-3", "soon", "inf", "nan"])
def test_a_bad_init_timeout_names_the_variable(value: str) -> None:
    with pytest.raises(ConfigError, match=r"SWARMFD_INIT_TIMEOUT=.*positive number of seconds"):
        config_from_env({**GROUP, "SWARMFD_INIT_TIMEOUT": value})


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), True, "10"])
def test_config_rejects_a_bad_init_timeout(value: object) -> None:
    with pytest.raises(ConfigError, match="init_timeout must be a positive number of seconds"):
        Config(world_size=1, rank=0, init_timeout=value)  # type: ignore[arg-type]


def test_init_takes_init_timeout_and_print_config_shows_it() -> None:
    """fd.init(init_timeout=) reaches the config; print_config shows both timeouts."""
    try:
        cfg = fd.init(timeout=20, init_timeout=90)
        assert (cfg.timeout, cfg.join_timeout) == (20.0, 90.0)
        out = io.StringIO()
        fd.print_config(file=out)
        assert "timeout=20s init_timeout=90s" in out.getvalue()
    finally:
        fd.cleanup()


def test_a_bare_init_joins_the_group_the_environment_describes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """fd.init() under a launcher is the launcher's job, not a silent world of one; the
    arguments given override the environment, and world_size without rank is refused."""
    from swarmfd import group

    started: list[Config] = []
    monkeypatch.setattr(group, "_start", lambda config, secret=None: started.append(config))
    for name, value in {"WORLD_SIZE": "3", "RANK": "2", "LOCAL_RANK": "0",
                        "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "10.0.0.7",
                        "MASTER_PORT": "29611", "SWARMFD_TIMEOUT": "40"}.items():
        monkeypatch.setenv(name, value)
    fd.init()
    fd.init(timeout=5, master_port=4000)
    fd.init(2, 1, master_addr="127.0.0.1")
    got = [(c.world_size, c.rank, c.master_addr, c.master_port, c.timeout) for c in started]
    assert got == [(3, 2, "10.0.0.7", 29611, 40.0), (3, 2, "10.0.0.7", 4000, 5.0),
                   (2, 1, "127.0.0.1", 29611, 40.0)]
    for args in ((2, None), (None, 1)):
        with pytest.raises(TypeError, match="give both world_size and rank, or neither"):
            fd.init(*args)
