"""A client process's side of the protocol (client/session.py), driven without sockets."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from federation import MemoryClient

from fedsaddle.client.session import ClientError, Working
from fedsaddle.common import wire
from fedsaddle.common.problems import PaperRegressionSpec, parse_spec
from fedsaddle.common.tasks import ComputeTask, EvaluateTask, GradientTask, LocalStepsTask
from fedsaddle.common.worker import ShardCache, Worker
from fedsaddle.proto import fedsaddle_pb2 as pb

DIM = 3000  # z has 6000 entries: 48 kB, chunked at 16 kB


def session(indices: tuple[int, ...] = (1, 4)) -> MemoryClient:
    state = MemoryClient(indices)
    state.handle(pb.Instruction(welcome=pb.Welcome(federation_id="f", num_clients=5, chunk_bytes=16_000)))
    spec = PaperRegressionSpec(num_clients=5, dim=DIM, s=2.0)
    run = pb.RunSpec(run_id="r", problem_name=spec.name, problem_json=spec.model_dump_json(), dimension=2 * DIM)
    run.synthetic_seed = 7
    (ready,) = state.handle(pb.Instruction(run=run))
    assert isinstance(ready, pb.ClientMessage) and ready.ready.dimension == 2 * DIM and not ready.ready.error
    return state


def answer_to(state: MemoryClient, task: LocalStepsTask | ComputeTask, round_id: int, chunk_bytes: int) -> bytes:
    """The answer's payload, the task sent as the coordinator sends it; chunks parsed as the client runtime does."""
    replies: list[pb.ClientMessage | bytes] = []
    for piece in wire.encode_task("r", round_id, task, chunk_bytes):
        chunk = wire.read_chunk(piece)
        replies += state.handle(chunk if chunk is not None else pb.Instruction.FromString(piece))
    messages = [pb.ClientMessage.FromString(r) if isinstance(r, bytes) else r for r in replies]
    header, chunks = messages[0].answer, [m.chunk for m in messages[1:]]
    assert header.round_id == round_id and tuple(header.client_indices) == state.indices
    return header.payload + b"".join(c.data for c in chunks)


def test_chunked_tasks_give_the_same_answers_as_inline_ones_task_after_task() -> None:
    rng = np.random.default_rng(0)
    chunked = session()
    for round_id in (1, 2, 3):  # it reuses its task and answer buffers: nothing may leak into the next answer
        task = LocalStepsTask(
            rng.standard_normal(2 * DIM),
            steps=4,
            gamma_local=0.05,
            step_offset=0,
            decay="constant",
            control=rng.standard_normal(2 * DIM),
            theta=0.5 * round_id,
        )
        by_chunks = answer_to(chunked, task, round_id, 16_000)
        assert by_chunks == answer_to(session(), task, round_id, 1 << 20)  # inline, into fresh buffers
        assert len(by_chunks) == 2 * 8 * 2 * DIM


@pytest.mark.parametrize("control", [True, False], ids=["scaffold", "fedavg"])
def test_one_client_runs_its_local_steps_in_the_task_buffer_with_the_same_bits(control: bool) -> None:
    """Without a regularizer, one hosted client's local steps run in the chunked task's own
    buffer instead of a copy: the answers stay those of an in-process worker, task after task."""
    rng = np.random.default_rng(1)
    chunked = session((2,))
    assert chunked.hosted.run is not None
    local = Worker(chunked.hosted.shards.get(parse_spec(json.loads(chunked.hosted.run.problem_json)), 7, (2,)), seed=0)
    for round_id in (1, 2, 3):
        task = LocalStepsTask(
            rng.standard_normal(2 * DIM),
            steps=5,
            gamma_local=0.05,
            control=rng.standard_normal(2 * DIM) if control else None,
        )
        sent = task.z_start.copy()
        by_chunks = answer_to(chunked, task, round_id, 16_000)
        assert chunked.hosted.worker is not None and "z" not in {name for name, _ in chunked.hosted.worker._buffers}
        expected = local.execute(task, round_id).vectors
        assert by_chunks == expected.tobytes()
        assert np.array_equal(task.z_start, sent)  # the coordinator's vector was never written
    assert by_chunks == answer_to(session((2,)), task, round_id, 1 << 20)  # inline: into a copy


def test_a_task_larger_than_the_runs_vectors_is_refused_before_anything_is_allocated() -> None:
    early = MemoryClient((1,))
    with pytest.raises(ClientError, match="task for run 'r' before its RunSpec"):
        early.handle(pb.Instruction(task=pb.Task(run_id="r", round_id=1, kind=pb.GRADIENT, payload_length=1 << 40)))
    state = session()
    header = pb.Task(run_id="r", round_id=1, kind=pb.GRADIENT, payload_length=1 << 40)
    with pytest.raises(
        ClientError, match=f"the coordinator sent a task of {1 << 40} float64 entries; run 'r' allows at most 12000"
    ):
        state.handle(pb.Instruction(task=header))


def test_tasks_are_bounded_by_the_datas_dimension_not_by_what_the_run_spec_claims() -> None:
    # A coordinator that claims a trillion entries, is told 8 in the Ready, and sends such a task anyway:
    # the client refuses it before allocating (it used to try, and die of a bare MemoryError).
    state = MemoryClient((1,))
    state.handle(pb.Instruction(welcome=pb.Welcome(federation_id="f", num_clients=5, chunk_bytes=16_000)))
    spec = PaperRegressionSpec(num_clients=5, dim=4, s=1.0)
    run = pb.RunSpec(run_id="r", problem_json=spec.model_dump_json(), synthetic_seed=1, dimension=10**12)
    (ready,) = state.handle(pb.Instruction(run=run))
    assert isinstance(ready, pb.ClientMessage) and ready.ready.dimension == 8 and not ready.ready.error
    header = pb.Task(run_id="r", round_id=1, kind=pb.GRADIENT, payload_length=10**12)
    with pytest.raises(ClientError, match=f"a task of {10**12} float64 entries; run 'r' allows at most 16$"):
        state.handle(pb.Instruction(task=header))
    # A task the data's size takes is answered: 8 entries from this process's one client.
    gradient = pb.GradientParams(batch=1)
    task = pb.Task(run_id="r", round_id=1, kind=pb.GRADIENT, gradient=gradient, payload_length=8, payload=bytes(64))
    (answer,) = state.handle(pb.Instruction(task=task))
    assert pb.ClientMessage.FromString(answer).answer.payload_length == 8


@pytest.mark.parametrize("declared", [0, 2 * DIM - 1, 2 * DIM + 1, 4 * DIM])
def test_an_inline_task_whose_payload_length_disagrees_with_its_payload_is_refused_and_changes_nothing(
    declared: int,
) -> None:
    # The header's payload_length was never compared with an inline payload: a task that declared one length
    # and carried another was served by the payload alone.
    state = session()
    gradient = pb.GradientParams(batch=1)
    z = np.ones(2 * DIM).tobytes()
    task = pb.Task(run_id="r", round_id=1, kind=pb.GRADIENT, gradient=gradient, payload_length=declared, payload=z)
    fault = (
        rf"a task declares payload_length {declared} \({8 * declared} bytes\) but carries an inline payload "
        rf"of {16 * DIM} bytes \({2 * DIM} float64 entries\)$"
    )
    with pytest.raises(ClientError, match=rf"^malformed instruction from the coordinator: {fault}"):
        state.handle(pb.Instruction(task=task))
    assert state.told is not None and re.match(f"^{fault}", state.told.failure.reason)  # (what the coordinator reads)
    assert state.told.failure.round_id == 1 and state.told.failure.run_id == "r"
    # Nothing of it was kept: the same task with its true length is answered, as round 1.
    task.payload_length = 2 * DIM
    (header, *_) = state.handle(pb.Instruction(task=task))
    assert isinstance(header, bytes)
    answer = pb.ClientMessage.FromString(header).answer
    assert answer.round_id == 1 and answer.payload_length == 2 * 2 * DIM


@pytest.mark.parametrize(
    ("clients", "error"),
    [
        ([4, 2], r"the task names clients \[2, 4\], not all hosted here"),
        ([1] * 100_000, r"the task names clients \[1, 1, 1, 1, 1, 1, 1, 1, ... and 99992 more\], some more than once"),
    ],
)
def test_a_task_must_name_hosted_clients_each_once(clients: list[int], error: str) -> None:
    # A client named 100 000 times would be computed and sent 100 000 times: a 100 kB task, a 4.8 GB answer.
    state = session()
    gradient = pb.GradientParams(batch=1)
    z = np.ones(2 * DIM).tobytes()
    task = pb.Task(run_id="r", round_id=1, kind=pb.GRADIENT, gradient=gradient, payload_length=2 * DIM, payload=z)
    del task.client_indices[:]
    task.client_indices.extend(clients)
    with pytest.raises(ClientError, match=f"^{error}$"):
        state.handle(pb.Instruction(task=task))
    # The session goes on: the same task naming client 4 once is answered for it alone.
    del task.client_indices[:]
    task.client_indices.append(4)
    (header, *_) = state.handle(pb.Instruction(task=task))
    assert isinstance(header, bytes)
    assert list(pb.ClientMessage.FromString(header).answer.client_indices) == [4]


@pytest.mark.parametrize("chunk_bytes", [0, 1023, (64 << 20) + 1])
def test_a_welcome_with_a_chunk_size_out_of_range_is_refused_and_changes_nothing(chunk_bytes: int) -> None:
    state = MemoryClient((1, 4))  # (a session's first Welcome: a second is refused as such)
    welcome = pb.Welcome(federation_id="f", num_clients=5, chunk_bytes=chunk_bytes)
    with pytest.raises(ClientError, match=f"malformed: chunk_bytes must be between 1024 .* got {chunk_bytes}$"):
        state.handle(pb.Instruction(welcome=welcome))
    assert state.session.chunk_bytes == 0
    with pytest.raises(ClientError, match="the coordinator sent a RunSpec before its Welcome"):
        state.handle(pb.Instruction(run=pb.RunSpec(run_id="r")))  # nothing of a run is served without one


def test_a_second_welcome_is_refused_naming_it_and_changes_nothing() -> None:
    # One Welcome per session: a second one (a coordinator off the protocol) was taken silently, and its chunk
    # size and federation size replaced the first's under a run.
    state = session()
    again = pb.Welcome(federation_id="other", num_clients=7, chunk_bytes=1 << 20)
    with pytest.raises(ClientError, match=r"^the coordinator sent a second Welcome during run 'r'$"):
        state.handle(pb.Instruction(welcome=again))
    assert state.session.chunk_bytes == 16_000
    early = MemoryClient((1,))
    early.handle(pb.Instruction(welcome=pb.Welcome(federation_id="f", num_clients=5, chunk_bytes=16_000)))
    with pytest.raises(ClientError, match=r"^the coordinator sent a second Welcome$"):  # (no run yet)
        early.handle(pb.Instruction(welcome=again))
    assert early.session.chunk_bytes == 16_000


def _ready_for(state: MemoryClient, problem: dict[str, object]) -> pb.Ready:
    spec = parse_spec(problem)
    run = pb.RunSpec(run_id="big", problem_name=spec.name, problem_json=spec.model_dump_json(), synthetic_seed=1)
    (reply,) = state.handle(pb.Instruction(run=run))
    assert isinstance(reply, pb.ClientMessage)
    return reply.ready


def test_a_run_too_large_for_this_machine_is_refused_in_ready_and_the_session_goes_on() -> None:
    # 2e12 float64 entries: no machine allocates them. The client says so instead of dying,
    # and the coordinator ends the run naming it.
    state = session()
    ready = _ready_for(state, {"name": "paper_regression", "num_clients": 5, "dim": 10**12})
    assert ready.run_id == "big" and ready.dimension == 0
    assert ready.error.startswith("not enough memory for this process's clients' data: Unable to allocate")
    assert state.hosted.worker is None
    # The session still serves the next run.
    assert not _ready_for(state, {"name": "paper_regression", "num_clients": 5, "dim": 4}).error


def test_a_run_whose_problem_has_another_client_count_than_the_federation_is_refused() -> None:
    # Synthetic data generation loops over every client: 1e11 of them would never end.
    state = session()
    ready = _ready_for(state, {"name": "paper_regression", "num_clients": 10**11, "dim": 4})
    assert ready.error == "the run's problem has 100000000000 clients; the federation has 5"


@pytest.mark.parametrize(
    ("problem_json", "error"),
    [
        ("[1, 2]", "the problem must be a mapping of fields, got list"),
        ("null", "the problem must be a mapping of fields, got NoneType"),
        ("{", "the coordinator's problem is not JSON: Expecting property name"),
        ('{"name": 5}', "the problem needs a `name`"),
        ("[" * 100_000, "the coordinator's problem is not JSON: maximum recursion depth exceeded"),
        (
            '{"name": "paper_regression", "num_clients": 5, "dim": 4, "s": Infinity}',
            "the coordinator's problem does not validate here: Input should be a finite number",
        ),
    ],
)
def test_a_run_spec_whose_problem_is_not_a_problem_is_refused_in_ready(problem_json: str, error: str) -> None:
    state = session()
    run = pb.RunSpec(run_id="odd", problem_json=problem_json, synthetic_seed=1)
    (reply,) = state.handle(pb.Instruction(run=run))
    assert isinstance(reply, pb.ClientMessage) and reply.ready.error.startswith(error)
    assert not _ready_for(state, {"name": "paper_regression", "num_clients": 5, "dim": 4}).error


@pytest.mark.parametrize("noise", [-1.0, float("nan"), float("inf")])
def test_a_run_spec_with_gradient_noise_that_is_no_deviation_is_refused_in_ready(noise: float) -> None:
    # (-1 ended the client with a ValueError; NaN was taken for exact gradients, inf made every answer diverge.)
    state = session()
    spec = PaperRegressionSpec(num_clients=5, dim=4, s=1.0)
    run = pb.RunSpec(run_id="noisy", problem_json=spec.model_dump_json(), synthetic_seed=1, gradient_noise=noise)
    (reply,) = state.handle(pb.Instruction(run=run))
    assert isinstance(reply, pb.ClientMessage)
    assert reply.ready.error == f"the run's gradient noise must be finite and >= 0, got {noise}"
    assert state.hosted.worker is None
    assert not _ready_for(state, {"name": "paper_regression", "num_clients": 5, "dim": 4}).error


@pytest.mark.parametrize("indices", [(1, 4), (3,)], ids=["two-clients", "one-client"])
def test_a_running_session_says_in_its_log_how_far_it_is(
    caplog: pytest.LogCaptureFixture, indices: tuple[int, ...]
) -> None:
    state = session(indices)  # (one client: its gradient tasks take the few-calls path, LoneGradient)
    state.session.heartbeat_s = 0.0  # a line per task (60 s in a real client)
    with caplog.at_level("INFO", logger="fedsaddle.client"):
        for round_id in (1, 2, 3):
            for _ in state.handle(
                pb.Instruction.FromString(wire.encode_task("r", round_id, GradientTask(np.ones(2 * DIM)), 1 << 20)[0])
            ):
                pass
        state.handle(pb.Instruction(goodbye=pb.Goodbye(reason="the run is over", outcome=pb.DONE)))
    said = [record.getMessage() for record in caplog.records]
    assert said[:3] == [f"run r: {k} tasks answered, now at round {k}" for k in (1, 2, 3)]
    assert said[3] == "coordinator says goodbye (3 tasks answered in the last run): the run is over"


def data_session(tmp_path: Path) -> MemoryClient:
    """Client 0 of 2 on its own linear-regression file, with held-out rows (metric test_mse)."""
    rng = np.random.default_rng(0)
    x, x_test = rng.standard_normal((50, 3)), rng.standard_normal((10, 3))
    np.savez(tmp_path / "c0.npz", X=x, y=x.sum(axis=1), X_test=x_test, y_test=x_test.sum(axis=1))
    state = MemoryClient((0,), ShardCache(data={0: tmp_path / "c0.npz"}))
    state.handle(pb.Instruction(welcome=pb.Welcome(federation_id="f", num_clients=2, chunk_bytes=16_000)))
    spec = parse_spec({"name": "linear_regression", "num_clients": 2, "features": 3})
    (ready,) = state.handle(pb.Instruction(run=pb.RunSpec(run_id="r", problem_json=spec.model_dump_json())))
    assert isinstance(ready, pb.ClientMessage) and ready.ready.dimension == 6 and not ready.ready.error
    return state


@pytest.mark.parametrize(
    ("data", "names", "error"),
    [
        (False, ("test_mse",), r"the coordinator sent an evaluation task for run 'r', whose problem has no evaluation"),
        (False, (), r"the coordinator sent an evaluation task for run 'r', whose problem has no evaluation"),
        (True, ("test_auc",), r"the coordinator asked run 'r' for the metrics \['test_auc'\]; its problem computes"),
        (True, ("test_mse",) * 3, r"the coordinator asked run 'r' for the metrics \['test_mse', 'test_mse', 'test"),
    ],
)
def test_an_evaluation_task_for_other_metrics_than_the_problems_is_malformed_and_changes_nothing(
    tmp_path: Path, data: bool, names: tuple[str, ...], error: str
) -> None:
    # The answer holds one value per metric the task names: the problem's must be the ones named.
    state = data_session(tmp_path) if data else session()
    z = np.ones(6 if data else 2 * DIM)
    (piece,) = wire.encode_task("r", 1, EvaluateTask(z, names), 1 << 20)
    with pytest.raises(ClientError, match=f"^{error}"):
        state.handle(pb.Instruction.FromString(piece))
    # The session goes on: the next task is answered.
    task = EvaluateTask(z, ("test_mse",)) if data else GradientTask(z, batch=1)
    (piece,) = wire.encode_task("r", 2, task, 1 << 20)
    (header, *_) = state.handle(pb.Instruction.FromString(piece))
    assert isinstance(header, bytes)
    answer = pb.ClientMessage.FromString(header).answer
    assert answer.round_id == 2 and answer.payload_length == len(state.indices) * (1 if data else 2 * DIM)


def test_a_compute_task_runs_the_named_computation_on_the_hosted_clients_as_in_process() -> None:
    state = session()
    z = np.linspace(-1.0, 1.0, 2 * DIM)
    task = ComputeTask("local_extragradient", z, params=(("steps", 3.0), ("gamma", 0.01)))
    payload = answer_to(state, task, 2, 16_000)
    shards = ShardCache().get(PaperRegressionSpec(num_clients=5, dim=DIM, s=2.0), 7, (1, 4))
    expected = Worker(shards, 0).execute(task, 2)
    assert payload == expected.vectors.tobytes()


def test_a_compute_task_for_a_computation_this_client_lacks_ends_the_session_naming_it() -> None:
    state = session()
    with pytest.raises(ClientError, match="this client has no local computation 'no_such_method': install the package"):
        answer_to(state, ComputeTask("no_such_method", np.ones(2 * DIM)), 2, 16_000)


def test_a_run_that_names_a_computation_this_client_lacks_is_refused_in_ready() -> None:
    state = MemoryClient((0,))
    state.handle(pb.Instruction(welcome=pb.Welcome(federation_id="f", num_clients=5, chunk_bytes=16_000)))
    spec = PaperRegressionSpec(num_clients=5, dim=4, s=2.0)
    run = pb.RunSpec(run_id="r", problem_name=spec.name, problem_json=spec.model_dump_json(), dimension=8)
    run.synthetic_seed = 7
    run.computations.extend(["local_sgda_plus", "someone_elses"])
    (ready,) = state.handle(pb.Instruction(run=run))
    assert isinstance(ready, pb.ClientMessage)
    assert ready.ready.error.startswith("this client has no local computation 'someone_elses'")


def test_a_key_directory_or_unmask_request_of_another_run_is_refused_naming_what_it_is() -> None:
    state = session()
    keys = pb.KeyDirectory(run_id="other", epoch=0)
    with pytest.raises(ClientError, match=r"^key directory for run 'other' before its RunSpec$"):
        state.handle(pb.Instruction(keys=keys))
    request = pb.UnmaskRequest(run_id="other", round_id=1, client=1, answered=[0, 1, 2])
    with pytest.raises(ClientError, match=r"^unmask request for run 'other' before its RunSpec$"):
        state.handle(pb.Instruction(unmask=request))


def test_a_large_inline_task_read_by_hand_is_answered_and_refused_as_protobufs_reading_of_it() -> None:
    # 12000 entries (z and the control), 96 kB inline: the client runtime reads the payload as a view into the
    # message (wire.read_inline_task). Its answer, and each refusal and the Failure that names it, are the same.
    rng = np.random.default_rng(5)
    z, control = rng.standard_normal((2, 2 * DIM))
    task = LocalStepsTask(z, steps=3, gamma_local=0.05, step_offset=0, decay="constant", control=control, theta=0.5)

    def both(piece: bytes) -> list[pb.Instruction | wire.InlineTask]:
        by_hand = wire.read_inline_task(piece)
        assert by_hand is not None and by_hand.payload.obj is piece
        return [by_hand, pb.Instruction.FromString(piece)]

    def outcome(state: MemoryClient, instruction: pb.Instruction | wire.InlineTask) -> object:
        try:
            replies = list(state.handle(instruction))
        except Exception as exc:
            return type(exc).__name__, str(exc), state.told
        return [r if isinstance(r, bytes) else r.SerializeToString() for r in replies]

    (piece,) = wire.encode_task("r", 1, task, 1 << 20)
    (elsewhere,) = wire.encode_task("other", 1, task, 1 << 20)
    short = pb.Instruction.FromString(piece)
    short.task.payload_length -= 1
    cases = [
        (piece, session, "answered"),
        (piece, lambda: MemoryClient((1, 4)), "ClientError"),  # before the Welcome
        (elsewhere, session, "ClientError"),  # for another run
        (short.SerializeToString(), session, "ClientError"),  # a payload_length its payload disagrees with
    ]
    for made, fresh, expected in cases:
        first, second = (outcome(fresh(), instruction) for instruction in both(made))
        assert first == second
        assert (first[0] if isinstance(first, tuple) else "answered") == expected


def small_session(
    indices: tuple[int, ...] = (3,), noise: float = 0.0, dim: int = 10, chunk_bytes: int = 16_000
) -> MemoryClient:
    """A session of run "r" at d = `dim` (z has 2 * dim entries; 20 unless told)."""
    state = MemoryClient(indices)
    state.handle(pb.Instruction(welcome=pb.Welcome(federation_id="f", num_clients=5, chunk_bytes=chunk_bytes)))
    spec = PaperRegressionSpec(num_clients=5, dim=dim, s=2.0)
    run = pb.RunSpec(run_id="r", problem_json=spec.model_dump_json(), dimension=2 * dim, gradient_noise=noise)
    run.synthetic_seed = 7
    (ready,) = state.handle(pb.Instruction(run=run))
    assert isinstance(ready, pb.ClientMessage) and not ready.ready.error
    return state


def test_the_usual_small_gradient_task_is_answered_in_a_few_calls_with_the_general_paths_bytes_and_errors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # One hosted client, no noise: a gradient task with its z inline skips the worker's dispatch and the
    # general encoder (LoneGradient). Any other task goes the general way; a gradient that is not finite is
    # answered as the general path answers it.
    rng = np.random.default_rng(3)

    def task(z: np.ndarray, round_id: int = 1, run_id: str = "r", **fields: object) -> pb.Instruction:
        (piece,) = wire.encode_task(run_id, round_id, GradientTask(z, exact=bool(fields.pop("exact", False))), 1 << 20)
        instruction = pb.Instruction.FromString(piece)
        for name, value in fields.items():
            if name == "client_indices":
                instruction.task.client_indices.extend(value)
            elif name in ("batch", "want_objective"):
                setattr(instruction.task.gradient, name, value)
            else:
                setattr(instruction.task, name, value)
        return instruction

    def outcome(state: MemoryClient, instruction: pb.Instruction) -> object:
        try:
            replies = list(state.handle(instruction))
        except Exception as exc:
            return type(exc).__name__, str(exc)
        return [r if isinstance(r, bytes) else r.SerializeToString() for r in replies]

    def counting(state: MemoryClient) -> list[int]:
        """Counts the worker's general calls (execute) of a session."""
        calls = [0]
        worker = state.hosted.worker
        assert worker is not None
        general = worker.execute

        def execute(*args: object, **kwargs: object) -> object:
            calls[0] += 1
            return general(*args, **kwargs)

        worker.execute = execute
        return calls

    z = rng.standard_normal(20)
    cases = [  # (the instruction, the way it goes)
        *((task(rng.standard_normal(20), round_id), "few calls") for round_id in (1, 2, 3)),
        (task(z, 4, exact=True), "few calls"),  # (no noise: an exact gradient is the same)
        (task(z, 5, want_objective=True), "general"),
        (task(z, 6, client_indices=[3]), "general"),  # it names its one client
        (task(z, 7, batch=0), "ClientError"),  # (malformed)
        (task(z, 8, payload_length=19), "ClientError"),  # the payload disagrees
        (task(z, 9, run_id="other"), "ClientError"),
        # Diverged, and finite with squares that overflow (tested entry by entry): answered as the general
        # path answers them (Worker.answer), from the one computation of the gradient.
        (task(np.full(20, np.inf), 10), "few calls"),
        (task(np.full(20, 1e200), 11), "few calls"),
    ]
    lone = small_session()
    with monkeypatch.context() as patched:
        patched.setattr(Worker, "lone_gradient", lambda self: None)
        general = small_session()
    taken, general_calls = counting(lone), counting(general)
    with np.errstate(over="ignore", invalid="ignore"):  # (as in a client process: the answers say what diverged)
        for instruction, way in cases:
            before = taken[0]
            result = outcome(lone, instruction)
            assert result == outcome(general, instruction)
            assert (result[0] if isinstance(result, tuple) else "answered") == (way if "Error" in way else "answered")
            assert taken[0] - before == (way == "general"), instruction.task
        assert general_calls[0] == len(cases) - 3  # (the three refused before the worker is asked)
        diverged = outcome(lone, task(np.full(20, np.inf), 12))
        assert pb.ClientMessage.FromString(diverged[0]).answer.diverged  # type: ignore[index]
        answers = [outcome(lone, task(z, 13)), outcome(general, task(z, 13))]
        assert answers[0] == answers[1] and len(pb.ClientMessage.FromString(answers[0][0]).answer.payload) == 160  # type: ignore[index]

    # Gradient noise, or two clients hosted: every task goes the general way.
    for state in (small_session(noise=0.5), small_session((1, 4))):
        calls = counting(state)
        list(state.handle(task(z, 1, exact=True)))
        assert calls == [1]


def test_an_empty_instruction_or_one_of_a_later_kind_ends_the_session_saying_so() -> None:
    state = session()
    later = pb.Instruction.FromString(wire.varint(15 << 3 | 2) + b"\x00")  # a kind a later protocol may add
    for instruction in (pb.Instruction(), later):
        with pytest.raises(ClientError, match=r"^unknown instruction: none of the kinds this client knows \(an empty"):
            state.handle(instruction)


def general_and_few_calls(monkeypatch: pytest.MonkeyPatch, **options: object) -> tuple[MemoryClient, MemoryClient]:
    """Two sessions of the same small run: one as the client runs it, one whose tasks all go the general way."""
    lone = small_session(**options)  # type: ignore[arg-type]
    with monkeypatch.context() as patched:
        patched.setattr(Worker, "lone_gradient", lambda self: None)
        general = small_session(**options)  # type: ignore[arg-type]
    return lone, general


def replies(state: MemoryClient, instruction: pb.Instruction) -> object:
    """The serialized replies to an instruction, or the error it raised (its type and text)."""
    try:
        return [r if isinstance(r, bytes) else r.SerializeToString() for r in state.handle(instruction)]
    except Exception as exc:
        return type(exc).__name__, str(exc)


def gradient_instruction(z: np.ndarray, round_id: int = 1) -> pb.Instruction:
    (piece,) = wire.encode_task("r", round_id, GradientTask(z), 1 << 20)
    return pb.Instruction.FromString(piece)


def test_a_gradient_answer_longer_than_the_welcomes_chunk_size_still_comes_in_chunks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # At d = 100 an answer is 1600 bytes, above a Welcome's chunk size of 1 KiB: the header, then two chunks
    # (proto/fedsaddle.proto, Answer.payload), whichever way the client computes it.
    lone, general = general_and_few_calls(monkeypatch, dim=100, chunk_bytes=1024)
    z = np.random.default_rng(5).standard_normal(200)
    for round_id in (1, 2):
        answer = replies(lone, gradient_instruction(z, round_id))
        assert answer == replies(general, gradient_instruction(z, round_id))
        assert isinstance(answer, list) and len(answer) == 3


@pytest.mark.parametrize(
    "returns",
    [
        lambda z: [0.0] * len(z),  # not an array: the general path's error names what it lacks
        lambda z: None,
        lambda z: z[:, 0].copy(),  # another shape
    ],
    ids=["a-list", "none", "a-row"],
)
def test_shards_whose_gradient_is_not_a_float64_column_give_the_general_paths_answer_or_error(
    monkeypatch: pytest.MonkeyPatch, returns: object
) -> None:
    from fedsaddle.common.problems.synthetic import PaperRegressionShards

    monkeypatch.setattr(PaperRegressionShards, "gradient", lambda self, z, out=None: returns(z))  # type: ignore[operator]
    lone, general = general_and_few_calls(monkeypatch)
    z = np.random.default_rng(6).standard_normal(20)
    assert replies(lone, gradient_instruction(z)) == replies(general, gradient_instruction(z))


def test_a_gradient_the_few_calls_path_leaves_to_the_general_one_is_computed_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Shards with a state of their own (a plug-in's stream, a count of calls) that answer in float32: each
    # task's gradient is computed once, as before, so the answers are the general path's task after task.
    from fedsaddle.common.problems.synthetic import PaperRegressionShards

    calls: dict[int, int] = {}

    def gradient(self: PaperRegressionShards, z: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        calls[id(self)] = calls.get(id(self), 0) + 1
        return (z * calls[id(self)]).astype(np.float32)

    monkeypatch.setattr(PaperRegressionShards, "gradient", gradient)
    lone, general = general_and_few_calls(monkeypatch)
    z = np.random.default_rng(7).standard_normal(20)
    with np.errstate(over="ignore", invalid="ignore"):
        for round_id in (1, 2, 3):
            assert replies(lone, gradient_instruction(z, round_id)) == replies(
                general, gradient_instruction(z, round_id)
            )
        diverged = np.full(20, np.inf)  # a diverged gradient too: the answer says so, from one computation
        assert replies(lone, gradient_instruction(diverged, 4)) == replies(general, gradient_instruction(diverged, 4))
    assert sorted(calls.values()) == [4, 4]


@pytest.mark.parametrize(
    "options",
    [{"dim": 100, "chunk_bytes": 1024}, {"dim": 4096}],
    ids=["answers-in-chunks", "answers-of-64-KiB"],
)
def test_a_run_that_does_not_take_the_few_calls_path_sets_no_buffer_aside_for_it(options: dict[str, int]) -> None:
    # Its answer buffer is made by the first task that needs one, as in every other run.
    state = small_session(**options)  # type: ignore[arg-type]
    assert state.hosted.worker is not None and state.hosted._lone is None and not state.hosted.worker._buffers


@pytest.mark.parametrize("dp", [False, True], ids=["secure-aggregation", "and-dp"])
def test_a_secure_run_of_one_hosted_client_never_takes_the_few_calls_path(dp: bool) -> None:
    state = MemoryClient((3,))
    state.handle(pb.Instruction(welcome=pb.Welcome(federation_id="f", num_clients=5, chunk_bytes=16_000)))
    spec = PaperRegressionSpec(num_clients=5, dim=10, s=2.0)
    run = pb.RunSpec(run_id="r", problem_json=spec.model_dump_json(), dimension=20)
    run.synthetic_seed = 7
    run.secure_aggregation.CopyFrom(pb.SecureAggregation(threshold=3, scale_bits=30, bound=1e6))
    if dp:
        run.dp.clip, run.dp.noise_multiplier = 1.0, 0.5
    (ready,) = state.handle(pb.Instruction(run=run))
    assert isinstance(ready, pb.ClientMessage) and not ready.ready.error and len(ready.ready.public_keys) == 1
    assert state.hosted.worker is not None and state.hosted._lone is None and not state.hosted.worker._buffers


def test_the_few_calls_answer_speaks_for_the_client_the_shards_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    # The general path answers for the worker's clients (its shards' indices), whatever a plug-in's shards say
    # they hold: the few-calls path's answer names the same client.
    from fedsaddle.common.problems.synthetic import PaperRegressionShards

    made = PaperRegressionShards.__init__

    def elsewhere(self: PaperRegressionShards, *args: object, **kwargs: object) -> None:
        made(self, *args, **kwargs)  # type: ignore[arg-type]
        self.indices = (4,)

    monkeypatch.setattr(PaperRegressionShards, "__init__", elsewhere)
    lone, general = general_and_few_calls(monkeypatch)
    z = np.random.default_rng(8).standard_normal(20)
    assert replies(lone, gradient_instruction(z)) == replies(general, gradient_instruction(z))


def test_a_new_run_leaves_nothing_of_the_last_runs_few_calls_path(monkeypatch: pytest.MonkeyPatch) -> None:
    # Run "r" takes the path; then a RunSpec this process cannot serve (Ready with an error), then one it can
    # at another dimension: the tasks of each are answered, or refused, as by the general path.
    lone, general = general_and_few_calls(monkeypatch)
    z = np.random.default_rng(9).standard_normal(20)
    assert replies(lone, gradient_instruction(z, 1)) == replies(general, gradient_instruction(z, 1))
    spec = PaperRegressionSpec(num_clients=5, dim=20, s=2.0)
    broken = pb.RunSpec(run_id="s", problem_json="{", dimension=40)
    usable = pb.RunSpec(run_id="r", problem_json=spec.model_dump_json(), dimension=40)
    usable.synthetic_seed = 7
    (piece,) = wire.encode_task("s", 2, GradientTask(z), 1 << 20)
    for run, tasks in (
        (broken, [gradient_instruction(z, 2), pb.Instruction.FromString(piece)]),
        (usable, [gradient_instruction(z, 3), gradient_instruction(np.concatenate([z, z]), 4)]),
    ):
        with monkeypatch.context() as patched:
            patched.setattr(Worker, "lone_gradient", lambda self: None)
            expected = replies(general, pb.Instruction(run=run))
        assert replies(lone, pb.Instruction(run=run)) == expected
        for instruction in tasks:
            assert replies(lone, instruction) == replies(general, instruction)
    assert lone.hosted._lone is not None
    assert isinstance(lone.session.state, Working) and isinstance(general.session.state, Working)
    assert lone.session.state.answered == general.session.state.answered == 1


def test_a_float32_run_is_echoed_in_ready_and_answered_in_four_byte_entries_as_in_process() -> None:
    state = session()
    spec = PaperRegressionSpec(num_clients=5, dim=4, s=1.0)
    run = pb.RunSpec(run_id="narrow", problem_json=spec.model_dump_json(), synthetic_seed=1, dimension=8)
    run.element_type = pb.FLOAT32
    (reply,) = state.handle(pb.Instruction(run=run))
    assert isinstance(reply, pb.ClientMessage) and not reply.ready.error
    assert reply.ready.element_type == pb.FLOAT32
    z = np.linspace(-1, 1, 8, dtype=np.float32)
    task = LocalStepsTask(z, 3, 0.1)
    pieces = wire.encode_task("narrow", 1, task, 16_000, dtype=wire.FLOAT32)
    (answer,) = state.handle(pb.Instruction.FromString(pieces[0]))
    header = pb.ClientMessage.FromString(answer).answer
    assert header.payload_length == 16 and len(header.payload) == 64  # two clients, 8 entries of 4 bytes
    shards = ShardCache().get(spec, 1, (1, 4), "uniform")
    expected = Worker(shards, 1, element=np.dtype(np.float32)).execute(task, 1)
    assert header.payload == expected.vectors.astype("<f4").tobytes()
    # The same run in float64 answers the widened arithmetic, unrounded: the float32 answer is its rounding.
    wide = Worker(shards, 1).execute(LocalStepsTask(z.astype(np.float64), 3, 0.1), 1)
    assert expected.vectors.dtype == np.float32
    np.testing.assert_array_equal(expected.vectors, wide.vectors.astype(np.float32))


def test_a_run_spec_of_an_element_type_this_client_does_not_know_is_refused_in_ready() -> None:
    state = session()
    spec = PaperRegressionSpec(num_clients=5, dim=4, s=1.0)
    run = pb.RunSpec(run_id="odd", problem_json=spec.model_dump_json(), synthetic_seed=1, dimension=8)
    run.element_type = 7  # type: ignore[assignment]  # (a later element type: an open enum's unknown value)
    (reply,) = state.handle(pb.Instruction(run=run))
    assert isinstance(reply, pb.ClientMessage)
    assert reply.ready.error.startswith("the coordinator's RunSpec.element_type is 7, which this client does not know")
    assert state.hosted.worker is None
