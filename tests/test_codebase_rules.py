"""The checkable codebase rules of docs/contributing.md, enforced; tests carry their numbers.

Each test names its rule; a failure says which file and line broke it.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "relax_launch"
SOURCES = sorted(p for p in PACKAGE.rglob("*.py") if "stand_ins" not in p.parts)
RUFF = str(Path(sys.executable).with_name("ruff"))


def rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def functions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def test_rule1_small_modules_and_functions():
    problems = []
    for path in SOURCES:
        text = path.read_text()
        limit = 600 if text.startswith("# long:") else 400
        if len(text.splitlines()) > limit:
            problems.append(f"{rel(path)}: {len(text.splitlines())} lines > {limit}")
        for fn in functions(ast.parse(text)):
            size = fn.end_lineno - fn.lineno + 1
            cap = 40 if fn.name == "__init__" else 60
            if size > cap:
                problems.append(f"{rel(path)}:{fn.lineno} {fn.name} is {size} lines > {cap}")
    assert not problems, "\n".join(problems)


def test_rule3_entry_points_are_thin():
    for entry in (REPO / "launch.py", PACKAGE / "launch.py"):
        assert len(entry.read_text().splitlines()) <= 80
    tree = ast.parse((PACKAGE / "cli.py").read_text())
    for fn in functions(tree):
        if any(
            getattr(d, "func", None) is not None and "command" in ast.unparse(d)
            for d in fn.decorator_list
        ):
            assert fn.end_lineno - fn.lineno + 1 <= 30, f"cli.py {fn.name} is longer than 30 lines"


def test_rule4_config_modules_are_pure():
    for path in PACKAGE.rglob("*config.py"):  # config.py and <concept>_config.py
        text = path.read_text()
        for banned in ("import torch", "os.path", "open(", "socket"):
            assert banned not in text, f"{rel(path)} uses {banned!r}: config validators stay pure"


def test_rule6_job_config_stays_at_the_top():
    allowed = (
        "relax_launch/config/",
        "relax_launch/cli.py",
        "relax_launch/launch.py",
        "relax_launch/rl/program.py",  # assembles the job from its sections
        "relax_launch/runtime/",
        "relax_launch/commands/",  # the operator's commands read the whole job
        "relax_launch/placement/",
    )
    for path in SOURCES:
        if "JobConfig" in path.read_text() and not rel(path).startswith(allowed):
            pytest.fail(f"{rel(path)} names JobConfig; pass it the sections it needs instead")


def test_rule11_device_differences_live_in_platform():
    pattern = re.compile(r"torch\.cuda|[\"'](nccl|gloo)[\"']|SGLANG_USE_CPU_ENGINE")
    for path in SOURCES:
        if "platform" in path.parts:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            assert not pattern.search(line), f"{rel(path)}:{number}: move to relax_launch/platform"


def test_rule12_no_global_state_or_kill_by_name():
    pattern = re.compile(r"^\s*global\s|Singleton|pkill|killall")
    scanned = SOURCES + sorted((REPO / "scripts").glob("*")) + [REPO / "launch.py"]
    for path in scanned:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            assert not pattern.search(line), f"{rel(path)}:{number}: {line.strip()}"


def test_rule12_one_way_to_wait_and_to_check_a_process():
    """A bounded wait ends at a ``relax_launch.deadline.Deadline``; whether a process runs is
    psutil's answer (``relax_launch.processes``), not a parse of /proc."""
    by_hand = re.compile(r"(monotonic|time|perf_counter)\(\) \+")
    proc = re.compile(r"[\"']/proc[\"']|/proc/\{")
    for path in SOURCES:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            where = f"{rel(path)}:{number}: {line.strip()}"
            assert path.name == "deadline.py" or not by_hand.search(line), f"use Deadline: {where}"
            assert not proc.search(line), f"use relax_launch.processes (psutil): {where}"


# Third-party libraries slow enough to import that a module defers them to the function that
# needs them (the CLI answers at once, inference ranks never load Megatron, a config error comes
# before torch). A function-level import of a relax_launch module is allowed only where it is
# the way to defer one of these, and never where it would close an import cycle.
HEAVY = {
    "aiohttp",
    "fastapi",
    "matplotlib",
    "megatron",
    "numpy",
    "pyarrow",
    "reasoning_gym",  # ~1 s: only jobs drawing reasoning-gym tasks load it
    "safetensors",
    "sglang",
    "torch",
    "transformers",
    "uvicorn",
    "wandb",
}


def module_of(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The names ``node`` imports: modules, and for ``from X import y`` both X and X.y (a
    submodule, or a name of X: callers keep those that are modules)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    here = module.split(".")
    base = here[: len(here) - node.level + is_package] if node.level else []
    name = ".".join([*base, *([node.module] if node.module else [])])
    return [name, *(f"{name}.{alias.name}" for alias in node.names)]


def import_nodes(tree: ast.AST, in_functions: bool) -> Iterator[ast.Import | ast.ImportFrom]:
    """The imports that run when the module loads, or (``in_functions``) when one of its
    functions runs; ``if TYPE_CHECKING:`` blocks never run."""

    def visit(node: ast.AST, inside: bool) -> Iterator[ast.Import | ast.ImportFrom]:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return
        if isinstance(node, ast.Import | ast.ImportFrom) and inside == in_functions:
            yield node
        deeper = inside or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        for child in ast.iter_child_nodes(node):
            yield from visit(child, deeper)

    return visit(tree, False)


def late_project_imports(package: Path) -> list[str]:
    """Function-level imports of the package's own modules that defer no heavy library or
    close an import cycle, as 'module:line imports target (why)'."""
    paths = {module_of(p, package): p for p in package.rglob("*.py")}
    trees = {name: ast.parse(path.read_text()) for name, path in paths.items()}
    at_load = {
        name: {
            target
            for node in import_nodes(tree, in_functions=False)
            for target in imported(node, name, paths[name].name == "__init__.py")
        }
        for name, tree in trees.items()
    }

    def loads(module: str) -> set[str]:
        """What importing ``module`` loads: its packages, itself, their imports, transitively."""
        seen: set[str] = set()
        todo = [module]
        while todo:
            parts = todo.pop().split(".")
            for end in range(1, len(parts) + 1):
                name = ".".join(parts[:end])
                if name not in seen:
                    seen.add(name)
                    todo.extend(at_load.get(name, ()))
        return seen

    def heavy(module: str) -> set[str]:
        return {name.split(".")[0] for name in loads(module)} & HEAVY

    problems = []
    for name, tree in trees.items():
        for node in import_nodes(tree, in_functions=True):
            names = imported(node, name, paths[name].name == "__init__.py")
            if isinstance(node, ast.ImportFrom):  # the submodules it names, else the module
                names = [n for n in names[1:] if n in paths] or names[:1]
            for target in (n for n in names if n in paths):
                where = f"{paths[name].relative_to(package.parent)}:{node.lineno} imports {target}"
                if any(name in loads(module) for module in at_load[target]):
                    problems.append(f"{where} (an import cycle: {target} loads {name})")
                elif not heavy(target) - heavy(name):
                    problems.append(f"{where} (it defers no heavy library: import it at the top)")
    return problems


def test_rule16_no_function_level_import_of_the_project():
    """An import of a relax_launch module sits at the top of the module, where the import graph
    shows it; inside a function only to defer a heavy third-party library (``HEAVY``)."""
    problems = late_project_imports(PACKAGE)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    "late,expected",
    [
        ("def f():\n    from pkg import b\n", "an import cycle"),  # b imports a at the top
        ("def f():\n    from pkg import c\n", "defers no heavy library"),
    ],
)
def test_rule16_catches_a_hidden_cycle_and_a_needless_late_import(tmp_path, late, expected):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "a.py").write_text(late)
    (package / "b.py").write_text("from pkg import a\n")
    (package / "c.py").write_text("import json\n")
    (package / "d.py").write_text("def f():\n    from pkg import e\n")  # defers torch: allowed
    (package / "e.py").write_text("import torch\n")
    (package / "__init__.py").write_text("def f():\n    from pkg import e\n")  # its own part
    (problem,) = late_project_imports(package)
    assert problem.startswith("pkg/a.py:2 imports pkg.") and expected in problem, problem


def test_rule17_no_formatter_escapes():
    """Modules meet the line budget by holding one concept each, never by lines the formatter
    is told to leave dense."""
    for path in PACKAGE.rglob("*.py"):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            assert "fmt: skip" not in line and "fmt: off" not in line, f"{rel(path)}:{number}"


def test_rule13_one_name_per_role():
    synonyms = re.compile(r"\b(actor|critic_model|policy_engine|generator_engine)\b", re.IGNORECASE)
    for path in SOURCES:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            assert not synonyms.search(line), f"{rel(path)}:{number}: say trainer/rollout instead"


def test_rule15_every_module_states_its_job():
    for path in [*SOURCES, REPO / "launch.py"]:
        docstring = ast.get_docstring(ast.parse(path.read_text()))
        assert docstring, f"{rel(path)} needs a module docstring stating its one job"


def test_rule14_ruff_lint_and_format():
    lint = subprocess.run([RUFF, "check", "."], cwd=REPO, capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout
    fmt = subprocess.run([RUFF, "format", "--check", "."], cwd=REPO, capture_output=True, text=True)
    assert fmt.returncode == 0, fmt.stdout
