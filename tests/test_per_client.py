"""output.per_client: each client's evaluation metrics and training objective, worst, best and spread."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from conftest import fedsaddle, strict_json

from fedsaddle import api
from fedsaddle.common.problems import DataProblem, make_problem
from fedsaddle.experiments.datasets import binned, by_dataset_column, load_dataset, split
from fedsaddle.server.config import ConfigError, parse_config
from fedsaddle.server.per_client import spread

CONFIG: dict[str, Any] = {
    "name": "ages",
    "problem": {"name": "linear_regression", "num_clients": 4, "features": 9},
    "rounds": 60,
    "evaluate_every": 10,
    "algorithms": [{"name": "mirror_prox", "gamma": 0.1}],
    "output": {"per_client": True},
}


@pytest.fixture(scope="module")
def ages(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The diabetes data over four age groups (the sites of a by-column split in bins)."""
    folder = tmp_path_factory.mktemp("ages")
    table = binned(by_dataset_column(load_dataset("diabetes"), "age"), "age", [40, 50, 60])
    split(table, None, "by-column", 0, folder)
    return folder


def test_each_clients_metric_and_objective_are_its_own_and_the_worst_is_named(ages: Path, tmp_path: Path) -> None:
    report = api.run(CONFIG, data=str(ages / "client-{i:03d}.npz"), out=tmp_path)
    result = report.results[0]
    entry = strict_json((report.run_dir / "summary.json").read_text())["algorithms"][0]
    clients = entry["per_client"]
    problem = make_problem(api.load(CONFIG).problem)
    assert isinstance(problem, DataProblem)
    datas = [problem.load(ages / f"client-{i:03d}.npz") for i in range(4)]
    z = result.final_z
    mse = [float(problem.metrics(d, z)[0]) for d in datas]
    objective = [float(problem.objective(d, z)) for d in datas]
    np.testing.assert_allclose(clients["test_mse"]["values"], mse, rtol=1e-12)
    np.testing.assert_allclose(clients["objective"]["values"], objective, rtol=1e-12)
    worst = int(np.argmax(mse))
    assert clients["test_mse"]["worst_client"] == worst and clients["test_mse"]["worst"] == max(
        clients["test_mse"]["values"]
    )
    assert clients["test_mse"]["spread"] == pytest.approx(max(mse) - min(mse), rel=1e-12)
    # The averaged metric is the clients' values weighted by their held-out rows.
    heldout = np.array([d.heldout for d in datas], dtype=float)
    assert entry["metrics"]["test_mse"] == pytest.approx(float(heldout @ mse / heldout.sum()), rel=1e-12)
    # Every evaluated step carries them (in metrics.jsonl too), and the figure has the objective's panel.
    lines = [strict_json(line) for line in (report.run_dir / "metrics.jsonl").read_text().splitlines()]
    evaluated = [line for line in lines if "test_mse" in line]
    assert len(evaluated) == 4 and all(line["clients"]["objective"]["worst"] is not None for line in evaluated)
    assert (report.run_dir / "metrics.png").read_bytes()[:4] == b"\x89PNG"
    # The per-client round is evaluation traffic: the algorithm's counts are those of a run without it.
    plain = api.run({**CONFIG, "output": {"plot": False}}, data=str(ages / "client-{i:03d}.npz"), out=tmp_path).results[
        0
    ]
    assert result.traffic["algorithm"] == plain.traffic["algorithm"] and result.z_sha256 == plain.z_sha256
    assert result.traffic["evaluation"]["rounds"] == 2 * plain.traffic["evaluation"]["rounds"]


def test_a_federation_reports_the_same_per_client_results_as_simulate(ages: Path, tmp_path: Path) -> None:
    path = tmp_path / "ages.yaml"
    path.write_text(yaml.safe_dump(CONFIG))
    data = str(ages / "client-{i:03d}.npz")
    simulated = api.run({**CONFIG, "output": {"per_client": True, "plot": False}}, data=data, out=tmp_path)
    done = fedsaddle(
        "local", "--config", str(path), "--data", data, "--out", str(tmp_path / "local"), "--quiet-clients"
    )
    assert done.returncode == 0, done.stderr
    run_dir = Path(done.stdout.strip().splitlines()[-1].removeprefix("run directory: "))
    federated = strict_json((run_dir / "summary.json").read_text())["algorithms"][0]
    assert "mirror_prox per client: objective worst" in done.stdout  # after the table
    assert "worst test_mse" in done.stderr  # the progress lines
    assert (
        federated["per_client"]
        == strict_json((simulated.run_dir / "summary.json").read_text())["algorithms"][0]["per_client"]
    )


def test_per_client_results_are_refused_with_secure_aggregation_saying_why() -> None:
    secure = {**CONFIG, "privacy": {"secure_aggregation": True}}
    with pytest.raises(ConfigError) as refused:
        parse_config(secure)
    assert "output.per_client: secure aggregation lets the coordinator hold only sums over the clients" in str(
        refused.value
    )
    assert "the metrics averaged over the clients (evaluate_every) and output.gradient_norm" in str(refused.value)
    with pytest.raises(ConfigError, match=r"output\.per_client: each client's results are gathered at the evaluated"):
        parse_config({**CONFIG, "evaluate_every": 0})
    parse_config({**secure, "output": {"per_client": False}})  # what composes with it


def test_the_worst_client_is_by_the_metrics_direction() -> None:
    loss = spread([0.5, None, 2.0, 1.0], higher_is_better=False)
    assert (loss["worst"], loss["worst_client"], loss["best"], loss["best_client"], loss["spread"]) == (
        2.0,
        2,
        0.5,
        0,
        1.5,
    )
    auc = spread([0.9, 0.6, None, 0.6], higher_is_better=True)
    assert (auc["worst"], auc["worst_client"], auc["best_client"]) == (0.6, 1, 0)
    assert spread([None, None], False)["worst"] is None


TRAINING_METRIC = """
from typing import Literal
import numpy as np
from fedsaddle.common.problems import DataProblem, ProblemSpec

class CentreSpec(ProblemSpec):
    name: Literal["centre"] = "centre"

class Centre(DataProblem):
    '''f_i(x, y) = 1/2 ||x - mean of the client's rows||^2 - 1/2 ||y||^2; its metric, on the training rows.'''
    Spec = CentreSpec
    metric_names = ("train_spread",)
    metrics_on = "training"
    def dims(self):
        return 2, 1
    def gradient(self, data, z):
        return np.concatenate([z[:2] - data.X.mean(axis=0), z[2:]])
    def objective(self, data, z):
        return 0.5 * float((z[:2] - data.X.mean(axis=0)) @ (z[:2] - data.X.mean(axis=0)) - z[2:] @ z[2:])
    def metrics(self, data, z):
        return (float(np.mean(np.sum((data.X - z[:2]) ** 2, axis=1))),)
"""


def centre_in_simulate_and_local(
    tmp_path: Path, source: str, rows: tuple[int, ...], held: tuple[int, ...], evaluate_every: int
) -> list[dict[str, Any]]:
    """The plug-in problem `source` (class Centre) on 3 clients with `rows` training and `held` held-out rows,
    20 rounds of Minibatch MD with per-client results, run by `simulate` and by `local`: their summaries'
    algorithm entries."""
    import os

    from conftest import CLIENT_ENV

    (tmp_path / "centre_problem.py").write_text(source)
    rng = np.random.default_rng(3)
    for i, (m, h) in enumerate(zip(rows, held, strict=True)):
        np.savez(tmp_path / f"c{i}.npz", X=rng.normal(i, 1.0, (m, 2)), y=np.zeros(m),
                 X_test=rng.normal(-i, 2.0, (h, 2)), y_test=np.zeros(h))  # fmt: skip
    config = {
        "name": "centre",
        "problem": {"name": "centre", "plugin": "centre_problem:Centre", "num_clients": 3},
        "rounds": 20,
        "evaluate_every": evaluate_every,
        "algorithms": [{"name": "minibatch_md", "gamma": 0.3}],
        "output": {"per_client": True, "plot": False},
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), CLIENT_ENV.get("PYTHONPATH", "")])}
    entries = []
    for command in ("simulate", "local"):
        done = fedsaddle(command, "--config", str(tmp_path / "run.yaml"), "--data", str(tmp_path / "c{i}.npz"),
                         "--out", str(tmp_path / command), env=env)  # fmt: skip
        assert done.returncode == 0, done.stderr
        run_dir = Path(done.stdout.strip().splitlines()[-1].removeprefix("run directory: "))
        entries.append(strict_json((run_dir / "summary.json").read_text())["algorithms"][0])
    assert entries[0]["metrics"] == entries[1]["metrics"] and entries[0]["per_client"] == entries[1]["per_client"]
    return entries


def test_a_metric_on_the_training_rows_is_weighted_by_them_in_process_and_over_grpc(tmp_path: Path) -> None:
    rows = (3, 5, 9)  # training rows; client 0 holds out none, so a held-out metric would leave it out
    entries = centre_in_simulate_and_local(tmp_path, TRAINING_METRIC, rows, (0, 2, 2), evaluate_every=5)
    values = entries[0]["per_client"]["train_spread"]["values"]
    assert None not in values  # client 0, with no held-out rows, has its training value
    expected = float(np.dot(rows, values) / sum(rows))
    assert entries[0]["metrics"]["train_spread"] == pytest.approx(expected, rel=1e-12)
    assert entries[0]["metrics"]["train_spread"] != pytest.approx(float(np.mean(values)), rel=1e-6)


MIXED_METRICS = TRAINING_METRIC.replace(
    'metric_names = ("train_spread",)\n    metrics_on = "training"',
    'metric_names = ("train_spread", "test_spread")\n    metrics_on = ("training", "held-out")',
).replace(
    "return (float(np.mean(np.sum((data.X - z[:2]) ** 2, axis=1))),)",
    "spread = lambda X: float(np.mean(np.sum((X - z[:2]) ** 2, axis=1))) if len(X) else float('nan')\n"
    "        return (spread(data.X), spread(data.X_test))",
)


def test_metrics_on_different_rows_are_each_weighted_by_their_own_in_process_and_over_grpc(tmp_path: Path) -> None:
    train, held = (3, 5, 9), (0, 4, 2)  # client 0 holds out none: it has a training value, no held-out one
    simulated, federated = centre_in_simulate_and_local(tmp_path, MIXED_METRICS, train, held, evaluate_every=10)
    for kind in ("algorithm", "evaluation"):
        counted = ("rounds", "messages_up", "floats_up")
        assert [simulated["traffic"][kind][k] for k in counted] == [federated["traffic"][kind][k] for k in counted]
    clients = simulated["per_client"]
    trained, tested = clients["train_spread"]["values"], clients["test_spread"]["values"]
    assert None not in trained and tested[0] is None and None not in tested[1:]
    assert simulated["metrics"]["train_spread"] == pytest.approx(float(np.dot(train, trained) / sum(train)), rel=1e-12)
    expected = float(np.dot(held[1:], tested[1:]) / sum(held[1:]))
    assert simulated["metrics"]["test_spread"] == pytest.approx(expected, rel=1e-12)
    # Each client answers 2 metrics and 2 row counts: 4 floats up per client and evaluation round.
    evaluation = simulated["traffic"]["evaluation"]
    rounds = evaluation["rounds"] // 2  # (with per_client, each evaluated step also asks for f_i(z))
    assert evaluation["floats_up"] == rounds * 3 * 4 + rounds * 3 * (3 + 1)


def test_metrics_on_different_rows_are_refused_under_secure_aggregation_and_a_bad_declaration_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "mixed_problem.py").write_text(MIXED_METRICS)
    (tmp_path / "wrong_problem.py").write_text(MIXED_METRICS.replace('("training", "held-out")', '("training",)'))
    monkeypatch.syspath_prepend(str(tmp_path))
    config = {
        "name": "mixed",
        "problem": {"name": "centre", "plugin": "mixed_problem:Centre", "num_clients": 3},
        "rounds": 20,
        "evaluate_every": 10,
        "algorithms": [{"name": "minibatch_md", "gamma": 0.3}],
    }
    parse_config(config)  # without secure aggregation: accepted
    with pytest.raises(ConfigError) as refused:
        parse_config({**config, "privacy": {"secure_aggregation": True}})
    assert (
        "privacy.secure_aggregation: problem centre's metrics are on different rows "
        "(train_spread: training, test_spread: held-out)"
    ) in str(refused.value)
    wrong = {**config, "problem": {**config["problem"], "plugin": "wrong_problem:Centre"}}
    with pytest.raises(ConfigError) as named:
        parse_config(wrong)
    assert (
        "problem 'centre' declares metrics_on = ('training',); it must be 'held-out' or 'training', or a tuple of "
        "those with one entry per metric name ['train_spread', 'test_spread']"
    ) in str(named.value)


def test_an_answer_with_row_counts_per_metric_is_read_as_such_and_a_wrong_number_is_refused() -> None:
    from fedsaddle.common import wire
    from fedsaddle.proto import fedsaddle_pb2 as pb

    values = np.array([[1.0, 2.0], [3.0, 4.0]])
    header = pb.Answer(client_indices=[0, 1], payload_length=4, sample_counts=[5, 0, 7, 2])
    answer = wire.decode_answer(header, values.tobytes(), 2, False, want_counts=2)
    assert answer.counts is not None and answer.counts.tolist() == [[5.0, 0.0], [7.0, 2.0]]
    with pytest.raises(wire.WireError, match=r"^4 row counts for 2 clients; expected 2$"):
        wire.decode_answer(header, values.tobytes(), 2, False, want_counts=1)
    with pytest.raises(wire.WireError, match=r"^3 row counts for 2 clients x 2 metrics; expected 4$"):
        wire.decode_answer(pb.Answer(client_indices=[0, 1], sample_counts=[5, 0, 7]), values.tobytes(), 2, False, 2)
