"""A checkpoint that fails is told to ``logging.notify`` (then raised, as before): through a real
local webhook, with the trainer's save failing in the RL loop's context of
``test_rl_schedule.py``."""

from __future__ import annotations

import dataclasses

import pytest
from harness.webhook import webhook
from test_rl_schedule import context

from relax_launch.deadline import wait_until
from relax_launch.notify import Notifier
from relax_launch.rl.checkpoints import save_checkpoint
from relax_launch.rl.data import PromptCursor


def test_a_failed_checkpoint_is_notified_and_still_raised(tmp_path):
    def full_disk(directory: str) -> list[str]:
        raise OSError(28, "No space left on device")

    with webhook() as hook:
        ctx = dataclasses.replace(context(tmp_path), notifier=Notifier([hook.url], "demo"))
        ctx.job.save_trainer = full_disk
        with pytest.raises(OSError, match="No space left"):
            save_checkpoint(ctx, 4, PromptCursor())
        assert wait_until(lambda: hook.messages, timeout_s=10), "no notification in 10 s"
    [message] = hook.messages
    assert message["title"] == "relax-launch demo: checkpoint failed"
    assert message["message"].startswith("step 4 in ") and "No space left" in message["message"]
