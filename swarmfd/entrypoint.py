"""The container entrypoint: a Swarm task's place in the job -> the env contract -> exec.

The swarmfd image runs ``python -m swarmfd.entrypoint COMMAND...``; each replica of a
Swarm service is one rank. Swarm cannot compute ``RANK``, but expands templates in a
service's environment and hostname, so the service (``swarmfd deploy``, a stack file)
sets ``SWARMFD_TASK_SLOT={{.Task.Slot}}`` (1..replicas), ``WORLD_SIZE`` (the replicas),
``MASTER_ADDR={{.Service.Name}}-1``, optionally ``MASTER_PORT`` and ``SWARMFD_PORT``,
and the hostname ``{{.Service.Name}}-{{.Task.Slot}}`` (USAGE lists them). Then this:

1. sets ``RANK = slot - 1`` unless set; a slot beyond ``WORLD_SIZE`` is an error,
   except in an elastic job (``SWARMFD_ELASTIC=1``), whose service may be scaled up;
2. sets ``LOCAL_RANK=0``, ``LOCAL_WORLD_SIZE=1`` when unset (one rank a container), but
   not when ``SWARMFD_NODE`` is set: swarmfd then derives them per node at rendezvous;
3. sets an unset ``OMP_NUM_THREADS`` to the container's CPU limit (:func:`cpu_limit`,
   at least 1): torch and OpenBLAS count the node's cores, not the limit; without a
   limit it cannot know how many tasks share the node, and leaves it unset;
4. waits until ``MASTER_ADDR`` resolves (rank 0's name is in DNS only while its task
   runs; not in an elastic job, whose ranks find each other), at most
   ``SWARMFD_RESOLVE_TIMEOUT`` s (else ``SWARMFD_INIT_TIMEOUT``, else 60); a command
   that never joins the group can let rank 0 end before a slow rank looks it up (a
   swarmfd program cannot: rank 0 waits for every rank);
5. started as root, runs the command as :func:`rank_user` (``swarmfd``, or
   ``SWARMFD_USER``), giving it a root-owned ``SWARMFD_CHECKPOINT_DIR`` first;
6. execs the command (signals reach it; a first word ending in ``.py`` runs with this
   Python).

Swarm registers a task's hostname as its DNS alias, so ``<service>-1`` resolves to slot
1 (also in a stack: ``<stack>_<service>-1``); ``tasks.<service>`` has no slot order. Use
``replicated`` mode, restart condition ``none`` (``replicated-job`` slots are node IDs);
an elastic job restarts on failure.

Exit codes when the command does not start: 2 bad environment or usage,
3 ``MASTER_ADDR`` did not resolve in time, 126 command not executable, 127 not found.
"""

from __future__ import annotations

import os
import pwd
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from .config import (
    ENV_ELASTIC,
    ENV_INIT_TIMEOUT,
    ENV_LOCAL_RANK,
    ENV_LOCAL_WORLD_SIZE,
    ENV_MASTER_ADDR,
    ENV_NODE,
    ENV_OMP_THREADS,
    ENV_RANK,
    ENV_RESOLVE_TIMEOUT,
    ENV_TASK_SLOT,
    ENV_WORLD_SIZE,
    parse_env_float,
    parse_env_int,
)
from .errors import ConfigError, RendezvousTimeout

DEFAULT_RESOLVE_TIMEOUT = 60.0

#: Who the command runs as when the container starts as root (see the module docstring).
ENV_USER = "SWARMFD_USER"
DEFAULT_RANK_USER = "swarmfd"
#: Where ``swarmfd deploy --checkpoint-volume`` mounts the job's volume (the name
#: swarmfd.swarm.spec sets; not imported: the core stays apart from that package).
ENV_CHECKPOINT_DIR = "SWARMFD_CHECKPOINT_DIR"

EXIT_USAGE = 2
EXIT_UNRESOLVED = 3
EXIT_NOT_EXECUTABLE = 126
EXIT_NOT_FOUND = 127

PROG = "swarmfd-entrypoint"
USAGE = f"""\
usage: python -m swarmfd.entrypoint COMMAND [ARG...]

Container entrypoint of the swarmfd image: maps the Swarm task slot to RANK, waits
until MASTER_ADDR resolves, then execs COMMAND (a first word ending in .py runs
with this Python).

Environment (set by the service):
  {ENV_TASK_SLOT}        {{{{.Task.Slot}}}}, 1-based; RANK = slot - 1 unless RANK is set
  {ENV_WORLD_SIZE}               number of replicas (slot must be <= WORLD_SIZE)
  {ENV_MASTER_ADDR}              rank 0's host name, e.g. {{{{.Service.Name}}}}-1
  MASTER_PORT              torch.distributed's port on rank 0 (default 29500)
  SWARMFD_PORT             swarmfd's rendezvous port on rank 0 (default MASTER_PORT + 1)
  SWARMFD_NODE             node name; when set, LOCAL_RANK is derived per node at rendezvous
  {ENV_RESOLVE_TIMEOUT}  seconds to wait for MASTER_ADDR to resolve (default 60)
  {ENV_OMP_THREADS}          when unset: the container's CPU limit (at least 1), if it has one
  {ENV_USER}             started as root, run as this user (default {DEFAULT_RANK_USER}, when the
                           image has it; root keeps root)
"""


_SLOT_HINT = (
    f" (Swarm sets {ENV_TASK_SLOT}={{{{.Task.Slot}}}} to 1..replicas in 'replicated' mode; "
    "'global' and 'replicated-job' services get a node ID instead, and templates are "
    "expanded only in a Swarm service, not by `docker run`)"
)


def cpu_limit(cgroup: str = "/sys/fs/cgroup") -> float | None:
    """The CPUs this process's cgroup may use (CFS quota / period: ``docker run --cpus``,
    a service's ``NanoCPUs``), or None without a limit. cgroup v2's ``cpu.max``, else
    v1's ``cfs_quota_us``/``cfs_period_us``; a container sees its own cgroup at the root."""
    try:
        with open(os.path.join(cgroup, "cpu.max")) as f:
            quota, _, period = f.read().strip().partition(" ")
    except OSError:
        for controller in ("cpu", "cpu,cpuacct"):
            try:
                with open(os.path.join(cgroup, controller, "cpu.cfs_quota_us")) as f:
                    quota = f.read().strip()
                with open(os.path.join(cgroup, controller, "cpu.cfs_period_us")) as f:
                    period = f.read().strip()
                break
            except OSError:
                continue
        else:
            return None
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None  # "max": no limit
    return q / p if q > 0 and p > 0 else None


def task_env(environ: Mapping[str, str], cpus: float | None = None) -> dict[str, str]:
    """The command's environment: ``environ`` plus the derived ``RANK``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE`` and ``OMP_NUM_THREADS`` (from ``cpus``, :func:`cpu_limit`).
    Pure; :class:`ConfigError` names the variable when the task's place is unclear."""
    env = dict(environ)
    if cpus is not None and ENV_OMP_THREADS not in env:
        env[ENV_OMP_THREADS] = str(max(1, int(cpus)))
    slot = parse_env_int(env, ENV_TASK_SLOT, minimum=1, hint=_SLOT_HINT)
    world_size = parse_env_int(env, ENV_WORLD_SIZE, minimum=1)
    if slot is not None:
        if world_size is None:
            raise ConfigError(
                f"{ENV_TASK_SLOT}={slot} is set but {ENV_WORLD_SIZE} is not: the service must "
                f"set {ENV_WORLD_SIZE} to its number of replicas"
            )
        if slot > world_size and not _elastic(env):
            raise ConfigError(
                f"{ENV_TASK_SLOT}={slot} exceeds {ENV_WORLD_SIZE}={world_size}: the service "
                f"runs more replicas than {ENV_WORLD_SIZE}; set replicas = {ENV_WORLD_SIZE}"
            )
        if not env.get(ENV_RANK, "").strip():
            env[ENV_RANK] = str(slot - 1)
    if world_size is not None and world_size > 1 and not env.get(ENV_MASTER_ADDR, "").strip():
        raise ConfigError(
            f"{ENV_WORLD_SIZE}={world_size} but {ENV_MASTER_ADDR} is not set: expected the host "
            "name of rank 0 (in a Swarm service: {{.Service.Name}}-1 with the hostname "
            "template {{.Service.Name}}-{{.Task.Slot}})"
        )
    if env.get(ENV_NODE, "").strip():
        return env  # per-node local ranks: swarmfd derives them at rendezvous
    if not env.get(ENV_LOCAL_RANK, "").strip():
        env[ENV_LOCAL_RANK] = "0"
    if not env.get(ENV_LOCAL_WORLD_SIZE, "").strip():
        env[ENV_LOCAL_WORLD_SIZE] = "1"
    return env


def rank_user(environ: Mapping[str, str], euid: int) -> pwd.struct_passwd | None:
    """The user the command runs as, or None to stay (not root, ``SWARMFD_USER=root``, or
    no ``swarmfd`` user); ConfigError when ``SWARMFD_USER`` names no user of the image."""
    if euid != 0:
        return None
    name = (environ.get(ENV_USER) or "").strip()
    if name in ("root", "0"):
        return None
    try:
        return pwd.getpwnam(name or DEFAULT_RANK_USER)
    except KeyError:
        if name:
            raise ConfigError(f"{ENV_USER}={name!r}: the image has no such user (expected a "
                              f"user of /etc/passwd, or root)") from None
        return None


def become(user: pwd.struct_passwd, env: dict[str, str]) -> None:
    """Give the job's checkpoint directory to ``user`` if root owns it, then run as
    ``user`` from now on (no supplementary groups); ``env`` gets its HOME and USER."""
    checkpoints = env.get(ENV_CHECKPOINT_DIR, "").strip()
    if checkpoints and os.path.isdir(checkpoints) and os.stat(checkpoints).st_uid == 0:
        os.chown(checkpoints, user.pw_uid, user.pw_gid)
    os.setgroups([])
    os.setgid(user.pw_gid)
    os.setuid(user.pw_uid)
    env.update(HOME=user.pw_dir, USER=user.pw_name, LOGNAME=user.pw_name)


def resolve_timeout(environ: Mapping[str, str]) -> float:
    """Seconds to wait for ``MASTER_ADDR``: ``SWARMFD_RESOLVE_TIMEOUT``, else
    ``SWARMFD_INIT_TIMEOUT`` (a job giving its ranks that long to start), else 60."""
    for name in (ENV_RESOLVE_TIMEOUT, ENV_INIT_TIMEOUT):
        value = parse_env_float(environ, name)
        if value is not None:
            return value
    return DEFAULT_RESOLVE_TIMEOUT


def command_argv(args: Sequence[str], python: str = sys.executable) -> list[str]:
    """The argv to exec for ``args``: a first word ending in ``.py`` runs with ``python``."""
    argv = list(args)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise ConfigError("no command given: expected COMMAND [ARG...] after the entrypoint")
    if argv[0].endswith(".py"):
        argv.insert(0, python)
    return argv


def wait_for_host(
    host: str,
    timeout: float,
    *,
    interval: float = 0.25,
    resolve: Callable[[str], object] | None = None,
) -> float:
    """Block until ``host`` resolves, at most ``timeout`` s (each lookup in a daemon
    thread: a hung resolver cannot stretch it); the seconds waited, or
    :class:`RendezvousTimeout` naming ``MASTER_ADDR`` and the last resolver error."""
    lookup = resolve or (lambda name: socket.getaddrinfo(name, None, type=socket.SOCK_STREAM))
    start = time.monotonic()
    deadline = start + timeout
    last_error = "no answer yet"
    any_answer = False
    while True:
        outcome: dict[str, object] = {}

        def attempt(result: dict[str, object] = outcome) -> None:
            try:
                lookup(host)
                result["ok"] = True
            except OSError as exc:  # socket.gaierror and friends
                result["error"] = exc

        worker = threading.Thread(target=attempt, name="swarmfd-resolve", daemon=True)
        worker.start()
        worker.join(max(0.0, deadline - time.monotonic()))
        if outcome.get("ok"):
            return time.monotonic() - start
        if "error" in outcome:
            last_error = str(outcome["error"])
        elif worker.is_alive() and not any_answer:
            last_error = "the resolver did not answer"
        any_answer = any_answer or "error" in outcome
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RendezvousTimeout(
                f"{ENV_MASTER_ADDR}={host!r} did not resolve within {timeout:g} s "
                f"({ENV_RESOLVE_TIMEOUT}); last error: {last_error}. Rank 0's task may have "
                "failed to start, or already ended (its name leaves DNS with it: a command "
                "that does not join the group lets rank 0 finish before the others look it "
                f"up), or {ENV_MASTER_ADDR} names no task on this network "
                "(expected {{.Service.Name}}-1 with hostname {{.Service.Name}}-{{.Task.Slot}})"
            )
        time.sleep(min(interval, remaining))


def _describe(env: Mapping[str, str]) -> str:
    names = (ENV_TASK_SLOT, ENV_WORLD_SIZE, ENV_RANK, ENV_MASTER_ADDR, "MASTER_PORT",
             "SWARMFD_PORT")
    return " ".join(f"{n}={env[n]}" for n in names if env.get(n))


def _elastic(env: Mapping[str, str]) -> bool:
    """An elastic job's task: any slot may be a replacement (a scaled service has slots
    beyond WORLD_SIZE), and MASTER_ADDR may be a lost rank's name, resolved never again:
    swarmfd finds the job's ranks itself (swarmfd.session), so nothing waits for it."""
    return env.get(ENV_ELASTIC, "").strip() in ("1", "on", "true", "yes")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the entrypoint; on success this never returns (the command replaces it)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0
    try:
        command = command_argv(args)
        env = task_env(os.environ, cpu_limit())
        timeout = resolve_timeout(env)
        user = rank_user(env, os.geteuid())
    except ConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        if not args:
            print(USAGE, end="", file=sys.stderr)
        return EXIT_USAGE
    master = env.get(ENV_MASTER_ADDR, "").strip()
    if master and not _elastic(env):
        try:
            waited = wait_for_host(master, timeout)
        except RendezvousTimeout as exc:
            print(f"{PROG}: error: {exc} [{_describe(env)}]", file=sys.stderr)
            return EXIT_UNRESOLVED
        if waited >= 1.0:
            print(
                f"{PROG}: {ENV_MASTER_ADDR}={master} resolved after {waited:.1f} s", file=sys.stderr
            )
    if user is not None:
        try:
            become(user, env)
        except OSError as exc:
            print(f"{PROG}: error: cannot run as {user.pw_name} (uid {user.pw_uid}): {exc} "
                  f"(set {ENV_USER}=root to keep root)", file=sys.stderr)
            return EXIT_USAGE
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(command[0], command, env)
    except FileNotFoundError:
        print(f"{PROG}: error: command not found: {command[0]!r}", file=sys.stderr)
        return EXIT_NOT_FOUND
    except PermissionError:
        print(f"{PROG}: error: command is not executable: {command[0]!r}", file=sys.stderr)
        return EXIT_NOT_EXECUTABLE
    except OSError as exc:
        print(f"{PROG}: error: cannot run {command[0]!r}: {exc}", file=sys.stderr)
        return EXIT_NOT_EXECUTABLE
    return EXIT_NOT_EXECUTABLE  # pragma: no cover - execvpe does not return


if __name__ == "__main__":
    sys.exit(main())
