"""A colocated sync's version is committed (the rollout model routable for the gateway's
clients) only once its engines pass the parity probe, which they score after their KV cache is
back (``WeightSync.check_parity``): between the sync and the probe an outside client gets no
engine. ``WeightSync``'s own logic over a real ``InferenceManager``, the sync's sends and the
probe answered in process; the real colocated job is tests/rl/test_colocated_job.py."""

from __future__ import annotations

import pytest

from relax_launch.config import build_config
from relax_launch.inference.discovery import RoutingSpec, WeightSource
from relax_launch.inference.manager import InferenceManager
from relax_launch.placement import plan
from relax_launch.runtime.weight_sync import WeightSync
from relax_launch.weights.parity import ParityError

JOB = {
    "cluster": {"nnodes": 1, "nproc_per_node": 2, "device": "cpu"},
    "placement": {"mode": "split"},
    "trainer": {"model": "builtin:tiny-llama"},
    "rollout": {"ranks": 1, "engine": {"max_total_tokens": 2048}},
    "data": {"prompts_per_step": 2},
}


class Probe:
    """A colocated probe: the engines' half pending after the sync; ``gap`` decides it."""

    colocated = True

    def __init__(self, fails: bool) -> None:
        self.fails, self.checked = fails, 0

    def after_sync(self, version, targets, reports, control) -> None:
        pass

    def check_engines(self, control) -> None:
        self.checked += 1
        if self.fails:
            raise ParityError("weight sync to version 1 failed its parity probe (test)")


@pytest.fixture
def made():
    syncs: list[WeightSync] = []
    yield syncs
    for sync in syncs:
        sync.close()  # its engine connections


def weight_sync(made: list, fails: bool) -> tuple[WeightSync, InferenceManager]:
    manager = InferenceManager(
        role="rollout",
        model_id="tiny-llama",
        served_model_name="/models/tiny-llama",
        weight_source=WeightSource.TRAINER,
        routing=RoutingSpec(default_model="tiny-llama"),
    )
    manager.attach([])  # READY, no engine to ask its version
    sync = WeightSync(plan(build_config(JOB)), None, list, manager, None, 30.0)
    sync._sync_whole = lambda version: [{"transport": "test"}]  # the sends, done
    sync.probe = Probe(fails)
    made.append(sync)
    return sync, manager


def test_the_version_is_routable_only_once_its_engines_pass_the_probe(made):
    sync, manager = weight_sync(made, fails=False)
    sync.sync(1)
    assert not manager.ready and manager.weight_version != "1"  # synced, not yet probed
    sync.check_parity()
    assert manager.ready and manager.weight_version == "1" and sync.probe.checked == 1
    sync.check_parity()  # nothing pending: nothing committed again
    assert manager.ready


def test_a_failed_probe_leaves_the_model_closed(made):
    sync, manager = weight_sync(made, fails=True)
    sync.sync(1)
    with pytest.raises(ParityError):
        sync.check_parity()
    assert not manager.ready and not manager.weights_valid and manager.weight_version != "1"
