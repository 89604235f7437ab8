#!/usr/bin/env bash
# A multi-node Docker Swarm of docker-in-docker nodes on this machine (the harness of
# tests/multinode/; run as root after `scripts/setup-docker.sh all`).
#
#   scripts/multinode.sh up [-n 3] [--image swarmfd:latest]   start it; prints DOCKER_HOST=
#   scripts/multinode.sh down                                 remove every node, volume, network
#   scripts/multinode.sh status                               what of it exists
#
# Then e.g.: swarmfd deploy -H unix:///run/swarmfd-multinode/node1/docker.sock IMAGE_ID -n 3 ...
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY=python3
cd "$ROOT"
exec env PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m tests.multinode.cluster "$@"
