"""Every config field is read by the code it configures: a field nobody reads is a silent knob.

Each section names its readers: the modules that are handed the section and act on it. A field
counts as read when one of its section's readers accesses an attribute of that name (or passes
it to ``getattr``). Scoping the scan to the readers keeps generic names honest: ``split`` or
``seed`` read anywhere else in the package does not count for ``data.split`` or ``data.seed``,
so dropping the reader of a field fails this test.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest
from pydantic import BaseModel

from relax_launch.config import JobConfig

PACKAGE = Path(__file__).resolve().parents[2] / "relax_launch"

ROLE_READERS = (
    "placement/planner.py",
    "inference/control_plane.py",
    "runtime/engines.py",
    "runtime/job.py",
    "rl/program.py",
    "runtime/session.py",
    "config/rules.py",
)
AUTOSCALE_READERS = (
    "runtime/autoscaler.py",
    "runtime/autoscale_policy.py",
    "inference/config.py",
)
# section path -> its readers (a path ending in / is a package); the longest prefix of a
# field's path chooses its readers
READERS: dict[str, tuple[str, ...]] = {
    "": (  # the job's own fields and its sections: the modules handed the whole JobConfig
        "launch.py",
        "cli.py",
        "commands/launcher.py",
        "runtime/job.py",
        "rl/program.py",
        "placement/planner.py",
    ),
    "cluster": (
        "placement/planner.py",
        "commands/launcher.py",
        "commands/sbatch.py",
        "runtime/job.py",
        "runtime/engines.py",
        "placement/memory_plan.py",
        "placement/device_memory.py",
        "commands/restarts.py",
        "config/rules.py",
        "placement/spare_pool.py",
    ),
    "cluster.spare_autoscale": ("runtime/pool_autoscaler.py",),
    "placement": ("placement/planner.py", "rl/program.py", "config/job.py"),
    "trainer": (
        "placement/planner.py",
        "trainer/model.py",
        "trainer/trainer.py",
        "trainer/config.py",
        "placement/memory.py",
        "trainer/vlm_policy.py",  # freeze_vision
    ),
    "rollout": ROLE_READERS,
    "teacher": ROLE_READERS,
    "genrm": ROLE_READERS,
    "gateway": ("inference/control_plane.py", "inference/gateway.py", "runtime/job.py"),
    "gateway.images": (
        "inference/images.py",
        "inference/image_config.py",
        "placement/preflight.py",
    ),
    "weight_sync": ("runtime/job.py", "runtime/parity_probe.py"),
    "weight_sync.parity_probe": ("runtime/parity_probe.py", "weights/parity.py"),
    "algorithm": ("rl/", "placement/planner.py"),
    "critic": (
        "rl/critic_config.py",
        "config/critic_rules.py",
        "rl/critic_step.py",
        "rl/phases.py",
        "runtime/critic_worker.py",
        "placement/critic_memory.py",
        "placement/critic_ranks.py",
    ),
    "algorithm.control": ("rl/control.py", "rl/program.py", "rl/config.py"),
    "data": ("rl/data.py", "rl/context.py", "rl/program.py", "placement/planner.py"),
    "eval": ("rl/evaluation.py", "rl/program.py", "rl/runner.py"),
    "eval.data": ("rl/data.py",),
    "data.reasoning_gym": ("rl/data.py", "rl/reasoning_gym_config.py"),
    "eval.data.reasoning_gym": ("rl/data.py", "rl/reasoning_gym_config.py"),
    "eval.sampling": ("rl/evaluation.py",),
    "reward": ("rl/rewards.py", "rl/inputs.py"),
    "reward.sources.code": ("rl/code_pool.py", "rl/inputs.py"),
    "checkpoint": ("rl/program.py", "commands/launcher.py", "rl/exports.py"),
    "checkpoint.export_hf": ("rl/exports.py", "config/job.py"),
    "trainer.lora": (
        "trainer/lora.py",
        "trainer/config.py",
        "commands/export.py",
        "runtime/engines.py",
        "runtime/workers.py",
    ),
    "rollout.autoscale": AUTOSCALE_READERS,
    "rollout.environment": (
        "rl/environments.py",
        "rl/environment_dataset.py",
        "config/environment_rules.py",
    ),
    "teacher.autoscale": AUTOSCALE_READERS,
    "genrm.autoscale": AUTOSCALE_READERS,
    "logging": (
        "rl/program.py",
        "rl/report.py",
        "runtime/job.py",
        "runtime/engines.py",
        "commands/launcher.py",
    ),
    "logging.wandb": ("rl/report.py",),
}


def section_fields(model: type[BaseModel], prefix: str = "") -> dict[str, str]:
    """``{dotted.path: field_name}`` of every field of a section, recursively."""
    fields = {}
    for name, info in model.model_fields.items():
        annotation = info.annotation
        nested = [
            a
            for a in (getattr(annotation, "__args__", None) or (annotation,))
            if isinstance(a, type) and issubclass(a, BaseModel)
        ]
        fields[prefix + name] = name
        for section in nested:
            fields.update(section_fields(section, f"{prefix}{name}."))
    return fields


@cache
def attributes_read(module: str) -> frozenset[str]:
    """Attribute names a module (or every module of a package, ``name/``) accesses."""
    paths = sorted((PACKAGE / module).rglob("*.py")) if module.endswith("/") else [PACKAGE / module]
    read = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                read.add(node.attr)
            elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "getattr":
                if len(node.args) > 1 and isinstance(node.args[1], ast.Constant):
                    read.add(node.args[1].value)
    return frozenset(read)


def readers_of(path: str, readers: dict[str, tuple[str, ...]]) -> tuple[str, ...]:
    """The readers of the longest section prefix of ``path`` (``eval.data.seed`` -> eval.data)."""
    parts = path.split(".")[:-1]
    while ".".join(parts) not in readers:
        parts.pop()
    return readers[".".join(parts)]


def unread(model: type[BaseModel], readers: dict[str, tuple[str, ...]]) -> list[str]:
    return sorted(
        path
        for path, name in section_fields(model).items()
        if not any(name in attributes_read(m) for m in readers_of(path, readers))
    )


def test_every_config_field_is_read_by_its_section_readers():
    missing = unread(JobConfig, READERS)
    assert not missing, (
        f"config fields their sections' readers never read: {missing}. Make the code it "
        "configures read it (and list that module in READERS), or delete the field: a field "
        "that is accepted must act."
    )


@pytest.mark.parametrize("module", sorted({m for ms in READERS.values() for m in ms}))
def test_every_reader_exists(module):
    assert (PACKAGE / module).exists(), f"{module} is gone: update READERS"


def test_a_dropped_reader_fails_the_rule():
    # data.prompt_key is read by rl/data.py alone; other modules reading a `prompt_key`
    # attribute (eval's readers) do not count for the data section
    without_data_py = READERS | {"data": tuple(m for m in READERS["data"] if m != "rl/data.py")}
    assert {"data.prompt_key", "data.split"} <= set(unread(JobConfig, without_data_py))


def test_the_scan_finds_a_field_that_nobody_reads():
    class Probe(BaseModel):
        never_read_by_anything_xyz: int = 0

    assert unread(Probe, {"": ("rl/", "runtime/")}) == ["never_read_by_anything_xyz"]
