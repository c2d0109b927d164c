"""The relax-launch CLI, run as a user runs it: a real subprocess of the installed script."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CLI = str(Path(sys.executable).with_name("relax-launch"))
PYTHON_CONFIGS = (REPO / "configs" / "python").glob("*.py")  # base.py: building blocks, no job
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
CONFIGS += sorted(p for p in PYTHON_CONFIGS if p.name != "base.py")
HEAVY = ("torch", "sglang", "megatron", "fastapi", "uvicorn", "transformers")
HEAVY += ("matplotlib", "wandb", "tensorboard", "rich")


def run(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CLI, *args], capture_output=True, text=True, cwd=cwd, timeout=60)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_plan_succeeds_on_every_shipped_config(config):
    result = run("plan", str(config))
    assert result.returncode == 0, result.stderr
    assert "phase order:" in result.stdout and "plan hash:" in result.stdout
    assert "Traceback" not in result.stderr


def test_plan_table_lists_every_rank_with_roles_and_phase():
    result = run("plan", "configs/split_8gpu.yaml")
    rows = [line.split() for line in result.stdout.splitlines()[2:10]]
    assert [r[0] for r in rows] == [str(i) for i in range(8)]
    assert "trainer[tp0" in result.stdout and "genrm[e0" in result.stdout
    assert "phase order: inference -> train" in result.stdout


def test_plan_json_is_the_plan():
    from relax_launch.placement import PlacementPlan

    result = run("plan", "configs/defer_8gpu.yaml", "--json")
    plan = PlacementPlan.from_json(result.stdout)
    assert plan.phase_order == ("rollout", "teacher", "genrm", "train")
    assert json.loads(result.stdout)["mode"] == "defer"


def test_plan_world_flags_and_overrides():
    result = run(
        "plan",
        "configs/split_8gpu.yaml",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "4",
        "trainer.tp_size=4",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert (data["nnodes"], data["nproc_per_node"], data["trainer"]["tp_size"]) == (2, 4, 4)


@pytest.mark.parametrize("suffix,magic", [(".svg", b"<svg"), (".png", b"\x89PNG")])
def test_plan_draws_a_picture(tmp_path, suffix, magic):
    out = tmp_path / f"plan{suffix}"
    result = run("plan", "configs/defer_8gpu.yaml", "--picture", str(out))
    assert result.returncode == 0, result.stderr
    assert out.read_bytes().startswith(magic)
    if suffix == ".svg":
        text = out.read_text()
        assert text.count("<rect") == 1 + 8 + 4 * (1 + 8)  # background, rank headers, 4 phase rows
        assert "#C44E52" in text and "teacher e1" in text


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["configs/quickstart_cpu.yaml", "rollout.ranks=2"], "needs 1 rank more"),
        (["configs/quickstart_cpu.yaml", "rollout.tp_siz=1"], "did you mean"),
        (["configs/split_8gpu.yaml", "trainer.ranks=4"], "remove trainer.ranks"),
        (["configs/quickstart_cpu.yaml", "--nproc-per-node", "3"], "3-rank world"),
        (["configs/missing.yaml"], "does not exist"),
        (["configs/quickstart_cpu.yaml", "--picture", "x.gif"], "must end in .svg or .png"),
    ],
)
def test_plan_rejects_with_exit_2_and_no_traceback(args, fragment):
    result = run("plan", *args)
    assert result.returncode == 2
    assert fragment in result.stderr
    assert result.stderr.startswith("relax-launch: ")
    assert "Traceback" not in result.stderr and result.stdout == ""


@pytest.mark.parametrize("command", [[], ["plan"], ["run"], ["config"]])
def test_every_command_has_help(command):
    result = run(*command, "--help")
    assert result.returncode == 0 and "Usage:" in result.stdout


def test_run_validates_before_starting_anything():
    result = run("run", "configs/quickstart_cpu.yaml", "rollout.ranks=2")
    assert result.returncode == 2 and "needs 1 rank more" in result.stderr
    assert "Traceback" not in result.stderr and "torchrun" not in result.stdout


def test_config_command_prints_the_full_config():
    result = run("config", "configs/quickstart_cpu.yaml", "trainer.lr=2e-6")
    data = json.loads(result.stdout)
    assert data["trainer"]["lr"] == 2e-6 and data["gateway"]["host"] == "127.0.0.1"


def test_cli_import_pulls_in_no_heavy_module():
    code = (
        "import sys, relax_launch.cli, relax_launch.config, relax_launch.placement;"
        "print(','.join(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    loaded = set(
        subprocess.check_output([sys.executable, "-c", code], text=True).strip().split(",")
    )
    assert not loaded.intersection(HEAVY), loaded.intersection(HEAVY)


def test_plan_shows_the_critic_on_the_trainer_ranks_and_its_memory():
    result = run("plan", "tests/rl/critic_tiny.yaml")
    assert result.returncode == 0, result.stderr
    assert (
        "critic: value model of builtin:tiny-llama on the trainer ranks 0-1 (tp=1 pp=1 dp=2)"
        in result.stdout
    )
    trainer_memory = [x for x in result.stdout.splitlines() if "trainer [active]" in x]
    assert trainer_memory and all("critic " in x for x in trainer_memory)


def test_plan_shows_a_colocated_critic_and_how_it_moves():
    colocated = ("placement.mode=defer", "trainer.ranks=null", "cluster.nproc_per_node=2")
    result = run("plan", "tests/rl/critic_tiny.yaml", *colocated)
    assert result.returncode == 0, result.stderr
    assert "critic [offloaded]" in result.stdout and "train critic" in result.stdout
    assert (
        "beside the policy's state through the turn (critic.offload=keep, by the memory plan)"
        in (result.stdout)
    )
    swapped = run("plan", "tests/rl/critic_tiny.yaml", *colocated, "critic.offload=swap")
    assert "critic values" in swapped.stdout
    swapping = "swapped with the policy's gradients and optimizer state"
    assert f"{swapping} (critic.offload=swap, by the config)" in swapped.stdout
