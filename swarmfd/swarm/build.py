"""``swarmfd build``: the user's project and its packages on top of the swarmfd image.

A *project* is a directory: scripts, and their requirements in ``requirements.txt``
and/or ``pyproject.toml`` (PEP 621; with a ``[build-system]`` the project is installed
as a package too). :func:`build_project` turns it into an image ``FROM`` the swarmfd
image (docs/swarm.md, "Your own code"):

1. a hash of the content (files, requirements, options, base image) tags it
   ``swarmfd-<dir>:<hash>``; an existing tag is not built again;
2. **this machine's** pip resolves the wheels for the base image's Python and platform,
   and they travel in the context: the build needs no network. The base's packages stay
   (stub wheels); torch is constrained to TORCH_CPU (PyPI's torch is the CUDA build);
3. a first stage installs the wheels under a staging root, kept as ``<repo>:deps`` (the
   layer cache); the final stage copies what it installed, and the project to
   ``/workspace``.

Progress goes to the ``progress`` callback; nothing here prints.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import zipfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import docker
import docker.errors
from docker.utils.build import PatternMatcher

from .errors import SwarmJobError

__all__ = ["BUILTIN_EXTRAS", "DEFAULT_BASE_IMAGE", "TORCH_CPU", "BuildError", "BuildOptions",
           "BuildRequest", "BuiltImage", "Project", "Target", "build_project", "content_hash",
           "dockerfile", "parse_registry", "push_image", "read_project", "repository_for"]

#: Bump when the generated Dockerfile or the context layout changes (it is in the hash).
RECIPE = 1
DEFAULT_BASE_IMAGE = "swarmfd:latest"
WORKDIR = "/workspace"
#: The CPU build of torch, as scripts/test.sh pins it (``+cpu`` tells it from PyPI's CUDA one).
TORCH_CPU = "torch==2.13.0+cpu"
#: ``--extra NAME`` when the project's pyproject.toml does not define that extra.
BUILTIN_EXTRAS: dict[str, tuple[str, ...]] = {"torch": ("torch==2.13.0",)}
#: Where PyTorch serves its CPU wheels (named in an error; never contacted by swarmfd).
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"

LABEL_PROJECT = "org.swarmfd.build.project"
LABEL_CONTENT = "org.swarmfd.build.content"
LABEL_DEPS = "org.swarmfd.build.deps"

#: Never part of a project's image (on top of the project's own .dockerignore).
DEFAULT_EXCLUDES = (
    ".git", ".hg", ".svn", "**/__pycache__", "**/*.pyc", "**/*.pyo", ".venv", "venv",
    ".tox", ".nox", ".mypy_cache", ".pytest_cache", ".ruff_cache", "**/*.egg-info",
    ".ipynb_checkpoints", ".DS_Store",
)
#: A context larger than this gets a warning (it is sent to the engine on every build).
LARGE_CONTEXT = 500 * 1024 * 1024
#: pip's dependency resolution against an index took 2-8 s here; a slow index gets time.
PIP_TIMEOUT = 1800.0
#: The probe container (``python -c ...`` in the base image) took about 1.5 s here.
PROBE_TIMEOUT = 120.0

_REPO_COMPONENT = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*$")
_REGISTRY_HOST = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?(?::\d{1,5})?$")


class BuildError(SwarmJobError):
    """The project cannot be built into an image (the message says what to do)."""


# --- the project (pure) ----------------------------------------------------------------


@dataclass(frozen=True)
class Project:
    """A project directory as ``swarmfd build`` sees it: ``files``, the sorted relative
    POSIX paths that go in; ``requirements``, pyproject.toml's (with the extras);
    ``requirements_file``, ``requirements.txt`` if any; ``installable``, it has a
    ``[build-system]``."""

    root: Path
    name: str
    files: tuple[str, ...]
    requirements: tuple[str, ...] = ()
    requirements_file: str | None = None
    installable: bool = False
    extras: tuple[str, ...] = ()


def _read_pyproject(root: Path, extras: Sequence[str]) -> tuple[str | None, tuple[str, ...],
                                                                bool, list[str]]:
    """(project name, requirements, installable, extras left for BUILTIN_EXTRAS)."""
    path = root / "pyproject.toml"
    if not path.is_file():
        return None, (), False, list(extras)
    try:
        import tomllib
    except ImportError:  # Python 3.10
        raise BuildError(f"reading {path} needs Python 3.11 or newer (tomllib): list the "
                         "requirements in requirements.txt instead") from None
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise BuildError(f"{path} cannot be read: {exc}") from None
    project = data.get("project")
    if not isinstance(project, dict):
        if (root / "requirements.txt").is_file():
            return None, (), False, list(extras)
        raise BuildError(
            f"{path} has no [project] table (PEP 621), so swarmfd cannot tell the project's "
            "dependencies: add one, or list them in requirements.txt beside it"
        )
    if "dependencies" in (project.get("dynamic") or []):
        raise BuildError(
            f"{path} declares its dependencies dynamic, so they are known only to its build "
            "backend: list them in [project] dependencies, or in requirements.txt"
        )
    requirements = [str(r) for r in project.get("dependencies") or []]
    optional = project.get("optional-dependencies") or {}
    left = []
    for extra in extras:
        if extra in optional:
            requirements += [str(r) for r in optional[extra]]
        else:
            left.append(extra)
    installable = isinstance(data.get("build-system"), dict)
    name = project.get("name")
    return (str(name) if name else None), tuple(requirements), installable, left


def _ignore_patterns(root: Path) -> list[str]:
    patterns = list(DEFAULT_EXCLUDES)
    ignore = root / ".dockerignore"
    if ignore.is_file():
        for line in ignore.read_text(encoding="utf-8", errors="replace").splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                patterns.append(line)
    return patterns


def read_project(directory: str | os.PathLike[str], extras: Sequence[str] = ()) -> Project:
    """Read a project directory; ``extras`` from pyproject.toml's
    ``[project.optional-dependencies]`` or :data:`BUILTIN_EXTRAS`. Raises
    :class:`BuildError` for a missing directory, an unknown extra, bad requirements."""
    root = Path(directory).expanduser().resolve()
    if not root.is_dir():
        raise BuildError(f"project directory {str(directory)!r} does not exist (or is not a "
                         "directory): give the folder that holds your script and its "
                         "requirements.txt or pyproject.toml")
    extras = list(dict.fromkeys(extras))
    for extra in extras:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", extra):
            raise BuildError(f"--extra {extra!r} is not an extra's name (e.g. --extra torch)")
    name, requirements, installable, left = _read_pyproject(root, extras)
    unknown = [e for e in left if e not in BUILTIN_EXTRAS]
    if unknown:
        known = sorted(BUILTIN_EXTRAS)
        raise BuildError(
            f"--extra {unknown[0]}: not an extra of {root / 'pyproject.toml'} nor one swarmfd "
            f"knows ({', '.join(known)}); add it under [project.optional-dependencies] or "
            "put the package in requirements.txt"
        )
    for extra in left:
        requirements += BUILTIN_EXTRAS[extra]
    requirements_file = "requirements.txt" if (root / "requirements.txt").is_file() else None
    matcher = PatternMatcher(_ignore_patterns(root))
    files = []
    for rel in matcher.walk(str(root)):
        path = root / rel
        if rel == ".dockerignore":  # the SDK's matcher always keeps it, as docker does
            continue
        if path.is_file() or path.is_symlink():
            files.append(PurePosixPath(Path(rel)).as_posix())
    return Project(root=root, name=name or root.name, files=tuple(sorted(files)),
                   requirements=tuple(requirements), requirements_file=requirements_file,
                   installable=installable, extras=tuple(extras))


def repository_for(project: Project) -> str:
    """The image repository of a project: ``swarmfd-<name>``, as Docker allows it."""
    slug = re.sub(r"[^a-z0-9]+", "-", project.name.lower()).strip("-") or "project"
    repo = slug if slug.startswith("swarmfd-") else f"swarmfd-{slug}"
    return repo[:100].rstrip("-")


def validate_repository(repo: str) -> str:
    """Check a ``--name`` for the image: lowercase path components (Docker's rules)."""
    parts = repo.split("/")
    if not repo or not all(_REPO_COMPONENT.match(p) for p in parts):
        raise BuildError(
            f"image name {repo!r} is not a valid repository: lowercase letters, digits and "
            "separators (. _ -), e.g. my-project or team/my-project (no tag: swarmfd adds one)"
        )
    return repo


@dataclass(frozen=True)
class BuildOptions:
    """How wheels are found: ``wheelhouses`` (pip ``--find-links``), ``no_index`` (no
    index at all), ``cpu_torch`` (constrain torch to :data:`TORCH_CPU`)."""

    wheelhouses: tuple[Path, ...] = ()
    no_index: bool = False
    cpu_torch: bool = True

    def __post_init__(self) -> None:
        resolved = []
        for wh in self.wheelhouses:
            path = Path(wh).expanduser().resolve()
            if not path.is_dir():
                raise BuildError(f"--wheelhouse {str(wh)!r}: no such directory (a folder of "
                                 ".whl files, e.g. from `pip download -d DIR PACKAGE`)")
            resolved.append(path)
        object.__setattr__(self, "wheelhouses", tuple(resolved))


@dataclass(frozen=True)
class BuildRequest:
    """What to build (``swarmfd build`` / ``swarmfd deploy --build``): the keyword
    arguments of :func:`build_project` besides the client and the progress callback."""

    directory: Path
    base: str = DEFAULT_BASE_IMAGE
    repository: str | None = None
    extras: tuple[str, ...] = ()
    options: BuildOptions = field(default_factory=BuildOptions)
    rebuild: bool = False

    def __post_init__(self) -> None:
        if self.repository is not None:
            validate_repository(self.repository)


def _file_digest(path: Path) -> str:
    if path.is_symlink():
        return "link:" + os.readlink(path)
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def content_hash(project: Project, base_id: str, options: BuildOptions) -> str:
    """SHA-256 of everything that decides the image: recipe, base image ID, every file's
    path, mode and content, requirements, extras, wheel options and wheelhouse listings."""
    digest = hashlib.sha256()

    def add(*parts: object) -> None:
        digest.update(json.dumps([str(p) for p in parts]).encode() + b"\n")

    add("recipe", RECIPE)
    add("base", base_id)
    add("requirements", *project.requirements)
    add("extras", *project.extras)
    add("installable", project.installable)
    add("options", options.no_index, options.cpu_torch)
    for wh in options.wheelhouses:
        add("wheelhouse", wh, *sorted(f"{p.name}:{p.stat().st_size}" for p in wh.iterdir()
                                      if p.suffix == ".whl"))
    for rel in project.files:
        path = project.root / rel
        mode = 0o755 if os.access(path, os.X_OK) and not path.is_symlink() else 0o644
        add("file", rel, oct(mode), _file_digest(path))
    return digest.hexdigest()


# --- the base image as a pip target ----------------------------------------------------


@dataclass(frozen=True)
class Target:
    """The base image's Python, as pip needs it to pick wheels for it."""

    python: str  # "3.11"
    implementation: str  # "cp"
    machine: str  # "x86_64"
    glibc: tuple[int, int] | None  # (2, 36); None: not glibc (musl: unsupported here)
    executable: str  # the image's python, e.g. /opt/venv/bin/python
    installed: dict[str, str] = field(default_factory=dict)  # normalized name -> version
    has_pip: bool = True

    @property
    def abi(self) -> str:
        return f"{self.implementation}{self.python.replace('.', '')}"

    def platforms(self) -> list[str]:
        """pip ``--platform`` tags, most specific first (``manylinux_2_<glibc>`` down to
        ``manylinux_2_17`` and the legacy aliases, then ``linux_<machine>``)."""
        if self.glibc is None:
            raise BuildError(
                "the base image's Python is not linked against glibc (Alpine/musl?): "
                "swarmfd build picks manylinux wheels; use a glibc base such as the swarmfd "
                "image"
            )
        major, minor = self.glibc
        tags = [f"manylinux_{major}_{m}_{self.machine}" for m in range(minor, 16, -1)]
        tags += [f"manylinux2014_{self.machine}", f"manylinux2010_{self.machine}",
                 f"manylinux1_{self.machine}", f"linux_{self.machine}"]
        return tags


_PROBE = r"""
import importlib.metadata as md, json, platform, sys
libc, version = platform.libc_ver()
installed = {}
for dist in md.distributions():
    name = dist.metadata["Name"]
    if name:
        installed[name] = dist.version
try:
    import pip  # noqa: F401
    has_pip = True
except ImportError:
    has_pip = False
print(json.dumps({"python": "%d.%d" % sys.version_info[:2],
                  "implementation": sys.implementation.name,
                  "machine": platform.machine(), "libc": libc, "libc_version": version,
                  "executable": sys.executable, "installed": installed,
                  "has_pip": has_pip}))
"""


def normalize_name(name: str) -> str:
    """PEP 503 normalized project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def target_from_probe(data: dict[str, Any]) -> Target:
    """A :class:`Target` from the probe's JSON (pure, for tests)."""
    impl = {"cpython": "cp", "pypy": "pp"}.get(str(data.get("implementation")), "")
    if not impl:
        raise BuildError(f"the base image runs {data.get('implementation')!r}, not CPython")
    glibc = None
    if data.get("libc") == "glibc":
        m = re.match(r"(\d+)\.(\d+)", str(data.get("libc_version", "")))
        if m:
            glibc = (int(m.group(1)), int(m.group(2)))
    installed = {normalize_name(k): str(v) for k, v in (data.get("installed") or {}).items()}
    return Target(python=str(data["python"]), implementation=impl,
                  machine=str(data.get("machine") or "x86_64"), glibc=glibc,
                  executable=str(data.get("executable") or "python"), installed=installed,
                  has_pip=bool(data.get("has_pip", True)))


def probe_base(client: docker.DockerClient, image_id: str) -> Target:
    """Ask the base image for its Python, platform and installed distributions (runs
    one throw-away container, about 1.5 s)."""
    container = None
    try:
        container = client.containers.create(image_id, entrypoint=["python", "-c", _PROBE],
                                             command=[], network_disabled=True,
                                             labels={LABEL_PROJECT: "probe"})
        container.start()
        result = container.wait(timeout=PROBE_TIMEOUT)
        out = container.logs(stdout=True, stderr=False).decode(errors="replace")
        err = container.logs(stdout=False, stderr=True).decode(errors="replace")
    except docker.errors.DockerException as exc:
        raise BuildError(f"cannot run Python in the base image {image_id[:19]}: {exc}") from None
    finally:
        if container is not None:
            with contextlib.suppress(docker.errors.DockerException):
                container.remove(force=True)
    if result.get("StatusCode") != 0:
        raise BuildError(f"the base image's `python` failed (exit {result.get('StatusCode')}): "
                         f"{err.strip()[-500:]}; the base must have python on its PATH")
    try:
        return target_from_probe(json.loads(out.strip().splitlines()[-1]))
    except (ValueError, IndexError, KeyError) as exc:
        raise BuildError(f"unexpected answer from the base image's python: {out[-300:]!r} "
                         f"({exc})") from None


# --- wheels (this machine's pip) -------------------------------------------------------


def _stub_wheel(directory: Path, name: str, version: str, tag: str) -> Path:
    """A metadata-only wheel standing for a distribution the base image has: its build
    tag and the target's best tag make pip prefer it to any index's, so nothing is
    downloaded for the base's packages (even those no index has, like swarmfd)."""
    dist = re.sub(r"[-_.]+", "_", name)
    filename = f"{dist}-{version}-0swarmfdbase-{tag}.whl"
    path = directory / filename
    info = f"{dist}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{info}/METADATA",
                    f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        zf.writestr(f"{info}/WHEEL", f"Wheel-Version: 1.0\nGenerator: swarmfd\n"
                                      f"Root-Is-Purelib: false\nTag: {tag}\n"
                                      f"Build: 0swarmfdbase\n")
        zf.writestr(f"{info}/RECORD", "")
    return path


def _pip_hint(stderr: str, options: BuildOptions) -> str:
    unresolved = any(s in stderr for s in ("No matching distribution", "ResolutionImpossible",
                                           "Could not find a version"))
    if options.cpu_torch and unresolved and "torch" in stderr.lower():
        return (f" torch is constrained to its CPU build ({TORCH_CPU}), which pip did not find "
                f"(or which your requirements exclude): point pip at the PyTorch CPU wheels "
                f"(PIP_EXTRA_INDEX_URL={TORCH_CPU_INDEX}) or put the wheel in a folder given "
                "with --wheelhouse; for another torch, pass --no-cpu-torch and pin it in your "
                "requirements.")
    if "No matching distribution" in stderr or "Could not find a version" in stderr:
        where = "the --wheelhouse folders" if options.no_index else \
            "your package index and --wheelhouse folders"
        return (f" A package (or a version of it) is not in {where} as a wheel for the base "
                "image's Python: `swarmfd build` installs wheels only (no compiler in the "
                "image); build one with `pip wheel -w DIR PACKAGE` and pass --wheelhouse DIR.")
    if "ResolutionImpossible" in stderr or "conflict" in stderr.lower():
        return (" The requirements conflict with each other or with the base image's "
                "packages, which stay at their versions (swarmfd, numpy, pyzmq, click, "
                "docker and their dependencies)"
                + (f", or with the CPU torch pin {TORCH_CPU} (--no-cpu-torch lifts it)"
                   if options.cpu_torch else "") + ".")
    return ""


def resolve_wheels(project: Project, target: Target, options: BuildOptions, dest: Path,
                   progress: Callable[[str], None],
                   pip: Sequence[str] = (sys.executable, "-m", "pip")) -> list[Path]:
    """Every wheel the project needs beyond the base image's, for its Python and
    platform, into ``dest`` by this machine's ``pip download`` (wheels only: the build
    runs no compiler)."""
    if not project.requirements and not project.requirements_file:
        return []
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="swarmfd-build-pip-") as tmp:
        stubs = Path(tmp) / "base"
        stubs.mkdir()
        best_tag = f"{target.abi}-{target.abi}-{target.platforms()[0]}"
        stub_names = set()
        constraints = []
        for name, version in sorted(target.installed.items()):
            stub_names.add(_stub_wheel(stubs, name, version, best_tag).name)
            constraints.append(f"{name}=={version}")
        if options.cpu_torch and "torch" not in target.installed:
            constraints.append(TORCH_CPU)
        constraint_file = Path(tmp) / "constraints.txt"
        constraint_file.write_text("\n".join(constraints) + "\n", encoding="utf-8")
        argv = [*pip, "download", "--dest", str(dest), "--only-binary=:all:",
                "--disable-pip-version-check", "--progress-bar", "off",
                "--python-version", target.python, "--implementation", target.implementation,
                "--abi", target.abi, "-c", str(constraint_file), "--find-links", str(stubs)]
        for platform in target.platforms():
            argv += ["--platform", platform]
        for wh in options.wheelhouses:
            argv += ["--find-links", str(wh)]
        if options.no_index:
            argv.append("--no-index")
        if project.requirements_file:
            argv += ["-r", str(project.root / project.requirements_file)]
        argv += list(project.requirements)
        progress("resolving wheels with this machine's pip for the image's Python "
                 f"{target.python} ({target.platforms()[0]})"
                 + (", offline: --wheelhouse only" if options.no_index else ""))
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, cwd=project.root)
        errors: list[str] = []

        def drain_stderr() -> None:
            assert proc.stderr is not None
            errors.extend(proc.stderr)

        reader = threading.Thread(target=drain_stderr, daemon=True)
        reader.start()
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                line = line.strip()
                if line.startswith(("Collecting ", "Processing ", "Downloading ")) \
                        and "swarmfdbase" not in line:
                    progress(f"pip: {line}")
            proc.wait(timeout=PIP_TIMEOUT)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        reader.join(10)
        if proc.returncode != 0:
            err = "".join(e for e in errors if "is ignored: it is neither" not in e).strip()
            raise BuildError(f"pip could not get the project's wheels (exit "
                             f"{proc.returncode}):\n{err[-3000:]}\n{_pip_hint(err, options)}")
    wheels = []
    for path in sorted(dest.iterdir()):
        if path.name in stub_names:
            path.unlink()
            continue
        if path.suffix != ".whl":
            raise BuildError(f"pip produced {path.name}, which is not a wheel")
        wheels.append(path)
    return wheels


def build_project_wheel(project: Project, options: BuildOptions, dest: Path,
                        progress: Callable[[str], None],
                        pip: Sequence[str] = (sys.executable, "-m", "pip")) -> Path:
    """Build the project's own wheel (no dependencies) with this machine's pip."""
    dest.mkdir(parents=True, exist_ok=True)
    argv = [*pip, "wheel", "--no-deps", "--disable-pip-version-check", "--wheel-dir",
            str(dest), str(project.root)]
    for wh in options.wheelhouses:
        argv += ["--find-links", str(wh)]
    if options.no_index:
        argv.append("--no-index")
    progress(f"building the project's own wheel ({project.name})")
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=PIP_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise BuildError(f"pip wheel of {project.root} did not finish in "
                         f"{PIP_TIMEOUT:.0f} s") from None
    if proc.returncode != 0:
        raise BuildError(f"pip could not build the project {project.root} as a package "
                         f"(exit {proc.returncode}):\n{proc.stderr.strip()[-3000:]}\n(its "
                         "build backend, e.g. setuptools, must be on your index or in a "
                         "--wheelhouse)")
    built = sorted(dest.glob("*.whl"))
    if len(built) != 1:
        raise BuildError(f"pip wheel of {project.root} made {len(built)} wheels, expected 1")
    return built[0]


# --- the Dockerfile and the context (pure) ---------------------------------------------


def dockerfile(base_ref: str, target: Target, *, deps_hash: str | None, project_wheel: str | None,
               labels: dict[str, str]) -> str:
    """The generated Dockerfile. ``deps_hash`` is None without dependency wheels."""
    py = target.executable
    pip_flags = ("--no-index --no-cache-dir --disable-pip-version-check --quiet "
                 "--no-warn-script-location")
    lines = [f"# generated by swarmfd build (recipe {RECIPE})"]
    if deps_hash is not None:
        lines += [
            f"FROM {base_ref} AS deps",
            f'LABEL {LABEL_DEPS}="{deps_hash}"',
            "COPY wheels/ /tmp/swarmfd-wheels/",
            # A staging root: the final stage copies installed files, never the wheels.
            f"RUN {py} -m pip install {pip_flags} --find-links /tmp/swarmfd-wheels "
            "--root /tmp/swarmfd-root /tmp/swarmfd-wheels/*.whl",
        ]
    lines.append(f"FROM {base_ref}")
    if deps_hash is not None:
        lines.append("COPY --from=deps /tmp/swarmfd-root/ /")
    lines.append(f"COPY project/ {WORKDIR}/")
    if project_wheel:
        lines += ["COPY own/ /tmp/swarmfd-own/",
                  f"RUN {py} -m pip install {pip_flags} --no-deps /tmp/swarmfd-own/"
                  f"{project_wheel} && rm -rf /tmp/swarmfd-own"]
    if target.has_pip and (deps_hash is not None or project_wheel):
        lines.append(f"RUN {py} -m pip check --disable-pip-version-check")
    lines.append(f"WORKDIR {WORKDIR}")
    label_text = " ".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    lines.append(f"LABEL {label_text}")
    return "\n".join(lines) + "\n"


def _tarinfo(name: str, size: int, mode: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mode = mode
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    info.mtime = 0
    return info


def write_context(fileobj: Any, project: Project, dockerfile_text: str,
                  wheels: Iterable[Path], project_wheel: Path | None) -> None:
    """Write the build context (an uncompressed tar) to ``fileobj``: ``Dockerfile``,
    ``wheels/``, ``own/`` (the project's wheel) and ``project/`` (its files)."""
    with tarfile.open(fileobj=fileobj, mode="w", format=tarfile.PAX_FORMAT) as tar:
        data = dockerfile_text.encode()
        tar.addfile(_tarinfo("Dockerfile", len(data), 0o644), io.BytesIO(data))
        for name in ("wheels", "own", "project"):
            info = _tarinfo(name + "/", 0, 0o755)
            info.type = tarfile.DIRTYPE
            tar.addfile(info)
        for wheel in wheels:
            with wheel.open("rb") as fh:
                tar.addfile(_tarinfo(f"wheels/{wheel.name}", wheel.stat().st_size, 0o644), fh)
        if project_wheel is not None:
            with project_wheel.open("rb") as fh:
                tar.addfile(_tarinfo(f"own/{project_wheel.name}", project_wheel.stat().st_size,
                                     0o644), fh)
        for rel in project.files:
            path = project.root / rel
            arcname = f"project/{rel}"
            if path.is_symlink():
                info = _tarinfo(arcname, 0, 0o777)
                info.type = tarfile.SYMTYPE
                info.linkname = os.readlink(path)
                tar.addfile(info)
                continue
            mode = 0o755 if os.access(path, os.X_OK) else 0o644
            with path.open("rb") as fh:
                tar.addfile(_tarinfo(arcname, path.stat().st_size, mode), fh)


# --- building ---------------------------------------------------------------------------


@dataclass
class BuiltImage:
    """What :func:`build_project` made (or found)."""

    repository: str
    tag: str
    image_id: str
    cached: bool  # the image existed: nothing was built
    seconds: float = 0.0
    context_bytes: int = 0
    wheels: int = 0
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def ref(self) -> str:
        """``repository:tag``."""
        return f"{self.repository}:{self.tag}"


_NOISE = re.compile(r"^( ---> |Removing intermediate container|Successfully built )")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _stream_build(events: Iterator[dict[str, Any]], progress: Callable[[str], None]) -> str:
    """Relay the engine's build events; return the built image's ID."""
    image_id = ""
    tail: list[str] = []
    for event in events:
        if "error" in event:
            detail = (event.get("errorDetail") or {}).get("message") or event["error"]
            raise BuildError(f"the image build failed: {str(detail).strip()}\n"
                             + "\n".join(tail[-15:]))
        aux = event.get("aux")
        if isinstance(aux, dict) and aux.get("ID"):
            image_id = str(aux["ID"])
        text = event.get("stream")
        if not text:
            continue
        for line in _ANSI.sub("", str(text)).splitlines():
            line = line.rstrip()
            if not line.strip():
                continue
            m = re.match(r"^Successfully built ([0-9a-f]+)$", line)
            if m and not image_id:
                image_id = m.group(1)
            tail.append(line)
            if line.startswith(" ---> Using cache"):
                progress("  (cached)")
            elif not _NOISE.match(line):
                progress(line if line.startswith("Step ") else f"  {line}")
    if not image_id:
        raise BuildError("the engine reported no image ID for the build:\n"
                         + "\n".join(tail[-15:]))
    return image_id


def _base_image(client: docker.DockerClient, base: str) -> Any:
    try:
        return client.images.get(base)
    except docker.errors.ImageNotFound:
        raise BuildError(
            f"the base image {base!r} is not on this engine: build it with "
            "`scripts/setup-docker.sh` (as root; it makes swarmfd:latest) or "
            "`docker build -t swarmfd .` in swarmfd's checkout, or pass --base IMAGE "
            "(an image with swarmfd and its entrypoint)"
        ) from None
    except docker.errors.APIError as exc:
        raise BuildError(f"the base image {base!r} cannot be looked up: {exc}") from None


def build_project(client: docker.DockerClient, directory: str | os.PathLike[str], *,
                  base: str = DEFAULT_BASE_IMAGE, repository: str | None = None,
                  extras: Sequence[str] = (), options: BuildOptions | None = None,
                  rebuild: bool = False,
                  progress: Callable[[str], None] = lambda line: None) -> BuiltImage:
    """Build (or find: ``cached``, unless ``rebuild``) the image of the project in
    ``directory`` on ``client``'s engine. Raises :class:`BuildError`."""
    started = time.monotonic()
    options = options or BuildOptions()
    project = read_project(directory, extras)
    repo = validate_repository(repository) if repository else repository_for(project)
    base_image = _base_image(client, base)
    base_id = str(base_image.id)
    timings: dict[str, float] = {}
    full_hash = content_hash(project, base_id, options)
    tag = full_hash[:12]
    timings["hash"] = time.monotonic() - started
    if not rebuild:
        with contextlib.suppress(docker.errors.ImageNotFound):
            found = client.images.get(f"{repo}:{tag}")
            progress(f"{repo}:{tag} is up to date (same files, requirements and base "
                     f"image): nothing to build")
            return BuiltImage(repo, tag, str(found.id), cached=True,
                              seconds=time.monotonic() - started, timings=timings)
    progress(f"building {repo}:{tag} from {project.root} ({len(project.files)} files) on "
             f"{base} ({base_id[:19]})")
    mark = time.monotonic()
    target = probe_base(client, base_id)
    timings["probe"] = time.monotonic() - mark
    with tempfile.TemporaryDirectory(prefix="swarmfd-build-") as tmp:
        mark = time.monotonic()
        wheels = resolve_wheels(project, target, options, Path(tmp) / "wheels", progress)
        own = build_project_wheel(project, options, Path(tmp) / "own", progress) \
            if project.installable else None
        timings["wheels"] = time.monotonic() - mark
        deps_hash = None
        if wheels:
            digest = hashlib.sha256()
            for wheel in wheels:
                digest.update(wheel.name.encode() + b"\0" + _file_digest(wheel).encode())
            deps_hash = digest.hexdigest()
            size = sum(w.stat().st_size for w in wheels)
            progress(f"{len(wheels)} wheel(s), {size / 1e6:.1f} MB, go into the build: "
                     + ", ".join(w.name.split("-")[0] + " " + w.name.split("-")[1]
                                 for w in wheels))
        labels = {LABEL_PROJECT: project.name, LABEL_CONTENT: full_hash}
        text = dockerfile(base_id, target, deps_hash=deps_hash,
                          project_wheel=own.name if own else None, labels=labels)
        mark = time.monotonic()
        context_path = Path(tmp) / "context.tar"
        with context_path.open("w+b") as ctx:
            write_context(ctx, project, text, wheels, own)
            context_bytes = ctx.tell()
            if context_bytes > LARGE_CONTEXT:
                progress(f"warning: the build context is {context_bytes / 1e6:.0f} MB; list "
                         "data and outputs in the project's .dockerignore")
            ctx.seek(0)
            timings["context"] = time.monotonic() - mark
            mark = time.monotonic()
            try:
                events = client.api.build(fileobj=ctx, custom_context=True,
                                          tag=f"{repo}:{tag}", rm=True, forcerm=True,
                                          decode=True)
                image_id = _stream_build(events, progress)
            except docker.errors.APIError as exc:
                raise BuildError(f"the engine refused the build: {exc}") from None
        timings["build"] = time.monotonic() - mark
    if deps_hash is not None:
        _keep_deps_stage(client, repo, deps_hash)
    found = client.images.get(f"{repo}:{tag}")
    seconds = time.monotonic() - started
    progress(f"built {repo}:{tag} ({str(found.id)[:19]}, "
             f"{(found.attrs.get('Size') or 0) / 1e6:.0f} MB) in {seconds:.1f} s")
    return BuiltImage(repo, tag, str(found.id) or image_id, cached=False, seconds=seconds,
                      context_bytes=context_bytes, wheels=len(wheels), timings=timings)


def _keep_deps_stage(client: docker.DockerClient, repo: str, deps_hash: str) -> None:
    """Tag the dependency stage ``<repo>:deps`` (the next build's cache) and remove the
    one it replaces."""
    stages = client.api.images(filters={"label": f"{LABEL_DEPS}={deps_hash}"})
    if not stages:
        return
    newest = max(stages, key=lambda s: s.get("Created", 0))
    previous = None
    with contextlib.suppress(docker.errors.ImageNotFound):
        previous = str(client.images.get(f"{repo}:deps").id)
    client.api.tag(newest["Id"], repo, "deps")
    if previous and previous != newest["Id"]:
        with contextlib.suppress(docker.errors.APIError):
            client.api.remove_image(previous)


# --- pushing ----------------------------------------------------------------------------


def parse_registry(text: str) -> str:
    """Check a ``--push`` registry: ``HOST[:PORT][/PATH]`` (no scheme, no tag)."""
    value = text.strip().rstrip("/")
    if "://" in value:
        raise ValueError(f"--push {text!r}: give the registry without a scheme, e.g. "
                         "registry.example.com:5000 or registry.example.com/team")
    host, _, path = value.partition("/")
    if not _REGISTRY_HOST.match(host) or ("." not in host and ":" not in host
                                          and host != "localhost"):
        raise ValueError(
            f"--push {text!r}: expected a registry HOST[:PORT][/PATH] (a host with a dot "
            "or a port, or localhost), e.g. registry.example.com:5000"
        )
    if path and not all(_REPO_COMPONENT.match(p) for p in path.split("/")):
        raise ValueError(f"--push {text!r}: the path after the host must be lowercase "
                         "repository components, e.g. registry.example.com/team")
    return value


def _push_hint(message: str, registry: str) -> str:
    host = registry.split("/")[0]
    if "HTTP response to HTTPS client" in message or "server gave HTTP" in message:
        return (f" The registry {host} speaks plain HTTP: add it to \"insecure-registries\" "
                "in /etc/docker/daemon.json (then restart dockerd) on this node and on every "
                "node that pulls, or serve it with TLS.")
    if "no basic auth credentials" in message or "unauthorized" in message.lower() \
            or "denied" in message.lower():
        return f" Log in first: `docker login {host}`."
    if "connection refused" in message or "no such host" in message \
            or "i/o timeout" in message:
        return f" Nothing answers at {host} from this engine: check the address and port."
    return ""


def push_image(client: docker.DockerClient, image: str, registry: str, *,
               progress: Callable[[str], None] = lambda line: None) -> str:
    """Push ``image`` (``repo:tag``) to ``registry``; the reference every node can pull,
    ``<registry>/<repo>:<tag>@sha256:...``."""
    registry = parse_registry(registry)
    if image.startswith("sha256:") or "@" in image:
        raise BuildError(f"cannot push {image!r}: give the image by name, REPOSITORY[:TAG]")
    repo, sep, tag = image.rpartition(":")
    if not sep or "/" in tag:  # no tag (a ':' only in the registry's port, if any)
        repo, tag = image, "latest"
    parts = repo.split("/")
    if len(parts) > 1 and ("." in parts[0] or ":" in parts[0] or parts[0] == "localhost"):
        parts = parts[1:]  # the image names another registry already: keep its path only
    remote = f"{registry}/{'/'.join(parts)}"
    try:
        client.api.tag(image, remote, tag)
    except docker.errors.APIError as exc:
        raise BuildError(f"cannot tag {image} as {remote}:{tag}: {exc}") from None
    progress(f"pushing {remote}:{tag}")
    started = time.monotonic()
    digest = ""
    seen: set[tuple[str, str]] = set()
    try:
        for event in client.api.push(remote, tag, stream=True, decode=True):
            if "error" in event:
                message = str((event.get("errorDetail") or {}).get("message") or event["error"])
                raise BuildError(f"push of {remote}:{tag} failed: {message}."
                                 + _push_hint(message, registry))
            aux = event.get("aux")
            if isinstance(aux, dict) and aux.get("Digest"):
                digest = str(aux["Digest"])
            status, layer = str(event.get("status", "")), str(event.get("id", ""))
            shown = status in ("Pushed", "Layer already exists") \
                or status.startswith("Mounted from")
            if shown and (layer, status) not in seen:
                seen.add((layer, status))
                progress(f"  {layer}: {status}")
    except docker.errors.APIError as exc:
        message = str(getattr(exc, "explanation", None) or exc)
        raise BuildError(f"push of {remote}:{tag} failed: {message}."
                         + _push_hint(message, registry)) from None
    if not digest:
        raise BuildError(f"push of {remote}:{tag} reported no digest")
    progress(f"pushed {remote}:{tag} ({digest[:19]}) in {time.monotonic() - started:.1f} s")
    return f"{remote}:{tag}@{digest}"
