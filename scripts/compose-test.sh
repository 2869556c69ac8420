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
#   6. each run's summary checked against `fedsaddle simulate` on the same config, run
#      in the coordinator's image: the same z_sha256 and the same counts;
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
say() { echo "compose-test: $*" >&2; }
skip() { say "SKIPPED: $*"; exit 0; }
started=$(date +%s)

# -- 1-4. tools, a base image, wheels, images -------------------------------------------------
. scripts/podman-images.sh

# -- 5. the socket, and teardown whatever happens --------------------------------------------
SOCKET=$WORK/podman.sock
rm -f "$SOCKET"
podman system service --time=0 "unix://$SOCKET" >"$WORK/service.log" 2>&1 &
SERVICE=$!
export DOCKER_HOST=unix://$SOCKET
COMPOSE_FILE=docker-compose.yml
compose() { docker-compose -p "$PROJECT" -f "$COMPOSE_FILE" "$@"; }
cleanup() {
  compose down -v --remove-orphans >/dev/null 2>&1 || true
  kill "$SERVICE" 2>/dev/null || true
  wait "$SERVICE" 2>/dev/null || true
  rm -f "$SOCKET"
}
trap cleanup EXIT
for _ in $(seq 100); do [ -S "$SOCKET" ] && break; sleep 0.1; done

# Run a compose file's federation to its end; copy the run directory out; check it against simulate.
federation() {  # label, compose file, config for simulate, service to SIGKILL mid-run (or ""), simulate's extra args
  local label=$1 kill=$4
  COMPOSE_FILE=$2
  rm -rf "$WORK/simulated" "$WORK/runs-$label"
  # The reference runs in the coordinator's image: bit identity holds on one numeric stack, and
  # OpenBLAS picks its kernels per environment (OPENBLAS_CORETYPE on the host may name another
  # than the container detects), so a simulate on the host could sum in another order.
  mkdir -p "$WORK/simulated/reference"
  podman run --rm -v "$ROOT/$3:/config/run.yaml:ro" ${FEDSADDLE_DATA:+-v "$FEDSADDLE_DATA:$FEDSADDLE_DATA:ro"} \
    --entrypoint sh fedsaddle:latest -c "fedsaddle --quiet simulate --config /config/run.yaml --out /tmp/simulated \
      ${5:-} >/tmp/simulate.log 2>&1 || { tail -5 /tmp/simulate.log >&2; exit 1; }; cat /tmp/simulated/*/summary.json" \
    >"$WORK/simulated/reference/summary.json" || exit 1
  compose down -v --remove-orphans >/dev/null 2>&1 || true
  compose up --no-build -d >/dev/null 2>&1
  local coordinator restarts=0
  coordinator=$(compose ps -q coordinator)
  if [ -n "$kill" ]; then
    local victim
    victim=$(compose ps -q "$kill")
    for _ in $(seq 300); do podman logs "$coordinator" 2>&1 | grep -q "round .*/" && break; sleep 0.2; done
    # SIGKILL to the container's process from outside, as a crash: `podman kill` would count as
    # a deliberate stop, to which the restart policy does not apply.
    kill -9 "$(podman inspect --format '{{.State.Pid}}' "$victim")"
    say "$label: killed $kill's container (SIGKILL) mid-run"
  fi
  local code
  code=$(podman wait "$coordinator")
  if [ -n "$kill" ]; then restarts=$(podman inspect --format '{{.RestartCount}}' "$(compose ps -q "$kill")"); fi
  # The run directory, out of the `runs` volume (podman cp cannot read a stopped container's volumes).
  mkdir -p "$WORK/runs-$label"
  podman volume export "${PROJECT}_runs" | tar -x -C "$WORK/runs-$label"
  if [ "$code" != 0 ]; then compose logs --tail 30 >&2; say "$label: the coordinator exited with $code"; exit 1; fi
  "$PY" - "$WORK/runs-$label" "$WORK/simulated" "$label" "$kill" "$restarts" <<'EOF'
import json, sys
from pathlib import Path
ran, simulated, label, killed, restarts = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
(summary,) = ran.glob("*/summary.json")
(reference,) = simulated.glob("*/summary.json")
got, want = json.loads(summary.read_text()), json.loads(reference.read_text())
for a, b in zip(got["algorithms"], want["algorithms"], strict=True):
    counts = {k: v for k, v in a["traffic"]["algorithm"].items() if not k.startswith("bytes")}
    expected = {k: v for k, v in b["traffic"]["algorithm"].items() if not k.startswith("bytes")}
    if "privacy" in b["traffic"]:  # secure aggregation: its rounds and messages are counted alike too
        counts["privacy"] = {k: v for k, v in a["traffic"].get("privacy", {}).items() if not k.startswith("bytes")}
        expected["privacy"] = {k: v for k, v in b["traffic"]["privacy"].items() if not k.startswith("bytes")}
    if a["z_sha256"] != b["z_sha256"] or counts != expected:
        sys.exit(f"compose-test: {label}: {a['name']} differs from simulate: {a['z_sha256'][:12]} vs {b['z_sha256'][:12]}")
if killed and restarts < 1:
    sys.exit(f"compose-test: {label}: {killed} was not restarted")
again = f"; {killed} restarted {restarts} time(s) and rejoined" if killed else ""
if "privacy" in want["algorithms"][0]["traffic"]:
    again += f"; secure aggregation: {got['algorithms'][0]['traffic']['privacy']['rounds']} privacy rounds, as simulate's"
print(f"compose-test: {label}: {len(got['algorithms'])} algorithms, z_sha256 and counts equal to simulate{again}")
EOF
}

export FEDSADDLE_RUN=./examples/compose-run.yaml
federation plain docker-compose.yml examples/compose-run.yaml ""
export FEDSADDLE_RUN=./examples/compose-long-run.yaml
federation killed docker-compose.yml examples/compose-long-run.yaml client-b

# Private data: each client container mounts only its own file.
rm -rf "$WORK/data"
"$PY" -m fedsaddle --quiet data split --dataset breast_cancer --clients 4 --partition iid --seed 1 --out "$WORK/data" >/dev/null
export FEDSADDLE_DATA=$WORK/data
federation data examples/compose/data.yml examples/compose/data-run.yaml "" "--data $WORK/data/client-{i:03d}.npz"

# Mutual TLS, certificate identities (development certificates, readable by the containers' user);
# the same problem and algorithms as the plain run, so simulate runs that config.
rm -rf "$WORK/certs"
bash scripts/dev-certs.sh "$WORK/certs" site-a site-b >/dev/null
chmod 644 "$WORK/certs"/*.key
export FEDSADDLE_CERTS=$WORK/certs
federation tls-secure examples/compose/tls.yml examples/compose/tls-run.yaml ""
say "done in $(( $(date +%s) - started )) s; containers, networks, volumes and the socket are removed"
