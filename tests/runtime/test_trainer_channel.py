"""The trainer channel for real (torchrun, gloo, the torchrun store): typed commands through the
store, each data-parallel rank receiving only its shard over torch.distributed, results back the
same way, and a store whose keys and bytes stay flat over the steps."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from harness.processes import run_group

from relax_launch.inference.process import free_port
from relax_launch.placement.plan import TrainerLayout
from relax_launch.trainer.batch import TokenBatch

WORKER = Path(__file__).with_name("channel_worker.py")
SMALL_RECORD = 1024  # bytes; every batch of the run is larger


def as_batch(fields: list[list[list[float]]]) -> TokenBatch:
    rows = [tuple(map(tuple, f)) for f in fields]
    return TokenBatch(rows[0], rows[1], rows[2], rows[3] or None)


def as_lists(batch: TokenBatch) -> list[list[list[float]]]:
    return [list(map(list, rows or ())) for rows in batch.__dict__.values()]


def packed_bytes(batch: TokenBatch) -> int:
    ids, values = batch.pack()
    return ids.numel() * ids.element_size() + values.numel() * values.element_size()


def run_job(
    out: Path, first: int, tp: int, dp: int, pp: int, cp: int, env: dict
) -> dict[int, dict]:
    world = first + tp * cp * dp * pp
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [str(torchrun), "--nproc-per-node", str(world), "--master-port", str(free_port())]
    run_group([*command, str(WORKER), str(out), *map(str, (first, tp, dp, pp, cp))], 400, env)
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(world)}


@pytest.mark.parametrize(
    ("first", "tp", "dp", "pp", "cp"),
    [
        # slow: the RL jobs of tests/rl deliver batches to TP=2 (the adapter job), DP=2 (the
        # loss family) and PP=2 (three roles) trainers; the store's footprint is asserted here
        pytest.param(1, 2, 2, 1, 1, marks=pytest.mark.slow),
        pytest.param(0, 1, 2, 2, 1, marks=pytest.mark.slow),
        (1, 1, 2, 1, 2),
    ],
    ids=["controller-apart-tp2-dp2", "controller-is-a-trainer-dp2-pp2", "controller-apart-cp2-dp2"],
)
def test_each_dp_rank_gets_only_its_shard_and_the_store_stays_flat(
    tmp_path, venv_env, first, tp, dp, pp, cp
):
    reports = run_job(tmp_path, first, tp, dp, pp, cp, venv_env)
    controller = reports[0]
    batches = [as_batch(fields) for fields in controller["batches"]]
    # The store: the same keys and bytes after every step; only small records ever put in it.
    assert len({tuple(f) for f in controller["footprints"]}) == 1, controller["footprints"]
    assert max(r["largest_record"] for r in reports.values()) < SMALL_RECORD
    assert min(packed_bytes(b) for b in batches) > SMALL_RECORD

    ranks = tuple(range(first, first + tp * cp * dp * pp))
    layout = TrainerLayout(ranks, tp, pp, dp, "train", cp_size=cp)
    for rank in layout.ranks:  # every TP/CP/PP peer of a DP rank gets that DP rank's shard only
        dp_rank = layout.coordinates(rank)[1]
        mine = [b.shards(dp)[dp_rank] for b in batches]
        assert reports[rank]["shards"] == [as_lists(s) for s in mine], f"rank {rank}"
        assert reports[rank]["received_bytes"] == sum(map(packed_bytes, mine)), f"rank {rank}"

    # Replies: metrics from the last stage's first rank; logprobs of every row, in batch order.
    assert controller["metrics"] == [
        {"sequences": len(b) // dp, "first_token": b.tokens[0][0]} for b in batches[:-1]
    ]
    assert controller["logprobs"] == [[t / 1024 for t in row[1:]] for row in batches[-1].tokens]
