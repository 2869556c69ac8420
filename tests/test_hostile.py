"""Hostile peers, with real sockets: they meet limits, get short precise refusals, cannot flood the log,
and a session that stops reading its stream is dropped and named. Mixed credentials work as documented."""

from __future__ import annotations

import json
import logging
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import yaml
from conftest import CLIENT_ENV, config
from test_bad_answers import HandClient, raw_stream
from test_failures import Coordinator, write_config

from fedsaddle.launch import client_command, open_federation_warning
from fedsaddle.proto import fedsaddle_pb2 as pb
from fedsaddle.server.driver import RunStopped, run_algorithm
from fedsaddle.server.transport.grpc_pool import GrpcPool
from fedsaddle.server.transport.local_pool import LocalPool
from fedsaddle.server.transport.sessions import Limits


def held_stream(channel: grpc.Channel) -> tuple[queue.Queue[bytes | None], Any]:
    """A Session stream that says nothing (its requests stay open until None is put)."""
    requests: queue.Queue[bytes | None] = queue.Queue()
    return requests, raw_stream(channel)(iter(requests.get, None))


def first_status(responses: Any) -> tuple[grpc.StatusCode, str]:
    try:
        next(responses)
    except grpc.RpcError as error:
        return error.code(), error.details()  # type: ignore[attr-defined]
    raise AssertionError("the stream was not refused")


def test_streams_waiting_for_a_hello_are_bounded() -> None:
    with GrpcPool(2, "127.0.0.1:0", limits=Limits(max_pending_hellos=3, hello_timeout_s=30)) as pool:
        channels = [grpc.insecure_channel(pool.address) for _ in range(3)]
        held = [held_stream(channels[i]) for i in range(3)]
        time.sleep(0.5)  # the three reach the coordinator and wait there
        _, extra = held_stream(channels[0])
        code, details = first_status(extra)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "3 streams are waiting for a Hello already" in details
        for requests, _ in held:
            requests.put(None)  # they end without a Hello: the waiting room empties ...
        time.sleep(0.5)
        hand = HandClient(channels[1], [0])  # ... and a real client gets in
        assert hand.welcome().num_clients == 2
        hand.close()
        for channel in channels:
            channel.close()


def test_streams_from_one_peer_are_bounded() -> None:
    with GrpcPool(4, "127.0.0.1:0", limits=Limits(max_streams_per_peer=5, hello_timeout_s=30)) as pool:
        channels = [grpc.insecure_channel(pool.address) for _ in range(3)]
        hands = [HandClient(channels[i % 3], [i]) for i in range(2)]
        for hand in hands:
            hand.welcome()
        held = [held_stream(channels[i % 3]) for i in range(3)]
        time.sleep(0.5)
        _, sixth = held_stream(channels[1])
        code, details = first_status(sixth)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "5 streams from ipv4:127.0.0.1 already" in details
        for requests, _ in held:
            requests.put(None)
        for hand in hands:
            hand.close()
        for channel in channels:
            channel.close()


def test_silent_connections_are_closed_after_the_idle_timeout() -> None:
    with GrpcPool(1, "127.0.0.1:0", limits=Limits(idle_connection_s=1.0)) as pool:
        host, port = pool.address.rsplit(":", 1)
        # A socket timeout (10 s, ten idle timeouts) raises: only a close by the coordinator ends each loop.
        silent = [socket.create_connection((host, int(port)), timeout=10) for _ in range(5)]
        for connection in silent:
            while connection.recv(4096):  # the server's HTTP/2 settings, then ...
                pass
            connection.close()  # ... closed by the coordinator


def test_a_session_that_stops_reading_is_dropped_and_named() -> None:
    run = config(
        problem={"name": "paper_regression", "num_clients": 2, "dim": 20_000},
        algorithms=[{"name": "minibatch_md", "gamma": 0.01}],
        rounds=1000,
    )
    limits = Limits(max_undelivered_mib=1.0)
    with (
        GrpcPool(2, "127.0.0.1:0", limits=limits, round_timeout_s=30) as pool,
        grpc.insecure_channel(pool.address) as channel,
    ):
        honest = HandClient(channel, [0])
        stub_stream = raw_stream(channel)
        hostile_messages: queue.Queue[bytes | None] = queue.Queue()
        hostile = stub_stream(iter(hostile_messages.get, None))
        hello = pb.ClientMessage(hello=pb.Hello(protocol_version=2, client_indices=[1], client_name="never reads"))
        hostile_messages.put(hello.SerializeToString())
        next(hostile)  # the welcome
        honest.welcome()
        pool.wait_for_clients(10)
        outcome: dict[str, Any] = {}

        def run_it() -> None:
            try:
                outcome["result"] = run_algorithm(run.algorithms[0], run, pool)
            except RunStopped as stopped:
                outcome["result"] = stopped.result

        runner = threading.Thread(target=run_it, daemon=True)
        runner.start()
        run_id = pb.Instruction.FromString(next(hostile)).run.run_id  # the last thing this peer reads
        hostile_messages.put(pb.ClientMessage(ready=pb.Ready(run_id=run_id, dimension=40_000)).SerializeToString())
        # It says Ready for whatever run, then answers every round blindly without reading a task.
        spec = None
        deadline = time.monotonic() + 60
        while runner.is_alive() and time.monotonic() < deadline:
            try:
                task = honest.next(timeout=1)
            except queue.Empty:
                continue
            if not task.HasField("task"):
                continue
            good = honest.good(task.task)
            honest.send(pb.ClientMessage(answer=good))
            blind = pb.Answer(run_id=task.task.run_id, round_id=task.task.round_id, client_indices=[1])
            blind.payload = np.zeros(40_000).tobytes()
            blind.payload_length = 40_000
            hostile_messages.put(pb.ClientMessage(answer=blind).SerializeToString())
            spec = task
        runner.join(timeout=30)
        hostile_messages.put(None)
        honest.close()
        del spec
    result = outcome["result"]
    assert result.status == "stopped"
    assert "client 1 (never reads at ipv4:127.0.0.1:" in result.detail and "stopped reading its stream" in result.detail


def test_refusals_are_short_and_the_log_is_not_flooded(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="fedsaddle.coordinator")
    options = [("grpc.max_send_message_length", 8 << 20)]
    with GrpcPool(10, "127.0.0.1:0") as pool, grpc.insecure_channel(pool.address, options=options) as channel:
        stub = raw_stream(channel)
        name = "\x1b[31m" + "x" * (1 << 20)  # 1 MiB (a message may be a chunk and 1 MiB more), with an escape
        hello = pb.ClientMessage(hello=pb.Hello(protocol_version=2, client_indices=range(10_000), client_name=name))
        code, details = first_status(stub(iter([hello.SerializeToString()])))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert details == "10000 client indices given; the federation has 10"  # (counted, not read)
        assert len(details) < 200
        for _ in range(60):  # a flood of refusals
            first_status(stub(iter([b"\xff not a protobuf"])))
        time.sleep(0.2)
    lines = [r.getMessage() for r in caplog.records]
    assert all(len(line) < 1200 for line in lines), max(len(line) for line in lines)
    assert all("\x1b" not in line and "Traceback" not in line for line in lines)
    assert sum("refused a session" in line for line in lines) <= 20  # then counted, not written
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_an_open_federation_on_a_reachable_address_is_announced() -> None:
    run = config(algorithms=[{"name": "minibatch_md", "gamma": 0.1}])
    warning = open_federation_warning(run, "0.0.0.0:50051")
    assert warning is not None and "OPEN FEDERATION" in warning and "transport.credentials" in warning
    assert open_federation_warning(run, "127.0.0.1:50051") is None
    assert open_federation_warning(run, "[::1]:50051") is None
    guarded = run.model_copy(update={"transport": run.transport.model_copy(update={"credentials": "ids.yaml"})})
    assert open_federation_warning(guarded, "0.0.0.0:50051") is None


def test_the_readmes_two_site_example_runs_token_and_certificate_identities_together(
    tmp_path: Path, certs: Path
) -> None:
    new_token = subprocess.run(
        [sys.executable, "-m", "fedsaddle", "new-token", "--name", "site-a", "--clients", "0-4"],
        capture_output=True,
        text=True,
        check=True,
        env=CLIENT_ENV,
    ).stdout
    token = new_token.splitlines()[1]
    (tmp_path / "site-a.token").write_text(token + "\n")
    (tmp_path / "credentials.yaml").write_text(
        "identities:\n" + "\n".join(new_token.splitlines()[4:]) + "\n  site-b: {indices: [5, 6, 7, 8, 9]}\n"
    )
    run = {
        "problem": {"name": "paper_regression", "num_clients": 10, "dim": 5},
        "algorithms": [{"name": "scaffold_s", "gamma_local": 0.02}],
        "rounds": 21,
        "output": {"plot": False},
        "transport": {
            "tls": {
                "cert": str(certs / "coordinator.pem"),
                "key": str(certs / "coordinator.key"),
                "client_ca": str(certs / "ca.pem"),
            },
            "credentials": str(tmp_path / "credentials.yaml"),
            "token_listen": "127.0.0.1:0",  # any free port: the coordinator says which
        },
    }
    coordinator = Coordinator(write_config(tmp_path / "run.yaml", **run), tmp_path / "runs")
    listening = coordinator.wait_for(r"listening on (\S+); token identities on 127\.0\.0\.1:(\d+);", 30)
    address, token_port = listening.group(1), int(listening.group(2))
    ca = ["--ca", str(certs / "ca.pem")]
    site_a = ["--token-file", str(tmp_path / "site-a.token")]
    site_b = ["--cert", str(certs / "site-b.pem"), "--key", str(certs / "site-b.key")]
    # Asked before any client joins: the coordinator is then surely still up (a run of
    # 21 rounds can end before a health check started alongside the clients connects).
    health = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedsaddle",
            "health",
            "--address",
            address,
            *ca,
            "--cert",
            str(certs / "site-b.pem"),
            "--key",
            str(certs / "site-b.key"),
        ],
        capture_output=True,
        text=True,
        timeout=30,
        env=CLIENT_ENV,
    )
    clients = [
        subprocess.Popen(
            client_command(f"127.0.0.1:{token_port}", "0-4", *ca, *site_a, quiet=False),
            env=CLIENT_ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        ),
        subprocess.Popen(
            client_command(address, "5-9", *ca, *site_b, quiet=False),
            env=CLIENT_ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        ),
    ]
    code, log, codes = coordinator.finish_with(clients, timeout=120)  # type: ignore[arg-type]
    assert code == 0, log
    assert codes == [0, 0]
    assert "as 'site-a'" in log and "as 'site-b'" in log
    assert health.returncode == 0 and "SERVING" in health.stdout
    (run_dir,) = (tmp_path / "runs").iterdir()
    remote = yaml.safe_load((run_dir / "summary.json").read_text())["algorithms"][0]["z_sha256"]
    local_config = config(**{k: v for k, v in run.items() if k not in ("transport", "output")})
    assert remote == run_algorithm(local_config.algorithms[0], local_config, LocalPool()).z_sha256


def _idle(client: subprocess.Popen[str], received: list[pb.ClientMessage]) -> None:
    pass


READ = None  # in a hand coordinator's instructions: read the client's next message before going on


def hand_coordinator(
    instructions: list[pb.Instruction | bytes | None], end: tuple[grpc.StatusCode, str] | None = None
) -> tuple[grpc.Server, int, list[pb.ClientMessage]]:
    """A coordinator written by hand: after the Hello it sends `instructions` (bytes as they are; READ
    waits for the client's next message), then ends the stream with status `end` if given, else reads
    until the client closes its side. The messages it received come in the list it returns."""
    from concurrent import futures

    from fedsaddle.common import wire

    received: list[pb.ClientMessage] = []

    def session(requests: Any, context: grpc.ServicerContext) -> Any:
        received.append(pb.ClientMessage.FromString(next(requests)))
        for instruction in instructions:
            if instruction is READ:
                received.append(pb.ClientMessage.FromString(next(requests)))
            else:
                yield instruction if isinstance(instruction, bytes) else instruction.SerializeToString()
        if end is not None:
            context.abort(*end)
        for request in requests:
            received.append(pb.ClientMessage.FromString(request))

    handler = grpc.stream_stream_rpc_method_handler(session)
    service, method = wire.SESSION_METHOD.strip("/").split("/")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, {method: handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port, received


def client_against(
    instructions: list[pb.Instruction | bytes | None],
    meanwhile: Callable[[subprocess.Popen[str], list[pb.ClientMessage]], None] = _idle,
    quiet: bool = True,
    end: tuple[grpc.StatusCode, str] | None = None,
) -> tuple[int, str, list[pb.ClientMessage]]:
    """Run client 0 against a hand-written coordinator (`hand_coordinator`), doing `meanwhile` while it
    runs; its exit status, its output (warnings and errors, or everything if not `quiet`) and what it sent."""
    server, port, received = hand_coordinator(instructions, end)
    client = subprocess.Popen(
        client_command(f"127.0.0.1:{port}", "0", "--connect-timeout", "10", quiet=quiet),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=CLIENT_ENV,
    )
    try:
        meanwhile(client, received)
        output, _ = client.communicate(timeout=60)
    finally:
        client.kill()
        server.stop(0)
    return client.returncode, output, received


def test_a_welcome_with_a_chunk_size_out_of_range_ends_the_client_with_an_error_naming_it() -> None:
    welcome = pb.Instruction(welcome=pb.Welcome(federation_id="f", num_clients=1, chunk_bytes=0))
    status, output, received = client_against([welcome])
    assert received and list(received[0].hello.client_indices) == [0]
    assert status == 1
    assert "the coordinator's Welcome is malformed: chunk_bytes must be between 1024 (1 KiB)" in output
    assert "Traceback" not in output


def test_a_second_welcome_mid_run_ends_the_client_with_an_error_naming_it() -> None:
    # It was taken silently: its chunk size replaced the first's under the run.
    problem = {"name": "paper_regression", "num_clients": 1, "dim": 3, "s": 1.0}
    instructions = [
        pb.Instruction(welcome=pb.Welcome(federation_id="f", num_clients=1, chunk_bytes=1 << 20)),
        pb.Instruction(run=pb.RunSpec(run_id="r", problem_json=json.dumps(problem), synthetic_seed=0, dimension=6)),
        READ,  # the Ready, before what ends the client
        pb.Instruction(welcome=pb.Welcome(federation_id="g", num_clients=1, chunk_bytes=1024)),
    ]
    status, output, received = client_against(instructions)
    assert [m.WhichOneof("body") for m in received] == ["hello", "ready", "failure"]  # it says why it goes
    said = "the coordinator sent a second Welcome during run 'r'"
    assert (received[2].failure.run_id, received[2].failure.reason) == ("r", said)
    assert status == 1
    assert said in output
    assert "Traceback" not in output


def test_a_task_in_tiny_chunks_ends_the_client_with_an_error_naming_them() -> None:
    # A hostile coordinator would make the client pay a message's cost per byte; the client refuses.
    problem = {"name": "paper_regression", "num_clients": 1, "dim": 100, "s": 1.0}
    instructions = [
        pb.Instruction(welcome=pb.Welcome(federation_id="f", num_clients=1, chunk_bytes=1024)),
        pb.Instruction(run=pb.RunSpec(run_id="r", problem_json=json.dumps(problem), synthetic_seed=0, dimension=200)),
        READ,  # the Ready, before what ends the client
        pb.Instruction(task=pb.Task(run_id="r", round_id=1, kind=pb.GRADIENT, payload_length=200)),
        *(pb.Instruction(chunk=pb.Chunk(offset=i, data=b"\0")) for i in range(3)),
    ]
    status, output, received = client_against(instructions)
    assert [m.WhichOneof("body") for m in received] == ["hello", "ready", "failure"]  # it says why it goes
    assert received[1].ready.error == ""  # it had loaded its data: the chunks are what it refused
    assert (
        received[2].failure.round_id == 0
        and "a chunk of 1 byte before the payload's last" in received[2].failure.reason
    )
    assert status == 1
    assert (
        "malformed instruction from the coordinator: a chunk of 1 byte before the payload's last: "
        "every chunk but the last carries at least 1024 bytes" in output
    )
    assert "Traceback" not in output


def test_a_task_larger_than_the_clients_data_ends_the_client_with_an_error_naming_it() -> None:
    # The RunSpec claims 10^12 entries; the client's data gives 6, and its Ready says so. A coordinator
    # that goes on anyway cannot make the client allocate what it claimed.
    problem = {"name": "paper_regression", "num_clients": 1, "dim": 3, "s": 1.0}
    instructions = [
        pb.Instruction(welcome=pb.Welcome(federation_id="f", num_clients=1, chunk_bytes=1 << 20)),
        pb.Instruction(
            run=pb.RunSpec(run_id="r", problem_json=json.dumps(problem), synthetic_seed=0, dimension=10**12)
        ),
        READ,  # the Ready, before what ends the client
        pb.Instruction(task=pb.Task(run_id="r", round_id=1, kind=pb.GRADIENT, payload_length=10**12)),
    ]
    status, output, received = client_against(instructions)
    assert [m.WhichOneof("body") for m in received] == ["hello", "ready", "failure"]
    assert received[1].ready.dimension == 6 and not received[1].ready.error
    failure = received[2].failure
    assert (failure.run_id, failure.round_id) == ("r", 1) and "allows at most 12" in failure.reason
    assert status == 1
    assert f"the coordinator sent a task of {10**12} float64 entries; run 'r' allows at most 12" in output
    assert "Traceback" not in output


def test_an_inline_task_whose_payload_length_disagrees_ends_the_client_with_an_error_naming_both() -> None:
    problem = {"name": "paper_regression", "num_clients": 1, "dim": 3, "s": 1.0}
    task = pb.Task(run_id="r", round_id=1, kind=pb.GRADIENT, payload_length=7, payload=np.ones(6).tobytes())
    task.gradient.batch = 1
    instructions = [
        pb.Instruction(welcome=pb.Welcome(federation_id="f", num_clients=1, chunk_bytes=1 << 20)),
        pb.Instruction(run=pb.RunSpec(run_id="r", problem_json=json.dumps(problem), synthetic_seed=0, dimension=6)),
        READ,  # the Ready, before what ends the client
        pb.Instruction(task=task),
    ]
    status, output, received = client_against(instructions)
    assert [m.WhichOneof("body") for m in received] == ["hello", "ready", "failure"]  # no answer: it says why
    said = "a task declares payload_length 7 (56 bytes) but carries an inline payload of 48 bytes (6 float64 entries)"
    failure = received[2].failure
    assert (failure.run_id, failure.round_id, failure.reason) == ("r", 1, said)
    assert status == 1
    assert f"malformed instruction from the coordinator: {said}" in output
    assert "Traceback" not in output


def _peak_rss_until_exit(client: subprocess.Popen[str], peak: list[int]) -> None:
    """Sample the client's peak RSS (VmHWM, MiB) until it exits, for at most 60 s."""
    end = time.monotonic() + 60
    while client.poll() is None and time.monotonic() < end:
        try:
            status = Path(f"/proc/{client.pid}/status").read_text()
        except OSError:  # (it exited meanwhile)
            break
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                peak[0] = max(peak[0], int(line.split()[1]) >> 10)
        time.sleep(0.05)


@pytest.mark.parametrize(
    "first, refusal",
    [
        ("run", "the coordinator sent a RunSpec before its Welcome"),
        ("task", "task for run 'r' before its RunSpec: the coordinator sent it before its Welcome"),
    ],
)
def test_a_run_before_the_welcome_ends_the_client_with_an_error_naming_it(first: str, refusal: str) -> None:
    # Before the Welcome no chunk size is known: a client that served this RunSpec and Task cut its answer
    # into chunks of no size, for ever, its memory growing. It must refuse at once instead.
    problem = {"name": "paper_regression", "num_clients": 1, "dim": 3, "s": 1.0}
    run = pb.Instruction(run=pb.RunSpec(run_id="r", problem_json=json.dumps(problem), synthetic_seed=0, dimension=6))
    task = pb.Instruction(
        task=pb.Task(run_id="r", round_id=1, kind=pb.GRADIENT, payload_length=6, payload=np.ones(6).tobytes())
    )
    task.task.gradient.batch = 1
    peak = [0]
    instructions: list[pb.Instruction | bytes | None] = [run, task] if first == "run" else [task]
    status, output, received = client_against(instructions, lambda client, _: _peak_rss_until_exit(client, peak))
    assert [m.WhichOneof("body") for m in received] == ["hello", "failure"]  # no Ready, no answer: why it goes
    assert received[1].failure.reason == refusal
    assert status == 1
    assert refusal in output
    assert "Traceback" not in output
    assert 0 < peak[0] < 400  # MiB: an interpreter with numpy and gRPC, nothing that grew


def test_a_coordinators_words_reach_the_clients_log_bounded_and_escaped() -> None:
    # Ids and reasons are the coordinator's text: megabytes of it, or escape sequences that would
    # clear or retitle the operator's terminal, must not reach the log as they came.
    problem = {"name": "paper_regression", "num_clients": 1, "dim": 3, "s": 1.0}
    run_id = "r\x1b[31m" * 10_000
    instructions = [
        pb.Instruction(welcome=pb.Welcome(federation_id="\x1b[2J" + "f" * 100_000, num_clients=1, chunk_bytes=1 << 20)),
        pb.Instruction(run=pb.RunSpec(run_id=run_id, problem_json=json.dumps(problem), synthetic_seed=0, dimension=6)),
        READ,  # the Ready, before what ends the client
        pb.Instruction(rejected=pb.Rejected(round_id=1, code=pb.INVALID_ARGUMENT, details="\x1b[5m" * 200_000)),
        pb.Instruction(goodbye=pb.Goodbye(reason="\x1b]0;pwned\x07" + "b" * 100_000, outcome=pb.FAILED)),
    ]
    status, output, received = client_against(instructions, quiet=False)
    assert [m.WhichOneof("body") for m in received] == ["hello", "ready"]
    assert received[1].ready.run_id == run_id  # answered as sent: only what is shown is changed
    assert status == 1
    assert "\x1b" not in output and "\x07" not in output
    assert max(len(line) for line in output.splitlines()) < 2000
    assert "joined federation \\x1b[2Jffff" in output
    assert "run r\\x1b[31mr\\x1b[31m" in output and "ready (dimension 6" in output
    assert "answer refused: INVALID_ARGUMENT: \\x1b[5m\\x1b[5m" in output
    assert "the coordinator ended the run as failed: \\x1b]0;pwned\\x07bbbb" in output
    assert "more characters)" in output
    assert "Traceback" not in output


def test_a_coordinators_flood_of_refusals_costs_the_clients_log_a_few_lines() -> None:
    welcome = pb.Instruction(welcome=pb.Welcome(federation_id="f", num_clients=1, chunk_bytes=1 << 20))
    rejected = pb.Instruction(rejected=pb.Rejected(round_id=1, code=pb.INVALID_ARGUMENT, details="no"))
    goodbye = pb.Instruction(goodbye=pb.Goodbye(reason="that was all", outcome=pb.FAILED))
    status, output, _ = client_against([welcome, *[rejected] * 500, goodbye])
    assert status == 1
    assert output.count("answer refused: INVALID_ARGUMENT: no") == 20  # the first 20 of 500 in 10 s
    assert "the coordinator ended the run as failed: that was all" in output


def test_a_coordinators_refusal_reaches_the_clients_log_escaped() -> None:
    status, output, _ = client_against([], end=(grpc.StatusCode.INVALID_ARGUMENT, "no\x1b[2J\x1b]0;pwned\x07"))
    assert status == 1
    assert "\x1b" not in output and "\x07" not in output
    assert "refused this client: no\\x1b[2J\\x1b]0;pwned\\x07" in output


@pytest.mark.parametrize(
    "garbage",
    [b"\xff\xff\xff\xff\x0f\x01", b"\x22\x05\x08\x00\x12", b"\x22\x0b\x08" + b"\xff" * 10 + b"\x01"],
    ids=["not protobuf", "a truncated chunk", "a chunk offset of 11 varint bytes"],
)
def test_bytes_that_are_not_an_instruction_end_the_client_with_an_error_naming_them(garbage: bytes) -> None:
    welcome = pb.Instruction(welcome=pb.Welcome(federation_id="f", num_clients=1, chunk_bytes=1 << 20))
    status, output, received = client_against([welcome, garbage])
    assert [m.WhichOneof("body") for m in received] == ["hello"]
    assert status == 1
    assert f"malformed instruction from the coordinator: {len(garbage)} bytes that are not an Instruction" in output
    assert "Traceback" not in output and "NoneType" not in output


def test_a_pool_refuses_a_chunk_size_out_of_range_before_it_starts_anything() -> None:
    before = set(threading.enumerate())  # (earlier tests' threads may still be ending: only new ones count)
    with pytest.raises(ValueError, match=r"chunk_bytes must be between 1024 \(1 KiB\) and 67108864 \(64 MiB\), got 0$"):
        GrpcPool(2, "127.0.0.1:0", chunk_bytes=0)
    assert set(threading.enumerate()) - before == set()


def signal_while_computing(
    instructions: list[pb.Instruction | bytes | None], stop: signal.Signals, messages: int, settle_s: float
) -> list[str | None]:
    """Run client 0 against `instructions`; `settle_s` after it has sent `messages` messages, send it
    `stop`. It must stop at once (within client_against's wait), cleanly, saying so. The kinds it sent."""

    def stop_it(client: subprocess.Popen[str], received: list[pb.ClientMessage]) -> None:
        deadline = time.monotonic() + 30
        while len(received) < messages and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(settle_s)
        client.send_signal(stop)

    status, output, received = client_against(instructions, stop_it, quiet=False)
    assert status == 0, output
    assert f"stopped by {stop.name} while computing; session closed" in output, output
    assert "Traceback" not in output
    return [m.WhichOneof("body") for m in received]


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_a_client_in_the_middle_of_a_task_of_billions_of_steps(stop: signal.Signals) -> None:
    # A task computes in the client's event-loop thread; SIGTERM or one Ctrl-C must not wait for it to end.
    problem = {"name": "paper_regression", "num_clients": 1, "dim": 3, "s": 1.0}
    endless = pb.LocalSteps(steps=2**31, gamma_local=1e-9, decay=pb.CONSTANT, correction=pb.NONE)
    instructions = [
        pb.Instruction(welcome=pb.Welcome(federation_id="f", num_clients=1, chunk_bytes=1 << 20)),
        pb.Instruction(run=pb.RunSpec(run_id="r", problem_json=json.dumps(problem), synthetic_seed=0, dimension=6)),
        pb.Instruction(
            task=pb.Task(
                run_id="r", round_id=1, kind=pb.LOCAL_STEPS, local=endless, payload_length=6, payload=bytes(48)
            )
        ),
    ]

    # 1 s after its Ready it is well into the steps, which alone would take hours.
    assert signal_while_computing(instructions, stop, messages=2, settle_s=1.0) == ["hello", "ready"]


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_a_client_generating_the_data_of_a_billion_clients(stop: signal.Signals) -> None:
    # Every client of the paper's regression draws all n clients' b'_j to center its own: a coordinator
    # that announces a billion clients keeps the client computing for hours, before any Ready.
    n = 10**9
    problem = {"name": "paper_regression", "num_clients": n, "dim": 10, "s": 1.0}
    instructions = [
        pb.Instruction(welcome=pb.Welcome(federation_id="f", num_clients=n, chunk_bytes=1 << 20)),
        pb.Instruction(run=pb.RunSpec(run_id="r", problem_json=json.dumps(problem), synthetic_seed=0, dimension=20)),
    ]

    # 3 s after its Hello it is well into the data (it starts at once: no message says so).
    assert signal_while_computing(instructions, stop, messages=1, settle_s=3.0) == ["hello"]
