"""The RL loop's pure parts: loss math against hand-computed values, data, rewards, batches."""

from __future__ import annotations

import io
import math
import re
from types import SimpleNamespace

import pytest
import torch
from rich.console import Console

from relax_launch.rl import runner
from relax_launch.rl.advantages import distill_advantages, grpo
from relax_launch.rl.batch import assign_advantages, to_batch
from relax_launch.rl.config import RewardConfig, RewardSource
from relax_launch.rl.context import PromptFeed, StepResult
from relax_launch.rl.data import PromptCursor, PromptStream, load_prompts
from relax_launch.rl.data_config import DataConfig
from relax_launch.rl.phases import drop_stale, sync_metrics
from relax_launch.rl.report import MetricsLog
from relax_launch.rl.rewards import (
    JUDGE_PREFILL,
    JUDGE_SCORE_REGEX,
    RewardError,
    Rewards,
    parse_score,
)
from relax_launch.rl.samples import Sample
from relax_launch.runtime.stop import StopRequest
from relax_launch.trainer.losses import LossSpec, policy_loss, reference_kl


def data(dataset, seed: int = 0) -> DataConfig:
    return DataConfig(dataset=str(dataset), seed=seed)


def sample(text="", label=None, group=0, response=(5, 6), logprobs=(-1.0, -2.0)) -> Sample:
    return Sample(group, "q", label, [1, 2, 3], list(response), list(logprobs), text, "1")


def test_grpo_advantages_by_hand():
    # group 1: mean 0.5, std 0.5 -> +-1; group 2: all equal -> no signal
    assert grpo([[1.0, 0.0, 1.0, 0.0], [2.0, 2.0, 2.0, 2.0]]) == [
        pytest.approx([1, -1, 1, -1], abs=1e-5),
        [0.0] * 4,
    ]
    # mean 2, variance (4 + 1 + 1) / 3 = 2: (0 - 2) / 1.4142 = -1.4142, (3 - 2) / 1.4142 = 0.7071
    assert grpo([[0.0, 3.0, 3.0]])[0] == pytest.approx([-1.4142, 0.7071, 0.7071], abs=1e-4)


def test_distill_advantages_by_hand():
    assert distill_advantages([-1.0, -3.0], [-2.0, -1.0], 0.5) == [-0.5, 1.0]
    with pytest.raises(ValueError, match="teacher scored 1 tokens"):
        distill_advantages([-1.0, -3.0], [-2.0], 0.5)


def mean_loss(*args, **kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """policy_loss as one micro-batch's mean, and its diagnostics per token."""
    loss_sum, count, sums = policy_loss(*args, **kwargs)
    tokens = sums.pop("tokens")
    return loss_sum / count, {k: v / tokens for k, v in sums.items()}


def test_ppo_clip_loss_by_hand():
    logprobs = torch.tensor([[0.0, math.log(1.5), math.log(0.5)]])
    old = torch.zeros(1, 3)
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    loss, extra = mean_loss(logprobs, old, adv, mask, LossSpec(0.2, 0.2, "token"))
    # token 1: ratio 1.5, A=1 -> -min(1.5, 1.2) = -1.2; token 2: ratio 0.5, A=-1 ->
    # -min(-0.5, -0.8) = 0.8; mean over the 2 masked tokens = -0.2
    assert float(loss) == pytest.approx(-0.2)
    assert float(extra["clipped"]) == pytest.approx(1.0)
    # approx KL = mean(old - new) = -(log 1.5 + log 0.5) / 2
    assert float(extra["approx_kl"]) == pytest.approx(-(math.log(1.5) + math.log(0.5)) / 2)


def test_on_policy_gradient_is_advantage_times_score():
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    adv = torch.tensor([[2.0, -1.0]])
    loss, _ = mean_loss(logprobs, logprobs.detach(), adv, torch.ones(1, 2), LossSpec())
    loss.backward()
    assert logprobs.grad.tolist()[0] == pytest.approx([-1.0, 0.5])  # -A / tokens


def test_sequence_aggregation_weights_sequences_equally():
    logprobs = torch.zeros(2, 3)
    adv = torch.tensor([[1.0, 1.0, 1.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    token, _ = mean_loss(logprobs, logprobs, adv, mask, LossSpec(aggregation="token"))
    sequence, _ = mean_loss(logprobs, logprobs, adv, mask, LossSpec(aggregation="sequence"))
    assert float(token) == pytest.approx(-(3 + 4) / 4)
    assert float(sequence) == pytest.approx(-(1 + 4) / 2)


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_a_batch_split_anyhow_sums_to_the_same_loss(aggregation):
    """The sums and counts of any split add up to the whole batch's: what lets the trainer
    divide once over micro-batches and data-parallel ranks."""
    generator = torch.Generator().manual_seed(0)
    logprobs = -torch.rand(4, 6, generator=generator)
    old = -torch.rand(4, 6, generator=generator)
    adv = torch.randn(4, 6, generator=generator)
    mask = torch.tensor([[1.0] * 6, [1.0, 1.0, 0, 0, 0, 0], [0.0] * 6, [0, 1.0, 1.0, 1.0, 0, 0]])
    spec = LossSpec(aggregation=aggregation)
    whole, count, _ = policy_loss(logprobs, old, adv, mask, spec)
    parts = [
        policy_loss(logprobs[i : i + 1], old[i : i + 1], adv[i : i + 1], mask[i : i + 1], spec)
        for i in range(4)
    ]
    assert float(sum(p[0] for p in parts) / sum(p[1] for p in parts)) == pytest.approx(
        float(whole / count)
    )
    if aggregation == "sequence":  # a mean of per-sequence means, however split
        return
    micro_means = [float(p[0] / p[1]) for p in parts if p[1] > 0]  # what a per-micro mean gave
    assert float(whole / count) != pytest.approx(sum(micro_means) / len(micro_means))


def test_extreme_and_masked_log_ratios_stay_finite():
    """±50 nats between policy, sampler and reference, and garbage (±1e4) on masked positions:
    the loss and its gradient stay finite, and masked positions contribute nothing."""
    logprobs = torch.tensor([[-60.0, -1.0, -1.0, 0.0, 0.0]], requires_grad=True)
    old = torch.tensor([[-10.0, -51.0, -1.0, -1e4, 1e4]])
    ref = torch.tensor([[-10.0, 49.0, -51.0, 1e4, -1e4]])
    adv = torch.tensor([[-1.0, -1.0, 1.0, -1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0, 0.0]])
    spec = LossSpec(kl_coef=1.0)
    loss_sum, count, sums = policy_loss(logprobs, old, adv, mask, spec, ref)
    loss_sum.backward()
    assert torch.isfinite(loss_sum) and all(torch.isfinite(v) for v in sums.values())
    assert torch.isfinite(logprobs.grad).all()
    assert logprobs.grad[0, 3:].tolist() == [0.0, 0.0]
    assert float(reference_kl(logprobs, ref, mask).max()) <= 10.0
    masked_out, _, _ = policy_loss(
        logprobs[:, :3], old[:, :3], adv[:, :3], mask[:, :3], spec, ref[:, :3]
    )
    assert float(masked_out) == pytest.approx(float(loss_sum))


def test_reference_kl_by_hand():
    logprobs = torch.tensor([[-1.0, -2.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[-1.0, -1.0, -3.0]])
    # k3 = exp(d) - d - 1 with d = ref - logprob: 0, e - 2, exp(-2) + 1
    kl = reference_kl(logprobs, ref)
    assert kl.tolist()[0] == pytest.approx([0.0, math.e - 2, math.exp(-2) + 1])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, extra = mean_loss(
        logprobs, logprobs.detach(), torch.zeros(1, 3), mask, LossSpec(kl_coef=0.5), ref
    )
    # advantages 0: the loss is 0.5 * the KL's mean over the 2 masked tokens
    assert float(loss) == pytest.approx(0.5 * (math.e - 2) / 2)
    assert float(extra["kl_ref"]) == pytest.approx((math.e - 2) / 2)
    loss.backward()
    # d/dlogprob of k3 = 1 - exp(d): no pull where policy = reference, pull up where it fell
    assert logprobs.grad.tolist()[0] == pytest.approx([0.0, 0.5 * (1 - math.e) / 2, 0.0])


def test_samples_older_than_the_staleness_bound_are_not_trained_on():
    samples = [sample(), sample(), sample()]
    for s, version in zip(samples, ["3", "2", "1"], strict=True):
        s.weight_version = version
    assert drop_stale(samples, trainer_version=3, bound=1) == 1
    assert [s.valid for s in samples] == [True, True, False]
    assert drop_stale(samples, trainer_version=3, bound=1) == 0  # counted once


def test_builtin_tasks_are_deterministic_and_checkable():
    a, b = load_prompts(data("builtin:arithmetic", 3)), load_prompts(data("builtin:arithmetic", 3))
    assert a == b and len(a) == 1000
    question = a[0].messages[0]["content"]
    x, y = (int(v) for v in question.removeprefix("What is ").split("?")[0].split(" + "))
    assert a[0].label == str(x + y)
    assert load_prompts(data("builtin:format"))[0].label is None


def test_prompt_stream_shuffles_per_epoch_and_resumes(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(f'{{"prompt": "q{i}", "label": {i}}}' for i in range(5)) + "\n")
    prompts = load_prompts(data(path))
    stream = PromptStream(prompts, shuffle=True, seed=1)
    first = [p.index for p in stream.next_batch(3)]
    cursor = stream.checkpoint()
    rest = [p.index for p in stream.next_batch(4)]
    resumed = PromptStream(prompts, shuffle=True, seed=1)
    resumed.restore(cursor)
    assert [p.index for p in resumed.next_batch(4)] == rest
    assert sorted(first + rest[:2]) == [0, 1, 2, 3, 4]  # an epoch covers every prompt once


@pytest.mark.parametrize(
    "content,message",
    [
        ("", "has no prompts"),
        ("{bad\n", ":1: not JSON"),
        ('{"label": 1}\n', ":1: needs a non-empty"),
    ],
)
def test_bad_datasets_are_named(tmp_path, content, message):
    path = tmp_path / "d.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_prompts(data(path))


def config(*sources) -> RewardConfig:
    return RewardConfig(sources=tuple(RewardSource(**s) for s in sources))


def test_builtin_rewards_and_weights():
    rewards = Rewards(
        config(
            {"name": "answer", "function": "builtin:exact_numeric", "weight": 1.0},
            {"name": "format", "function": "builtin:format", "weight": 0.5},
        )
    )
    samples = [sample("It is 42.\nAnswer: 42", "42"), sample("41", "42"), sample("Answer: x", "7")]
    metrics = rewards.score(samples)
    assert [s.reward for s in samples] == [1.5, 0.0, 0.5]
    assert metrics["reward/answer"] == pytest.approx(1 / 3)
    assert metrics["reward/format/failed"] == 0


def raising(samples):
    raise KeyError("label missing")


def half_broken(samples):
    return [1.0, "x"][: len(samples)]


async def async_reward(samples):
    return [0.25 for _ in samples]


def test_failing_reward_functions_mark_samples_invalid_and_count_them():
    module = __name__
    rewards = Rewards(
        config(
            {"name": "ok", "function": f"{module}:async_reward"},
            {"name": "half", "function": f"{module}:half_broken"},
        )
    )
    samples = [sample(), sample()]
    metrics = rewards.score(samples)
    assert [s.valid for s in samples] == [True, False]
    assert samples[0].reward == 1.25 and metrics["reward/half/failed"] == 1
    with pytest.raises(RewardError, match="raised KeyError: 'label missing'"):
        Rewards(config({"name": "bad", "function": f"{module}:raising"})).score([sample()])


def test_judge_scores_are_parsed_and_unparseable_replies_counted():
    replies = iter([["Score: 8", "I think it is fine", "score=15"]])
    rewards = Rewards(config({"name": "judge", "genrm": True}), judge=lambda p, r, s: next(replies))
    samples = [sample("a"), sample("b"), sample("c")]
    metrics = rewards.score(samples)
    assert [s.rewards.get("judge") for s in samples] == [0.8, None, 1.0]
    assert metrics["reward/judge/failed"] == 1 and not samples[1].valid
    assert parse_score("Final. SCORE: 3.5") == 0.35
    with_fallback = Rewards(
        config({"name": "judge", "genrm": True, "fallback": 0.0}),
        judge=lambda p, r, s: ["?"] * len(p),
    )
    samples = [sample("a")]
    assert with_fallback.score(samples)["reward/judge/failed"] == 1
    assert samples[0].valid and samples[0].reward == 0.0
    with pytest.raises(ValueError, match="no 'Score: N'"):
        parse_score("great answer")


def test_judge_reply_is_prefilled_so_a_bare_number_scores():
    asked = []

    def judge(prompts, regex, source):
        asked.extend((p, regex) for p in prompts)
        return ["7", " 10.", "Score: 4"]

    rewards = Rewards(config({"name": "judge", "genrm": True}), judge=judge)
    samples = [sample("a"), sample("b"), sample("c")]
    rewards.score(samples)
    assert [s.rewards["judge"] for s in samples] == [0.7, 1.0, 0.4]
    assert all(p[-1] == {"role": "assistant", "content": JUDGE_PREFILL} for p, _ in asked)
    assert all(regex == JUDGE_SCORE_REGEX for _, regex in asked)


def test_every_reply_the_judge_regex_allows_parses_to_its_score():
    for score in [*map(str, range(11)), "0.5", "7.5", "9.9"]:
        for reply in (score, f" {score}"):
            assert re.fullmatch(JUDGE_SCORE_REGEX, reply)
            assert parse_score(f"{JUDGE_PREFILL} {reply}") == pytest.approx(float(score) / 10)
    for outside in ("11", "-1", "10.5", "7.55", "7.", "", "  3", "Score: 3"):
        assert re.fullmatch(JUDGE_SCORE_REGEX, outside) is None


def test_batch_trains_only_valid_responses_with_their_advantages():
    samples = [sample(group=0), sample(group=0), sample(group=1), sample(group=1)]
    for s, r in zip(samples, [1.0, 0.0, 1.0, 1.0], strict=True):
        s.reward = r
    samples[3].valid = False
    samples[2].teacher_logprobs = [-0.5, -2.5]
    assign_advantages(samples, 2)
    batch = to_batch(samples, distill_coef=0.1)
    assert [s.advantage for s in samples] == pytest.approx([1.0, -1.0, 0.0, 0.0], abs=1e-5)
    assert batch.loss_mask[0] == (0.0, 0.0, 0.0, 1.0, 1.0)
    assert batch.loss_mask[3] == (0.0,) * 5  # invalid: no gradient
    assert batch.token_weights[2][3:] == pytest.approx((0.05, -0.05))  # 0.1 * (teacher - own)
    assert batch.old_logprobs[0] == (0.0, 0.0, 0.0, -1.0, -2.0)


class WordTokenizer:
    """One token per word (stands in for a chat tokenizer in this unit test)."""

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return " ".join(m["content"] for m in messages)

    def encode(self, text, add_special_tokens):
        return list(range(len(text.split())))


def test_prompts_longer_than_the_limit_are_skipped_and_counted(tmp_path):
    path = tmp_path / "d.jsonl"
    rows = ['{"prompt": "short one"}', '{"prompt": "' + "long " * 50 + '"}', '{"prompt": "ok too"}']
    path.write_text("\n".join(rows) + "\n")
    limits = DataConfig(dataset=str(path), prompts_per_step=2, max_prompt_tokens=8, shuffle=False)
    stream = PromptStream(load_prompts(limits), shuffle=False, seed=0)
    feed = PromptFeed(stream, WordTokenizer(), limits)
    chosen = feed.draw()
    assert [p.index for p, _ in chosen] == [0, 2] and feed.skipped == 1
    only_long = tmp_path / "long.jsonl"
    only_long.write_text(rows[1] + "\n")
    stream = PromptStream(load_prompts(data(only_long)), shuffle=False, seed=0)
    with pytest.raises(RuntimeError, match="max_prompt_tokens=8"):
        PromptFeed(stream, WordTokenizer(), limits).draw()


def test_step_time_covers_the_whole_step_and_other_is_what_no_phase_covers(monkeypatch, tmp_path):
    now = [0.0]
    monkeypatch.setattr(runner, "clock", lambda: now[0])

    class StepsOfSixSeconds:
        def step(self, step):
            now[0] += 6.0
            metrics = {"step": step + 1, "reward": 0.5, "tokens_per_s": 1.0}
            seconds = {"rollout": 2.0, "train": 3.0, "sync": 1.0}
            return StepResult(metrics, PromptCursor(), seconds)

        def close(self):
            pass

    class SlowLog(MetricsLog):
        def write(self, metrics):
            super().write(metrics)
            now[0] += 4.0  # e.g. a slow disk under metrics.jsonl and TensorBoard

    console = Console(file=io.StringIO())
    ctx = SimpleNamespace(
        log=SlowLog(tmp_path),
        job=SimpleNamespace(
            console=console,
            stop=StopRequest(0, tmp_path),
            engines=SimpleNamespace(cancel_all=lambda why: None),
        ),
        feed=SimpleNamespace(position=PromptCursor),
        checkpoint_every=None,
        exports=None,
        guard=None,  # algorithm.mismatch_guard: rl/mismatch_guard.py's tests
        control=None,  # algorithm.control: test_control_actions.py
    )
    history = runner.run(ctx, StepsOfSixSeconds(), 3, tmp_path)
    # step k's window starts where step k-1's ended: writing step k-1's row is in step k
    assert [r["time/step"] for r in history] == [6.0, 10.0, 10.0]
    assert [r["time/other"] for r in history] == [0.0, 4.0, 4.0]
    lines = console.file.getvalue().splitlines()
    assert lines[1].startswith("relax-launch: step 2/3 | reward 0.500")
    assert "other 4.0s" in lines[1] and lines[1].endswith("ETA 0:08")  # mean 8 s x 1 step left


def test_a_syncs_time_adds_up_over_groups_that_send_in_turn():
    """Pipeline stages and EP ranks send one after the other: the sync's phases are their sum
    (the slowest one alone would hide the rest); the session's open and close count once."""

    def report(export_s, transfer_s, staged):
        receivers = ({"staged": staged},)
        return dict(export_s=export_s, transfer_s=transfer_s, engine_s=0.5, control_s=0.25,
                    num_bytes=100, receivers=receivers)  # fmt: skip

    metrics = sync_metrics([report(1.0, 2.0, 0), report(3.0, 1.0, 2)], seconds=8.0)
    assert (metrics["sync/export_s"], metrics["sync/transfer_s"]) == (4.0, 3.0)
    assert (metrics["sync/engine_s"], metrics["sync/control_s"]) == (1.0, 0.25)
    assert (metrics["sync/bytes"], metrics["sync/staged_tensors"]) == (200, 2)
