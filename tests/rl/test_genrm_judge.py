"""The GenRM reward source against a real judge: the job's control plane over the shared tiny
SGLang engine, asked exactly as an RL step asks it (in process, through its engine clients)."""

from __future__ import annotations

import functools

import pytest
from harness.prometheus_text import total

from relax_launch.inference.config import GatewayConfig, GenRMConfig
from relax_launch.inference.control_plane import ControlPlane, RoleSpec
from relax_launch.rl import rollout
from relax_launch.rl.config import RewardConfig
from relax_launch.rl.program import JUDGE_MAX_TOKENS
from relax_launch.rl.rewards import Rewards
from relax_launch.rl.samples import Sample

pytestmark = pytest.mark.e2e
MODEL = "builtin:tiny-llama"


def test_random_judge_writes_scores_that_become_rewards(tiny_server, tiny_model, tmp_path):
    spec = RoleSpec("genrm", MODEL, tiny_model, GenRMConfig(model=MODEL), "serving")
    plane = ControlPlane([spec], gateway=GatewayConfig(), admin_token=None, log_dir=tmp_path)
    plane.start()
    try:
        plane.attach("genrm", [tiny_server.url], startup_timeout_s=60)
        judge = functools.partial(rollout.judge, plane.engines, max_tokens=JUDGE_MAX_TOKENS)
        rewards = Rewards(RewardConfig(sources=[{"name": "judge", "genrm": True}]), judge=judge)
        samples = [
            Sample(0, f"What is {a} + {b}?", str(a + b), [1], [2], [-1.0], text, "0")
            for a, b, text in [(2, 3, "Answer: 5"), (7, 8, "Answer: 14"), (1, 1, "two, I think")]
        ]
        metrics = rewards.score(samples)
    finally:
        plane.close()
    counted = (tmp_path / "gateway_metrics.txt").read_text()
    # the judge's requests reached the engine from the controller, none through the gateway
    ok = {"role": "genrm", "endpoint": "generate", "model": "tiny-llama", "status": "200"}
    assert total(counted, "relax_controller_requests_total", **ok) == 3, counted
    assert total(counted, "relax_gateway_requests_total", role="genrm") == 0, counted
    # The random model never writes "Score: N" on its own (it fails to parse unconstrained):
    # decoded under the judge's regex, every reply is a score and reaches the reward.
    assert metrics["reward/judge/failed"] == 0
    assert all(s.valid for s in samples)
    scores = [s.rewards["judge"] for s in samples]
    assert all(0.0 <= v <= 1.0 for v in scores), scores
    assert [s.reward for s in samples] == scores  # one source of weight 1
    assert metrics["reward/judge"] == pytest.approx(sum(scores) / len(scores))
