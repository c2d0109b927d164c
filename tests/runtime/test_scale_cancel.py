"""RFC #351's cancel at the edges of a scale-out (``EngineScaler``, ``runtime/scaling.py``): a
cancel answered 202 always ends ``cancelled`` with the engines stopped by PID and the count
returned; once the engines are being routed a cancel is refused 409 ("too late"), so a 202
``cancelling`` never ends ``succeeded``. Over a real plan and real InferenceManagers with the
ranks' commands answered in process, as ``test_scaling.py``."""

from __future__ import annotations

import threading

import pytest
from test_scaling import JOB, Ranks, ended, genrm_manager, rollout_scaler, routed

from relax_launch.config import build_config
from relax_launch.deadline import wait_until
from relax_launch.inference.scale_routes import ScaleRefused
from relax_launch.placement import plan
from relax_launch.runtime import scaling
from relax_launch.runtime.rank_commands import StopEngine


@pytest.fixture
def scaler(tmp_path, monkeypatch):
    monkeypatch.setattr(scaling, "get_json", lambda url, path, timeout_s: {})  # healthy
    made = scaling.EngineScaler(
        plan=plan(build_config(JOB)),
        managers={"genrm": genrm_manager()},
        call=Ranks(),
        startup_timeout_s=30,
        drain_timeout_s=30,
        sync_lock=threading.Lock(),
        log_dir=tmp_path,
    )
    made.ranks, made.manager = made._call, made.managers["genrm"]
    return made


def test_a_cancel_once_the_engines_are_routed_is_refused_409_and_the_scale_out_stands(scaler):
    """The cancel comes while the started, healthy engine is being put in routing (after the
    last cancel check): it was answered 202 ``cancelling`` and the operation then ended
    ``succeeded`` with its engine; now it is refused 409 and nothing is stopped."""
    reached, gate = threading.Event(), threading.Event()
    add = scaler.manager.add_engine

    def held_add(handle, joining=False):
        reached.set()
        gate.wait(60)  # bounds only guard against a hang: a loaded machine is slow
        add(handle, joining=joining)

    scaler.manager.add_engine = held_add
    op = scaler.request("genrm", "scale_out", 2)
    try:
        assert reached.wait(60)
        with pytest.raises(ScaleRefused) as refused:
            scaler.cancel("genrm", op.request_id)
    finally:
        gate.set()
    assert refused.value.status == 409 and "too late to cancel" in str(refused.value)
    doc = ended(scaler, op)
    assert doc["state"] == "succeeded" and doc["actual"] == 2, doc
    assert not [c for c in scaler.ranks.commands if isinstance(c, StopEngine)]


def test_a_cancel_in_the_instant_a_sync_routes_a_rollout_engine_still_stops_it(
    tmp_path, monkeypatch
):
    """The sync commits on the joining engine (routed) and the cancel comes before the scale-out
    has seen it: the cancel was answered 202 and the operation ended ``succeeded``; now it ends
    ``cancelled``, the engine taken out of routing (what it was sent goes elsewhere) and
    stopped by PID, the count as before."""
    rollout = rollout_scaler(tmp_path, monkeypatch)
    manager, answers = rollout.manager, []
    serving = manager.serving

    def serving_then_cancel():
        now = serving()
        if "tiny-llama/1" in {e.engine_id for e in now} and not answers:
            answers.append(rollout.cancel("rollout", op.request_id).state)
        return now

    manager.serving = serving_then_cancel
    op = rollout.request("rollout", "scale_out", 2)
    assert wait_until(lambda: "tiny-llama/1" in manager.joining, 60)
    manager.admit("tiny-llama/1")  # the weight sync took it in and committed: routed
    doc = ended(rollout, op)
    assert answers == ["cancelling"]
    assert doc["state"] == "cancelled" and "rollout keeps 1" in doc["error"], doc
    assert [c.index for c in rollout.ranks.commands if isinstance(c, StopEngine)] == [1]
    assert routed(manager) == ["tiny-llama/0"] and rollout.count("rollout") == 1
    assert manager.was_retired("http://10.0.0.1:30000/generate")  # a request there is re-sent


def test_a_cancel_answered_while_a_failed_start_is_undone_ends_cancelled(scaler, monkeypatch):
    """The engine fails its health check and the scale-out is stopping what it started when the
    cancel comes: the cancel is answered 202, so the operation ends ``cancelled`` (it ended
    ``failed``, or stayed ``cancelling`` when its end raced the cancel's), the count as before."""

    def unhealthy(url, path, timeout_s):
        raise ConnectionError("health check refused")

    monkeypatch.setattr(scaling, "get_json", unhealthy)
    answers, call, requested = [], scaler._call, threading.Event()

    def call_then_cancel(command, ranks, timeout_s):
        if isinstance(command, StopEngine) and not answers:  # the undo under way
            # the scale-out's thread may get here before request() has returned the operation
            assert requested.wait(60), "request() did not return"
            answers.append(scaler.cancel("genrm", op.request_id).state)
        return call(command, ranks, timeout_s)

    scaler._call = call_then_cancel
    op = scaler.request("genrm", "scale_out", 2)
    requested.set()
    doc = ended(scaler, op)
    assert answers == ["cancelling"]
    assert doc["state"] == "cancelled" and "health check refused" in doc["error"], doc
    assert scaler.count("genrm") == 1
