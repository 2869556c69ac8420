"""Problems written in PyTorch: G_i by autograd, the wire order, minibatch local steps, the errors a
problem's author meets, and bit identity between `simulate` and real client processes (with secure
aggregation, and across a coordinator killed and resumed)."""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pytest
import yaml

torch = pytest.importorskip("torch", reason="PyTorch is not installed (the torch extra: `make install` adds it)")

from conftest import CLIENT_ENV, fedsaddle, stop_processes, summary_of  # noqa: E402
from pydantic import Field  # noqa: E402
from test_docs import CLIENT_PAGE, titled_block  # noqa: E402
from test_failures import Coordinator, write_config  # noqa: E402
from test_resume import free_address, resume_coordinator, simulated, without_time  # noqa: E402

from fedsaddle.common.problems import ClientData  # noqa: E402
from fedsaddle.common.problems.pytorch import (  # noqa: E402
    Batch,
    TorchProblem,
    TorchShards,
    TorchSpec,
    flatten,
    minibatch_rows,
    unflatten,
)
from fedsaddle.common.problems.shards import ProblemError  # noqa: E402
from fedsaddle.common.tasks import GradientTask, LocalStepsTask  # noqa: E402
from fedsaddle.common.worker import Worker  # noqa: E402
from fedsaddle.launch import client_command  # noqa: E402
from fedsaddle.server.config import ConfigError, parse_config  # noqa: E402

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "deep-auc.yaml"
MINIBATCH_ROWS = titled_block(CLIENT_PAGE, "minibatch rows")


class TinySpec(TorchSpec):
    name: Literal["tiny"] = "tiny"
    num_clients: int = 2
    dtype: Literal["float32", "float64"] = Field("float64")


class Tiny(TorchProblem):
    """x = a linear model (weight 1 x 3, bias), y = v in R^2:
    f_i = mean(r^2)/2 + v0 mean(r) + v1 b - |v|^2/2, with r = X w + b - t."""

    Spec = TinySpec
    spec: TinySpec

    def players(self) -> tuple[Any, Any]:
        return torch.nn.Linear(3, 1), [torch.zeros(2)]

    def loss(self, x: Any, y: Any, batch: Batch, *, client: Any) -> Any:
        (v,) = y
        r = x(batch.inputs).squeeze(1) - batch.targets
        return 0.5 * torch.mean(r**2) + v[0] * torch.mean(r) + v[1] * x.bias.sum() - 0.5 * torch.sum(v**2)


def hand_gradient(X: np.ndarray, t: np.ndarray, z: np.ndarray) -> np.ndarray:
    w, b, v = z[:3], z[3], z[4:]
    r = X @ w + b - t
    grad_w = X.T @ r / len(t) + v[0] * X.mean(axis=0)
    grad_b = r.mean() + v[0] + v[1]
    grad_v = np.array([r.mean() - v[0], b - v[1]])
    return np.concatenate([grad_w, [grad_b], -grad_v])


def client_data(rows: int, seed: int) -> ClientData:
    rng = np.random.default_rng(seed)
    return ClientData(f"client-{seed}", rng.standard_normal((rows, 3)), rng.standard_normal(rows))


def test_the_gradient_is_autograd_of_the_loss_with_the_max_players_block_negated() -> None:
    problem = Tiny(TinySpec())
    datas = [client_data(7, 0), client_data(5, 1)]
    shards = TorchShards(problem, datas, [0, 1])
    z = np.random.default_rng(2).standard_normal((6, 2))
    g = shards.gradient(z)
    for j, data in enumerate(datas):
        np.testing.assert_allclose(g[:, j], hand_gradient(data.X, data.y, z[:, j]), rtol=1e-12, atol=1e-13)
        # and f_i's own finite differences agree with G_i, x's block and minus y's
        step, f = 1e-6, problem.objective
        numeric = np.array(
            [(f(data, z[:, j] + step * e) - f(data, z[:, j] - step * e)) / (2 * step) for e in np.eye(6)]
        )
        np.testing.assert_allclose(g[: 3 + 1, j], numeric[:4], atol=1e-7)
        np.testing.assert_allclose(g[4:, j], -numeric[4:], atol=1e-7)
    assert problem.dims() == (4, 2)


def test_the_wire_order_is_the_min_players_named_parameters_then_the_max_players() -> None:
    problem = Tiny(TinySpec())
    x, y = problem.build("cpu", seed=5)
    z = flatten(x.parameters, y.parameters)
    weight, bias = x.value.weight.detach().numpy().ravel(), x.value.bias.detach().numpy()
    np.testing.assert_array_equal(z, np.concatenate([weight, bias, [0.0, 0.0]]))
    # the starting point of `init: problem` is that build, for the run's seed; another seed, another network
    np.testing.assert_array_equal(problem.initial_point(5), z)
    assert not np.array_equal(problem.initial_point(6)[:4], z[:4])
    target = np.arange(6.0) / 7
    unflatten(target, [*x.parameters, *y.parameters])
    np.testing.assert_array_equal(x.value.weight.detach().numpy().ravel(), target[:3])
    np.testing.assert_array_equal(y.value[0].detach().numpy(), target[4:])
    np.testing.assert_array_equal(flatten(x.parameters, y.parameters), target)
    with pytest.raises(ValueError, match="shape \\(5,\\); the players have 6 parameters"):
        unflatten(target[:5], [*x.parameters, *y.parameters])
    # float32 players round z to nearest, and widen back exactly
    single = Tiny(TinySpec(dtype="float32"))
    xs, ys = single.build("cpu", seed=0)
    unflatten(target, [*xs.parameters, *ys.parameters])
    assert flatten(xs.parameters, ys.parameters).tolist() == target.astype(np.float32).astype(np.float64).tolist()


def test_minibatch_local_steps_take_the_documented_rows_of_each_call() -> None:
    # Each local step of client i in round r draws the rows minibatch_rows(seed, i, r, step, m, b): the steps
    # are replayed here by hand from full-batch gradients on those rows alone.
    problem = Tiny(TinySpec(batch_size=3))
    datas = [client_data(7, 0), client_data(5, 1)]
    worker = Worker(TorchShards(problem, datas, [4, 9]), seed=11)
    z0 = np.random.default_rng(3).standard_normal(6)
    steps, gamma = 4, 0.1
    answer = worker.execute(LocalStepsTask(z0, steps, gamma), round_id=7)
    for row, (i, data) in enumerate(zip((4, 9), datas, strict=True)):
        z, total = z0.copy(), np.zeros(6)
        for call in range(steps):
            rows = minibatch_rows(11, i, 7, call, data.samples, 3)
            assert rows.shape == (3,) and len(set(rows.tolist())) == 3
            found = {"numpy": np, "seed": 11, "i": i, "round_id": 7, "call": call, "m": data.samples, "b": 3}
            exec(MINIBATCH_ROWS, {}, found)  # the stream as docs/reference/client-arithmetic.md writes it down
            np.testing.assert_array_equal(rows, found["rows"])
            g = hand_gradient(data.X[rows], data.y[rows], z)
            total += g
            z = z - gamma * g
        np.testing.assert_allclose(answer.vectors[row], total, rtol=1e-12, atol=1e-13)
    # the same round again: the same bits; another round: other rows
    again = worker.execute(LocalStepsTask(z0, steps, gamma), round_id=7)
    np.testing.assert_array_equal(again.vectors, answer.vectors)
    other = worker.execute(LocalStepsTask(z0, steps, gamma), round_id=8)
    assert not np.array_equal(other.vectors, answer.vectors)
    # an exact GRADIENT task takes every row; a stochastic one, the round's first minibatch
    exact = worker.execute(GradientTask(z0, exact=True), round_id=7)
    np.testing.assert_allclose(exact.vectors[0], hand_gradient(datas[0].X, datas[0].y, z0), rtol=1e-12)
    drawn = worker.execute(GradientTask(z0), round_id=7)
    rows = minibatch_rows(11, 4, 7, 0, 7, 3)
    np.testing.assert_allclose(drawn.vectors[0], hand_gradient(datas[0].X[rows], datas[0].y[rows], z0), rtol=1e-12)
    # without batch_size every step takes every row
    full = Worker(TorchShards(Tiny(TinySpec()), datas, [4, 9]), seed=11).execute(
        LocalStepsTask(z0, 1, gamma), round_id=7
    )
    np.testing.assert_allclose(full.vectors[1], hand_gradient(datas[1].X, datas[1].y, z0), rtol=1e-12)


class Boxed(Tiny):
    """Tiny with its max player held in the box v >= -0.01 (steps of 0.5 reach the bound)."""

    def domains(self) -> Any:
        from fedsaddle.common.problems.domains import Box, Free

        return [Free(4), Box(2, -0.01)]


def by_hand(spec: TinySpec, z0: np.ndarray, data: ClientData) -> tuple[Any, Any, np.ndarray, Any, Any]:
    """Boxed's players built by hand with z0 in them (x, v), z0 as they hold it, and the client's rows."""
    x, y = Boxed(spec).build("cpu", 0)
    (v,) = y.value
    unflatten(z0, [*x.parameters, v])
    inputs, targets = torch.tensor(data.X, dtype=torch.float32), torch.tensor(data.y, dtype=torch.float32)
    return x, v, flatten(x.parameters, [v]), inputs, targets


@pytest.mark.parametrize("decay", ["constant", "inverse_sqrt"])
def test_local_iterate_players_steps_the_parameters_in_place_as_a_plain_loop_does(decay: Any) -> None:
    # The loop a PyTorch user writes, replayed by hand: z rounded into float32 parameters, each step's
    # minibatch, sub_/add_ with alpha = gamma * weight, the box clamped; the answer (z_0 - z_L) / gamma.
    from fedsaddle.common.tasks import step_weight

    spec = TinySpec(dtype="float32", batch_size=3, local_iterate="players")
    datas = [client_data(7, 0), client_data(5, 1)]
    worker = Worker(TorchShards(Boxed(spec), datas, [4, 9]), seed=11)
    z0 = np.random.default_rng(3).standard_normal(6)
    steps, gamma, offset = 5, 0.5, 3
    answer = worker.execute(LocalStepsTask(z0, steps, gamma, step_offset=offset, decay=decay), round_id=7)
    for row, (i, data) in enumerate(zip((4, 9), datas, strict=True)):
        x, v, first, inputs, targets = by_hand(spec, z0, data)
        clamped = 0
        for call in range(steps):
            rows = torch.from_numpy(minibatch_rows(11, i, 7, call, data.samples, 3))
            loss = Boxed(spec).loss(x.value, [v], Batch(inputs[rows], targets[rows]), client=None)
            grads = torch.autograd.grad(loss, [*x.parameters, v])
            rate = gamma * step_weight(decay, offset + call)
            with torch.no_grad():
                for p, g in zip(x.parameters, grads, strict=False):
                    p.sub_(g, alpha=rate)
                v.add_(grads[-1], alpha=rate)
                clamped += int((v < -0.01).sum())
                v.clamp_(min=-0.01)
        np.testing.assert_array_equal(answer.vectors[row], (first - flatten(x.parameters, [v])) / gamma)
        assert clamped  # the box did act
    # the worker's float64 iterate computes other bits, the same steps up to float32's rounding
    float64 = Worker(TorchShards(Boxed(spec.model_copy(update={"local_iterate": "float64"})), datas, [4, 9]), 11)
    other = float64.execute(LocalStepsTask(z0, steps, gamma, step_offset=offset, decay=decay), round_id=7)
    assert not np.array_equal(other.vectors, answer.vectors)
    np.testing.assert_allclose(other.vectors, answer.vectors, rtol=1e-4, atol=1e-5)


def test_local_iterate_players_takes_scaffold_s_s_correction_as_a_plain_loop_does() -> None:
    # SCAFFOLD-S's step by hand in float32 parameters, as a plain loop keeping a control variate takes it: the
    # direction G_i(z) - G_i(z~) + c, with c in float32 and G_i(z~) on all of the client's rows at the start.
    spec = TinySpec(dtype="float32", batch_size=3, local_iterate="players")
    datas = [client_data(7, 0), client_data(5, 1)]
    worker = Worker(TorchShards(Boxed(spec), datas, [4, 9]), seed=11)
    rng = np.random.default_rng(4)
    z0, control = rng.standard_normal(6), rng.standard_normal(6)
    steps, gamma = 4, 0.3
    answer = worker.execute(LocalStepsTask(z0, steps, gamma, control=control), round_id=2)
    c = torch.tensor(control, dtype=torch.float32)
    for row, (i, data) in enumerate(zip((4, 9), datas, strict=True)):
        x, v, first, inputs, targets = by_hand(spec, z0, data)
        full = torch.autograd.grad(
            Boxed(spec).loss(x.value, [v], Batch(inputs, targets), client=None), [*x.parameters, v]
        )
        shift = [c[:3].view(1, 3) - full[0], c[3:4] - full[1], c[4:] + full[2]]  # c - G_i(z~), G_y = -grad_y f
        for call in range(steps):
            rows = torch.from_numpy(minibatch_rows(11, i, 2, call, data.samples, 3))
            loss = Boxed(spec).loss(x.value, [v], Batch(inputs[rows], targets[rows]), client=None)
            grads = torch.autograd.grad(loss, [*x.parameters, v])
            with torch.no_grad():
                x.parameters[0].sub_(grads[0] + shift[0], alpha=gamma)
                x.parameters[1].sub_(grads[1] + shift[1], alpha=gamma)
                v.add_(grads[2] - shift[2], alpha=gamma)
                v.clamp_(min=-0.01)
        np.testing.assert_array_equal(answer.vectors[row], (first - flatten(x.parameters, [v])) / gamma)
    # the float64 iterate: the same steps up to float32's rounding
    float64 = Worker(TorchShards(Boxed(spec.model_copy(update={"local_iterate": "float64"})), datas, [4, 9]), 11)
    other = float64.execute(LocalStepsTask(z0, steps, gamma, control=control), round_id=2)
    assert not np.array_equal(other.vectors, answer.vectors)
    np.testing.assert_allclose(other.vectors, answer.vectors, rtol=1e-4, atol=1e-5)
    # Catalyst's regularized steps (theta > 0) keep the float64 iterate
    regularized = LocalStepsTask(z0, steps, gamma, control=control, theta=0.5)
    np.testing.assert_array_equal(
        Worker(TorchShards(Boxed(spec), datas, [4, 9]), 11).execute(regularized, round_id=2).vectors,
        float64.execute(regularized, round_id=2).vectors,
    )


class Shared(TorchProblem):
    """A loss whose min parameter p and max parameter v enter through one sum, and u through another: autograd
    may hand back one gradient tensor for p and v, and an expanded (read-only) one for u."""

    Spec = TinySpec
    spec: TinySpec

    def players(self) -> tuple[Any, Any]:
        return [torch.zeros(3), torch.zeros(2), torch.zeros(2)], [torch.zeros(2)]

    def loss(self, x: Any, y: Any, batch: Batch, *, client: Any) -> Any:
        w, p, u = x
        (v,) = y
        scale = torch.tensor([1.0, 2.0], dtype=p.dtype)
        r = batch.inputs @ w - batch.targets
        return 0.5 * torch.mean(r**2) + ((p + v) * scale).sum() + 0.1 * u.sum()


def test_corrected_players_steps_do_not_write_into_autograd_s_gradients() -> None:
    datas = [client_data(7, 0), client_data(5, 1)]
    rng = np.random.default_rng(0)
    z0, control = rng.standard_normal(9), rng.standard_normal(9)
    answers = []
    for iterate in ("float64", "players"):  # in float64 the two iterates agree to rounding
        worker = Worker(TorchShards(Shared(TinySpec(local_iterate=iterate)), datas, [0, 1]), seed=1)
        answers.append(worker.execute(LocalStepsTask(z0, 3, 0.1, control=control), round_id=1).vectors)
    np.testing.assert_allclose(answers[1], answers[0], rtol=1e-12, atol=1e-12)


class Declared(Tiny):
    def dims(self) -> tuple[int, int]:
        return 5, 2


class NotScalar(Tiny):
    def loss(self, x: Any, y: Any, batch: Batch, *, client: Any) -> Any:
        return x(batch.inputs).squeeze(1) - batch.targets


class NanLoss(Tiny):
    def loss(self, x: Any, y: Any, batch: Batch, *, client: Any) -> Any:
        return torch.log(-torch.ones(()) + 0 * x.bias.sum())


class WithBuffers(Tiny):
    def players(self) -> tuple[Any, Any]:
        return torch.nn.Sequential(torch.nn.Linear(3, 1), torch.nn.BatchNorm1d(1)), [torch.zeros(2)]


@pytest.mark.parametrize(
    ("problem", "message"),
    [
        (Declared(TinySpec()), r"players have 4 \+ 2 parameters \(x, y\), but dims\(\) declares 5 \+ 2"),
        (NotScalar(TinySpec()), r"loss\(\) on client 0's data returned shape \(7,\); f_i is a scalar"),
        (NanLoss(TinySpec()), r"loss\(\) on client 0's data is nan at the players' initialization"),
        (
            Tiny(TinySpec(batch_size=6)),
            r"batch_size is 6, larger than client 1's 5 training rows; set problem\.batch_size",
        ),
        (WithBuffers(TinySpec()), r"the min player \(x\) has buffers \['1.running_mean'"),
    ],
    ids=["dims", "not-scalar", "nan", "batch-size", "buffers"],
)
def test_a_problem_that_cannot_serve_is_named_before_the_first_round(problem: TorchProblem, message: str) -> None:
    with pytest.raises(ProblemError, match=message):
        TorchShards(problem, [client_data(7, 0), client_data(5, 1)], [0, 1])


def test_init_problem_is_refused_for_a_problem_without_a_starting_point() -> None:
    config = {"problem": {"name": "quadratic_game", "num_clients": 2, "dim": 4}, "init": "problem"}
    with pytest.raises(ConfigError, match=r"init.*quadratic_game has no starting point of its own"):
        parse_config({**config, "algorithms": [{"name": "minibatch_md", "gamma": 0.1}]})


def test_a_device_this_machine_lacks_is_refused_naming_it(tmp_path: Path) -> None:
    path = write_config(tmp_path / "run.yaml", **small_config())
    done = fedsaddle("simulate", "--config", str(path), "--device", "gpu0")
    assert done.returncode == 2 and "--device: device 'gpu0': expected cpu, cuda or cuda:K" in done.stderr
    if not torch.cuda.is_available():
        done = fedsaddle("simulate", "--config", str(path), "--device", "cuda:3")
        assert done.returncode == 2, done.stderr
        assert "--device: device 'cuda:3': this machine has no CUDA device that PyTorch can use" in done.stderr


# -- bit identity with real processes ----------------------------------------------------------------------


def small_config(**fields: Any) -> dict[str, Any]:
    """deep_auc shrunk to seconds: 3 clients, a narrow CNN, minibatches of 8."""
    problem = {"name": "deep_auc", "num_clients": 3, "channels": 2, "hidden": 4, "batch_size": 8, "skew_alpha": 2.0}
    return {
        "name": "deep-small",
        "problem": problem,
        "init": "problem",
        "sync": {"kind": "fixed", "tau": 3},
        "rounds": 12,
        "algorithms": [{"name": "fedavg_s", "gamma_local": 0.2, "decay": "constant"}],
        "output": {"plot": False, "checkpoint_every": 5},
        **fields,
    }


def test_the_example_gives_the_same_bits_in_simulate_and_in_local(tmp_path: Path) -> None:
    example = yaml.safe_load(EXAMPLE.read_text())
    example["rounds"] = 8  # the example's own fields otherwise, shortened
    example["evaluate_every"] = 4
    path = write_config(tmp_path / "deep-auc.yaml", **example)
    runs = {}
    for command, extra in (("simulate", []), ("local", ["--clients-per-process", "5", "--quiet-clients"])):
        done = fedsaddle(command, "--config", str(path), "--out", str(tmp_path / command), *extra, timeout=300)
        assert done.returncode == 0, done.stderr
        (run_dir,) = (tmp_path / command).iterdir()
        runs[command] = (summary_of(tmp_path / command), without_time(run_dir / "metrics.jsonl"))
    (simulate, simulate_lines), (local, local_lines) = runs["simulate"], runs["local"]
    assert [a["name"] for a in simulate["algorithms"]] == ["local_sgda_plus", "fedgda_gt"]
    for a, b in zip(simulate["algorithms"], local["algorithms"], strict=True):
        assert a["status"] == b["status"] == "ok"
        assert a["z_sha256"] == b["z_sha256"]
    assert simulate_lines == local_lines  # test_auc included, bit for bit
    aucs = [line["test_auc"] for line in simulate_lines if "test_auc" in line]
    assert aucs and all(0.0 <= auc <= 1.0 for auc in aucs)


def test_local_iterate_players_gives_the_same_bits_in_simulate_and_in_local(tmp_path: Path) -> None:
    config = small_config(name="deep-players", rounds=6)
    config["problem"] = {**config["problem"], "local_iterate": "players"}
    config["algorithms"] = [*config["algorithms"], {"name": "scaffold_s", "gamma_local": 0.2}]  # (corrected steps)
    path = write_config(tmp_path / "players.yaml", **config)
    runs = {}
    for command, extra in (("simulate", []), ("local", ["--clients-per-process", "3", "--quiet-clients"])):
        done = fedsaddle(command, "--config", str(path), "--out", str(tmp_path / command), *extra, timeout=300)
        assert done.returncode == 0, done.stderr
        runs[command] = summary_of(tmp_path / command)["algorithms"]
    for simulated_run, federated_run in zip(runs["simulate"], runs["local"], strict=True):
        assert simulated_run["status"] == federated_run["status"] == "ok"
        assert simulated_run["z_sha256"] == federated_run["z_sha256"]


# Each process that loads a PyTorch problem imports torch (seconds on a loaded machine): these runs start few.
SECURE = small_config(name="deep-secure", rounds=24, privacy={"secure_aggregation": True})


@pytest.fixture(scope="module")
def secure_simulated(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    return simulated(tmp_path_factory.mktemp("secure"), SECURE)[1]


def test_simulate_equals_a_secure_federation_of_client_processes(
    tmp_path: Path, secure_simulated: tuple[dict[str, Any], list[dict[str, Any]]]
) -> None:
    path = write_config(tmp_path / "run.yaml", **SECURE)
    done = fedsaddle("local", "--config", str(path), "--out", str(tmp_path / "runs"), "--quiet-clients", timeout=300)
    assert done.returncode == 0, done.stderr
    (run_dir,) = (tmp_path / "runs").iterdir()
    (a,), (b,) = secure_simulated[0]["algorithms"], summary_of(tmp_path / "runs")["algorithms"]
    assert summary_of(tmp_path / "runs")["transport"]["client_processes"] == 3
    assert a["z_sha256"] == b["z_sha256"] and a["status"] == b["status"] == "ok"
    assert b["traffic"]["privacy"]["rounds"] >= 1  # it did run masked
    assert without_time(run_dir / "metrics.jsonl") == secure_simulated[1]


def test_a_coordinator_of_a_pytorch_problem_never_maps_torch(
    tmp_path: Path, secure_simulated: tuple[dict[str, Any], list[dict[str, Any]]]
) -> None:
    # The coordinator only folds vectors: it reads deep_auc's spec, dimension and domain without torch, and
    # builds z0 (`init: problem`) in a child process. Its memory maps are read all along the run (importing torch
    # maps libtorch_cpu.so, libtorch_python.so, ...).
    address = free_address()
    coordinator = Coordinator(write_config(tmp_path / "run.yaml", **SECURE), tmp_path / "runs", listen=address)
    clients = [subprocess.Popen(client_command(address, "0-2", "--connect-timeout", "60"), env=CLIENT_ENV)]
    maps = Path(f"/proc/{coordinator.process.pid}/maps")
    seen, torch_mapped = 0, []
    try:
        deadline = time.monotonic() + 300
        while coordinator.process.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(OSError):  # (it may end between poll and read)
                torch_mapped += [line for line in maps.read_text().splitlines() if "libtorch" in line]
                seen += 1
            time.sleep(0.05)
        code, log = coordinator.finish(timeout=30)
    finally:
        codes = stop_processes(clients)
    assert code == 0, log
    assert codes == [0]
    assert seen > 10 and torch_mapped == []
    (a,), (b,) = secure_simulated[0]["algorithms"], summary_of(tmp_path / "runs")["algorithms"]
    assert a["z_sha256"] == b["z_sha256"] and b["status"] == "ok"  # the child's z0 is simulate's


def test_a_coordinator_killed_mid_run_resumes_to_the_same_bits(
    tmp_path: Path, secure_simulated: tuple[dict[str, Any], list[dict[str, Any]]]
) -> None:
    # SECURE checkpoints every 5 rounds; one client process hosts the three clients, and reconnects by itself.
    address = free_address()
    first = Coordinator(write_config(tmp_path / "run.yaml", **SECURE), tmp_path / "runs", listen=address)
    clients = [subprocess.Popen(client_command(address, "0-2", "--connect-timeout", "60"), env=CLIENT_ENV)]
    try:
        first.wait_for(r"fedavg_s\s+round\s+1\d/24", 120)
        first.process.send_signal(signal.SIGKILL)
        first.finish(timeout=30)
        (run_dir,) = (tmp_path / "runs").iterdir()
        resumed = resume_coordinator(run_dir, address)
        _, log = resumed.communicate(timeout=300)
    finally:
        codes = stop_processes(clients)
    assert resumed.returncode == 0, log
    assert re.search(r"resuming .* from its checkpoint: fedavg_s at step \d+", log), log
    assert codes == [0]  # never restarted
    (a,), (b,) = secure_simulated[0]["algorithms"], summary_of(tmp_path / "runs")["algorithms"]
    assert a["z_sha256"] == b["z_sha256"] and b["status"] == "ok"
    assert without_time(run_dir / "metrics.jsonl") == secure_simulated[1]


def test_new_problem_torch_writes_a_package_whose_test_passes_and_whose_config_is_valid(tmp_path: Path) -> None:
    made = fedsaddle("new", "problem", "deep_fit", "--torch", "--out", str(tmp_path / "deep_fit"))
    assert made.returncode == 0, made.stderr
    package = tmp_path / "deep_fit"
    assert "class DeepFit(TorchProblem)" in (package / "src" / "deep_fit" / "problem.py").read_text()
    tested = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
        cwd=package,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert tested.returncode == 0, tested.stdout[-3000:]
    assert "2 passed" in tested.stdout
    # its config names the class by its path, found in src/ beside it, and starts from the built network
    shown = fedsaddle("show-config", "--config", str(package / "run.yaml"))
    assert shown.returncode == 0, shown.stderr
    assert "init: problem" in shown.stdout and "batch_size: 16" in shown.stdout


def test_a_batch_of_seeds_equals_each_run_alone() -> None:
    # Sweeps (experiments, `fedsaddle experiment`) batch runs into one worker: each run still draws its own
    # minibatches from its own seed's streams.
    from fedsaddle.common.problems import make_problem
    from fedsaddle.server.batch import BatchRun, run_batch
    from fedsaddle.server.driver import run_algorithm
    from fedsaddle.server.transport.local_pool import LocalPool

    configs = [parse_config(small_config(seed=seed, rounds=9)) for seed in (0, 1)]
    # (a batch measures distances to a reference point; a network has no z*, any point does)
    members = [BatchRun(c, c.algorithms[0], reference=np.zeros(make_problem(c.problem).dimension)) for c in configs]
    batched = run_batch(members)
    alone = [run_algorithm(c.algorithms[0], c, LocalPool()) for c in configs]
    assert [r.z_sha256 for r in batched] == [r.z_sha256 for r in alone]
    assert batched[0].z_sha256 != batched[1].z_sha256


def test_deep_auc_is_the_aucm_loss_on_imbalanced_label_skewed_digits() -> None:
    from fedsaddle.common.problems.auc import roc_auc
    from fedsaddle.common.problems.deep_auc import DeepAuc, DeepAucSpec, split_digits

    spec = DeepAucSpec(num_clients=10, channels=2, hidden=4, dtype="float64", lam=1e-3)
    problem = DeepAuc(spec)
    datas = split_digits(spec)
    train = np.concatenate([d.y for d in datas])
    test = np.concatenate([d.y_test for d in datas if d.y_test is not None])
    assert len(train) + len(test) == 1797 and round(0.3 * 1797) == len(test)
    assert 0.08 < train.mean() < 0.12 and problem.positive_rate == train.mean()  # digit 9: about 10% positives
    shares = [d.y.mean() for d in datas]
    assert max(shares) - min(shares) > 0.1  # label skew
    z = problem.initial_point(3)
    z[:2], z[-1] = [0.2, 0.6], 0.7  # a, b (a module's own parameters come before its submodules'), alpha
    model, _ = problem.unflatten(z)
    data = datas[0]
    with torch.no_grad():
        logits = model.net(torch.tensor(data.X).reshape(-1, 1, 8, 8)).numpy()
    weights = np.concatenate([p.detach().numpy().ravel() for p in model.net.parameters()])
    s, pos, p = 1 / (1 + np.exp(-logits)), data.y, problem.positive_rate
    a, b, alpha = 0.2, 0.6, 0.7
    aucm = (
        (1 - p) * np.mean((s - a) ** 2 * pos)
        + p * np.mean((s - b) ** 2 * (1 - pos))
        + 2 * alpha * (p * (1 - p) * 1.0 + np.mean(p * s * (1 - pos) - (1 - p) * s * pos))
        - p * (1 - p) * alpha**2
    )
    penalty = 1e-3 / 2 * weights @ weights
    assert problem.objective(data, z) == pytest.approx(aucm + penalty, rel=1e-12)
    ce = DeepAuc(spec.model_copy(update={"loss_kind": "cross_entropy"}))
    bce = np.mean(np.logaddexp(0, -logits) * pos + np.logaddexp(0, logits) * (1 - pos))
    assert ce.objective(data, z) == pytest.approx(bce + penalty, rel=1e-12)
    # the pooled test AUC is the AUC of the network's scores on every client's held-out images
    X = np.concatenate([d.X_test for d in datas if d.X_test is not None])
    with torch.no_grad():
        pooled = model.net(torch.tensor(X).reshape(-1, 1, 8, 8)).numpy()
    assert problem.pooled_test_auc(z) == roc_auc(pooled, test > 0)


def test_a_pytorch_problem_whose_metrics_on_is_not_held_out_is_refused_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from fedsaddle.common.problems.deep_auc import DeepAuc

    parse_config(small_config(evaluate_every=4))
    monkeypatch.setattr(DeepAuc, "metrics_on", "training")
    with pytest.raises(ConfigError) as refused:
        parse_config(small_config(evaluate_every=4))
    assert (
        "problem deep_auc is written in PyTorch, whose test_metrics are computed on each client's held-out rows; "
        "its metrics_on must be 'held-out', not 'training'"
    ) in str(refused.value)
