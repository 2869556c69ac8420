"""The dashboard's picture in the docs (docs/figures/dashboard.png): a run watched in headless chromium.

    python scripts/dashboard-screenshot.py [OUT.png]

Runs `fedsaddle local --monitor` on the quadratic game with four algorithms and takes the
picture while the third one runs (needs chromium, chromium-driver and selenium).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service

RUN = """
name: quadratic-game
problem: {name: quadratic_game, num_clients: 5, dim: 4, mu: 1.0, heterogeneity: 0.5}
sync: {kind: fixed, tau: 5}
rounds: 600
evaluate_every: 10
algorithms:
  - {name: minibatch_md, gamma: 0.1}
  - {name: mirror_prox, gamma: 0.15}
  - {name: scaffold_s, gamma_local: 0.05}
  - {name: fedavg_s, gamma_local: 0.05, decay: constant}
output: {dir: OUT, plot: false, gradient_norm: true}
"""


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/figures/dashboard.png")
    folder = Path(tempfile.mkdtemp(prefix="dashboard-"))
    (folder / "run.yaml").write_text(RUN.replace("OUT", str(folder / "runs")))
    log = folder / "local.log"
    command = [sys.executable, "-m", "fedsaddle", "local", "--config", str(folder / "run.yaml"), "--quiet-clients"]
    with open(log, "w") as written:
        federation = subprocess.Popen([*command, "--monitor", "127.0.0.1:0"], stdout=written, stderr=subprocess.STDOUT)
    options = webdriver.ChromeOptions()
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1200,1130", "--hide-scrollbars"):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
    try:
        while not (lines := [x for x in log.read_text().splitlines() if x.startswith("monitor: dashboard at ")]):
            time.sleep(0.1)
        driver.get(lines[0].split()[3].rstrip(","))
        running = "return [...document.querySelectorAll('#algorithms td.status')].map(c => c.textContent).join(' ')"
        deadline = time.monotonic() + 120
        while "ok ok running" not in (shown := driver.execute_script(running)):
            if time.monotonic() > deadline:
                raise SystemExit(f"the third algorithm was not seen running (the page shows {shown!r})")
            time.sleep(0.05)
        time.sleep(0.6)
        driver.save_screenshot(str(out))
    finally:
        driver.quit()
        federation.wait(timeout=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
