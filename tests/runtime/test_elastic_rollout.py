"""A rollout replica scaled out while the job runs (``rollout.max_engines``): it joins the
next weight sync, is routed only once it holds that version (its logprobs then equal the
trainer's, checked before any request was routed to it), serves, and is scaled in again; the
next sync goes to the planned engine alone. A real torchrun job (``job_worker.py
scale_rollout``); slow (50 s), run it with ``bash scripts/test.sh -m slow
tests/runtime/test_elastic_rollout.py``. The same behind sglang-router (route mode ``router``,
default run): the new engine serves through the router once a sync committed on it."""

from __future__ import annotations

import json

import pytest
from test_job import PARITY_TOLERANCE, assert_no_sglang_left, finish, start

pytestmark = pytest.mark.e2e


@pytest.mark.slow
def test_a_scaled_out_rollout_engine_serves_the_current_version_and_leaves_cleanly(tmp_path):
    out = tmp_path / "report.json"
    env = {"RELAX_ADMIN_TOKEN": "elastic-rollout"}
    process, _ = start("scale_rollout", "elastic_rollout_tiny.yaml", out, tmp_path, env=env)
    code, output = finish(process, 500)
    assert code == 0, output[-4000:]
    report = json.loads(out.read_text())
    # started, healthy, but out of routing until a sync takes it in
    assert report["joining"]["replicas"][0]["state"] == "weight_syncing", report["joining"]
    assert len(report["serving_while_joining"]) == 1
    done = report["scale_out"]
    assert done["state"] == "succeeded" and done["actual"] == 2, done
    assert report["new_version"] == "1"
    assert report["answered_before_check"] == 0  # nothing routed to it before the check
    assert report["parity_new"] <= PARITY_TOLERANCE, report["parity_new"]
    assert report["routed"] == [200] * 4 and report["answered_after"] >= 2  # round robin
    scale_in = report["scale_in"]
    assert scale_in["state"] == "succeeded" and scale_in["actual"] == 1, scale_in
    assert report["versions_after"] == ["2"] and report["parity_after"] <= PARITY_TOLERANCE
    assert not report["new_alive"]
    print(f"new rollout engine: logprob parity {report['parity_new']:.2e} at version 1")
    assert_no_sglang_left(tmp_path)


def test_behind_sglang_router_a_scaled_out_engine_serves_once_synced_and_leaves_cleanly(tmp_path):
    """rollout.max_engines with gateway.rollout_route_mode=router: scale-out by the API, the
    router learns of the engine only when the sync commits on it, requests sent through the
    gateway (to the router) reach it, and the scale-in takes it out of the router."""
    out = tmp_path / "report.json"
    env = {"RELAX_ADMIN_TOKEN": "elastic-rollout"}
    route = "gateway.rollout_route_mode=router"
    process, _ = start(
        "scale_behind_router", "elastic_rollout_tiny.yaml", out, tmp_path, route, env=env
    )
    code, output = finish(process, 500)
    assert code == 0, output[-4000:]
    report = json.loads(out.read_text())
    assert report["joining"]["replicas"][0]["state"] == "weight_syncing", report["joining"]
    new = report["new"]
    assert new not in report["workers_joining"] and len(report["workers_joining"]) == 1
    assert report["scale_out"]["state"] == "succeeded", report["scale_out"]
    assert new in report["workers_out"] and len(report["workers_out"]) == 2
    assert report["routed"] == [200] * 6 and report["served_by_new"] >= 2  # round robin
    assert report["scale_in"]["state"] == "succeeded", report["scale_in"]
    assert report["workers_in"] == [u for u in report["workers_out"] if u != new]
    assert report["routed_after"] == [200] and not report["new_alive"]
    assert_no_sglang_left(tmp_path)
