"""PPO with a learned value model against hand-computed values: GAE per response token, returns,
whitening over the batch, explained variance, the clipped value loss and its gradient, how the
step hands each of them to the policy and the critic, and the config rules of the critic."""

from __future__ import annotations

import io
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from rich.console import Console

from relax_launch.config import ConfigError
from relax_launch.config.loading import build_config
from relax_launch.rl.batch import assign_advantages, to_batch
from relax_launch.rl.critic_step import advantages_and_returns, train_with_critic
from relax_launch.rl.data import load_prompts
from relax_launch.rl.data_config import DataConfig
from relax_launch.rl.gae import explained_variance, gae, returns, whiten
from relax_launch.rl.phases import train
from relax_launch.rl.report import StepProgress
from relax_launch.rl.samples import Sample
from relax_launch.trainer.critic import STEP_SECONDS, STEP_TICKETS
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

    critic_overlaps = False  # the critic on the trainer's ranks: trained after the policy

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
        return {
            "critic/value_loss": 0.5,
            "critic/clip_fraction": 0.0,
            "critic/grad_norm": 1.0,
            STEP_SECONDS: 2.5,  # the step's duration on the critic's rank
        }


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
        (["critic.dp_size=2"], "critic.dp_size=2 sizes a critic on ranks of its own"),
        (["critic.ranks=own", "critic.pp_size=2"], "one pipeline stage"),
        (
            ["critic.ranks=own", "placement.mode=split", "trainer.ranks=null"],
            "critic.ranks=own gives the value model ranks no other role uses",
        ),
        (
            ["critic.ranks=own", "critic.dp_size=2", "critic.micro_batch_size=3"],
            "2 data-parallel ranks of the critic",
        ),
        (["critic.tp_size=2"], "critic.tp_size=2 differs from trainer.tp_size=1"),
        (["critic.micro_batch_size=3"], "make the step a multiple of 3"),
        (["critic.mini_batches=16"], "critic.mini_batches=16"),
        (["algorithm.dynamic_sampling=true"], "turn dynamic_sampling off"),
        (["critic.warmup_steps=1"], "critic.warmup_steps=1 leaves no step of"),
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


def test_in_the_critics_warm_up_only_the_critic_trains():
    job = RecordingJob([[9.0, 0.5, 0.2, -0.1]])
    ctx = SimpleNamespace(
        job=job,
        algorithm=SimpleNamespace(gamma=1.0, lam=1.0),
        critic=SimpleNamespace(value_clip=0.2, mini_batches=1),
    )
    batch = to_batch([sample(1.0)], 0.0)
    metrics = train_with_critic(ctx, [sample(1.0)], batch, LossSpec(), train_policy=False)
    # the memory moves as in a full step (a colocated turn ends as it began); no policy step
    assert [c[0] for c in job.calls] == [
        "scoring",
        "values",
        "policy_training",
        "critic_training",
        "critic",
        "done",
    ]
    assert metrics["critic/warmup"] == 1.0 and "loss" not in metrics
    assert metrics["critic/value_loss"] == 0.5


def test_the_first_warmup_steps_of_the_job_skip_the_policy():
    """``rl/phases.train`` with ``critic.warmup_steps=2``: steps 0 and 1 train the critic alone,
    step 2 the policy too (the step index is the one every schedule passes)."""
    trained = []
    for step in range(3):
        job = RecordingJob([[9.0, 0.5, 0.2, -0.1]])
        ctx = SimpleNamespace(
            job=job,
            algorithm=SimpleNamespace(gamma=1.0, lam=1.0, distill_coef=0.0),
            critic=SimpleNamespace(value_clip=0.2, mini_batches=1, warmup_steps=2),
            guard=None,
            spec=LossSpec(),
        )
        metrics = train(ctx, [sample(1.0)], {}, step)
        trained.append([c[0] for c in job.calls if c[0] in ("policy", "critic")])
        assert metrics["critic/warmup"] == float(step < 2)
    assert trained == [["critic"], ["critic"], ["policy", "critic"]]


class OverlappingJob(RecordingJob):
    """A job whose critic has ranks of its own: its steps are started before the policy's and
    collected after it (the real one: tests/rl/test_critic_job.py). Each of its ``seconds``
    passes on a fake monotonic clock: starting the critic, the policy's step, finishing. Each
    critic step takes its tickets from the job's counter at one of those moments
    (``critic_at``: "start", "policy", "finish" for each step, or one spanning two: "start-policy"
    began while starting and ended within the policy's step)."""

    critic_overlaps = True

    def __init__(
        self,
        values,
        clock,
        seconds=(0.5, 3.0, 1.0),
        critic_s=2.0,
        fail=False,
        critic_at=("policy", "policy"),
    ):
        super().__init__(values)
        self.clock, self.seconds, self.critic_s, self.fail = clock, seconds, critic_s, fail
        self.critic_at, self.tickets = critic_at, {}
        self.counter = 0

    def order_ticket(self):
        self.counter += 1
        return self.counter

    def _critic_tickets(self, moment):
        """The critic's ranks taking their steps' tickets at ``moment``."""
        for step, at in enumerate(self.critic_at):
            began, _, ended = at.partition("-")
            if began == moment:
                self.tickets[step] = [self.order_ticket()]
            if (ended or began) == moment:
                self.tickets[step].append(self.order_ticket())

    def start_critic(self, batches, clip):
        self.calls.append(("start_critic", len(batches), clip))
        self.clock.now += self.seconds[0]
        self._critic_tickets("start")
        return batches

    def train_step(self, batch, spec):
        self.calls.append(("policy", batch))
        self.clock.now += self.seconds[1]
        self._critic_tickets("policy")
        if self.fail:
            raise RuntimeError("policy step failed")
        return {"loss": 0.1}

    def finish_critic(self, started):
        self.calls.append(("finish_critic",))
        self.clock.now += self.seconds[2]
        self._critic_tickets("finish")
        for step in range(len(self.critic_at)):  # the warm-up's: no policy step to run beside
            while len(self.tickets.setdefault(step, [])) < 2:
                self.tickets[step].append(self.order_ticket())
        # durations on the critic's rank: no clock of its own reaches rank 0
        return [
            {
                "critic/value_loss": 0.5 + i,
                STEP_SECONDS: self.critic_s / len(started),
                **dict(zip(STEP_TICKETS, self.tickets[i], strict=True)),
            }
            for i, _ in enumerate(started)
        ]


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def monotonic(self):
        return self.now


def overlapping(monkeypatch, **kwargs):
    clock = FakeClock()
    monkeypatch.setattr("relax_launch.rl.critic_step.monotonic", clock.monotonic)
    job = OverlappingJob([[9.0, 0.5, 0.2, -0.1], [9.0, 0.1, 0.1, 0.1]], clock, **kwargs)
    ctx = SimpleNamespace(
        job=job,
        algorithm=SimpleNamespace(gamma=1.0, lam=1.0),
        critic=SimpleNamespace(value_clip=0.2, mini_batches=2),
    )
    return job, ctx, [sample(1.0), sample(0.0)]


def test_a_critic_on_its_own_ranks_trains_while_the_policy_does(monkeypatch):
    job, ctx, samples = overlapping(monkeypatch)
    metrics = train_with_critic(ctx, samples, to_batch(samples, 0.0), LossSpec())
    # both mini-batches posted before the policy's step, collected after it; no memory moves
    # for the critic's own step (its turns' critic_training is the shared critic's)
    assert [c[0] for c in job.calls] == [
        "scoring",
        "values",
        "policy_training",
        "start_critic",
        "policy",
        "finish_critic",
        "done",
    ]
    assert job.calls[3][1:] == (2, 0.2)
    assert metrics["critic/value_loss"] == 1.0  # the mean over the two steps
    # rank 0's wall 4.5 s held the policy's 3 s and the critic's 2 s: 0.5 s at once, from
    # durations alone; a quarter of the shorter (the critic's)
    assert metrics["critic/step_s"] == pytest.approx(2.0)
    assert metrics["critic/overlap_s"] == pytest.approx(0.5)
    assert metrics["critic/overlap_fraction"] == pytest.approx(0.25)
    assert STEP_SECONDS not in metrics


def test_a_critic_wholly_within_the_policys_step_overlaps_all_of_it(monkeypatch):
    # the critic's 2 s ran within the policy's 3 s: rank 0 waited 0 s more for it
    job, ctx, samples = overlapping(monkeypatch, seconds=(0.0, 3.0, 0.0))
    metrics = train_with_critic(ctx, samples, to_batch(samples, 0.0), LossSpec())
    assert metrics["critic/overlap_s"] == pytest.approx(2.0)
    assert metrics["critic/overlap_fraction"] == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("critic_at", "overlapped"),
    [
        (("policy", "policy"), 2),  # both within the policy's step
        (("start-policy", "policy-finish"), 2),  # each across one of its ends
        (("start-finish", "finish"), 1),  # the first across all of it, the second after it
        (("start", "policy"), 1),  # the first done before it began
        (("start", "start"), 0),
        (("finish", "finish"), 0),  # neither begun before it ended
    ],
)
def test_the_critics_steps_beside_the_policys_are_counted_by_their_tickets(
    monkeypatch, critic_at, overlapped
):
    # the same durations in every case: the count comes from the tickets' order alone
    job, ctx, samples = overlapping(monkeypatch, critic_at=critic_at)
    metrics = train_with_critic(ctx, samples, to_batch(samples, 0.0), LossSpec())
    assert metrics["critic/overlapped_steps"] == overlapped
    assert metrics["critic/overlap_s"] == pytest.approx(0.5)
    assert not set(STEP_TICKETS) & set(metrics)


def test_the_critic_warmup_reports_no_overlap(monkeypatch):
    job, ctx, samples = overlapping(monkeypatch)
    metrics = train_with_critic(ctx, samples, to_batch(samples, 0.0), LossSpec(), False)
    assert "policy" not in [c[0] for c in job.calls]
    assert metrics["critic/step_s"] == pytest.approx(2.0) and metrics["critic/warmup"] == 1.0
    assert not {"critic/overlap_s", "critic/overlap_fraction", "critic/overlapped_steps"} & set(
        metrics
    )


def test_a_failed_policy_step_still_finishes_the_critics_steps(monkeypatch):
    job, ctx, samples = overlapping(monkeypatch, fail=True)
    with pytest.raises(RuntimeError, match="policy step failed"):
        train_with_critic(ctx, samples, to_batch(samples, 0.0), LossSpec())
    # the critic's sends complete before the failure ends the job; the turn still ends
    assert [c[0] for c in job.calls][-3:] == ["policy", "finish_critic", "done"]


def test_a_critic_on_the_trainers_ranks_reports_its_time_and_no_overlap():
    job = RecordingJob([[9.0, 0.5, 0.2, -0.1]])
    ctx = SimpleNamespace(
        job=job,
        algorithm=SimpleNamespace(gamma=1.0, lam=1.0),
        critic=SimpleNamespace(value_clip=0.2, mini_batches=1),
    )
    metrics = train_with_critic(ctx, [sample(1.0)], to_batch([sample(1.0)], 0.0), LossSpec())
    assert metrics["critic/step_s"] == 2.5 and "critic/overlap_s" not in metrics
    assert STEP_SECONDS not in metrics


def test_a_critic_on_ranks_of_its_own_takes_its_own_layout():
    job = build_config(
        RAW,
        ["cluster.nproc_per_node=4", "critic.ranks=own", "critic.tp_size=2", "trainer.lr=1e-6"],
    )
    section = job.critic.trainer_section(job.trainer)
    assert (section.tp_size, section.ranks, section.lr) == (2, 2, 1e-5)
    assert job.trainer.tp_size == 1  # the policy's own stays


def test_a_pipeline_parallel_policy_takes_a_critic_on_ranks_of_its_own():
    common = ["cluster.nproc_per_node=4", "trainer.ranks=2", "trainer.pp_size=2"]
    with pytest.raises(ConfigError, match="critic on the trainer's ranks with trainer.pp_size"):
        build_config(RAW, common)
    # on ranks of its own the value model is one stage, none of the policy's PP/CP/EP
    job = build_config(RAW, [*common, "critic.ranks=own"])
    section = job.critic.trainer_section(job.trainer)
    assert (section.pp_size, section.cp_size, section.ep_size) == (1, 1, 1)
    assert job.trainer.pp_size == 2


def test_the_console_line_marks_the_critics_warm_up():
    progress = StepProgress(Console(file=io.StringIO()), total=4, done=1)
    progress.step_seconds.append(30.0)  # the ETA's: one step done
    row = {"step": 1, "reward": 0.5, "tokens_per_s": 10.0, "critic/value_loss": 0.1}
    row["critic/explained_variance"] = 0.2
    warming = progress.line(row | {"critic/warmup": 1.0})
    assert "V-loss 0.1000 EV 0.20 (critic warm-up)" in warming
    assert "warm-up" not in progress.line(row | {"critic/warmup": 0.0})


def test_the_benchmarks_two_difficulty_arithmetic_loads_as_a_dataset(tmp_path):
    """``bench/critic_data.py`` (the critic's explained-variance benchmark): alternating one- and
    four-digit sums, read back by the job's own dataset reader with their labels and sources."""
    bench = Path(__file__).resolve().parents[2] / "bench"
    out = tmp_path / "mixed.jsonl"
    subprocess.run(
        [sys.executable, str(bench / "critic_data.py"), str(out), "--rows", "6"], check=True
    )
    prompts = load_prompts(DataConfig(dataset=str(out)))
    assert [p.data_source for p in prompts] == ["easy", "hard"] * 3
    for p in prompts:
        a, b = (int(x) for x in re.findall(r"\d+", p.messages[0]["content"]))
        assert p.label == str(a + b)
        assert (a < 10 and b < 10) if p.data_source == "easy" else min(a, b) >= 1000
