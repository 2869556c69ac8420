"""Chunk flood: a client that cuts its answers into tiny chunks, against the coordinator.

Every message costs the coordinator about the same work whatever its size, so an
answer cut into one-byte chunks would cost it a message's work per byte. The wire
contract asks every chunk but a payload's last to carry at least 4 KiB (or the
session's chunk size, if smaller), and a session refused 32 times in one round is
ended (docs/explanation/threat-model.md, Limits).

This process is the coordinator of two clients: client 1 is an honest client
process, client 0 a process that answers correctly but cuts each answer into
chunks of --pieces bytes. For each piece size, a fresh federation runs
gradient rounds at d = --dim; prints the median round, or how and how soon the
coordinator ended the flooding session.

    python bench/chunk_flood.py                       # d = 1e6; pieces of 2 MiB, 4 KiB and 1 byte
    python bench/chunk_flood.py --dim 1e4 --pieces 1024 1
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import subprocess
import sys
import time

import grpc
import numpy as np

from fedsaddle.common import wire
from fedsaddle.common.problems import PaperRegressionSpec
from fedsaddle.common.worker import ShardCache, Worker
from fedsaddle.launch import reap, start_clients
from fedsaddle.proto import fedsaddle_pb2 as pb
from fedsaddle.server.pool import ClientLost, RunInfo
from fedsaddle.server.transport.grpc_pool import GrpcPool


async def flooding_client(address: str, spec: PaperRegressionSpec, piece: int) -> None:
    """Client 0: correct answers, cut into chunks of `piece` bytes, until the stream ends."""
    async with grpc.aio.insecure_channel(address, options=wire.grpc_options(wire.MAX_CHUNK_BYTES)) as channel:
        call = channel.stream_stream(
            wire.SESSION_METHOD, request_serializer=wire.serialized, response_deserializer=pb.Instruction.FromString
        )()
        hello = pb.Hello(protocol_version=pb.PROTOCOL_VERSION_2, client_indices=[0], client_name="flood")
        await call.write(pb.ClientMessage(hello=hello))
        worker: Worker | None = None
        task, payload = pb.Task(), bytearray()
        try:
            async for instruction in call:
                kind = instruction.WhichOneof("body")
                if kind == "run":
                    shards = ShardCache(size=1).get(spec, instruction.run.synthetic_seed, (0,))
                    worker = Worker(shards, instruction.run.noise_seed)
                    ready = pb.Ready(run_id=instruction.run.run_id, dimension=instruction.run.dimension)
                    await call.write(pb.ClientMessage(ready=ready))
                    continue
                if kind == "task":
                    task, payload = instruction.task, bytearray(instruction.task.payload)
                elif kind == "chunk":
                    payload += instruction.chunk.data
                else:
                    continue
                if worker is None or len(payload) < 8 * task.payload_length:
                    continue
                answer = worker.execute(wire.decode_task(task, bytes(payload), 2 * spec.dim), task.round_id)
                data = answer.vectors.tobytes()
                header = pb.Answer(
                    run_id=task.run_id, round_id=task.round_id, client_indices=[0], payload_length=len(data) // 8
                )
                await call.write(pb.ClientMessage(answer=header))
                for offset in range(0, len(data), piece):
                    chunk = pb.Chunk(offset=offset, data=data[offset : offset + piece])
                    await call.write(pb.ClientMessage(chunk=chunk))
        except grpc.aio.AioRpcError:
            pass  # the coordinator ended the session: the federation reports how


class Ended(logging.Handler):
    """Keeps why the coordinator ended a session (its warning), and lets no other line through."""

    def __init__(self) -> None:
        super().__init__()
        self.reasons: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("ended the session of"):
            self.reasons.append(message.split(": ", 1)[1])


def federation(dim: int, piece: int, rounds: int) -> str:
    spec = PaperRegressionSpec(num_clients=2, dim=dim, s=1.0)
    pool = GrpcPool(2, "127.0.0.1:0", round_timeout_s=600)
    honest = start_clients(pool.address, ["1"])
    flood = subprocess.Popen([sys.executable, __file__, "--flood", pool.address, str(piece), str(dim)])
    try:
        pool.wait_for_clients(60)
        run = RunInfo("flood", spec, 0, 0.0)
        pool.start_run(run)
        z = np.ones(run.dimension)
        times = []
        for _ in range(rounds):
            started = time.perf_counter()
            try:
                pool.gradients(z)
            except ClientLost:
                why = ENDED.reasons[-1] if ENDED.reasons else "it disconnected"
                return f"session ended {1e3 * (time.perf_counter() - started):.0f} ms into the round: {why}"
            times.append(time.perf_counter() - started)
        return f"round {1e3 * statistics.median(times):.1f} ms (median of {rounds}; answered in full)"
    finally:
        pool.close()
        reap([*honest, flood])


def main() -> None:
    if sys.argv[1:2] == ["--flood"]:  # the flooding client's process
        address, piece, dim = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
        asyncio.run(flooding_client(address, PaperRegressionSpec(num_clients=2, dim=dim, s=1.0), piece))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=float, default=1e6, help="d: x and y each in R^d")
    parser.add_argument(
        "--pieces", type=int, nargs="+", default=[wire.DEFAULT_CHUNK_BYTES, 4096, 1], help="chunk sizes to send"
    )
    parser.add_argument("--rounds", type=int, default=5, help="gradient rounds per piece size")
    args = parser.parse_args()
    dim = int(args.dim)
    coordinator = logging.getLogger("fedsaddle.coordinator")
    coordinator.addHandler(ENDED)
    coordinator.propagate = False
    print(f"chunk flood: one client of two cuts its answers (d = {dim}: {16 * dim} bytes each) into pieces")
    for piece in args.pieces:
        print(f"  {piece:>8} B pieces: {federation(dim, piece, args.rounds)}", flush=True)


ENDED = Ended()

if __name__ == "__main__":
    main()
