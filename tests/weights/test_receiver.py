"""The engine-side receive of weight sync, on its own: which tensors land in place, which are
staged for ``load_weights``, and that staging buffers are kept for the next sync."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from relax_launch.inference.process import free_port
from relax_launch.weights.broadcast_group import custom_group
from relax_launch.weights.receiver import IN_PLACE, checkpoint_names, receive, reported
from relax_launch.weights.receiver import _receiver_state as receiver_state


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj = torch.nn.Linear(128, 192, bias=False)  # 96 KiB: travels alone
        self.norm = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))


class Updater:
    """What the receive reads from SGLang's WeightUpdater."""

    def __init__(self, model: torch.nn.Module, group: dist.ProcessGroup) -> None:
        self.model, self.device = model, "cpu"
        self._model_update_group = {"g": group}

    def get_model(self) -> torch.nn.Module:
        return self.model


def request(names, dtypes, shapes, load_format=IN_PLACE):
    return dict(names=names, dtypes=dtypes, shapes=shapes, group_name="g", load_format=load_format)


def test_matching_tensors_land_in_place_and_the_rest_are_staged_once():
    group = custom_group("gloo", "127.0.0.1", free_port(), 1, 0, "receiver-test", 30)
    try:
        model = Model()
        weight = model.qkv_proj.weight
        updater = Updater(model, group)
        body = request(
            ["qkv_proj.weight", "norm", "q_proj.weight"],
            ["float32", "float32", "float32"],  # norm is bfloat16 in the model: staged
            [[192, 128], [3], [2, 2]],  # q_proj is not a parameter: staged for load_weights
        )
        address = weight.data_ptr()
        staged = receive(None, updater, **body)
        assert [name for name, _ in staged] == ["norm", "q_proj.weight"]
        assert model.qkv_proj.weight is weight and weight.data_ptr() == address  # in place
        reply = reported(lambda updater, named: (True, "Succeeded."), updater, staged)
        assert reply == (
            True,
            'Succeeded.; relax-launch receiver: {"in_place": 1, "copied": 0, '
            '"staged": 2, "staged_bytes": 28, "other_stage": 0, "allocated": 1, "moved": 0}',
        )
        again = receive(None, updater, **body)
        assert [t.data_ptr() for _, t in staged] == [t.data_ptr() for _, t in again]  # reused
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
        self.model.layers = torch.nn.ModuleList([PPMissingLayer(), torch.nn.Linear(128, 192)])


def test_a_pipeline_stage_keeps_its_own_layers_and_drops_the_others():
    group = custom_group("gloo", "127.0.0.1", free_port(), 1, 0, "receiver-pp-test", 30)
    try:
        model = Stage()
        updater = Updater(model, group)
        body = request(
            [
                "model.embed_tokens.weight",  # the first stage's
                "model.layers.0.mlp.weight",  # the first stage's layer
                "model.layers.0.norm.weight",  # small: travels packed
                "model.layers.1.weight",  # this stage's: in place
            ],
            ["float32"] * 4,
            [[320, 128], [192, 128], [4], [192, 128]],
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


def test_small_tensors_travel_packed_after_the_large_ones_one_broadcast_per_dtype():
    from relax_launch.weights.receiver import broadcast_plan

    dtypes = ["float32", "float32", "bfloat16", "float32", "bfloat16"]
    shapes = [[256, 128], [64], [4], [128, 128], [32768]]  # 128 KiB, 256 B, 8 B, 64 KiB, 64 KiB
    assert broadcast_plan(dtypes, shapes) == ([0, 3, 4], {"bfloat16": [2], "float32": [1]})


class Experts(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w13_weight = torch.nn.Parameter(torch.zeros(4, 128, 128))  # 64 KiB: alone


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
        body = request(names, ["float32"] * 3, [[128, 128], [128, 128], [32, 128]])
        staged = receive(None, updater, **body)
        assert [name for name, _ in staged] == ["w13_weight[4]", "w13_weight[1]"]
        assert stacked.data_ptr() == address
        reply = reported(lambda updater, named: (True, "ok"), updater, staged)
        assert '"in_place": 1' in reply[1] and '"moved": 0' in reply[1]
        state = receiver_state(updater)
        assert state.direct("w13_weight[2]", torch.float32, [128, 128]).data_ptr() == (
            address + 2 * 128 * 128 * 4
        )
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
