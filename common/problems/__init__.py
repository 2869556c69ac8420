"""Federated minimax problems: the plug-in interface, the built-in problems, and their data.

See base.py for how to write your own, registry.py for how fedsaddle finds
problems (and which ones a client agrees to load), data.py for the data file
formats, shards.py for how clients' oracles are vectorized.
"""

from fedsaddle.common.problems.base import (
    ClientContext,
    ClientData,
    DataError,
    DataProblem,
    Problem,
    ProblemSpec,
    SyntheticProblem,
)
from fedsaddle.common.problems.data import data_paths, read_client_data
from fedsaddle.common.problems.registry import (
    ProblemNotFound,
    make_problem,
    make_shards,
    parse_spec,
    problem_class,
    solution,
)
from fedsaddle.common.problems.shards import ProblemError, ProblemShards, Shards, stack_shards
from fedsaddle.common.problems.synthetic import PaperRegressionSpec, QuadraticGameSpec

__all__ = [
    "ClientContext",
    "ClientData",
    "DataError",
    "DataProblem",
    "PaperRegressionSpec",
    "Problem",
    "ProblemError",
    "ProblemNotFound",
    "ProblemShards",
    "ProblemSpec",
    "QuadraticGameSpec",
    "Shards",
    "SyntheticProblem",
    "data_paths",
    "make_problem",
    "make_shards",
    "parse_spec",
    "problem_class",
    "read_client_data",
    "solution",
    "stack_shards",
]
