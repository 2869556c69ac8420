"""`fedsaddle data`: split a table, images or a bundled dataset into client data files, and inspect one."""

from __future__ import annotations

import argparse
from pathlib import Path

from fedsaddle.cli.arguments import Commands, add_group, add_subcommand, positive_float, positive_int
from fedsaddle.cli.shared import EXIT_OK, UsageError


def cmd_data_split(args: argparse.Namespace) -> int:
    """Split a table (CSV, Parquet) or a bundled dataset into one data file per client, summarize each
    client's share, print the public statistics of each problem's spec, and write them into a config."""
    from fedsaddle.experiments.datasets import (
        DATASETS,
        Table,
        binned,
        by_dataset_column,
        describe,
        load_dataset,
        load_image_table,
        load_table,
        problem_entry,
        split,
        write_config,
    )
    from fedsaddle.experiments.images import ImageError, is_image_source
    from fedsaddle.experiments.tables import TableError, TableSpec

    source = args.file or args.dataset
    if source is None:
        raise UsageError(
            "data split needs a table (FILE, a .csv or .parquet), images (FILE, a .npy, .npz or a folder of class "
            f"subfolders) or --dataset {{{','.join(DATASETS)}}}"
        )
    if args.file and args.dataset:
        raise UsageError("give the table as FILE or as --dataset, not both")
    bundled = source in DATASETS
    images = not bundled and is_image_source(source)
    table_options = (args.target, args.features, args.group, args.positive, args.task)
    bins = _bins(args)
    if args.labels is not None and not images:
        raise UsageError("--labels gives the labels of images in a .npy file")
    try:
        if images:
            if any(option is not None for option in (args.target, args.features, args.group, args.by, args.task)):
                raise UsageError(
                    f"{source} holds images: their classes are the labels; --target, --features, --group, --by and "
                    "--task are for a table (--positive CLASS makes one class against the rest)"
                )
            dataset: str | Table = load_image_table(source, args.labels, args.positive)
        elif bundled:
            if any(option is not None for option in table_options):
                raise UsageError(
                    f"{source} is a bundled dataset with its own columns; "
                    "--target, --features, --group, --positive and --task are for your own table"
                )
            dataset = source
            if args.by is not None and args.partition == "by-column":  # one of its own columns
                dataset = by_dataset_column(load_dataset(source), args.by)
        else:
            if Path(source).suffix.lower() not in (".csv", ".parquet", ".pq") and not Path(source).exists():
                raise UsageError(
                    f"{source!r} is neither a bundled dataset {list(DATASETS)} nor a .csv or .parquet file"
                )
            if args.target is None:
                raise UsageError(f"{source}: name the target column with --target")
            features = tuple(f.strip() for f in args.features.split(",") if f.strip()) if args.features else ()
            spec = TableSpec(args.target, features, args.group, args.by, args.task, args.positive)
            dataset = load_table(source, spec)
        if args.partition == "by-column" and images:
            raise UsageError("images have no site column; by-column is for a table (--by)")
        if args.by is not None and args.partition != "by-column":
            raise UsageError("--by names the site column of --partition by-column")
        if args.partition == "by-column" and args.by is None:
            raise UsageError(
                "--partition by-column needs --by COLUMN (the column whose values, or bins, are the sites)"
            )
        if bins is not None:
            if args.partition != "by-column":
                raise UsageError("--bins and --quantiles cut the --by column of --partition by-column")
            assert isinstance(dataset, Table)
            dataset = binned(dataset, args.by, *bins)
        if args.partition != "by-column" and args.clients is None:
            raise UsageError(f"the {args.partition} partition needs --clients N")
        out = Path(args.out)
        summary = split(dataset, args.clients, args.partition, args.seed, out, args.test_fraction, args.alpha)
        print(describe(summary))
        print(f"wrote {out / 'client-000.npz'} ... client-{summary['clients'] - 1:03d}.npz, test.npz, summary.json")
        if args.config:
            entry = problem_entry(summary, args.problem)
            name = "".join(c if c.isalnum() or c in "_.-" else "-" for c in Path(source).stem) or "federation"
            print(write_config(Path(args.config), entry, name))
        elif args.problem:
            problem_entry(summary, args.problem)  # (refuses a problem that does not fit)
    except (TableError, ImageError) as exc:
        raise UsageError(str(exc)) from None
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return EXIT_OK


def _bins(args: argparse.Namespace) -> tuple[list[float] | None, int | None] | None:
    """--bins EDGES or --quantiles Q, as binned() takes them; None without either."""
    if args.bins is not None and args.quantiles is not None:
        raise UsageError("give --bins EDGES or --quantiles Q, not both")
    if args.quantiles is not None:
        return None, args.quantiles
    if args.bins is None:
        return None
    try:
        return [float(edge) for edge in args.bins.split(",") if edge.strip()], None
    except ValueError:
        raise UsageError(f"--bins: edges must be numbers separated by commas, got {args.bins!r}") from None


def cmd_data_inspect(args: argparse.Namespace) -> int:
    """Describe a client's data file: rows, features, labels, groups, and what each problem makes of it."""
    from fedsaddle.experiments.inspect import inspect_file

    try:
        print(inspect_file(args.file))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return EXIT_OK


def add_data(commands: Commands) -> None:
    data_commands = add_group(commands, "data", "prepare client data files", "data_command", "ACTION", "actions")
    p = add_subcommand(
        data_commands,
        "split",
        help="split a table (CSV, Parquet), images or a bundled dataset into one file per client",
        description="Split a table of your own (.csv, or .parquet with the data extra), images of your own (a .npy "
        "of N x C x H x W with --labels, a .npz of images and labels, or a folder of one subfolder of PNG or .npy "
        "images per class) or a dataset bundled with scikit-learn into one .npz file per client (plus held-out "
        "rows), print each client's share and the public statistics each problem's spec needs, and optionally "
        "write them into a config.",
        epilog="examples:\n"
        "  fedsaddle data split patients.csv --target outcome --partition label-skew --clients 3 --out data/\n"
        "  fedsaddle data split patients.parquet --target outcome --partition by-column --by hospital --out data/\n"
        "  fedsaddle data split --dataset breast_cancer --clients 10 --out data/ --config run.yaml\n"
        "  fedsaddle data split scans.npy --labels labels.npy --partition label-skew --clients 10 --out data/\n"
        "  fedsaddle data split digits/ --positive 7 --clients 10 --out data/   # digits/0/*.png ... digits/9/*.png",
        func=cmd_data_split,
    )
    p.add_argument(
        "file",
        nargs="?",
        metavar="FILE",
        help="your table: .csv (a header line) or .parquet; or images: .npy, .npz (images and labels) or a folder "
        "with a subfolder of images per class",
    )
    p.add_argument("--labels", metavar="FILE", help="images in a .npy: their labels, a .npy of one per image")
    p.add_argument(
        "--dataset", metavar="NAME", help="a bundled dataset instead: diabetes, diabetes_fair, breast_cancer"
    )
    p.add_argument("--target", metavar="COLUMN", help="the column to predict (two values: classes 0 and 1)")
    p.add_argument(
        "--features", metavar="A,B,...", help="feature columns, in this order (default: every other numeric column)"
    )
    p.add_argument("--group", metavar="COLUMN", help="a sensitive attribute of two values (for fair_logistic)")
    p.add_argument(
        "--positive",
        metavar="VALUE",
        help="the target value that is class 1 (default: the larger one); images: the class (label or subfolder) "
        "against the rest",
    )
    p.add_argument("--task", choices=["classification", "regression"], help="default: two target values are classes")
    p.add_argument(
        "--partition",
        choices=["iid", "label-skew", "by-column"],
        default="iid",
        help="how rows are dealt: equal shares, Dirichlet label skew, or one client per value of --by",
    )
    p.add_argument(
        "--by",
        metavar="COLUMN",
        help="the site column of --partition by-column: one client per value (or per bin, with --bins or "
        "--quantiles); a column of your table, or of a bundled dataset's features; it is left out of the features",
    )
    p.add_argument(
        "--bins",
        metavar="E1,E2,...",
        help="cut the numeric --by column at these increasing edges, in the column's units as the data holds "
        "them: k edges make k + 1 clients, (-inf, E1), [E1, E2), ..., [Ek, inf)",
    )
    p.add_argument(
        "--quantiles",
        type=positive_int,
        metavar="Q",
        help="cut the numeric --by column into Q bins of about equal row counts (one client each)",
    )
    p.add_argument("--clients", type=positive_int, help="number of clients (files); by-column: the number of sites")
    p.add_argument("--alpha", type=positive_float, default=0.5, help="Dirichlet concentration of label-skew")
    p.add_argument("--test-fraction", type=positive_float, default=0.2, help="share of rows held out for evaluation")
    p.add_argument("--seed", type=int, default=0, help="seed of the split")
    p.add_argument("--out", required=True, help="folder for the client files")
    p.add_argument(
        "--problem",
        choices=["auc", "fair_logistic", "linear_regression"],
        help="the problem of --config (default: auc for classes, fair_logistic with --group, else linear_regression)",
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        help="write the problem and its statistics into this config (a new file gets a starter config)",
    )

    p = add_subcommand(
        data_commands,
        "inspect",
        help="describe a client's data file",
        description="Describe a client's data file (.npz or .csv): rows, held-out rows, features, labels, groups, "
        "and the statistics each problem's spec would take from it.",
        func=cmd_data_inspect,
    )
    p.add_argument("file", metavar="FILE", help="a client's data file")
