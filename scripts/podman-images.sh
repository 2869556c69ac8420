#!/usr/bin/env bash
# Sourced by scripts/compose-test.sh and scripts/kube-test.sh: podman, and fedsaddle's two images built with it.
#
#   1. tools: podman, runc, debootstrap, docker-compose (installed with apt-get when root);
#   2. a base image: python:3.11 from a registry, or, with none reachable, a Debian
#      base made here with debootstrap and imported (cached in podman's storage);
#   3. wheels of every dependency, so that the image build needs no package index;
#   4. the client and coordinator images, built with podman; skipped, with 3, when both are labelled with
#      the hash of the files they would be built from (make kube-test after make compose-test builds nothing).
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

# -- 3-4. wheels and images, unless the images were built from these very files ----------------------
# Every file the build context holds (tracked, or new and not ignored), hashed: an image labelled with the
# same hash was built from the same source on the same base, and is used as it is (make kube-test after
# make compose-test builds nothing). Anything changed, and the wheels and images are made again.
SOURCE_ID=$( { echo "$BASE"; git ls-files -co --exclude-standard -- Dockerfile pyproject.toml README.md fedsaddle common \
  client server proto experiments examples docker | sort | xargs -d '\n' sha256sum; } | sha256sum | cut -c1-32)
built=yes
for image in fedsaddle-client:latest fedsaddle:latest; do
  [ "$(podman image inspect --format '{{ index .Labels "fedsaddle.source" }}' "$image" 2>/dev/null)" = "$SOURCE_ID" ] || built=""
done
if [ -n "$built" ]; then
  say "images up to date (built from these files: $SOURCE_ID)"
else
  WHEELS=docker/wheels  # inside the build context (and ignored by git)
  "$PY" -m pip wheel -q --wheel-dir "$WHEELS" '.[plot]' 'setuptools>=68' wheel >"$WORK/wheels.log" 2>&1 \
    || { tail -20 "$WORK/wheels.log" >&2; exit 1; }
  for target in client coordinator; do
    image=$([ $target = client ] && echo fedsaddle-client:latest || echo fedsaddle:latest)
    podman build -q --build-arg BASE="$BASE" --build-arg WHEELS="$WHEELS" --label "fedsaddle.source=$SOURCE_ID" \
      --target $target -t "$image" . >/dev/null
  done
  say "images built ($(( $(date +%s) - _images_started )) s so far)"
fi
