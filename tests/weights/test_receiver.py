"""The engine-side receive of weight sync, on its own: which tensors land in place, which are
staged for ``load_weights``, and that staging buffers are kept for the next sync."""

from __future__ import annotations

import json
import sys
import types

import torch
import torch.distributed as dist

from relax_launch.inference.process import free_port
from relax_launch.platform import sync_bucketing
from relax_launch.weights.broadcast_group import custom_group
from relax_launch.weights.engine_caches import forget_image_features
from relax_launch.weights.receiver import _receiver_state as receiver_state
from relax_launch.weights.receiver import receive, reported
from relax_launch.weights.staging import checkpoint_names
from relax_launch.weights.update_plan import in_place_format


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj = torch.nn.Linear(512, 768, bias=False)  # 1.5 MiB: travels alone
        self.norm = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))


class Updater:
    """What the receive reads from SGLang's WeightUpdater."""

    def __init__(self, model: torch.nn.Module, group: dist.ProcessGroup) -> None:
        self.model, self.device = model, "cpu"
        self._model_update_group = {"g": group}

    def get_model(self) -> torch.nn.Module:
        return self.model


BROADCAST_FORMAT = in_place_format(*sync_bucketing("cpu"))


def request(names, dtypes, shapes, load_format=BROADCAST_FORMAT):
    return dict(names=names, dtypes=dtypes, shapes=shapes, group_name="g", load_format=load_format)


def test_matching_tensors_land_in_place_and_the_rest_are_staged_in_buffers_freed_after():
    group = custom_group("gloo", "127.0.0.1", free_port(), 1, 0, "receiver-test", 30)
    try:
        model = Model()
        weight = model.qkv_proj.weight
        updater = Updater(model, group)
        body = request(
            ["qkv_proj.weight", "norm", "q_proj.weight"],
            ["float32", "float32", "float32"],  # norm is bfloat16 in the model: staged
            [[768, 512], [3], [512, 512]],  # q_proj is not a parameter: staged for load_weights
        )
        address = weight.data_ptr()
        staged = receive(None, updater, **body)
        # norm from its bucket of small tensors (a copy), q_proj from the staging buffer
        assert [name for name, _ in staged] == ["norm", "q_proj.weight"]
        assert model.qkv_proj.weight is weight and weight.data_ptr() == address  # in place
        reply = reported(lambda updater, named: (True, "Succeeded."), updater, staged)
        # the buffers are as large as this update needs: q_proj (1 MiB + alignment) to stage,
        # one bucket of 12 bytes
        peak = 512 * 512 * 4 + 64 + 12
        assert reply == (
            True,
            'Succeeded.; relax-launch receiver: {"in_place": 1, "copied": 0, '
            '"staged": 2, "staged_bytes": 1048588, "other_stage": 0, '
            f'"peak_staging_bytes": {peak}, "allocated": 1, "moved": 0}}',
        )
        assert receiver_state(updater).buffers == {}  # freed after the update
    finally:
        dist.destroy_process_group(group)


class PPMissingLayer(torch.nn.Module):
    """Named as SGLang's placeholder for a module another pipeline stage holds."""


class Stage(torch.nn.Module):
    """The second of two pipeline stages of a two-layer model, as SGLang builds it: layer 1
    real, layer 0 and the embedding placeholders."""

    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.start_layer, self.model.end_layer = 1, 2
        self.model.embed_tokens = PPMissingLayer()
        self.model.layers = torch.nn.ModuleList([PPMissingLayer(), torch.nn.Linear(512, 768)])


def test_a_pipeline_stage_keeps_its_own_layers_and_drops_the_others():
    group = custom_group("gloo", "127.0.0.1", free_port(), 1, 0, "receiver-pp-test", 30)
    try:
        model = Stage()
        updater = Updater(model, group)
        body = request(
            [
                "model.embed_tokens.weight",  # the first stage's
                "model.layers.0.mlp.weight",  # the first stage's layer
                "model.layers.0.norm.weight",  # small: travels in a bucket
                "model.layers.1.weight",  # this stage's: in place
            ],
            ["float32"] * 4,
            [[320, 1024], [768, 512], [4], [768, 512]],
        )
        assert receive(None, updater, **body) == []  # nothing for load_weights
        _, message = reported(lambda updater, named: (True, "Succeeded."), updater, [])
        report = json.loads(message.partition("receiver: ")[2])
        assert (report["in_place"], report["staged"], report["other_stage"]) == (1, 0, 3)
        state = receiver_state(updater)
        assert not state.elsewhere("model.layers.1.weight")
        model.config = type("Config", (), {"tie_word_embeddings": True})()
        state.__init__(model)  # a tied head: the last stage loads it from the embedding
        assert not state.elsewhere("model.embed_tokens.weight")
    finally:
        dist.destroy_process_group(group)


def test_other_load_formats_run_sglangs_own_receive():
    calls = []
    assert (
        receive(
            lambda updater, **kw: calls.append(kw) or "stock",
            None,
            names=[],
            dtypes=[],
            shapes=[],
            group_name="g",
            load_format=None,
        )
        == "stock"
    )
    assert calls and calls[0]["load_format"] is None


def test_sglang_finds_the_receiver_plugin_and_a_plugin_whitelist_keeps_it(tmp_path):
    from importlib.metadata import entry_points

    from relax_launch.inference.server import RECEIVER_PLUGIN, SGLangServer
    from relax_launch.weights.receiver import register

    (plugin,) = [e for e in entry_points(group="sglang.srt.plugins") if e.name == RECEIVER_PLUGIN]
    assert plugin.load() is register
    server = SGLangServer(model_path="m", device="cpu", log_path=tmp_path / "log", port=1)
    assert server.env({"SGLANG_PLUGINS": "other"})["SGLANG_PLUGINS"] == f"other,{RECEIVER_PLUGIN}"
    assert "SGLANG_PLUGINS" not in server.env({})


def test_colocated_buckets_align_every_tensor_and_hold_a_bounded_size():
    from relax_launch.weights.colocated import pack
    from relax_launch.weights.sync import TensorSpec

    manifest = [
        TensorSpec("a", "float32", (3,)),  # 12 B, aligned to 64
        TensorSpec("b", "bfloat16", (70,)),  # 140 B -> 192
        TensorSpec("c", "int8", (1,)),
        TensorSpec("d", "float32", (100,)),  # 400 B: more than a bucket holds, alone
        TensorSpec("e", "int8", (5,)),
    ]
    assert pack(manifest, 320) == [[(0, 0), (1, 64), (2, 256)], [(3, 0)], [(4, 0)]]


def test_small_tensors_travel_in_buckets_per_dtype_each_sent_once_full():
    from relax_launch.weights.update_plan import Broadcast, broadcast_plan

    pack_below, bucket_bytes = 1 << 12, 1 << 16
    small = pack_below // 4 - 1  # float32 elements just under the threshold
    per_bucket = -(-(bucket_bytes - 32) // (small * 4))  # with the [8] before them: full
    dtypes = ["float32", "bfloat16", "float32"] + ["float32"] * per_bucket + ["float32"]
    shapes = [[pack_below // 4], [4], [8]] + [[small]] * per_bucket + [[pack_below]]
    names = [f"t{i}" for i in range(len(shapes))]
    plan = broadcast_plan(names, dtypes, shapes, pack_below, bucket_bytes)
    last_small = 2 + per_bucket
    assert plan == [
        Broadcast((0,), "float32", bucket=False),  # 4 KiB: alone, where it comes
        Broadcast(tuple(range(2, last_small + 1)), "float32", bucket=True),  # full: sent now
        Broadcast((last_small + 1,), "float32", bucket=False),
        Broadcast((1,), "bfloat16", bucket=True),  # the rest at the end, one per dtype
    ]


def test_consecutive_experts_travel_together_and_a_large_tensor_in_parts():
    """A MoE layer's experts (w13 and w2 interleaved, as exported) go as one run per stacked
    tensor, each sent once its layer is done; a tensor larger than a bucket goes in parts of
    whole rows, so no receive buffer needs more than about a bucket."""
    from relax_launch.weights.update_plan import Broadcast, broadcast_plan

    names = [f"l0.{w}[{e}]" for e in (0, 2, 1) for w in ("w13", "w2")]
    names += ["l1.w13[0]", "l1.w2[0]", "embed", "l2.w13[0]", "l2.w13[2]"]
    shapes = [[256]] * 8 + [[16, 1024]] + [[256]] * 2  # experts of 1 KiB, embed of 64 KiB
    plan = broadcast_plan(names, ["float32"] * len(names), shapes, 1 << 12, 1 << 14)
    run = lambda indices, stem: Broadcast(indices, "float32", bucket=True, stacked=stem)  # noqa: E731
    part = lambda rows: Broadcast((8,), "float32", bucket=False, rows=rows)  # noqa: E731
    assert plan == [
        run((0, 4, 2), "l0.w13"),  # layer 1's first expert: layer 0's runs go, in slot order
        run((1, 5, 3), "l0.w2"),
        *[part((row, row + 4)) for row in range(0, 16, 4)],  # 16 KiB each
        run((6,), "l1.w13"),  # l1.w2 stays open: at most two runs
        run((7,), "l1.w2"),
        run((9, 10), None),  # slots 0 and 2 do not follow: copied out, not in place
    ]


class Experts(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w13_weight = torch.nn.Parameter(torch.zeros(4, 512, 512))  # 1 MiB each: alone


def test_an_expert_lands_in_its_own_slice_of_the_stacked_experts():
    """``NAME[i]`` is expert i of a stacked parameter, written in place and nowhere else; an
    index past the experts, or a slice of the wrong shape, is staged (and load_weights would
    refuse it) rather than written over another expert."""
    group = custom_group("gloo", "127.0.0.1", free_port(), 1, 0, "receiver-experts", 30)
    try:
        model = Experts()
        stacked = model.w13_weight
        address = stacked.data_ptr()
        updater = Updater(model, group)
        names = ["w13_weight[2]", "w13_weight[4]", "w13_weight[1]"]
        body = request(names, ["float32"] * 3, [[512, 512], [512, 512], [32, 128]])
        staged = receive(None, updater, **body)
        assert sorted(name for name, _ in staged) == ["w13_weight[1]", "w13_weight[4]"]
        assert stacked.data_ptr() == address
        reply = reported(lambda updater, named: (True, "ok"), updater, staged)
        assert '"in_place": 1' in reply[1] and '"moved": 0' in reply[1]
        state = receiver_state(updater)
        assert state.direct("w13_weight[2]", torch.float32, [512, 512]).data_ptr() == (
            address + 2 * 512 * 512 * 4
        )
        assert state.direct("w13_weight[1:3]", torch.float32, [2, 512, 512]).data_ptr() == (
            address + 512 * 512 * 4
        )
        assert state.direct("w13_weight[3:5]", torch.float32, [2, 512, 512]) is None  # past
    finally:
        dist.destroy_process_group(group)


def test_a_run_of_experts_lands_in_its_slices_and_parts_in_their_rows_or_are_dropped():
    """Consecutive experts, one broadcast straight into their slices of the stacked weight; a
    tensor larger than a bucket in parts, each into its rows; another pipeline stage's large
    tensor dropped part by part through a buffer of one part, not of the whole tensor."""
    group = custom_group("gloo", "127.0.0.1", free_port(), 1, 0, "receiver-runs", 30)
    try:
        model = Stage()
        model.model.layers[1].experts = Experts()
        updater = Updater(model, group)
        prefix = "model.layers.1.experts.w13_weight"
        names = [f"{prefix}[0]", f"{prefix}[1]", f"{prefix}[2]", "model.layers.1.weight"]
        names.append("model.layers.0.mlp.weight")  # the other stage's, 2 MiB
        shapes = [[512, 512]] * 3 + [[768, 512], [1024, 512]]
        bucketing = (3 << 19, 3 << 19)  # experts (1 MiB) in runs; 1.5 MiB+ in parts
        body = request(names, ["float32"] * 5, shapes, in_place_format(*bucketing))
        assert receive(None, updater, **body) == []
        _, message = reported(lambda updater, named: (True, "ok"), updater, [])
        report = json.loads(message.partition("receiver: ")[2])
        assert (report["in_place"], report["copied"], report["other_stage"]) == (4, 0, 1)
        # no bucket buffer (the runs went in place); the dropped parts through one buffer of
        # the bucket's size, not the tensor's 2 MiB
        assert report["peak_staging_bytes"] == bucketing[1]
    finally:
        dist.destroy_process_group(group)


def test_fused_tensors_that_do_not_fit_go_to_load_weights_under_checkpoint_names():
    """The CPU engine pads some sizes (a shared expert's 48 rows to 64): a fused or stacked
    tensor that does not fit its parameter reaches load_weights as the checkpoint's tensors,
    which it pads and shards itself (a fused name it would skip or refuse)."""
    w13, w2 = torch.arange(8.0).view(4, 2), torch.ones(2, 2)
    stem = "model.layers.1.mlp."

    def named(name, tensor):
        pairs = checkpoint_names(stem + name, tensor)
        return [(n.removeprefix(stem), t.tolist()) for n, t in pairs]

    assert named("experts.w13_weight[3]", w13) == [
        ("experts.3.gate_proj.weight", w13[:2].tolist()),
        ("experts.3.up_proj.weight", w13[2:].tolist()),
    ]
    assert named("experts.w2_weight[0]", w2) == [("experts.0.down_proj.weight", w2.tolist())]
    assert [n for n, _ in named("shared_expert.gate_up_proj.weight", w13)] == [
        "shared_expert.gate_proj.weight",
        "shared_expert.up_proj.weight",
    ]
    assert named("gate.weight", w2) == [("gate.weight", w2.tolist())]


def test_image_features_are_forgotten_only_when_the_vision_tower_changes(monkeypatch):
    """A text model's update (or a frozen tower's) imports and clears nothing; an update of
    the tower clears SGLang's image feature cache once."""
    cleared = []
    cache = types.SimpleNamespace(clear=lambda: cleared.append(True))
    managers = types.ModuleType("sglang.srt.managers")
    managers.mm_schedule = types.SimpleNamespace(embedding_cache=cache)
    monkeypatch.setitem(sys.modules, "sglang.srt.managers", managers)
    forget_image_features(["model.layers.0.mlp.up_proj.weight", "lm_head.weight"])
    assert cleared == []
    monkeypatch.delitem(sys.modules, "sglang.srt.managers")
    monkeypatch.setitem(sys.modules, "sglang.srt.managers", None)  # an import would raise
    forget_image_features(["model.embed_tokens.weight"])
    monkeypatch.setitem(sys.modules, "sglang.srt.managers", managers)
    forget_image_features(["model.layers.0.mlp.up_proj.weight", "visual.blocks.0.attn.qkv.weight"])
    forget_image_features(["model.visual.merger.mlp.0.weight"])
    assert cleared == [True, True]
