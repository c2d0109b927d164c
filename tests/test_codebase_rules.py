"""The checkable codebase rules of docs/contributing.md, enforced; tests carry their numbers.

Each test names its rule; a failure says which file and line broke it.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
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
    for path in PACKAGE.rglob("config.py"):
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
