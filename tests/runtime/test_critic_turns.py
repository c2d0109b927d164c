"""The value model's moves within the trainer's turn (``runtime/critic_turns.py``), in the order
each mode makes them (the real moves in a job: tests/rl/test_critic_job.py)."""

from __future__ import annotations

import pytest

from relax_launch.runtime.critic_turns import CriticTurns


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
