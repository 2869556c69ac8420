"""The client runtime: dial the coordinator, open a Session stream, answer its tasks until goodbye."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
from dataclasses import dataclass, field

import grpc

from fedsaddle.client.session import ClientError, ClientSession
from fedsaddle.common import wire
from fedsaddle.common.worker import ShardCache
from fedsaddle.proto import fedsaddle_pb2_grpc as pb_grpc

log = logging.getLogger("fedsaddle.client")

# The most a coordinator may ask one chunk to be; the receive limit follows from it.
MAX_CHUNK_BYTES = 64 << 20

__all__ = ["ClientError", "ClientOptions", "run_client", "serve"]


@dataclass
class ClientOptions:
    coordinator: str
    indices: tuple[int, ...]
    name: str = ""
    connect_timeout_s: float = 60.0
    credentials: grpc.ChannelCredentials | None = None  # TLS (and client certificate)
    metadata: tuple[tuple[str, str], ...] = ()  # e.g. the bearer token
    server_name: str | None = None  # expected name in the coordinator's certificate
    data: dict[int, str] = field(default_factory=dict)  # each hosted client's own data file
    trusted: tuple[str, ...] = ()  # plugin problems ('module:Class') this process agrees to load


def _channel(options: ClientOptions) -> grpc.aio.Channel:
    channel_options: list[tuple[str, int | str]] = [*wire.grpc_options(MAX_CHUNK_BYTES)]
    if options.server_name:
        channel_options.append(("grpc.ssl_target_name_override", options.server_name))
    if options.credentials is not None:
        return grpc.aio.secure_channel(options.coordinator, options.credentials, options=channel_options)
    return grpc.aio.insecure_channel(options.coordinator, options=channel_options)


async def run_client(options: ClientOptions) -> None:
    """Serve one session; returns after a DONE goodbye, raises ClientError otherwise."""
    async with _channel(options) as channel:
        try:
            await asyncio.wait_for(channel.channel_ready(), options.connect_timeout_s)
        except TimeoutError:
            raise ClientError(
                f"cannot reach the coordinator at {options.coordinator} within {options.connect_timeout_s:g} s"
            ) from None
        stub = pb_grpc.CoordinatorStub(channel)  # type: ignore[no-untyped-call]
        session = ClientSession(options.indices, ShardCache(size=2, data=options.data, trusted=options.trusted))
        call = stub.Session(metadata=options.metadata or None)
        try:
            await call.write(session.hello(options.name or f"{socket.gethostname()}:{os.getpid()}"))
            async for instruction in call:
                for message in session.handle(instruction):
                    await call.write(message)
                if session.over:
                    await call.done_writing()
                    return
        except grpc.aio.AioRpcError as exc:
            raise ClientError(f"session with {options.coordinator} ended: {exc.code().name}: {exc.details()}") from None
        except wire.WireError as exc:
            raise ClientError(f"malformed instruction from the coordinator: {exc}") from None
        finally:
            call.cancel()
        raise ClientError(f"the coordinator at {options.coordinator} closed the session without a goodbye")


def serve(options: ClientOptions) -> None:
    """Run the session; SIGTERM ends it cleanly (the stream closes, the coordinator is told)."""

    async def session() -> None:
        task = asyncio.current_task()
        assert task is not None
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        try:
            await run_client(options)
        except asyncio.CancelledError:
            log.info("stopped by SIGTERM; session closed")

    asyncio.run(session())
