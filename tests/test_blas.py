"""BLAS's thread count (common/blas.py): the operator's OPENBLAS_NUM_THREADS, else one, in every process."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from fedsaddle.common import blas

SCRIPT = """
import os
for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.pop(name, None)
os.environ.update(dict(arg.split("=") for arg in __import__("sys").argv[1:]))
from fedsaddle.common import blas
blas.apply()  # before numpy loads: nothing to set yet, and nothing to remember
import numpy  # loads OpenBLAS with its own default
get = blas._loaded().get_threads
before = get()
with blas.threads_for_run():
    during = get()
blas.apply()
print(before, during, get())
"""


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: BLAS starts on one thread anyway")
@pytest.mark.parametrize(("setting", "expected"), [((), 1), (("OPENBLAS_NUM_THREADS=2",), 2)])
def test_the_loaded_blas_takes_the_count_even_if_looked_for_before_numpy_loaded(
    setting: tuple[str, ...], expected: int
) -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT, *setting], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    before, during, after = (int(v) for v in done.stdout.split())
    assert during == after == expected
    if setting:
        assert before == 2  # numpy loaded with the operator's count


@pytest.mark.parametrize(("value", "count"), [(None, 1), ("3", 3), ("0", 1), ("many", 1)])
def test_the_count_is_the_operators_when_it_is_one(
    value: str | None, count: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    if value is None:
        monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OPENBLAS_NUM_THREADS", value)
    assert blas.threads() == count


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 kernel names")
@pytest.mark.parametrize("kernel", ["Haswell", "Sandybridge"])
def test_the_description_names_the_kernel_the_operator_chose(kernel: str) -> None:
    # Kernels sum matrix products in other orders; the description lets hosts be compared.
    script = "import numpy\nfrom fedsaddle.common import blas\nblas.apply()\nprint(blas.describe())"
    env = {**os.environ, "OPENBLAS_CORETYPE": kernel, "OPENBLAS_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"OpenBLAS {kernel} kernel, 1 thread"


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 kernel names")
def test_the_coordinator_records_each_clients_stack_and_warns_when_they_differ(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Two client processes, the second made to run another kernel, as a host with another CPU would.
    import logging

    from fedsaddle.common.problems import QuadraticGameSpec
    from fedsaddle.launch import client_command, client_env, reap
    from fedsaddle.server.pool import RunInfo
    from fedsaddle.server.transport.grpc_pool import GrpcPool

    pool = GrpcPool(2, "127.0.0.1:0")
    processes = [
        subprocess.Popen(client_command(pool.address, str(i)), env={**client_env(), **extra})
        for i, extra in enumerate(({}, {"OPENBLAS_CORETYPE": "Sandybridge"}))
    ]
    try:
        pool.wait_for_clients(60)
        with caplog.at_level(logging.WARNING, logger="fedsaddle.coordinator"):
            for run_id in ("r1", "r2"):  # warned once, not once per run
                pool.start_run(RunInfo(run_id, QuadraticGameSpec(num_clients=2, dim=3), 0))
        stacks = pool.numeric_stacks()
    finally:
        pool.close()
        reap(processes)
    theirs = [stack for stack, clients in stacks.items() if clients == [1]]
    assert theirs == [f"numpy {__import__('numpy').__version__}, OpenBLAS Sandybridge kernel, 1 thread"]
    assert len(stacks) == 2 and stacks[next(s for s in stacks if s not in theirs)] == [0]
    (warning,) = [r.getMessage() for r in caplog.records if "numeric stacks" in r.getMessage()]
    assert "Sandybridge kernel, 1 thread (clients [1])" in warning
