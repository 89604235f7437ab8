"""Rank 1 exits with code 3 after a barrier; rank 0, deaf to SIGTERM, goes on calling
all_reduce until it finds rank 1 gone (PeerLostError, uncaught: its traceback on stderr)."""

import signal
import sys

import numpy as np

import swarmfd as fd

fd.init_from_env()
fd.barrier()
if fd.get_rank() == 1:
    sys.exit(3)
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # so the launcher's stop cannot come first
while True:
    fd.all_reduce(np.ones(4))
