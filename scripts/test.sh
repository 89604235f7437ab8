#!/usr/bin/env bash
# Run swarmfd's whole test suite on a fresh machine (as root): a virtual environment
# with the project and its test tools, then pytest. Extra arguments go to pytest.
#
#   scripts/test.sh                 everything
#   scripts/test.sh -m "not swarm"  without the Docker Swarm tests: Docker is not touched
#
# Docker is set up only when a selected test needs it: the Swarm tests' fixtures
# (tests/swarm/docker_setup.py) run scripts/setup-docker.sh (the engine with a one-node
# Swarm, the swarmfd image, and for tests/multinode/ the node image) the first time a
# test asks for the engine, so a selection without Swarm tests never installs, starts
# or builds anything.
#
# SWARMFD_TEST_LANES=2: two lanes side by side (pytest-xdist), see below.
#
# Environment: VENV (default .venv in the checkout), SWARMFD_SKIP_DOCKER=1 to leave
# Docker alone even then (Swarm tests then skip when no engine answers, or fail under
# CI=true).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
# The examples extra (scikit-learn: examples/train_torch.py's data) lets its test run.
"$VENV/bin/python" -m pip install --quiet -e ".[test,examples]"
# torch is optional for swarmfd; its CPU build (pinned: an unpinned torch pulls a
# multi-GB CUDA build) lets the tensor tests run instead of skipping.
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  "$VENV/bin/python" -m pip install --quiet "torch==2.13.0" >/dev/null 2>&1 \
    || echo "test.sh: torch 2.13.0 not installable here; torch tests will skip"
fi

if [ "${SWARMFD_SKIP_DOCKER:-0}" != 1 ]; then
  export SWARMFD_SETUP_DOCKER=1  # the Swarm fixtures may run scripts/setup-docker.sh
fi

# SWARMFD_TEST_LANES=2: two lanes side by side (pytest-xdist; see
# pytest_xdist_make_scheduler in tests/conftest.py): the Docker tests and the waiting
# ones (timeouts, a fresh venv), which leave the CPU mostly idle; and the rest, at a
# lower CPU priority. About 13-15 minutes instead of about 20 here, but not yet the
# default: in the last laned run a timing bound of the front-door tests was missed in
# the lower-priority lane (other work loaded the machine too). Today's other laned
# failures are fixed (a Docker cleanup race, a lossy sniffer, a Ctrl-C test that
# inherited SIGINT ignored).
LANES=()
if [ -n "${SWARMFD_TEST_LANES:-}" ] && [ "${SWARMFD_TEST_LANES}" != 1 ]; then
  LANES=(-n "$SWARMFD_TEST_LANES")
fi

export PATH="$VENV/bin:$PATH"
exec "$VENV/bin/python" -m pytest "${LANES[@]}" "$@"
