"""A client process written from proto/fedsaddle.proto alone, as someone outside the project would.

It imports nothing of fedsaddle: only grpc, numpy and the modules protoc generates
from the proto (their folder is the first argument). It serves the problem
`linear_regression` on its own .npz files, with the formulas the documentation and the
paper give (f_i(x, y) = -1/2 [||y||^2 - b_i^T y + y^T A_i x] + lam/2 ||x||^2, with
A_i = X_i^T X_i / m_i and b_i = X_i^T t_i / m_i), and speaks the protocol as the
proto's comments describe it, with the synchronous gRPC API. Its Hello lists its
clients in the order given on the command line, which need not be increasing.

    python outsider_client.py GENERATED ADDRESS INDEX=FILE [INDEX=FILE ...]

Exit status: 0 after a DONE goodbye; 1 after a FAILED one; 3 if an answer was refused.
"""

from __future__ import annotations

import json
import queue
import sys

import grpc
import numpy as np

sys.path.insert(0, sys.argv[1])  # the modules protoc generated from the proto
import fedsaddle_pb2 as pb
import fedsaddle_pb2_grpc as rpc


class LinearRegressionClients:
    """The clients this process hosts, each with its own rows."""

    def __init__(self, files: dict[int, str]) -> None:
        self.data = {i: np.load(path) for i, path in files.items()}

    def start(self, problem: dict[str, object]) -> None:
        if problem.get("name") != "linear_regression":
            raise ValueError(f"this client serves linear_regression, not {problem.get('name')}")
        self.p, self.lam = int(problem["features"]), float(problem.get("lam", 1e-2))  # type: ignore[arg-type]
        self.moments = {}
        for i, d in self.data.items():
            x, t = d["X"], d["y"]
            self.moments[i] = (x.T @ x / len(t), x.T @ t / len(t))

    def gradient(self, i: int, z: np.ndarray) -> np.ndarray:
        """G_i(z) = (grad_x f_i, -grad_y f_i)."""
        a, b = self.moments[i]
        x, y = z[: self.p], z[self.p :]
        return np.concatenate([self.lam * x - a.T @ y / 2, y - b / 2 + a @ x / 2])

    def objective(self, i: int, z: np.ndarray) -> float:
        a, b = self.moments[i]
        x, y = z[: self.p], z[self.p :]
        return float(-(y @ y - b @ y + y @ (a @ x)) / 2 + self.lam / 2 * (x @ x))

    def local_steps(self, i: int, z_start: np.ndarray, control: np.ndarray | None, local: pb.LocalSteps) -> np.ndarray:
        """The weighted sum of the local directions over `steps` steps from z_start."""
        z, total = z_start.copy(), np.zeros_like(z_start)
        g_start = self.gradient(i, z_start) if control is not None else None
        for s in range(local.steps):
            k = local.step_offset + s
            weight = 1.0 if local.decay == pb.CONSTANT else 1.0 / (np.sqrt(k) + 1.0)
            direction = self.gradient(i, z)
            if control is not None and g_start is not None:
                direction = direction - g_start + local.theta * (z - z_start) + control
            total += weight * direction
            z -= local.gamma_local * weight * direction
        return total

    def test_mse(self, i: int, z: np.ndarray) -> tuple[float, int]:
        d = self.data[i]
        residual = d["X_test"] @ z[: self.p] - d["y_test"]
        return float(residual @ residual / len(residual)), len(residual)


def main() -> int:
    address = sys.argv[2]
    files = {int(k): v for k, v in (arg.split("=", 1) for arg in sys.argv[3:])}
    order = list(files)  # as given: the Hello lists them so
    clients = LinearRegressionClients(files)
    outbox: queue.Queue[pb.ClientMessage | None] = queue.Queue()
    outbox.put(pb.ClientMessage(hello=pb.Hello(protocol_version=pb.PROTOCOL_VERSION_2, client_indices=order)))

    def requests():  # the stream up: what the loop below queues, until None
        while (message := outbox.get()) is not None:
            yield message

    chunk_bytes, dimension, task, payload = 0, 0, None, bytearray()
    with grpc.insecure_channel(address) as channel:
        for instruction in rpc.CoordinatorStub(channel).Session(requests()):
            kind = instruction.WhichOneof("body")
            if kind == "welcome":
                chunk_bytes = instruction.welcome.chunk_bytes
            elif kind == "run":
                run = instruction.run
                error = ""
                try:
                    if run.gradient_noise != 0:
                        raise ValueError("this client computes exact gradients only")
                    clients.start(json.loads(run.problem_json))
                except (ValueError, KeyError) as exc:
                    error = str(exc)
                dimension = 2 * clients.p if not error else 0
                counts = [len(clients.data[i]["y"]) for i in order]
                ready = pb.Ready(run_id=run.run_id, dimension=dimension, sample_counts=counts, error=error)
                outbox.put(pb.ClientMessage(ready=ready))
            elif kind == "task":
                task, payload = instruction.task, bytearray(instruction.task.payload)
            elif kind == "chunk":
                assert instruction.chunk.offset == len(payload)
                payload += instruction.chunk.data
            elif kind == "rejected":
                print(f"answer refused: {instruction.rejected}", file=sys.stderr)
                outbox.put(None)
                return 3
            elif kind == "goodbye":
                outbox.put(None)
                return 0 if instruction.goodbye.outcome == pb.DONE else 1
            if task is not None and len(payload) == 8 * task.payload_length:
                for message in answer(
                    clients, task, np.frombuffer(bytes(payload), "<f8"), order, dimension, chunk_bytes
                ):
                    outbox.put(message)
                task = None
    return 2  # the stream ended without a goodbye


def answer(clients, task, values, order, dimension, chunk_bytes):  # type: ignore[no-untyped-def]
    """The Answer (and its Chunks) for a task whose payload has arrived."""
    who = list(task.client_indices) or order
    objective, counts = [], []
    if task.kind == pb.GRADIENT:
        rows = [clients.gradient(i, values) for i in who]
        if task.gradient.want_objective:
            objective = [clients.objective(i, values) for i in who]
    elif task.kind == pb.LOCAL_STEPS:
        control = values[dimension:] if task.local.correction == pb.SCAFFOLD else None
        rows = [clients.local_steps(i, values[:dimension], control, task.local) for i in who]
    else:  # EVALUATE
        assert list(task.metric_names) == ["test_mse"], task.metric_names
        evaluated = [clients.test_mse(i, values) for i in who]
        rows, counts = [np.array([mse]) for mse, _ in evaluated], [n for _, n in evaluated]
    data = np.concatenate(rows).astype("<f8").tobytes()
    header = pb.Answer(
        run_id=task.run_id,
        round_id=task.round_id,
        client_indices=who,
        payload_length=len(data) // 8,
        objective=np.array(objective, "<f8").tobytes(),
        sample_counts=counts,
    )
    if len(data) <= chunk_bytes:
        header.payload = data
        return [pb.ClientMessage(answer=header)]
    pieces = [pb.ClientMessage(answer=header)]
    for offset in range(0, len(data), chunk_bytes):
        pieces.append(pb.ClientMessage(chunk=pb.Chunk(offset=offset, data=data[offset : offset + chunk_bytes])))
    return pieces


if __name__ == "__main__":
    code = main()
    assert not any(name.startswith("fedsaddle.") for name in sys.modules), "imported fedsaddle"
    sys.exit(code)
