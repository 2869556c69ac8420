"""What an algorithm module declares, and the run's synchronization schedule it is built under.

Every algorithm, built in or a plug-in, is one module holding its spec (a subclass of
`AlgorithmSpecBase`: its hyper-parameters with their defaults and ranges, declared there
only), its server half (an `Algorithm`, base.py), its client half if it has one (named
local computations) and the `AlgorithmDef` that ties them together. The registry
(registry.py) lists the built-in definitions; the config (server/config.py) takes the
union of their specs and the run's `sync` (`FixedSync` or `RandomSync`) from here.

This module imports neither the config nor the registry, so that both can import it and
the algorithm modules.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, Generic, Literal, NamedTuple, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from fedsaddle.common.computations import LocalComputation

if TYPE_CHECKING:
    from fedsaddle.server.algorithms.base import Algorithm
    from fedsaddle.server.algorithms.schedule import SyncSchedule

# How the paper's own algorithms cite their source in the algorithms table.
PAPER = "the paper (docs/explanation/algorithms.md)"


class StrictModel(BaseModel):
    """A config section: unknown fields refused, values frozen, no inf or nan."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


# -- the run's synchronization schedule ------------------------------------------------


class FixedSync(StrictModel):
    """Every sync interval is exactly tau local steps (tau is also MD/MP's minibatch)."""

    kind: Literal["fixed"] = "fixed"
    tau: int = Field(20, ge=1, le=1_000_000)


class RandomSync(StrictModel):
    """Each local step ends in a sync with probability p: intervals ~ Geometric(p)."""

    kind: Literal["random"] = "random"
    p: float = Field(0.05, gt=0, le=1)


SyncSpec = Annotated[FixedSync | RandomSync, Field(discriminator="kind")]


# -- an algorithm ----------------------------------------------------------------------


class AlgorithmSpecBase(BaseModel):
    """What every algorithm's spec has: its `name` (a Literal with a default in each spec) and a `label`.

    A spec declares the algorithm's hyper-parameters with their defaults and ranges; it
    is the only place they are declared (the server half takes each one as required).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    label: str | None = Field(None, description="name in outputs; defaults to the algorithm name")
    name: str

    @property
    def display_name(self) -> str:
        return self.label or self.name


class BuildContext(NamedTuple):
    """What the run gives every algorithm besides its spec."""

    schedule: SyncSchedule  # the run's synchronization schedule (fixed tau or random p)
    dim_x: int | None  # the length of x in z = (x, y), when known


SpecT = TypeVar("SpecT", bound=AlgorithmSpecBase)


@dataclass(frozen=True)
class AlgorithmDef(Generic[SpecT]):
    """One algorithm: spec, server half (`build` makes it from a validated spec), and the client
    half's local computations by name."""

    spec: type[SpecT]
    build: Callable[[SpecT, BuildContext], Algorithm[Any]]
    computations: Mapping[str, LocalComputation] = field(default_factory=dict)
    paper: str = ""  # the paper it comes from, for the algorithms table

    @property
    def name(self) -> str:
        return str(self.spec.model_fields["name"].default)
