"""The layering the README promises, checked on the source: who may import zmq, docker,
click, torch."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "swarmfd"


def _imports(path: Path) -> set[str]:
    """Top-level package names imported anywhere in ``path`` (also inside functions)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _modules() -> dict[str, set[str]]:
    return {str(p.relative_to(PACKAGE)): _imports(p) for p in PACKAGE.rglob("*.py")}


def test_only_transport_imports_zmq() -> None:
    """ZeroMQ stays behind swarmfd/transport.py."""
    users = sorted(m for m, names in _modules().items() if "zmq" in names)
    assert users == ["transport.py"]


def test_only_the_swarm_package_imports_docker() -> None:
    """The Docker SDK stays inside swarmfd/swarm/."""
    users = sorted(m for m, names in _modules().items() if "docker" in names)
    assert users and all(m.startswith("swarm/") for m in users), users


def test_only_the_cli_modules_import_click() -> None:
    """The core never imports click: only cli.py and cli_swarm.py do."""
    users = sorted(m for m, names in _modules().items() if "click" in names)
    assert users == ["cli.py", "cli_swarm.py"]


def test_nothing_unpickles() -> None:
    """No module uses pickle or marshal (nothing from the network is ever unpickled)."""
    users = sorted(m for m, names in _modules().items() if names & {"pickle", "marshal"})
    assert users == []


def test_only_the_torch_package_imports_torch() -> None:
    """torch stays optional: only swarmfd/torch/ imports it (the core takes tensors as
    numpy views without importing torch)."""
    users = sorted(m for m, names in _modules().items() if "torch" in names)
    assert users and all(m.startswith("torch/") for m in users), users
