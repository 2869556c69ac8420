"""The centralized baseline of `fedsaddle experiment deep-auc`: LibAUC's own AUC-M loss and PESG optimizer.

    python -m fedsaddle.experiments.libauc_baseline --seeds 0,1,...,9 --tuning 0,1 --steps 200 \\
        --lrs 0.05,0.1,0.3 --out libauc.json

An independent implementation of the same objective: the network, its initialization and the data split
are the built-in `deep_auc` problem's for each seed (the same CNN, built by `DeepAuc.initial_point(seed)`;
the same training, validation and test images), but the loss is `libauc.losses.AUCMLoss` (margin 1, the
positive share p of the pooled training rows) and the optimizer `libauc.optimizers.PESG` (its SGD mode, with
its defaults otherwise: momentum, epoch decay and weight decay), on the pooled training rows of all
clients, minibatches of the experiment's size in a seeded shuffled order. The learning rate is chosen on
the grid `--lrs` by the mean validation AUC of the `--tuning` seeds, as the federated methods' steps are.

LibAUC pulls in heavy packages (transformers, torch-geometric, opencv), so it belongs in a Python of its
own, never in fedsaddle's environment:

    python -m venv /tmp/libauc-venv && /tmp/libauc-venv/bin/pip install torch libauc scikit-learn -e .

Writes a JSON list of points (method, step, seed, validation_auc, test_auc, wall_s, z_sha256).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from fedsaddle.common.numeric import sha256

from .deep_auc import BATCH, Point, choose, problem_spec


def _libauc() -> Any:
    try:
        import libauc.losses  # type: ignore[import-not-found]  # (its own Python only; no stubs)
        import libauc.optimizers  # type: ignore[import-not-found]
    except ImportError:
        sys.exit(
            f"the LibAUC baseline needs libauc, which {sys.executable} does not have: make a Python of its own "
            "(python -m venv /tmp/libauc-venv && /tmp/libauc-venv/bin/pip install torch libauc scikit-learn -e .) "
            "and pass it to fedsaddle experiment deep-auc --libauc-python /tmp/libauc-venv/bin/python"
        )
    return libauc


def train(seed: int, lr: float, steps: int, share: float | None = None) -> dict[str, Any]:
    """One centralized run: the seed's split (its positive training images thinned to `share`, if given) and
    initialization, `steps` PESG steps at `lr`."""
    import torch

    from fedsaddle.common.problems.deep_auc import DeepAuc, DeepAucSpec, split_digits
    from fedsaddle.common.problems.pytorch import flatten

    libauc = _libauc()
    # AUCMLoss warns of a minibatch without positives; with p given (imratio, auto=False) its loss is defined.
    warnings.filterwarnings("ignore", message="Input data has no positive sample")
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    problem = DeepAuc(DeepAucSpec(**problem_spec(seed, share=share)))
    datas = split_digits(problem.spec)
    X = torch.as_tensor(np.concatenate([d.X for d in datas]), dtype=torch.float32).reshape(-1, 1, 8, 8)
    t = torch.as_tensor(np.concatenate([d.y for d in datas]), dtype=torch.float32)
    model, _ = problem.unflatten(problem.initial_point(seed))  # the network the federated runs start from
    net = model.net
    p = float(t.mean())
    torch.manual_seed(seed)
    loss_fn = libauc.losses.AUCMLoss(margin=problem.spec.margin, imratio=p, device="cpu")
    optimizer = libauc.optimizers.PESG(
        net.parameters(), loss_fn=loss_fn, lr=lr, mode="sgd", device="cpu", verbose=False
    )
    rng = np.random.default_rng([seed, 77])
    order: list[int] = []
    started = time.perf_counter()
    finite = True
    for _ in range(steps):
        if len(order) < BATCH:
            order.extend(rng.permutation(len(t)).tolist())
        rows = torch.as_tensor(order[:BATCH])
        del order[:BATCH]
        score = torch.sigmoid(net(X[rows]))
        loss = loss_fn(score, t[rows], auto=False)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if not math.isfinite(float(loss.detach())):
            finite = False
            break
    wall = time.perf_counter() - started
    with torch.no_grad():  # LibAUC's a and b into the problem's model, whose parameters are z's min player in order
        model.a.copy_(loss_fn.a)
        model.b.copy_(loss_fn.b)
    z = flatten(list(model.parameters()), [loss_fn.alpha])
    ok = finite and bool(np.isfinite(z).all())
    return {
        "method": "libauc",
        "step": lr,
        "seed": seed,
        "validation_auc": problem.pooled_validation_auc(z) if ok else math.nan,
        "test_auc": problem.pooled_test_auc(z) if ok else math.nan,
        "wall_s": wall,
        "z_sha256": sha256(z),
    }


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=_ints, required=True)
    parser.add_argument("--tuning", type=_ints, required=True, help="the seeds whose validation AUC picks lr")
    parser.add_argument("--steps", type=int, required=True, help="PESG steps per run")
    parser.add_argument("--lrs", type=lambda s: [float(v) for v in s.split(",")], required=True)
    parser.add_argument("--out", required=True, help="the JSON file to write")
    parser.add_argument(
        "--positive-share", type=float, default=None, help="thin the positive training images to this share"
    )
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps: must be at least 1, got {args.steps}")
    if not args.lrs or min(args.lrs) <= 0:
        parser.error(f"--lrs: every learning rate must be positive, got {args.lrs}")
    if args.positive_share is not None and not 0 < args.positive_share < 1:
        parser.error(f"--positive-share: must be between 0 and 1, got {args.positive_share:g}")
    _libauc()
    points = [train(seed, lr, args.steps, args.positive_share) for lr in args.lrs for seed in args.tuning]
    chosen = choose([Point(**p) for p in points], "libauc", args.lrs, args.tuning)  # the federated methods' rule
    points += [train(seed, chosen, args.steps, args.positive_share) for seed in args.seeds if seed not in args.tuning]
    with open(args.out, "w") as f:
        json.dump(points, f, allow_nan=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
