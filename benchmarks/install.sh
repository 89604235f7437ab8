#!/usr/bin/env bash
# Install what benchmarks/compare.py compares against, into the project venv.
#   bash benchmarks/install.sh            (VENV=/path/to/venv to override)
# Open MPI comes from Debian (mpi4py builds against it); torch is pinned to a CPU
# wheel (an unpinned torch downloads a multi-GB CUDA build). Needs root for apt.
set -euo pipefail
VENV="${VENV:-$(cd "$(dirname "$0")/.." && pwd)/.venv}"
here="$(cd "$(dirname "$0")" && pwd)"
if ! command -v mpirun >/dev/null 2>&1; then
    apt-get update
    DEBIAN_FRONTEND=noninteractive apt-get install -y openmpi-bin libopenmpi-dev
fi
"$VENV/bin/pip" install -r "$here/requirements.txt"
"$VENV/bin/python" -c "import torch, mpi4py, matplotlib; print('torch', torch.__version__, \
'mpi4py', mpi4py.__version__, 'matplotlib', matplotlib.__version__)"
mpirun --version | head -1
