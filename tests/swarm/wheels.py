"""Small real wheels for the build tests: made here, so no index or network is needed.

:func:`make_wheel` writes a pure-Python wheel pip can install (a module with a
``VALUE`` and a ``greet`` function, correct ``RECORD`` hashes), or a metadata-only
wheel with any tag (what ``pip download`` needs to resolve, e.g. a stand-in torch).
:func:`probe_project` writes a whole project (a script and its requirements file)
with the wheelhouse its package comes from.
"""

from __future__ import annotations

import base64
import hashlib
import re
import zipfile
from collections.abc import Sequence
from pathlib import Path


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return f"sha256={digest.decode()}"


def make_wheel(directory: Path, name: str, version: str, *, requires: Sequence[str] = (),
               tag: str = "py3-none-any", value: str = "") -> Path:
    """Write ``<name>-<version>-<tag>.whl`` into ``directory``; return its path.

    The wheel holds module ``<name with _>`` whose ``VALUE`` is ``value`` (default
    ``"<name> <version>"``) and whose ``greet(rank)`` returns ``f"{VALUE} greets rank
    {rank}"``; ``requires`` become ``Requires-Dist`` lines.
    """
    directory.mkdir(parents=True, exist_ok=True)
    dist = re.sub(r"[-_.]+", "_", name)
    info = f"{dist}-{version}.dist-info"
    module = f"VALUE = {value or f'{name} {version}'!r}\n\n\ndef greet(rank):\n" \
             "    return f'{VALUE} greets rank {rank}'\n"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires)
    wheel = f"Wheel-Version: 1.0\nGenerator: swarmfd-tests\nRoot-Is-Purelib: true\nTag: {tag}\n"
    files = {f"{dist}.py": module, f"{info}/METADATA": metadata, f"{info}/WHEEL": wheel}
    path = directory / f"{dist}-{version}-{tag}.whl"
    with zipfile.ZipFile(path, "w") as zf:
        record = []
        for arcname, text in files.items():
            data = text.encode()
            zf.writestr(arcname, data)
            record.append(f"{arcname},{_record_hash(data)},{len(data)}")
        record.append(f"{info}/RECORD,,")
        zf.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
    return path


#: The script of :func:`probe_project`: every rank greets with the package and sums
#: rank + 1 over the group (3 ranks: 6).
PROBE_SCRIPT = """\
import numpy as np
import swarmfd as fd
import swarmfd_probe_pkg as probe

cfg = fd.init_from_env(timeout=60)
x = np.full(4, cfg.rank + 1.0)
fd.all_reduce(x)
print(probe.greet(cfg.rank), "sum", int(x[0]), flush=True)
fd.cleanup()
"""


def probe_project(root: Path) -> tuple[Path, Path]:
    """``root/project`` (train.py, requirements.txt naming swarmfd-probe-pkg==1.0) and
    ``root/wheels`` (that package, which needs numpy); returns both."""
    wheelhouse = root / "wheels"
    make_wheel(wheelhouse, "swarmfd-probe-pkg", "1.0", requires=["numpy>=1.24"],
               value="probe-pkg 1.0")
    project = root / "project"
    project.mkdir(parents=True)
    (project / "train.py").write_text(PROBE_SCRIPT)
    (project / "requirements.txt").write_text("swarmfd-probe-pkg==1.0\n")
    return project, wheelhouse


def probe_lines(world: int) -> dict[int, list[str]]:
    """What each rank of :data:`PROBE_SCRIPT` prints, by rank."""
    total = world * (world + 1) // 2
    return {r: [f"probe-pkg 1.0 greets rank {r} sum {total}"] for r in range(world)}
