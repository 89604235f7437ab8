"""What ``swarmfd deploy`` (and ``swarmfd build``) is asked to do: one validated request.

:class:`DeployRequest` extends :class:`swarmfd.request.JobRequest` (what ``deploy``
shares with ``swarmfd run``) with the Swarm's options, each declared once as a field
(:func:`swarmfd.request.option`): the click layer (:mod:`swarmfd.swarm.cli`) makes the
command's options from them and builds the request; :func:`swarmfd.swarm.deploy.
run_deploy` takes it. On creation it checks every option and how they combine, and
makes the :class:`~.spec.JobSpec` (the job the engine is asked for) and the
:class:`~.build.BuildRequest` of ``--build``; its errors (ValueError, TypeError) name
the option. Nothing contacts an engine. To add an option to ``deploy``: a field here,
its check in ``__post_init__`` (or in JobSpec, if the job's spec carries it), and its use
in :mod:`.deploy`.

:class:`BuildChoices` is how a project is built, the options ``swarmfd build DIR`` and
``swarmfd deploy --build DIR`` share. The docker SDK (which :mod:`.build` imports) is
loaded only when a request is made, not to list the options.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from .. import __version__
from ..request import JobRequest, OptionSpec, option
from . import spec as spec_lib

if TYPE_CHECKING:
    from collections.abc import Mapping

    from .build import BuildRequest

__all__ = ["HOST", "KEEP_POLICIES", "BuildChoices", "DeployRequest"]

#: ``-H/--host``: the Docker host of every Swarm command.
HOST = OptionSpec(("-H", "--host"), metavar="URL",
                  help="Docker host of a Swarm manager, e.g. unix:///var/run/docker.sock or "
                       "tcp://manager:2376.  [default: $DOCKER_HOST, else the local socket]")
#: always: keep the finished job; never: remove it; on-failure: keep it only if a rank failed.
KEEP_POLICIES = ("on-failure", "always", "never")


def _flag(*decls: str, help: str) -> Any:
    return option(*decls, default=False, flag_value=True, help=help)


@dataclass(frozen=True, kw_only=True)
class BuildChoices:
    """How a project is built into an image (``swarmfd build``, ``deploy --build``)."""

    base: str | None = option("--base", metavar="IMAGE",
                              help="Image to build on: it has swarmfd and its entrypoint.  "
                                   "[default: swarmfd:latest]")
    extras: tuple[str, ...] = option(
        "--extra", multiple=True, metavar="NAME",
        help="Also install an extra: one of pyproject.toml's [project.optional-dependencies], "
             "or 'torch' (torch==2.13.0, the CPU wheel); repeatable.")
    wheelhouses: tuple[str, ...] = option(
        "--wheelhouse", multiple=True, metavar="DIR",
        help="Folder of wheels to install from (pip --find-links); repeatable.")
    no_index: bool = _flag("--no-index",
                           help="Offline: take wheels only from --wheelhouse folders (and "
                                "pip's configured find-links), never from a package index.")
    no_cpu_torch: bool = _flag("--no-cpu-torch",
                               help="Do not constrain torch to the CPU wheel torch==2.13.0+cpu "
                                    "(e.g. for a CUDA build pinned in your requirements).")
    repository: str | None = option("--image-name", metavar="REPO",
                                    help="Image repository (the tag is the content hash).  "
                                         "[default: swarmfd-<directory name>]")
    rebuild: bool = _flag("--rebuild", help="Build even when an image of the same content "
                                            "exists.")

    def given(self) -> bool:
        """Whether any of these options was given."""
        return self != BuildChoices()

    def request(self, directory: str) -> BuildRequest:
        """What to build from ``directory``; ValueError when the options do not fit."""
        from pathlib import Path

        from .build import DEFAULT_BASE_IMAGE, BuildError, BuildOptions, BuildRequest

        if self.no_index and not self.wheelhouses:
            raise ValueError("--no-index needs a --wheelhouse DIR to take the wheels from")
        try:
            return BuildRequest(
                directory=Path(directory), base=self.base or DEFAULT_BASE_IMAGE,
                repository=self.repository, extras=tuple(self.extras), rebuild=self.rebuild,
                options=BuildOptions(wheelhouses=tuple(Path(w) for w in self.wheelhouses),
                                     no_index=self.no_index, cpu_torch=not self.no_cpu_torch))
        except BuildError as exc:
            raise ValueError(str(exc)) from None


def parse_push(registry: str) -> str:
    """A ``--push`` registry, checked (ValueError naming it)."""
    from .build import BuildError, parse_registry

    try:
        return parse_registry(registry)
    except BuildError as exc:
        raise ValueError(str(exc)) from None


@dataclass(frozen=True, kw_only=True)
class DeployRequest(JobRequest):
    """``swarmfd deploy`` (see the module docstring): ``image`` is None with
    ``build_dir``; ``job`` (the JobSpec) and ``build_request`` are made from the rest."""

    RESERVED_ENV: ClassVar[Mapping[str, str]] = spec_lib.RESERVED_ENV

    image: str | None = None
    build_dir: str | None = option(
        "--build", metavar="DIR",
        help="Build DIR first (as `swarmfd build DIR`) and run that image; give no IMAGE "
             "then. The build options below apply.")
    build: BuildChoices = field(default_factory=BuildChoices, metadata={"group": BuildChoices})
    push: str | None = option(
        "--push", metavar="REGISTRY",
        help="Push the image to REGISTRY (HOST[:PORT][/PATH]) and run it from there: every "
             "node pulls it (what a Swarm of several nodes needs).")
    checkpoint_volume: str | None = option(
        "--checkpoint-volume", metavar="NAME",
        help="Mount the named volume NAME at /checkpoints in every rank and set "
             "SWARMFD_CHECKPOINT_DIR=/checkpoints, so checkpoints outlive the ranks "
             "(--max-restarts resumes from them). The volume is kept after the job.")
    name: str | None = option(
        "--name", metavar="NAME",
        help="Job name: lowercase letters, digits, '-'.  [default: swarmfd-<word>-<hex>]")
    mounts: tuple[str, ...] = option(
        "--mount", multiple=True, metavar="SPEC",
        help="Mount, Docker syntax: type=bind,src=/data,dst=/data[,readonly] or "
             "type=volume,src=NAME,dst=/path or type=tmpfs,dst=/tmp; repeatable.")
    workdir: str | None = option("-w", "--workdir", metavar="DIR",
                                 help="Working directory of the command in the container.")
    networks: tuple[str, ...] = option(
        "--network", multiple=True, metavar="NAME",
        help="Extra (overlay) network to attach the ranks to; repeatable.")
    constraints: tuple[str, ...] = option(
        "--constraint", multiple=True, metavar="EXPR",
        help="Placement constraint, e.g. node.labels.gpu==true; repeatable.")
    reserve_cpu: str | None = option("--reserve-cpu", metavar="CPUS",
                                     help="CPUs reserved per rank.")
    limit_cpu: str | None = option("--limit-cpu", metavar="CPUS", help="CPU limit per rank.")
    reserve_memory: str | None = option("--reserve-memory", metavar="SIZE",
                                        help="Memory reserved per rank, e.g. 512M or 2G.")
    limit_memory: str | None = option("--limit-memory", metavar="SIZE",
                                      help="Memory limit per rank, e.g. 512M or 2G.")
    generic_resources: tuple[str, ...] = option(
        "--generic-resource", multiple=True, metavar="KIND=N",
        help="Generic resource per rank that nodes advertise, e.g. gpu=1; repeatable.")
    labels: tuple[str, ...] = option("--label", multiple=True, metavar="KEY=VALUE",
                                     help="Label on the job's service and network; repeatable.")
    master_port: int = option(
        "--master-port", type=int, default=spec_lib.DEFAULT_MASTER_PORT, show_default=True,
        metavar="PORT",
        help="MASTER_PORT, torch.distributed's port on rank 0; swarmfd's rendezvous uses the "
             "next one (SWARMFD_PORT: set it with -e to choose another).")
    max_per_node: int | None = option("--max-per-node", type=int, metavar="K",
                                      help="At most K ranks on one node.")
    local_ranks: str = option(
        "--local-ranks", choices=spec_lib.LOCAL_RANK_MODES, default="container",
        show_default=True,
        help="LOCAL_RANK per container (0 of 1 in each) or per node (derived by swarmfd at "
             "rendezvous; read it with swarmfd.get_config().local_rank).")
    encrypt_network: bool = _flag(
        "--encrypt-network",
        help="Encrypt the job's overlay network between nodes (IPsec, Docker's 'encrypted' "
             "overlay option; every node's kernel needs ESP support).")
    pull: bool = _flag("--pull", help="IMAGE is in a registry every node can reach: let each "
                                      "node pull it (default: IMAGE must be on this node and "
                                      "runs by its ID).")
    detach: bool = _flag("-d", "--detach",
                         help="Create the job, print its name and return at once.")
    keep: bool = _flag("--keep",
                       help="Keep the job when it finishes, even if every rank succeeded.")
    remove: bool = _flag("--rm", help="Remove the job when it finishes, even if a rank failed.")
    host: str | None = option(*HOST.decls, metavar=HOST.metavar, help=HOST.help)

    job: spec_lib.JobSpec = field(init=False)
    build_request: BuildRequest | None = field(init=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_combinations()
        if self.push is not None:
            self._set("push", parse_push(self.push))
        self._set("job", self._job_spec())
        self._set("build_request", None if self.build_dir is None
                  else self.build.request(self.build_dir))

    def example(self) -> str:
        shown = f"--build {self.build_dir}" if self.build_dir is not None else self.image
        return f"swarmfd deploy {shown} -n {self.nproc} -- python train.py"

    def _check_combinations(self) -> None:
        if (self.image is None) == (self.build_dir is None):
            raise ValueError("give IMAGE or --build DIR (one of them)")
        if self.build_dir is None and self.build.given():
            raise ValueError("--base, --extra, --wheelhouse, --no-index, --no-cpu-torch, "
                             "--image-name and --rebuild apply to --build DIR")
        if self.push is not None and self.pull:
            raise ValueError("--push runs the image from the registry already: drop --pull")
        if self.keep and self.remove:
            raise ValueError("--keep and --rm contradict each other: give one")
        if self.detach and self.max_restarts:
            raise ValueError("--max-restarts needs deploy to follow the job (to restart it): "
                             "not with --detach")
        if self.detach and self.remove:
            raise ValueError("--rm needs deploy to follow the job: a detached job is kept "
                             "until `swarmfd rm NAME`")

    def _job_spec(self) -> spec_lib.JobSpec:
        """The job's spec: the spec's parsers and JobSpec's checks (each names its option)."""
        def parsed(parse: Any, value: str | None, option_name: str) -> Any:
            return None if value is None else parse(value, option_name)

        image = self.image if self.image is not None else f"(built from {self.build_dir})"
        # Variables of shared options the spec does not set itself (it sets the timeouts).
        options_env = {k: v for k, v in self.rank_env().items() if k not in self.RESERVED_ENV}
        return spec_lib.JobSpec(
            name=spec_lib.validate_job_name(self.name) if self.name is not None
            else spec_lib.generate_job_name(),
            image=image, image_ref=image,  # the image ID replaces it once the engine is asked
            world_size=self.nproc, command=self.command, env={**self.env, **options_env},
            mounts=tuple(spec_lib.parse_mount(m) for m in self.mounts),
            workdir=self.workdir, networks=tuple(self.networks),
            constraints=tuple(spec_lib.parse_constraint(c) for c in self.constraints),
            reserve_cpu=parsed(spec_lib.parse_cpus, self.reserve_cpu, "--reserve-cpu"),
            limit_cpu=parsed(spec_lib.parse_cpus, self.limit_cpu, "--limit-cpu"),
            reserve_memory=parsed(spec_lib.parse_memory, self.reserve_memory, "--reserve-memory"),
            limit_memory=parsed(spec_lib.parse_memory, self.limit_memory, "--limit-memory"),
            generic_resources=tuple(spec_lib.parse_generic_resource(g)
                                    for g in self.generic_resources),
            labels=spec_lib.parse_labels(self.labels), master_port=self.master_port,
            timeout=self.timeout, init_timeout=self.init_timeout,
            max_per_node=self.max_per_node, local_ranks=self.local_ranks,
            encrypt_network=self.encrypt_network,
            checkpoint_volume=None if self.checkpoint_volume is None
            else spec_lib.parse_checkpoint_volume(self.checkpoint_volume),
            version=__version__)

    @property
    def keep_policy(self) -> str:
        """One of KEEP_POLICIES: what becomes of the job once it finished."""
        return "always" if self.keep else "never" if self.remove else "on-failure"
