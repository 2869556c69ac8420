"""The deep AUC experiment: deep_auc's validation images and cross-entropy variant, and the experiment's
plumbing on a shrunk setup (seconds). Skipped without PyTorch (the torch extra)."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the deep AUC experiment needs PyTorch: pip install 'fedsaddle[torch]'")

from fedsaddle import api  # noqa: E402
from fedsaddle.common.problems.base import ClientData, client_context  # noqa: E402
from fedsaddle.common.problems.deep_auc import DIGITS_ROWS, DeepAuc, DeepAucSpec, split_digits, validation_rows  # noqa: E402
from fedsaddle.experiments import deep_auc  # noqa: E402

SMALL = {"channels": 2, "hidden": 4}  # the CNN shrunk to seconds
FEDSADDLE = (sys.executable, "-m", "fedsaddle")
BASELINE = (sys.executable, "-m", "fedsaddle.experiments.libauc_baseline")


def test_validation_images_are_set_aside_and_leave_the_test_rows_as_they_were() -> None:
    plain = DeepAucSpec(split_seed=3)
    held = DeepAucSpec(split_seed=3, validation_fraction=0.25)
    assert len(validation_rows(plain)) == 0
    rows = validation_rows(held)
    train_plain = sum(d.samples for d in split_digits(plain))
    assert len(rows) == round(0.25 * train_plain)
    assert sum(d.samples for d in split_digits(held)) == train_plain - len(rows)

    def pooled_test(spec: DeepAucSpec) -> list[tuple[float, ...]]:
        return sorted(tuple(row) for d in split_digits(spec) if d.X_test is not None for row in d.X_test)

    assert pooled_test(plain) == pooled_test(held)  # the test images do not change (their dealing may)
    # No client trains on a validation image: every image is in exactly one of training, validation, test.
    test_rows = round(DeepAucSpec().test_fraction * DIGITS_ROWS)
    assert sum(d.samples for d in split_digits(held)) + len(rows) + test_rows == DIGITS_ROWS


@pytest.mark.parametrize("share", [0.05, 0.02])
def test_thinning_drops_only_positive_training_images_down_to_the_share(share: float) -> None:
    base = {"split_seed": 4, "test_fraction": 0.5, "validation_fraction": 0.25}
    whole, thinned = split_digits(DeepAucSpec(**base)), split_digits(DeepAucSpec(**base, train_positive_share=share))

    def rows(datas: list[ClientData], positive: bool) -> set[tuple[float, ...]]:
        return {tuple(x) for d in datas for x, t in zip(d.X, d.y, strict=True) if (t > 0) == positive}

    assert rows(thinned, False) == rows(whole, False)  # every negative kept
    assert rows(thinned, True) < rows(whole, True)  # positives dropped, none added
    kept, negatives = len(rows(thinned, True)), len(rows(whole, False))
    assert kept == round(share * negatives / (1 - share))
    assert abs(kept / (kept + negatives) - share) < 1 / negatives
    assert DeepAuc(DeepAucSpec(**base, train_positive_share=share)).positive_rate == kept / (kept + negatives)

    def pooled_test(datas: list[ClientData]) -> list[tuple[float, ...]]:
        return sorted(tuple(x) for d in datas if d.X_test is not None for x in d.X_test)

    assert pooled_test(thinned) == pooled_test(whole)  # validation and test images keep the digits' share
    assert len(validation_rows(DeepAucSpec(**base, train_positive_share=share))) == len(
        validation_rows(DeepAucSpec(**base))
    )


def test_the_experiment_passes_the_share_to_every_run_and_the_baseline() -> None:
    spec = deep_auc.problem_spec(3, "cross_entropy", 0.05)
    assert spec["train_positive_share"] == 0.05 and spec["split_seed"] == 3
    assert "train_positive_share" not in deep_auc.problem_spec(3)  # the default split, as it always was
    method = deep_auc.METHODS[0]
    thinned = deep_auc.Setting(2, share=0.05)
    assert deep_auc.config(method, 1.0, 3, thinned)["problem"] == deep_auc.problem_spec(3, method.loss, 0.05)
    assert deep_auc.config(method, 1.0, 3, deep_auc.Setting(2))["sync"] == {"kind": "fixed", "tau": deep_auc.TAU}
    assert deep_auc.config(method, 1.0, 3, deep_auc.Setting(2, 7))["sync"] == {"kind": "fixed", "tau": 7}
    assert deep_auc.Setting(2, 7).steps == deep_auc.CLIENTS * 2 * 7  # the LibAUC baseline's steps
    done = subprocess.run(
        [*FEDSADDLE, "experiment", "deep-auc", "--positive-share", "1", "--out", "unused"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "--positive-share: must be below 1, got '1'" in done.stderr


def test_pooled_validation_auc_needs_validation_images() -> None:
    problem = DeepAuc(DeepAucSpec(**SMALL))
    with pytest.raises(ValueError, match="validation_fraction is 0"):
        problem.pooled_validation_auc(problem.initial_point(0))
    held = DeepAuc(DeepAucSpec(**SMALL, validation_fraction=0.2))
    assert 0.0 <= held.pooled_validation_auc(held.initial_point(0)) <= 1.0


def test_cross_entropy_is_the_logistic_loss_and_leaves_the_auc_variables_alone() -> None:
    spec = DeepAucSpec(**SMALL, num_clients=2, loss_kind="cross_entropy", lam=0.0)
    problem = DeepAuc(spec)
    data = split_digits(spec)[0]
    z = problem.initial_point(1)
    z[-1] = 0.7  # alpha: takes no part in cross-entropy
    client = client_context(0, 2, data.samples)
    g = problem.gradient(data, z, client=client)
    assert np.all(g[[0, 1, -1]] == 0.0)  # a and b (the min player's first parameters), alpha (the max player)
    assert np.any(g[2:-1] != 0.0)  # the network
    model, _ = problem.unflatten(z)
    with torch.no_grad():
        logits = model.net(torch.as_tensor(data.X, dtype=torch.float32).reshape(-1, 1, 8, 8)).double().numpy()
    t = data.y
    by_hand = float(np.mean(np.logaddexp(0.0, logits) - t * logits))
    assert problem.objective(data, z, client=client) == pytest.approx(by_hand, rel=1e-5)


def test_the_experiment_tunes_on_validation_and_writes_its_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(deep_auc, "PROBLEM", {**deep_auc.PROBLEM, **SMALL})
    two = (
        deep_auc.Method("fedavg_s", "FedAvg-S", "fedavg_s", ("gamma_local",), (0.5, 1e-6), {"decay": "constant"}),
        deep_auc.Method(
            "fedavg_ce",
            "FedAvg-S, cross-entropy",
            "fedavg_s",
            ("gamma_local",),
            (0.5,),
            {"decay": "constant"},
            "cross_entropy",
        ),
    )
    monkeypatch.setattr(deep_auc, "METHODS", two)
    monkeypatch.setattr(deep_auc, "TUNING_SEEDS", 1)  # tune on seed 0, then seed 1 at the chosen step
    done: list[int] = []
    points = deep_auc.run_deep_auc(
        api.run, tmp_path, "test", range(2), 2, None, lambda n, total: done.append(total), tau=3
    )
    # fedavg_s: 2 steps on the tuning seed, then the chosen step on seed 1; fedavg_ce: 1 + 1
    assert len(points) == 5 and done[-1] == 5
    tuned = {p.step: p.validation_auc for p in points if p.method == "fedavg_s" and p.seed == 0}
    chosen = max(tuned, key=lambda step: tuned[step])
    assert [p.step for p in points if p.method == "fedavg_s" and p.seed == 1] == [chosen]
    assert all(0.0 <= p.test_auc <= 1.0 for p in points)
    with (tmp_path / "runs.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["method"] for r in rows] == [p.method for p in points]
    report = (tmp_path / "deep_auc.md").read_text()
    assert "FedAvg-S, cross-entropy" in report and "LibAUC not run this time" in report
    assert "2 rounds of tau = 3 local steps" in report
    assert (tmp_path / "figure_deep_auc.png").stat().st_size > 0
    # The same point again: the same bits.
    again = deep_auc.run_point(api.run, two[1], 0.5, 1, deep_auc.Setting(2, 3), tmp_path / "again")
    (first,) = [p for p in points if p.method == "fedavg_ce" and p.seed == 1]
    assert again.z_sha256 == first.z_sha256 and again.test_auc == first.test_auc


def test_the_libauc_baseline_says_what_it_needs_when_libauc_is_absent(tmp_path: Path) -> None:
    try:
        import libauc  # noqa: F401

        pytest.skip("libauc is installed here")
    except ImportError:
        pass
    out = tmp_path / "x.json"
    done = subprocess.run(
        [
            *BASELINE,
            "--seeds",
            "0",
            "--tuning",
            "0",
            "--steps",
            "1",
            "--lrs",
            "0.1",
            "--positive-share",
            "0.05",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1  # (argparse's refusal of a flag would be 2)
    assert "the LibAUC baseline needs libauc" in done.stderr and "--libauc-python" in done.stderr
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize(
    ("flag", "value", "why"),
    [
        ("--positive-share", "1.5", "--positive-share: must be between 0 and 1, got 1.5"),
        ("--steps", "0", "--steps: must be at least 1, got 0"),
        ("--lrs", "0.1,-1", "--lrs: every learning rate must be positive, got [0.1, -1.0]"),
    ],
)
def test_the_libauc_baseline_refuses_bad_flags_by_name(tmp_path: Path, flag: str, value: str, why: str) -> None:
    given = {"--seeds": "0", "--tuning": "0", "--steps": "1", "--lrs": "0.1", "--out": str(tmp_path / "x.json")}
    given[flag] = value
    done = subprocess.run(
        [*BASELINE, *(part for pair in given.items() for part in pair)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and f"error: {why}" in done.stderr, done.stderr
    assert not (tmp_path / "x.json").exists()


def test_the_command_refuses_a_libauc_python_that_is_not_there(tmp_path: Path) -> None:
    done = subprocess.run(
        [*FEDSADDLE, "experiment", "deep-auc", "--libauc-python", str(tmp_path / "nope"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert f"--libauc-python {tmp_path / 'nope'}: no such file" in done.stderr
    done = subprocess.run(
        [*FEDSADDLE, "experiment", "problems", "--libauc-python", sys.executable],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "experiment problems does not take --libauc-python" in done.stderr


# -- the group-robust MLP ------------------------------------------------------------------------------------


def test_the_agnostic_weights_ascend_on_each_clients_loss_and_uniform_leaves_them_alone() -> None:
    from fedsaddle.experiments.robust_mlp import AgnosticMlp, AgnosticMlpSpec, split_classes

    spec = AgnosticMlpSpec(hidden=4, nu=0.5, lam=0.0)
    problem = AgnosticMlp(spec)
    datas = split_classes(spec)
    assert sorted({int(label) for d in datas for label in d.y}) == list(range(10))  # all ten digits, as labels
    z = problem.initial_point(2)
    weights = np.linspace(1.0, 2.0, 10)
    z[-10:] = weights / weights.sum()
    i = 3
    client = client_context(i, 10, datas[i].samples)
    g = problem.gradient(datas[i], z, client=client)
    mlp, _ = problem.unflatten(z)
    with torch.no_grad():
        logits = mlp(torch.as_tensor(datas[i].X, dtype=torch.float32)).double()
    loss = float(torch.nn.functional.cross_entropy(logits, torch.as_tensor(datas[i].y).long()))
    # f_i = n lambda_i L_i - nu/2 ||lambda - 1/n||^2, and G's lambda block is -grad_lambda f_i
    expected = 0.5 * (z[-10:] - 0.1)
    expected[i] -= 10 * loss
    assert np.allclose(g[-10:], expected, rtol=1e-5, atol=1e-6)
    uniform = AgnosticMlp(AgnosticMlpSpec(hidden=4, uniform=True))
    assert np.all(uniform.gradient(datas[i], z, client=client)[-10:] == 0.0)
    assert uniform.client_accuracies(z).shape == (10,)


def test_each_clients_validation_images_come_out_of_its_own_training_rows() -> None:
    from fedsaddle.experiments.robust_mlp import AgnosticMlp, AgnosticMlpSpec, split_classes, validation_sets

    plain, held = AgnosticMlpSpec(split_seed=2), AgnosticMlpSpec(split_seed=2, validation_fraction=0.2)
    assert all(len(y) == 0 for _, y in validation_sets(plain))
    for whole, kept, (X_val, y_val) in zip(
        split_classes(plain), split_classes(held), validation_sets(held), strict=True
    ):
        assert len(y_val) == round(0.2 * whole.samples) and kept.samples == whole.samples - len(y_val)
        rows = {tuple(x) for x in whole.X}
        assert {tuple(x) for x in kept.X} | {tuple(x) for x in X_val} == rows  # the same images, split in two
        assert not {tuple(x) for x in kept.X} & {tuple(x) for x in X_val}
        assert np.array_equal(kept.X_test, whole.X_test)  # held-out images untouched
    small = AgnosticMlp(AgnosticMlpSpec(hidden=4))
    with pytest.raises(ValueError, match="validation_fraction is 0"):
        small.client_accuracies(small.initial_point(0), "validation")


def test_the_robust_mlp_experiment_chooses_steps_on_validation_and_reports_every_client(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fedsaddle.experiments import robust_mlp

    tiny = {
        "uniform": ({"uniform": True, "hidden": 4}, "fedavg_s", {"gamma_local": (0.3, 1e-6)}, {"decay": "constant"}),
        "agnostic": ({"uniform": False, "hidden": 4}, "local_sgda_plus", {"eta_x": (0.3,), "eta_y": (1e-4, 1e-3)}, {}),
    }
    monkeypatch.setattr(robust_mlp, "RUNS", tiny)
    monkeypatch.setattr(robust_mlp, "TUNING_SEEDS", 1)
    assert robust_mlp.grid("agnostic") == [(("eta_x", 0.3), ("eta_y", 1e-4)), (("eta_x", 0.3), ("eta_y", 1e-3))]
    totals: list[int] = []
    outcomes = robust_mlp.run_robust_mlp(api.run, tmp_path, "test", range(2), 3, lambda n, total: totals.append(total))
    assert len(outcomes) == 2 + 2 + 1 + 1 and totals[-1] == 6  # two grid points each on seed 0, then seed 1
    for kind in tiny:
        tuned = {o.steps: robust_mlp.worst(o.validation) for o in outcomes if o.kind == kind and o.seed == 0}
        (later,) = [o for o in outcomes if o.kind == kind and o.seed == 1]
        assert tuned[later.steps] == max(tuned.values())  # seed 1 ran at the point seed 0's validation chose
        assert later.accuracies.shape == (10,) and np.all((later.accuracies >= 0) & (later.accuracies <= 1))
    (uniform,) = [o for o in outcomes if o.kind == "uniform" and o.seed == 1]
    assert np.allclose(uniform.weights, 0.1, rtol=0, atol=1e-7)  # lambda stays at 1/n (up to float32 rounding)
    report = (tmp_path / "robust_mlp.md").read_text()
    assert "Every client's held-out accuracy at the chosen steps" in report and "per grid point" in report
    with (tmp_path / "runs.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 6 and {r["training"] for r in rows} == {"uniform", "agnostic"}
    assert [float(rows[0][f"client_{i}"]) for i in range(10)] == pytest.approx(list(outcomes[0].accuracies), abs=1e-6)


def test_runs_spread_over_processes_come_back_in_the_order_given() -> None:
    import operator
    import os

    from fedsaddle.experiments.processes import each

    work = [(k, 10 - k) for k in range(6)]
    done: list[int] = []
    assert each(operator.mul, work, 2, done.append) == [k * (10 - k) for k in range(6)]
    assert sorted(done) == [1, 2, 3, 4, 5, 6]
    assert each(os.getpid, [()] * 2, 1, lambda n: None) == [os.getpid()] * 2  # jobs 1: in this process
    assert os.getpid() not in each(os.getpid, [()] * 2, 2, lambda n: None)  # else in processes of their own
