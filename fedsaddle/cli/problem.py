"""A problem of one's own: `new problem` writes a package to start from, `check-problem` checks it before
it is federated."""

from __future__ import annotations

import argparse
from pathlib import Path

from fedsaddle.cli.arguments import Commands, add_command, positive_float, positive_int, with_data
from fedsaddle.cli.shared import EXIT_OK, EXIT_RUN_FAILED, UsageError, config_from, data_paths_of


def cmd_new(args: argparse.Namespace) -> int:
    """Write a package to start a problem of one's own from, with a test that passes."""
    from fedsaddle.problem_template import TemplateError, new_problem

    if args.kind == "algorithm":
        raise UsageError(
            "`fedsaddle new` writes problem packages only; an algorithm plug-in starts from the package "
            "examples/algorithm-plugin in fedsaddle's repository (docs: how-to/own-algorithm.md)"
        )
    out = Path(args.out or args.name)
    try:
        written = new_problem(args.name, out, torch=args.torch)
    except TemplateError as exc:
        raise UsageError(str(exc)) from None
    for path in written:
        print(f"wrote {path}")
    print(f"next: cd {out} && pytest   (then edit src/{args.name}/problem.py; README.md says what to change)")
    return EXIT_OK


def cmd_check_problem(args: argparse.Namespace) -> int:
    from fedsaddle.check import check_problem, distances
    from fedsaddle.common.problems import DataError, ProblemError, make_problem

    config = config_from(args)
    paths = data_paths_of(args.data, range(config.problem.num_clients))
    for run_dir in args.run_dir or []:
        if not (Path(run_dir) / "summary.json").is_file():
            raise UsageError(f"--run-dir {run_dir}: no summary.json there (not the run directory of a finished run)")
    try:
        report = check_problem(config, paths, args.points, args.pairs, args.seed, args.seconds)
    except (DataError, ProblemError) as exc:
        print(f"FAILED loading: {exc}")
        return EXIT_RUN_FAILED
    print("\n".join(report.lines))
    if report.failure is not None:
        return EXIT_RUN_FAILED
    assert report.z_star is not None
    if args.save_reference:
        from fedsaddle.server.reference import ReferenceError, save_reference

        found = report.z_star
        try:
            written, note = save_reference(
                Path(args.save_reference), found.z, found.accuracy, found.residual, found.method, config.problem.name
            )
        except ReferenceError as exc:
            raise UsageError(str(exc)) from None
        print(f"z* written to {written}, its accuracy to {note} (simulate/local/coordinator --reference {written})")
    dim_x, _ = make_problem(config.problem).dims()
    for run_dir in args.run_dir or []:
        print("\n".join(distances(report, Path(run_dir), dim_x)))
    return EXIT_OK


def add_new(commands: Commands) -> None:
    p = add_command(commands, "new", "start a package for a problem of your own, with a passing test", cmd_new)
    p.add_argument(
        "kind", choices=["problem", "algorithm"], help="what to start (an algorithm: see examples/algorithm-plugin)"
    )
    p.add_argument("name", help="its name, a Python module name (e.g. robust_regression)")
    p.add_argument("--out", help="folder to write (default: ./NAME; must not exist or be empty)")
    p.add_argument(
        "--torch", action="store_true", help="a problem written in PyTorch (an MLP; needs the torch extra to run)"
    )


def add_check_problem(commands: Commands) -> None:
    p = add_command(
        commands,
        "check-problem",
        "check a problem (a plug-in, on its data files) before federating it: gradient against finite differences "
        "of the objective, monotonicity of G, and its saddle point z* (reference_solution, or numerical); "
        "exit 0 if every check passes, 1 naming the first that fails",
        cmd_check_problem,
    )
    p.add_argument("--config", help="run config naming the problem (default: the built-in one)")
    with_data(p, "each client's")
    p.add_argument("--points", type=positive_int, default=3, help="random points for the gradient check")
    p.add_argument("--pairs", type=positive_int, default=20, help="random pairs for the monotonicity check")
    p.add_argument("--seed", type=int, default=0, help="seed of the random points")
    p.add_argument("--seconds", type=positive_float, default=60.0, help="time allowed for a numerical z*")
    p.add_argument(
        "--save-reference",
        metavar="FILE.npy",
        help="write z* to FILE.npy and its accuracy to FILE.json beside it (what --reference reads)",
    )
    p.add_argument(
        "--run-dir",
        action="append",
        metavar="RUN_DIR",
        help="print each final iterate's distance to z* (never finer than z*'s accuracy); repeatable",
    )
