"""The faults of the elastic test scripts (elastic_job.py, elastic_torch.py), from the
environment: ``KILLS="7:first,17:middle"``: at global step 7 the rank that is rank 0 of
the world then kills itself (SIGKILL); at step 17 every middle one; ``last``: the last.
Each kill happens in one generation only (a file in ``KILL_DIR`` names it), so the
ranks that redo the step after the rollback live."""

import os
import signal

import swarmfd as fd

KILL_DIR = os.environ.get("KILL_DIR", "")
KILLS: dict[int, list[str]] = {}
for item in filter(None, os.environ.get("KILLS", "").split(",")):
    step, _, where = item.partition(":")
    KILLS.setdefault(int(step), []).append(where)


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def maybe_kill(step: int) -> None:
    """Die if this rank is at a position KILLS names for ``step``, in the generation
    that first got there."""
    rank, world = fd.get_rank(), fd.get_world_size()
    gen = str(fd.session.elastic_state().world.gen)
    here = {"first": rank == 0, "last": rank == world - 1, "middle": 0 < rank < world - 1}
    for n, where in enumerate(KILLS.get(step, [])):
        marker = os.path.join(KILL_DIR, f"killed-{step}-{n}")
        if not here.get(where):
            continue
        try:
            with open(marker, "x") as f:
                f.write(gen)
        except FileExistsError:
            with open(marker) as f:
                if f.read() != gen:
                    continue
        die()
