#!/usr/bin/env bash
# Sourced by scripts/compose-test.sh and scripts/kube-test.sh: podman, and fedsaddle's two images built with it.
#
#   1. tools: podman, runc, debootstrap, docker-compose (installed with apt-get when root);
#   2. a base image: python:3.11 from a registry, or, with none reachable, a Debian
#      base made here with debootstrap and imported (cached in podman's storage);
#   3. wheels of every dependency, so that the image build needs no package index;
#   4. the client and coordinator images, built with podman (layers cached: a second build takes seconds).
#
# Expects ROOT, PY, WORK and the functions say and skip; sets CONTAINERS_CONF and BASE.
# Where podman cannot be had, skip says SKIPPED and why.
REGISTRY_BASE=docker.io/library/python:3.11.13-slim-bookworm
LOCAL_BASE=localhost/fedsaddle-base:bookworm
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
_images_started=$(date +%s)
# debootstrap can leave the chroot's /proc mounted (it did on these machines): rm -rf or tar would walk
# the host's /proc. So anything mounted below the root file system is unmounted first, and tar stays on
# that file system.
unmount_rootfs() {
  local mounted
  while read -r mounted; do umount -l "$mounted"; done < <(awk -v root="$WORK/rootfs/" 'index($2, root) == 1 {print $2}' /proc/mounts | sort -r)
}

# -- 1. tools ------------------------------------------------------------------------------
missing=()
for tool in podman runc debootstrap docker-compose; do command -v "$tool" >/dev/null 2>&1 || missing+=("$tool"); done
if [ ${#missing[@]} -gt 0 ]; then
  [ "$(id -u)" = 0 ] || skip "needs ${missing[*]}, and installing them needs root"
  command -v apt-get >/dev/null 2>&1 || skip "needs ${missing[*]}, and there is no apt-get to install them"
  say "installing podman runc debootstrap docker-compose"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc debootstrap docker-compose; } \
    >/dev/null 2>&1 || skip "apt-get could not install ${missing[*]}"
fi
mkdir -p "$WORK"
# Machines like these lack CAP_SYS_RESOURCE (no default rlimits) and cgroup v2 for crun.
cat >"$WORK/containers.conf" <<'EOF'
[containers]
default_ulimits = []

[engine]
runtime = "runc"
EOF
export CONTAINERS_CONF=$WORK/containers.conf
podman info >/dev/null 2>&1 || skip "podman is installed but cannot run here: $(podman info 2>&1 | tail -1)"

# -- 2. a base image -----------------------------------------------------------------------
if podman image exists "$REGISTRY_BASE" || timeout 20 podman pull -q "$REGISTRY_BASE" >/dev/null 2>&1; then
  BASE=$REGISTRY_BASE
else
  BASE=$LOCAL_BASE
  if ! podman image exists "$BASE"; then
    say "no registry reachable: making $BASE with debootstrap (about a minute)"
    unmount_rootfs
    rm -rf "$WORK/rootfs"
    debootstrap --variant=minbase --include=python3,python3-venv bookworm "$WORK/rootfs" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 \
      || { tail -5 "$WORK/debootstrap.log" >&2; exit 1; }
    unmount_rootfs
    tar -C "$WORK/rootfs" --one-file-system -c . | podman import -q - "$BASE" >/dev/null
    rm -rf "$WORK/rootfs"
  fi
fi
say "base image: $BASE"

# -- 3. wheels -----------------------------------------------------------------------------
WHEELS=docker/wheels  # inside the build context (and ignored by git)
"$PY" -m pip wheel -q --wheel-dir "$WHEELS" '.[plot]' 'setuptools>=68' wheel >"$WORK/wheels.log" 2>&1 \
  || { tail -20 "$WORK/wheels.log" >&2; exit 1; }

# -- 4. images -----------------------------------------------------------------------------
for target in client coordinator; do
  image=$([ $target = client ] && echo fedsaddle-client:latest || echo fedsaddle:latest)
  podman build -q --build-arg BASE="$BASE" --build-arg WHEELS="$WHEELS" --target $target -t "$image" . >/dev/null
done
say "images built ($(( $(date +%s) - _images_started )) s so far)"

