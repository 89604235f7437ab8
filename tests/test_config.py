"""The environment contract's timeouts (SWARMFD_TIMEOUT, SWARMFD_INIT_TIMEOUT) and swarmfd's
rendezvous port (SWARMFD_PORT, else MASTER_PORT + 1), as plain data."""

from __future__ import annotations

import io

import pytest

import swarmfd as fd
from swarmfd.config import Config, ConfigError, config_from_env, rendezvous_port

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
    from swarmfd import session

    started: list[Config] = []
    monkeypatch.setattr(session, "_start", lambda config, secret=None: started.append(config))
    for name, value in {"WORLD_SIZE": "3", "RANK": "2", "LOCAL_RANK": "0",
                        "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "10.0.0.7",
                        "MASTER_PORT": "29611", "SWARMFD_TIMEOUT": "40"}.items():
        monkeypatch.setenv(name, value)
    fd.init()
    fd.init(timeout=5, master_port=4000)
    fd.init(2, 1, master_addr="127.0.0.1")
    monkeypatch.setenv("SWARMFD_PORT", "29700")
    fd.init(2, 0, master_addr="127.0.0.1")
    fd.init(2, 0, master_addr="127.0.0.1", master_port=4001)
    got = [(c.world_size, c.rank, c.master_addr, c.rendezvous_port, c.timeout)
           for c in started]
    # swarmfd's rendezvous: MASTER_PORT + 1, SWARMFD_PORT when set, master_port= as given.
    assert got == [(3, 2, "10.0.0.7", 29612, 40.0), (3, 2, "10.0.0.7", 4000, 5.0),
                   (2, 1, "127.0.0.1", 29612, 40.0), (2, 0, "127.0.0.1", 29700, 40.0),
                   (2, 0, "127.0.0.1", 4001, 40.0)]
    for args in ((2, None), (None, 1)):
        with pytest.raises(TypeError, match="give both world_size and rank, or neither"):
            fd.init(*args)


# -- swarmfd's rendezvous port: beside torch.distributed, which holds MASTER_PORT ----------


@pytest.mark.parametrize(("env", "port"), [
    ({}, 29501),  # MASTER_PORT defaults to 29500, as torch's does
    ({"MASTER_PORT": "23456"}, 23457),
    ({"MASTER_PORT": " 1 "}, 2),
    ({"MASTER_PORT": "65534"}, 65535),
    ({"MASTER_PORT": ""}, 29501),  # empty is unset, as for every variable
    ({"SWARMFD_PORT": "40000"}, 40000),
    ({"MASTER_PORT": "23456", "SWARMFD_PORT": "40000"}, 40000),
    ({"MASTER_PORT": "65535", "SWARMFD_PORT": "1"}, 1),
    ({"MASTER_PORT": "23456", "SWARMFD_PORT": "65535"}, 65535),
    ({"MASTER_PORT": "23456", "SWARMFD_PORT": ""}, 23457),
])
def test_the_rendezvous_port_is_swarmfd_port_else_master_port_plus_one(
        env: dict[str, str], port: int) -> None:
    assert rendezvous_port(env) == port
    assert config_from_env({**GROUP, **env}).rendezvous_port == port


def test_an_explicit_rendezvous_port_does_not_read_the_environment() -> None:
    """fd.init(master_port=P) (the c10d backend passes one) binds P, whatever the
    environment says, even what would be an error there."""
    env = {**GROUP, "MASTER_PORT": "65535"}
    assert config_from_env(env, rendezvous_port=4000).rendezvous_port == 4000
    with pytest.raises(ConfigError, match="MASTER_PORT=65535"):
        config_from_env(env)


@pytest.mark.parametrize(("env", "message"), [
    ({"MASTER_PORT": "65535"},
     r"MASTER_PORT=65535 leaves no port for swarmfd's rendezvous, which is MASTER_PORT \+ 1 "
     r"unless SWARMFD_PORT is set: set SWARMFD_PORT to a free port"),
    ({"SWARMFD_PORT": "0"}, r"SWARMFD_PORT='0' is invalid: expected an integer >= 1 \(a TCP port"),
    ({"SWARMFD_PORT": "65536"},
     r"SWARMFD_PORT='65536' is invalid: expected a TCP port, 1\.\.65535"),
    ({"SWARMFD_PORT": "-5"}, r"SWARMFD_PORT='-5' is invalid"),
    ({"SWARMFD_PORT": "29501x"}, r"SWARMFD_PORT='29501x' is not an integer"),
    ({"SWARMFD_PORT": "2.5e4"}, r"SWARMFD_PORT='2\.5e4' is not an integer"),
    ({"MASTER_PORT": "70000"}, r"MASTER_PORT='70000' is invalid: expected a TCP port"),
    ({"MASTER_PORT": "port"}, r"MASTER_PORT='port' is not an integer"),
    ({"MASTER_PORT": "0"}, r"MASTER_PORT='0' is invalid"),
    ({"MASTER_PORT": "29500", "SWARMFD_PORT": "29500"},
     r"SWARMFD_PORT=29500 is MASTER_PORT too: MASTER_PORT is torch\.distributed's"),
])
def test_a_bad_port_names_the_variable_and_what_is_expected(
        env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        rendezvous_port(env)
    with pytest.raises(ConfigError, match=message):
        config_from_env({**GROUP, **env})


def test_a_bad_port_in_the_environment_fails_init_before_any_rendezvous(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """fd.init(world, rank) reads SWARMFD_PORT too, and refuses a bad one at once."""
    monkeypatch.setenv("MASTER_PORT", "65535")
    monkeypatch.delenv("SWARMFD_PORT", raising=False)
    with pytest.raises(ConfigError, match="MASTER_PORT=65535 leaves no port"):
        fd.init(2, 0, master_addr="127.0.0.1", secret="x" * 16 + "y" * 16)
    assert not fd.is_initialized()


@pytest.mark.parametrize("value", [0, 65536, -1, True, "29501", 2.0])
def test_config_rejects_a_bad_rendezvous_port(value: object) -> None:
    with pytest.raises(ConfigError, match="rendezvous_port"):
        Config(world_size=1, rank=0, rendezvous_port=value)  # type: ignore[arg-type]


@pytest.mark.parametrize(("value", "want"), [("29500", 29500), ("", None), ("torch", None),
                                             ("70000", None)])
def test_master_port_is_torch_s_port_or_none(value: str, want: int | None) -> None:
    """Only kept free of swarmfd's data planes: a bad value is torch's to report."""
    from swarmfd.config import master_port

    assert master_port({"MASTER_PORT": value}) == want
    assert master_port({}) is None


def test_swarmfd_cma_switches_cross_memory_reads() -> None:
    """SWARMFD_CMA: on unless 0/off/false/no; anything else is refused, naming it."""
    from swarmfd.config import ENV_CMA, cma_enabled

    assert cma_enabled({}) and cma_enabled({ENV_CMA: ""}) and cma_enabled({ENV_CMA: "1"})
    assert not cma_enabled({ENV_CMA: "0"}) and not cma_enabled({ENV_CMA: "off"})
    with pytest.raises(ConfigError, match=r"SWARMFD_CMA='maybe'.*expected 1"):
        cma_enabled({ENV_CMA: "maybe"})
