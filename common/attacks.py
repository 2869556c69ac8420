"""Byzantine clients, simulated: what a lying client sends instead of its honest answer.

For research and for tests. An attack makes chosen clients Byzantine on every
algorithm exchange (never on held-out evaluation). Two places apply one:

* the coordinator, for the config's `attack:` section (server/pool.py and
  server/batch.py, through `corrupt_round`): the round's answers are replaced, as
  they arrive, before any rule sees them, in every transport alike, so `simulate`,
  `local` and `coordinator` + clients give the same bits. There an attacker may be
  omniscient: it sees the honest clients' vectors of the round, as the papers
  assume;
* a real client process started with `fedsaddle client --attack KIND`
  (client/hosted.py, through `corrupt_own`): it lies about its own answers and
  knows nothing else, so only the attacks of one client's own vector are offered
  there (sign_flip, scale, gaussian, false_diverged).

The attacks:

* `sign_flip`: -v;
* `scale`: factor * v;
* `gaussian`: v + N(0, sigma^2 I), from a stream of (seed, client, round);
* `alie`, "a little is enough" (Baruch, Baruch, Goldberg, NeurIPS 2019): every Byzantine client sends
  mu - z sigma, with mu and sigma the coordinate-wise mean and standard deviation of the honest vectors
  (omniscient) or of the Byzantine clients' own true vectors (not omniscient: what colluders know), and
  z the paper's z_max for n answers of which f are Byzantine unless given;
* `ipm`, inner-product manipulation (Xie, Koyejo, Gupta, UAI 2020): every Byzantine client sends
  -epsilon * mu, mu as for ALIE;
* `false_diverged`: the client reports its results as non-finite (a run under the mean ends as diverged;
  under a robust rule the client is left out of that round, server/settlement.py);
* `label_flip`, label flipping (Tolpegin, Truex, Gursoy, Liu, ESORICS 2020), for problems on data files
  with binary labels: a Byzantine client trains on its rows with every label swapped (`flip_labels`), and
  answers honestly from them. The lie is in its data, not its answers: it is made where the client's data is
  loaded (common/worker.py's `ShardCache`), in `simulate` for the config's clients, and in a client process
  started with `--attack label_flip` for the clients it hosts. Held-out rows keep their labels.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np

from fedsaddle.common import seeding
from fedsaddle.common.numeric import Array, ordered_sum
from fedsaddle.common.problems.data import ClientData, DataError
from fedsaddle.common.tasks import Answer

AttackKind = Literal["sign_flip", "scale", "gaussian", "alie", "ipm", "false_diverged", "label_flip"]
ATTACK_KINDS: tuple[str, ...] = get_args(AttackKind)
# What a client can do knowing only its answer (or its own data)
OWN_KINDS = ("sign_flip", "scale", "gaussian", "false_diverged", "label_flip")


@dataclass(frozen=True)
class Attack:
    """One attack: its kind, the Byzantine clients, and its parameters."""

    kind: AttackKind
    clients: tuple[int, ...]
    factor: float = -1.0  # scale
    sigma: float = 1.0  # gaussian
    epsilon: float = 0.1  # ipm
    z: float | None = None  # alie; None: the paper's z_max
    omniscient: bool = False  # alie, ipm: statistics of the honest vectors rather than the colluders' own

    def __post_init__(self) -> None:
        if self.kind not in ATTACK_KINDS:
            raise ValueError(f"unknown attack {self.kind!r}; the attacks are {', '.join(ATTACK_KINDS)}")
        if not self.clients:
            raise ValueError("an attack needs at least one Byzantine client")


def alie_z(n: int, byzantine: int) -> float:
    """ALIE's z_max (Baruch et al. 2019): with s = floor(n/2 + 1) - f honest clients the attackers must win
    over, the z with Phi(z) = (n - s) / n (0 when that leaves nothing to gain)."""
    s = math.floor(n / 2 + 1) - byzantine
    p = (n - s) / n
    return statistics.NormalDist().inv_cdf(p) if 0 < p < 1 else 0.0


def corrupt_own(attack: Attack, vector: Array, client: int, seed: int, round_id: int) -> Array:
    """What Byzantine `client` sends instead of its true `vector` under an attack of its own vector."""
    if attack.kind == "sign_flip":
        return -vector
    if attack.kind == "scale":
        return attack.factor * vector
    if attack.kind == "gaussian":
        noise = seeding.rng(seed, seeding.ATTACK, client, round_id).normal(0.0, attack.sigma, vector.shape)
        return vector + noise
    if attack.kind in ("false_diverged", "label_flip"):
        return vector
    raise ValueError(f"attack {attack.kind!r} needs the other clients' vectors; a client alone cannot make it")


def corrupt_round(attack: Attack, replies: Sequence[Answer], seed: int, round_id: int) -> list[Answer]:
    """A round's answers with the Byzantine clients' replaced: one Answer per client, in index order.

    Replies that already say `diverged` are kept as they are (their vectors may not be finite)."""
    rows: list[tuple[int, Answer, int]] = []  # (client, its reply, its row there)
    for reply in replies:
        rows.extend((client, reply, k) for k, client in enumerate(reply.indices))
    rows.sort(key=lambda row: row[0])
    byzantine = set(attack.clients)
    honest = [reply.vectors[k] for client, reply, k in rows if client not in byzantine and not reply.diverged]
    own = [reply.vectors[k] for client, reply, k in rows if client in byzantine and not reply.diverged]
    seen = honest if attack.omniscient else own
    shared: Array | None = None  # the vector every colluder sends (alie, ipm)
    if attack.kind in ("alie", "ipm") and seen:
        stacked = np.stack(seen)
        mu = ordered_sum(stacked) / len(seen)
        if attack.kind == "ipm":
            shared = -attack.epsilon * mu
        else:
            sigma = np.sqrt(ordered_sum((stacked - mu) ** 2) / len(seen))
            z = attack.z if attack.z is not None else alie_z(len(rows), len(own))
            shared = mu - z * sigma
    out: list[Answer] = []
    for client, reply, k in rows:
        vector = reply.vectors[k : k + 1]
        objective = None if reply.objective is None else reply.objective[k : k + 1]
        diverged = reply.diverged
        if client in byzantine and not diverged:
            if attack.kind == "false_diverged":
                diverged = True
            elif shared is not None:
                vector = shared[None].copy()
            elif attack.kind in OWN_KINDS:
                vector = corrupt_own(attack, vector[0], client, seed, round_id)[None]
        out.append(Answer((client,), vector, objective, diverged))
    return out


def corrupt_answer(attack: Attack, answer: Answer, seed: int, round_id: int) -> Answer:
    """A client process's own answer as it lies about it (`fedsaddle client --attack`): each hosted client's
    row corrupted on its own (`corrupt_own`), or the whole answer reported as diverged."""
    if answer.diverged or attack.kind == "label_flip":  # a flipped client's answers come from its data
        return answer
    if attack.kind == "false_diverged":
        return answer._replace(diverged=True)
    rows = [corrupt_own(attack, answer.vectors[k], client, seed, round_id) for k, client in enumerate(answer.indices)]
    return answer._replace(vectors=np.stack(rows))


def label_flipped(attack: Attack | None) -> tuple[int, ...]:
    """The clients whose training labels `attack` swaps (none unless it is a `label_flip`)."""
    return attack.clients if attack is not None and attack.kind == "label_flip" else ()


def flip_labels(data: ClientData) -> ClientData:
    """`data` with its training labels swapped, for the `label_flip` attack: 1 - y for labels in {0, 1}, -y for
    labels in {-1, 1}. Its held-out rows are kept as they are. DataError for labels that are not binary."""
    values = np.unique(data.y)
    if set(values.tolist()) <= {0.0, 1.0}:
        flipped = 1.0 - data.y
    elif set(values.tolist()) <= {-1.0, 1.0}:
        flipped = -data.y
    else:
        shown = ", ".join(f"{v:g}" for v in values[:4]) + (", ..." if len(values) > 4 else "")
        raise DataError(f"{data.path}: label_flip needs binary labels, {{0, 1}} or {{-1, 1}}; y holds {shown}")
    return dataclasses.replace(data, y=flipped)


def parse_own_attack(text: str, clients: Sequence[int]) -> Attack:
    """`--attack KIND[:VALUE]` of a client process: sign_flip, scale:FACTOR, gaussian:SIGMA, false_diverged,
    label_flip."""
    kind, _, value = text.partition(":")
    if kind not in OWN_KINDS:
        raise ValueError(f"a client process can make the attacks {', '.join(OWN_KINDS)}, not {kind!r}")
    if value and kind not in ("scale", "gaussian"):
        raise ValueError(f"{kind} takes no value, got {value!r}")
    try:
        number = float(value) if value else None
    except ValueError:
        raise ValueError(f"{kind}'s value must be a number, got {value!r}") from None
    if number is not None and not math.isfinite(number):
        raise ValueError(f"{kind}'s value must be finite, got {value!r}")
    if kind == "gaussian" and number is not None and number <= 0:
        raise ValueError(f"gaussian's sigma must be > 0, got {value!r}")
    factor = number if kind == "scale" and number is not None else -1.0
    sigma = number if kind == "gaussian" and number is not None else 1.0
    return Attack(kind, tuple(clients), factor=factor, sigma=sigma)  # type: ignore[arg-type]
