"""Each built-in algorithm is one module: its spec, its server half and its AlgorithmDef side by side;
the registry and the config take them from one list, and nothing in server/algorithms/ imports the config."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from test_import_graph import import_graph

from fedsaddle.common import computations
from fedsaddle.server import config
from fedsaddle.server.algorithms import Algorithm, BuildContext, SyncSchedule, available
from fedsaddle.server.algorithms.registry import BUILT_IN, definition, parse_algorithm


def _smallest_spec(name: str) -> dict[str, object]:
    """An `algorithms:` entry giving each required field of the algorithm's spec (every one is a step size)."""
    fields = definition(name).spec.model_fields
    return {"name": name, **{field: 0.1 for field, info in fields.items() if info.is_required()}}


@pytest.mark.parametrize("name", list(BUILT_IN))
def test_a_built_in_algorithm_is_declared_in_one_module(name: str) -> None:
    algorithm_def = BUILT_IN[name]
    spec = parse_algorithm(_smallest_spec(name))
    built = algorithm_def.build(spec, BuildContext(SyncSchedule(tau=3), dim_x=2))
    assert isinstance(built, Algorithm)
    assert built.name == algorithm_def.name == name
    # The spec, the server half and their AlgorithmDef share one module of server/algorithms/.
    module = type(built).__module__
    assert module.startswith("fedsaddle.server.algorithms.")
    assert algorithm_def.spec.__module__ == module
    assert algorithm_def.build.__module__ == module


def test_the_registry_and_the_config_list_the_same_built_in_algorithms_in_one_order() -> None:
    names = list(BUILT_IN)
    assert names[:5] == ["minibatch_md", "mirror_prox", "fedavg_s", "scaffold_s", "scaffold_catalyst_s"]
    assert available()[: len(names)] == names
    assert tuple(names) == config.ALGORITHM_NAMES
    assert tuple(BUILT_IN[name].spec for name in names) == config.BUILT_IN_SPECS
    assert all(definition(name) is BUILT_IN[name] for name in names)


def test_the_built_in_client_halves_are_the_computations_a_client_process_finds() -> None:
    declared = {name: fn for algorithm in BUILT_IN.values() for name, fn in algorithm.computations.items()}
    assert declared == computations.BUILT_IN
    assert sorted(declared) == ["local_extragradient", "local_sgda_plus"]
    for name, fn in declared.items():
        assert computations.find_computation(name) is fn


def test_a_spec_is_checked_by_its_own_module_with_the_documented_defaults() -> None:
    fedavg = parse_algorithm({"name": "fedavg_s", "gamma_local": 0.2})
    assert fedavg.model_dump() == {
        "label": None,
        "name": "fedavg_s",
        "gamma_local": 0.2,
        "gamma_global": None,
        "decay": "inverse_sqrt",
    }
    catalyst = parse_algorithm({"name": "scaffold_catalyst_s", "gamma_local": 0.1})
    assert catalyst.model_dump()["theta_rule"] == "estimated"
    assert catalyst.model_dump()["stop"] == {"rule": "gradient", "rtol": 0.1, "max_inner_syncs": 50}
    with pytest.raises(ValidationError, match="gamma_global is required when gamma_local is 0"):
        parse_algorithm({"name": "scaffold_s", "gamma_local": 0})


def test_nothing_in_the_algorithms_package_imports_the_config() -> None:
    graph = import_graph()
    package = "fedsaddle.server.algorithms"
    members = [module for module in graph if module == package or module.startswith(f"{package}.")]
    assert f"{package}.fedavg_s" in members and f"{package}.spec" in members
    for module in members:
        reached = {target for target in graph[module] if target.startswith("fedsaddle.server.config")}
        assert not reached, f"{module} imports {sorted(reached)}"
    # spec.py is what the algorithm modules, the registry and the config share: it imports none of them.
    assert not [target for target in graph[f"{package}.spec"] if target.startswith(package)]
    # The built-in algorithm modules do not reach back to the registry that lists them.
    for algorithm_def in BUILT_IN.values():
        assert f"{package}.registry" not in graph[algorithm_def.spec.__module__]
