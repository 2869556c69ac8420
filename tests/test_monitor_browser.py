"""The dashboard in a real browser: Debian's chromium, driven headless through chromium-driver (selenium).

One `fedsaddle local --monitor` run for the module. The page, loaded while the run goes,
must show the round advance (server-sent events, no reload), and once the run is over show
summary.json's numbers: each algorithm's rounds and steps, its final distance, and the
bytes of every traffic category. Without chromium, chromium-driver or selenium the module
is SKIPPED with the reason (under CI=true it fails: .ci/run installs them).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import require_tools, under_ci

from fedsaddle.launch import CLIENT_ENV

RUN = """
name: watched
problem: {name: quadratic_game, num_clients: 3, dim: 3, mu: 1.0, heterogeneity: 0.5}
sync: {kind: fixed, tau: 4}
rounds: 2000
evaluate_every: 50
algorithms:
  - {name: minibatch_md, gamma: 0.1}
  - {name: mirror_prox, gamma: 0.15}
output: {dir: OUT, plot: false, gradient_norm: true}
monitor: {linger_s: 2}
"""


def wait_for(what: str, check: Any, timeout: float, every: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(every)
    raise AssertionError(f"{what} within {timeout:g} s")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    tools = require_tools(
        {"chromium": "chromium", "chromedriver": "chromium-driver"}, "the test reads the dashboard in a real browser"
    )
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        reason = "selenium is not installed (the dev extra: pip install -e '.[dev]')"
        if under_ci():
            pytest.fail(f"CI=true but {reason}")
        pytest.skip(reason)
    options = webdriver.ChromeOptions()
    options.binary_location = tools["chromium"]
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1280,1000",
    ):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(tools["chromedriver"]), options=options)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def watched(browser: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, list[int], Path]]:
    """The page of a run watched from its start: the rounds it showed on the way, and the run's folder."""
    from selenium.webdriver.common.by import By

    folder = tmp_path_factory.mktemp("watched")
    (folder / "run.yaml").write_text(RUN.replace("OUT", str(folder / "runs")))
    log = folder / "local.log"
    command = [sys.executable, "-m", "fedsaddle", "local", "--config", str(folder / "run.yaml"), "--quiet-clients"]
    with open(log, "w") as out:
        federation = subprocess.Popen(
            [*command, "--monitor", "127.0.0.1:0"], env=CLIENT_ENV, stdout=out, stderr=subprocess.STDOUT
        )
    try:

        def address() -> str | None:
            for line in log.read_text().splitlines():
                if line.startswith("monitor: dashboard at "):
                    return line.split()[3].rstrip(",")
            assert federation.poll() is None, log.read_text()[-3000:]
            return None

        browser.get(wait_for("the monitor's address", address, 60))
        cell = '#algorithms tr[data-algorithm="minibatch_md"] td.rounds'

        def shown_round() -> int:  # (read in one script: the table is redrawn at each update)
            text = browser.execute_script(f"const c = document.querySelector('{cell}'); return c ? c.textContent : ''")
            return int(text) if text else -1

        seen = [wait_for("a round shown", lambda: shown_round() > 0 and [shown_round()], 60)[0]]
        wait_for("the round advance", lambda: shown_round() > seen[0], 30, every=0.05)
        seen.append(shown_round())
        outcome = browser.find_element(By.ID, "outcome")  # (the badge itself stays; its text changes)
        wait_for("the run's end shown", lambda: outcome.text == "finished", 120)
        assert federation.wait(timeout=60) == 0, log.read_text()[-3000:]
        yield browser, seen, folder
    finally:
        if federation.poll() is None:
            federation.terminate()
            federation.wait(timeout=30)


def test_the_page_shows_the_round_advance_as_the_run_goes(watched: tuple[Any, list[int], Path]) -> None:
    _, seen, _ = watched
    first, later = seen
    assert 0 < first < later < 2000  # two values read while minibatch_md ran, with no reload between


def test_the_page_ends_with_the_summary_s_numbers(watched: tuple[Any, list[int], Path]) -> None:
    from selenium.webdriver.common.by import By

    browser, _, folder = watched
    (summary_path,) = (folder / "runs").glob("watched-*/summary.json")
    summary = json.loads(summary_path.read_text())
    for algorithm in summary["algorithms"]:
        name = algorithm["name"]
        row = browser.find_element(By.CSS_SELECTOR, f'#algorithms tr[data-algorithm="{name}"]')
        assert row.find_element(By.CSS_SELECTOR, "td.status").text == "ok"
        assert int(row.find_element(By.CSS_SELECTOR, "td.rounds").text) == algorithm["traffic"]["algorithm"]["rounds"]
        assert int(row.find_element(By.CSS_SELECTOR, "td.steps").text) == algorithm["steps"]
        shown = float(row.find_element(By.CSS_SELECTOR, "td.dist").text)
        assert shown == pytest.approx(algorithm["dist_x"], rel=1e-3)  # (4 significant digits on the page)
        for category, counts in algorithm["traffic"].items():
            if not counts["rounds"] and not counts["bytes_down"]:
                continue
            traffic = browser.find_element(
                By.CSS_SELECTOR, f'#traffic tr[data-algorithm="{name}"][data-category="{category}"]'
            )
            assert int(traffic.get_attribute("data-bytes")) == counts["bytes_down"] + counts["bytes_up"]
            assert int(traffic.find_element(By.CSS_SELECTOR, "td.rounds").text) == counts["rounds"]
            messages = f"{counts['messages_down']}/{counts['messages_up']}"
            assert traffic.find_element(By.CSS_SELECTOR, "td.messages").text == messages
    charts = browser.find_elements(By.CSS_SELECTOR, "#charts canvas")
    assert {c.get_attribute("data-measure") for c in charts} >= {"dist_x", "dist_z", "grad_norm"}
    clients = browser.find_elements(By.CSS_SELECTOR, "#clients tbody tr")
    assert len(clients) == 3 and all(float(c.find_element(By.CSS_SELECTOR, "td.latency").text) > 0 for c in clients)
