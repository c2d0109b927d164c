"""LifecycleCoordinator contract: leases, BLOCKED on an unknown outcome, operation ids, the
commit gate, bounded history (scripted operations; the real roles run in tests/rl)."""

from __future__ import annotations

import threading
import time

import pytest

from relax_launch.runtime import lifecycle
from relax_launch.runtime.leases import BatchFailed, LeaseError
from relax_launch.runtime.lifecycle import LifecycleCoordinator

SYNC = {("trainer", "params"), ("rollout", "weights")}


class Role:
    """A role's onload/offload, recording calls; can fail, hang or wait on a gate."""

    def __init__(self, name: str) -> None:
        self.name, self.calls = name, []
        self.fail: set[str] = set()
        self.gate: threading.Event | None = None

    def op(self, kind: str):
        def call(parts: tuple[str, ...]) -> dict[str, float]:
            self.calls.append((kind, parts))
            if self.gate is not None:
                self.gate.wait(10)
            if kind in self.fail:
                raise RuntimeError(f"{self.name} {kind} broke")
            return {"bytes": 100 * len(parts)}

        return call


def coordinator(timeout_s: float = 5.0, **roles_ranks) -> tuple[LifecycleCoordinator, dict]:
    coord = LifecycleCoordinator(operation_timeout_s=timeout_s, co_resident=SYNC)
    roles = {}
    layout = roles_ranks or {"trainer": (0, 1), "rollout": (0, 1), "teacher": (0,)}
    for name, ranks in layout.items():
        roles[name] = role = Role(name)
        trainer = name == "trainer"
        coord.register(
            name,
            ranks=ranks,
            parts=("params", "grads", "optimizer") if trainer else ("weights", "kv_cache"),
            onload=role.op("onload"),
            offload=role.op("offload"),
            inference=not trainer,
            resident=("params", "grads", "optimizer") if trainer else (),
        )
    return coord, roles


def test_rollout_and_scoring_leases_are_exclusive_until_offload_acknowledges():
    coord, _ = coordinator()
    coord.begin_batch(0)
    with pytest.raises(LeaseError, match=r"held by trainer \(ranks 0,1\)"):
        coord.activate("rollout")
    coord.deactivate("trainer", ["grads", "optimizer"])
    coord.activate("rollout", ["weights"])  # the sync window: params + weights may meet
    with pytest.raises(LeaseError, match="held by trainer"):
        coord.activate("rollout", ["kv_cache"])
    coord.deactivate("trainer")
    coord.activate("rollout", ["kv_cache"])
    with pytest.raises(LeaseError, match=r"held by rollout \(ranks 0,1\) \(kv_cache, weights"):
        coord.activate("teacher")
    coord.deactivate("rollout")
    coord.activate("teacher")
    assert coord.state()["teacher"]["lease"] == "active"


def test_disjoint_ranks_are_granted_together():
    coord, _ = coordinator(trainer=(0, 1), rollout=(0,), teacher=(1,))
    coord.deactivate("trainer")
    coord.activate("rollout")
    coord.activate("teacher")  # split: disjoint slices run in one phase
    assert {coord.state()[r]["lease"] for r in ("rollout", "teacher")} == {"active"}


def test_concurrent_duplicate_operation_joins_one_manager_rpc():
    coord, roles = coordinator()
    coord.deactivate("trainer")
    roles["teacher"].gate = gate = threading.Event()
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(coord.activate("teacher", None, "op-1")))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    time.sleep(0.2)
    gate.set()
    for t in threads:
        t.join(10)
    assert roles["teacher"].calls == [("onload", ("weights", "kv_cache"))]
    assert len(results) == 3 and len({id(r) for r in results}) == 1
    assert coord.activate("teacher", None, "op-1") is results[0]  # a later repeat: same answer


def test_operation_id_fingerprint_rejects_different_action_role_and_batch():
    coord, _ = coordinator()
    coord.deactivate("trainer", None, "op-1")
    for call in (
        lambda: coord.activate("trainer", None, "op-1"),  # action
        lambda: coord.deactivate("rollout", None, "op-1"),  # role
        lambda: coord.deactivate("trainer", ["params"], "op-1"),  # parts
    ):
        with pytest.raises(LeaseError, match="operation id 'op-1' was used"):
            call()
    coord.begin_batch(0)
    with pytest.raises(LeaseError, match="operation id 'op-1' was used"):
        coord.deactivate("trainer", None, "op-1")  # batch


def test_commit_waits_for_every_manager_release_and_wakes_all_consumers():
    coord, _ = coordinator()
    coord.begin_batch(0)
    coord.deactivate("trainer")
    coord.activate("rollout")
    woken = []
    waiters = [
        threading.Thread(target=lambda: woken.append(coord.wait_committed(0, 10))) for _ in range(2)
    ]
    for t in waiters:
        t.start()
    with pytest.raises(LeaseError, match="before inference offload: rollout"):
        coord.commit_batch(0)
    coord.deactivate("rollout")
    coord.commit_batch(0)
    for t in waiters:
        t.join(10)
    assert woken == [None, None]
    assert [e["event"] for e in coord.events][-1] == "commit"


@pytest.mark.parametrize("kind", ["onload", "offload"])
def test_manager_failure_retains_lease_and_fails_current_and_future_batch_waiters(kind):
    coord, roles = coordinator()
    coord.begin_batch(0)
    coord.deactivate("trainer")
    roles["teacher"].fail.add(kind)
    if kind == "offload":
        coord.activate("teacher")
    failing = coord.activate if kind == "onload" else coord.deactivate
    with pytest.raises(LeaseError, match=r"teacher \(rank 0\): \w+ failed .*BLOCKED"):
        failing("teacher")
    assert coord.state()["teacher"]["lease"] == "blocked"
    with pytest.raises(BatchFailed, match="teacher"):
        coord.wait_committed(0, 1)  # a waiter that comes after the failure
    with pytest.raises(LeaseError, match="lease is held by teacher"):
        coord.activate("rollout")
    with pytest.raises(LeaseError, match="BLOCKED"):
        coord.begin_batch(1)
    roles["teacher"].fail.clear()
    coord.deactivate("teacher")  # the confirmed cleanup releases the lease
    assert coord.state()["teacher"] == {"lease": "sleeping", "resident": [], "ranks": [0]}
    coord.begin_batch(1)  # and a retry goes through
    coord.activate("rollout")


def test_timeout_never_releases_lease_even_after_late_rpc_success():
    coord, roles = coordinator()
    coord.begin_batch(0)
    coord.deactivate("trainer")
    coord.operation_timeout_s = 0.3  # for the gated call only
    roles["rollout"].gate = gate = threading.Event()
    with pytest.raises(LeaseError, match="no answer within"):
        coord.activate("rollout", None, "slow")
    gate.set()  # the late call succeeds ...
    time.sleep(0.2)
    assert coord.state()["rollout"]["lease"] == "blocked"  # ... and changes nothing
    with pytest.raises(LeaseError, match="no answer within"):
        coord.activate("rollout", None, "slow")  # joining it gets the same outcome
    with pytest.raises(BatchFailed):
        coord.wait_committed(0, 1)


def test_batch_failure_does_not_release_active_scorer_and_allows_confirmed_cleanup():
    coord, roles = coordinator()
    coord.begin_batch(0)
    coord.deactivate("trainer")
    coord.activate("teacher")
    coord.fail_batch(0, "teacher scoring: HTTP 500")
    assert coord.state()["teacher"]["lease"] == "active"
    with pytest.raises(BatchFailed, match="HTTP 500"):
        coord.wait_committed(0, 1)
    coord.deactivate("teacher")
    assert roles["teacher"].calls[-1] == ("offload", ("weights", "kv_cache"))
    assert coord.state()["teacher"]["lease"] == "sleeping"


def test_wait_timeout_does_not_change_batch_or_lease():
    coord, _ = coordinator()
    coord.begin_batch(0)
    before = coord.state()
    with pytest.raises(TimeoutError):
        coord.wait_committed(0, 0.1)
    assert coord.state() == before and coord.pending == 0


def test_only_one_batch_is_pending_and_old_commit_remains_available():
    coord, _ = coordinator()
    coord.begin_batch(0)
    with pytest.raises(LeaseError, match="batch 0 is still in flight"):
        coord.begin_batch(1)
    coord.commit_batch(0)
    coord.begin_batch(1)
    coord.wait_committed(0, 0.1)  # still answerable


def test_committed_batches_and_operations_are_evicted_with_bounded_history(monkeypatch):
    monkeypatch.setattr(lifecycle, "BATCH_HISTORY", 3)
    monkeypatch.setattr(lifecycle, "OPERATION_HISTORY", 2)
    coord, _ = coordinator()
    for batch in range(5):
        coord.begin_batch(batch)
        coord.deactivate("teacher", None, f"op-{batch}")
        coord.commit_batch(batch)
    assert list(coord.batches) == [2, 3, 4] and list(coord.operations) == ["op-3", "op-4"]
    with pytest.raises(LeaseError, match="never begun"):
        coord.wait_committed(0, 0.1)


def test_registration_is_idempotent_and_topology_is_frozen_before_first_batch():
    coord, roles = coordinator()
    noop = roles["teacher"].op("onload")
    coord.register("teacher", ranks=(0,), parts=("weights", "kv_cache"), onload=noop, offload=noop)
    with pytest.raises(LeaseError, match="registered already"):
        coord.register("teacher", ranks=(1,), parts=("weights",), onload=noop, offload=noop)
    coord.begin_batch(0)
    with pytest.raises(LeaseError, match="frozen"):
        coord.register("genrm", ranks=(0,), parts=("weights",), onload=noop, offload=noop)


@pytest.mark.parametrize("batch", [-1, 1.5, "1", True, None])
def test_invalid_batch_ids_are_refused(batch):
    coord, _ = coordinator()
    with pytest.raises(LeaseError, match="batch ids are integers"):
        coord.begin_batch(batch)


def test_batch_ids_increase():
    coord, _ = coordinator()
    coord.begin_batch(3)
    coord.commit_batch(3)
    with pytest.raises(LeaseError, match="not after batch 3"):
        coord.begin_batch(3)


def test_event_log_proves_who_held_the_ranks(tmp_path):
    coord, _ = coordinator()
    coord.log_path = tmp_path / "coordinator.jsonl"
    coord.begin_batch(0)
    coord.deactivate("trainer")
    coord.activate("rollout")
    coord.deactivate("rollout")
    coord.commit_batch(0)
    lines = (tmp_path / "coordinator.jsonl").read_text().splitlines()
    assert len(lines) == len(coord.events) == 8
    confirms = [e for e in coord.events if e["event"] == "confirm"]
    assert [e["holders"] for e in confirms] == [
        {},
        {"rollout": ["kv_cache", "weights"]},
        {},
    ]
    assert confirms[1]["bytes"] == 200


def test_a_duplicate_of_a_timed_out_operation_gets_its_outcome_at_once():
    coord, roles = coordinator()
    coord.deactivate("trainer")
    coord.operation_timeout_s = 0.5  # for the hung call
    roles["teacher"].gate = gate = threading.Event()  # the call hangs
    try:
        with pytest.raises(LeaseError, match="no answer within") as first:
            coord.activate("teacher", None, "hung")
        coord.operation_timeout_s = 30  # a second wait on the hung call would take 30 s
        with pytest.raises(LeaseError, match="no answer within") as again:
            coord.activate("teacher", None, "hung")
        # the recorded outcome, at once: a wait of its own would end "no answer within 30 s"
        assert str(again.value) == str(first.value) and "30 s" not in str(again.value)
    finally:
        gate.set()
    assert roles["teacher"].calls == [("onload", ("weights", "kv_cache"))]
