"""The packages import one way: schema at the bottom, then the components, then the RL algorithm,
then the wiring that runs it, then the entry points (docs/contributing.md, "Layers").

Every import in ``relax_launch/`` counts, including imports inside functions; only imports under
``if TYPE_CHECKING:`` are left out (they never run).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "relax_launch"

# Lower numbers are lower layers; a module may import its own layer or any below it, and the
# packages of one layer must not import each other in a cycle.
LAYERS = {
    "schema": 0,  # relax_launch/config/ and every package's own config section modules
    "platform": 0,
    "models": 0,
    "http": 0,  # relax_launch/http.py: the one HTTP client library
    "console": 0,  # relax_launch/console.py: the operator's console logger
    "run_dir": 0,  # relax_launch/run_dir.py: the files a run directory holds
    "deadline": 0,  # relax_launch/deadline.py: the end of every bounded wait
    "processes": 0,  # relax_launch/processes.py: whether a PID or a process group runs
    "notify": 0,  # relax_launch/notify.py: the operator's notifications (Apprise)
    "placement": 1,
    "inference": 1,
    "weights": 1,
    "trainer": 1,
    "rl": 2,  # the algorithm, on protocols that runtime implements
    "runtime": 3,  # per-rank wiring: sessions, lifecycle, watchdog
    "commands": 3,  # operator-side commands: launcher, sbatch, status
    "launch": 4,  # the torchrun entry: assembles the RL program and the runtime
    "cli": 4,
}


def unit_of(module: str) -> str:
    """The layer unit of a dotted module name inside relax_launch."""
    parts = module.split(".")[1:]
    if not parts or parts[0] == "config" or is_config_module(parts[-1]):
        return "schema"
    return parts[0]


def is_config_module(name: str) -> bool:
    """A package's config sections: ``config.py``, or ``<concept>_config.py`` when the package
    owns sections of more than one concept (``rl/data_config.py``)."""
    return name == "config" or name.endswith("_config")


def module_name(path: Path, package: Path = PACKAGE) -> str:
    relative = path.relative_to(package.parent).with_suffix("")
    return ".".join(p for p in relative.parts if p != "__init__")


def type_checking_nodes(tree: ast.AST) -> set[int]:
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skipped


def is_module(dotted: str, package: Path) -> bool:
    path = package.parent.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or path.is_dir()


def imports_of(path: Path, package: Path) -> set[str]:
    """relax_launch modules ``path`` imports, at any depth, TYPE_CHECKING blocks aside."""
    tree = ast.parse(path.read_text())
    skipped = type_checking_nodes(tree)
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("relax_launch")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("relax_launch"):
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                name = f"{node.module}.{alias.name}"
                found.add(name if is_module(name, package) else node.module)
    return found


def unit_edges(package: Path = PACKAGE) -> dict[tuple[str, str], str]:
    """(importing unit, imported unit) -> one example 'module imports module'."""
    edges = {}
    for path in package.rglob("*.py"):
        source = module_name(path, package)
        for target in imports_of(path, package):
            pair = (unit_of(source), unit_of(target))
            if pair[0] != pair[1] and unit_of(target) in LAYERS:
                edges.setdefault(pair, f"{source} imports {target}")
    return edges


def layer_problems(edges: dict[tuple[str, str], str]) -> list[str]:
    problems = [
        f"{a} (layer {LAYERS[a]}) imports {b} (layer {LAYERS[b]}): {example}"
        for (a, b), example in sorted(edges.items())
        if LAYERS[b] > LAYERS[a]
    ]
    problems += [
        f"{a} and {b} import each other: {edges[(a, b)]}; {edges[(b, a)]}"
        for (a, b) in sorted(edges)
        if (b, a) in edges and a < b
    ]
    return problems


def test_every_unit_has_a_layer():
    units = {unit_of(module_name(p)) for p in PACKAGE.rglob("*.py")} - {"relax_launch"}
    assert units <= set(LAYERS), f"give these a layer: {sorted(units - set(LAYERS))}"


def test_layers_import_one_way():
    problems = layer_problems(unit_edges())
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    "source,extra,expected",
    [
        # the trainer reaching up into the RL loop (an import inside a function counts)
        ("trainer/x.py", "def f():\n    from relax_launch.rl import loop\n", "trainer (layer 1)"),
        # two components importing each other
        ("weights/x.py", "import relax_launch.trainer.model\n", "import each other"),
        # the algorithm reaching into the wiring that runs it
        ("rl/x.py", "from relax_launch.runtime.session import Session\n", "rl (layer 2)"),
    ],
)
def test_the_rule_catches_an_upward_import_and_a_cycle(tmp_path, source, extra, expected):
    fake = tmp_path / "relax_launch"
    for unit in ("trainer", "weights", "rl", "runtime"):
        (fake / unit).mkdir(parents=True)
    (fake / "trainer" / "model.py").write_text("import relax_launch.weights.sync\n")
    (fake / source).write_text(extra)
    problems = layer_problems(unit_edges(fake))
    assert any(expected in p for p in problems), problems
