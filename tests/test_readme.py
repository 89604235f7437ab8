"""README.md and docs/*.md run as written: every Python snippet, and every command meant
for this machine.

The fenced blocks of each page are read in order. A comment on the line right above a
block, ``<!-- readme: WHAT -->``, says what the block is; without one, a ``python``
block runs as a world of one (a fresh interpreter in an empty directory) and, all of
them one after the other in one job, on two ranks under ``swarmfd run -n 2``; a ``sh``
block runs with bash (``-euo pipefail``) in the checkout, with this interpreter's
``bin`` first on ``PATH`` (where ``pip install -e .`` puts ``swarmfd``). Other blocks
(program output) are not run. The markers:

``file PATH``         the block is PATH's content, exactly (a ``python`` one also runs)
``fresh-clone``       runs in a copy of the checkout's tracked files (it makes a venv)
``swarm``             needs the Docker engine with a Swarm: runs in a ``swarm`` test
``swarm, torch``      builds a torch image (about 100 s cold): runs with
                      ``SWARMFD_README_TORCH=1`` only
``elsewhere (WHY)``   aimed at other machines (a manager, a registry): never run
``not run (WHY)``     e.g. the test suite itself

An unknown marker fails the catalogue test, so no block is skipped by accident.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from .support import harness

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: The pages whose blocks run: the README, then docs/ in name order.
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
CONTRACT_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "SWARMFD_PORT", "SWARMFD_RESTART_COUNT", "SWARMFD_CHECKPOINT_DIR",
                 "SWARMFD_SECRET_FILE")
PYTHON_TIMEOUT = 300.0
COMMAND_TIMEOUT = 600.0
#: A fresh venv with `pip install -e .` took about 23 s here; a loaded machine gets time.
FRESH_CLONE_TIMEOUT = 900.0
#: The torch project's cold build took about 100 s here.
TORCH_TIMEOUT = 1800.0

_MARKER = re.compile(r"^\s*<!-- readme: (?P<what>.+?) -->\s*$")
_FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[\w-]*)\s*$")
_SKIPPED = re.compile(r"^(elsewhere|not run) \(.+\)$")


@dataclass(frozen=True)
class Block:
    """One fenced block of a page."""

    line: int  # 1-based line of the opening fence
    lang: str
    body: str
    marker: str | None
    page: str = "README.md"  # its path from the checkout's root

    @property
    def kind(self) -> str:
        """python | local | fresh-clone | swarm | swarm-torch | file | skip | output."""
        marker = self.marker
        if marker is None:
            return {"python": "python", "sh": "local"}.get(self.lang, "output")
        if marker.startswith("file "):
            return "file"
        if marker == "fresh-clone":
            return "fresh-clone"
        if marker == "swarm":
            return "swarm"
        if marker == "swarm, torch":
            return "swarm-torch"
        if _SKIPPED.match(marker):
            return "skip"
        raise ValueError(f"{self.id}: unknown marker <!-- readme: {marker} -->")

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def read_blocks(text: str, page: str = "README.md") -> list[Block]:
    """The fenced blocks of ``text`` (the page ``page``) with the marker right above each."""
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang, start = m.group("indent"), m.group("lang"), i
        i += 1
        body: list[str] = []
        while i < len(lines) and lines[i] != indent + "```":
            line = lines[i]
            body.append(line[len(indent):] if line.startswith(indent) else line.lstrip())
            i += 1
        if i == len(lines):
            raise ValueError(f"{page}:{start + 1}: the block never ends")
        above = _MARKER.match(lines[start - 1]) if start else None
        blocks.append(Block(start + 1, lang, "\n".join(body) + "\n",
                            above.group("what") if above else None, page))
        i += 1
    return blocks


BLOCKS = [block for page in PAGES
          for block in read_blocks(page.read_text(encoding="utf-8"),
                                   str(page.relative_to(ROOT)))]


def of_kind(*kinds: str) -> list[Block]:
    found = []
    for block in BLOCKS:
        try:
            kind = block.kind
        except ValueError:
            continue  # reported by test_every_block_is_accounted_for
        if kind in kinds or (kind == "file" and "python" in kinds and block.lang == "python"):
            found.append(block)
    return found


def clean_env() -> dict[str, str]:
    """This environment without the swarmfd contract (a world of one), this Python's
    bin first on PATH."""
    env = {k: v for k, v in os.environ.items() if k not in CONTRACT_VARS}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_sh(block: Block, cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run a sh block with bash; fail with its output unless it exits 0."""
    try:
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", block.body], cwd=cwd,
                              env=clean_env(), capture_output=True, text=True,
                              timeout=timeout, start_new_session=True)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{block.id} did not finish in {timeout:.0f} s:\n{block.body}\n"
                    f"{exc.stdout}\n{exc.stderr}")
    assert proc.returncode == 0, (f"{block.id} exited {proc.returncode}:\n{block.body}\n"
                                  f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n"
                                  f"{proc.stderr[-4000:]}")
    return proc


def remove_tmp_paths(block: Block) -> None:
    """Remove the /tmp/swarmfd-* paths a command of the block names (it made them)."""
    for path in set(re.findall(r"/tmp/swarmfd-[\w.-]+", block.body)):
        shutil.rmtree(path, ignore_errors=True)


# --- the catalogue ------------------------------------------------------------------------


def test_every_block_is_accounted_for() -> None:
    """Every marker of every page is known; the README has snippets and commands that do
    run, and docs/ has pages."""
    for block in BLOCKS:
        if block.marker is not None and block.kind != "skip":  # .kind raises on an unknown one
            assert block.lang in ("python", "sh", "text"), (block.id, block.lang)
    readme = [block.kind for block in BLOCKS if block.page == "README.md"]
    assert readme.count("python") >= 1 and readme.count("local") >= 1, readme
    assert "swarm" in readme and "fresh-clone" in readme, readme
    assert len(PAGES) > 1, "no docs/*.md"


@pytest.mark.parametrize("block", of_kind("file"), ids=lambda b: b.id)
def test_file_blocks_are_the_files(block: Block) -> None:
    """A block shown as a file's content is exactly that file."""
    path = ROOT / block.marker.split(" ", 1)[1]  # type: ignore[union-attr]
    assert path.read_text(encoding="utf-8") == block.body, f"{block.id} differs from {path}"


# --- what runs here, fast ----------------------------------------------------------------


def _needs_torch(block: Block) -> bool:
    return re.search(r"^import torch|^from torch", block.body, re.M) is not None


@pytest.mark.parametrize("block", of_kind("python"), ids=lambda b: b.id)
def test_python_blocks_run_as_a_world_of_one(block: Block, tmp_path: Path) -> None:
    """Each Python snippet runs as written in a fresh interpreter and exits 0."""
    if _needs_torch(block):
        harness.require_torch(load=False)
    try:
        proc = subprocess.run([sys.executable, "-c", block.body], cwd=tmp_path,
                              env=clean_env(), capture_output=True, text=True,
                              timeout=PYTHON_TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{block.id} did not finish in {PYTHON_TIMEOUT:.0f} s")
    assert proc.returncode == 0, f"{block.id}:\n{proc.stdout}\n{proc.stderr}"


#: Runs each snippet on both ranks in turn: a fresh interpreter per snippet, the job's
#: environment (ports, secret) shared, so each snippet's init forms the group anew.
_IN_TURN = """set -u
for snippet in "$@"; do
  echo "== $snippet"
  "$PY" "$snippet" || { code=$?; echo "FAILED: $snippet (exit $code)"; exit 1; }
done
"""


def test_python_blocks_run_on_two_ranks(tmp_path: Path) -> None:
    """Every Python snippet also runs as written on two ranks: all of them, one after the
    other, in one ``swarmfd run -n 2`` job (one launcher and one secret for all), each
    in a fresh interpreter on each rank; every rank runs every snippet to its end."""
    with_torch = harness.torch_installed()
    blocks = [b for b in of_kind("python") if with_torch or not _needs_torch(b)]
    names = []
    for i, block in enumerate(blocks):
        name = f"{i:02d}-{block.page.replace('/', '-')}-{block.line}.py"
        (tmp_path / name).write_text(block.body, encoding="utf-8")
        names.append(name)
    env = {**clean_env(), "PY": sys.executable}
    cmd = [sys.executable, "-m", "swarmfd", "run", "-n", "2", "--timeout", "60", "--",
           "bash", "-c", _IN_TURN, "snippets", *names]
    try:
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=PYTHON_TIMEOUT, start_new_session=True)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the snippets did not finish on two ranks in {PYTHON_TIMEOUT:.0f} s:\n"
                    f"{exc.stdout}\n{exc.stderr}")
    ids = dict(zip(names, (b.id for b in blocks), strict=True))
    failed = re.findall(r"FAILED: (\S+)", proc.stdout)
    assert proc.returncode == 0 and not failed, (
        f"on two ranks, {[ids.get(n, n) for n in failed]} failed (exit {proc.returncode}):\n"
        f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    for rank in (0, 1):
        ran = re.findall(rf"^\[rank {rank}\] == (\S+)$", proc.stdout, re.M)
        assert ran == names, (rank, ran, proc.stdout[-4000:])


@pytest.mark.parametrize("block", of_kind("local"), ids=lambda b: b.id)
def test_local_commands_run(block: Block) -> None:
    """Each command block for this machine runs as written, from the checkout."""
    try:
        run_sh(block, ROOT, COMMAND_TIMEOUT)
    finally:
        remove_tmp_paths(block)


@pytest.mark.waits  # pip installs a fresh venv
@pytest.mark.slow
@pytest.mark.parametrize("block", of_kind("fresh-clone"), ids=lambda b: b.id)
def test_fresh_clone_commands_run(block: Block, tmp_path: Path) -> None:
    """The set-up command, in a copy of the checkout's tracked files (it makes .venv)."""
    clone = tmp_path / "clone"
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                            timeout=60)
    if listed.returncode != 0:
        pytest.skip("not a git checkout: no list of tracked files to copy")
    for rel in listed.stdout.decode().split("\0"):
        if rel and (ROOT / rel).is_file():
            (clone / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, clone / rel)
    proc = run_sh(block, clone, FRESH_CLONE_TIMEOUT)
    assert "params identical on all 2 ranks: OK" in proc.stdout, proc.stdout


# --- what needs the Docker engine --------------------------------------------------------


def _engine() -> object:
    """A Docker client of a Swarm manager, or skip (fail under CI=true), like tests/swarm."""
    def unavailable(reason: str) -> None:
        harness.unavailable(reason, what="the Swarm tests",
                            fix="run `sudo scripts/setup-docker.sh`")

    from tests.swarm.docker_setup import ensure_engine

    problem = ensure_engine()
    if problem:
        unavailable(problem)
    if os.geteuid() != 0:
        unavailable("the README's Swarm commands run scripts/setup-docker.sh, as root")
    import docker

    try:
        client = docker.from_env(timeout=60)
        client.ping()
    except docker.errors.DockerException as exc:
        unavailable(f"no Docker engine answers ({exc})")
    if client.info().get("Swarm", {}).get("LocalNodeState") != "active":
        unavailable("the Docker engine is not in a Swarm")
    return client


@contextlib.contextmanager
def _removing_new_jobs(client: object, also: tuple[str, ...] = ()):
    """Remove the jobs that appear while the block runs (and the named ones, before and
    after: a crashed earlier run may have left them)."""
    from swarmfd.swarm.engine import list_jobs, remove_job
    from swarmfd.swarm.errors import JobNotFoundError

    def remove(name: str) -> None:
        with contextlib.suppress(JobNotFoundError):
            remove_job(client, name, timeout=60)  # type: ignore[arg-type]

    for name in also:
        remove(name)
    before = {j.name for j in list_jobs(client)}  # type: ignore[arg-type]
    try:
        yield
    finally:
        for job in list_jobs(client):  # type: ignore[arg-type]
            if job.name not in before or job.name in also:
                remove(job.name)


@pytest.mark.swarm
@pytest.mark.parametrize("block", of_kind("swarm"), ids=lambda b: b.id)
def test_swarm_commands_run(block: Block) -> None:
    """The Swarm commands run as written against the real engine; every job they make
    is gone afterwards."""
    client = _engine()
    names = tuple(re.findall(r"--name (\S+)", block.body))
    with _removing_new_jobs(client, names):
        run_sh(block, ROOT, COMMAND_TIMEOUT)


@pytest.mark.swarm
@pytest.mark.parametrize("block", of_kind("swarm-torch"), ids=lambda b: b.id)
def test_swarm_torch_commands_run(block: Block) -> None:
    """The torch project is built, deployed, found up to date, and resumes after a
    failure, as written. Opt-in (SWARMFD_README_TORCH=1): the cold build of the torch
    image takes minutes, more than the CI can give it."""
    if os.environ.get("SWARMFD_README_TORCH") != "1":
        pytest.skip("the torch image build takes minutes: SWARMFD_README_TORCH=1 runs it")
    client = _engine()
    volumes = re.findall(r"--checkpoint-volume (\S+)", block.body)
    for volume in volumes:
        with contextlib.suppress(Exception):
            client.volumes.get(volume).remove(force=True)  # type: ignore[attr-defined]
    try:
        with _removing_new_jobs(client):
            proc = run_sh(block, ROOT, TORCH_TIMEOUT)
        assert "resumed from /checkpoints/torch_checkpoint.pt at epoch 4" in proc.stdout, \
            proc.stdout
        print(f"\n{block.id}:\n" + "\n".join(
            line for line in proc.stderr.splitlines()
            if re.search(r"built |up to date|restart|done:", line)))
    finally:
        for volume in volumes:
            with contextlib.suppress(Exception):
                client.volumes.get(volume).remove(force=True)  # type: ignore[attr-defined]
        for image in client.images.list(name="swarmfd-torch-project"):  # type: ignore[attr-defined]
            for tag in image.tags:
                with contextlib.suppress(Exception):
                    client.images.remove(tag, force=True)  # type: ignore[attr-defined]
