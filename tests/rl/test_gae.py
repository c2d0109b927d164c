"""PPO with a learned value model against hand-computed values: GAE per response token, returns,
whitening over the batch, explained variance, the clipped value loss and its gradient, how the
step hands each of them to the policy and the critic, and the config rules of the critic."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from relax_launch.config import ConfigError
from relax_launch.config.loading import build_config
from relax_launch.rl.batch import assign_advantages, to_batch
from relax_launch.rl.critic_step import advantages_and_returns, train_with_critic
from relax_launch.rl.gae import explained_variance, gae, returns, whiten
from relax_launch.rl.samples import Sample
from relax_launch.trainer.critic_loss import value_loss
from relax_launch.trainer.losses import LossSpec


def approx(values, tol=1e-6):
    return pytest.approx(values, abs=tol)


def test_gae_by_hand():
    values = [0.5, 0.2, -0.1]
    # delta_2 = 1 - (-0.1) = 1.1; delta_1 = 0.9 * -0.1 - 0.2 = -0.29; delta_0 = 0.9 * 0.2 - 0.5
    # A_2 = 1.1; A_1 = -0.29 + 0.72 * 1.1 = 0.502; A_0 = -0.32 + 0.72 * 0.502 = 0.04144
    advantages = gae(values, 1.0, gamma=0.9, lam=0.8)
    assert advantages == approx([0.04144, 0.502, 1.1])
    assert returns(advantages, values) == approx([0.54144, 0.702, 1.0])


def test_gae_limits_are_monte_carlo_and_td0():
    values = [0.5, 0.2, -0.1]
    assert gae(values, 1.0, gamma=1.0, lam=1.0) == approx([0.5, 0.8, 1.1])  # R - V
    assert gae(values, 1.0, gamma=1.0, lam=0.0) == approx([-0.3, -0.3, 1.1])  # one-step TD


def test_whitening_is_over_the_trained_tokens_of_the_batch():
    rows, masks = [[1.0, 2.0, 7.0], [3.0, 9.0]], [[1.0, 1.0, 0.0], [1.0, 0.0]]
    std = (2 / 3) ** 0.5  # of 1, 2, 3 around 2
    out = whiten(rows, masks)
    assert out == [approx([-1 / std, 0.0, 0.0], 1e-5), approx([1 / std, 0.0], 1e-5)]


def test_explained_variance_by_hand():
    # R - V = [0, 1] (variance 0.25), R = [1, 3] (variance 1): 1 - 0.25 = 0.75; masked out: 9
    assert explained_variance([[1.0, 2.0, 9.0]], [[1.0, 3.0, 0.0]], [[1, 1, 0]]) == approx(0.75)
    assert explained_variance([[1.0, 3.0]], [[1.0, 3.0]], [[1, 1]]) == approx(1.0)


def test_clipped_value_loss_and_its_gradient_by_hand():
    values = torch.tensor([[1.0, 0.5, 2.0, 5.0]], requires_grad=True)
    old = torch.tensor([[0.8, 0.5, 1.0, 0.0]])
    targets = torch.tensor([[0.0, 1.0, 3.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    loss, count, sums = value_loss(values, old, targets, mask, clip=0.1)
    # 0.5 * max(1, 0.81) + 0.5 * 0.25 + 0.5 * max(1, (1.1 - 3)^2 = 3.61); the masked 5 is out
    assert float(loss) == pytest.approx(0.5 + 0.125 + 1.805) and float(count) == 3
    assert float(sums["value_clipped"]) == 1 and float(sums["value_sum"]) == pytest.approx(3.5)
    loss.backward()
    # the clipped token's term is flat in V: no gradient; the others (V - R)
    assert values.grad.tolist() == [approx([1.0, -0.5, 0.0, 0.0])]
    unclipped, _, _ = value_loss(values, old, targets, mask, clip=None)
    assert float(unclipped) == pytest.approx(0.5 * (1 + 0.25 + 1))


def sample(reward: float, response: int = 3, valid: bool = True) -> Sample:
    s = Sample(0, "q", None, [1, 2], [5] * response, [-1.0] * response, "", "0", "stop")
    s.reward, s.valid = reward, valid
    return s


def test_advantages_start_at_the_first_response_token():
    # targets of [1, 2, 5, 5, 5]: position 0 predicts the prompt's 2, 1..3 the response
    values = [[9.0, 0.5, 0.2, -0.1]]
    advantages, targets = advantages_and_returns([sample(1.0)], values, 0.9, 0.8)
    assert advantages == [approx([0.0, 0.04144, 0.502, 1.1])]
    assert targets == [approx([0.0, 0.54144, 0.702, 1.0])]


def test_gae_leaves_the_group_estimator_out():
    samples = [sample(1.0), sample(0.0)]
    assign_advantages(samples, 2, "gae")
    assert [s.advantage for s in samples] == [0.0, 0.0]


class RecordingTurns:
    """The critic's memory moments, recorded in the job's calls (runtime/critic_turns.py)."""

    def __init__(self, calls):
        self.calls = calls

    def __getattr__(self, moment):
        if moment == "take_moved":
            return lambda: {"critic_onloaded": 2e9}
        return lambda: self.calls.append((moment,))


class RecordingJob:
    """The Job's critic and trainer calls, recorded (the real ones: tests/rl/test_critic_job.py)."""

    def __init__(self, values):
        self.values, self.calls = values, []
        self.critic_turns = RecordingTurns(self.calls)

    def critic_values(self, batch):
        self.calls.append(("values", batch))
        return self.values

    def train_step(self, batch, spec):
        self.calls.append(("policy", batch))
        return {"loss": 0.1}

    def train_critic(self, batch, clip):
        self.calls.append(("critic", batch, clip))
        return {"critic/value_loss": 0.5, "critic/clip_fraction": 0.0, "critic/grad_norm": 1.0}


def test_the_step_scores_values_trains_the_policy_then_the_critic():
    samples = [sample(1.0), sample(0.0), sample(1.0, valid=False)]
    values = [[9.0, 0.5, 0.2, -0.1], [9.0, 0.1, 0.1, 0.1], [9.0, 0.0, 0.0, 0.0]]
    job = RecordingJob(values)
    algorithm = SimpleNamespace(gamma=1.0, lam=1.0)
    critic = SimpleNamespace(value_clip=0.2, mini_batches=1)
    ctx = SimpleNamespace(job=job, algorithm=algorithm, critic=critic)
    batch = to_batch(samples, 0.0)
    metrics = train_with_critic(ctx, samples, batch, LossSpec())
    assert [c[0] for c in job.calls if len(c) > 1] == ["values", "policy", "critic"]
    # the critic's memory moves before each moment, and the turn ends with done
    assert [c[0] for c in job.calls] == [
        "scoring",
        "values",
        "policy_training",
        "policy",
        "critic_training",
        "critic",
        "done",
    ]
    assert metrics["memory/critic_onloaded_gb"] == 2.0
    # lam = gamma = 1: A = R - V on the trained tokens (the invalid sample is not trained on)
    raw = [0.5, 0.8, 1.1, -0.1, -0.1, -0.1]
    mean = sum(raw) / 6
    std = (sum((a - mean) ** 2 for a in raw) / 6) ** 0.5
    policy = job.calls[3][1]
    assert policy.token_weights[0] == approx([0, 0, *((a - mean) / std for a in raw[:3])], 1e-5)
    assert policy.token_weights[2] == (0.0,) * 5
    _, trained, clip = job.calls[5]
    assert clip == 0.2 and trained.tokens == batch.tokens
    assert trained.token_weights[0] == approx([0, 0, 1.0, 1.0, 1.0])  # returns R
    assert trained.old_logprobs[0] == approx([0, 9.0, 0.5, 0.2, -0.1])  # V_old
    assert metrics["critic/value_mean"] == approx((0.5 + 0.2 - 0.1 + 0.3) / 6)
    # R - V = [.5, .8, 1.1, -.1, -.1, -.1]: variance 0.2325; R = [1, 1, 1, 0, 0, 0]: 0.25
    assert metrics["critic/explained_variance"] == approx(1 - 0.2325 / 0.25)
    assert metrics["critic/value_loss"] == 0.5 and metrics["loss"] == 0.1


RAW = {
    "cluster": {"nproc_per_node": 2, "device": "cpu"},
    "trainer": {"model": "m", "ranks": 1},
    "rollout": {"engine": {"max_total_tokens": 64}},
    "data": {"prompts_per_step": 2},
    "algorithm": {"n_samples_per_prompt": 4, "advantage_estimator": "gae"},
    "critic": {"lr": 1e-5},
}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["critic=null"], "advantage_estimator=gae needs a value model"),
        (["algorithm.advantage_estimator=grpo"], "which algorithm.advantage_estimator=grpo"),
        (["critic=null", "algorithm.advantage_estimator=grpo", "algorithm.lam=0.9"], "GAE's"),
        (["critic.offload=swap"], "critic.offload=swap acts in a colocated placement"),
        (["critic.ranks=own"], "critic.ranks=own"),
        (["critic.tp_size=2"], "critic.tp_size=2 differs from trainer.tp_size=1"),
        (["critic.micro_batch_size=3"], "make the step a multiple of 3"),
        (["critic.mini_batches=16"], "critic.mini_batches=16"),
        (["algorithm.dynamic_sampling=true"], "turn dynamic_sampling off"),
    ],
)
def test_critic_settings_that_would_not_act_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        build_config(RAW, overrides)


def test_a_critic_on_the_trainer_layout_is_accepted_and_built_from_the_policy():
    job = build_config(RAW, ["critic.micro_batch_size=2", "trainer.lr=1e-6"])
    section = job.critic.trainer_section(job.trainer)
    assert section.model == "m" and section.lr == 1e-5 and section.micro_batch_size == 2
    assert section.lora is None and not section.distributed_optimizer
    assert job.algorithm.gamma == 1.0 and job.algorithm.lam == 0.95


@pytest.mark.parametrize("mode", ["split", "defer"])
def test_a_critic_is_accepted_in_colocated_placement(mode):
    job = build_config(RAW, [f"placement.mode={mode}", "trainer.ranks=null", "critic.offload=swap"])
    assert job.placement.mode == mode and job.critic.offload == "swap"


def test_a_failed_step_still_ends_the_critics_turn():
    job = RecordingJob([[9.0, 0.5, 0.2, -0.1]])
    job.train_step = lambda batch, spec: (_ for _ in ()).throw(RuntimeError("policy failed"))
    ctx = SimpleNamespace(
        job=job, algorithm=SimpleNamespace(gamma=1.0, lam=1.0), critic=SimpleNamespace()
    )
    with pytest.raises(RuntimeError, match="policy failed"):
        train_with_critic(ctx, [sample(1.0)], to_batch([sample(1.0)], 0.0), LossSpec())
    assert [c[0] for c in job.calls] == ["scoring", "values", "policy_training", "done"]
