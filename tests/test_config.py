"""Invalid configs fail with an error that names the field and the reason."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import fedsaddle

from fedsaddle.server.config import ConfigError, load_config, parse_config

VALID: dict[str, Any] = {"algorithms": [{"name": "minibatch_md", "gamma": 0.1}]}


def error_of(data: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as caught:
        parse_config(data)
    return str(caught.value)


def test_the_minimal_config_is_valid_and_has_the_papers_defaults() -> None:
    config = parse_config(VALID)
    assert config.problem.name == "paper_regression"
    assert (config.problem.num_clients, config.problem.dim, config.problem.lam) == (10, 10, 1e-5)
    assert config.rounds == 500 and config.sync.kind == "fixed" and config.sync.tau == 20


def test_negative_step_names_the_field() -> None:
    message = error_of({"algorithms": [{"name": "fedavg_s", "gamma_local": -0.1}]})
    assert "algorithms[0].gamma_local: Input should be greater than 0 (got -0.1)" in message


def test_probability_outside_zero_one_names_the_field() -> None:
    for p in (0, 1.5, -0.2):
        message = error_of({**VALID, "sync": {"kind": "random", "p": p}})
        assert "sync.p:" in message and f"(got {p})" in message
    assert parse_config({**VALID, "sync": {"kind": "random", "p": 1}}).sync.p == 1  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"algorithms": [{"name": "minibatch_md", "gamma": float("inf")}]}, "algorithms[0].gamma"),
        ({**VALID, "problem": {"name": "paper_regression", "s": float("inf")}}, "problem.s"),
        ({**VALID, "gradient_noise": float("nan")}, "gradient_noise"),
        ({**VALID, "transport": {"round_timeout_s": float("inf")}}, "transport.round_timeout_s"),
    ],
)
def test_infinity_and_nan_are_refused_naming_the_field(data: dict[str, Any], field: str) -> None:
    # (s = inf used to start a run that warned of NaNs and diverged; gamma = inf failed with
    # "gamma must be > 0, got inf" as a run error, not as the config's.)
    assert f"{field}: Input should be a finite number" in error_of(data)


def test_unknown_algorithm_lists_the_known_ones() -> None:
    message = error_of({"algorithms": [{"name": "fedprox", "gamma": 0.1}]})
    assert "algorithms[0]: unknown name 'fedprox'" in message
    assert "scaffold_catalyst_s" in message


def test_unknown_problem_and_unknown_field() -> None:
    message = error_of({**VALID, "problem": {"name": "mnist"}})
    assert "problem.name: unknown problem 'mnist'" in message and "'linear_regression'" in message
    assert "problem.heterogenity: unknown field (did you mean 'heterogeneity'?)" in error_of(
        {**VALID, "problem": {"name": "quadratic_game", "heterogenity": 1}}
    )


def test_a_misspelt_name_gets_the_closest_known_one() -> None:
    message = error_of(
        {
            **VALID,
            "problem": {"name": "paper_regresion"},
            "sync": {"kind": "randm"},
            "algorithms": [{"name": "scafold_s"}, {"name": "fedprox"}],
        }
    )
    assert "problem.name: unknown problem 'paper_regresion' (did you mean 'paper_regression'?)" in message
    assert "sync: unknown kind 'randm' (did you mean 'random'?)" in message
    assert "algorithms[0]: unknown name 'scafold_s' (did you mean 'scaffold_s'?)" in message
    assert "algorithms[1]: unknown name 'fedprox'; expected one of" in message  # nothing close: no guess


def test_a_misspelt_field_gets_the_closest_field_of_its_own_place() -> None:
    message = error_of(
        {
            **VALID,
            "runds": 4,
            "sync": {"kind": "random", "P": 0.1},
            "transport": {"limits": {"max_conections": 4}},
            "algorithms": [
                {"name": "minibatch_md", "gamma": 0.1, "gama": 1},
                {"name": "scaffold_s", "gama": 1},  # SCAFFOLD-S has gamma_local and gamma_global: no guess
            ],
        }
    )
    assert "  runds: unknown field (did you mean 'rounds'?)" in message
    assert "  sync.P: unknown field (did you mean 'p'?)" in message
    assert "  transport.limits.max_conections: unknown field (did you mean 'max_connections'?)" in message
    assert "  algorithms[0].gama: unknown field (did you mean 'gamma'?)" in message
    # No close field: the place's fields are listed instead, when they are few.
    assert "  algorithms[1].gama: unknown field (its fields: 'gamma_global', 'gamma_local', 'label', 'name')" in message
    assert "  sync.tua: unknown field (its fields: 'kind', 'tau')" in error_of(
        {**VALID, "sync": {"kind": "fixed", "tua": 5}}
    )
    assert "  budget: unknown field\n" in error_of({**VALID, "budget": 5}) + "\n"  # the top level has too many


def test_every_bad_field_is_reported_at_once() -> None:
    message = error_of({"rounds": 0, "algorithms": [{"name": "minibatch_md", "gamma": 0}]})
    assert "rounds: Input should be greater than or equal to 1" in message
    assert "algorithms[0].gamma: Input should be greater than 0" in message


def test_an_entry_that_names_no_kind_or_rule_is_told_what_each_takes() -> None:
    # pydantic said only "Unable to extract tag using discriminator 'kind'".
    message = error_of({**VALID, "sync": {"p": 0.1}})
    assert message.splitlines()[1:] == ["  sync: needs kind: fixed (takes tau) or kind: random (takes p)"]
    catalyst = {"name": "scaffold_catalyst_s", "gamma_local": 0.1, "stop": {"rtol": 0.1}}
    assert error_of({"algorithms": [catalyst]}).splitlines()[1:] == [
        "  algorithms[0].stop: needs rule: fixed (takes inner_syncs), rule: objective (takes rtol, max_inner_syncs) "
        "or rule: gradient (takes rtol, max_inner_syncs)"
    ]
    assert "Unable to extract tag" not in message
    # A choice named where its mapping belongs: pydantic said "Input should be a valid dictionary".
    assert error_of({**VALID, "sync": "fixed"}).splitlines()[1:] == [
        "  sync: needs a mapping, not 'fixed': it needs kind: fixed (takes tau) or kind: random (takes p)"
    ]


def test_every_fault_across_fields_is_reported_at_once_each_at_its_field() -> None:
    # Each check across fields used to raise on its own, and pydantic runs no model check after one that
    # raised: a private run's config showed its faults one attempt at a time.
    data = {
        **VALID,
        "problem": {"name": "paper_regression", "num_clients": 10},
        "weighting": "samples",
        "evaluate_every": 5,
        "privacy": {
            "secure_aggregation": True,
            "threshold": 11,
            "bound": 1e6,
            "neighbours": 3,
            "dp": {"clip": 1.0, "noise_multiplier": 1.0},
        },
        "participation": {"straggler_deadline_s": 1, "min_clients": 3},
    }
    assert error_of(data).splitlines()[1:] == [
        "  evaluate_every: problem paper_regression has no evaluation metrics (output.gradient_norm: true "
        "evaluates ||G(z)|| on any problem)",
        "  weighting: samples needs clients with data files; paper_regression is synthetic",
        "  privacy.dp: differential privacy needs weighting: uniform",
        "  privacy.dp: evaluate_every would release the clients' metrics without noise; set it to 0",
        "  privacy: threshold 11 is unsafe for 10 clients per round: it must be within 6..10 (a majority of 10 + 1, "
        "and no more than the clients)",
        "  privacy: a bound of 1e+06 with scale 2^-40 lets 10 clients' sum overflow the 64-bit ring; the largest "
        "safe bound is 262144",
        "  privacy: neighbours must be 0 (all pairs) or an even number >= 2 (each client masks with k/2 clients on "
        "either side of it), got 3",
    ]
    # With the threshold sound, the quorum is checked against it, in the same message as the rest.
    data["privacy"] = {**data["privacy"], "threshold": None}
    assert (
        "  participation.min_clients: 3 is fewer than the 6 clients secure aggregation needs to unmask a round"
        in error_of(data).splitlines()
    )


def test_repeated_algorithm_names_need_labels() -> None:
    twice = {"algorithms": [{"name": "minibatch_md", "gamma": 0.1}, {"name": "minibatch_md", "gamma": 0.2}]}
    assert "algorithm names repeat: ['minibatch_md']" in error_of(twice)
    twice["algorithms"][1]["label"] = "md-large"
    assert [a.display_name for a in parse_config(twice).algorithms] == ["minibatch_md", "md-large"]


def test_files_that_are_not_configs(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("algorithms: [\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config(bad)
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(bad)
    # YAML itself keeps the last of a key given twice; a config that does so is refused, naming the key
    bad.write_text("rounds: 5\noutput: {dir: a}\nrounds: 7\n")
    with pytest.raises(ConfigError, match=r"found the key 'rounds' twice[\s\S]*line 3"):
        load_config(bad)
    bad.write_text("output:\n  dir: a\n  plot: false\n  dir: b\n")
    with pytest.raises(ConfigError, match="found the key 'dir' twice"):
        load_config(bad)


def test_the_cli_exits_2_and_names_the_field(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("algorithms:\n  - name: mirror_prox\n    gamma: -1\n")
    done = subprocess.run(
        [sys.executable, "-m", "fedsaddle", "simulate", "--config", str(path), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "algorithms[0].gamma: Input should be greater than 0 (got -1)" in done.stderr
    assert "Traceback" not in done.stderr
    assert not any(tmp_path.glob("run-*"))  # nothing was started


def test_locations_drop_the_union_tags_pydantic_adds_and_keep_every_field_the_user_wrote() -> None:
    # A tag (fedavg_s, random, fixed) is recognised by the models' own Literal fields, at any depth;
    # an unknown key that happens to equal a default value ("runs", output.dir's) is still named.
    data = {
        "algorithms": [
            {"name": "fedavg_s", "gamma_local": 0.1, "decay": "linear"},
            {"name": "scaffold_catalyst_s", "gamma_local": 0.1, "stop": {"rule": "fixed", "inner_syncs": 0}},
        ],
        "sync": {"kind": "random", "p": 2},
        "output": {"runs": 1},
    }
    with pytest.raises(ConfigError) as caught:
        parse_config(data)
    lines = [line.strip().split(":")[0] for line in str(caught.value).splitlines()[1:]]
    assert lines == ["algorithms[0].decay", "algorithms[1].stop.inner_syncs", "sync.p", "output.runs"]


def test_the_algorithms_defaults_are_the_documented_ones() -> None:
    # Declared once, in the specs (the algorithm classes repeat none): what README.md, docs/experiments.md
    # and the examples' documented results use.
    fedavg, catalyst = parse_config(
        {"algorithms": [{"name": "fedavg_s", "gamma_local": 0.1}, {"name": "scaffold_catalyst_s", "gamma_local": 0.1}]}
    ).algorithms
    assert fedavg.decay == "inverse_sqrt"  # type: ignore[union-attr]
    assert catalyst.theta_rule == "estimated"  # type: ignore[union-attr]


def test_the_built_in_run_is_the_example_file_as_installed() -> None:
    from fedsaddle.cli.shared import built_in_config

    example = Path(__file__).resolve().parent.parent / "examples" / "paper-s10.yaml"
    assert built_in_config() == load_config(example)
    assert built_in_config().name == "paper-s10"


def test_gradient_norm_without_evaluated_steps_is_refused_not_ignored() -> None:
    # It is measured at evaluated steps only: without evaluate_every the run recorded nothing, silently
    # (and a private run, which refuses evaluate_every, took it without a word).
    said = "output.gradient_norm: ||G(z)|| is measured at the evaluated steps, and evaluate_every is 0"
    assert said in error_of({**VALID, "output": {"gradient_norm": True}})
    parse_config({**VALID, "output": {"gradient_norm": True}, "evaluate_every": 10})


def test_a_validator_that_names_the_value_is_not_followed_by_it_again() -> None:
    message = error_of({"output": {"save_every": 0}})
    assert "output.save_every: must be a number of steps >= 1, got 0;" in message and "(got 0)" not in message


def test_an_output_folder_that_cannot_be_made_exits_2_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("rounds: 2\nalgorithms:\n  - {name: minibatch_md, gamma: 0.01}\n")
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    done = fedsaddle("simulate", "--config", str(path), "--out", str(blocked))
    assert done.returncode == 2
    assert f"output.dir (--out) {str(blocked)!r}: cannot create a run directory there: Not a directory" in done.stderr
