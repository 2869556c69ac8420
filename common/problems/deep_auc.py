"""Federated deep AUC maximization: the AUC-M min-max margin loss with a small CNN, on handwritten digits.

The objective is LibAUC's AUC-M square-margin loss (Yuan, Yan, Sonka, Yang, "Large-scale Robust Deep AUC
Maximization", ICCV 2021; its federated form is CODASCA, Yuan et al., ICML 2021). With a network h_w, the
score s = sigmoid(h_w(u)) in [0, 1], p the share of positive rows over the federation, and m the margin:

    F(w, a, b, alpha; u, t) = (1-p) (s - a)^2 [t = 1] + p (s - b)^2 [t = 0]
                              + 2 alpha (p (1-p) m + p s [t = 0] - (1-p) s [t = 1]) - p (1-p) alpha^2
    f_i = mean of F over client i's rows + lam/2 ||w||^2,

minimized over x = (w, a, b) and maximized over y = alpha >= 0 (a box block). f is nonconvex in w and
concave (strongly) in alpha: the paper's strongly-convex-strongly-concave rates do not apply
(docs/how-to/pytorch-problems.md says what is known).

The data is scikit-learn's handwritten digits (1797 images of 8 x 8 pixels, shipped with the package: no
download): one digit (`positive_digit`) against the nine others, about 10% positives. Every client builds
the same split from the spec (`split_seed`), and keeps its own part: a held-out share `test_fraction`, then
the training rows dealt to `num_clients` clients with label skew (each digit's rows divided by
Dirichlet(`skew_alpha`) proportions, as `fedsaddle data split --partition label-skew` deals a table's). So
this is a benchmark source like the synthetic ones: public data, built from a public spec. Each client's
held-out rows follow its training rows' proportions; `pooled_test_auc` scores a z on all held-out rows.
Pixels are scaled to [0, 1] (divided by 16). With `validation_fraction` > 0, that share of the training rows
is set aside, drawn from its own stream, before the rest is dealt: no client trains on it, and
`pooled_validation_auc` scores a z there (for choosing step sizes without looking at the test rows).
With `train_positive_share`, positive training rows are then dropped at random (their own stream) down to
that share, for a more imbalanced task; the validation and test rows keep the digits' own share.

`loss_kind: cross_entropy` trains the same network on the same clients with binary cross-entropy instead (the
usual baseline; a, b and alpha stay at their start).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from numpy.typing import NDArray
from pydantic import Field

from fedsaddle.common.numeric import Array
from fedsaddle.common.problems.auc import roc_auc
from fedsaddle.common.problems.base import ClientContext, ClientData, SyntheticProblem
from fedsaddle.common.problems.data import deal_by_class
from fedsaddle.common.problems.domains import Block, Box, Free
from fedsaddle.common.problems.pytorch import Batch, Player, TorchProblem, TorchSpec
from fedsaddle.common.problems.shards import Shards

if TYPE_CHECKING:
    import torch

    from fedsaddle.common.problems.deep_auc_network import AucModel

DIGITS_ROWS = 1797  # load_digits' images
SIDE = 8  # pixels per side


class DeepAucSpec(TorchSpec):
    name: Literal["deep_auc"] = "deep_auc"
    positive_digit: int = Field(9, ge=0, le=9, description="the digit of the positive class (the rest: negative)")
    test_fraction: float = Field(0.3, gt=0, lt=1, description="the share of images held out for evaluation")
    skew_alpha: float = Field(0.5, gt=0, description="Dirichlet concentration of the label skew (smaller: more skew)")
    split_seed: int = Field(0, ge=0, lt=2**63, description="seeds the split (the same for every run seed)")
    channels: int = Field(8, ge=1, le=256, description="the first convolution's channels (the second has twice)")
    hidden: int = Field(32, ge=1, le=4096, description="the hidden layer's width")
    margin: float = Field(1.0, gt=0, description="m, AUC-M's margin")
    lam: float = Field(1e-4, ge=0, description="L2 weight on the network's parameters")
    validation_fraction: float = Field(
        0.0, ge=0, lt=1, description="the share of the training images set aside for validation (no client has them)"
    )
    train_positive_share: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="drop positive training images at random until they are this share of the training rows "
        "(a more imbalanced task; validation and test images keep the digits' own share); none: keep them all",
    )
    loss_kind: Literal["aucm", "cross_entropy"] = Field(
        "aucm",
        description="aucm: the AUC-M min-max margin loss; cross_entropy: the baseline, binary cross-entropy of the "
        "same network on the same data (a, b and alpha then stay where they start)",
    )


@functools.cache
def _digits() -> tuple[Array, NDArray[np.int64]]:
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise RuntimeError("problem deep_auc needs scikit-learn: pip install 'fedsaddle[data,torch]'") from None
    raw = load_digits()
    return np.asarray(raw.data, dtype=np.float64) / 16.0, np.asarray(raw.target, dtype=np.int64)


def split_digits(spec: DeepAucSpec) -> list[ClientData]:
    """Every client's data as the spec determines it (module docstring), in client order."""
    images, digits = _digits()
    labels = (digits == spec.positive_digit).astype(np.float64)
    rng = np.random.default_rng([spec.split_seed, 1])
    order = rng.permutation(len(digits))
    n_test = round(spec.test_fraction * len(digits))
    test, train = np.sort(order[:n_test]), np.sort(order[n_test:])
    train = np.setdiff1d(train, validation_rows(spec))
    if spec.train_positive_share is not None:
        train = _thin_positives(spec, train, labels)
    n = spec.num_clients
    for _ in range(1000):
        shares = rng.dirichlet(np.full(n, spec.skew_alpha), size=10)
        dealt_train = deal_by_class(train, digits, shares, rng)
        if min(len(rows) for rows in dealt_train) >= max(2, spec.batch_size or 0):
            break
    else:
        raise ValueError(
            f"problem deep_auc: no label-skew split gives each of {n} clients at least "
            f"{max(2, spec.batch_size or 0)} training rows; raise skew_alpha or lower num_clients or batch_size"
        )
    dealt_test = deal_by_class(test, digits, shares, rng)
    return [
        ClientData(f"deep_auc:client-{i}", images[tr], labels[tr], None, images[te], labels[te])
        for i, (tr, te) in enumerate(zip(dealt_train, dealt_test, strict=True))
    ]


def _thin_positives(spec: DeepAucSpec, train: NDArray[np.int64], labels: Array) -> NDArray[np.int64]:
    """`train` with positives dropped at random (a stream of their own) so that they are
    `train_positive_share` of what is left, at least one kept."""
    share = spec.train_positive_share
    assert share is not None
    positives, negatives = train[labels[train] > 0], train[labels[train] == 0]
    keep = max(1, round(share * len(negatives) / (1 - share)))
    if keep >= len(positives):
        return train
    picked = np.random.default_rng([spec.split_seed, 3]).permutation(positives)[:keep]
    return np.sort(np.concatenate([negatives, picked]))


def validation_rows(spec: DeepAucSpec) -> NDArray[np.int64]:
    """The images set aside for validation (`validation_fraction` of the training rows; none by default), drawn
    from a stream of their own so that the split without them is the one it always was."""
    order = np.random.default_rng([spec.split_seed, 1]).permutation(DIGITS_ROWS)
    train = np.sort(order[round(spec.test_fraction * DIGITS_ROWS) :])
    picked = np.random.default_rng([spec.split_seed, 2]).permutation(len(train))
    return np.sort(train[picked[: round(spec.validation_fraction * len(train))]])


class DeepAuc(TorchProblem, SyntheticProblem):
    """AUC-M with a small CNN on digits, one against the rest (module docstring)."""

    Spec = DeepAucSpec
    spec: DeepAucSpec
    synthetic = True
    metric_names = ("test_auc",)

    @functools.cached_property
    def positive_rate(self) -> float:
        """p: the share of positive training rows over all clients."""
        datas = split_digits(self.spec)
        return sum(float(d.y.sum()) for d in datas) / sum(d.samples for d in datas)

    def players(self) -> tuple[Player, Player]:
        import torch

        from fedsaddle.common.problems.deep_auc_network import AucModel

        return AucModel(self.spec.channels, self.spec.hidden, SIDE), [torch.zeros(1)]

    def dims(self) -> tuple[int, int]:
        """Declared from the spec (a coordinator needs no network): the CNN's convolutions (3 x 3, with biases),
        its two linear layers, then a and b; alpha."""
        c, h = self.spec.channels, self.spec.hidden
        net = (9 * c + c) + (9 * c * 2 * c + 2 * c) + (2 * c * (SIDE // 4) ** 2 * h + h) + (h + 1)
        return net + 2, 1

    def inputs(self, X: torch.Tensor) -> torch.Tensor:
        return X.reshape(-1, 1, SIDE, SIDE)

    def loss(self, x: Any, y: Any, batch: Batch, *, client: ClientContext) -> torch.Tensor:
        import torch

        model: AucModel = x
        (alpha,) = y
        p, margin = self.positive_rate, self.spec.margin
        if self.spec.loss_kind == "cross_entropy":
            logits = model.net(batch.inputs)
            value = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.targets)
            return self._regularized(model, value)
        score = torch.sigmoid(model.net(batch.inputs))
        positive = batch.targets
        negative = 1.0 - positive
        value = (
            (1 - p) * torch.mean((score - model.a) ** 2 * positive)
            + p * torch.mean((score - model.b) ** 2 * negative)
            + 2 * alpha * (p * (1 - p) * margin + torch.mean(p * score * negative - (1 - p) * score * positive))
            - p * (1 - p) * alpha**2
        )
        return self._regularized(model, value)

    def _regularized(self, model: AucModel, value: torch.Tensor) -> torch.Tensor:
        import torch

        if self.spec.lam:
            value = value + self.spec.lam / 2 * sum(torch.sum(w**2) for w in model.net.parameters())
        result: torch.Tensor = value.reshape(())
        return result

    def test_metrics(self, x: Any, y: Any, batch: Batch, *, client: ClientContext) -> Sequence[float]:
        import torch

        logits = x.net(batch.inputs).to(device="cpu", dtype=torch.float64).numpy()
        return (roc_auc(logits, batch.targets.cpu().numpy() > 0),)

    def domains(self) -> Sequence[Block]:
        dim_x, dim_y = self.dims()
        return [Free(dim_x), Box(dim_y, 0.0)]  # alpha >= 0

    def shards(self, seed: int, indices: Sequence[int]) -> Shards:
        from fedsaddle.common.problems.torch_shards import TorchShards

        datas = split_digits(self.spec)
        return TorchShards(self, [datas[i] for i in indices], indices)

    def pooled_test_auc(self, z: Array) -> float:
        """The test AUC of z on every client's held-out rows pooled (the federation's test set)."""
        datas = split_digits(self.spec)
        X = np.concatenate([d.X_test for d in datas if d.X_test is not None])
        t = np.concatenate([d.y_test for d in datas if d.y_test is not None])
        return self._auc(z, X, t)

    def pooled_validation_auc(self, z: Array) -> float:
        """The AUC of z on the validation images (`validation_fraction`; ValueError when there are none)."""
        rows = validation_rows(self.spec)
        if not len(rows):
            raise ValueError("problem deep_auc: validation_fraction is 0, so there are no validation images")
        images, digits = _digits()
        return self._auc(z, images[rows], (digits[rows] == self.spec.positive_digit).astype(np.float64))

    def _auc(self, z: Array, X: Array, t: Array) -> float:
        import torch

        model, _ = self.unflatten(z)
        with torch.no_grad():
            images = self.inputs(torch.as_tensor(X, dtype=model.a.dtype))
            logits = model.net(images).to(dtype=torch.float64).numpy()
        return roc_auc(logits, t > 0)
