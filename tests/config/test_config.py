"""One schema for YAML and Python: loading, overrides, freezing, and the generated reference."""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest

from relax_launch.config import (
    ConfigError,
    JobConfig,
    TrainerConfig,
    apply_overrides,
    build_config,
    load_config,
    with_overrides,
)
from relax_launch.config.reference import render_reference

REPO = Path(__file__).resolve().parents[2]
YAML_CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


def test_every_shipped_config_loads():
    assert len(YAML_CONFIGS) >= 5
    for path in YAML_CONFIGS:
        assert isinstance(load_config(path), JobConfig)


@pytest.mark.parametrize("path", YAML_CONFIGS, ids=lambda p: p.stem)
def test_python_twin_equals_yaml(path):
    twin = REPO / "configs" / "python" / f"{path.stem}.py"
    assert twin.is_file(), f"configs/python/{path.stem}.py is missing"
    assert load_config(twin) == load_config(path)


def test_overrides_are_typed_and_nested():
    job = load_config(
        REPO / "configs" / "quickstart_cpu.yaml",
        [
            "rollout.engine.max_total_tokens=1024",
            "trainer.lr=3e-6",
            "teacher=null",
            "algorithm.distill_coef=0",
            "reward.sources.0.weight=0.5",
            "name=renamed",
        ],
    )
    assert job.rollout.engine["max_total_tokens"] == 1024
    assert job.trainer.lr == pytest.approx(3e-6)
    assert job.teacher is None and job.name == "renamed"
    assert job.reward.sources[0].weight == 0.5


def test_override_creates_missing_sections():
    data = apply_overrides({"trainer": {"model": "m"}}, ["genrm.model=judge", "genrm.ranks=2"])
    assert data["genrm"] == {"model": "judge", "ranks": 2}


def test_override_list_index_out_of_range():
    with pytest.raises(ConfigError, match="list index 3 is out of range"):
        apply_overrides({"reward": {"sources": [{"name": "a"}]}}, ["reward.sources.3.weight=1"])


def test_with_overrides_revalidates():
    job = load_config(REPO / "configs" / "quickstart_cpu.yaml")
    assert with_overrides(job, ["algorithm.num_steps=3"]).algorithm.num_steps == 3
    with pytest.raises(ConfigError, match="rollout.ranks"):
        with_overrides(job, ["rollout.ranks=-1"])


def test_config_is_frozen():
    job = load_config(REPO / "configs" / "quickstart_cpu.yaml")
    with pytest.raises(pydantic.ValidationError):
        job.trainer.lr = 1.0
    with pytest.raises(pydantic.ValidationError):
        job.name = "other"


def test_python_api_rejects_unknown_fields():
    with pytest.raises(pydantic.ValidationError, match="learning_rate"):
        TrainerConfig(model="m", learning_rate=1.0)


def test_every_field_is_documented():
    reference = render_reference()
    assert "**required**" in reference
    for line in reference.splitlines():
        if line.startswith("| `"):
            assert not line.rstrip().endswith("|  |"), f"undocumented field: {line}"


def test_configuration_doc_is_current():
    current = (REPO / "docs" / "configuration.md").read_text()
    assert current == render_reference(), (
        "docs/configuration.md is stale: run "
        "python -m relax_launch.config.reference > docs/configuration.md"
    )


@pytest.mark.parametrize(
    "text,message",
    [
        ("trainer: [1, 2]", "trainer"),
        ("- just\n- a list", "must hold a mapping"),
        ("trainer: {model: m, ranks: 2\n", "not valid YAML"),
    ],
)
def test_malformed_yaml_files(tmp_path, text, message):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(path)


def test_python_config_errors_are_config_errors(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('oops')\n")
    with pytest.raises(ConfigError, match="failed to run: RuntimeError: oops"):
        load_config(broken)
    invalid = tmp_path / "invalid.py"
    invalid.write_text(
        "from relax_launch.config import JobConfig, TrainerConfig\n"
        "config = JobConfig(trainer=TrainerConfig(model='m', ranks=2, tp_size=0))\n"
    )
    with pytest.raises(ConfigError, match="tp_size"):
        load_config(invalid)
    empty = tmp_path / "empty.py"
    empty.write_text("x = 1\n")
    with pytest.raises(ConfigError, match="must define `config = JobConfig"):
        load_config(empty)


def test_engines_take_the_trainers_dtype_unless_their_engine_says_otherwise():
    raw = {
        "cluster": {"nproc_per_node": 3, "device": "cpu"},
        "trainer": {"model": "m", "ranks": 1, "dtype": "bfloat16"},
        "rollout": {"ranks": 1, "engine": {"max_total_tokens": 64}},
        "teacher": {"model": "t", "engine": {"max_total_tokens": 64, "dtype": "float32"}},
        "algorithm": {"distill_coef": 0.1},
    }
    job = build_config(raw)
    assert (job.engine_dtype("rollout"), job.engine_dtype("teacher")) == ("bfloat16", "float32")
    assert job.precision_notice() is None  # a teacher at another precision changes no ratio
    assert job.rollout_correction() == "none"  # same precision, on-policy
    mismatched = build_config(raw, ["rollout.engine.dtype=float32"])
    assert mismatched.rollout_correction() == "token_tis"  # auto: another precision
    assert "rollout_correction=token_tis weights each token" in mismatched.precision_notice()
    uncorrected = build_config(
        raw, ["rollout.engine.dtype=float32", "algorithm.rollout_correction=none"]
    )
    assert "importance ratios start away from 1" in uncorrected.precision_notice()
    with pytest.raises(ConfigError, match="rollout.engine.dtype='fp16' is not one of"):
        build_config(raw, ["rollout.engine.dtype=fp16"])
