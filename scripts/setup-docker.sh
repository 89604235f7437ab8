#!/usr/bin/env bash
# Prepare this machine for swarmfd's Docker Swarm tests, offline from container
# registries. Idempotent and fast when everything already exists. Run as root.
#
# Usage: scripts/setup-docker.sh [STEP...]
#   engine      install Debian's docker.io (and mmdebstrap, in the same apt run, when a
#               base or node step follows) if no dockerd exists, start dockerd if it
#               is not running, `docker swarm init` if the swarm is inactive
#   base        build the base image ($SWARMFD_BASE_IMAGE) with mmdebstrap from the
#               host's own apt sources file, unless it exists (FORCE_BASE=1 rebuilds)
#   wheelhouse  download manylinux cp311 wheels of the runtime deps into wheelhouse/
#               (skipped when wheelhouse/.stamp matches the dependency list)
#   image       build the swarmfd image ($SWARMFD_IMAGE) from the Dockerfile with
#               --build-arg BASE_IMAGE=$SWARMFD_BASE_IMAGE. The Dockerfile's build stage
#               (the venv before it is copied into the runtime image) is kept, tagged
#               $SWARMFD_BUILD_CACHE, as the layer cache: an unchanged rebuild then takes
#               about a second instead of reinstalling every dependency. Its previous
#               version is removed when it changes, so no untagged image is left behind.
#   node        build the multi-node test Swarm's node image ($SWARMFD_NODE_IMAGE): Debian
#               with docker.io and docker-registry, by mmdebstrap like the base image,
#               unless it exists (FORCE_NODE=1 rebuilds); only tests/multinode/ needs it
#   deploy      engine base wheelhouse image: what `swarmfd deploy` and `swarmfd build`
#               need (the default)
#   all         deploy and node (what the whole test suite needs); node is built
#               alongside base, wheelhouse and image
#   status      print engine, swarm and image state; change nothing
# `image` prints a line `SWARMFD_IMAGE_ID=sha256:...`, `node` one `SWARMFD_NODE_IMAGE=<tag>`.
#
# Environment:
#   SWARMFD_IMAGE        image tag to build (default swarmfd:latest)
#   SWARMFD_BASE_IMAGE   local base image tag (default swarmfd-base:<suite>-1)
#   SWARMFD_NODE_IMAGE   multi-node test node image tag (default swarmfd-node:<suite>-2)
#   SWARMFD_BUILD_CACHE  tag of the kept build stage (default swarmfd-build-cache:latest)
#   SWARMFD_APT_SOURCES  apt sources file for mmdebstrap (default: the host's
#                        /etc/apt/sources.list.d/debian.sources, else /etc/apt/sources.list)
#   SWARMFD_SUITE        Debian suite (default: VERSION_CODENAME of the host)
#   DOCKERD_LOG          dockerd log file (default /var/log/swarmfd-dockerd.log)
#   DOCKER_WAIT          seconds to wait for the engine to answer (default 60)
#   FORCE_BASE=1         rebuild the base image even if it exists
#   FORCE_NODE=1         rebuild the node image even if it exists
#   SWARMFD_SETUP_LOCK   prefix of the per-step lock files (default
#                        /run/lock/swarmfd-setup-docker: <prefix>.<step>.lock)
#
# The mirror is never written in this file: mmdebstrap reads the host's sources file.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SUITE="${SWARMFD_SUITE:-$(. /etc/os-release && echo "${VERSION_CODENAME:-bookworm}")}"
BASE_RECIPE=2   # bump when the base package list or options below change
BASE_IMAGE="${SWARMFD_BASE_IMAGE:-swarmfd-base:${SUITE}-${BASE_RECIPE}}"
IMAGE="${SWARMFD_IMAGE:-swarmfd:latest}"
NODE_RECIPE=3   # bump when the node package list, options or entry script change
NODE_IMAGE="${SWARMFD_NODE_IMAGE:-swarmfd-node:${SUITE}-${NODE_RECIPE}}"
BUILD_CACHE="${SWARMFD_BUILD_CACHE:-swarmfd-build-cache:latest}"
# docker.io pulls containerd, runc, tini and iptables; mount and iproute2 are for the
# entry script and overlay networking; docker-registry is the registry the multi-node
# tests run inside the cluster (`swarmfd deploy --push`). No Python: a node only runs
# dockerd (and the registry).
NODE_PKGS="docker.io,docker-registry,mount,iproute2,procps"
DOCKERD_LOG="${DOCKERD_LOG:-/var/log/swarmfd-dockerd.log}"
DOCKER_WAIT="${DOCKER_WAIT:-60}"
WHEELHOUSE="$ROOT/wheelhouse"
BASE_PKGS="python3,python3-venv,ca-certificates"
# Wheels for the image's CPython 3.11 on x86_64 (Debian bookworm and python:3.11-slim).
WHEEL_PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64)

die() { echo "setup-docker: ERROR: $*" >&2; exit 1; }
log() { echo "setup-docker: $*"; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1fs", b - a }'; }

# The engine's own client (/usr/bin/docker from docker.io) matches the daemon's API;
# /usr/local/bin/docker on this host is a newer client only (it also works, by
# downgrading the API). Prefer the engine's client; an explicit $DOCKER wins.
pick_client() {
  if [ -n "${DOCKER:-}" ]; then return; fi
  if [ -x /usr/bin/docker ]; then DOCKER=/usr/bin/docker
  elif command -v docker >/dev/null 2>&1; then DOCKER="$(command -v docker)"
  else DOCKER=""; fi
}

need_root() { [ "$(id -u)" = 0 ] || die "$1 needs root (run: sudo $0 $1)"; }

apt_install() {
  need_root "installing $*"
  export DEBIAN_FRONTEND=noninteractive
  # One apt run at a time: `all` builds the node image while the image chain runs, and
  # each may have a package to install.
  (
    with_lock apt
    apt-get update -qq || die "apt-get update failed"
    apt-get install -y -qq --no-install-recommends "$@" >/dev/null || die "apt-get install $* failed"
  )
}

engine_running() { [ -n "$DOCKER" ] && "$DOCKER" info >/dev/null 2>&1; }

# A live dockerd process (a killed one can linger a moment as a zombie: not alive).
dockerd_alive() { ps -C dockerd -o stat= 2>/dev/null | grep -qv '^Z'; }
containerd_alive() { ps -C containerd -o stat= 2>/dev/null | grep -qv '^Z'; }

start_dockerd() {
  local dockerd; dockerd="$(command -v dockerd || echo /usr/sbin/dockerd)"
  # A dockerd killed without cleanup leaves its pid file, and a new one refuses to start.
  if [ -e /var/run/docker.pid ]; then
    log "removing stale /var/run/docker.pid (no dockerd process runs)"
    rm -f /var/run/docker.pid
  fi
  # Likewise the pid file of the containerd that dockerd manages.
  if [ -e /var/run/docker/containerd/containerd.pid ] && ! containerd_alive; then
    rm -f /var/run/docker/containerd/containerd.pid
  fi
  log "starting $dockerd (log: $DOCKERD_LOG)"
  mkdir -p "$(dirname "$DOCKERD_LOG")"
  # setsid + nohup: the daemon outlives this script and its terminal; 9>&-: it must not
  # inherit a set-up lock (see with_lock), or it would hold it as long as it runs.
  setsid nohup "$dockerd" >>"$DOCKERD_LOG" 2>&1 </dev/null 9>&- &
}

step_engine() {
  local t0; t0=$(now)
  pick_client
  if ! command -v dockerd >/dev/null 2>&1 && [ ! -x /usr/sbin/dockerd ] && [ ! -x /usr/bin/dockerd ]; then
    # mmdebstrap too, in the same apt run, when a base or node image will need it.
    local pkgs=(docker.io)
    if [ "${NEED_MMDEBSTRAP:-0}" = 1 ] && ! command -v mmdebstrap >/dev/null 2>&1; then
      pkgs+=(mmdebstrap)
    fi
    log "no dockerd found: installing Debian's ${pkgs[*]}"
    apt_install "${pkgs[@]}"
    DOCKER=""; pick_client
    log "installed docker.io in $(since "$t0")"
  fi
  [ -n "$DOCKER" ] || die "no docker client found after installing docker.io"
  if engine_running; then
    log "engine already answering ($("$DOCKER" version -f '{{.Server.Version}} API {{.Server.APIVersion}}'))"
  else
    need_root "starting dockerd"
    local started=0
    if ! dockerd_alive; then start_dockerd; started=1
    else log "a dockerd process exists but does not answer yet; waiting for it"; fi
    local wait_until=$(( $(date +%s) + DOCKER_WAIT ))
    until engine_running; do
      if [ "$(date +%s)" -ge "$wait_until" ]; then
        tail -n 20 "$DOCKERD_LOG" >&2 || true
        die "the engine did not answer \`docker info\` within ${DOCKER_WAIT}s (log: $DOCKERD_LOG)"
      fi
      if ! dockerd_alive; then
        # One retry: right after a kill, the old containerd can still hold its pid file.
        if [ "$started" -ge 2 ]; then
          tail -n 20 "$DOCKERD_LOG" >&2 || true
          die "dockerd exited during start-up, twice (log: $DOCKERD_LOG)"
        fi
        log "dockerd is not running (any more); starting it again"
        sleep 1; start_dockerd; started=$((started + 1))
      fi
      sleep 0.3
    done
    log "engine up in $(since "$t0") ($("$DOCKER" version -f '{{.Server.Version}} API {{.Server.APIVersion}}'))"
  fi
  local state; state="$("$DOCKER" info -f '{{.Swarm.LocalNodeState}}')"
  local deadline=$(( $(date +%s) + DOCKER_WAIT ))
  # After a restart the node can report "pending" for a moment while it rejoins.
  while [ "$state" = pending ] && [ "$(date +%s)" -lt "$deadline" ]; do
    sleep 0.5; state="$("$DOCKER" info -f '{{.Swarm.LocalNodeState}}')"
  done
  case "$state" in
    active) log "swarm already active" ;;
    inactive)
      "$DOCKER" swarm init --advertise-addr 127.0.0.1 >/dev/null || die "docker swarm init failed"
      log "swarm initialised (advertise 127.0.0.1)" ;;
    *) die "swarm is in state '$state' (expected active or inactive); see \`$DOCKER info\`" ;;
  esac
  [ "$("$DOCKER" info -f '{{.Swarm.ControlAvailable}}')" = true ] \
    || die "this node is not a swarm manager: the tests need a manager node"
}

require_engine() {
  pick_client
  engine_running || die "no Docker engine answers; run: $0 engine"
}

apt_sources_file() {
  local f
  if [ -n "${SWARMFD_APT_SOURCES:-}" ]; then
    [ -s "$SWARMFD_APT_SOURCES" ] || die "SWARMFD_APT_SOURCES=$SWARMFD_APT_SOURCES is not a readable file"
    echo "$SWARMFD_APT_SOURCES"; return
  fi
  for f in /etc/apt/sources.list.d/debian.sources /etc/apt/sources.list; do
    if [ -s "$f" ] && grep -Eq '^[[:space:]]*(URIs:|deb )' "$f"; then echo "$f"; return; fi
  done
  die "no usable apt sources file (looked at /etc/apt/sources.list.d/debian.sources and /etc/apt/sources.list); set SWARMFD_APT_SOURCES"
}

# mmdebstrap a rootfs tarball of $SUITE with the packages $2 (comma-separated) into $1,
# from the host's own apt sources file; extra arguments are more mmdebstrap options.
debootstrap_tar() {
  local out="$1" pkgs="$2"; shift 2
  command -v mmdebstrap >/dev/null 2>&1 || { log "installing mmdebstrap"; apt_install mmdebstrap; }
  local src; src="$(apt_sources_file)"
  log "mmdebstrap $SUITE from $src ($pkgs)"
  # Check-Valid-Until false: the host's mirror may be a dated snapshot whose Release
  # files are past Valid-Until; mmdebstrap does not read the host's apt.conf.d.
  # No docs, man pages, locales or info (copyrights stay): dpkg leaves them out of every
  # package it installs, by a dpkg.cfg.d file the extract hook writes, and the
  # customize hook removes them from the essential packages, which mmdebstrap unpacked
  # before. (Given as --dpkgopt, the same excludes make mmdebstrap filter each essential
  # package through mmtarfilter, a Python process per package: the base rootfs then took
  # 56 CPU-s against 40-46.)
  local nodoc="printf '%s\\n'" opt
  for opt in 'path-exclude=/usr/share/man/*' 'path-exclude=/usr/share/doc/*' \
             'path-include=/usr/share/doc/*/copyright' 'path-exclude=/usr/share/locale/*' \
             'path-exclude=/usr/share/info/*'; do
    nodoc+=" '$opt'"
  done
  nodoc+=' > "$1"/etc/dpkg/dpkg.cfg.d/99swarmfd-nodoc'
  # shellcheck disable=SC2016  # "$1" is expanded by mmdebstrap's hook shell, not here
  mmdebstrap ${MMDEBSTRAP_VERBOSE:---quiet} \
    --variant=apt --mode=root --format=tar \
    --include="$pkgs" \
    --aptopt='Acquire::Check-Valid-Until "false"' \
    --aptopt='Acquire::Languages "none"' \
    --extract-hook="$nodoc" \
    --customize-hook='find "$1"/usr/share/doc -type f ! -path "*/usr/share/doc/*/copyright" -delete
      for d in man locale info; do
        [ -d "$1/usr/share/$d" ] || continue
        find "$1/usr/share/$d" -mindepth 1 ! -type d -delete
        find "$1/usr/share/$d" -mindepth 1 -type d -empty -delete
      done
      find "$1"/usr/share/doc -mindepth 1 -type d -empty -delete
      if [ -d "$1"/etc/alternatives ]; then
        find "$1"/etc/alternatives -name "*.gz" -lname "/usr/share/man/*" -delete
      fi' \
    "$@" \
    --customize-hook='rm -f "$1"/etc/apt/sources.list "$1"/etc/apt/sources.list.d/* "$1"/var/cache/apt/*.bin' \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/*' \
    "$SUITE" "$out" "$src" \
    || die "mmdebstrap failed (apt sources: $src, suite: $SUITE)"
}

step_base() {
  require_engine
  if [ "${FORCE_BASE:-0}" != 1 ] && "$DOCKER" image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    log "base image $BASE_IMAGE exists (FORCE_BASE=1 rebuilds it)"
    return
  fi
  need_root "building the base image"
  local work; work="$(mktemp -d /tmp/swarmfd-base.XXXXXX)"
  # shellcheck disable=SC2064
  trap "rm -rf '$work'" RETURN
  log "building $BASE_IMAGE"
  local t0 t1; t0=$(now)
  debootstrap_tar "$work/rootfs.tar" "$BASE_PKGS"
  t1=$(now)
  "$DOCKER" import \
    --change 'ENV LANG=C.UTF-8 PYTHONUNBUFFERED=1' \
    --change 'CMD ["python3"]' \
    "$work/rootfs.tar" "$BASE_IMAGE" >/dev/null || die "docker import of the base rootfs failed"
  log "base image $BASE_IMAGE built in $(since "$t0") (mmdebstrap" \
      "$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1fs", b - a }'), import $(since "$t1")):" \
      "$("$DOCKER" image inspect -f '{{.Size}}' "$BASE_IMAGE" | awk '{printf "%.0f MB", $1/1e6}')"
}

# The node image of the multi-node test Swarm: dockerd (docker.io) started by
# scripts/multinode-node-entry.sh. A node needs no Python and no swarmfd: the swarmfd
# image is loaded into each node's engine by the harness.
step_node() {
  require_engine
  if [ "${FORCE_NODE:-0}" != 1 ] && "$DOCKER" image inspect "$NODE_IMAGE" >/dev/null 2>&1; then
    log "node image $NODE_IMAGE exists (FORCE_NODE=1 rebuilds it)"
    echo "SWARMFD_NODE_IMAGE=$NODE_IMAGE"
    return
  fi
  need_root "building the node image"
  local work; work="$(mktemp -d /tmp/swarmfd-node.XXXXXX)"
  # shellcheck disable=SC2064
  trap "rm -rf '$work'" RETURN
  log "building $NODE_IMAGE"
  local t0; t0=$(now)
  debootstrap_tar "$work/rootfs.tar" "$NODE_PKGS" \
    --customize-hook="copy-in $ROOT/scripts/multinode-node-entry.sh /usr/local/bin" \
    --customize-hook='rm -f "$1"/var/cache/debconf/*-old'
  "$DOCKER" import \
    --change 'ENV LANG=C.UTF-8' \
    --change 'VOLUME /var/lib/docker' \
    --change 'LABEL org.swarmfd.node-recipe='"$NODE_RECIPE" \
    --change 'ENTRYPOINT ["/usr/local/bin/multinode-node-entry.sh"]' \
    "$work/rootfs.tar" "$NODE_IMAGE" >/dev/null || die "docker import of the node rootfs failed"
  log "node image $NODE_IMAGE built in $(since "$t0"):" \
      "$("$DOCKER" image inspect -f '{{.Size}}' "$NODE_IMAGE" | awk '{printf "%.0f MB", $1/1e6}')"
  echo "SWARMFD_NODE_IMAGE=$NODE_IMAGE"
}

# Requirement list: the project's runtime dependencies (read from pyproject.toml) plus
# the build backend, so the image can build swarmfd's wheel with --no-index.
wheel_requirements() {
  python3 - "$ROOT/pyproject.toml" <<'EOF'
import sys, tomllib
with open(sys.argv[1], "rb") as f:
    data = tomllib.load(f)
reqs = list(data["project"].get("dependencies", [])) + list(data["build-system"]["requires"])
reqs.append("wheel")
print("\n".join(sorted(set(reqs))))
EOF
}

step_wheelhouse() {
  local t0; t0=$(now)
  mkdir -p "$WHEELHOUSE"
  local reqs stamp
  reqs="$(wheel_requirements)" || die "could not read dependencies from $ROOT/pyproject.toml"
  stamp="$(printf '%s\n%s\n' "$reqs" "${WHEEL_PLATFORMS[*]}" | sha256sum | cut -c1-16)"
  if [ -f "$WHEELHOUSE/.stamp" ] && [ "$(cat "$WHEELHOUSE/.stamp")" = "$stamp" ] \
     && ls "$WHEELHOUSE"/*.whl >/dev/null 2>&1; then
    log "wheelhouse up to date ($(ls "$WHEELHOUSE"/*.whl | wc -l) wheels)"
    return
  fi
  log "downloading wheels into $WHEELHOUSE: $(echo "$reqs" | tr '\n' ' ')"
  rm -f "$WHEELHOUSE"/*.whl "$WHEELHOUSE/.stamp"
  local plat=() p
  for p in "${WHEEL_PLATFORMS[@]}"; do plat+=(--platform "$p"); done
  # PIP_FIND_LINKS (set on this machine) is unset so only index wheels land here.
  local req_list=()
  mapfile -t req_list <<<"$reqs"
  env -u PIP_FIND_LINKS python3 -m pip download --quiet --disable-pip-version-check \
    --dest "$WHEELHOUSE" --only-binary=:all: \
    --python-version 3.11 --implementation cp --abi cp311 "${plat[@]}" "${req_list[@]}" \
    || die "pip download failed (needs access to the package index)"
  echo "$stamp" > "$WHEELHOUSE/.stamp"
  log "wheelhouse: $(ls "$WHEELHOUSE"/*.whl | wc -l) wheels, $(du -sh "$WHEELHOUSE" | cut -f1), in $(since "$t0")"
}

step_image() {
  require_engine
  "$DOCKER" image inspect "$BASE_IMAGE" >/dev/null 2>&1 || die "base image $BASE_IMAGE is missing; run: $0 base"
  ls "$WHEELHOUSE"/*.whl >/dev/null 2>&1 || die "the wheelhouse is empty; run: $0 wheelhouse"
  local t0; t0=$(now)
  local out old_cache new_cache
  old_cache="$("$DOCKER" image inspect -f '{{.Id}}' "$BUILD_CACHE" 2>/dev/null || true)"
  # Classic builder (DOCKER_BUILDKIT=0): needs no buildx plugin and behaves like the
  # SDK's images.build; the layer cache makes an unchanged rebuild take about a second.
  # The classic builder keeps each stage's last layer as an image; tagging the `wheel`
  # stage (which holds the `deps` stage) names that cache instead of leaving it untagged.
  # The second build finds every stage in the cache.
  local target
  for target in wheel runtime; do
    local args=(build --quiet --build-arg "BASE_IMAGE=$BASE_IMAGE" -f "$ROOT/Dockerfile")
    if [ "$target" = wheel ]; then args+=(--target wheel -t "$BUILD_CACHE")
    else args+=(-t "$IMAGE"); fi
    if ! out="$(DOCKER_BUILDKIT=0 "$DOCKER" "${args[@]}" "$ROOT" 2>&1)"; then
      echo "$out" >&2
      die "docker build of $IMAGE ($target stage) failed (run without --quiet to see all steps: DOCKER_BUILDKIT=0 $DOCKER build --build-arg BASE_IMAGE=$BASE_IMAGE -t $IMAGE $ROOT)"
    fi
  done
  new_cache="$("$DOCKER" image inspect -f '{{.Id}}' "$BUILD_CACHE")"
  if [ -n "$old_cache" ] && [ "$old_cache" != "$new_cache" ]; then
    # The old build stage is untagged now; nothing runs it (it is never deployed).
    "$DOCKER" image rm "$old_cache" >/dev/null 2>&1 || true
  fi
  local id size
  id="$("$DOCKER" image inspect -f '{{.Id}}' "$IMAGE")"
  size="$("$DOCKER" image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1/1e6}')"
  log "image $IMAGE built in $(since "$t0"): ${id:0:19} $size"
  echo "SWARMFD_IMAGE_ID=$id"
}

step_status() {
  pick_client
  echo "client: ${DOCKER:-none}   dockerd: $(command -v dockerd || echo none)"
  if engine_running; then
    "$DOCKER" info -f 'engine {{.ServerVersion}}  swarm {{.Swarm.LocalNodeState}}  manager {{.Swarm.ControlAvailable}}'
    "$DOCKER" image ls --format '{{.Repository}}:{{.Tag}} {{.ID}} {{.Size}}' | grep -E '^swarmfd' || echo "no swarmfd images"
  else
    echo "engine not answering"
  fi
}

# One run of a step at a time, each step under its own lock: .ci/run starts `all` in
# the background while the test venv is installed, and the test fixtures' own calls
# then wait for the steps they need, and find them done. Separate locks let the Swarm
# tests start while `all` still builds the node image, which only tests/multinode/
# needs. with_lock holds the lock on fd 9 until the (sub)shell that took it ends.
LOCK_PREFIX="${SWARMFD_SETUP_LOCK:-/run/lock/swarmfd-setup-docker}"
with_lock() {
  local lock="$LOCK_PREFIX.$1.lock"
  mkdir -p "$(dirname "$lock")" 2>/dev/null || true
  exec 9>>"$lock" || die "cannot open the set-up lock file $lock (set SWARMFD_SETUP_LOCK)"
  if ! flock -n 9; then
    log "another setup-docker.sh run holds $lock; waiting for it"
    flock 9
  fi
}

# run_step STEP: the step in a subshell holding its lock.
run_step() {
  ( with_lock "$1"; "step_$1" )
}

# `all`: the node image (mmdebstrap, about 100 s cold) is built alongside the chain
# base, wheelhouse, image, which the one-node Swarm tests wait for.
step_all() {
  run_step engine
  NODE_LOG="$(mktemp /tmp/swarmfd-setup-node.XXXXXX)"
  run_step node >"$NODE_LOG" 2>&1 &
  NODE_PID=$!
  trap 'wait_node || true' EXIT  # a failed image chain still waits for (and shows) it
  run_step base
  run_step wheelhouse
  run_step image
  trap - EXIT
  wait_node || die "step node failed (its output is above)"
}

# Wait for the node image build that step_all started; show its output; its status.
wait_node() {
  local status=0
  wait "$NODE_PID" || status=$?
  cat "$NODE_LOG"
  rm -f "$NODE_LOG"
  return "$status"
}

main() {
  local steps=("$@")
  [ ${#steps[@]} -gt 0 ] || steps=(deploy)
  case " ${steps[*]} " in *" base "*|*" node "*|*" deploy "*|*" all "*) export NEED_MMDEBSTRAP=1 ;; esac
  local t0; t0=$(now)
  local s
  for s in "${steps[@]}"; do
    case "$s" in
      engine|base|wheelhouse|image|node) run_step "$s" ;;
      deploy) run_step engine; run_step base; run_step wheelhouse; run_step image ;;
      all) step_all ;;
      status) step_status ;;
      -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; return 0 ;;
      *) die "unknown step '$s' (expected engine, base, wheelhouse, image, node, deploy, all or status)" ;;
    esac
  done
  log "done in $(since "$t0")"
}

main "$@"
