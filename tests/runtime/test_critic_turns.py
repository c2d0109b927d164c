"""The value model's moves within the trainer's turn (``runtime/critic_turns.py``), in the order
each mode makes them (the real moves in a job: tests/rl/test_critic_job.py)."""

from __future__ import annotations

import pytest

from relax_launch.runtime.critic_turns import CriticTurns
from relax_launch.runtime.trainer_client import moved_by_ranks
from relax_launch.trainer.offload import move_parts


class Moves:
    """A trainer's or critic's client: offload/onload recorded, 1 GB each."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def offload(self, parts):
        self.log.append((self.name, "off", tuple(parts)))
        return {"bytes": 1e9}

    def onload(self, parts):
        self.log.append((self.name, "on", tuple(parts)))
        return {"bytes": 1e9}


def turn(mode: str) -> tuple[list, dict[str, float]]:
    log: list = []
    turns = CriticTurns(Moves("policy", log), Moves("critic", log), mode)
    for moment in ("scoring", "policy_training", "critic_training", "done"):
        log.append(moment)
        getattr(turns, moment)()
    return log, turns.take_moved()


ALL = ("params", "grads", "optimizer")


def test_swap_moves_the_critic_out_of_the_policys_step_and_the_policys_state_out_of_its():
    log, moved = turn("swap")
    assert log == [
        "scoring",
        ("critic", "on", ("params",)),
        "policy_training",
        ("critic", "off", ("params",)),
        "critic_training",
        ("policy", "off", ("grads", "optimizer")),
        ("critic", "on", ALL),
        "done",
        ("critic", "off", ALL),
        ("policy", "on", ("grads", "optimizer")),
    ]
    assert moved == {
        "critic_onloaded": 2e9,
        "critic_offloaded": 2e9,
        "policy_swapped_out": 1e9,
        "policy_swapped_in": 1e9,
    }


def test_keep_brings_the_critic_once_and_resident_moves_nothing():
    log, moved = turn("keep")
    assert log == [
        "scoring",
        ("critic", "on", ALL),
        "policy_training",
        "critic_training",
        "done",
        ("critic", "off", ALL),
    ]
    assert moved == {"critic_onloaded": 1e9, "critic_offloaded": 1e9}
    log, moved = turn("resident")
    assert [x for x in log if isinstance(x, tuple)] == [] and moved == {}


@pytest.mark.parametrize("mode", ["keep", "swap"])
def test_take_moved_counts_each_step_afresh(mode):
    log: list = []
    turns = CriticTurns(Moves("policy", log), Moves("critic", log), mode)
    turns.scoring()
    assert turns.take_moved()["critic_onloaded"] == 1e9
    assert turns.take_moved() == {}


class Offloader:
    """A rank's ``StateOffloader``: which parts are in host memory, and each part's bytes (an
    empty part, e.g. Adam's state before the first step, has none but moves all the same)."""

    def __init__(self, away=(), sizes=None) -> None:
        self.away, self.sizes = set(away), sizes or {}

    def resident(self, part):
        return part not in self.away

    def offload(self, parts):
        moved = {p: 0 if p in self.away else self.sizes.get(p, 1) for p in parts}
        self.away |= set(parts)
        return moved

    def onload(self, parts):
        moved = {p: self.sizes.get(p, 1) if p in self.away else 0 for p in parts}
        self.away -= set(parts)
        return moved


class Policy:
    """Two trainer ranks behind a client: each rank replies as ``Trainer.offload`` does."""

    def __init__(self, **offloader) -> None:
        self.ranks = [Offloader(**offloader), Offloader(**offloader)]

    def offload(self, parts):
        return moved_by_ranks(
            {i: move_parts(r, "offload", parts) for i, r in enumerate(self.ranks)}
        )

    def onload(self, parts):
        return moved_by_ranks({i: move_parts(r, "onload", parts) for i, r in enumerate(self.ranks)})


@pytest.mark.parametrize(
    ("offloader", "left_away"),
    [
        ({}, set()),  # the usual: the policy whole on the device, whole again after
        ({"sizes": {"optimizer": 0}}, set()),  # Adam's state not made yet: it comes back too
        ({"away": ("grads",)}, {"grads"}),  # in host memory before: it stays there
        ({"away": ("grads", "optimizer")}, {"grads", "optimizer"}),
    ],
)
def test_a_swapped_checkpoint_brings_back_only_what_it_moved(offloader, left_away):
    policy = Policy(**offloader)
    turns = CriticTurns(policy, Moves("critic", []), "swap")
    seen = []
    assert (
        turns.checkpoint(
            lambda: seen.append({p for p in ALL if not policy.ranks[0].resident(p)}) or 7
        )
        == 7
    )
    assert seen == [{"grads", "optimizer"}]  # the critic's save or load ran with both away
    assert all(rank.away == left_away for rank in policy.ranks)


def test_a_swapped_checkpoint_brings_back_what_it_moved_after_a_failure():
    policy = Policy(away=("grads",))
    turns = CriticTurns(policy, Moves("critic", []), "swap")
    with pytest.raises(RuntimeError, match="disk full"):
        turns.checkpoint(lambda: (_ for _ in ()).throw(RuntimeError("disk full")))
    assert all(rank.away == {"grads"} for rank in policy.ranks)
