"""Differential privacy on top: clipping, the noise each side adds, the accountant, and what runs report."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from fedsaddle import api
from fedsaddle.common import dp, seeding
from fedsaddle.common.dp import DpSettings
from fedsaddle.common.secagg import fixedpoint
from fedsaddle.common.secagg.party import Party
from fedsaddle.common.secagg.rows import mask_answer
from fedsaddle.common.secagg.settings import SecAggSettings, round_threshold
from fedsaddle.common.tasks import Answer, GradientTask
from fedsaddle.server.config import ConfigError, RunConfig, parse_config
from fedsaddle.server.driver import run_algorithm
from fedsaddle.server.secure import KeyDirectory, MaskedRound
from fedsaddle.server.transport.local_pool import LocalPool

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_clipping_bounds_the_norm_and_leaves_small_rows_alone() -> None:
    row = np.array([3.0, 4.0])
    assert dp.clip(row, 10.0) is row
    np.testing.assert_allclose(dp.clip(row, 1.0), [0.6, 0.8])
    assert np.linalg.norm(dp.clip(row * 1e6, 2.5)) == pytest.approx(2.5)


def test_the_clients_shares_of_noise_add_up_to_sigma_in_the_masked_sum() -> None:
    k, length = 5, 20_000
    settings = SecAggSettings(0, 40, 1e3)
    parties = {i: Party(i, "dp", settings) for i in range(k)}
    directory = KeyDirectory()
    for party in parties.values():
        directory.announce(party.index, party.public_key)
    for party in parties.values():
        party.agree(0, directory.keys)
    private = DpSettings(clip=2.0, noise_multiplier=1.5)  # sigma = 3
    answer = Answer(tuple(range(k)), np.zeros((k, length)))
    masked = mask_answer(parties, answer, GradientTask(np.zeros(length)), 1, 0, tuple(range(k)), None, private)
    round_ = MaskedRound("dp", 1, 0, tuple(range(k)), round_threshold(settings, k), length + 1)
    for row in masked.rows:
        round_.add(row)
    requests = round_.close()
    total = fixedpoint.decode(round_.finish({j: parties[j].unmask(r) for j, r in requests.items()}), 40)
    noise = total[:-1]
    assert total[-1] == k  # the weights carry no noise
    assert abs(noise.mean()) < 4 * 3 / np.sqrt(length)
    assert noise.std() == pytest.approx(3.0, rel=0.03)  # k shares of variance sigma^2 / k


def test_epsilon_comes_from_the_accountant_and_behaves_as_it_must() -> None:
    settings = DpSettings(1.0, 1.0)
    assert dp.epsilon(settings, 1.0, 0, 1e-5) == 0.0
    grows = [dp.epsilon(settings, 1.0, rounds, 1e-5) for rounds in (1, 10, 100)]
    assert grows == sorted(grows) and grows[0] > 0
    assert dp.epsilon(DpSettings(1.0, 4.0), 1.0, 100, 1e-5) < grows[2]  # more noise, less spent
    assert dp.epsilon(settings, 0.1, 100, 1e-5) < grows[2]  # sampling amplifies privacy
    # One Gaussian mechanism with z = 1 at delta = 1e-5: the RDP bound is a few units of epsilon.
    assert 3 < grows[0] < 6


def paper(rounds: int, privacy: dict[str, Any], **fields: Any) -> RunConfig:
    data = yaml.safe_load((EXAMPLES / "paper-s10.yaml").read_text())
    data.update(rounds=rounds, privacy=privacy, **fields)
    return parse_config(data)


def test_central_noise_is_the_coordinators_seeded_draw_on_the_clipped_sum() -> None:
    gamma, clip, multiplier = 0.01, 1e6, 0.5  # no row is clipped: the difference is the noise alone
    private = paper(1, {"dp": {"clip": clip, "noise_multiplier": multiplier}})
    plain = paper(1, {})
    md = private.algorithms[0]
    ours, theirs = run_algorithm(md, private, LocalPool()), run_algorithm(md, plain, LocalPool())
    noise = seeding.rng(private.seed, seeding.DP_NOISE, 1).normal(0.0, multiplier * clip, 20)
    np.testing.assert_allclose(ours.final_z, theirs.final_z - gamma * noise / 10, rtol=0, atol=1e-9)
    again = run_algorithm(md, private, LocalPool())
    assert again.z_sha256 == ours.z_sha256  # the coordinator's noise is reproducible


def test_a_private_run_reports_epsilon_live_and_in_its_summary() -> None:
    dp_spec = {"clip": 100.0, "noise_multiplier": 1e-6, "delta": 1e-6}
    config = paper(60, {"secure_aggregation": True, "dp": dp_spec})
    result = run_algorithm(config.algorithms[3], config, LocalPool())  # SCAFFOLD-S
    assert result.status == "ok"
    settings = DpSettings(100.0, 1e-6)
    # Every record carries what the rounds so far spent (SCAFFOLD-S's init already spends one).
    assert [r["epsilon"] for r in result.records] == [
        dp.epsilon(settings, 1.0, r["rounds"], 1e-6) for r in result.records
    ]
    privacy = result.summary()["privacy"]
    assert privacy["epsilon"] == result.records[-1]["epsilon"] == dp.epsilon(settings, 1.0, 59, 1e-6)
    assert privacy["noise_added_by"] == "clients" and privacy["delta"] == 1e-6
    assert "epsilon" not in result.metrics  # a privacy figure, not an evaluation metric


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"weighting": "samples"}, "differential privacy needs weighting: uniform"),
        ({"evaluate_every": 5}, "evaluate_every would release the clients' metrics without noise"),
    ],
)
def test_private_runs_refuse_what_would_release_data_without_noise(fields: dict[str, Any], message: str) -> None:
    data = yaml.safe_load((EXAMPLES / "paper-s10.yaml").read_text())
    data.update(privacy={"dp": {"clip": 1.0, "noise_multiplier": 1.0}}, **fields)
    data["problem"] = {"name": "linear_regression", "features": 10, "num_clients": 10}
    with pytest.raises(ConfigError, match=message):
        parse_config(data)


def test_client_processes_add_their_noise_under_secure_aggregation(tmp_path: Path) -> None:
    data = yaml.safe_load((EXAMPLES / "paper-s10.yaml").read_text())
    dp_spec = {"clip": 1e3, "noise_multiplier": 1e-9}  # sigma = 1e-6: visible in the bits, not in the distance
    data.update(rounds=20, privacy={"secure_aggregation": True, "dp": dp_spec}, output={"plot": False})
    data["algorithms"] = data["algorithms"][:1]
    federated = api.run(data, transport="grpc", clients_per_process=5, out=tmp_path)
    (ours,) = federated.results
    data["privacy"] = {"secure_aggregation": True}
    (plain,) = api.run(data, out=tmp_path).results
    assert ours.status == "ok" and ours.summary()["privacy"]["noise_added_by"] == "clients"
    assert ours.z_sha256 != plain.z_sha256  # the clients' own noise ...
    np.testing.assert_allclose(ours.final_z, plain.final_z, rtol=0, atol=1e-5)  # ... of the size asked for
