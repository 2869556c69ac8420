"""Secure aggregation over gRPC with real client processes: the same bits as simulate, and a curious
coordinator that rebuilds a client's data from plain answers but not from masked ones."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from conftest import stop_processes

from fedsaddle import api
from fedsaddle.common.problems import make_problem, parse_spec, read_client_data
from fedsaddle.common.secagg import fixedpoint
from fedsaddle.common.secagg.messages import SEALED_SHARE_BYTES
from fedsaddle.common.secagg.rows import MaskedAnswer
from fedsaddle.common.tasks import Answer, GradientTask, Task
from fedsaddle.experiments.datasets import split
from fedsaddle.launch import index_groups, start_clients
from fedsaddle.proto import fedsaddle_pb2 as pb
from fedsaddle.server.config import parse_config
from fedsaddle.server.driver import AlgorithmResult, run_algorithm
from fedsaddle.server.pool import Category
from fedsaddle.server.transport import checks
from fedsaddle.server.transport.grpc_pool import GrpcPool
from fedsaddle.server.transport.local_pool import LocalPool
from fedsaddle.server.transport.refusal import Refusal
from fedsaddle.server.transport.sessions import Limits

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
CLIENTS, FEATURES, LAM = 10, 10, 0.1


def without_bytes(traffic: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Counts as simulate has them too (bytes on the wire are gRPC's alone)."""
    return {name: {k: v for k, v in counts.items() if not k.startswith("bytes")} for name, counts in traffic.items()}


def test_simulate_and_the_federation_agree_bit_for_bit_for_every_algorithm(tmp_path: Path) -> None:
    config = yaml.safe_load((EXAMPLES / "paper-s10.yaml").read_text())
    config.update(rounds=30, privacy={"secure_aggregation": True}, output={"plot": False})
    alone = api.run(config, out=tmp_path)
    # Processes of 3, 3, 3 and 1 clients: each hosted client masks its own row.
    federated = api.run(config, transport="grpc", clients_per_process=3, out=tmp_path)
    assert federated.failure is None
    for ours, theirs in zip(alone.results, federated.results, strict=True):
        assert theirs.status == ours.status == "ok", theirs.detail
        assert theirs.z_sha256 == ours.z_sha256, ours.name
        assert without_bytes(theirs.traffic) == without_bytes(ours.traffic), ours.name
        assert theirs.traffic["privacy"]["bytes_up"] > 0 and theirs.traffic["privacy"]["bytes_down"] > 0


def test_the_newer_baselines_go_through_secure_aggregation_bit_for_bit(tmp_path: Path) -> None:
    # Local Extragradient and Local SGDA+ answer named local computations, masked like any answer; FedGDA-GT's
    # local steps start from the gathered G(z_t), itself a masked sum.
    config = yaml.safe_load((EXAMPLES / "paper-s10.yaml").read_text())
    config.update(
        rounds=20,
        privacy={"secure_aggregation": True},
        output={"plot": False},
        algorithms=[
            {"name": "local_extragradient", "gamma": 0.01},
            {"name": "local_sgda_plus", "eta_x": 0.01},
            {"name": "fedgda_gt", "eta": 0.01},
        ],
    )
    alone = api.run(config, out=tmp_path)
    federated = api.run(config, transport="grpc", clients_per_process=3, out=tmp_path)
    plain = api.run({**config, "privacy": {}}, out=tmp_path)
    assert federated.failure is None
    for ours, theirs, unmasked in zip(alone.results, federated.results, plain.results, strict=True):
        assert theirs.status == ours.status == "ok", theirs.detail
        assert theirs.z_sha256 == ours.z_sha256, ours.name
        assert without_bytes(theirs.traffic) == without_bytes(ours.traffic), ours.name
        assert theirs.traffic["privacy"]["rounds"] == 1 + theirs.traffic["algorithm"]["rounds"]
        np.testing.assert_allclose(ours.final_z, unmasked.final_z, rtol=0, atol=1e-9)  # fixed point's resolution


def test_sampled_rounds_mask_among_the_drawn_clients_only(tmp_path: Path) -> None:
    config = yaml.safe_load((EXAMPLES / "paper-s10.yaml").read_text())
    config.update(
        rounds=20,
        privacy={"secure_aggregation": True},
        participation={"fraction": 0.5},
        output={"plot": False},
        algorithms=[config["algorithms"][3]],  # SCAFFOLD-S: sampled rounds of both kinds
    )
    (ours,) = api.run(config, out=tmp_path).results
    (theirs,) = api.run(config, transport="grpc", clients_per_process=3, out=tmp_path).results
    assert theirs.status == ours.status == "ok", theirs.detail
    assert theirs.z_sha256 == ours.z_sha256
    assert without_bytes(theirs.traffic) == without_bytes(ours.traffic)
    assert theirs.traffic["algorithm"]["messages_up"] == 5 * theirs.traffic["algorithm"]["rounds"]


def test_secagg_plus_over_grpc_agrees_with_simulate_and_with_all_pairs_bit_for_bit(tmp_path: Path) -> None:
    """k = 2 neighbours (a ring) on sampled rounds of 6 of 12 clients, hosted 4 to a process."""
    config = yaml.safe_load((EXAMPLES / "paper-s10.yaml").read_text())
    config["problem"]["num_clients"] = 12
    config.update(
        rounds=12,
        privacy={"secure_aggregation": True, "neighbours": 2},
        participation={"fraction": 0.5},
        output={"plot": False},
        algorithms=[config["algorithms"][3]],
    )
    (ours,) = api.run(config, out=tmp_path).results
    (theirs,) = api.run(config, transport="grpc", clients_per_process=4, out=tmp_path).results
    config["privacy"]["neighbours"] = 0
    (all_pairs,) = api.run(config, out=tmp_path).results
    assert theirs.status == ours.status == all_pairs.status == "ok", theirs.detail
    assert theirs.z_sha256 == ours.z_sha256 == all_pairs.z_sha256
    assert without_bytes(theirs.traffic) == without_bytes(ours.traffic)


@pytest.fixture(scope="module")
def diabetes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("diabetes")
    split("diabetes", CLIENTS, "label-skew", seed=1, out=folder)
    return folder


def regression(rounds: int, secure: bool, algorithm: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {
        "name": "diabetes",
        "problem": {"name": "linear_regression", "features": FEATURES, "lam": LAM, "num_clients": CLIENTS},
        "rounds": rounds,
        "algorithms": [algorithm],
        "privacy": {"secure_aggregation": secure},
        "output": {"plot": False},
        **fields,
    }


def test_weighted_runs_with_evaluation_agree_bit_for_bit(tmp_path: Path, diabetes: Path) -> None:
    config = regression(
        101,
        True,
        {"name": "scaffold_s", "gamma_local": 0.2},
        weighting="samples",
        evaluate_every=25,
        sync={"kind": "fixed", "tau": 10},
    )
    data = str(diabetes / "client-{i:03d}.npz")
    alone = api.run(config, data=data, out=tmp_path)
    federated = api.run(config, data=data, transport="grpc", clients_per_process=5, out=tmp_path)
    ((ours,), (theirs,)) = alone.results, federated.results
    assert theirs.status == ours.status == "ok", theirs.detail
    assert theirs.z_sha256 == ours.z_sha256
    assert without_bytes(theirs.traffic) == without_bytes(ours.traffic)
    assert [r.get("test_mse") for r in theirs.records] == [r.get("test_mse") for r in ours.records]
    assert theirs.traffic["evaluation"]["rounds"] == 3  # steps 0, 25 and 50 (SCAFFOLD-S: 2 rounds a step)


# -- a curious coordinator -----------------------------------------------------------------------


class Watched(GrpcPool):
    """A coordinator that looks at its round each time a masked answer's rows join the sum."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[tuple[str, int, int]] = []  # (how, most bytes of answers read at once, bytes of rows kept)

    def _exchange_masked(
        self, task: Task, round_id: int, category: Category, participants: Any, rows: Any
    ) -> list[MaskedAnswer]:
        add, end_stream = rows.add, rows.end_stream

        def look(how: str) -> None:  # (called on the transport's loop, as the answer is taken)
            round_ = self.protocol.collecting
            assert round_ is not None
            kept = sum(answer.vectors.nbytes for answer in round_.answers.values())
            self.seen.append((how, round_.peak_admitted_bytes, kept))

        def added(row: Any) -> None:
            look("whole")
            add(row)

        def streamed(shares: Any) -> None:  # (each row's sealed shares; the rows are in the sum)
            look("chunk by chunk")
            end_stream(shares)

        rows.add, rows.end_stream = added, streamed
        return super()._exchange_masked(task, round_id, category, participants, rows)


def watched_run(groups: list[str], chunk_bytes: int, dim: int = 3000) -> tuple[Watched, AlgorithmResult]:
    """SCAFFOLD-S with secure aggregation, 6 clients in processes of `groups`, no reorder room: the
    federation equal to simulate bit for bit; the pool, to see how the rows joined the sum."""
    clients, rounds = 6, 4
    config = parse_config(
        {
            "problem": {"name": "paper_regression", "num_clients": clients, "dim": dim, "s": 1.0},
            "algorithms": [{"name": "scaffold_s", "gamma_local": 0.01}],
            "sync": {"kind": "fixed", "tau": 2},
            "rounds": rounds,
            "privacy": {"secure_aggregation": True},
            "output": {"plot": False},
        }
    )
    alone = run_algorithm(config.algorithms[0], config, LocalPool(), run_id="as-they-come")
    pool = Watched(clients, "127.0.0.1:0", chunk_bytes=chunk_bytes, limits=Limits(reorder_mib=0))
    processes = start_clients(pool.address, groups)
    try:
        pool.wait_for_clients(60)
        federated = run_algorithm(config.algorithms[0], config, pool, run_id="as-they-come")
    finally:
        pool.close()
        stop_processes(processes)
    assert federated.status == alone.status == "ok", federated.detail
    assert federated.z_sha256 == alone.z_sha256
    return pool, federated


def test_masked_rows_are_summed_as_they_come_and_read_one_answer_at_a_time() -> None:
    # d = 3000: each row is 6002 ring elements (48 KB), 3 chunks of 16 KiB. With no reorder room, the
    # coordinator reads one answer at a time, in whatever order they come (sums mod 2^64 do not depend on
    # it), adds it to the round's sum chunk by chunk as it is read and keeps none of it: its memory does
    # not grow with n.
    pool, federated = watched_run([str(i) for i in range(6)], 16384)
    answer = 8 * (2 * 3000 + 2)  # one process's answer: a row with the objective and the weight
    masked_rounds = federated.traffic["algorithm"]["rounds"]
    assert len(pool.seen) == 6 * masked_rounds  # every row went into a sum as it came
    assert {how for how, _, _ in pool.seen} == {"chunk by chunk"}  # none was held whole first
    assert all(kept == 0 for _, _, kept in pool.seen)  # no answer kept its row once added
    assert all(peak <= answer for _, peak, _ in pool.seen)  # never two answers read at once
    assert max(peak for _, peak, _ in pool.seen) > 0  # (the answers were long enough to be held back)


def test_one_message_answers_join_the_sum_beside_answers_streaming_in_chunks() -> None:
    # Processes of 3, 2 and 1 clients with 64 KiB chunks: the lone client's answer (48 KB) is one message,
    # read whatever else is being read, and taken whole, possibly while another process's answer streams
    # (MaskedRound.add keeps it in the sum that aborting that stream would restore); the others stream.
    pool, federated = watched_run(["0-2", "3-4", "5"], 65536)
    masked_rounds = federated.traffic["algorithm"]["rounds"]
    hows = [how for how, _, _ in pool.seen]
    assert hows.count("whole") == hows.count("chunk by chunk") / 2 == masked_rounds
    assert all(kept == 0 for _, _, kept in pool.seen)


def test_masked_rows_of_over_64_kib_in_one_message_are_written_and_read_by_hand_with_the_same_bits() -> None:
    # d = 6000: a row is 12002 ring elements (96 kB), over the 64 KiB from which a payload is written and read
    # by hand, under the 2 MiB chunk: every answer is one message, taken whole, equal to simulate bit for bit.
    pool, federated = watched_run(["0-2", "3-4", "5"], 2 << 20, dim=6000)
    assert federated.traffic["algorithm"]["rounds"] > 0 and len(pool.seen) % 3 == 0  # three answers a round
    assert {how for how, _, _ in pool.seen} == {"whole"} and all(kept == 0 for _, _, kept in pool.seen)


class Curious(GrpcPool):
    """A coordinator that follows the protocol and keeps every vector its transport receives."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fold_answers = False  # it keeps each client's vector, not only their running sum
        self.plain: list[tuple[Task, list[Answer]]] = []
        self.masked: list[tuple[Task, list[MaskedAnswer]]] = []

    def _exchange(self, task: Task, round_id: int, category: Category, participants: Any) -> list[Answer]:
        answers = super()._exchange(task, round_id, category, participants)
        self.plain.append((task, answers))
        return answers

    def _exchange_masked(
        self, task: Task, round_id: int, category: Category, participants: Any, rows: Any
    ) -> list[MaskedAnswer]:
        answers = super()._exchange_masked(task, round_id, category, participants, rows)
        self.masked.append((task, answers))
        return answers


@contextmanager
def curious_federation(diabetes: Path) -> Iterator[Curious]:
    pool = Curious(CLIENTS, "127.0.0.1:0")
    data = {i: str(diabetes / f"client-{i:03d}.npz") for i in range(CLIENTS)}
    processes = start_clients(pool.address, index_groups(CLIENTS, 2), data=data)
    try:
        pool.wait_for_clients(60)
        yield pool
    finally:
        pool.close()
        stop_processes(processes)


def rebuild_moments(points: np.ndarray, answers: np.ndarray) -> np.ndarray:
    """A_i from (z, G_i(z)) pairs, knowing the problem's public form (common/problems/regression.py):
    -grad_y f_i = y - b_i/2 + A_i x/2 and grad_x f_i = lam x - A_i y/2, i.e. for every round
    A_i x - b_i = 2 (G_y - y) and A_i y = -2 (G_x - lam x): least squares over the rounds."""
    x, y = points[:, :FEATURES], points[:, FEATURES:]
    gx, gy = answers[:, :FEATURES], answers[:, FEATURES:]
    design = np.vstack([np.hstack([x, np.ones((len(x), 1))]), np.hstack([y, np.zeros((len(y), 1))])])
    targets = np.vstack([2 * (gy - y), -2 * (gx - LAM * x)])
    solution: np.ndarray = np.linalg.lstsq(design, targets, rcond=None)[0][:FEATURES].T
    return solution


def test_a_curious_coordinator_rebuilds_a_clients_data_from_plain_answers_but_not_from_masked_ones(
    diabetes: Path,
) -> None:
    spy, rounds = 3, 2 * FEATURES + 2
    truth = read_client_data(diabetes / f"client-{spy:03d}.npz")
    moments = truth.X.T @ truth.X / truth.samples  # X_i^T X_i / m_i: what the client keeps to itself
    algorithm = {"name": "minibatch_md", "gamma": 0.5}
    recorded: dict[bool, tuple[np.ndarray, np.ndarray]] = {}
    received = np.zeros(0, dtype=np.uint64)
    for secure in (False, True):
        config = parse_config(regression(rounds, secure, algorithm, init="random"))
        with curious_federation(diabetes) as pool:
            result = run_algorithm(config.algorithms[0], config, pool, run_id=f"curious-{secure}")
        assert result.status == "ok", result.detail
        if secure:
            assert not pool.plain  # no plain answer ever reached it
            points = np.array([task.z for task, _ in pool.masked if isinstance(task, GradientTask)])
            received = np.array(
                [row.masked for _, answers in pool.masked for a in answers for row in a.rows if row.client == spy]
            )
            # The best it can do: read the masked rows as values (the row's first 2p entries are w G_i).
            seen = fixedpoint.decode(received[:, : 2 * FEATURES], 40)
        else:
            points = np.array([task.z for task, _ in pool.plain if isinstance(task, GradientTask)])
            seen = np.array(
                [a.vectors[a.indices.index(spy)] for _, answers in pool.plain for a in answers if spy in a.indices]
            )
        assert len(points) == len(seen) == rounds
        recorded[secure] = points, seen
    # Without secure aggregation, the leak: X_i^T X_i / m_i to 1e-9 from one run's answers.
    leaked = rebuild_moments(*recorded[False])
    assert np.linalg.norm(leaked - moments) <= 1e-9 * np.linalg.norm(moments)
    # With it, the same reconstruction is off by far more than the size of the moments themselves ...
    masked_points, masked_values = recorded[True]
    guessed = rebuild_moments(masked_points, masked_values)
    assert np.linalg.norm(guessed - moments) > 100 * np.linalg.norm(moments)
    # ... and what it received does not depend on the client's true answers at those points.
    problem = make_problem(parse_spec(regression(1, True, algorithm)["problem"]))
    client = problem.load(diabetes / f"client-{spy:03d}.npz")  # type: ignore[attr-defined]
    true_answers = np.array([problem.gradient(client, z) for z in masked_points])  # type: ignore[attr-defined]
    ones = np.unpackbits(np.ascontiguousarray(received).view(np.uint8)).mean()
    assert abs(ones - 0.5) < 0.01  # every bit of every masked row a fair coin
    correlation = np.corrcoef(masked_values.ravel(), true_answers.ravel())[0, 1]
    assert abs(correlation) < 0.25  # (440 pairs: independent ones stay within 0.2 with odds > 99.99%)


# -- a client killed mid-round -----------------------------------------------------------------


VICTIM, LAST_ROUND = 4, 5


class Dropping(LocalPool):
    """simulate, with client VICTIM's masked row lost in the last round (as if its process died)."""

    def _exchange_masked(
        self, task: Task, round_id: int, category: Category, participants: Any, rows: Any
    ) -> list[MaskedAnswer]:
        (answer,) = super()._exchange_masked(task, round_id, category, participants, rows)
        if round_id == LAST_ROUND:
            answer = answer._replace(rows=tuple(row for row in answer.rows if row.client != VICTIM))
        return [answer]


class Killing(GrpcPool):
    """A coordinator whose client VICTIM is frozen as the last round starts and SIGKILLed once the
    others have answered it: the round loses it mid-round."""

    victim: subprocess.Popen[bytes] | None = None

    def _exchange_masked(
        self, task: Task, round_id: int, category: Category, participants: Any, rows: Any
    ) -> list[MaskedAnswer]:
        if round_id == LAST_ROUND and self.victim is not None:
            victim = self.victim
            victim.send_signal(signal.SIGSTOP)  # it gets the task, but does not answer it

            def kill_when_the_others_answered() -> None:
                while (round_ := self.protocol.collecting) is None or round_.answered_clients() < CLIENTS - 1:
                    time.sleep(0.01)
                victim.send_signal(signal.SIGKILL)

            threading.Thread(target=kill_when_the_others_answered, daemon=True).start()
        return super()._exchange_masked(task, round_id, category, participants, rows)


def test_a_client_killed_mid_round_is_unmasked_around_and_the_run_equals_simulate_with_that_dropout(
    diabetes: Path,
) -> None:
    config = parse_config(
        regression(
            LAST_ROUND,
            True,
            {"name": "minibatch_md", "gamma": 0.5},
            participation={"straggler_deadline_s": 30, "min_clients": 6},
        )
    )
    data = {i: str(diabetes / f"client-{i:03d}.npz") for i in range(CLIENTS)}
    alone = run_algorithm(config.algorithms[0], config, Dropping(data=data), run_id="dropout")
    pool = Killing(CLIENTS, "127.0.0.1:0", straggler_deadline_s=30, min_clients=6)
    processes = start_clients(pool.address, [str(i) for i in range(CLIENTS)], data=data)
    pool.victim = processes[VICTIM]
    try:
        pool.wait_for_clients(60)
        federated = run_algorithm(config.algorithms[0], config, pool, run_id="dropout")
    finally:
        pool.close()
        codes = stop_processes(processes)
    assert codes[VICTIM] == -signal.SIGKILL
    assert federated.status == alone.status == "ok", federated.detail
    assert federated.z_sha256 == alone.z_sha256
    assert without_bytes(federated.traffic) == without_bytes(alone.traffic)
    algorithm = federated.traffic["algorithm"]
    assert algorithm["messages_up"] == CLIENTS * LAST_ROUND - 1  # the last round closed without the victim
    privacy = federated.traffic["privacy"]
    assert privacy["messages_up"] == CLIENTS + CLIENTS * LAST_ROUND - 1  # keys, then the survivors' unmasking


def test_a_masked_answer_whose_shares_miss_a_client_of_the_round_is_refused_before_it_is_used() -> None:
    expected = checks.Expectation("r", 7, (1,), 3, False, masked=True, round_clients=(0, 1, 2))
    header = pb.Answer(run_id="r", round_id=7, client_indices=[1], payload_length=3, masked=True)
    header.shares.add(holders=[0], sealed=[bytes(SEALED_SHARE_BYTES)])  # client 2's share is missing
    payload = np.zeros(3, dtype="<u8").tobytes()
    with pytest.raises(Refusal, match=r"client 1: sealed shares for clients \[0\], expected one for each other client"):
        checks.answer(header, payload, expected)
    header.shares[0].holders.append(2)
    header.shares[0].sealed.append(bytes(SEALED_SHARE_BYTES))
    answer = checks.answer(header, payload, expected)
    assert answer.shares is not None and sorted(answer.shares[0]) == [0, 2]
    with pytest.raises(Refusal, match="masked rows of 16 bytes, expected 24"):
        checks.answer(header, payload[:16], expected)


def test_under_secagg_plus_a_masked_answer_must_share_with_its_neighbours_exactly() -> None:
    round_clients = tuple(range(8))
    expected = checks.Expectation("r", 7, (1,), 3, False, masked=True, round_clients=round_clients, neighbours=2)
    payload = np.arange(3, dtype="<u8").tobytes()

    def header_sharing_with(holders: list[int]) -> pb.Answer:
        header = pb.Answer(run_id="r", round_id=7, client_indices=[1], payload_length=3, masked=True)
        header.shares.add(holders=holders, sealed=[bytes(SEALED_SHARE_BYTES)] * len(holders))
        return header

    answer = checks.answer(header_sharing_with([0, 2]), payload, expected)  # 1's neighbours on the ring
    assert answer.shares is not None and sorted(answer.shares[0]) == [0, 2]
    for holders in ([0, 2, 3], [0], list(range(8))):
        with pytest.raises(Refusal, match=r"client 1: sealed shares for clients .*, expected one for each neighbour"):
            checks.answer(header_sharing_with([h for h in holders if h != 1]), payload, expected)


class Restarting(GrpcPool):
    """A coordinator whose client VICTIM's process is SIGKILLed as round RESTART_ROUND is about to start and
    started again (new process, new keys): it rejoins, and every client agrees on keys anew."""

    victim: subprocess.Popen[bytes] | None = None
    data: dict[int, str] = {}  # noqa: RUF012 - set per test
    restarted: list[subprocess.Popen[bytes]] = []  # noqa: RUF012

    def _exchange_masked(
        self, task: Task, round_id: int, category: Category, participants: Any, rows: Any
    ) -> list[MaskedAnswer]:
        if round_id == RESTART_ROUND and self.victim is not None:
            self.victim.send_signal(signal.SIGKILL)
            self.victim.wait(30)
            deadline = time.monotonic() + 30
            while any(VICTIM in s.indices for s in self.protocol.registry.live()) and time.monotonic() < deadline:
                time.sleep(0.01)  # until the coordinator has seen the stream end
            self.restarted += start_clients(self.address, [str(VICTIM)], data={VICTIM: self.data[VICTIM]})
        return super()._exchange_masked(task, round_id, category, participants, rows)


RESTART_ROUND = 4


Traffic = dict[str, dict[str, Any]]


def rejoined(
    diabetes: Path, reference: type[LocalPool], federation: type[Restarting]
) -> tuple[AlgorithmResult, Traffic, Traffic]:
    """Run 8 rounds of Minibatch MD with secure aggregation in-process (`reference`) and over gRPC with
    VICTIM's process killed and started again (`federation`); check both ended alike, bit for bit, and
    return the federated result and both runs' traffic without byte counts."""
    config = parse_config(regression(8, True, {"name": "minibatch_md", "gamma": 0.5}))
    data = {i: str(diabetes / f"client-{i:03d}.npz") for i in range(CLIENTS)}
    alone = run_algorithm(config.algorithms[0], config, reference(data=data), run_id="rejoin")
    pool = federation(CLIENTS, "127.0.0.1:0", rejoin_timeout_s=60)
    processes = start_clients(pool.address, [str(i) for i in range(CLIENTS)], data=data)
    pool.victim, pool.data, pool.restarted = processes[VICTIM], data, []
    try:
        pool.wait_for_clients(60)
        federated = run_algorithm(config.algorithms[0], config, pool, run_id="rejoin")
    finally:
        pool.close()
        codes = stop_processes(processes + pool.restarted)
    assert codes[VICTIM] == -signal.SIGKILL and len(pool.restarted) == 1
    assert federated.status == alone.status == "ok", federated.detail
    assert federated.z_sha256 == alone.z_sha256
    return federated, without_bytes(federated.traffic), without_bytes(alone.traffic)


def test_a_killed_client_process_that_rejoins_gets_new_keys_and_the_run_equals_simulate(diabetes: Path) -> None:
    federated, theirs, ours = rejoined(diabetes, LocalPool, Restarting)  # no round lost the client
    assert theirs["algorithm"] == ours["algorithm"]
    # One key agreement more, counted as privacy traffic: the new key up, the directory of epoch 1 down to all.
    assert theirs["privacy"]["rounds"] == ours["privacy"]["rounds"] + 1
    assert theirs["privacy"]["messages_up"] == ours["privacy"]["messages_up"] + 1
    assert theirs["privacy"]["messages_down"] == ours["privacy"]["messages_down"] + CLIENTS
    assert federated.traffic["privacy"]["bytes_down"] > 0


class DroppingIn(LocalPool):
    """simulate, with client VICTIM's masked row lost in round RESTART_ROUND only."""

    def _exchange_masked(
        self, task: Task, round_id: int, category: Category, participants: Any, rows: Any
    ) -> list[MaskedAnswer]:
        (answer,) = super()._exchange_masked(task, round_id, category, participants, rows)
        if round_id == RESTART_ROUND:
            answer = answer._replace(rows=tuple(row for row in answer.rows if row.client != VICTIM))
        return [answer]


class KillingMidRound(Restarting):
    """VICTIM is frozen as round RESTART_ROUND starts, SIGKILLed once the others answered, and started again:
    it comes back during the round, sits it out (dropped), and agrees on keys anew for the next."""

    def _exchange_masked(
        self, task: Task, round_id: int, category: Category, participants: Any, rows: Any
    ) -> list[MaskedAnswer]:
        if round_id == RESTART_ROUND and self.victim is not None:
            victim = self.victim
            victim.send_signal(signal.SIGSTOP)

            def kill_and_restart() -> None:
                while (round_ := self.protocol.collecting) is None or round_.answered_clients() < CLIENTS - 1:
                    time.sleep(0.01)
                victim.send_signal(signal.SIGKILL)
                victim.wait(30)
                self.restarted += start_clients(self.address, [str(VICTIM)], data={VICTIM: self.data[VICTIM]})

            threading.Thread(target=kill_and_restart, daemon=True).start()
        return GrpcPool._exchange_masked(self, task, round_id, category, participants, rows)


def test_a_client_killed_mid_round_that_rejoins_sits_that_round_out_and_the_run_equals_simulate(
    diabetes: Path,
) -> None:
    _, theirs, ours = rejoined(diabetes, DroppingIn, KillingMidRound)
    assert theirs["algorithm"] == ours["algorithm"]  # round RESTART_ROUND closed without the victim in both
    assert theirs["algorithm"]["messages_up"] == CLIENTS * 8 - 1
    assert theirs["privacy"]["rounds"] == ours["privacy"]["rounds"] + 1  # the key agreement anew
