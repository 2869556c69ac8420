"""The floor fedsaddle's rounds are measured against: a bare grpc.aio fan-out of raw bytes.

A grpc.aio server; one process per client dials out and holds one bidirectional
stream of raw bytes (no protobuf, no numpy); each round the server writes P
bytes to every stream and waits for P bytes back from each. Nothing is
computed: this is what moving the same bytes through gRPC in Python costs.
Its event loops are asyncio's own, as a bare grpc.aio program's are; `--loop
uvloop` runs server and clients on uvloop's, as fedsaddle's run where it is
installed (common/eventloop.py).

    python bench/anchor.py --clients 10 --bytes 160 16000000 --rounds 100
    python bench/anchor.py --loop uvloop
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time

import grpc

METHOD = "/anchor.Anchor/Exchange"
OPTIONS = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
LOOPS = ("asyncio", "uvloop")


def new_loop(kind: str) -> asyncio.AbstractEventLoop:
    if kind == "uvloop":
        import uvloop

        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def _same(data: bytes) -> bytes:
    return data


async def client(address: str) -> None:
    """Echo every message until the server's empty goodbye."""
    async with grpc.aio.insecure_channel(address, options=OPTIONS) as channel:
        call = channel.stream_stream(METHOD, request_serializer=_same, response_deserializer=_same)()
        await call.write(b"hello")
        async for message in call:
            if not message:
                break
            await call.write(message)
        await call.done_writing()


class Anchor:
    """The server side: a stream per client process, and a round that writes to all and waits for all."""

    def __init__(self, clients: int) -> None:
        self.clients = clients
        self.streams: list[tuple[asyncio.Queue[bytes], asyncio.Queue[bytes]]] = []
        self.ready = asyncio.Event()

    async def exchange(self, requests: object, context: object) -> object:
        outbox: asyncio.Queue[bytes] = asyncio.Queue()
        inbox: asyncio.Queue[bytes] = asyncio.Queue()
        incoming = requests.__aiter__()  # type: ignore[attr-defined]
        await incoming.__anext__()
        self.streams.append((outbox, inbox))
        if len(self.streams) == self.clients:
            self.ready.set()

        async def read() -> None:
            async for message in incoming:
                inbox.put_nowait(message)

        reader = asyncio.ensure_future(read())
        try:
            while True:
                message = await outbox.get()
                await context.write(message)  # type: ignore[attr-defined]
                if not message:
                    return None
        finally:
            reader.cancel()

    async def round(self, payload: bytes) -> float:
        started = time.perf_counter()
        for outbox, _ in self.streams:
            outbox.put_nowait(payload)
        for _, inbox in self.streams:
            await inbox.get()
        return time.perf_counter() - started


class Floor:
    """The anchor's server with its client processes, driven in blocks of rounds from synchronous code.

    It owns an event loop that runs only while a block runs, so a benchmark can
    alternate blocks of the anchor with blocks of fedsaddle in one process and
    let both see the same machine.
    """

    def __init__(self, clients: int, loop: str = "asyncio") -> None:
        self.kind = loop
        self.loop = new_loop(loop)
        self.anchor = Anchor(clients)
        self.processes: list[subprocess.Popen[bytes]] = []
        self.server: grpc.aio.Server | None = None
        self.loop.run_until_complete(self._start(clients))

    async def _start(self, clients: int) -> None:
        self.server = grpc.aio.server(options=OPTIONS)
        handler = grpc.stream_stream_rpc_method_handler(
            self.anchor.exchange, request_deserializer=_same, response_serializer=_same
        )
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("anchor.Anchor", {"Exchange": handler}),)
        )
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.processes = [
            subprocess.Popen([sys.executable, __file__, "client", f"127.0.0.1:{port}", self.kind])
            for _ in range(clients)
        ]
        await asyncio.wait_for(self.anchor.ready.wait(), 120)

    def rounds(self, size: int, count: int) -> list[float]:
        """Times of `count` rounds of `size` bytes each way per client."""
        payload = b"\x01" * size

        async def block() -> list[float]:
            return [await self.anchor.round(payload) for _ in range(count)]

        return self.loop.run_until_complete(block())

    def close(self) -> None:
        self.loop.run_until_complete(self._goodbye(10))
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        if self.server is not None:
            self.loop.run_until_complete(self.server.stop(1))
        self.loop.close()

    async def _goodbye(self, timeout_s: float) -> None:
        """Sends every client the empty goodbye and waits up to `timeout_s` for them to exit.

        The loop must run while they do: the goodbyes are written by the streams' handlers.
        """
        for outbox, _ in self.anchor.streams:
            outbox.put_nowait(b"")
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in self.processes) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)


def measure(
    clients: int, sizes: list[int], rounds: int, warmup: int = 3, loop: str = "asyncio"
) -> dict[int, list[float]]:
    """Round times for each payload size, with `clients` client processes."""
    floor = Floor(clients, loop)
    try:
        times: dict[int, list[float]] = {}
        for size in sizes:
            floor.rounds(size, warmup)
            times[size] = floor.rounds(size, rounds)
        return times
    finally:
        floor.close()


def main() -> None:
    if len(sys.argv) > 3 and sys.argv[1] == "client":
        with asyncio.Runner(loop_factory=lambda: new_loop(sys.argv[3])) as runner:
            runner.run(client(sys.argv[2]))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--bytes", type=int, nargs="+", default=[160, 16_000_000])
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--loop", choices=LOOPS, default="asyncio", help="the event loops of server and clients")
    args = parser.parse_args()
    for size, times in measure(args.clients, args.bytes, args.rounds, loop=args.loop).items():
        print(f"{size:>10} bytes: median {1e3 * statistics.median(times):.3f} ms")


if __name__ == "__main__":
    main()
