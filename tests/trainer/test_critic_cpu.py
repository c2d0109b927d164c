"""PPO's value model on the CPU with real Megatron-core (``trainer/critic.py``), driven through
the real control channel, shard channel and ``CriticWorker`` handlers (critic_worker.py), in two
layouts of two ranks: TP=2 and DP=2 (and TP=2 in bfloat16).

The value head sees the whole hidden state under TP (the same values as without TP), the
clipped value loss falls towards the returns, a checkpoint resumes exactly, and the clip binds
once values are stale.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from torchrun_worker import run_worker

pytestmark = pytest.mark.slow  # two torchrun jobs of ~25 s each
WORKER = Path(__file__).with_name("critic_worker.py")


@pytest.fixture(scope="module")
def runs(tiny_model: Path, venv_env: dict[str, str]) -> dict[int, dict]:
    """Rank 0's report of a TP=2 and of a TP=1 x DP=2 run in float32, by TP size."""
    found = {}
    for tp in (2, 1):
        (report,) = run_worker(WORKER, 2, [tiny_model, tp, "float32"], venv_env)
        found[tp] = report
    return found


def test_a_bfloat16_value_model_trains_and_resumes(tiny_model, venv_env):
    """The trainer's default dtype: bf16 weights, fp32 main weights in Megatron's optimizer."""
    (report,) = run_worker(WORKER, 2, [tiny_model, 2, "bfloat16"], venv_env)
    losses = report["losses"]
    assert losses[-1] < 0.1 * losses[0], losses
    assert report["resumed_losses"] == losses[3:]


def close(a: list[list[float]], b: list[list[float]], tol: float) -> bool:
    return all(
        abs(x - y) <= tol for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)
    )


def test_values_are_the_same_under_tensor_parallelism(runs):
    tp2, tp1 = runs[2]["initial"], runs[1]["initial"]
    assert [len(r) for r in tp2] == [8, 11, 6, 9]  # one value per target position
    assert close(tp2, tp1, 1e-5), (tp2[0], tp1[0])
    assert any(abs(v) > 1e-3 for row in tp2 for v in row)  # a fresh head, not zeros


def test_value_loss_falls_and_layouts_agree(runs):
    for report in runs.values():
        losses = report["losses"]
        assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses
        assert losses[-1] < 0.05 * losses[0], losses
        assert all(n > 0 for n in report["grad_norms"])
    # the same gradient in both layouts: a head whose gradient were summed over TP ranks would
    # train twice as fast under TP=2
    for a, b in zip(runs[2]["losses"], runs[1]["losses"], strict=True):
        assert abs(a - b) <= 1e-4 * max(abs(a), 1e-3), (runs[2]["losses"], runs[1]["losses"])


def test_a_checkpoint_resumes_exactly(runs):
    for report in runs.values():
        assert report["loaded_steps"] == 3
        assert report["resumed_losses"] == report["losses"][3:]
        assert report["resumed_values"] == report["final_values"]
    assert sorted(Path(f).name for f in runs[2]["saved_files"]) == [
        "critic_tp0_pp0.pt",
        "critic_tp1_pp0.pt",
    ]
    assert [Path(f).name for f in runs[1]["saved_files"]] == ["critic_tp0_pp0.pt"]  # DP rank 0


def test_the_value_clip_binds_only_once_values_are_stale(runs):
    for report in runs.values():
        first, *later = report["stale_clip_fractions"]
        assert first == 0.0 and report["clip_fractions"] == [0.0] * 6  # V = V_old: nothing cut
        assert later[-1] > 0.5, report["stale_clip_fractions"]


def test_the_memory_plan_counts_the_value_model_built(runs):
    """The value head replaces the vocab-sized head before the model reaches the device: the
    plan counts the value model's parameters as built (the final norm aside), not the LM head."""
    for tp, report in runs.items():
        planned, built = report["planned_parameters"], report["parameters"]
        assert abs(planned - built) <= 64, (tp, planned, built)  # the final norm's 64


def test_a_step_reduces_its_sums_once_and_a_load_stays_in_host_memory(runs):
    for report in runs.values():
        assert report["dp_all_reduces"] == 1  # loss, count, tokens, clipped: one tensor
        # a load allocates the optimizer state the optimizer keeps, and no copy of the rest:
        # the weights are copied into the live parameters
        kept = report["optimizer_state_bytes"]
        assert 0 < report["load_copied_bytes"] <= kept, (report["load_copied_bytes"], kept)
