#!/usr/bin/env bash
# make kube-test: the manifests of `fedsaddle deploy kubernetes`, played for real with `podman kube play`.
#
#   1-4. podman and the two images, as make compose-test makes them (scripts/podman-images.sh; the
#      layers are cached, so after compose-test this takes seconds);
#   5. development certificates naming the coordinator's Service, and the manifests for
#      examples/kube-run.yaml with TLS and a token per client (`--tls-dir`, `--tokens`);
#   6. the reference: `fedsaddle simulate` of the config the manifests' ConfigMap holds, in the
#      coordinator's image;
#   7. the podman form played on a network of its own: the coordinator's pod, and a pod with its
#      own data volume per client index; the health service asked as the coordinator's probe asks it;
#   8. mid-run, a client pod deleted and played again from its own file (what the StatefulSet's
#      controller does in a cluster): it rejoins, and the run ends;
#   9. the run's end: the coordinator holds (its readiness probe fails, its liveness probe passes)
#      and every client waits, so no restart starts the run again; then the run directory, out of
#      the runs volume: every algorithm's z_sha256 and counts equal simulate's, the coordinator ran
#      once, and it says the client rejoined;
#  10. everything torn down: pods, volumes, the network.
#
# Where podman cannot be had, it says SKIPPED and why (exit 0), never silently; with
# FEDSADDLE_REQUIRE_PODMAN set (CI sets it), that is a failure instead.
# KUBE_TEST_DIR (default /tmp/fedsaddle-kube-test) holds its working files.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
WORK=${KUBE_TEST_DIR:-/tmp/fedsaddle-kube-test}
NETWORK=fedsaddle-kube-test
NAME=fedsaddle
VICTIM=2  # the client index whose pod is deleted mid-run
say() { echo "kube-test: $*" >&2; }
skip() {
  if [ -n "${FEDSADDLE_REQUIRE_PODMAN:-}" ]; then say "FAILED: podman is required here (FEDSADDLE_REQUIRE_PODMAN): $*"; exit 1; fi
  say "SKIPPED: $*"
  exit 0
}
started=$(date +%s)

# -- 1-4. tools, a base image, wheels, images -------------------------------------------------
. scripts/podman-images.sh

# -- 5. certificates and manifests -------------------------------------------------------------
rm -rf "$WORK/certs" "$WORK/manifests" "$WORK/runs" "$WORK/simulated"
FEDSADDLE_CERT_SANS="DNS:$NAME-coordinator,DNS:localhost,IP:127.0.0.1" bash scripts/dev-certs.sh "$WORK/certs" >/dev/null
chmod 644 "$WORK/certs"/*.key  # the containers' user (uid 1000) reads them from the ConfigMap made of the Secret
"$PY" -m fedsaddle deploy kubernetes --config examples/kube-run.yaml --name "$NAME" --out "$WORK/manifests" \
  --tokens --tls-dir "$WORK/certs" >"$WORK/deploy.log"
FORM=$WORK/manifests/podman
# The ConfigMap's config (what the coordinator reads), and the probe's command (what kubelet would run).
"$PY" - "$WORK/manifests/kubernetes.yaml" "$WORK" <<'EOF'
import json, sys, yaml
from pathlib import Path
objects = {(o["kind"], o["metadata"]["name"]): o for o in yaml.safe_load_all(Path(sys.argv[1]).read_text())}
work = Path(sys.argv[2])
(work / "run.yaml").write_text(objects["ConfigMap", "fedsaddle-config"]["data"]["run.yaml"])
(container,) = objects["Deployment", "fedsaddle-coordinator"]["spec"]["template"]["spec"]["containers"]
for probe in ("readiness", "liveness"):
    (work / f"{probe}.json").write_text(json.dumps(container[f"{probe}Probe"]["exec"]["command"]))
EOF
probe() { "$PY" -c 'import json, sys; print("\n".join(json.load(open(sys.argv[1]))))' "$WORK/$1.json"; }
mapfile -t READY < <(probe readiness)
mapfile -t LIVE < <(probe liveness)

# -- 6. the reference ------------------------------------------------------------------------
mkdir -p "$WORK/simulated/reference"
podman run --rm -v "$WORK/run.yaml:/config/run.yaml:ro" --entrypoint sh fedsaddle:latest -c \
  "fedsaddle --quiet simulate --config /config/run.yaml --out /tmp/simulated >/tmp/simulate.log 2>&1 \
   || { tail -5 /tmp/simulate.log >&2; exit 1; }; cat /tmp/simulated/*/summary.json" \
  >"$WORK/simulated/reference/summary.json"

# -- 7. play ---------------------------------------------------------------------------------
cleanup() {
  podman kube down "$FORM/pods.yaml" >/dev/null 2>&1 || true
  for volume in $(podman volume ls -q --filter "name=^(data-)?$NAME-"); do podman volume rm -f "$volume" >/dev/null 2>&1 || true; done
  podman network rm -f "$NETWORK" >/dev/null 2>&1 || true
}
trap cleanup EXIT
cleanup
podman network create "$NETWORK" >/dev/null
play_started=$(date +%s)
CONFIGMAPS=$(ls "$FORM"/configmap-*.yaml | paste -sd,)
play() { podman kube play --network "$NETWORK" --configmap "$CONFIGMAPS" "$1" >"$WORK/play.log" 2>&1 \
  || { cat "$WORK/play.log" >&2; exit 1; }; }
play "$FORM/pods.yaml"
COORDINATOR=$NAME-coordinator-coordinator  # podman names a pod's container POD-CONTAINER
healthy=""
for _ in $(seq 100); do
  if podman exec "$COORDINATOR" "${READY[@]}" >/dev/null 2>&1; then healthy=yes; break; fi
  sleep 0.3
done
[ -n "$healthy" ] || { podman logs "$COORDINATOR" 2>&1 | tail -20 >&2; say "the coordinator never became ready"; exit 1; }
podman exec "$COORDINATOR" "${LIVE[@]}" >/dev/null || { say "the coordinator is ready but not live"; exit 1; }
say "the coordinator is ready and live (the probes' own commands: ${READY[*]:2}; and with --service '')"

# -- 8. a client pod deleted mid-run, and made again -----------------------------------------------
for _ in $(seq 300); do podman logs "$COORDINATOR" 2>&1 | grep -q "round .*/" && break; sleep 0.2; done
podman pod rm -f "$NAME-client-$VICTIM" >/dev/null
say "deleted pod $NAME-client-$VICTIM mid-run; playing it again from $FORM/client-$VICTIM.yaml"
podman volume exists "data-$NAME-client-$VICTIM" || { say "the deleted pod's data volume went with it"; exit 1; }
play "$FORM/client-$VICTIM.yaml"

# -- 9. the result ---------------------------------------------------------------------------
# --hold: when the run ends, the coordinator stays, not ready but live, and the clients wait; neither
# exits, so neither is restarted (restartPolicy Always, as a Deployment's and a StatefulSet's pods).
held=""
for _ in $(seq 600); do podman logs "$COORDINATOR" 2>&1 | grep -q "holding until SIGTERM" && { held=yes; break; }; sleep 0.5; done
played=$(( $(date +%s) - play_started ))
[ -n "$held" ] || { podman logs "$COORDINATOR" 2>&1 | tail -30 >&2; say "the run did not end within 300 s"; exit 1; }
if podman exec "$COORDINATOR" "${READY[@]}" >/dev/null 2>&1; then say "the coordinator is still ready after its run"; exit 1; fi
podman exec "$COORDINATOR" "${LIVE[@]}" >/dev/null || { say "the coordinator is not live after its run"; exit 1; }
for file in "$FORM"/client-*.yaml; do
  i=${file##*/client-}; i=${i%.yaml}
  for _ in $(seq 40); do podman logs "$NAME-client-$i-client" 2>&1 | grep -q "holding until SIGTERM" && break; sleep 0.25; done
  podman logs "$NAME-client-$i-client" 2>&1 | grep -q "holding until SIGTERM" || { say "client $i did not hold"; exit 1; }
done
say "the run has ended: the coordinator holds (not ready, live) and every client waits"
podman stop -t 30 "$COORDINATOR" >/dev/null  # SIGTERM, as kubelet sends
code=$(podman inspect --format '{{.State.ExitCode}}' "$COORDINATOR")
podman logs "$COORDINATOR" >"$WORK/coordinator.log" 2>&1
mkdir -p "$WORK/runs"
podman volume export "$NAME-runs" | tar -x -C "$WORK/runs"
if [ "$code" != 0 ]; then tail -30 "$WORK/coordinator.log" >&2; say "the coordinator exited with $code"; exit 1; fi
"$PY" - "$WORK/runs" "$WORK/simulated" "$WORK/coordinator.log" "$NAME-client-$VICTIM" <<'EOF'
import json, sys
from pathlib import Path
ran, simulated, log, victim = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]).read_text(), sys.argv[4]
(summary,) = ran.glob("*/summary.json")
(reference,) = simulated.glob("*/summary.json")
got, want = json.loads(summary.read_text()), json.loads(reference.read_text())
for a, b in zip(got["algorithms"], want["algorithms"], strict=True):
    counts = {k: v for k, v in a["traffic"]["algorithm"].items() if not k.startswith("bytes")}
    expected = {k: v for k, v in b["traffic"]["algorithm"].items() if not k.startswith("bytes")}
    if a["z_sha256"] != b["z_sha256"] or counts != expected:
        sys.exit(f"kube-test: {a['name']} differs from simulate: {a['z_sha256'][:12]} vs {b['z_sha256'][:12]}")
if log.count("run directory:") != 1:
    sys.exit("kube-test: the coordinator ran more than once")
rejoined = [line for line in log.splitlines() if f"({victim}" in line and "rejoined" in line]
if not rejoined:
    sys.exit(f"kube-test: the coordinator's log does not say that {victim} rejoined")
print(f"kube-test: {len(got['algorithms'])} algorithm(s) over {len(got['algorithms'][0]['traffic'])} traffic "
      f"categories: z_sha256 {got['algorithms'][0]['z_sha256'][:12]} and counts equal to simulate; {victim} was "
      f"deleted, played again and rejoined over TLS with its token")
EOF
say "the federation ran in ${played} s; done in $(( $(date +%s) - started )) s; pods, volumes and the network are removed"
