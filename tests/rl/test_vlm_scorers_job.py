"""Real RL jobs of a vision-language policy (``vlm_tiny.yaml``, two steps each) with a teacher and
with judges: the teacher, the initial policy itself, scores the policy's sampled sequences with
their images exactly as the trainer does (its logprobs = the trainer's, and off them with the
other prompt's image); a vision-language judge is shown the images and a text judge, routed by
its reward source, the text alone, both answering every sample."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from relax_launch.inference.process import free_port
from relax_launch.models.build import ensure_model

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
HERE = Path(__file__).parent
CONFIG = HERE / "vlm_tiny.yaml"
VLM = "builtin:tiny-qwen2.5-vl"
ENGINE = "{max_total_tokens: 4096, image_processor_backend: pil}"
REWARDS = (
    "{name: count, function: 'builtin:exact_numeric'}, "
    "{name: alternating, function: 'tiny_rewards:alternating'}"
)
FP32_PARITY = 1e-5  # trainer and engines in float32: the probe's gap is float32 rounding


def run_job(tmp_path: Path, *overrides: str, **env: str) -> list[dict]:
    """The job's metrics, one row per step, once it finished."""
    cli = Path(sys.executable).with_name("relax-launch")
    result = subprocess.run(
        [str(cli), "run", str(CONFIG), f"logging.dir={tmp_path}", "algorithm.num_steps=2"]
        + ["cluster.nproc_per_node=3", *overrides],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONPATH": str(HERE), **env},
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-3000:]
    assert "finished 2 steps" in result.stdout
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def trainer_logprobs(record: Path, env: dict[str, str]) -> dict:
    """``vlm_logprobs_worker.py``'s report on the recorded samples (one torchrun rank)."""
    torchrun = Path(sys.executable).with_name("torchrun")
    worker = HERE / "vlm_logprobs_worker.py"
    with tempfile.TemporaryDirectory(prefix="torchrun-worker-") as logs:
        result = subprocess.run(
            [str(torchrun), "--nproc-per-node", "1", "--master-port", str(free_port())]
            + ["--log-dir", logs, "--redirects", "1", str(worker)]
            + [str(ensure_model(VLM)), str(record)],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        assert result.returncode == 0, result.stderr[-4000:]
        (out,) = Path(logs).glob("**/attempt_*/0/stdout.log")
        return json.loads(next(x for x in out.read_text().splitlines() if x.startswith("{")))


def largest_gap(rows: list[dict], scored: list[list[float]]) -> float:
    return max(
        abs(t - s)
        for row, mine in zip(rows, scored, strict=True)
        if row["teacher_logprobs"]
        for t, s in zip(row["teacher_logprobs"], mine, strict=True)
    )


def test_a_vlm_teacher_scores_the_policys_samples_with_their_images(tmp_path, venv_env):
    import torch

    record = tmp_path / "record" / "samples"
    record.parent.mkdir()
    steps = run_job(
        tmp_path,
        f"teacher={{model: '{VLM}', ranks: 1, engine: {ENGINE}}}",
        "algorithm.distill_coef=1.0",
        f"reward.sources=[{REWARDS}, {{name: record, function: 'vlm_record:samples'}}]",
        RELAX_TEST_RECORD=str(record),
    )
    keys = ("loss", "reverse_kl", "teacher/unscored", "grad_norm")
    print(json.dumps([{k: s.get(k) for k in keys} for s in steps]))
    assert [s["step"] for s in steps] == [1, 2]
    assert all(math.isfinite(s["loss"]) and math.isfinite(s["reverse_kl"]) for s in steps)
    assert all(s["sync/parity_gap_image"] <= FP32_PARITY for s in steps)
    # step 1's samples (the teacher is the initial policy) as the trainer scores them
    rows = torch.load(f"{record}.1", weights_only=False)
    scored = [r for r in rows if r["teacher_logprobs"]]
    assert all(r["pixel_values"] is not None for r in rows) and len(rows) == 8
    assert len(scored) >= 4  # a response showing a media placeholder is not scored
    assert steps[0]["teacher/unscored"] == len(rows) - len(scored)  # and is counted
    report = trainer_logprobs(Path(f"{record}.1"), venv_env)
    ours = largest_gap(rows, report["responses"])
    other = largest_gap(rows, report["other_image"])
    print(
        f"{len(scored)} of {len(rows)} samples scored; teacher vs trainer: {ours:.2e}; "
        f"with the other prompt's image: {other:.2e}"
    )
    assert ours <= FP32_PARITY
    assert other > 100 * FP32_PARITY  # so the teacher read each sample's own image
    assert abs(steps[0]["reverse_kl"]) <= FP32_PARITY  # the teacher is the initial policy
    assert abs(steps[1]["reverse_kl"]) > 10 * FP32_PARITY  # the student moved off it


def test_a_vlm_judge_sees_the_images_and_a_text_judge_the_text(tmp_path):
    text_judge = "{model: 'builtin:tiny-llama', ranks: 1, route_keys: [plain]}"
    steps = run_job(
        tmp_path,
        "cluster.nproc_per_node=4",
        f"genrm={{model: '{VLM}', ranks: 1, engine: {ENGINE}, models: [{text_judge}]}}",
        f"reward.sources=[{REWARDS}, {{name: judge, genrm: true}}, {{name: plain, genrm: true}}]",
    )
    print(json.dumps([{k: v for k, v in s.items() if k.startswith("reward")} for s in steps]))
    for s in steps:
        assert 0.0 <= s["reward/judge"] <= 1.0 and s["reward/judge/failed"] == 0
        assert s["reward/judge/images"] == 8  # 2 prompts x 4 samples, one image each
        assert 0.0 <= s["reward/plain"] <= 1.0 and s["reward/plain/failed"] == 0
        assert "reward/plain/images" not in s
