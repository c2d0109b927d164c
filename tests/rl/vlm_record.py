"""A reward source that records each step's samples as the teacher scored them (their token ids,
images, the rollout engine's and the teacher's logprobs), for ``test_vlm_scorers_job.py``; it
rewards nothing. ``RELAX_TEST_RECORD`` names the file prefix (step k is written to PREFIX.k)."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def samples(batch) -> list[float]:
    prefix = Path(os.environ["RELAX_TEST_RECORD"])
    step = len(list(prefix.parent.glob(f"{prefix.name}.*"))) + 1
    rows = [
        {
            "prompt_ids": s.prompt_ids,
            "response_ids": s.response_ids,
            "logprobs": s.logprobs,
            "teacher_logprobs": s.teacher_logprobs,
            "pixel_values": None if s.images is None else s.images.pixel_values,
            "grids": None if s.images is None else s.images.grids,
        }
        for s in batch
    ]
    torch.save(rows, f"{prefix}.{step}")
    return [0.0] * len(batch)
