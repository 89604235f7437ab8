"""An elastic numpy job whose result tells what it processed, for tests/test_elastic.py.

Every step, each rank adds 1 at the samples of its batch to a vector of the data set's
size; the world sums the vectors (all_reduce) into ``state.counts``, which commits keep.
So at the end ``counts`` holds how many times each sample was processed *in the
committed history*: EPOCHS for every sample (none skipped, none processed again after a
rollback), plus the repeats that even out a split's last step. Every rank prints it.

Faults, from the environment:

* ``KILLS`` and ``KILL_DIR``: see elastic_kills.py.
* ``DIE_IN_REFORM="1"``: the rank that starts as rank 1 dies as soon as it takes part
  in its first re-formation (a loss during a re-formation).
* ``RAISE_AT=5``: the rank that starts as rank 1 raises ValueError at step 5 (a bug of
  the user's: it ends the job).
* ``LEAVE_AT=5``: the rank that starts last asks to leave at step 5
  (``fd.elastic.request_leave``): it leaves at the next commit, without a rollback.
* ``OLD_GROUP="1"``: the first ranks make a group of the whole first world; the reset
  callbacks use it, and print the error it raises.
"""

import os
import time

import numpy as np
from elastic_kills import die, maybe_kill

import swarmfd as fd
import swarmfd.membership

EPOCHS = int(os.environ.get("EPOCHS", "2"))
SAMPLES = int(os.environ.get("SAMPLES", "120"))
BATCH = int(os.environ.get("BATCH", "4"))
COMMIT_EVERY = int(os.environ.get("COMMIT_EVERY", "5"))
STEP_SLEEP = float(os.environ.get("STEP_SLEEP", "0.02"))
RAISE_AT = int(os.environ.get("RAISE_AT", "0"))
LEAVE_AT = int(os.environ.get("LEAVE_AT", "0"))
SLOT = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
LAST = SLOT == WORLD - 1
FIRST = not os.environ.get("SWARMFD_ELASTIC_JOIN")


if os.environ.get("DIE_IN_REFORM") and SLOT == 1 and FIRST:
    _reform = swarmfd.membership.reform

    def reform_then_die(*args, **kwargs):
        die()
        return _reform(*args, **kwargs)

    swarmfd.membership.reform = reform_then_die


fd.init_from_env()
sampler = fd.elastic.ElasticSampler(SAMPLES, shuffle=True, seed=1)
state = fd.elastic.State(counts=np.zeros(SAMPLES), sampler=sampler, epoch=0, batch=0,
                         steps=0)
state.register_reset_callbacks([lambda: print(f"reset: now rank {fd.get_rank()} of "
                                              f"{fd.get_world_size()}", flush=True)])
if os.environ.get("OLD_GROUP") and FIRST:
    old = fd.new_group(list(range(fd.get_world_size())))

    def use_old_group():
        try:
            fd.all_reduce(np.ones(1), group=old)
        except ValueError as exc:
            print(f"old group refused: {exc}", flush=True)

    state.register_reset_callbacks([use_old_group])


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
            if state.steps == LEAVE_AT and FIRST and LAST:
                fd.elastic.request_leave()
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
