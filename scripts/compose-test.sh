#!/usr/bin/env bash
# make compose-test: the multi-container federation for real, with podman and docker-compose.
#
#   1. tools: podman, runc, debootstrap, docker-compose (installed with apt-get when root);
#   2. a base image: python:3.11 from a registry, or, with none reachable, a Debian
#      base made here with debootstrap and imported (cached in podman's storage);
#   3. wheels of every dependency, so that the image build needs no package index;
#   4. the client and coordinator images, built with podman;
#   5. docker-compose.yml brought up through podman's Docker-compatible socket and run
#      to the end, then again with a client container killed mid-run (it is restarted
#      and rejoins);
#   6. each run's summary checked against `fedsaddle simulate` on the same config:
#      the same z_sha256 and the same counts;
#   7. everything torn down: containers, networks, volumes, the socket process.
#
# Where podman cannot be had, it says SKIPPED and why (exit 0), never silently.
# COMPOSE_TEST_DIR (default /tmp/fedsaddle-compose-test) holds its working files.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
WORK=${COMPOSE_TEST_DIR:-/tmp/fedsaddle-compose-test}
PROJECT=fedsaddle-compose-test
REGISTRY_BASE=docker.io/library/python:3.11.13-slim-bookworm
LOCAL_BASE=localhost/fedsaddle-base:bookworm
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
say() { echo "compose-test: $*" >&2; }
skip() { say "SKIPPED: $*"; exit 0; }
started=$(date +%s)

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
    rm -rf "$WORK/rootfs"
    debootstrap --variant=minbase --include=python3,python3-venv bookworm "$WORK/rootfs" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 \
      || { tail -5 "$WORK/debootstrap.log" >&2; exit 1; }
    tar -C "$WORK/rootfs" -c . | podman import -q - "$BASE" >/dev/null
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
say "images built ($(( $(date +%s) - started )) s so far)"

# -- 5. the socket, and teardown whatever happens --------------------------------------------
SOCKET=$WORK/podman.sock
rm -f "$SOCKET"
podman system service --time=0 "unix://$SOCKET" >"$WORK/service.log" 2>&1 &
SERVICE=$!
export DOCKER_HOST=unix://$SOCKET
compose() { docker-compose -p "$PROJECT" -f docker-compose.yml "$@"; }
cleanup() {
  compose down -v --remove-orphans >/dev/null 2>&1 || true
  kill "$SERVICE" 2>/dev/null || true
  wait "$SERVICE" 2>/dev/null || true
  rm -f "$SOCKET"
}
trap cleanup EXIT
for _ in $(seq 100); do [ -S "$SOCKET" ] && break; sleep 0.1; done

# Run the federation to its end; copy the run directory out; check it against simulate.
federation() {  # $1: a label; $2: the run's config; $3: "kill" to kill client-b's container mid-run
  export FEDSADDLE_RUN=$2
  rm -rf "$WORK/simulated"
  "$PY" -m fedsaddle --quiet simulate --config "$2" --out "$WORK/simulated" >/dev/null
  compose down -v --remove-orphans >/dev/null 2>&1 || true
  rm -rf "$WORK/runs-$1"
  compose up --no-build -d >/dev/null 2>&1
  if [ "${3:-}" = kill ]; then
    local client
    client=$(compose ps -q client-b)
    # Wait for the run to be under way, then kill the container as a crash would.
    local coordinator
    coordinator=$(compose ps -q coordinator)
    for _ in $(seq 300); do podman logs "$coordinator" 2>&1 | grep -q "round .*/" && break; sleep 0.2; done
    # SIGKILL to the container's process from outside, as a crash: `podman kill` would count as
    # a deliberate stop, to which the restart policy does not apply.
    kill -9 "$(podman inspect --format '{{.State.Pid}}' "$client")"
    say "$1: killed client-b's container (SIGKILL) mid-run"
  fi
  local code
  code=$(podman wait "$(compose ps -q coordinator)")
  # The run directory, out of the `runs` volume (podman cp cannot read a stopped container's volumes).
  mkdir -p "$WORK/runs-$1"
  podman volume export "${PROJECT}_runs" | tar -x -C "$WORK/runs-$1"
  if [ "$code" != 0 ]; then compose logs --tail 30 >&2; say "$1: the coordinator exited with $code"; exit 1; fi
  restarts=$(podman inspect --format '{{.RestartCount}}' "$(compose ps -q client-b)")
  "$PY" - "$WORK/runs-$1" "$WORK/simulated" "$1" "$restarts" <<'EOF'
import json, sys
from pathlib import Path
ran, simulated, label, restarts = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
(summary,) = ran.glob("*/summary.json")
(reference,) = simulated.glob("*/summary.json")
got, want = json.loads(summary.read_text()), json.loads(reference.read_text())
for a, b in zip(got["algorithms"], want["algorithms"], strict=True):
    same = a["z_sha256"] == b["z_sha256"] and a["traffic"]["algorithm"]["rounds"] == b["traffic"]["algorithm"]["rounds"]
    counts = {k: v for k, v in a["traffic"]["algorithm"].items() if not k.startswith("bytes")}
    expected = {k: v for k, v in b["traffic"]["algorithm"].items() if not k.startswith("bytes")}
    if not same or counts != expected:
        sys.exit(f"compose-test: {label}: {a['name']} differs from simulate: {a['z_sha256'][:12]} vs {b['z_sha256'][:12]}")
if label == "killed" and restarts < 1:
    sys.exit("compose-test: killed: client-b was not restarted")
print(f"compose-test: {label}: {len(got['algorithms'])} algorithms, z_sha256 and counts equal to simulate"
      f" (client-b restarted {restarts} time(s))")
EOF
}
federation plain ./examples/compose-run.yaml
federation killed ./examples/compose-long-run.yaml kill
say "done in $(( $(date +%s) - started )) s; containers, networks, volumes and the socket are removed"
