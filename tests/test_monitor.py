"""The monitor (server/monitor, common/monitoring.py, client/monitor.py) over real sockets on 127.0.0.1.

What it shows equals what summary.json records; it is read-only, loopback unless given TLS
and a viewer token, refuses viewers without the token, never shows a vector (with secure
aggregation, nothing per client beyond liveness and timing), and viewers that never read
neither stop nor change a run. The real Prometheus server and the real browser are
tests/test_monitor_prometheus.py and tests/test_monitor_browser.py.
"""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from conftest import config, fedsaddle
from prometheus_client.parser import text_string_to_metric_families

from fedsaddle.common.monitoring import Exposure, MonitorError, MonitorServer, Reply, check_exposure
from fedsaddle.launch import CLIENT_ENV, reap, start_clients
from fedsaddle.server.checkpoint import config_digest
from fedsaddle.server.config import MonitorSpec
from fedsaddle.server.monitor import Monitor
from fedsaddle.server.runs import run_config
from fedsaddle.server.transport.grpc_pool import GrpcPool
from fedsaddle.server.transport.local_pool import LocalPool

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "a-viewer-token-of-32-characters!"


def game(out: Path, rounds: int = 60, secure: bool = False, **fields: Any) -> Any:
    fields.setdefault("privacy", {"secure_aggregation": secure})
    fields.setdefault("evaluate_every", 5)
    fields.setdefault("output", {"dir": str(out), "plot": False, "gradient_norm": True})
    return config(
        name="watched",
        problem={"name": "quadratic_game", "num_clients": 3, "dim": 3, "mu": 1.0, "heterogeneity": 0.5},
        rounds=rounds,
        algorithms=[{"name": "minibatch_md", "gamma": 0.1}, {"name": "mirror_prox", "gamma": 0.15}],
        **fields,
    )


def watched_run(run: Any, monitor: Monitor) -> Any:
    """An in-process run of `run`, told to the monitor as the command line tells it."""
    pool = LocalPool()
    monitor.attach(pool)
    outcome = run_config(run, pool, pool.describe(), on_step=monitor.on_step)
    monitor.finish(outcome)
    return outcome


def get(
    url: str, headers: dict[str, str] | None = None, context: ssl.SSLContext | None = None
) -> tuple[int, Any, bytes]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as reply:
            return reply.status, reply.headers, reply.read()
    except urllib.error.HTTPError as refused:
        return refused.code, refused.headers, refused.read()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a Prometheus text exposition, as prometheus-client's own parser reads it."""
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> tuple[Monitor, Any, dict[str, Any]]:
    """One watched in-process run, over: its monitor (still serving), outcome and summary.json."""
    out = tmp_path_factory.mktemp("runs")
    run = game(out)
    monitor = Monitor(run, MonitorSpec(listen="127.0.0.1:0"))
    try:
        outcome = watched_run(run, monitor)
        summary = json.loads((outcome.run_dir / "summary.json").read_text())
        yield monitor, outcome, summary
    finally:
        monitor.close()


def test_the_metrics_are_the_summary_s_counts(finished: tuple[Monitor, Any, dict[str, Any]]) -> None:
    monitor, _, summary = finished
    status, headers, body = get(monitor.url + "metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain; version=")
    found = samples(body.decode())
    histogram_count = 0.0
    for algorithm in summary["algorithms"]:
        name = algorithm["name"]
        for category, counts in algorithm["traffic"].items():
            assert found[("fedsaddle_rounds_total", (("algorithm", name), ("category", category)))] == counts["rounds"]
            for direction in ("down", "up"):
                labels = (("algorithm", name), ("category", category), ("direction", direction))
                assert found[("fedsaddle_messages_total", labels)] == counts[f"messages_{direction}"]
                assert found[("fedsaddle_floats_total", labels)] == counts[f"floats_{direction}"]
            histogram_count += counts["rounds"]
        assert found[("fedsaddle_round", (("algorithm", name),))] == algorithm["traffic"]["algorithm"]["rounds"]
        status_labels = (("algorithm", name), ("status", "ok"))
        assert found[("fedsaddle_algorithm_status", status_labels)] == 1.0
        measure = (("algorithm", name), ("measure", "dist_x"))
        assert found[("fedsaddle_convergence", measure)] == pytest.approx(algorithm["dist_x"], rel=1e-12)
        assert ("fedsaddle_convergence", (("algorithm", name), ("measure", "grad_norm"))) in found
    durations = sum(v for (n, _), v in found.items() if n == "fedsaddle_round_duration_seconds_count")
    assert durations == histogram_count > 0  # every round observed once, whatever its category
    assert found[("fedsaddle_clients_expected", ())] == 3
    assert found[("fedsaddle_run_finished", ())] == 1.0 and found[("fedsaddle_run_failed", ())] == 0.0


def test_the_state_holds_numbers_and_never_a_vector(finished: tuple[Monitor, Any, dict[str, Any]]) -> None:
    monitor, outcome, summary = finished
    status, _, body = get(monitor.url + "state")
    state = json.loads(body)
    assert status == 200 and state["outcome"] == {"failure": None, "run_dir": str(outcome.run_dir)}
    shown = {a["name"]: a for a in state["algorithms"]}
    for algorithm in summary["algorithms"]:
        assert shown[algorithm["name"]]["traffic"] == {
            category: {k: v for k, v in counts.items() if not k.startswith("per_client")}
            for category, counts in algorithm["traffic"].items()
        }
        curve = state["points"][algorithm["name"]]
        assert curve[-1]["dist_x"] == pytest.approx(algorithm["dist_x"], rel=1e-12)

    def scalars_only(value: Any) -> None:
        assert not isinstance(value, list) or all(isinstance(v, dict) for v in value), value
        for inner in value.values() if isinstance(value, dict) else value if isinstance(value, list) else ():
            scalars_only(inner)

    scalars_only(state)  # lists hold records or clients, never numbers: no vector, no per-client counts


def test_the_monitor_is_read_only(finished: tuple[Monitor, Any, dict[str, Any]]) -> None:
    monitor, _, _ = finished
    host, port = monitor.address.split(":")
    for method in ("POST", "PUT", "DELETE"):
        connection = http.client.HTTPConnection(host, int(port), timeout=10)
        connection.request(method, "/metrics", body=b"x")
        reply = connection.getresponse()
        assert reply.status == 405 and reply.getheader("Allow") == "GET, HEAD"
        connection.close()
    status, headers, body = get(monitor.url)
    assert status == 200 and b'<script src="/dashboard.js"' in body
    assert "default-src 'self'" in headers["Content-Security-Policy"]  # nothing loaded from elsewhere
    assert get(monitor.url + "nothing-here")[0] == 404


def test_a_taken_address_is_said_before_the_run_starts(tmp_path: Path) -> None:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps(game(tmp_path / "runs").model_dump(mode="json")))
    try:
        result = fedsaddle("local", "--config", str(path), "--monitor", f"127.0.0.1:{port}", timeout=60)
    finally:
        holder.close()
    assert result.returncode == 2, result.stderr
    assert f"monitor: cannot listen on 127.0.0.1:{port}: Address already in use" in result.stderr
    assert not (tmp_path / "runs").exists()  # no run directory: nothing started
    assert "client processes" not in result.stderr


def test_an_address_off_loopback_needs_tls_and_a_token(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps(game(tmp_path / "runs").model_dump(mode="json")))
    result = fedsaddle("local", "--config", str(path), "--monitor", "0.0.0.0:0", timeout=60)
    assert result.returncode == 2
    assert "0.0.0.0:0 is not a loopback address, so the monitor needs TLS" in result.stderr
    token = tmp_path / "token"
    token.write_text("short\n")
    with pytest.raises(MonitorError, match="has 5 characters; use at least 16"):
        check_exposure(Exposure("127.0.0.1:0", token_file=str(token)))
    with pytest.raises(MonitorError, match="TLS needs both a certificate and its key"):
        check_exposure(Exposure("0.0.0.0:0", cert=str(token), token_file=str(token)))
    bad = fedsaddle("local", "--config", str(path), "--monitor", "127.0.0.1:99999", timeout=60)
    assert bad.returncode == 2 and "port must be a number from 0 to 65535" in bad.stderr
    with pytest.raises(ValueError, match=r"monitor\.listen"):
        game(tmp_path, monitor={"listen": "nowhere"})


def test_the_monitor_is_not_part_of_the_checkpoint_s_config(tmp_path: Path) -> None:
    plain = game(tmp_path)
    watched = plain.model_copy(update={"monitor": MonitorSpec(listen="127.0.0.1:9999")})
    assert config_digest(plain) == config_digest(watched)  # a run resumed with another monitor is the same run


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("certs")
    subprocess.run(["bash", str(ROOT / "scripts/dev-certs.sh"), str(out)], check=True, capture_output=True)
    return out


def test_with_tls_and_a_token_a_viewer_without_the_token_is_refused(tmp_path: Path, certs: Path) -> None:
    token = tmp_path / "viewer-token"
    token.write_text(TOKEN + "\n")
    tls = {"cert": str(certs / "coordinator.pem"), "key": str(certs / "coordinator.key")}
    run = game(tmp_path / "runs", monitor={"listen": "127.0.0.1:0", "tls": tls, "token_file": str(token)})
    assert run.monitor is not None
    monitor = Monitor(run, run.monitor)
    try:
        watched_run(run, monitor)
        assert monitor.url.startswith("https://127.0.0.1:")
        trusted = ssl.create_default_context(cafile=str(certs / "ca.pem"))
        assert get(monitor.url + "metrics", context=trusted)[0] == 401
        assert get(monitor.url + "events", context=trusted)[0] == 401
        wrong = {"Authorization": "Bearer " + TOKEN[:-1] + "?"}
        assert get(monitor.url + "state", wrong, context=trusted)[0] == 401
        status, _, body = get(monitor.url + "metrics", {"Authorization": f"Bearer {TOKEN}"}, context=trusted)
        assert status == 200 and b"fedsaddle_rounds_total" in body
        # A browser comes once with ?token=: a cookie carries it from then on, and the address bar loses it.
        host, port = monitor.address.split(":")
        connection = http.client.HTTPSConnection(host, int(port), timeout=10, context=trusted)
        connection.request("GET", f"/?token={TOKEN}")
        reply = connection.getresponse()
        reply.read()
        assert reply.status == 303 and reply.getheader("Location") == "/"
        cookie = reply.getheader("Set-Cookie")
        assert "HttpOnly" in cookie and "Secure" in cookie and "SameSite=Strict" in cookie
        connection.request("GET", "/state", headers={"Cookie": cookie.split(";")[0]})
        reply = connection.getresponse()
        assert reply.status == 200 and json.loads(reply.read())["run"] == "watched"
        connection.close()
        with pytest.raises((ConnectionError, http.client.HTTPException, OSError)):  # plaintext gets nothing
            plain = http.client.HTTPConnection(host, int(port), timeout=10)
            plain.request("GET", "/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
            plain.getresponse().read()
        assert monitor.server.refused["unauthorized"] == 3
    finally:
        monitor.close()


def test_with_secure_aggregation_a_client_shows_only_liveness_and_timing(tmp_path: Path) -> None:
    run = game(tmp_path / "runs", rounds=12, secure=True)
    with GrpcPool(3, "127.0.0.1:0") as pool:
        processes = start_clients(pool.address, ["0", "1-2"])
        monitor = Monitor(run, MonitorSpec(listen="127.0.0.1:0"))
        try:
            monitor.attach(pool)
            pool.wait_for_clients(60)
            outcome = run_config(run, pool, {"kind": "grpc"}, on_step=monitor.on_step)
            monitor.finish(outcome)
            state = json.loads(get(monitor.url + "state")[2])
            metrics = get(monitor.url + "metrics")[2].decode()
        finally:
            monitor.close()
            pool.close()
            reap(processes)
    assert outcome.failure is None and state["secure_aggregation"] is True
    for client in state["clients"]:
        assert set(client) == {"index", "state", "latency_s"}  # no address
        assert client["latency_s"] > 0
    assert "127.0.0.1" not in json.dumps(state["clients"]) and "127.0.0.1" not in metrics
    found = samples(metrics)
    assert found[("fedsaddle_secagg_dropouts_total", ())] == 0
    summary = json.loads((outcome.run_dir / "summary.json").read_text())
    for algorithm in summary["algorithms"]:
        privacy = algorithm["traffic"]["privacy"]
        labels = (("algorithm", algorithm["name"]), ("category", "privacy"), ("direction", "down"))
        assert found[("fedsaddle_bytes_total", labels)] == privacy["bytes_down"] > 0


def never_reading_viewer(url_path: str, port: int) -> tuple[socket.socket, bytes]:
    """A viewer that asks for the stream and never reads it (its receive buffer as small as the kernel allows).
    Returns the socket and what came at once (empty for a stream, the refusal for one turned away)."""
    viewer = socket.socket()
    viewer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    viewer.connect(("127.0.0.1", port))
    viewer.sendall(f"GET {url_path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
    return viewer, b""


def test_viewers_that_never_read_neither_stop_nor_change_a_run(tmp_path: Path) -> None:
    plain = game(tmp_path / "plain", rounds=400)
    reference = run_config(plain, LocalPool(), {"kind": "inprocess"})
    run = game(tmp_path / "watched", rounds=400)
    monitor = Monitor(run, MonitorSpec(listen="127.0.0.1:0", max_viewers=4))
    port = monitor.server.port
    threads_before = threading.active_count()
    viewers = [never_reading_viewer("/events", port)[0] for _ in range(20)]
    try:
        deadline = time.monotonic() + 20
        while monitor.server.viewers + monitor.server.refused["streams"] < 20 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert monitor.server.viewers == 4 and monitor.server.refused["streams"] == 16
        # Bounded: a thread per connection at most, and the connections are bounded (max(32, 4 * viewers)).
        assert threading.active_count() - threads_before <= 20
        outcome = watched_run(run, monitor)  # the driver's thread never waits on a viewer
        found = samples(get(monitor.url + "metrics")[2].decode())
        assert found[("fedsaddle_monitor_viewers", ())] == 4
        assert found[("fedsaddle_monitor_refused_total", (("reason", "streams"),))] == 16
    finally:
        for viewer in viewers:
            viewer.close()
        monitor.close()
    assert outcome.failure is None
    for ours, theirs in zip(outcome.results, reference.results, strict=True):
        assert ours.summary()["z_sha256"] == theirs.summary()["z_sha256"]
        assert ours.traffic == theirs.traffic


def test_a_viewer_that_stops_reading_is_let_go() -> None:
    block = b"data: " + b"x" * (256 << 10) + b"\n\n"

    def flood(write: Any, stopping: threading.Event) -> None:
        while not stopping.is_set():
            write(block)

    server = MonitorServer(
        Exposure("127.0.0.1:0"), {"/metrics": lambda: Reply(b"ok\n")}, {"/events": flood}, write_timeout_s=0.5
    )
    try:
        viewer, _ = never_reading_viewer("/events", server.port)
        deadline = time.monotonic() + 5
        while server.viewers == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.viewers == 1
        deadline = time.monotonic() + 20
        while server.viewers and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.viewers == 0  # its write waited write_timeout_s, and it was let go
        assert get(f"http://{server.address}/metrics")[2] == b"ok\n"  # the others are served as before
        viewer.close()
    finally:
        server.close()


def test_a_client_process_serves_its_own_metrics(tmp_path: Path) -> None:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    run = game(tmp_path / "runs", rounds=30)
    with GrpcPool(3, "127.0.0.1:0") as pool:
        processes = start_clients(pool.address, ["0-2"], extra=["--monitor", f"127.0.0.1:{port}"])
        try:
            pool.wait_for_clients(60)
            outcome = run_config(run, pool, {"kind": "grpc"})
            found = samples(get(f"http://127.0.0.1:{port}/metrics")[2].decode())
        finally:
            pool.close()
            reap(processes)
    tasks = sum(counts["rounds"] for r in outcome.results for counts in r.traffic.values())
    assert found[("fedsaddle_client_tasks_answered_total", ())] == tasks
    assert found[("fedsaddle_client_hosted", ())] == 3
    assert found[("fedsaddle_client_compute_seconds_total", ())] > 0
    received = found[("fedsaddle_client_bytes_total", (("direction", "received"),))]
    sent = found[("fedsaddle_client_bytes_total", (("direction", "sent"),))]
    down = sum(counts["bytes_down"] for r in outcome.results for counts in r.traffic.values())
    up = sum(counts["bytes_up"] for r in outcome.results for counts in r.traffic.values())
    assert received >= down and sent >= up  # its one session carried every task and answer (and more: the start)


def test_a_coordinator_shows_its_clients_waiting_then_its_run_s_counts(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    run = game(tmp_path / "runs", rounds=40, monitor={"linger_s": 10})  # (ended by the test once it has read)
    path.write_text(json.dumps(run.model_dump(mode="json")))
    command = [sys.executable, "-m", "fedsaddle", "coordinator", "--config", str(path), "--listen", "127.0.0.1:0"]
    log = tmp_path / "coordinator.log"
    with open(log, "w") as out:  # both ports chosen by the system, read back from the log
        coordinator = subprocess.Popen(
            [*command, "--monitor", "127.0.0.1:0"], env=CLIENT_ENV, stdout=out, stderr=subprocess.STDOUT
        )
    client: subprocess.Popen[bytes] | None = None
    try:

        def logged(before: str, after: str) -> str | None:
            for line in log.read_text().splitlines():
                if before in line:
                    return line.split(before)[1].split(after)[0].strip()
            assert coordinator.poll() is None, log.read_text()
            return None

        deadline = time.monotonic() + 60
        while (address := logged("coordinator listening on ", ";")) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert address is not None
        url = logged("monitor: dashboard at ", ",")
        assert url is not None and url.startswith("http://127.0.0.1:"), url
        waiting = json.loads(get(url + "state")[2])  # before any client: every index waits
        assert [c["state"] for c in waiting["clients"]] == ["waiting"] * 3 and waiting["outcome"] is None
        client = subprocess.Popen(
            [sys.executable, "-m", "fedsaddle", "client", "--coordinator", address, "--clients", "0-2"],
            env=CLIENT_ENV,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 120
        while not (state := json.loads(get(url + "state")[2]))["outcome"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert state["outcome"]["failure"] is None
        coordinator_metrics = samples(get(url + "metrics")[2].decode())
        assert client.wait(timeout=60) == 0
    finally:
        for process in (coordinator, client):
            if process is not None and process.poll() is None:
                process.terminate()
                process.wait(timeout=30)
    assert coordinator_metrics[("fedsaddle_clients_expected", ())] == 3
    assert {c["address"].rsplit(":", 1)[0] for c in state["clients"]} <= {"ipv4:127.0.0.1", ""}
    (summary_path,) = (tmp_path / "runs").glob("watched-*/summary.json")
    summary = json.loads(summary_path.read_text())
    for algorithm in summary["algorithms"]:
        labels = (("algorithm", algorithm["name"]), ("category", "algorithm"), ("direction", "up"))
        assert coordinator_metrics[("fedsaddle_bytes_total", labels)] == algorithm["traffic"]["algorithm"]["bytes_up"]


def test_the_epsilon_spent_is_the_summary_s(tmp_path: Path) -> None:
    dp = {"clip": 5.0, "noise_multiplier": 2.0}
    out = {"dir": str(tmp_path / "runs"), "plot": False}
    run = game(tmp_path / "runs", rounds=20, privacy={"dp": dp}, evaluate_every=0, output=out)
    monitor = Monitor(run, MonitorSpec(listen="127.0.0.1:0"))
    try:
        outcome = watched_run(run, monitor)
        found = samples(get(monitor.url + "metrics")[2].decode())
    finally:
        monitor.close()
    for result in outcome.results:
        spent = found[("fedsaddle_dp_epsilon", (("algorithm", result.name),))]
        assert spent == result.extra["privacy"]["epsilon"] > 0
