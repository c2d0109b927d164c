"""The order of a colocated batch (defer, split) under the coordinator, with scripted work and
scripted role operations (the real job: tests/rl/test_colocated_job.py)."""

from __future__ import annotations

import threading

import pytest

from relax_launch.rl.colocated import PhaseError, run_batch
from relax_launch.runtime.colocation import SYNC_WINDOW
from relax_launch.runtime.leases import BatchFailed, LeaseError
from relax_launch.runtime.lifecycle import LifecycleCoordinator
from relax_launch.trainer.offload import PARTS

ENGINE_PARTS = ("weights", "kv_cache")


class Work:
    """Records each step of the batch with who held memory at that moment."""

    def __init__(self, coordinator: LifecycleCoordinator, fail: str = "", rounds: int = 1) -> None:
        self.coordinator, self.fail, self.log, self.rounds = coordinator, fail, [], rounds

    def _at(self, what: str) -> None:
        holders = {r: s["resident"] for r, s in self.coordinator.state().items() if s["resident"]}
        self.log.append((what, holders))
        if what == self.fail:
            raise RuntimeError(f"{what} broke")

    def sync(self) -> None:
        self._at("sync")

    def generate(self) -> None:
        self._at("generate")

    def score(self, role: str) -> None:
        self._at(role)

    def enough(self) -> bool:
        self.rounds -= 1
        return self.rounds == 0

    def finish(self) -> None:
        self._at("finish")


def coordinator(layout: dict[str, tuple[int, ...]], broken: str = "") -> LifecycleCoordinator:
    coord = LifecycleCoordinator(operation_timeout_s=60, co_resident=SYNC_WINDOW)  # hang bound

    def op(role: str, kind: str):
        def call(parts):
            if f"{role}.{kind}" == broken:
                raise RuntimeError("engine did not answer")
            return {"bytes": 10.0}

        return call

    for role, ranks in layout.items():
        trainer = role == "trainer"
        coord.register(
            role,
            ranks=ranks,
            parts=PARTS if trainer else ENGINE_PARTS,
            onload=op(role, "onload"),
            offload=op(role, "offload"),
            inference=not trainer,
            resident=PARTS if trainer else (),
        )
    return coord


DEFER = {"trainer": (0, 1), "rollout": (0, 1), "teacher": (0, 1), "genrm": (0,)}
SPLIT = {"trainer": (0, 1, 2), "rollout": (0,), "teacher": (1,), "genrm": (2,)}


def test_deferred_writeback_precedes_commit_and_never_overlaps():
    coord = coordinator(DEFER)
    work = Work(coord)
    turns = run_batch(work, coord, 0, split=False)
    assert [what for what, _ in work.log] == ["sync", "generate", "teacher", "genrm", "finish"]
    held = dict(work.log)
    assert held["sync"] == {"trainer": ["params"], "rollout": ["weights"]}
    assert held["generate"] == {"rollout": ["kv_cache", "weights"]}
    assert held["teacher"] == {"teacher": ["kv_cache", "weights"]}
    assert held["genrm"] == {"genrm": ["kv_cache", "weights"]}
    events = [(e["event"], e.get("role")) for e in coord.events]
    assert events.index(("confirm", "genrm")) < events.index(("commit", None))
    assert events[-1] == ("confirm", "trainer")  # the trainer gets its ranks back last
    assert coord.state()["trainer"]["resident"] == sorted(PARTS)
    assert turns.moved["trainer_offloaded"] == 20.0  # grads+optimizer, then params: 10 each
    assert turns.moved["engines_offloaded"] == 30.0 and "onload_teacher" in turns.seconds


def test_split_runs_inference_roles_on_their_slices_together():
    coord = coordinator(SPLIT)
    work = Work(coord)
    run_batch(work, coord, 0, split=True)
    held = dict(work.log)
    assert set(held["generate"]) == {"rollout", "teacher", "genrm"}
    assert held["finish"] == {}


def test_split_draws_more_rounds_while_its_slices_stay_onloaded():
    coord = coordinator(SPLIT)
    work = Work(coord, rounds=3)  # dynamic sampling: two rounds without enough signal
    run_batch(work, coord, 0, split=True)
    steps = [what for what, _ in work.log]
    assert steps == ["sync"] + ["generate", "teacher", "genrm"] * 3 + ["finish"]
    rounds = [held for what, held in work.log if what in ("generate", "teacher", "genrm")]
    assert all(set(held) == {"rollout", "teacher", "genrm"} for held in rounds)


def test_deferred_teacher_failure_never_commits_and_never_trains():
    coord = coordinator(DEFER)
    work = Work(coord, fail="teacher")
    with pytest.raises(
        PhaseError, match=r"phase teacher of batch 0 failed on teacher \(ranks 0,1\)"
    ):
        run_batch(work, coord, 0, split=False)
    assert "commit" not in [e["event"] for e in coord.events]
    assert "finish" not in [w for w, _ in work.log]
    with pytest.raises(BatchFailed, match="teacher broke"):
        coord.wait_committed(0, 1)
    assert coord.state()["trainer"]["resident"] == []  # never onloaded to train


def test_failed_offload_blocks_names_rank_and_role_and_a_retry_after_recovery_succeeds():
    coord = coordinator(DEFER, broken="rollout.offload")
    with pytest.raises(LeaseError, match=r"rollout \(ranks 0,1\): offload failed"):
        run_batch(Work(coord), coord, 0, split=False)
    assert coord.state()["rollout"]["lease"] == "blocked"
    with pytest.raises(LeaseError, match="BLOCKED"):
        run_batch(Work(coord), coord, 1, split=False)
    coord.members["rollout"].offload = lambda parts: {}  # the engine recovers
    coord.deactivate("rollout")
    run_batch(Work(coord), coord, 1, split=False)
    assert [e["event"] for e in coord.events].count("commit") == 1


def test_split_onloads_and_offloads_its_slices_at_once():
    coord = coordinator(SPLIT)
    together = {kind: threading.Barrier(3, timeout=60) for kind in ("onload", "offload")}

    def meet(kind: str):
        def call(parts):
            if parts != ("weights",):  # rollout's weights onload alone, before the sync
                together[kind].wait()  # breaks (an error) unless all three move at once
            return {"bytes": 1.0}

        return call

    for role in ("rollout", "teacher", "genrm"):
        coord.members[role].onload, coord.members[role].offload = meet("onload"), meet("offload")
    turns = run_batch(Work(coord), coord, 0, split=True)
    assert turns.moved["engines_onloaded"] == 4.0 and turns.moved["engines_offloaded"] == 3.0
