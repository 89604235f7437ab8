"""A real swarmfd rank: join the group from the env, all-reduce, print the result."""

import numpy as np

import swarmfd as fd

cfg = fd.init_from_env(timeout=20)
try:
    x = np.arange(4, dtype=np.float64) + 10 * cfg.rank
    fd.all_reduce(x)
    print("result", " ".join(f"{v:g}" for v in x), "world", cfg.world_size)
finally:
    fd.cleanup()
