"""Abuse: hostile peers against a coordinator that serves a live federation.

This process is the coordinator of 10 client processes running rounds without
pause. Meanwhile other processes on 127.0.0.1 attack it:

  streams  --streams Session streams that never send a Hello (held open)
  bare     --connections TCP connections that never speak
  names    --names Hellos whose client name is 1 MiB (a message may be a chunk and 1 MiB more)

Prints the coordinator's RSS before (its clean peak), during and after the
attacks, whether the health service answered every check, what the federation's
rounds cost meanwhile, and how the abusers were answered. All traffic stays on
loopback and every loop is bounded.

    python bench/abuse.py [--streams 8000] [--connections 2000] [--names 20]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import socket
import statistics
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc
from procfs import rss_mib  # bench/procfs.py

from fedsaddle.common import wire
from fedsaddle.common.problems import PaperRegressionSpec
from fedsaddle.launch import reap, start_clients
from fedsaddle.proto import fedsaddle_pb2 as pb
from fedsaddle.server.pool import RunInfo
from fedsaddle.server.transport.grpc_pool import GrpcPool
from fedsaddle.server.transport.sessions import Limits

SESSION = wire.SESSION_METHOD


# -- the attackers (each in its own process) ------------------------------------------------


async def hold_streams(address: str, count: int, seconds: float) -> None:
    """Open `count` Session streams that never say Hello; report how they ended."""
    outcomes: collections.Counter[str] = collections.Counter()
    channels = [grpc.aio.insecure_channel(address) for _ in range(max(1, count // 8))]

    async def one(channel: grpc.aio.Channel) -> None:
        call = channel.stream_stream(SESSION, request_serializer=lambda b: b, response_deserializer=lambda b: b)()
        try:
            await asyncio.wait_for(call.read(), seconds)
            outcomes["answered"] += 1
        except grpc.aio.AioRpcError as error:
            outcomes[error.code().name] += 1
        except TimeoutError:
            outcomes["still open"] += 1
        finally:
            call.cancel()

    await asyncio.gather(*(one(channels[i % len(channels)]) for i in range(count)))
    for channel in channels:
        await channel.close()
    print(f"streams: {dict(outcomes)}", flush=True)


def hold_connections(address: str, count: int, seconds: float) -> None:
    host, port = address.rsplit(":", 1)
    held = []
    for _ in range(count):
        try:
            held.append(socket.create_connection((host, int(port)), timeout=5))
        except OSError:
            break
    time.sleep(seconds)
    closed = 0
    for connection in held:
        connection.setblocking(False)
        try:
            closed += connection.recv(1) == b""  # the coordinator closed it (idle)
        except BlockingIOError:
            pass
        except OSError:
            closed += 1
        connection.close()
    print(f"connections: {len(held)} opened, {closed} closed by the coordinator within {seconds:g} s", flush=True)


def big_names(address: str, count: int) -> None:
    name = "x" * (1 << 20)
    codes: collections.Counter[str] = collections.Counter()
    with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 8 << 20)]) as channel:
        stub = channel.stream_stream(SESSION, request_serializer=lambda m: m.SerializeToString())
        for _ in range(count):
            hello = pb.ClientMessage(hello=pb.Hello(protocol_version=2, client_indices=[99999], client_name=name))
            try:
                list(stub(iter([hello])))
            except grpc.RpcError as error:
                codes[error.code().name] += 1  # type: ignore[attr-defined]
    print(f"1 MiB names: {dict(codes)}", flush=True)


def attacker(kind: str, address: str, count: int, seconds: float) -> None:
    if kind == "streams":
        asyncio.run(hold_streams(address, count, seconds))
    elif kind == "bare":
        hold_connections(address, count, seconds)
    else:
        big_names(address, count)


# -- the coordinator ------------------------------------------------------------------------


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "attack":
        attacker(sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5]))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=8000)
    parser.add_argument("--connections", type=int, default=2000)
    parser.add_argument("--names", type=int, default=20)
    parser.add_argument("--hold", type=float, default=40.0, help="seconds the attackers hold what they opened")
    args = parser.parse_args()
    limits = Limits()  # the defaults
    pool = GrpcPool(10, "127.0.0.1:0", round_timeout_s=120, limits=limits)
    clients = start_clients(pool.address, [str(i) for i in range(10)], capture=False)
    stop = threading.Event()
    latencies: list[tuple[float, float]] = []

    def rounds() -> None:
        pool.start_run(RunInfo("abuse", PaperRegressionSpec(num_clients=10, dim=1000, s=1.0), 0))
        z = np.ones(2000)
        while not stop.is_set():
            started = time.perf_counter()
            pool.gradients(z)
            latencies.append((started, time.perf_counter() - started))

    health_failures = 0
    health_checks = 0
    try:
        pool.wait_for_clients(120)
        worker = threading.Thread(target=rounds, daemon=True)
        worker.start()
        time.sleep(3)
        clean = max(rss_mib() for _ in range(20) if not time.sleep(0.1))
        print(f"clean: RSS {clean:.1f} MiB while the federation runs")
        attack_start = time.perf_counter()
        command = [sys.executable, __file__, "attack"]
        during: list[float] = []
        peaks: dict[str, float] = {}
        for kind, count, hold in (
            ("streams", args.streams, args.hold),
            ("bare", args.connections, args.hold),
            ("names", args.names, 0.0),
        ):  # one attack after the other, so that each limit is met on its own
            attack = subprocess.Popen([*command, kind, pool.address, str(count), str(hold)])
            with grpc.insecure_channel(pool.address) as channel:
                health = health_pb2_grpc.HealthStub(channel)
                while attack.poll() is None:
                    during.append(rss_mib())
                    peaks[kind] = max(peaks.get(kind, 0.0), during[-1])
                    health_checks += 1
                    try:
                        health.Check(health_pb2.HealthCheckRequest(), timeout=5)
                    except grpc.RpcError:
                        health_failures += 1
                    time.sleep(0.5)
        attack_end = time.perf_counter()
        time.sleep(limits.idle_connection_s + 20)  # what the attackers left is reaped, freed memory returned
        after = [rss_mib() for _ in range(10) if not time.sleep(0.2)]
        stop.set()
        worker.join(timeout=30)
    finally:
        pool.close()
        reap(clients)
    base = [d for s, d in latencies if s < attack_start]
    under = [d for s, d in latencies if attack_start <= s <= attack_end]
    print("RSS peak during each attack: " + ", ".join(f"{k} {v:.1f} MiB" for k, v in peaks.items()))
    print(f"after the attackers left: RSS {min(after):.1f}-{max(after):.1f} MiB")
    print(f"after - clean peak: {max(after) - clean:+.1f} MiB")
    print(f"health checks answered: {health_checks - health_failures}/{health_checks}")
    print(
        f"rounds (d = 1000, 10 processes): median {1e3 * statistics.median(base):.2f} ms before, "
        f"{1e3 * statistics.median(under):.2f} ms under attack ({len(under)} rounds)"
    )


if __name__ == "__main__":
    main()
