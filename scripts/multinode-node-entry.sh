#!/bin/sh
# Entrypoint of the swarmfd-node image: one docker-in-docker "node" of the multi-node
# test Swarm (tests/multinode/cluster.py). Makes the kernel interfaces dockerd needs
# writable, then execs dockerd with the given arguments.
#
# The node runs WITHOUT --privileged (on some VMs the capability bounding set lacks
# CAP_SYS_RESOURCE and runc refuses "--privileged" with "unable to apply caps"), but
# with every other capability, seccomp/AppArmor off, all devices and a private cgroup
# namespace. So /sys and the cgroup mounts arrive read-only and are remounted here.
set -eu
if grep -q ' /sys sysfs ro' /proc/mounts; then mount -o remount,rw /sys; fi
grep -E ' cgroup2? ro,' /proc/mounts | while read -r _ mp _; do mount -o remount,bind,rw "$mp"; done
mountpoint -q /sys/kernel/security 2>/dev/null \
  || mount -t securityfs none /sys/kernel/security 2>/dev/null || true
# cgroup v2: leave the root cgroup so controllers can be delegated to the inner containers.
if [ -f /sys/fs/cgroup/cgroup.controllers ]; then
  mkdir -p /sys/fs/cgroup/init
  xargs -rn1 < /sys/fs/cgroup/cgroup.procs > /sys/fs/cgroup/init/cgroup.procs 2>/dev/null || true
  sed -e 's/ / +/g' -e 's/^/+/' < /sys/fs/cgroup/cgroup.controllers \
    > /sys/fs/cgroup/cgroup.subtree_control 2>/dev/null || true
fi
rm -f /var/run/docker.pid /var/run/docker/containerd/containerd.pid
exec dockerd --host=unix:///var/run/docker.sock "$@"
