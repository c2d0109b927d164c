"""The closed-loop control's actions on the train step (``rl/control.py``), on recorded metric
sequences of real jobs (``test_control_actions_job.py``, slow) and constructed ones: the sequence
ratio mask (engaged above its bound, released after calm steps below ``release_below``, each
change logged once) and the trainer's side of it (``trainer/sequence_mask.py``, by hand); routing
replay turned on once the routing drifts, and kept on."""

from __future__ import annotations

import logging

import pytest
import torch

from relax_launch.rl.control import Latch, StepControl, next_bound, next_mask, replay_due
from relax_launch.rl.control_config import (
    ControlConfig,
    RatioMaskControlConfig,
    RoutingReplayControlConfig,
    StalenessControlConfig,
)
from relax_launch.trainer.losses import LossSpec, policy_loss
from relax_launch.trainer.moe import COMPARED, compare_only
from relax_launch.trainer.sequence_mask import sequence_mask, sequence_ratios

# sequence_ratio_max of steps 1-3, recorded: the tiny Llama off-policy at lr 1e-2 (PP=2), its
# engine corrupted at version 0, no mask (steps 1-2 train version 0's samples, step 3 version 1's)
CORRUPTED_OFF_POLICY = [1.0601, 1.1720, 1.2288]
HEALTHY = [1.0, 1.0, 1.0]  # the tiny MoE job's clean version, fp32: 1 to float precision
# moe/routing_mismatch of steps 1-3, recorded: the tiny Qwen3-MoE off-policy, its engine
# corrupted at version 0 (steps 1-2 trained version 0's samples, step 3 version 1's)
CORRUPTED_ROUTING = [0.3652, 0.4057, 0.0]
# constructed in the range docs/benchmarks.md measured in bf16 with replay (0 to 0.6 % a step)
BF16_ROUTING = [0.0, 0.006, 0.002, 0.0, 0.004, 0.0]


def rows(name: str, values: list[float]) -> list[dict[str, float]]:
    return [{"step": i + 1, name: v} for i, v in enumerate(values)]


def mask_states(config: RatioMaskControlConfig, values: list[float]) -> list[bool]:
    state, states = Latch(), []
    for row in rows("sequence_ratio_max", values):
        state = next_mask(config, state, row)
        states.append(state.on)
    return states


def test_the_default_mask_leaves_healthy_and_merely_stale_runs_alone():
    default = RatioMaskControlConfig()  # bound 2: what wrong weights show, not a step's drift
    assert mask_states(default, HEALTHY + CORRUPTED_OFF_POLICY) == [False] * 6


def test_the_mask_engages_above_the_bound_and_releases_after_calm_steps(caplog):
    config = RatioMaskControlConfig(bound=2.0, release_below=1.5, patience=2)
    ratios = [1.0, 2.0, 2.5, 1.8, 1.4, 1.6, 1.3, 1.2, 1.0]
    # 2.0 is not above the bound; 2.5 engages; 1.8 and 1.6 (not below 1.5) restart the count;
    # 1.3 and 1.2, two calm steps in a row, release it
    assert mask_states(config, ratios) == [False, False, True, True, True, True, True, False, False]
    control = StepControl(ControlConfig(ratio_mask=config))
    with caplog.at_level(logging.INFO):
        metrics = [control.after_step(row) for row in rows("sequence_ratio_max", ratios)]
    assert [m["control/ratio_mask_step"] for m in metrics] == [0, 0, 1, 0, 0, 0, 0, -1, 0]
    assert [m["control/masked_sequences"] for m in metrics] == [0.0] * 9  # none reported
    logged = [r.getMessage() for r in caplog.records if "control:" in r.getMessage()]
    assert logged == [
        "relax-launch: control: sequence ratio mask engaged (sequence_ratio_max 2.5 > 2): "
        "sequences beyond [0.5, 2] are not trained on from step 4 (algorithm.control.ratio_mask)",
        "relax-launch: control: sequence ratio mask released (sequence_ratio_max below 1.5 for 2 "
        "steps) from step 9 (algorithm.control.ratio_mask)",
    ]


def test_the_recorded_corrupted_run_engages_the_mask_after_step_1_and_keeps_it():
    tight = RatioMaskControlConfig(bound=1.03, release_below=1.01)  # the job test's bounds
    assert mask_states(tight, CORRUPTED_OFF_POLICY) == [True, True, True]
    assert mask_states(tight, HEALTHY) == [False, False, False]


def test_a_step_that_trained_nothing_moves_nothing():
    config = RatioMaskControlConfig(patience=1)
    skipped = {"step": 2, "train_skipped": 1, "sequence_ratio_max": 1.0}
    assert next_mask(config, Latch(on=True), skipped) == Latch(on=True)
    staleness = StalenessControlConfig(patience=1)
    assert next_bound(staleness, 1, 0, 2, skipped | {"mismatch_kl": 0.0}) == (1, 0)
    assert not replay_due(
        RoutingReplayControlConfig(), False, {"moe/routing_mismatch": 0.5, "train_skipped": 1}
    )


def test_the_next_steps_loss_spec_carries_the_mask_and_the_routing_choice():
    config = ControlConfig(
        ratio_mask=RatioMaskControlConfig(bound=1.03, release_below=1.01),
        routing_replay=RoutingReplayControlConfig(routing_mismatch_above=0.01),
    )
    control = StepControl.of(config)
    spec = LossSpec(correction="token_tis")
    assert control.loss_spec(spec) == LossSpec(correction="token_tis", routing_replay=False)
    row = {"step": 1, "sequence_ratio_max": 1.06, "moe/routing_mismatch": 0.365}
    assert control.after_step(row) == {
        "control/ratio_mask": 1.0,
        "control/ratio_mask_step": 1.0,
        "control/masked_sequences": 0.0,
        "control/routing_replay": 1.0,
    }
    masked = control.loss_spec(spec)
    assert masked.sequence_ratio_bound == 1.03 and masked.routing_replay
    assert masked.correction == "token_tis"  # the rest of the spec as it was
    row = {"step": 2, "sequence_ratio_max": 1.12, "control/masked_sequences": 0.625}
    assert control.after_step(row)["control/masked_sequences"] == 0.625
    # the staleness action alone acts in the fully asynchronous schedule, not on the spec
    assert StepControl.of(ControlConfig(staleness={})) is None and StepControl.of(None) is None


def test_routing_replay_turns_on_at_the_first_drift_and_stays_on(caplog):
    config = RoutingReplayControlConfig(routing_mismatch_above=0.01)
    on, states = False, []
    for row in rows("moe/routing_mismatch", CORRUPTED_ROUTING):
        on = replay_due(config, on, row)
        states.append(on)
    assert states == [True, True, True]  # step 3's clean routing does not turn it off
    on = False
    for row in rows("moe/routing_mismatch", BF16_ROUTING):  # a few flips: below the bound
        on = replay_due(config, on, row)
    assert not on
    assert not replay_due(config, False, {"step": 1, "moe/routing_mismatch": 0.01})  # not above
    control = StepControl(ControlConfig(routing_replay=config))
    with caplog.at_level(logging.INFO):
        for row in rows("moe/routing_mismatch", CORRUPTED_ROUTING):
            control.after_step(row)
    logged = [r.getMessage() for r in caplog.records if "control:" in r.getMessage()]
    assert logged == [
        "relax-launch: control: routing replay turned on after step 1 (moe/routing_mismatch "
        "0.365 > 0.01; algorithm.control.routing_replay): the trainer computes each token with "
        "the engine's experts"
    ]


def test_sequence_ratios_are_geometric_means_either_way_by_hand():
    trainer = torch.tensor([[-1.0, -1.0, 0.0], [-1.0, -2.0, -3.0], [-2.0, -2.0, -2.0]])
    engine = torch.tensor([[-1.5, -0.5, -9.0], [-3.0, -4.0, -5.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    # row 0: log ratios +0.5, -0.5 (the padding's -9 ignored): 1; row 1: +2 each: e^2;
    # row 2 has no trained token: 1
    expected = torch.tensor([1.0, torch.e**2, 1.0])
    assert torch.allclose(sequence_ratios(trainer, engine, mask), expected)
    # the engine far more confident than the trainer (what wrong weights show): e^2 as well
    assert torch.allclose(sequence_ratios(engine, trainer, mask), expected)
    keep, sums = sequence_mask(trainer, engine, mask, None)
    assert torch.equal(keep, torch.ones(3, 1)) and sums.keys() == {"sequence_ratio_max"}
    keep, sums = sequence_mask(trainer, engine, mask, 2.0)
    assert keep.flatten().tolist() == [1.0, 0.0, 1.0]
    assert (sums["masked_sequences"], sums["sequences"]) == (1.0, 2.0)
    assert sums["sequence_ratio_max"] == pytest.approx(torch.e**2)


@pytest.mark.parametrize("correction", ["none", "token_tis", "sequence_mis"])
def test_a_masked_sequence_adds_nothing_to_the_loss_whatever_the_correction(correction):
    logprobs = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]], requires_grad=True)
    engine = torch.tensor([[-1.1, -0.9], [-3.0, -3.0]])  # row 1: ratio e^2 per token
    advantages = torch.tensor([[1.0, 1.0], [-2.0, -2.0]])
    mask = torch.ones(2, 2)
    spec = LossSpec(correction=correction, correction_cap=100.0, sequence_ratio_bound=2.0)
    loss_sum, count, sums = policy_loss(logprobs, engine, advantages, mask, spec)
    alone, alone_count, _ = policy_loss(
        logprobs[:1], engine[:1], advantages[:1], mask[:1], LossSpec(correction=correction)
    )
    assert loss_sum.item() == pytest.approx(alone.item()) and count == 4 and alone_count == 2
    loss_sum.backward()
    assert torch.equal(logprobs.grad[1], torch.zeros(2))  # no gradient through the dropped row
    assert sums["masked_sequences"] == 1.0 and sums["mismatch_kl"] > 1.0  # measured on all


def test_compared_routing_is_kept_for_the_monitor_but_not_replayed():
    routed = torch.zeros(1, 4, 2, 2, dtype=torch.int32)
    batches = [
        {"inputs": torch.zeros(1, 4), "routed_experts": routed},
        {"inputs": torch.zeros(1, 4)},
    ]
    compare_only(batches)
    assert "routed_experts" not in batches[0] and batches[0][COMPARED] is routed
    assert COMPARED not in batches[1]


def test_the_mask_needs_its_release_below_its_bound():
    with pytest.raises(ValueError, match="release_below=2.0 must be below bound=2.0"):
        RatioMaskControlConfig(bound=2.0, release_below=2.0)


def test_a_resumed_run_continues_with_the_mask_and_replay_its_steps_left():
    config = ControlConfig(
        ratio_mask=RatioMaskControlConfig(bound=2.0, release_below=1.5, patience=2),
        routing_replay=RoutingReplayControlConfig(),
    )
    history = [
        {"step": 1, "sequence_ratio_max": 2.5, "moe/routing_mismatch": 0.3},
        {"step": 2, "sequence_ratio_max": 1.2, "moe/routing_mismatch": 0.0},
    ]
    resumed = StepControl(config)
    resumed.resume(history)
    assert resumed.mask == Latch(on=True, calm=1) and resumed.replaying
    spec = resumed.loss_spec(LossSpec())
    assert spec.sequence_ratio_bound == 2.0 and spec.routing_replay
    # one more calm step releases the mask, as it would have without the restart
    assert resumed.after_step({"step": 3, "sequence_ratio_max": 1.1})["control/ratio_mask"] == 0
