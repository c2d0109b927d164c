"""Weight sync into a real SGLang engine on the CPU: the weights land in the engine's own
parameters, with no copy of the model and no allocation (the engine's receiver says so in every
reply, and an engine without it is refused); what an engine serves right after a sync is the new
weights' answer, never KV its prefix cache computed with the old ones; an engine that refuses an
update fails the sync at once and keeps its version."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest
import torch
from safetensors.torch import load_file

from relax_launch import platform
from relax_launch.inference.engine import EngineRequestError, get_json, post
from relax_launch.inference.process import free_port
from relax_launch.inference.server import SGLangServer
from relax_launch.platform.nccl_semantics import SLOW_BROADCAST_ENV
from relax_launch.trainer.hf_conversion import fuse_for_engine
from relax_launch.weights.colocated import BucketSender
from relax_launch.weights.sync import ReceiverMissing, TensorSpec, WeightSender, dtype_name
from relax_launch.weights.update_plan import broadcast_plan
from relax_launch.weights.update_session import (
    EngineTarget,
    UpdateSession,
    WeightSyncError,
    sync_deadline,
)

pytestmark = pytest.mark.e2e
PROMPT = list(range(40, 72))  # long enough that the prefix cache holds most of it


def sync(sender: WeightSender, weights: dict[str, torch.Tensor], version: int):
    """What the controller does for one pipeline stage; returns the sender's report."""
    engines = UpdateSession(sender.targets, sync_deadline(120), sender.control)
    engines.open()
    manifest = [TensorSpec.of(n, t) for n, t in weights.items()]
    try:
        return sender.send(weights.items(), manifest, version, 120)
    finally:
        engines.close()


def connected(transport: type[WeightSender], url: str, group_name: str) -> WeightSender:
    """A sender of ``transport`` to the one engine at ``url``, connected."""
    sender = transport(
        targets=[EngineTarget(url, 1, "tiny engine")],
        world_size=2,
        group_name=group_name,
        host="127.0.0.1",
        port=free_port(),
        backend=platform.weight_sync_backend("cpu"),
    )
    try:
        sender.connect(60)
    except BaseException:
        sender.close()
        raise
    return sender


def next_token(url: str) -> tuple[float, int]:
    """The greedy next token's logprob after PROMPT, and how many prompt tokens came cached."""
    reply = post(
        url,
        "/generate",
        {
            "input_ids": PROMPT,
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        },
        60,
    )
    meta = reply["meta_info"]
    return meta["output_token_logprobs"][0][0], meta["cached_tokens"]


@pytest.mark.parametrize("transport", [WeightSender, BucketSender])
def test_a_sync_flushes_the_prefix_cache_so_answers_are_the_new_models(
    tiny_server, tiny_model, transport
):
    """Both transports: the broadcast (decoupled) and the shared buckets (split, defer)."""
    original = fuse_for_engine(load_file(str(tiny_model / "model.safetensors")))
    changed = {n: t * 1.5 if t.dim() > 1 else t for n, t in original.items()}
    label = get_json(tiny_server.url, "/model_info", 30)["weight_version"]
    sender = connected(transport, tiny_server.url, "stale-cache-test")
    try:
        sync(sender, original, 1)
        next_token(tiny_server.url)
        old, cached = next_token(tiny_server.url)
        assert cached > len(PROMPT) // 2  # the prompt's KV is in the prefix cache

        sync(sender, changed, 2)
        after_sync, cached_after_sync = next_token(tiny_server.url)
        post(tiny_server.url, "/flush_cache", {}, 30)
        fresh, _ = next_token(tiny_server.url)

        assert cached_after_sync == 0  # nothing computed by the old weights is reused
        assert abs(after_sync - fresh) < 1e-5  # exactly the new model's answer
        assert abs(after_sync - old) > 1e-3  # and the weights did change
        assert get_json(tiny_server.url, "/model_info", 30)["weight_version"] == "2"
    finally:
        sync(sender, original, 0)  # leave the shared engine as it was
        post(tiny_server.url, "/update_weight_version", {"new_version": label}, 30)
        sender.close()


def test_an_engine_that_refuses_the_update_fails_the_sync_at_once_and_keeps_serving(
    tiny_server, tiny_model
):
    weights = fuse_for_engine(load_file(str(tiny_model / "model.safetensors")))
    before = next_token(tiny_server.url)[0]
    label = get_json(tiny_server.url, "/model_info", 30)["weight_version"]
    sender = connected(WeightSender, tiny_server.url, "refusal-test")
    manifest = [TensorSpec.of(n, t) for n, t in weights.items()]
    try:
        # No update session is open, so SGLang refuses before it joins any broadcast; the sender
        # sees the refusal while it waits (a deadline would raise a different error), and the
        # broadcasts the engine never received do not hold the failure until the group's
        # timeout (60 s): the engine tears its side down, which ends them.
        began = time.monotonic()
        with pytest.raises(WeightSyncError, match="tiny engine refused the update"):
            sender.send(weights.items(), manifest, 7, timeout_s=120)
        assert time.monotonic() - began < 30
    finally:
        sender.close()
    assert get_json(tiny_server.url, "/model_info", 30)["weight_version"] == label
    assert next_token(tiny_server.url)[0] == before


def test_an_export_that_does_not_match_fails_the_send_and_leaves_the_version(
    tiny_server, tiny_model
):
    weights = fuse_for_engine(load_file(str(tiny_model / "model.safetensors")))
    label = get_json(tiny_server.url, "/model_info", 30)["weight_version"]
    sender = connected(BucketSender, tiny_server.url, "mismatch-test")
    manifest = [TensorSpec.of(n, t) for n, t in weights.items()]
    halved = [(n, t * 0.5 if n != "model.norm.weight" else t[:2]) for n, t in weights.items()]
    engines = UpdateSession(sender.targets, sync_deadline(60), sender.control)
    engines.open()
    try:
        with pytest.raises(WeightSyncError, match="does not match the manifest"):
            sender.send(halved, manifest, 9, timeout_s=60)
    finally:
        engines.close()
        sender.close()
    assert get_json(tiny_server.url, "/model_info", 30)["weight_version"] == label


@pytest.mark.parametrize("transport", [WeightSender, BucketSender])
def test_weights_land_in_the_engines_own_parameters(tiny_server, tiny_model, transport):
    """Two processes, the real receive: every tensor goes into the parameter it updates, none
    through SGLang's loader; no parameter storage moves and, after the first sync, nothing is
    allocated; the engine then holds exactly the values sent."""
    weights = fuse_for_engine(load_file(str(tiny_model / "model.safetensors")))
    changed = {n: t * 1.25 for n, t in weights.items()}
    label = get_json(tiny_server.url, "/model_info", 30)["weight_version"]
    sender = connected(transport, tiny_server.url, f"in-place-{transport.__name__}")
    if transport is WeightSender:  # the tiny model's matrices travel alone (colocated: buckets)
        sender.bucketing = (4096, 64 << 10)
    name = "model.layers.1.mlp.down_proj.weight"
    try:
        first, second = sync(sender, changed, 1).receivers[0], sync(sender, changed, 2).receivers[0]
        held = post(tiny_server.url, "/get_weights_by_name", {"name": name, "truncate_size": 4}, 30)
    finally:
        sync(sender, weights, 0)
        post(tiny_server.url, "/update_weight_version", {"new_version": label}, 30)
        sender.close()
    for report in (first, second):
        assert report["in_place"] + report["copied"] == len(weights), report
        assert report["staged"] == report["staged_bytes"] == report["moved"] == 0, report
    assert second["allocated"] == 0  # no staging buffer at all: nothing is staged
    if transport is WeightSender:  # the large ones are broadcast straight into the parameters
        assert second["in_place"] == sum(t.nbytes >= 4096 for t in weights.values()) > 0
    assert torch.equal(torch.tensor(held), changed[name][:4])  # bit for bit (its first rows)


def test_a_sync_whose_broadcasts_outlast_every_poll_interval_completes(
    tiny_server, tiny_model, monkeypatch
):
    """On the CPU's sync backend (gloo with NCCL's waits and aborts), every broadcast slowed to
    take 1.2 s, as GPU-sized ones queue: the sender's and the engine's waits outlast them
    without aborting the group (a wait of a second at a time, read as "not done yet", aborts
    it under NCCL), and the engine then holds exactly the weights sent."""
    weights = fuse_for_engine(load_file(str(tiny_model / "model.safetensors")))
    changed = {n: t * 1.25 for n, t in weights.items()}
    label = get_json(tiny_server.url, "/model_info", 30)["weight_version"]
    monkeypatch.setenv(SLOW_BROADCAST_ENV, "1.2")
    sender = connected(WeightSender, tiny_server.url, "slow-broadcasts")
    sender.bucketing = (48 << 10, 1 << 20)  # a few broadcasts, queued one behind the other
    monkeypatch.delenv(SLOW_BROADCAST_ENV)
    plan = broadcast_plan(
        list(changed),
        [dtype_name(t.dtype) for t in changed.values()],
        [list(t.shape) for t in changed.values()],
        *sender.bucketing,
    )
    name = "model.layers.1.mlp.down_proj.weight"
    try:
        report = sync(sender, changed, 1)
        held = post(tiny_server.url, "/get_weights_by_name", {"name": name, "truncate_size": 4}, 30)
    finally:
        sender.close()
        restore = connected(WeightSender, tiny_server.url, "slow-broadcasts-restore")
        sync(restore, weights, 0)
        restore.close()
        post(tiny_server.url, "/update_weight_version", {"new_version": label}, 30)
    print(f"\n{len(plan)} broadcasts of 1.2 s each: sync {report.seconds:.1f} s")
    assert len(plan) >= 3 and report.transfer_s >= 1.2 * (len(plan) - 1)
    assert report.receivers[0]["moved"] == 0
    assert torch.equal(torch.tensor(held), changed[name][:4])


@pytest.mark.parametrize("transport", [WeightSender, BucketSender])
def test_an_engine_without_the_receiver_is_refused_before_any_update(
    tiny_model, tmp_path, transport
):
    """SGLang ignores a load_format it does not know: without the plugin its own receive would
    misread the packed broadcasts (or the buckets) and crash. The sender asks first and refuses
    the engine, which stays up."""
    engine = SGLangServer(
        model_path=tiny_model,
        device="cpu",
        log_path=tmp_path / "no-plugin.log",
        engine={"max_total_tokens": 2048, "dtype": "float32"},
        extra_env={"SGLANG_PLUGINS": "none-of-them"},  # a whitelist without relax-launch's
    )
    engine.start(timeout_s=240)
    try:
        with pytest.raises(ReceiverMissing, match="without relax-launch's in-place receiver"):
            connected(transport, engine.url, "no-receiver")
        next_token(engine.url)  # it still serves
    finally:
        engine.stop()


def test_an_engine_dying_mid_sync_fails_it_at_once_and_frees_the_others(
    tiny_server, tiny_model, tmp_path
):
    """An engine killed while the weights stream fails the sync within seconds, and the engine
    that was receiving beside it is not left waiting for tensors that will never come: a new
    group with it alone syncs (what ``rollout.fault_tolerance`` does next)."""
    weights = fuse_for_engine(load_file(str(tiny_model / "model.safetensors")))
    manifest = [TensorSpec.of(n, t) for n, t in weights.items()]
    label = get_json(tiny_server.url, "/model_info", 30)["weight_version"]
    victim = SGLangServer(
        model_path=tiny_model,
        device="cpu",
        log_path=tmp_path / "victim.log",
        engine={"max_total_tokens": 2048},
    )
    victim.start(timeout_s=240)
    sender = WeightSender(
        targets=[
            EngineTarget(tiny_server.url, 1, "survivor"),
            EngineTarget(victim.url, 2, "victim"),
        ],
        world_size=3,
        group_name="mid-sync-death",
        host="127.0.0.1",
        port=free_port(),
        backend=platform.weight_sync_backend("cpu"),
    )

    def export_that_loses_the_victim():
        for index, (name, tensor) in enumerate(weights.items()):
            if index == len(weights) // 2:
                os.killpg(victim.pid, signal.SIGKILL)  # as when the engine crashes
            yield name, tensor

    try:
        sender.connect(60)
        engines = UpdateSession(sender.targets, sync_deadline(120), sender.control)
        engines.open()
        began = time.monotonic()
        with pytest.raises(WeightSyncError, match="its broadcast group was dropped"):
            sender.send(export_that_loses_the_victim(), manifest, 5, timeout_s=120)
        failed_after_s = time.monotonic() - began
        with contextlib.suppress(EngineRequestError):
            engines.close()
        sender.close()
        again = connected(WeightSender, tiny_server.url, "after-the-death")
        sync(again, weights, 6)
        again.close()
        recovered_after_s = time.monotonic() - began
        print(
            f"\nsync failed {failed_after_s:.1f} s after the engine died; the survivor took the "
            f"next version in a new group {recovered_after_s:.1f} s after it"
        )
        # left waiting, it takes the sync timeout (120 s); the bounds leave a loaded machine room
        assert failed_after_s < 60 and recovered_after_s < 90
        assert get_json(tiny_server.url, "/model_info", 30)["weight_version"] == "6"
    finally:
        victim.stop()
        post(tiny_server.url, "/update_weight_version", {"new_version": label}, 30)
