"""The layering the README promises, checked on the source: who may import what.

* ``swarmfd/comm/`` is the communication layer; only four of its modules import zmq
  (the keys and ZAP, the zmq plane, the rendezvous, the transport that builds them);
  the message layer, the wire format, the socket and shared-memory planes use the
  standard library and numpy only.
* ``swarmfd/algorithms/`` sees an Op, never a socket: no zmq, socket or selectors.
* ``swarmfd/swarm/`` is the only package that imports docker; only the CLI modules
  (``cli.py``, ``cli_options.py``, ``swarm/cli.py``) import click; only
  ``swarmfd/torch/`` imports torch.
* Nothing unpickles; every core module declares its public names (``__all__``).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "swarmfd"


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _imports(path: Path) -> set[str]:
    """Top-level package names imported anywhere in ``path`` (also inside functions)."""
    names: set[str] = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _modules() -> dict[str, set[str]]:
    return {str(p.relative_to(PACKAGE)): _imports(p) for p in PACKAGE.rglob("*.py")}


def test_only_four_comm_modules_import_zmq() -> None:
    """ZeroMQ stays behind swarmfd/comm: its keys, its plane, the rendezvous, the transport."""
    users = sorted(m for m, names in _modules().items() if "zmq" in names)
    assert users == ["comm/planes/zmq.py", "comm/rendezvous.py", "comm/security.py",
                     "comm/transport.py"]


def test_the_message_layer_and_the_other_planes_use_the_standard_library() -> None:
    """What every plane shares, and the socket and shared-memory planes, need no zmq."""
    allowed = {"__future__", "numpy", "swarmfd"}
    for module in ("comm/channel.py", "comm/wire.py", "comm/plane.py", "comm/handshake.py",
                   "comm/planes/socket.py", "comm/planes/shm.py", "comm/shm_setup.py"):
        imported = _imports(PACKAGE / module)
        import sys

        outside = {n for n in imported - allowed if n not in sys.stdlib_module_names}
        assert not outside, (module, outside)


def test_algorithms_never_see_a_socket() -> None:
    for path in (PACKAGE / "algorithms").glob("*.py"):
        assert not _imports(path) & {"zmq", "socket", "selectors"}, path.name


def test_only_the_swarm_package_imports_docker() -> None:
    """The Docker SDK stays inside swarmfd/swarm/."""
    users = sorted(m for m, names in _modules().items() if "docker" in names)
    assert users and all(m.startswith("swarm/") for m in users), users


def test_only_the_cli_modules_import_click() -> None:
    """The core never imports click: only the command line does (cli.py, its shared
    options, and the Swarm commands beside the Swarm package)."""
    users = sorted(m for m, names in _modules().items() if "click" in names)
    assert users == ["cli.py", "cli_options.py", "swarm/cli.py"]


def test_only_the_torch_integration_imports_torch() -> None:
    users = sorted(m for m, names in _modules().items() if "torch" in names)
    assert all(m.startswith("torch/") for m in users), users


def test_nothing_unpickles() -> None:
    """No module uses pickle or marshal (nothing from the network is ever unpickled)."""
    users = sorted(m for m, names in _modules().items() if names & {"pickle", "marshal"})
    assert users == []


def test_core_modules_declare_their_public_names() -> None:
    core = [p for p in PACKAGE.rglob("*.py")
            if p.parent.name in ("swarmfd", "comm", "planes", "algorithms")
            and p.name not in ("__main__.py",) and not (p.name == "__init__.py"
                                                         and p.parent.name != "swarmfd")]
    missing = []
    for p in core:
        names = {t.id for node in _tree(p).body if isinstance(node, ast.Assign)
                 for t in node.targets if isinstance(t, ast.Name)}
        if "__all__" not in names:
            missing.append(str(p.relative_to(PACKAGE)))
    tools = {"bench.py", "cli.py", "entrypoint.py", "launch.py"}
    assert sorted(set(missing) - tools) == [], missing


def test_only_the_torch_package_imports_torch() -> None:
    """torch stays optional: only swarmfd/torch/ imports it (the core takes tensors as
    numpy views without importing torch)."""
    users = sorted(m for m, names in _modules().items() if "torch" in names)
    assert users and all(m.startswith("torch/") for m in users), users
