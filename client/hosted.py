"""The work of a client process: its hosted clients' data, their worker and their secure-aggregation parties.

`ClientSession` (session.py) decides what the protocol asks for and hands it out
as actions; `HostedClients` performs those that load data or compute (a run's data
loaded, a task answered, keys agreed, a round unmasked) and returns the results,
which the caller feeds back into the session. The service (service.py) and the
in-memory federation of the tests drive the two the same way.
"""

from __future__ import annotations

import gc
import json
import logging
import math
from collections.abc import Callable, Iterable

import numpy as np
from pydantic import ValidationError

from fedsaddle.client.session import (
    ELEMENTS,
    AgreeKeys,
    Compute,
    Loaded,
    LoadRun,
    Refusal,
    Unmask,
)
from fedsaddle.common import blas, wire
from fedsaddle.common.attacks import Attack, corrupt_answer
from fedsaddle.common.computations import find_computation
from fedsaddle.common.dp import DpSettings
from fedsaddle.common.memory import trim
from fedsaddle.common.numeric import Array
from fedsaddle.common.problems import DataError, ProblemNotFound, parse_spec, problem_class
from fedsaddle.common.secagg import SecAggError, messages
from fedsaddle.common.secagg.party import Party
from fedsaddle.common.secagg.rows import mask_answer, row_length
from fedsaddle.common.secagg.settings import check_bound
from fedsaddle.common.tasks import Answer, EvaluateTask, Task
from fedsaddle.common.text import printable
from fedsaddle.common.worker import ShardCache, UnknownComputation, Worker
from fedsaddle.proto import fedsaddle_pb2 as pb

log = logging.getLogger("fedsaddle.client")


class HostedClients:
    """This process's clients for the current run: the data, the worker that computes on it, and (secure
    aggregation) one party per client with each one's own weight."""

    def __init__(
        self, indices: tuple[int, ...], shards: ShardCache | None = None, attack: Attack | None = None
    ) -> None:
        self.indices = indices
        self.shards = shards or ShardCache(size=2)  # holds the clients' data files and the trusted plugins
        self.attack = attack  # research and tests: lie about every algorithm answer (common/attacks.py)
        self.worker: Worker | None = None
        self.run: pb.RunSpec | None = None
        self._writer: wire.AnswerWriter | None = None  # made by each run, with the Welcome's chunk size
        self._run_name = ""  # the run's id as logs show it: the coordinator's text, bounded and escaped
        self._lone: LoneGradient | None = None  # the usual small round's task, in a few calls (see the class)
        self._dimension = 0
        self._num_clients = 0  # n, from the Welcome
        self._parties: dict[int, Party] = {}
        self._weights: dict[int, float] | None = None
        self._dp: DpSettings | None = None  # differential privacy's clipping and this process's noise
        # (round, its clients, row length) of the last masked round, and the round expected after its unmasking:
        # its masks are made while the coordinator unmasks and computes (prepare_next).
        self._last_masked: tuple[int, tuple[int, ...], int] | None = None
        self._upcoming: tuple[int, tuple[int, ...], int] | None = None

    def load(self, action: LoadRun) -> Loaded | Refusal:
        """Load this process's clients' data for the run, and make its worker; or why it cannot."""
        run = action.run
        self.run, self.worker, self._lone = run, None, None
        self._run_name = printable(run.run_id, 64)
        gc.unfreeze()  # the last run's objects (frozen below) go back to the collector with the run
        self._num_clients = action.num_clients
        try:
            if run.element_type not in ELEMENTS:
                raise ValueError(
                    f"the coordinator's RunSpec.element_type is {run.element_type}, which this client does not know "
                    "(it reads FLOAT64 and FLOAT32)"
                )
            element = ELEMENTS[run.element_type]
            try:
                problem = json.loads(run.problem_json)
            except (ValueError, RecursionError) as exc:  # (RecursionError: nested too deeply to parse)
                raise ValueError(f"the coordinator's problem is not JSON: {exc}") from None
            spec = parse_spec(problem, self.shards.trusted)
            missing = [name for name in run.computations if find_computation(name) is None]
            if missing:
                raise ValueError(str(UnknownComputation(missing[0])))
            n = action.num_clients
            if n and spec.num_clients != n:  # a synthetic problem's data generation scales with it
                raise ValueError(f"the run's problem has {spec.num_clients} clients; the federation has {n}")
            seed = run.synthetic_seed if run.HasField("synthetic_seed") else None
            shards = self.shards.get(spec, seed, self.indices, "samples" if run.want_sample_counts else "uniform")
            metrics = tuple(problem_class(spec.name, spec.plugin, self.shards.trusted).metric_names)
            counts: list[int] = []
            if run.want_sample_counts:
                sample_counts = getattr(shards, "sample_counts", None)
                if sample_counts is None:
                    raise ValueError(f"problem {spec.name} has no per-client sample counts to weight by")
                counts = sample_counts()
            worker = Worker(
                shards, run.noise_seed, run.gradient_noise, reuse_answers=True, scratch_tasks=True, element=element
            )
            self._parties, self._weights, self._dp, keys = {}, None, None, []
            if run.HasField("dp"):
                clip, multiplier = run.dp.clip, run.dp.noise_multiplier
                if not (math.isfinite(clip) and clip > 0 and math.isfinite(multiplier) and multiplier > 0):
                    raise ValueError(f"differential privacy needs a finite clip and noise multiplier > 0, got {run.dp}")
                if not run.HasField("secure_aggregation"):
                    raise ValueError("the coordinator asks for differential privacy's noise without secure aggregation")
                self._dp = DpSettings(clip, multiplier)
            if run.HasField("secure_aggregation") and element != wire.FLOAT64:
                raise ValueError("the coordinator asks for secure aggregation in a FLOAT32 run; its rows are float64's")
            if run.HasField("secure_aggregation"):
                secure = run.secure_aggregation
                settings = messages.read_settings(secure)
                check_bound(max(n, len(self.indices), 2), settings.bound, settings.scale_bits)
                self._parties = {i: Party(i, run.run_id, settings) for i in self.indices}
                keys = [self._parties[i].public_key for i in self.indices]
                if secure.weigh_by_samples:  # each client weighs its own row; the counts never leave
                    sample_counts = getattr(shards, "sample_counts", None)
                    if sample_counts is None:
                        raise ValueError(f"problem {spec.name} has no per-client sample counts to weight by")
                    self._weights = dict(zip(self.indices, (float(c) for c in sample_counts()), strict=True))
        except ValidationError as exc:
            return Refusal(f"the coordinator's problem does not validate here: {exc.errors()[0]['msg']}")
        except (ProblemNotFound, DataError, ValueError) as exc:
            return Refusal(str(exc))
        except MemoryError as exc:  # the problem's size is the coordinator's to choose, this machine's memory is not
            return Refusal(f"not enough memory for this process's clients' data: {exc}")
        self.worker = worker
        # Making the data left its temporaries' pages in the heaps: hand them back before the first task, whose
        # buffers are not placed there (common/memory.py, `lasting`).
        trim()
        # What lives as long as the run (modules, the worker, its data, the parties) is set aside from the
        # collector, so that the full collection of the periodic trim does not walk it again and again: its
        # cost then stays small whatever the run's size (docs/privacy.md, "Cost"). Unreferenced objects are
        # still freed; only reference cycles among them wait for the next run's unfreeze.
        gc.freeze()
        # Tasks are bounded by what the data gives, not by what the RunSpec claims: a coordinator that
        # said a trillion and went on despite this Ready would have this process allocate terabytes.
        self._dimension = shards.dimension
        self._writer = wire.AnswerWriter(action.chunk_bytes, element)
        # Its answer goes inline as protobuf writes it: within the Welcome's chunk size (a longer one goes in
        # Chunks) and below BY_HAND_ABOVE (a larger one is written by hand). (Asked last: the worker sets its
        # answer buffer aside for it.)
        inline = 8 * self._dimension <= action.chunk_bytes and 8 * self._dimension < wire.BY_HAND_ABOVE
        inline = inline and element == wire.FLOAT64  # (its bytes are float64's)
        gradient = worker.lone_gradient() if inline and not self._parties and self.attack is None else None
        if gradient is not None:
            self._lone = LoneGradient(
                run.run_id, worker.indices[0], self._dimension, gradient, worker.answer, self._writer
            )
        return Loaded(
            dimension=shards.dimension,
            sample_counts=tuple(counts),
            public_keys=tuple(keys),
            metrics=metrics,
            secure=bool(self._parties),
            lone=self._lone is not None,
            numeric_stack=blas.numeric_stack(),
        )

    def compute(self, action: Compute) -> Iterable[bytes] | Refusal:
        """A task's answer, serialized (an Answer and its Chunks), or why these clients refuse to answer."""
        message = action.message
        if action.task is None:  # the run's usual small gradient (the session found it one)
            assert self._lone is not None and action.payload is not None
            return self._lone.answer(message.round_id, action.payload)
        worker, writer = self.worker, self._writer
        assert worker is not None and writer is not None  # (the session asks only in a run this loaded)
        task, round_id = action.task, message.round_id
        if self._parties:
            return self._masked(message, task, action.clients)
        return writer.encode(
            message.run_id, round_id, self._lie(task, worker.execute(task, round_id, action.clients), round_id)
        )

    def _lie(self, task: Task, answer: Answer, round_id: int) -> Answer:
        """The answer as this process sends it: its own, unless it simulates a Byzantine client (never on
        held-out evaluation)."""
        if self.attack is None or isinstance(task, EvaluateTask):
            return answer
        assert self.run is not None
        return corrupt_answer(self.attack, answer, self.run.noise_seed, round_id)

    # -- secure aggregation ----------------------------------------------------------------

    def agree(self, action: AgreeKeys) -> Refusal | None:
        """Agree on pairwise keys with every other client; a stale or forged directory is refused."""
        try:
            for party in self._parties.values():
                party.agree(action.epoch, action.keys)
        except SecAggError as exc:
            return Refusal(f"refused the coordinator's key directory: {exc}")
        return None

    def _masked(self, message: pb.Task, task: Task, clients: tuple[int, ...] | None) -> Iterable[bytes] | Refusal:
        """The task's answer as masked rows, one per answering client, each masked by its own party."""
        assert self.worker is not None and self._writer is not None
        round_clients = tuple(int(i) for i in message.round_clients) or tuple(range(self._num_clients))
        answer = self._lie(task, self.worker.execute(task, message.round_id, clients), message.round_id)
        self._last_masked = (message.round_id, round_clients, row_length(task, self._dimension))
        self._upcoming = None
        try:
            masked = mask_answer(
                self._parties, answer, task, message.round_id, 0, round_clients, self._weights, self._dp
            )
        except SecAggError as exc:  # the coordinator asked for a round that cannot be summed safely
            return Refusal(f"refused to answer: {exc}")
        if masked.diverged:
            log.error("run %s: %s", self._run_name, masked.reason)
        return messages.masked_answer(message.run_id, message.round_id, masked, self._writer.chunk_bytes)

    def unmask(self, action: Unmask) -> bytes:
        """A client's part of unmasking a round, or its refusal (sent back, naming the round)."""
        request = action.request
        run_id = request.run_id
        party = self._parties[request.client]  # (the session asks only for a hosted client of a secure run)
        try:
            reply = party.unmask(messages.read_unmask_request(request))
        except SecAggError as exc:
            log.error("run %s: client %d refuses to unmask: %s", self._run_name, request.client, exc)
            return messages.unmask_reply(run_id, request.round_id, request.client, None, str(exc))
        last = self._last_masked
        if last is not None and last[0] == request.round_id:  # the same clients and length are the likely next
            self._upcoming = (request.round_id + 1, last[1], last[2])
        return messages.unmask_reply(run_id, request.round_id, request.client, reply)

    def prepare_next(self) -> None:
        """Make the expected next round's masks now, after the unmasking replies are sent and before the
        task comes (the coordinator is unmasking and computing): the task then only adds them. A round that
        comes otherwise is masked as usual, and the masks made here are dropped."""
        upcoming, self._upcoming = self._upcoming, None
        if upcoming is None:
            return
        round_id, clients, length = upcoming
        for index, party in self._parties.items():
            if index in clients:
                party.prepare(round_id, 0, clients, length)


class LoneGradient:
    """The usual task of a small round, answered in a few calls: a gradient at z, for the one client a
    process hosts. The general path (decoding, the worker's dispatch, the finiteness test, the answer's
    encoding) makes some thirty Python and numpy calls for it, and in place each costs several times
    what it costs in a loop, as the other processes take the caches between rounds (bench/README.md,
    *One task, few calls*).

    A run takes it only where the general path would do just this: one client hosted, no secure
    aggregation (nor its differential privacy), no gradient noise (Worker.lone_gradient), and answers
    small enough to go inline as protobuf writes them (within the Welcome's chunk size and below
    wire.BY_HAND_ABOVE). A task takes it only when the session finds it a GRADIENT of the run naming no
    clients, asking no objective, with a batch of at least 1 and exactly the run's entries inline
    (ClientSession.receive); any other task goes the general way, with the general path's errors.
    A gradient that is not a finite float64 column of the run's length (a diverged one; a plug-in's of
    another shape or type) is not computed again: it is answered as the general path answers it
    (Worker.answer, then the run's AnswerWriter), so that shards with a state of their own see one call
    per task. The bytes are the same (tests/test_client_session.py compares them)."""

    def __init__(
        self,
        run_id: str,
        index: int,
        dimension: int,
        gradient: Callable[[Array], Array],
        general: Callable[[Array], Answer],
        writer: wire.AnswerWriter,
    ) -> None:
        self.run_id, self.shape = run_id, (dimension, 1)
        self.gradient, self.general, self.writer = gradient, general, writer
        self.message = pb.ClientMessage()
        header = self.message.answer  # the fields every answer of the run shares, set once
        header.run_id = run_id
        header.client_indices.append(index)
        header.payload_length = dimension

    def answer(self, round_id: int, payload: bytes) -> Iterable[bytes]:
        """The serialized answer to the gradient at z (`payload`: the run's float64 entries)."""
        g = self.gradient(np.frombuffer(payload, np.float64)[:, None])
        if type(g) is np.ndarray and g.shape == self.shape and g.dtype == np.float64:
            flat = g.ravel()
            if math.isfinite(flat.dot(flat)):  # (as numeric.all_finite tests a short vector)
                header = self.message.answer
                header.round_id = round_id
                header.payload = g.tobytes()
                return (self.message.SerializeToString(),)
        return self.writer.encode(self.run_id, round_id, self.general(g))
