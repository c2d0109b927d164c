"""Weight sync into a real SGLang engine of two TP ranks on the CPU: each rank receives its own
slice of every weight (``engine_shards.py``), in the group of its TP index, straight into its
parameter; nothing is staged, the receive buffers stay within the sender's buckets (the
receiver's ``peak_staging_bytes``), and the engine then computes what Hugging Face's model
computes with the same weights. Dense (tiny Llama) in the default run; a MoE (tiny Qwen3-MoE:
experts into their slices of the stacked weights, the CPU engine's padded intermediate size) is
slow."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from relax_launch import platform
from relax_launch.inference.engine import post
from relax_launch.inference.process import free_port
from relax_launch.inference.server import SGLangServer
from relax_launch.models.build import ensure_model
from relax_launch.trainer.hf_conversion import fuse_for_engine
from relax_launch.weights.engine_shards import EngineShards
from relax_launch.weights.staging import BUCKETS_POSTED
from relax_launch.weights.sync import TensorSpec, WeightSender
from relax_launch.weights.update_plan import broadcast_plan
from relax_launch.weights.update_session import EngineTarget, UpdateSession, sync_deadline

pytestmark = pytest.mark.e2e
PROMPT = list(range(40, 56))
BUCKETING = (1 << 10, 4 << 10)  # small buckets, so that staging whole tensors would exceed them
TOLERANCE = 1e-5  # fp32 engine vs fp32 Hugging Face


@pytest.fixture(
    scope="module", params=["tiny-llama", pytest.param("tiny-qwen3-moe", marks=pytest.mark.slow)]
)
def tp2_engine(request, tmp_path_factory):
    model = ensure_model(f"builtin:{request.param}")
    server = SGLangServer(
        model_path=model,
        device="cpu",
        log_path=tmp_path_factory.mktemp("tp2") / "sglang.log",
        tp_size=2,
        extra_env=platform.thread_env("cpu", 2, ranks=2, engine_ranks=2),
        engine={"max_total_tokens": 2048, "random_seed": 0, "dtype": "float32"},
    )
    server.start(timeout_s=300)
    try:
        yield model, server
    finally:
        server.stop()


def engine_logprob(url: str) -> tuple[int, float]:
    """The engine's greedy next token after PROMPT and its logprob."""
    reply = post(
        url,
        "/generate",
        {
            "input_ids": PROMPT,
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        },
        120,
    )
    logprob, token, _ = reply["meta_info"]["output_token_logprobs"][0]
    return token, logprob


def reference_logprob(model: Path, weights: dict[str, torch.Tensor], token: int) -> float:
    """Hugging Face's logprob of ``token`` after PROMPT with ``weights`` (checkpoint names).

    Loaded as a checkpoint (``from_pretrained``), not with ``load_state_dict``: Hugging Face's
    Qwen3-MoE holds its experts stacked (``mlp.experts.gate_up_proj``, ``down_proj``), and
    converts a checkpoint's per-expert tensors only when it loads one; ``load_state_dict``
    would skip them, and the reference would keep the checkpoint's experts."""
    import shutil
    import tempfile

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as checkpoint:
        for path in model.iterdir():
            if path.is_file() and path.suffix != ".safetensors":
                shutil.copy(path, checkpoint)
        save_file(weights, f"{checkpoint}/model.safetensors", metadata={"format": "pt"})
        hf, info = AutoModelForCausalLM.from_pretrained(
            checkpoint, dtype=torch.float32, output_loading_info=True
        )
    loaded_all = ("missing_keys", "unexpected_keys", "mismatched_keys")
    assert not any(info.get(key) for key in loaded_all), info
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT])).logits[0, -1]
    return torch.log_softmax(logits.double(), -1)[token].item()


def test_each_engine_tp_rank_receives_its_own_slice_in_place(tp2_engine):
    model, server = tp2_engine
    config = __import__("json").loads((model / "config.json").read_text())
    shards = EngineShards(
        2,
        config["num_attention_heads"],
        config["num_key_value_heads"],
        pads_for_tp=platform.engine_pads_for_tp("cpu"),
    )
    sender = WeightSender(
        targets=[EngineTarget(server.url, 1, "tp-2 engine", 2)],
        world_size=2,  # the sender and one worker in each TP index's group
        group_name="tp2-sync",
        host="127.0.0.1",
        port=free_port(),
        backend=platform.weight_sync_backend("cpu"),
        shards=shards,
    )
    sender.bucketing = BUCKETING
    original = load_file(str(model / "model.safetensors"))
    try:
        sender.connect(120)
        for version, scale in ((1, 1.25), (2, 0.8)):
            weights = {n: t * scale if t.dim() > 1 else t for n, t in original.items()}
            fused = fuse_for_engine(weights)
            manifest = [TensorSpec.of(n, t) for n, t in fused.items()]
            engines = UpdateSession(sender.targets, sync_deadline(120), sender.control)
            engines.open()
            try:
                report = sender.send(fused.items(), manifest, version, 120).receivers[0]
            finally:
                engines.close()
            token, logprob = engine_logprob(server.url)
            reference = reference_logprob(model, weights, token)
            print(f"\nversion {version}: {report}; engine {logprob:.7f}, HF {reference:.7f}")
            per_rank = sender._engine_manifest(manifest)
            plan = broadcast_plan(
                [s.name for s in per_rank],
                [s.dtype for s in per_rank],
                [list(s.shape) for s in per_rank],
                *BUCKETING,
            )
            alone = {i for item in plan if not item.bucket for i in item.indices}
            # a MoE's consecutive experts travel together, straight into their slices
            stacked = sum(len(item.indices) for item in plan if item.stacked)
            assert report["staged"] == report["staged_bytes"] == report["moved"] == 0, report
            assert report["in_place"] == len(alone) + stacked > len(fused) // 2, report
            assert report["in_place"] + report["copied"] == len(fused), report
            bucket_buffers = BUCKETS_POSTED * sum(BUCKETING)
            assert report["peak_staging_bytes"] <= bucket_buffers, report
            assert abs(logprob - reference) <= TOLERANCE
    finally:
        sender.close()
