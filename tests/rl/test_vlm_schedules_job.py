"""A vision-language policy in the other schedules, real jobs (``vlm_tiny.yaml``, 2 steps each):
colocated (``defer``, ``split``: the trainer on both ranks, the rollout engine sharing rank 0,
the whole model handed over in memory), fully asynchronous (``algorithm.max_staleness``: the
continuous rollout's requests carry the images, interrupted generations continue with them) and
with an eval section of held-out visual prompts (decoupled, and in ``defer``'s turns). After
every sync the parity probe's text and image sequences match; without clearing SGLang's
image-feature cache on the colocated path the image sequence misses by 0.1 (docs/vlm.md)."""

from __future__ import annotations

import json

import pytest
from test_vlm_job import FP32_PARITY, run_job

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
COLOCATED = ["trainer.ranks=null"]  # the trainer on every rank
EVAL = [
    "eval.data.dataset=builtin:shape_counting",
    "eval.data.seed=12345",  # held-out seeds: other pictures than the training's
    "eval.max_prompts=2",
    "eval.every_steps=1",
    "eval.sampling.n_samples=2",
    "eval.sampling.temperature=1.0",
    "eval.pass_k=[1,2]",
]
JOBS = {
    "defer": ["placement.mode=defer", *COLOCATED, *EVAL],  # eval in turns of its own
    "split": ["placement.mode=split", *COLOCATED],
    # long replies so that the syncs interrupt generations, which continue with the images
    "async": ["algorithm.max_staleness=1", "algorithm.num_steps=3", "data.max_response_tokens=96"],
    "eval": EVAL,
}


@pytest.mark.parametrize("schedule", list(JOBS))
def test_a_vlm_trains_in_every_schedule_with_parity_after_every_sync(tmp_path, schedule):
    tiny = [f"logging.dir={tmp_path}", "algorithm.num_steps=2", "checkpoint.export_hf.at_end=false"]
    result = run_job(*tiny, *JOBS[schedule])
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-3000:]
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    print(json.dumps([{k: v for k, v in s.items() if "/" in k} for s in steps], indent=1))
    assert len(steps) == (3 if schedule == "async" else 2)
    for s in steps:
        assert s["sync/parity_gap"] <= FP32_PARITY and s["sync/parity_gap_image"] <= FP32_PARITY
        assert s["samples_invalid"] == 0 and s["grad_norm"] > 0
    if schedule == "async":
        assert sum(s["async/samples_staleness_1"] for s in steps) > 0
        # generations interrupted by a sync went on with their images (or started again)
        assert sum(s["async/resumed_samples"] + s["async/image_restarts"] for s in steps) > 0
    if schedule in ("eval", "defer"):
        for s in steps:
            assert s["eval/prompts"] == 2 and s["eval/samples_invalid"] == 0
            assert 0.0 <= s["eval/pass@1"] <= s["eval/pass@2"] <= 1.0
