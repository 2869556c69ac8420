"""`fedsaddle experiment`: the paper's sweep, its ablations, and the experiments beyond it (noise, the real
problems, agnostic learning, differential privacy, the PyTorch ones, and a comparison of chosen algorithms
on chosen problems)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedsaddle.cli.arguments import (
    Commands,
    add_command,
    non_negative_float,
    open_unit_interval,
    positive_float,
    positive_int,
    with_data,
)
from fedsaddle.cli.shared import EXIT_OK, EXIT_RUN_FAILED, UsageError, data_paths_of, given_reference

if TYPE_CHECKING:
    from fedsaddle.progress import Progress


def cmd_experiment(args: argparse.Namespace) -> int:
    """The paper's Experiments section, its ablations, and gradient noise."""
    from fedsaddle.progress import Progress

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError("experiments draw figures and need matplotlib: pip install 'fedsaddle[plot]'") from None
    _refuse_flags_not_taken(args)
    out = Path(args.out) if args.out else Path("runs") / f"experiment-{args.which}-{time.strftime('%Y%m%d-%H%M%S')}"
    command = "fedsaddle " + " ".join(sys.argv[1:])
    progress = Progress(unit="run")
    started = time.perf_counter()
    try:
        if args.which == "noise":
            from fedsaddle.experiments.noise import run_noise

            run_noise(out, command)
            print(f"report: {out} (noise.md, figure_noise.png; {time.perf_counter() - started:.1f} s)")
            return EXIT_OK
        if args.which == "dp":
            try:
                import dp_accounting  # noqa: F401
            except ImportError:
                raise UsageError("experiment dp needs dp-accounting: pip install 'fedsaddle[privacy]'") from None
            from fedsaddle.experiments.dp import EPSILONS, Setup, run_dp

            dp_seeds = tuple(range(args.seeds or 10))
            epsilons = tuple(args.epsilons or EPSILONS)
            setup = Setup(rounds=args.rounds or Setup().rounds)
            total = len(dp_seeds) * (len(epsilons) + 2)  # per seed: plain, clipping only, one per epsilon
            run_dp(out, command, dp_seeds, epsilons, setup, lambda done: progress.update("runs", done, total))
            print(f"report: {out / 'table.md'} (figure_dp.png, runs.csv; {time.perf_counter() - started:.1f} s)")
            return EXIT_OK
        if args.which == "problems":
            from fedsaddle.experiments.problems import ALGORITHMS, CASES, STEP_FACTORS, run_problems

            total = len(CASES) * len(ALGORITHMS) * len(STEP_FACTORS)
            rounds = args.rounds or 1000
            run_problems(out, command, rounds, lambda done: progress.update("runs", done, total))
            print(f"report: {out / 'problems.md'} (figure_problems.png; {time.perf_counter() - started:.1f} s)")
            return EXIT_OK
        if args.which == "agnostic":
            from fedsaddle import api
            from fedsaddle.experiments.agnostic import run_agnostic

            seeds = range(args.seeds or 10)
            grpc = args.transport == "grpc"
            run_agnostic(
                api.run,
                out,
                command,
                seeds,
                args.rounds or 2000,
                grpc,
                lambda n: progress.update("seeds", n, len(seeds)),
            )
            print(f"report: {out / 'agnostic.md'} (figure_agnostic.png; {time.perf_counter() - started:.1f} s)")
            return EXIT_OK
        if args.which == "deep-auc":
            return _deep_auc(args, out, command, progress)
        if args.which == "robust-mlp":
            return _robust_mlp(args, out, command, progress)
        if args.which == "ablations":
            from fedsaddle.experiments.ablations import run_ablations, variant_count

            total = variant_count()
            run_ablations(out, command, progress=lambda done: progress.update("ablation variants", done, total))
            print(f"report: {out / 'ablations.md'} ({time.perf_counter() - started:.1f} s)")
            return EXIT_OK
        if args.which == "compare":
            return _compare(args, out, command, progress)
        return _paper_experiment(args, out, command, progress)
    finally:
        progress.close()


# The flags each experiment takes (--out: all of them). The others run on setups of their own, documented
# in their reports, and a flag they would ignore is refused rather than silently dropped.
EXPERIMENT_FLAGS: dict[str, tuple[str, ...]] = {
    "paper": ("seeds", "s", "rounds", "convention", "tau", "init", "transport"),
    "ablations": (),
    "noise": (),
    "problems": ("rounds",),
    "agnostic": ("seeds", "rounds", "transport"),
    "dp": ("seeds", "rounds", "epsilons"),
    "deep-auc": ("seeds", "rounds", "tau", "libauc_python", "jobs", "positive_share"),
    "robust-mlp": ("seeds", "rounds", "jobs"),
    "compare": (
        "seeds",
        "s",
        "rounds",
        "convention",
        "tau",
        "algorithms",
        "problems",
        "eps",
        "grid",
        "ray",
        "config",
        "data",
        "reference",
    ),
}


COMPARE_FLAGS = ("algorithms", "problems", "eps", "grid", "ray", "config", "data", "reference")


def _refuse_flags_not_taken(args: argparse.Namespace) -> None:
    takes = EXPERIMENT_FLAGS.get(args.which)
    if takes is None:
        return
    given = [
        name
        for name in (
            "seeds",
            "s",
            "rounds",
            "epsilons",
            "convention",
            "tau",
            "init",
            "transport",
            "libauc_python",
            "jobs",
            "positive_share",
            *COMPARE_FLAGS,
        )
        if getattr(args, name, None) is not None and name not in takes
    ]
    if given:
        flags = ", ".join(f"--{name.replace('_', '-')}" for name in given)
        allowed = ", ".join(f"--{name.replace('_', '-')}" for name in (*takes, "out"))
        raise UsageError(f"experiment {args.which} does not take {flags} (it takes {allowed})")


def _deep_auc(args: argparse.Namespace, out: Path, command: str, progress: Progress) -> int:
    try:
        import torch  # noqa: F401
    except ImportError:
        raise UsageError("experiment deep-auc needs PyTorch: pip install 'fedsaddle[torch,data]'") from None
    if args.libauc_python is not None and not Path(args.libauc_python).is_file():
        raise UsageError(f"--libauc-python {args.libauc_python}: no such file (a Python that has libauc)")
    from fedsaddle import api
    from fedsaddle.experiments import deep_auc

    started = time.perf_counter()
    try:
        deep_auc.run_deep_auc(
            api.run,
            out,
            command,
            range(args.seeds or 10),
            args.rounds or 20,
            args.libauc_python,
            lambda done, total: progress.update("runs", done, total),
            jobs=args.jobs or 1,
            share=args.positive_share,
            tau=args.tau or deep_auc.TAU,
        )
    except RuntimeError as exc:
        raise UsageError(str(exc)) from None
    print(f"report: {out / 'deep_auc.md'} (runs.csv, figure_deep_auc.png; {time.perf_counter() - started:.1f} s)")
    return EXIT_OK


def _robust_mlp(args: argparse.Namespace, out: Path, command: str, progress: Progress) -> int:
    try:
        import torch  # noqa: F401
    except ImportError:
        raise UsageError("experiment robust-mlp needs PyTorch: pip install 'fedsaddle[torch,data]'") from None
    from fedsaddle import api
    from fedsaddle.experiments.robust_mlp import run_robust_mlp

    started = time.perf_counter()
    run_robust_mlp(
        api.run,
        out,
        command,
        range(args.seeds or 10),
        args.rounds or 30,
        lambda done, total: progress.update("runs", done, total),
        jobs=args.jobs or 1,
    )
    print(f"report: {out / 'robust_mlp.md'} (runs.csv, figure_robust_mlp.png; {time.perf_counter() - started:.1f} s)")
    return EXIT_OK


def _own_problem(args: argparse.Namespace) -> Any:
    """--config (with --data and --reference): the config's problem as `experiment compare` runs it, with
    z* (its reference_solution from all clients' data, or --reference) and each algorithm's step as the
    config writes it (the grid's scale 1)."""
    from fedsaddle.common.problems import DataError, make_problem
    from fedsaddle.common.worker import ShardCache
    from fedsaddle.experiments.compare import STEP_FIELDS, OwnProblem
    from fedsaddle.server.config import load_config
    from fedsaddle.server.transport.local_pool import reference_solution

    config = load_config(args.config)
    problem = make_problem(config.problem)
    data = data_paths_of(args.data, range(config.problem.num_clients))
    if problem.synthetic and data:
        raise UsageError(f"--data: problem {config.problem.name} is synthetic; it generates its own data")
    reference, accuracy = None, 0.0
    if args.reference:
        given = given_reference(args, config)
        reference, accuracy = tuple(given.z.tolist()), given.accuracy
    elif not problem.synthetic:
        if not data:
            raise UsageError(f"--data: problem {config.problem.name} reads each client's data file; name them")
        try:
            found = reference_solution(config, ShardCache(data=data))
        except DataError as exc:
            raise UsageError(str(exc)) from None
        if found is None:
            raise UsageError(
                f"problem {config.problem.name} computes no reference_solution(): give z* with --reference FILE.npy "
                "(fedsaddle check-problem --save-reference FILE.npy writes it)"
            )
        reference = tuple(found.tolist())
    bases: dict[str, float] = {}
    for spec in config.algorithms:
        fields = spec.model_dump()
        step = next((fields[name] for name in STEP_FIELDS if isinstance(fields.get(name), int | float)), None)
        if step is not None and spec.name not in bases:
            bases[spec.name] = float(step)
    entry = config.problem.model_dump(mode="json", exclude_none=True)
    extra = {"weighting": config.weighting, "gradient_noise": config.gradient_noise, "init": config.init}
    return OwnProblem(config.problem.name, entry, extra, data, reference, accuracy, bases)


def _compare(args: argparse.Namespace, out: Path, command: str, progress: Progress) -> int:
    from fedsaddle.experiments import compare
    from fedsaddle.server.config import RoundConvention

    grids: dict[str, tuple[float, ...]] = {}
    for given in args.grid or ():
        name, _, values = given.partition("=")
        try:
            grids[name] = tuple(float(v) for v in values.split(","))
        except ValueError:
            raise UsageError(f"--grid {given}: expected NAME=SCALE,SCALE,... (numbers)") from None
    own = _own_problem(args) if args.config else None
    if own is None and (args.data or args.reference):
        raise UsageError("--data and --reference go with --config (the problem of your own config)")
    if own is not None and args.ray and own.data:
        raise UsageError("--ray places tasks on other nodes, which do not hold your data files: leave out --ray")
    algorithms = args.algorithms or (list(own.bases) if own is not None else None)
    problems = args.problems or ([] if own is not None else None)
    if own is not None and own.name in (problems or []):
        raise UsageError(f"--problems names {own.name}, the config's problem: leave it out (--config runs it)")
    try:
        setup = compare.Setup(
            algorithms=tuple(algorithms or compare.DEFAULT_ALGORITHMS),
            problems=(*(problems if problems is not None else compare.DEFAULT_PROBLEMS), *([own.name] if own else [])),
            own=own,
            s_values=tuple(args.s) if args.s else compare.DEFAULT_S,
            seeds=tuple(range(args.seeds or compare.DEFAULT_SEEDS)),
            rounds=args.rounds or compare.DEFAULT_ROUNDS,
            eps=args.eps or compare.DEFAULT_EPS,
            convention=RoundConvention(args.convention or "exchanges"),
            tau=args.tau or 20,
            grids=grids,
        )
    except compare.CompareError as exc:
        raise UsageError(str(exc)) from None
    where = f"the Ray cluster at {args.ray}" if args.ray else "local processes"
    print(f"{setup.size} runs in {len(setup.tasks())} tasks on {where}", file=sys.stderr)
    started = time.perf_counter()

    def count(done: int) -> None:
        progress.update("runs", done, setup.size)

    try:
        if args.ray:
            from fedsaddle.experiments.ray_tasks import run_on_ray

            results = run_on_ray(setup.tasks(), args.ray, count)
        else:
            results = compare.run_local(setup.tasks(), progress=count)
    except compare.CompareError as exc:
        raise UsageError(str(exc)) from None
    elapsed = time.perf_counter() - started
    nodes = sorted({r.node for r in results})
    compare.report(out, setup, results, command)
    (out / "placement.csv").write_text(compare.placement_csv(setup, results))
    print(f"{setup.size} runs in {elapsed:.1f} s on {len(nodes)} node(s)", file=sys.stderr)
    figures = ", ".join(f"figure_{problem}.png" for problem in setup.problems)
    print(f"report: {out / 'compare.md'} (runs.csv, summary.csv, placement.csv, {figures})")
    return EXIT_OK


def _paper_experiment(args: argparse.Namespace, out: Path, command: str, progress: Progress) -> int:
    from fedsaddle.experiments.grid import STEP_SCALES, VARIANTS, Grid, run_grid, run_rows_on
    from fedsaddle.experiments.report import write_report
    from fedsaddle.server.config import RoundConvention

    grpc = args.transport == "grpc"
    default_s = (0.0, 5.0, 10.0) if grpc else tuple(float(s) for s in range(16))
    grid = Grid(
        s_values=tuple(args.s) if args.s else default_s,
        seeds=tuple(range(args.seeds if args.seeds else (1 if grpc else 5))),
        rounds=args.rounds or 500,
        convention=RoundConvention(args.convention or "exchanges"),
        tau=args.tau or 20,
        overrides={"init": args.init or "ones"},
        # Over gRPC every point runs again through client processes: the paper's own grid only.
        step_scales=STEP_SCALES if grpc else None,
        variants={} if grpc else VARIANTS,
    )
    print(
        f"{grid.size} runs: {len(grid.s_values)} values of s x {len(grid.seeds)} seeds x {len(grid.algorithms)} "
        "algorithms, each on its step grid",
        file=sys.stderr,
    )
    started = time.perf_counter()
    rows = run_grid(grid, progress=lambda done: progress.update("in-process sweep", done, grid.size))
    print(f"in-process sweep: {time.perf_counter() - started:.2f} s", file=sys.stderr)
    if not grpc:
        write_report(out, grid, rows, command)
        print(f"report: {out}  (runs.csv, figure1_curves.png, figure2_final_vs_s.png, table.md)")
        return EXIT_OK
    from fedsaddle.launch import loopback_federation

    first = grid.config(grid.algorithms[0], grid.s_values[0], grid.scales(grid.algorithms[0])[0], grid.seeds[0])
    with loopback_federation(first, 1, True) as (pool, _):
        remote = run_rows_on(
            pool, grid, [row.key for row in rows], lambda done: progress.update("over gRPC", done, len(rows))
        )
    same = sum(
        a.result.z_sha256 == b.result.z_sha256
        and [r["dist_x"] for r in a.result.records] == [r["dist_x"] for r in b.result.records]
        for a, b in zip(rows, remote, strict=True)
    )
    print(f"gRPC (10 client processes) vs in-process batch: {same}/{len(rows)} runs identical bit for bit")
    write_report(out, grid, remote, command)
    print(f"report: {out}")
    return EXIT_OK if same == len(rows) else EXIT_RUN_FAILED


def add_experiment(commands: Commands) -> None:
    p = add_command(commands, "experiment", "reproduce the paper's experiments (figures, tables, CSV)", cmd_experiment)
    p.add_argument(
        "which",
        choices=["paper", "ablations", "noise", "problems", "agnostic", "dp", "deep-auc", "robust-mlp", "compare"],
        help="the paper's sweep, ablations of its open choices, stochastic gradients, the real problems, "
        "agnostic federated learning on breast_cancer, differential privacy (held-out AUC against epsilon), "
        "federated deep AUC maximization with a CNN on digits, group-robust training of an MLP (both PyTorch), "
        "or a comparison of chosen algorithms on chosen problems (docs/how-to/compare.md)",
    )
    p.add_argument(
        "--seeds",
        type=positive_int,
        help="seeds per setting (default 5, or 1 with --transport grpc; the docs use 20; 10 for dp, agnostic, "
        "deep-auc and robust-mlp; 3 for compare)",
    )
    p.add_argument(
        "--s",
        type=non_negative_float,
        nargs="+",
        help="values of s (default 0..15; 0 5 10 with --transport grpc; 1 10 for compare)",
    )
    p.add_argument(
        "--rounds",
        type=positive_int,
        help="communication budget per run (default 500; 1000 for problems; 20 for dp; 2000 for agnostic; 20 for "
        "deep-auc; 30 for robust-mlp; 300 for compare)",
    )
    p.add_argument(
        "--epsilons", type=positive_float, nargs="+", help="dp: target epsilons (default 0.5 1 2 4 8; delta 1e-5)"
    )
    # The names of RoundConvention's members (server/config.py is not imported until a command needs it).
    p.add_argument(
        "--convention", choices=["exchanges", "paper"], help="paper, compare: what a round is (default exchanges)"
    )
    p.add_argument(
        "--tau", type=positive_int, help="paper, compare, deep-auc: local steps per sync (default 20; 5 for deep-auc)"
    )
    p.add_argument("--init", choices=["ones", "zeros", "random"], help="paper: starting point z0 (default ones)")
    p.add_argument(
        "--transport",
        choices=["inprocess", "grpc"],
        help="paper, agnostic: inprocess (default), or grpc: also run the points over 10 client processes and "
        "check them bit for bit",
    )
    p.add_argument(
        "--algorithms",
        nargs="+",
        metavar="NAME",
        help="compare: algorithms as a config names them (default: the paper's five)",
    )
    p.add_argument(
        "--problems",
        nargs="+",
        metavar="NAME",
        help="compare: paper, linear_regression, auc, fair_logistic, or an installed synthetic problem "
        "(default: paper linear_regression)",
    )
    p.add_argument("--eps", type=positive_float, help="compare: the accuracy for rounds to eps (default 1e-6)")
    p.add_argument(
        "--grid",
        action="append",
        metavar="NAME=SCALE,...",
        help="compare: an algorithm's own step scales (times the problem's base step); repeatable",
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        help="compare: also the problem of this config (a plug-in, or one on data files with --data), each "
        "algorithm's step in it as the grid's scale 1; its algorithms are the default --algorithms",
    )
    with_data(p, "compare --config: each client's")
    p.add_argument(
        "--reference",
        metavar="FILE.npy",
        help="compare --config: z* of the config's problem (default: its reference_solution from all the data)",
    )
    p.add_argument(
        "--ray",
        metavar="ADDRESS",
        help="compare: run the tasks on the Ray cluster whose head is at HOST:PORT ('local': a one-node Ray)",
    )
    p.add_argument(
        "--libauc-python",
        metavar="PATH",
        help="deep-auc: a Python with libauc, torch and fedsaddle, for the centralized LibAUC baseline",
    )
    p.add_argument(
        "--positive-share",
        type=open_unit_interval,
        metavar="S",
        help="deep-auc: thin the positive training images to this share (a more imbalanced task; default: keep all)",
    )
    p.add_argument(
        "--jobs", type=positive_int, help="deep-auc, robust-mlp: runs at once, each in a process of its own (default 1)"
    )
    p.add_argument("--out", help="report folder (default: runs/experiment-WHICH-TIME)")
