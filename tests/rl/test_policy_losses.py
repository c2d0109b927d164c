"""CISPO, SAPO and M2PO (``algorithm.policy_loss``) against hand-computed values and gradients,
and the settings each refuses. REINFORCE++ with a group baseline is an advantage estimator
(``tests/rl/test_loss_family.py``); its real job is in ``test_policy_loss_jobs.py``."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from relax_launch.config import ConfigError
from relax_launch.config.loading import build_config
from relax_launch.rl.config import AlgorithmConfig
from relax_launch.rl.context import RLContext
from relax_launch.trainer.losses import LossSpec, policy_loss
from relax_launch.trainer.step_metrics import PER_TOKEN, SUMMED
from relax_launch.trainer.surrogates import second_moment_mask


def loss_and_grad(spec: LossSpec, trainer, engine, advantages, mask):
    """(loss sum, count, sums, d loss_sum / d trainer logprobs, flat) of ``policy_loss``."""
    logprobs = torch.tensor(trainer, requires_grad=True)
    loss_sum, count, sums = policy_loss(
        logprobs, torch.tensor(engine), torch.tensor(advantages), torch.tensor(mask), spec
    )
    loss_sum.backward()
    return float(loss_sum), float(count), sums, logprobs.grad.flatten().tolist()


def test_cispo_caps_the_weight_without_gradient_and_keeps_every_token():
    # ratios exp(trainer - engine): exp(0) = 1, exp(0.5) = 1.6487, exp(-0.5) = 0.6065
    trainer, engine = [[-1.0, -2.0, -0.5]], [[-1.0, -2.5, 0.0]]
    advantages, mask = [[2.0, 2.0, -1.0]], [[1.0, 1.0, 1.0]]
    spec = LossSpec(surrogate="cispo", cispo_clip_high=0.2)
    loss, count, sums, grad = loss_and_grad(spec, trainer, engine, advantages, mask)
    # weights sg(min(r, 1.2)) = 1, 1.2, 0.6065 (no lower bound: PPO's would lift it to 0.8)
    # per token -w A logp: -1*2*(-1) = 2; -1.2*2*(-2) = 4.8; -0.6065*(-1)*(-0.5) = -0.30327
    assert loss == pytest.approx(2.0 + 4.8 - 0.5 * math.exp(-0.5), abs=1e-5) and count == 3.0
    # d/dlogp = -w A, the weight a constant: -2, -2.4, +0.6065. The capped token (r > 1.2, A > 0)
    # keeps its gradient, where PPO-clip's would be 0; a weight with gradient would give the
    # first token -A (w + logp * r) = 0.
    assert grad == pytest.approx([-2.0, -2.4, math.exp(-0.5)], abs=1e-5)
    assert float(sums["cispo_capped"]) == 1.0 and "clipped" not in sums


def test_sapo_gates_the_ratio_softly_with_a_temperature_per_sign():
    # ratios 1, exp(0.5) = 1.648721, exp(-0.5) = 0.606531; tau 1 where A > 0, 2 where A < 0
    trainer, engine = [[-1.0, -2.0, -0.5]], [[-1.0, -2.5, 0.0]]
    advantages, mask = [[1.0, 1.0, -1.0]], [[1.0, 1.0, 1.0]]
    spec = LossSpec(surrogate="sapo", sapo_tau_pos=1.0, sapo_tau_neg=2.0)
    loss, _, sums, grad = loss_and_grad(spec, trainer, engine, advantages, mask)
    # gate f(r) = 4/tau * sigmoid(tau (r - 1)), per token -f A:
    #   r = 1:     sigmoid(0) = 0.5,                 f = 2,        loss -2
    #   r = 1.649: sigmoid(0.648721) = 0.656722,     f = 2.626889, loss -2.626889
    #   r = 0.607: sigmoid(2 * -0.393469) = 0.312826, f = 0.625653, loss +0.625653 (A = -1)
    assert loss == pytest.approx(-2.0 - 2.626889 + 0.625653, abs=1e-5)
    # d/dlogp = -A f'(r) r, f'(r) = 4 s (1 - s): 1 * 1, 0.901753 * 1.648721, 0.859864 * 0.606531
    assert grad == pytest.approx([-1.0, -1.486739, 0.521534], abs=1e-5)
    # the gradient weights 4 s (1 - s): 1 + 0.901753 + 0.859864 (PPO-clip: 1 + 0 + 0, both cut)
    assert float(sums["sapo_gate"]) == pytest.approx(2.761617, abs=1e-5)


def test_m2po_masks_the_largest_squared_log_ratios_until_the_second_moment_is_within():
    # log-ratios 0.1, -0.5, 0 | 0.3, 0.05, (padding): squares 0.01, 0.25, 0 | 0.09, 0.0025
    trainer = [[-1.0, -1.5, -1.0], [-0.7, -0.95, -5.0]]
    engine = [[-1.1, -1.0, -1.0], [-1.0, -1.0, 0.0]]
    advantages, mask = [[1.0] * 3, [-1.0] * 3], [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
    spec = LossSpec(surrogate="m2po", m2po_threshold=0.04)
    loss, count, sums, grad = loss_and_grad(spec, trainer, engine, advantages, mask)
    # mean of the 5: 0.3525 / 5 = 0.0705 > 0.04; without 0.25: 0.1025 / 4 = 0.025625 <= 0.04
    assert float(sums["m2"]) == pytest.approx(0.3525, abs=1e-6)
    assert float(sums["m2po_masked"]) == 1.0
    assert float(sums["m2po_m2_kept_max"]) == pytest.approx(0.025625, abs=1e-6)
    # per token -M r A, no clip: -(e^0.1 + 0 + 1) + (e^0.3 + e^0.05) = 0.295959; the masked
    # token still counts (the paper divides by every token)
    assert loss == pytest.approx(0.295959, abs=1e-5) and count == 5.0
    # d/dlogp = -M A r: the masked token and the padding get none
    expected = [-math.exp(0.1), 0.0, -1.0, math.exp(0.3), math.exp(0.05), 0.0]
    assert grad == pytest.approx(expected, abs=1e-5)


def test_second_moment_mask_drops_one_token_at_a_time_from_the_largest():
    log_ratio = torch.tensor([[0.1, -0.5, 0.0, 0.3, 0.05, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0, 0.0]])  # 9.0 is padding: never counted
    # 0.02: without 0.25, 0.025625 > 0.02; without 0.09 too, 0.0125 / 3 = 0.004167
    assert second_moment_mask(log_ratio, mask, 0.02).tolist() == [[1, 0, 1, 0, 1, 0]]
    assert second_moment_mask(log_ratio, mask, 0.1).tolist() == [[1, 1, 1, 1, 1, 0]]
    # every square above the bound: nothing is left to train on
    assert second_moment_mask(torch.tensor([[2.0, -3.0]]), torch.ones(1, 2), 1.0).sum() == 0


def reference_second_moment_mask(log_ratio, mask, threshold):
    """The mask as first written, with boolean indexing and a host read of the count: the
    reference the sync-free ``second_moment_mask`` must match exactly."""
    on = mask > 0
    squares = log_ratio.detach().pow(2)[on]
    order = torch.argsort(squares, descending=True, stable=True)
    ranked = squares[order]
    suffix = ranked.flip(0).cumsum(0).flip(0)
    kept_mean = suffix / torch.arange(len(ranked), 0, -1, dtype=ranked.dtype)
    within = torch.nonzero(kept_mean <= threshold)
    dropped = int(within[0]) if len(within) else len(ranked)
    keep_ranked = torch.ones_like(ranked)
    keep_ranked[:dropped] = 0.0
    keep = torch.zeros_like(squares)
    keep[order] = keep_ranked
    out = torch.zeros_like(log_ratio)
    out[on] = keep
    return out


def test_second_moment_mask_matches_the_reference_on_random_batches():
    generator = torch.Generator().manual_seed(0)
    for case in range(300):
        rows, length = 1 + case % 4, 1 + case % 37
        log_ratio = torch.randn(rows, length, generator=generator) * (0.05 + case % 5 * 0.2)
        if case % 3 == 0:  # ties: squares equal across tokens and signs
            log_ratio = (log_ratio * 10).round() / 10
        mask = (torch.rand(rows, length, generator=generator) < 0.2 + case % 4 * 0.25).float()
        for threshold in (0.0, 1e-3, 0.01, 0.1, 1.0, 100.0):
            expected = reference_second_moment_mask(log_ratio, mask, threshold)
            assert torch.equal(second_moment_mask(log_ratio, mask, threshold), expected)


def test_second_moment_mask_needs_no_host_sync():
    """On the meta device (shapes, no values) every data-dependent step raises: boolean
    indexing and ``nonzero`` (output size from the data), ``.item()``/``int()``/``bool()``. The
    mask running there reads nothing back to the host, so on CUDA it does not stall the
    micro-batch."""
    log_ratio, mask = torch.zeros(3, 17, device="meta"), torch.ones(3, 17, device="meta")
    keep = second_moment_mask(log_ratio, mask, 0.01)
    assert keep.shape == (3, 17)
    assert keep.device.type == "meta"


def test_the_new_diagnostics_are_reported_as_per_token_means():
    for key, name in [
        ("cispo_capped", "cispo_capped_fraction"),
        ("sapo_gate", "sapo_gate_mean"),
        ("m2", "m2po_m2"),
        ("m2po_masked", "m2po_masked_fraction"),
    ]:
        assert key in SUMMED and PER_TOKEN[key] == name


def test_the_algorithm_section_reaches_the_loss_spec():
    ctx = SimpleNamespace(
        algorithm=AlgorithmConfig(policy_loss="sapo", sapo_tau_pos=2.0, sapo_tau_neg=3.0),
        data=SimpleNamespace(max_response_tokens=8),
        correction="none",
        control=None,
    )
    spec = RLContext.spec.fget(ctx)
    assert (spec.surrogate, spec.sapo_tau_pos, spec.sapo_tau_neg) == ("sapo", 2.0, 3.0)
    ctx.algorithm = AlgorithmConfig(policy_loss="m2po", m2po_threshold=0.01)
    assert (RLContext.spec.fget(ctx).surrogate, RLContext.spec.fget(ctx).m2po_threshold) == (
        "m2po",
        0.01,
    )


RAW = {
    "cluster": {"nproc_per_node": 2, "device": "cpu"},
    "trainer": {"model": "m", "ranks": 1},
    "rollout": {"engine": {"max_total_tokens": 64}},
}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algorithm.cispo_clip_high=1"], "cispo_clip_high acts only with .*policy_loss=cispo"),
        (["algorithm.sapo_tau_neg=2"], "sapo_tau_neg acts only with .*policy_loss=sapo"),
        (["algorithm.m2po_threshold=0.1"], "m2po_threshold acts only with .*policy_loss=m2po"),
        (
            ["algorithm.policy_loss=cispo", "algorithm.clip_eps_high=0.3"],
            "clip_eps_high acts only with algorithm.policy_loss=ppo",
        ),
        (["algorithm.policy_loss=sapo", "algorithm.clip_eps=0.1"], "clip_eps acts only with"),
        (
            ["algorithm.policy_loss=m2po", "algorithm.policy_ratio=sequence"],
            "policy_ratio=sequence is GSPO's",
        ),
        (
            ["algorithm.policy_loss=cispo", "algorithm.rollout_correction=token_tis"],
            "would weigh it twice",
        ),
        (["algorithm.policy_loss=m2po", "algorithm.m2po_threshold=0"], "greater than 0"),
        (["algorithm.policy_loss=grpo"], "policy_loss: Input should be"),
    ],
)
def test_policy_loss_settings_that_would_not_act_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        build_config(RAW, overrides)


def test_losses_that_correct_by_themselves_take_no_rollout_correction_off_policy():
    off_policy = ["algorithm.off_policy_steps=1"]
    assert build_config(RAW, off_policy).rollout_correction() == "token_tis"
    for loss in ("cispo", "m2po"):
        job = build_config(RAW, [*off_policy, f"algorithm.policy_loss={loss}"])
        assert job.rollout_correction() == "none" and job.off_policy_notice() is None
    # SAPO gates the ratio to its base like PPO: off-policy, auto still corrects
    sapo = build_config(RAW, [*off_policy, "algorithm.policy_loss=sapo"])
    assert sapo.rollout_correction() == "token_tis"
    precision = ["trainer.dtype=float32", "rollout.engine.dtype=bfloat16"]
    bf16 = build_config(RAW, ["algorithm.policy_loss=m2po", *precision])
    assert "policy_loss=m2po weighs each token by that ratio itself" in bf16.precision_notice()
