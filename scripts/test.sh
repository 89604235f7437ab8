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
# The tests run in five lanes side by side (pytest-xdist), see below;
# SWARMFD_TEST_LANES=1 runs them in one.
#
# Environment: VENV (default .venv in the checkout), SWARMFD_SKIP_DOCKER=1 to leave
# Docker alone even then (Swarm tests then skip when no engine answers, or fail under
# CI=true).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"

# The examples extra (scikit-learn: examples/train_torch.py's data) lets its test run.
# torch is optional for swarmfd; its CPU build (pinned: an unpinned torch pulls a
# multi-GB CUDA build) lets the tensor tests run instead of skipping. --no-compile: see
# "Bytecode" below.
REQS=(-e ".[test,examples]")
TORCH=("torch==2.13.0")

# The installer is uv (astral-sh/uv, from the package index into the venv) where it
# can be had, else pip. On this 2-core machine a fresh venv with these requirements
# took pip 46 s wall (31 CPU-s, most of it unpacking torch, one file at a time) and uv
# 11 s, uv's own install included; the suite waits for it, so it is the
# start of every CI run. The same versions either way: uv is told pip's configuration
# of this machine (below) and to pick, like pip, the best version of every index.
# SWARMFD_NO_UV=1 uses pip.
uv_args() {
  # uv does not read pip's configuration files or PIP_* variables: pass on the index,
  # link and constraint settings `pip config list` shows (files and environment).
  UV_ARGS=(--index-strategy unsafe-best-match)
  local line key value item
  while IFS= read -r line; do
    key="${line%%=*}"; key="${key##*.}"
    value="${line#*=}"; value="${value#\'}"; value="${value%\'}"
    for item in $value; do
      case "$key" in
        index-url) UV_ARGS+=(--index-url "$item") ;;
        extra-index-url) UV_ARGS+=(--extra-index-url "$item") ;;
        find-links) UV_ARGS+=(--find-links "$item") ;;
        constraint) UV_ARGS+=(--constraint "$item") ;;
        cert) export SSL_CERT_FILE="$item" ;;
      esac
    done
  done < <("$PY" -m pip config list 2>/dev/null || true)
}

# install_reqs INSTALLER...: the requirements with torch, else (torch not installable
# here) without it.
install_reqs() {
  "$@" "${REQS[@]}" "${TORCH[@]}" && return
  echo "test.sh: torch 2.13.0 not installable here; torch tests will skip"
  "$@" "${REQS[@]}"
}

install_with_uv() {
  [ "${SWARMFD_NO_UV:-0}" != 1 ] || return 1
  if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv --without-pip "$VENV" || return 1
  fi
  if [ ! -x "$VENV/bin/uv" ]; then
    "$PY" -m pip --python "$VENV/bin/python" install --quiet --no-compile uv 2>/dev/null \
      || return 1
  fi
  uv_args
  # pip too: `swarmfd deploy --build` runs `python -m pip download` for an image's wheels.
  install_reqs "$VENV/bin/uv" pip install --quiet --python "$VENV/bin/python" \
    "${UV_ARGS[@]}" pip || return 1
}

install_with_pip() {
  if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
  elif ! "$VENV/bin/python" -m pip --version >/dev/null 2>&1; then
    "$VENV/bin/python" -m ensurepip --default-pip >/dev/null
  fi
  install_reqs "$VENV/bin/python" -m pip install --quiet --no-compile
}

if ! install_with_uv; then
  [ "${SWARMFD_NO_UV:-0}" = 1 ] || echo "test.sh: uv is not available here, or failed; installing with pip"
  install_with_pip
fi

if [ "${SWARMFD_SKIP_DOCKER:-0}" != 1 ]; then
  export SWARMFD_SETUP_DOCKER=1  # the Swarm fixtures may run scripts/setup-docker.sh
fi

# Bytecode: this machine's environment sets PYTHONDONTWRITEBYTECODE=1, so every process
# compiled every module it imported from source, every time: pytest rewrote the asserts
# of all 122 test modules in each lane (6.4 of the 15 CPU-seconds of a collection), and
# each rank and CLI process compiled swarmfd's modules again (0.1 CPU-s a process that
# imports the CLI). The suite's processes write and reuse it (in __pycache__, ignored by
# git and by image builds). pip compiles nothing (it compiled every file of torch,
# scipy and scikit-learn, most of which nothing imports: venv and install took 60 s
# that way against 106 s); what the suite imports is compiled once here,
# before the lanes start (else each of them compiles the same modules at once).
export PYTHONDONTWRITEBYTECODE=
"$VENV/bin/python" -m compileall -q swarmfd tests benchmarks examples >/dev/null
"$VENV/bin/python" - <<'PY'
import importlib, importlib.util
for name in ("numpy", "zmq", "click", "docker", "pytest", "xdist", "hypothesis", "psutil",
             "torch", "sklearn.datasets"):
    if importlib.util.find_spec(name.split(".")[0]) is not None:
        importlib.import_module(name)
PY

# Lanes (tests/conftest.py, pytest_xdist_make_scheduler): the one-node Swarm tests; the
# multi-node ones; the tests that wait for a timeout or a detection; and two lanes of all the others, at a lower
# CPU priority. Run in one lane the suite left the 2 cores half idle (about 1170
# CPU-seconds in 1190 s).
LANES=()
if [ "${SWARMFD_TEST_LANES:-5}" != 1 ]; then
  LANES=(-n "${SWARMFD_TEST_LANES:-5}")
fi

export PATH="$VENV/bin:$PATH"
exec "$VENV/bin/python" -m pytest "${LANES[@]}" "$@"
