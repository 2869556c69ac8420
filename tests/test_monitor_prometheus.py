"""A real Prometheus server (Debian's `prometheus`) scrapes a running federation's monitor on 127.0.0.1.

One `fedsaddle local --monitor` run and one Prometheus for the module: Prometheus scrapes
twice a second while the run goes; once it has scraped the run's end, a query through its
HTTP API must return summary.json's rounds, messages and bytes, algorithm by algorithm and
category by category. Without prometheus installed the module is SKIPPED with the reason
(under CI=true it fails: .ci/run installs it).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import require_tools, stop_processes

from fedsaddle.launch import CLIENT_ENV

RUN = """
name: scraped
problem: {name: quadratic_game, num_clients: 3, dim: 3, mu: 1.0, heterogeneity: 0.5}
sync: {kind: fixed, tau: 4}
rounds: 600
evaluate_every: 25
algorithms:
  - {name: minibatch_md, gamma: 0.1}
  - {name: scaffold_s, gamma_local: 0.05}
output: {dir: OUT, plot: false, gradient_norm: true}
monitor: {linger_s: 6}
"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def query(api: str, promql: str) -> list[dict[str, Any]]:
    url = f"{api}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=10) as reply:
        answer = json.loads(reply.read())
    assert answer["status"] == "success", answer
    return list(answer["data"]["result"])


def wait_until(what: str, check: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise AssertionError(f"{what} within {timeout:g} s")


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, Any]]]:
    """Prometheus's API address once it has scraped the finished run, and the run's summary.json."""
    tools = require_tools({"prometheus": "prometheus"}, "the test scrapes the monitor with a real Prometheus")
    folder = tmp_path_factory.mktemp("scraped")
    monitor_port, api_port = free_port(), free_port()
    (folder / "prometheus.yml").write_text(
        "global: {scrape_interval: 500ms, scrape_timeout: 500ms, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: fedsaddle\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{monitor_port}']}}]\n"
    )
    (folder / "run.yaml").write_text(RUN.replace("OUT", str(folder / "runs")))
    prometheus = subprocess.Popen(
        [
            tools["prometheus"],
            f"--config.file={folder / 'prometheus.yml'}",
            f"--storage.tsdb.path={folder / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{api_port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    api = f"http://127.0.0.1:{api_port}"
    federation: subprocess.Popen[str] | None = None
    try:

        def ready() -> bool:
            try:
                with urllib.request.urlopen(f"{api}/-/ready", timeout=2) as reply:
                    return bool(reply.status == 200)
            except OSError:
                assert prometheus.poll() is None, prometheus.communicate()[1][-2000:]
                return False

        wait_until("Prometheus ready", ready, 60)
        # Its scrape loop runs (up is 0 while nothing listens): from now on it scrapes twice a second.
        wait_until("Prometheus scraping", lambda: query(api, 'up{job="fedsaddle"}'), 60)
        command = [sys.executable, "-m", "fedsaddle", "local", "--config", str(folder / "run.yaml"), "--quiet-clients"]
        federation = subprocess.Popen(
            [*command, "--monitor", f"127.0.0.1:{monitor_port}"],
            env=CLIENT_ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        # While the run goes the round moves; once Prometheus has scraped its end (the monitor lingers 6 s), query.
        wait_until("Prometheus scraped the run's end", lambda: query(api, "fedsaddle_run_finished == 1"), 120)
        _, err = federation.communicate(timeout=60)
        assert federation.returncode == 0, err[-3000:]
        (summary_path,) = (folder / "runs").glob("scraped-*/summary.json")
        yield api, json.loads(summary_path.read_text())
    finally:
        if federation is not None and federation.poll() is None:
            federation.terminate()
            federation.wait(timeout=30)
        prometheus.terminate()
        stop_processes([prometheus])  # type: ignore[list-item]


def last(api: str, metric: str) -> list[dict[str, Any]]:
    """Each series' last scraped value (the monitor may be gone by now: its series are then marked stale)."""
    return query(api, f"last_over_time({metric}[10m])")


def by_labels(result: list[dict[str, Any]], *names: str) -> dict[tuple[str, ...], float]:
    return {tuple(item["metric"][name] for name in names): float(item["value"][1]) for item in result}


def test_prometheus_reads_the_summary_s_rounds_and_bytes(scraped: tuple[str, dict[str, Any]]) -> None:
    api, summary = scraped
    rounds = by_labels(last(api, "fedsaddle_rounds_total"), "algorithm", "category")
    wire = by_labels(last(api, "fedsaddle_bytes_total"), "algorithm", "category", "direction")
    messages = by_labels(last(api, "fedsaddle_messages_total"), "algorithm", "category", "direction")
    compared = 0
    for algorithm in summary["algorithms"]:
        name = algorithm["name"]
        for category, counts in algorithm["traffic"].items():
            assert rounds[(name, category)] == counts["rounds"]
            for direction in ("down", "up"):
                assert wire[(name, category, direction)] == counts[f"bytes_{direction}"]
                assert messages[(name, category, direction)] == counts[f"messages_{direction}"]
            compared += 1
        assert algorithm["traffic"]["algorithm"]["bytes_down"] > 0 and algorithm["traffic"]["evaluation"]["rounds"] > 0
    assert compared == 2 * 3  # two algorithms, three categories each
    (spent,) = last(api, 'fedsaddle_round{algorithm="minibatch_md"}')
    assert float(spent["value"][1]) == summary["algorithms"][0]["traffic"]["algorithm"]["rounds"] == 600


def test_prometheus_saw_the_federation_and_its_rounds(scraped: tuple[str, dict[str, Any]]) -> None:
    api, summary = scraped
    (joined,) = query(api, "max_over_time(fedsaddle_clients_joined[10m])")
    assert float(joined["value"][1]) == 3  # scraped while the run went
    (under_way,) = query(api, "min_over_time(fedsaddle_run_finished[10m])")
    assert float(under_way["value"][1]) == 0
    total = sum(counts["rounds"] for a in summary["algorithms"] for counts in a["traffic"].values())
    (observed,) = query(api, "sum(last_over_time(fedsaddle_round_duration_seconds_count[10m]))")
    assert float(observed["value"][1]) == total  # every round in the duration histogram, once
    (up,) = query(api, 'max_over_time(up{job="fedsaddle"}[10m])')
    assert float(up["value"][1]) == 1
