"""The loss and advantage family against hand-computed values: Dr.GRPO, RLOO, REINFORCE++ with a
group baseline, GSPO's sequence ratio, token-sum aggregation, truncated and masked importance
sampling between engine and trainer, DAPO's over-long shaping and filtering, dynamic sampling."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from relax_launch.config import ConfigError
from relax_launch.config.loading import build_config
from relax_launch.rl.advantages import dr_grpo, overlong_penalty, reinforce_pp_baseline, rloo
from relax_launch.rl.batch import assign_advantages, shape_overlong, to_batch
from relax_launch.rl.config import AlgorithmConfig
from relax_launch.rl.data import PromptCursor
from relax_launch.rl.dynamic_sampling import keep_groups_with_signal
from relax_launch.rl.evaluation import Evaluation, pass_at_k
from relax_launch.rl.samples import Sample
from relax_launch.trainer.losses import LossSpec, aggregate, policy_loss


def sample(reward: float, length: int = 2, finish: str = "stop", group: int = 0) -> Sample:
    s = Sample(group, "q", None, [1, 2], [5] * length, [-1.0] * length, "", "0", finish)
    s.reward = reward
    return s


def test_dr_grpo_rloo_and_reinforce_pp_by_hand():
    rewards = [[1.0, 0.0, 0.0, 1.0], [3.0, 0.0, 0.0]]
    # group means 0.5 and 1.0
    assert dr_grpo(rewards) == [[0.5, -0.5, -0.5, 0.5], [2.0, -1.0, -1.0]]
    # leave one out: 1 - 1/3, 0 - 2/3; 3 - 0, 0 - 3/2
    assert rloo(rewards) == [
        pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3]),
        pytest.approx([3.0, -1.5, -1.5]),
    ]
    # centred values 0.5,-0.5,-0.5,0.5,2,-1,-1: mean 0, variance (4*0.25 + 4 + 1 + 1) / 7 = 1
    assert reinforce_pp_baseline(rewards) == [
        pytest.approx([0.5, -0.5, -0.5, 0.5], abs=1e-5),
        pytest.approx([2.0, -1.0, -1.0], abs=1e-5),
    ]
    assert reinforce_pp_baseline([[1.0, 1.0]]) == [[0.0, 0.0]]  # no signal anywhere


def test_the_configured_estimator_is_applied_per_group():
    samples = [sample(1.0), sample(0.0), sample(3.0), sample(0.0)]
    samples[1].valid = False  # group 0 has one scored sample: no advantage
    assign_advantages(samples, 2, "rloo")
    assert [s.advantage for s in samples] == [0.0, 0.0, 3.0, -3.0]


def test_overlong_penalty_by_hand():
    # max 16, buffer 4: free up to 12 tokens, then -1/4 per token down to -1 at 16
    assert [overlong_penalty(n, 16, 4, 1.0) for n in (12, 13, 14, 16)] == [0.0, -0.25, -0.5, -1.0]
    assert overlong_penalty(16, 16, 0, 1.0) == 0.0  # off
    assert overlong_penalty(14, 16, 4, 0.5) == -0.25


def test_overlong_shaping_and_filtering_reach_the_batch():
    algorithm = AlgorithmConfig(overlong_buffer_tokens=4, mask_truncated=True)
    short, long = sample(1.0, length=10), sample(1.0, length=16, finish="length")
    assert shape_overlong([short, long], algorithm, max_tokens=16) == 1
    assert (short.reward, long.reward) == (1.0, 0.0)
    assert long.rewards["overlong"] == -1.0
    batch = to_batch([short, long], distill_coef=0.0)
    assert sum(batch.loss_mask[0]) == 10 and sum(batch.loss_mask[1]) == 0  # cut: not trained


def test_token_sum_aggregation_divides_by_a_constant_length():
    per_token = torch.tensor([[1.0, 2.0, 0.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    loss_sum, count = aggregate(per_token, mask, "token_sum", max_tokens=8)
    assert (float(loss_sum), float(count)) == (7.0, 16.0)  # 2 sequences x 8 tokens


def test_gspo_ratio_is_the_sequence_mean_and_its_gradient_by_hand():
    old = torch.tensor([[-1.0, -1.0]])
    logprobs = torch.tensor([[-0.8, -1.1]], requires_grad=True)
    mask, advantages = torch.ones(1, 2), torch.full((1, 2), 2.0)
    spec = LossSpec(clip_low=1.0, clip_high=1.0, ratio="sequence", aggregation="sequence")
    loss_sum, count, _ = policy_loss(logprobs, old, advantages, mask, spec)
    s = math.exp((0.2 - 0.1) / 2)  # exp(mean log-ratio)
    assert float(loss_sum) == pytest.approx(-s * 2.0)
    loss_sum.backward()
    # d/dlogp_t of -(1/2) sum_t s * A with s carrying each token's gradient: -s * A / 2
    assert logprobs.grad.flatten().tolist() == pytest.approx([-s, -s])
    # a ratio past the clip range clips the whole sequence: no gradient for any token
    logprobs.grad = None
    tight = LossSpec(clip_low=0.01, clip_high=0.01, ratio="sequence", aggregation="sequence")
    policy_loss(logprobs, old, advantages, mask, tight)[0].backward()
    assert logprobs.grad.tolist() == [[0.0, 0.0]]


def test_token_tis_weights_each_token_by_its_truncated_ratio():
    engine = torch.tensor([[-1.0, -3.0]])
    logprobs = torch.tensor([[-1.5, -1.0]], requires_grad=True)  # ratios exp(-0.5), exp(2)
    mask, advantages = torch.ones(1, 2), torch.ones(1, 2)
    spec = LossSpec(correction="token_tis", correction_cap=2.0)
    loss_sum, count, sums = policy_loss(logprobs, engine, advantages, mask, spec)
    loss_sum.backward()
    # PPO's ratio is to the trainer's own logprobs (1, never clipped), times min(ratio, 2)
    assert logprobs.grad.flatten().tolist() == pytest.approx([-math.exp(-0.5), -2.0])
    assert float(sums["clipped"]) == 0.0
    assert float(sums["is_cut"]) == 1.0 and float(sums["is_ratio_max"]) == pytest.approx(
        math.exp(2.0)
    )
    # k3 of KL(engine || trainer): exp(d) - d - 1 per token, d = trainer - engine
    expected = sum(math.exp(d) - d - 1 for d in (-0.5, 2.0))
    assert float(sums["mismatch_kl"]) == pytest.approx(expected)
    assert float(sums["approx_kl"]) == pytest.approx(0.5 - 2.0)  # engine - trainer, summed
    # without a correction the same mismatch is what PPO clips
    plain = policy_loss(logprobs, engine, advantages, mask, LossSpec())[2]
    assert float(plain["clipped"]) == 2.0 and "is_cut" not in plain


def test_sequence_mis_drops_sequences_over_the_cap_and_weights_the_rest():
    engine = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]])
    # sequence 0: log-ratio 0.1 + 0.2 (ratio 1.35, kept); sequence 1: 0.5 + 0.5 (2.72 > 2)
    logprobs = torch.tensor([[-0.9, -0.8], [-0.5, -0.5]], requires_grad=True)
    mask, advantages = torch.ones(2, 2), torch.ones(2, 2)
    spec = LossSpec(correction="sequence_mis", correction_cap=2.0)
    loss_sum, _, sums = policy_loss(logprobs, engine, advantages, mask, spec)
    loss_sum.backward()
    kept = math.exp(0.3)
    assert logprobs.grad.flatten().tolist() == pytest.approx([-kept, -kept, 0.0, 0.0])
    assert float(sums["is_cut"]) == 2.0  # both tokens of the dropped sequence
    assert float(sums["is_ratio_max"]) == pytest.approx(math.exp(1.0))


def test_masked_positions_stay_out_of_every_correction():
    engine = torch.tensor([[-1.0, -1.0, 0.0]])
    logprobs = torch.tensor([[-1.0, -1.0, -60.0]], requires_grad=True)  # last token masked
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    for correction in ("token_tis", "sequence_mis"):
        spec = LossSpec(correction=correction)
        loss_sum, _, sums = policy_loss(logprobs, engine, torch.ones(1, 3), mask, spec)
        assert float(sums["is_ratio_max"]) == pytest.approx(1.0)
        assert float(sums["is_cut"]) == 0.0 and float(sums["mismatch_kl"]) == 0.0


def scripted_rounds(*rounds: list[float]):
    """A draw function whose rounds of 2 prompts x 2 samples have the given rewards."""
    remaining = iter(rounds)

    def draw():
        rewards = next(remaining)
        samples = [sample(r, group=i // 2) for i, r in enumerate(rewards)]
        return samples, PromptCursor(seen=len(rewards)), {"reward/answer": sum(rewards) / 4}

    return draw


def dynamic(**algorithm) -> AlgorithmConfig:
    return AlgorithmConfig(n_samples_per_prompt=2, dynamic_sampling=True, **algorithm)


def test_dynamic_sampling_draws_until_the_groups_have_signal():
    draw = scripted_rounds([1, 1, 1, 0], [0, 0, 0, 1], [1, 0, 1, 0])
    samples, cursor, metrics = keep_groups_with_signal(dynamic(), 2, draw, draw())
    # round 1 keeps group (1, 0); round 2 keeps (0, 1): full after 2 rounds, round 3 not drawn
    assert [s.reward for s in samples] == [1, 0, 0, 1]
    assert [s.group for s in samples] == [0, 0, 1, 1]
    assert metrics["data/sampling_rounds"] == 2 and metrics["data/groups_without_signal"] == 2
    assert metrics["data/groups_padded"] == 0
    assert metrics["reward/answer"] == pytest.approx((0.75 + 0.25) / 2)  # over every round


def test_dynamic_sampling_is_bounded_and_fills_with_flat_groups():
    draw = scripted_rounds([1, 1, 0, 1], [0, 0, 1, 1], [0, 1, 0, 1])
    algorithm = dynamic(dynamic_sampling_max_rounds=2)
    samples, cursor, metrics = keep_groups_with_signal(algorithm, 2, draw, draw())
    assert [s.reward for s in samples] == [0, 1, 1, 1]  # one with signal, one padded
    assert metrics["data/groups_padded"] == 1 and metrics["data/sampling_rounds"] == 2
    assert cursor.seen == 4  # the second round's: the third was never drawn


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algorithm.dynamic_sampling_max_rounds=2"], "acts only with algorithm.dynamic_sampling"),
        (["algorithm.overlong_penalty=0.5"], "acts only with algorithm.overlong_buffer_tokens"),
        (["algorithm.overlong_buffer_tokens=16"], "must be below data.max_response_tokens=16"),
        (["algorithm.rollout_correction_cap=3"], "the rollout correction is none"),
        (["algorithm.rollout_correction=off"], "rollout_correction: Input should be"),
    ],
)
def test_algorithm_knobs_that_would_not_act_are_refused(overrides, message):
    raw = {
        "cluster": {"nproc_per_node": 2, "device": "cpu"},
        "trainer": {"model": "m", "ranks": 1},
        "rollout": {"engine": {"max_total_tokens": 64}},
        "data": {"max_response_tokens": 16},
    }
    with pytest.raises(ConfigError, match=message):
        build_config(raw, overrides)


def test_dynamic_sampling_is_refused_in_defer_only():
    raw = {
        "cluster": {"nproc_per_node": 2, "device": "cpu"},
        "placement": {"mode": "defer"},
        "trainer": {"model": "m"},
        "rollout": {"engine": {"max_total_tokens": 64}},
        "algorithm": {"dynamic_sampling": True},
    }
    with pytest.raises(ConfigError, match="placement.mode=defer cannot do"):
        build_config(raw)
    assert build_config(raw, ["placement.mode=split"]).algorithm.dynamic_sampling


def test_off_policy_turns_the_correction_on_and_says_so():
    raw = {
        "cluster": {"nproc_per_node": 2, "device": "cpu"},
        "trainer": {"model": "m", "ranks": 1},
        "rollout": {"engine": {"max_total_tokens": 64}},
        "algorithm": {"off_policy_steps": 1},
    }
    job = build_config(raw)
    assert job.rollout_correction() == "token_tis"
    assert "truncated at 2.0 (token_tis)" in job.off_policy_notice()
    assert build_config(raw, ["algorithm.rollout_correction=none"]).off_policy_notice() is None


def test_pass_at_k_by_hand():
    # 4 samples, 1 passed: pass@1 = 1/4; pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(4, 1, 1) == 0.25 and pass_at_k(4, 1, 2) == 0.5
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 3, 2) == 1.0


def test_evaluation_is_due_every_k_steps_and_after_the_last():
    every = SimpleNamespace(config=SimpleNamespace(every_steps=2))
    assert [Evaluation.due(every, s, 5) for s in range(1, 6)] == [False, True, False, True, True]
    only_end = SimpleNamespace(config=SimpleNamespace(every_steps=0))
    assert [Evaluation.due(only_end, s, 3) for s in range(1, 4)] == [False, False, True]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"sampling": {"n_samples": 4}}, "eval.sampling: temperature=0 is greedy"),
        (
            {"sampling": {"n_samples": 2, "temperature": 1.0}, "pass_k": [4]},
            r"pass_k=\[4\] needs each k",
        ),
        (
            {"data": {"dataset": "builtin:arithmetic", "prompt_key": "q"}},
            "eval.data.prompt_key names fields of a dataset file",
        ),
        (
            {"data": {"dataset": "builtin:arithmetic", "seed": 0}},
            "would evaluate on the training prompts",
        ),
        ({"dataset": "builtin:arithmetic"}, "eval.dataset"),  # the flat form is refused
    ],
)
def test_eval_settings_that_cannot_work_are_refused(fields, message):
    raw = {
        "cluster": {"nproc_per_node": 2, "device": "cpu"},
        "trainer": {"model": "m", "ranks": 1},
        "rollout": {"engine": {"max_total_tokens": 64}},
        "eval": {"data": {"dataset": "builtin:arithmetic"}} | fields,
    }
    with pytest.raises(ConfigError, match=message):
        build_config(raw)


def test_fully_async_refuses_what_it_cannot_combine_with():
    raw = {
        "cluster": {"nproc_per_node": 2, "device": "cpu"},
        "trainer": {"model": "m", "ranks": 1},
        "rollout": {"engine": {"max_total_tokens": 64}},
        "algorithm": {"max_staleness": 2},
    }
    job = build_config(raw)
    assert job.rollout_correction() == "token_tis"  # auto: the samples come from older weights
    with pytest.raises(ConfigError, match="needs algorithm.off_policy_steps=0"):
        build_config(raw, ["algorithm.off_policy_steps=1"])
    with pytest.raises(ConfigError, match="needs algorithm.dynamic_sampling off"):
        build_config(raw, ["algorithm.dynamic_sampling=true"])
