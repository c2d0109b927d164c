"""InferenceManager lifecycle logic and static-model protection.

The engines here are scripted stand-ins that record each operation (this module's logic only);
the same operations against a real SGLang engine are in test_gateway.py.
"""

from __future__ import annotations

import pytest

from relax_launch.inference import engine as engine_module
from relax_launch.inference.discovery import RoutingSpec, State, WeightSource
from relax_launch.inference.engine import (
    WEIGHT_MUTATIONS,
    EngineHandle,
    EngineRequestError,
    StaticModelError,
)
from relax_launch.inference.manager import InferenceManager, LifecycleError


class ScriptedEngine(EngineHandle):
    """Records operations; ``fail`` names operations that raise like an engine error."""

    def __init__(self, engine_id: str, fail: set[str] | None = None, version: str = "0") -> None:
        super().__init__(
            engine_id,
            f"http://127.0.0.1:1/{engine_id}".rsplit("/", 1)[0],
            role="rollout",
            static=False,
        )
        self.ops: list[tuple[str, object]] = []
        self.fail, self.version = fail or set(), version

    def call(self, op, body=None, timeout_s=None):
        self.require_mutable(op)
        self.ops.append((op, body))
        if op in self.fail:
            raise EngineRequestError(f"rollout engine {self.engine_id}: {op} refused")
        return {}

    def weight_version(self) -> str:
        return self.version

    def names(self) -> list[str]:
        return [op for op, _ in self.ops]


def manager(engines, weight_source=WeightSource.STATIC, drain_timeout_s=1.0) -> InferenceManager:
    m = InferenceManager(
        role="teacher" if weight_source is WeightSource.STATIC else "rollout",
        model_id="m",
        served_model_name="/models/m",
        weight_source=weight_source,
        routing=RoutingSpec(default_model="m"),
        drain_timeout_s=drain_timeout_s,
    )
    m.attach(engines)
    return m


def test_repeated_offload_onload_shutdown_are_idempotent():
    e = ScriptedEngine("e0")
    m = manager([e])
    m.offload()
    m.offload()
    assert e.names().count("release_memory_occupation") == 1
    assert e.names()[:3] == ["pause_generation", "abort_request", "flush_cache"]
    m.onload()
    m.onload()
    assert e.names().count("resume_memory_occupation") == 1
    assert e.names().count("continue_generation") == 1
    assert m.ready
    stops = []
    m._on_shutdown = [lambda: stops.append(1)]
    m.shutdown()
    m.shutdown()
    assert stops == [1] and m.state is State.DEAD
    with pytest.raises(LifecycleError, match="shut down"):
        m.onload()


def test_partial_onload_is_never_ready_and_resumes_only_missing_tags():
    e = ScriptedEngine("e0")
    m = manager([e])
    m.offload()
    m.onload(["weights"])
    assert m.state is State.ONLOADING and not m.ready
    assert m.snapshot().models["m"].state is State.ONLOADING
    assert "continue_generation" not in e.names()
    m.onload()
    resumed = [body["tags"] for op, body in e.ops if op == "resume_memory_occupation"]
    assert resumed == [["weights"], ["cuda_graph", "kv_cache"]]
    assert m.ready


def test_offload_of_some_tags_keeps_the_others():
    e = ScriptedEngine("e0")
    m = manager([e])
    m.offload(["kv_cache"])
    assert e.loaded == {"weights", "cuda_graph"}
    m.onload()
    assert [b for op, b in e.ops if op == "resume_memory_occupation"] == [{"tags": ["kv_cache"]}]


def test_failed_pause_never_releases_memory_and_closes_admission():
    e = ScriptedEngine("e0", fail={"pause_generation"})
    m = manager([e])
    with pytest.raises(LifecycleError, match="admission stays closed"):
        m.offload()
    assert "release_memory_occupation" not in e.names()
    assert m.state is State.FAILED and not m.ready
    e.fail.clear()
    m.onload()  # recovery: nothing was released, so only generation is reopened
    assert m.ready and "resume_memory_occupation" not in e.names()


def test_drain_that_never_goes_idle_times_out_without_release():
    e = ScriptedEngine("e0", fail={"flush_cache"})
    m = manager([e], drain_timeout_s=0.3)
    with pytest.raises(LifecycleError, match="still busy"):
        m.offload()
    assert "release_memory_occupation" not in e.names()
    assert e.names().count("abort_request") >= 2  # abort -> flush retried until the deadline
    assert m.state is State.FAILED


def test_failed_release_on_one_engine_fails_the_model():
    good, bad = ScriptedEngine("e0"), ScriptedEngine("e1", fail={"release_memory_occupation"})
    m = manager([good, bad])
    with pytest.raises(LifecycleError, match="e1"):
        m.offload()
    assert m.state is State.FAILED
    assert good.loaded == set() and bad.loaded == {"weights", "kv_cache", "cuda_graph"}
    bad.fail.clear()
    m.onload()
    assert m.ready and good.complete and bad.complete


def test_revision_moves_only_when_content_changes():
    m = manager([ScriptedEngine("e0")])
    first = m.snapshot()
    assert m.snapshot().topology_revision == first.topology_revision
    m.offload()
    second = m.snapshot()
    assert second.topology_revision == first.topology_revision + 1
    assert second.models["m"].engines[0].direct_eligible is False
    assert m.snapshot().topology_revision == second.topology_revision
    assert first.models["m"].state is State.READY  # an old snapshot never changes


def test_rollout_is_ready_only_after_a_committed_sync():
    e = ScriptedEngine("e0", version="0")
    m = manager([e], weight_source=WeightSource.TRAINER)
    assert not m.ready and m.snapshot().models["m"].state is State.ONLOADING
    m.weights_updating()
    m.weights_lost("the first sync failed")
    assert not m.ready  # a failed first sync keeps it unavailable
    m.weights_updating()
    m.weights_committed(0)
    assert m.ready and m.snapshot().models["m"].weight_version == "0"
    m.weights_updating()
    assert not m.ready  # never routable while a sync is in flight
    m.weights_lost("sent twice, failed twice")
    assert not m.ready  # engines may hold parts of two versions: closed, not rolled back
    assert m.snapshot().models["m"].weight_version == "0"  # the last whole version's label
    e.version = "1"
    m.weights_updating()
    m.weights_committed(1)
    assert m.ready  # until a sync commits


def test_rollout_that_released_its_weights_waits_for_the_next_sync():
    e = ScriptedEngine("e0", version="3")
    m = manager([e], weight_source=WeightSource.TRAINER)
    m.weights_updating()
    m.weights_committed(3)
    m.offload(["kv_cache"])
    m.onload()
    assert m.ready  # the weights stayed resident
    m.offload()
    m.onload()
    assert not m.ready and m.snapshot().models["m"].state is State.ONLOADING
    m.weights_updating()
    m.weights_committed(3)
    assert m.ready


def test_static_model_keeps_its_weights_across_offload():
    m = manager([ScriptedEngine("e0")])
    m.offload()
    m.onload()
    assert m.ready  # restored from its backup, no sync needed


def test_commit_that_engines_do_not_serve_fails_the_model():
    e = ScriptedEngine("e0", version="1")
    m = manager([e], weight_source=WeightSource.TRAINER)
    m.weights_updating()
    with pytest.raises(LifecycleError, match="do not serve weight_version 2"):
        m.weights_committed(2)
    assert m.state is State.FAILED and not m.ready


@pytest.mark.parametrize("role", ["teacher", "genrm"])
@pytest.mark.parametrize("op", sorted(WEIGHT_MUTATIONS))
def test_static_model_rejects_weight_mutations_before_network(monkeypatch, role, op):
    sent = []
    monkeypatch.setattr(engine_module, "post", lambda *a, **k: sent.append(a))
    handle = EngineHandle("m/0", "http://127.0.0.1:9", role=role, static=True)
    with pytest.raises(StaticModelError, match=f"STATIC model and refuses '{op}'"):
        handle.call(op, {})
    assert sent == []


def test_dynamic_model_and_static_lifecycle_calls_do_reach_the_engine(monkeypatch):
    sent = []
    monkeypatch.setattr(engine_module, "post", lambda url, path, *a: sent.append(path))
    EngineHandle("m/0", "http://h:1", role="rollout", static=False).call("update_weights_from_disk")
    EngineHandle("m/0", "http://h:1", role="teacher", static=True).call("release_memory_occupation")
    assert sent == ["/update_weights_from_disk", "/release_memory_occupation"]
