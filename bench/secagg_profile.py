"""Where a secure round's time goes: each step of secure aggregation timed alone, then the phases of real rounds.

1. The work of each step, in-process, for one client and for the coordinator of a
   federation of n clients (min of several repeats: what the step costs, not what the
   machine was doing), per gradient round:
   client: PRG expansion of its masks, seeds/Shamir split/sealed shares, fixed-point
   encoding onto the masks, building its masked answer; parsing an unmask request,
   opening its shares, building the reply;
   coordinator: parsing the n masked answers (the rows kept as they came), summing
   the rows (one pass, when the round closes), building the n unmask requests,
   parsing the n replies, Shamir reconstruction of the n self-mask seeds, PRG
   expansion of their masks, reading the mean from the sum (decoding).
2. Gradient rounds over gRPC, one client process per client: the median time of each
   phase of a secure round beside a plain round in the same run (alternating in blocks):
   the first trip (the task out, the masked answers back, the clients' masking in it),
   the unmask trip (requests out, replies back: the second trip's messaging and the
   waiting on the clients), the unmasking and the decoding on the coordinator.

    python bench/secagg_profile.py                      # d = 10 and 1e6, all pairs and k = 4
    python bench/secagg_profile.py --dims 10 --rounds 400
"""

from __future__ import annotations

import argparse
import statistics
import time
import timeit
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
from round_latency import time_rounds
from secagg import graph_name, run_info

from fedsaddle.common import wire
from fedsaddle.common.memory import tune_malloc
from fedsaddle.common.secagg import SecAggSettings, crypto, graph, messages, shamir
from fedsaddle.common.secagg.party import Party, self_mask_key
from fedsaddle.common.secagg.rows import MaskedAnswer, read_sum, row_pieces
from fedsaddle.common.secagg.settings import default_bound, round_threshold
from fedsaddle.common.tasks import GradientTask
from fedsaddle.launch import reap, start_clients
from fedsaddle.proto import fedsaddle_pb2 as pb
from fedsaddle.server import secure
from fedsaddle.server.secure import MaskedRound
from fedsaddle.server.transport.grpc_pool import GrpcPool

CHUNK_BYTES = wire.DEFAULT_CHUNK_BYTES
PHASES = (
    "plain: the round trip",
    "secure: first trip (task, masked answers)",
    "secure: unmask trip (requests, replies)",
    "secure: unmasking (Shamir, self masks)",
    "secure: read the mean (decode)",
)


def best(step: Callable[[], object], repeats: int) -> float:
    """Seconds of one call: the least of `repeats` timings."""
    return min(timeit.repeat(step, number=1, repeat=repeats))


def steps(n: int, d: int, k: int, repeats: int) -> list[tuple[str, float]]:
    """The work of each step of one secure gradient round (client 0's, and the coordinator's for n clients)."""
    length = 2 * d + 1
    settings = SecAggSettings(0, 40, default_bound(n), k)
    parties = {i: Party(i, "profile", settings) for i in range(n)}
    keys = {i: party.public_key for i, party in parties.items()}
    for party in parties.values():
        party.agree(0, keys)
    clients = tuple(range(n))
    vector = np.random.default_rng(0).normal(size=2 * d)
    round_ids = iter(range(1, 10**9))
    me = parties[0]
    figures: list[tuple[str, float]] = []

    # The client: its masks made ahead (prepare: seeds, split, seals, and the PRG), then the task's work.
    def prepare_without_prg() -> None:
        me.prepare(next(round_ids), 0, clients, 0)  # a row of no entries: everything but the expansion

    figures.append(("client: seeds, Shamir split, sealed shares", best(prepare_without_prg, repeats)))
    seeds = [(bytes([j]) * 32, 1) for j in range(len(graph.neighbours_of(0, clients, k)) + 1)]  # self + neighbours
    pad = np.empty(length, dtype=np.uint64)
    figures.append(
        ("client: PRG expansion of its masks", best(lambda: crypto.add_masks(pad, seeds, fresh=True), repeats))
    )
    pieces = row_pieces(vector, 1.0)

    def mask() -> Any:
        round_id = next(round_ids)
        me.prepare(round_id, 0, clients, length)
        start = time.perf_counter()
        row = me.mask(round_id, 0, clients, pieces)
        return time.perf_counter() - start, row

    figures.append(("client: encode onto the masks (mod 2^64 adds)", min(mask()[0] for _ in range(repeats))))
    _, row = mask()
    answer = MaskedAnswer((row,))
    figures.append(
        (
            "client: build the masked answer",
            best(lambda: list(messages.masked_answer("profile", 1, answer, 1 << 20)), repeats),
        )
    )

    # One whole round among all parties, for the coordinator's steps and the client's unmasking.
    # A whole round among all parties, for the coordinator's steps and the client's unmasking. The answers
    # are read as the coordinator's transport reads them: a header, then chunks assembled into the payload.
    round_id = next(round_ids)
    rows = [parties[i].mask(round_id, 0, clients, row_pieces(vector, 1.0)) for i in clients]
    answers = [list(messages.masked_answer("profile", round_id, MaskedAnswer((r,)), CHUNK_BYTES)) for r in rows]
    threshold = round_threshold(settings, n)

    def parse_and_add(masked: MaskedRound) -> MaskedRound:
        for first, *chunks in answers:
            header = pb.ClientMessage.FromString(first).answer
            payload: bytes | memoryview = header.payload
            if chunks:
                assembler = wire.Assembler(8 * header.payload_length, min_piece=wire.min_piece(CHUNK_BYTES))
                for chunk in chunks:
                    raw = wire.read_chunk(chunk)
                    assert raw is not None
                    assembler.add(raw)
                payload = assembler.payload()
            for masked_row in messages.as_masked(messages.read_masked_answer(header, payload, length)).rows:
                masked.add(masked_row)
        return masked

    def new_round() -> MaskedRound:
        return MaskedRound("profile", round_id, 0, clients, threshold, length, k)

    figures.append(
        (
            f"coordinator: parse {n} masked answers, add their rows up (as they come)",
            best(lambda: parse_and_add(new_round()), repeats),
        )
    )
    masked = parse_and_add(new_round())
    requests = masked.close()
    figures.append(
        (
            f"coordinator: build {n} unmask requests",
            best(lambda: messages.unmask_requests("profile", requests), repeats),
        )
    )
    request_bytes = messages.unmask_requests("profile", requests)[0]
    figures.append(
        (
            "client: parse the unmask request",
            best(lambda: messages.read_unmask_request(pb.Instruction.FromString(request_bytes).unmask), repeats),
        )
    )

    replies = {j: parties[j].unmask(q) for j, q in requests.items()}
    reply_bytes = {j: messages.unmask_reply("profile", round_id, j, r) for j, r in replies.items()}
    figures.append(
        (
            "client: build the unmask reply",
            best(lambda: messages.unmask_reply("profile", round_id, 0, replies[0]), repeats),
        )
    )
    figures.append(
        (
            f"coordinator: parse {n} unmask replies",
            best(
                lambda: [
                    messages.read_unmask_reply(pb.ClientMessage.FromString(b).unmasked) for b in reply_bytes.values()
                ],
                repeats,
            ),
        )
    )

    # Shamir reconstruction and the self masks, as MaskedRound.finish does them.
    def reconstruct() -> list[bytes]:
        coefficients: dict[tuple[int, ...], dict[int, int]] = {}
        self_seeds = []
        for i in clients:
            around = graph.neighbours_of(i, clients, k)
            needed = (
                round_threshold(settings, n) if len(around) == n - 1 else graph.neighbourhood_threshold(len(around) + 1)
            )
            holders = tuple(sorted((*around, i))[:needed])
            if holders not in coefficients:
                coefficients[holders] = shamir.coefficients(holders)
            values = {j: shamir.from_bytes(replies[j].b_shares[i]) for j in holders}
            secret = shamir.combine_with(coefficients[holders], values)
            self_seeds.append(self_mask_key(secret.to_bytes(16, "little"), "profile", round_id, 0))
        return self_seeds

    figures.append((f"coordinator: Shamir reconstruction of {n} self-mask seeds", best(reconstruct, repeats)))
    self_seeds = [(seed, -1) for seed in reconstruct()]
    total = masked.total.copy()
    figures.append(
        (f"coordinator: PRG expansion of {n} self masks", best(lambda: crypto.add_masks(total, self_seeds), repeats))
    )
    task = GradientTask(np.zeros(2 * d))
    figures.append(("coordinator: read the mean (decode)", best(lambda: read_sum(total, task, 2 * d, 40), repeats)))

    def unmask_once() -> float:  # (a round can be unmasked once: a fresh round of 1-entry rows each time)
        small = next(round_ids)
        masked_small = MaskedRound("profile", small, 0, clients, round_threshold(settings, n), 1, k)
        for i in clients:
            masked_small.add(parties[i].mask(small, 0, clients, np.zeros(1)))
        request = masked_small.close()[0]
        start = time.perf_counter()
        parties[0].unmask(request)
        return time.perf_counter() - start

    figures.append(("client: check the unmask request, open its shares", min(unmask_once() for _ in range(repeats))))
    return figures


def phases(n: int, dims: list[int], rounds: int, blocks: int, graphs: list[int]) -> None:
    """Median time of each phase of secure rounds over gRPC, beside plain rounds in the same run."""
    spent: dict[str, list[float]] = defaultdict(list)
    pool = GrpcPool(n, "127.0.0.1:0", round_timeout_s=600)

    @contextmanager
    def timing(name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            spent[name].append(time.perf_counter() - start)

    def timed(owner: Any, attribute: str, name: str) -> None:
        original = getattr(owner, attribute)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with timing(name):
                return original(*args, **kwargs)

        setattr(owner, attribute, wrapper)

    for (owner, attribute), name in zip(
        (
            (pool, "_exchange"),
            (pool, "_exchange_masked"),
            (pool, "_unmask"),
            (MaskedRound, "finish"),
            (secure, "read_sum"),
        ),
        PHASES,
        strict=True,
    ):
        timed(owner, attribute, name)
    processes = start_clients(pool.address, [str(i) for i in range(n)], capture=False)
    try:
        pool.wait_for_clients(120)
        for d in dims:
            for k in graphs:
                spent.clear()
                totals: dict[str, list[float]] = defaultdict(list)
                z = np.ones(2 * d)
                per_block = max(1, (rounds if d < 100_000 else max(4, rounds // 20)) // blocks)
                for block in range(blocks + 1):
                    for kind in ("plain", "secure"):
                        pool.start_run(run_info(f"profile-{d}-{k}-{kind}-{block}", n, d, kind == "secure", k))
                        time_rounds(pool, z, 2)
                        marks = {name: len(values) for name, values in spent.items()}
                        times = time_rounds(pool, z, per_block)
                        if not block:  # (warm-up: not counted)
                            for name, count in marks.items():
                                del spent[name][count:]
                            continue
                        totals[kind] += times
                plain, secure_round = statistics.median(totals["plain"]), statistics.median(totals["secure"])
                print(f"\n2. d = {d}, {graph_name(k)}, {n} client processes: ms per round, median")
                print(f"   {'plain round':44} {1e3 * plain:9.2f}")
                print(f"   {'secure round':44} {1e3 * secure_round:9.2f}   ratio {secure_round / plain:.2f}")
                for name in PHASES:
                    if spent[name]:
                        print(f"   {name:44} {1e3 * statistics.median(spent[name]):9.2f}")
    finally:
        pool.close()
        reap(processes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dims", type=float, nargs="+", default=[10, 1e6], help="d: x and y each in R^d")
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--graphs", type=int, nargs="+", default=[0, 4], help="0 all pairs, k neighbours")
    parser.add_argument("--rounds", type=int, default=200, help="timed rounds per kind at d < 1e5 (a 20th above)")
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=20, help="timings per step in part 1 (the least is shown)")
    parser.add_argument("--skip-steps", action="store_true")
    parser.add_argument("--skip-phases", action="store_true")
    args = parser.parse_args()
    dims = [int(v) for v in args.dims]
    tune_malloc()  # large buffers reused from the heaps, as the coordinator and the clients have them
    if not args.skip_steps:
        for d in dims:
            repeats = args.repeats if d < 100_000 else 5
            for k in args.graphs:
                print(f"\n1. d = {d}, {graph_name(k)}, n = {args.clients}: ms per round, least of {repeats}")
                for name, seconds in steps(args.clients, d, k, repeats):
                    print(f"   {name:60} {1e3 * seconds:9.3f}")
    if not args.skip_phases:
        phases(args.clients, dims, args.rounds, args.blocks, args.graphs)


if __name__ == "__main__":
    main()
