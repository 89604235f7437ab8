"""An elastic numpy job whose result tells what it processed, for tests/test_elastic.py.

Every step, each rank adds 1 at the samples of its batch to a vector of the data set's
size; the world sums the vectors (all_reduce) into ``state.counts``, which commits keep.
So at the end ``counts`` holds how many times each sample was processed *in the
committed history*: EPOCHS for every sample (none skipped, none processed again after a
rollback), plus the repeats that even out a split's last step. Every rank prints it.

Faults, from the environment:

* ``KILLS="7:first,17:middle"``: at global step 7, the rank that is rank 0 of the world
  then kills itself (SIGKILL); at step 17, a middle one; ``last``: the last rank;
  ``ranks``: "first,last" both at once. Each kill happens once (a file in
  ``KILL_DIR`` marks it), so the steps redone after a rollback do not repeat it.
* ``DIE_IN_REFORM="1"``: the rank that starts as rank 1 dies as soon as it takes part
  in its first re-formation (a loss during a re-formation).
* ``RAISE_AT=5``: the rank that starts as rank 1 raises ValueError at step 5 (a bug of
  the user's: it ends the job).
"""

import os
import signal
import time

import numpy as np

import swarmfd as fd
import swarmfd.membership

EPOCHS = int(os.environ.get("EPOCHS", "2"))
SAMPLES = int(os.environ.get("SAMPLES", "120"))
BATCH = int(os.environ.get("BATCH", "4"))
COMMIT_EVERY = int(os.environ.get("COMMIT_EVERY", "5"))
STEP_SLEEP = float(os.environ.get("STEP_SLEEP", "0.02"))
KILLS = {}
for item in filter(None, os.environ.get("KILLS", "").split(",")):
    step, _, where = item.partition(":")
    KILLS.setdefault(int(step), []).append(where)
KILL_DIR = os.environ.get("KILL_DIR", "")
RAISE_AT = int(os.environ.get("RAISE_AT", "0"))
SLOT = int(os.environ.get("RANK", "0"))
FIRST = not os.environ.get("SWARMFD_ELASTIC_JOIN")


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


if os.environ.get("DIE_IN_REFORM") and SLOT == 1 and FIRST:
    _reform = swarmfd.membership.reform

    def reform_then_die(*args, **kwargs):
        die()
        return _reform(*args, **kwargs)

    swarmfd.membership.reform = reform_then_die


def maybe_kill(step: int) -> None:
    """Die if this rank is at a position KILLS names for ``step``, the first time the
    job reaches it (the generation then is written down: the ranks of that generation
    at the position die, not those that redo the step after the rollback)."""
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


fd.init_from_env()
sampler = fd.elastic.ElasticSampler(SAMPLES, shuffle=True, seed=1)
state = fd.elastic.State(counts=np.zeros(SAMPLES), sampler=sampler, epoch=0, batch=0,
                         steps=0)
state.register_reset_callbacks([lambda: print(f"reset: now rank {fd.get_rank()} of "
                                              f"{fd.get_world_size()}", flush=True)])


@fd.elastic.run
def train(state):
    for state.epoch in range(state.epoch, EPOCHS):  # noqa: B020 (the epoch lives in the state)
        for idx in state.sampler.batches(BATCH):
            local = np.zeros(SAMPLES)
            np.add.at(local, idx, 1)
            fd.all_reduce(local)
            state.counts += local
            state.sampler.record_batch(state.batch, BATCH)
            state.batch += 1
            state.steps += 1
            maybe_kill(state.steps)
            if state.steps == RAISE_AT and SLOT == 1:
                raise ValueError(f"a bug at step {state.steps}")
            if state.batch % COMMIT_EVERY == 0:
                state.commit()
                if state.commits == 1 and fd.get_rank() == 0:
                    print("first commit", flush=True)
            time.sleep(STEP_SLEEP)
        state.batch = 0
        state.sampler.set_epoch(state.epoch + 1)
    return state.counts


counts = train(state)
ctx = fd.session.elastic_state()
print(f"RESULT rank={fd.get_rank()} world={fd.get_world_size()} gen={ctx.world.gen} "
      f"min={int(counts.min())} max={int(counts.max())} "
      f"extra={int((counts - EPOCHS).sum())} steps={state.steps}", flush=True)
fd.cleanup()
