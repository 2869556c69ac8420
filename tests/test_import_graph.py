"""The project's modules import one another without cycles.

The graph is read from the source, not from an import: every module of every
package that pyproject.toml's `package-dir` maps (fedsaddle.server -> server/, ...)
is parsed, and each `import` / `from ... import` it can run is an edge, the ones
inside functions included (a lazy import hides a cycle from the importer, not
from a reader). Imports under `if TYPE_CHECKING:` are left out: they never run.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the installed package, by its import name, found through the package-dir mapping."""
    setuptools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    found: dict[str, Path] = {}
    for package, folder in setuptools["package-dir"].items():
        for path in sorted((root / folder).glob("*.py")):
            found[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return found


def _type_checking_only(tree: ast.AST) -> set[int]:
    """The ids of the nodes inside `if TYPE_CHECKING:` blocks."""
    hidden: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            hidden.update(id(inner) for stmt in node.body for inner in ast.walk(stmt))
    return hidden


def _imported(module: str, path: Path, known: Mapping[str, Path]) -> Iterator[str]:
    """The project's modules that `module` may import when it runs."""
    tree = ast.parse(path.read_text(), filename=str(path))
    hidden = _type_checking_only(tree)
    package = module if path.stem == "__init__" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if id(node) in hidden:
            continue
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            source = (f"{base}.{node.module}" if node.module else base) if node.level else (node.module or "")
            for alias in node.names:
                # `from package import module` imports the module; `from module import name` the module.
                submodule = f"{source}.{alias.name}"
                if submodule in known:
                    yield submodule
                elif source in known:
                    yield source


def outside_imports(path: Path) -> set[str]:
    """The top-level names of the packages outside the project that a module may import when it runs."""
    tree = ast.parse(path.read_text(), filename=str(path))
    hidden = _type_checking_only(tree)
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in hidden:
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.partition(".")[0])
    return names - {"fedsaddle"}


def reachable(graph: Mapping[str, set[str]], start: str) -> set[str]:
    """`start` and every module it imports, directly or through others."""
    seen, todo = {start}, [start]
    while todo:
        for target in graph[todo.pop()] - seen:
            seen.add(target)
            todo.append(target)
    return seen


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    known = modules(root)
    return {module: set(_imported(module, path, known)) - {module} for module, path in known.items()}


def cycle(graph: Mapping[str, set[str]]) -> list[str] | None:
    """One import cycle of the graph (its modules, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start)
            if found:
                return found
    return None


def test_the_import_graph_is_read_through_the_package_dir_mapping() -> None:
    graph = import_graph()
    # Folders named as installed: server/driver.py is fedsaddle.server.driver, and its imports are seen.
    assert modules()["fedsaddle.server.driver"] == ROOT / "server" / "driver.py"
    assert "fedsaddle.server.config" in graph["fedsaddle.server.driver"]
    # A lazy import inside a function is an edge (cli imports nearly everything that way).
    assert "fedsaddle.launch" in graph["fedsaddle.cli.run"]
    assert len(graph) > 50


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_modules_import_one_another_without_cycles() -> None:
    found = cycle(import_graph())
    assert found is None, "import cycle: " + " -> ".join(found or [])


def test_the_top_level_folders_import_one_another_without_cycles() -> None:
    # One node per folder of the repository (fedsaddle/, server/, client/, common/, experiments/, proto/):
    # e.g. server/ must not reach fedsaddle/ (the command line, the API) and come back.
    # A module's folder is the one its file is in (fedsaddle/cli/run.py is in fedsaddle/).
    def folder(module: str) -> str:
        return known[module].relative_to(ROOT).parts[0]

    known = modules()
    folders: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        folders.setdefault(folder(module), set()).update(folder(t) for t in targets)
    graph = {name: targets - {name} for name, targets in folders.items()}
    assert {"fedsaddle", "server", "client", "common", "proto"} <= set(graph)
    found = cycle(graph)
    assert found is None, "folder cycle: " + " -> ".join(found or [])


def test_the_coordinators_protocol_object_and_what_it_imports_never_import_grpc() -> None:
    # Coordination (server/transport/protocol.py) does no I/O and speaks the transport's own statuses
    # (refusal.Status); the servicer alone maps them to gRPC's. Imports inside functions count here too.
    known = modules()
    closure = reachable(import_graph(), "fedsaddle.server.transport.protocol")
    parts = {"actions", "checks", "identity", "refusal", "rounds", "sessions", "states"}
    assert {f"fedsaddle.server.transport.{part}" for part in parts} | {"fedsaddle.server.secure"} <= closure
    on_grpc = sorted(m for m in closure if any(n.startswith("grpc") for n in outside_imports(known[m])))
    assert on_grpc == []
    assert "grpc" in outside_imports(known["fedsaddle.server.transport.servicer"])  # (the rule can fail)


def test_a_run_without_a_pytorch_problem_never_imports_torch(tmp_path: Path) -> None:
    # PyTorch is an extra of about 5 GB: the command line, the API and a whole run of a numpy problem do
    # without it (common/problems/pytorch.py is imported only when a config names a PyTorch problem).
    code = (
        "import sys\n"
        "from fedsaddle import api, cli\n"
        "config = {'problem': {'name': 'paper_regression', 'num_clients': 2, 'dim': 4}, 'rounds': 5,\n"
        "          'algorithms': [{'name': 'fedavg_s', 'gamma_local': 0.1}], 'output': {'plot': False}}\n"
        "report = api.run(config, out=sys.argv[1])\n"
        "assert report.failure is None, report.failure\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"
