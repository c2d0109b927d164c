"""A real RL job with a vision-language policy (``vlm_tiny.yaml``): the tiny random Qwen2.5-VL on
the built-in visual task, decoupled, three steps. The rollout engine gets each prompt's image,
the trainer its patches; every sync sends the whole model (vision tower included) and the
parity probe scores text and an image on both sides; the run's checkpoint exports as a
directory transformers and SGLang load, with the weights the run exported live. Its LoRA variant
trains adapters on the language model alone: each sync sends the targeted weights merged (the
tower never), and the checkpoint (adapters alone) exports merged as the run's own export."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
HERE = Path(__file__).parent
CONFIG = HERE / "vlm_tiny.yaml"
FP32_PARITY = 1e-5  # trainer and engine in float32: the probe's gap is float32 rounding


def run_job(*overrides: str) -> subprocess.CompletedProcess:
    cli = Path(sys.executable).with_name("relax-launch")
    return subprocess.run(
        [str(cli), "run", str(CONFIG), *overrides],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONPATH": str(HERE)},
    )


def image_logprobs(model_dir: Path, served: str | None = None) -> list[float]:
    """The parity probe's image sequence scored by transformers from ``model_dir`` (or, with
    ``served``, by the SGLang engine at that URL), its text tokens' logprobs."""
    import requests
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    from relax_launch.runtime.image_probe import image_probe

    probe = image_probe(model_dir)
    text = [k for k, t in enumerate(probe.ids[1:]) if t != probe.image_token_id]
    if served is not None:
        reply = requests.post(served + "/generate", json=probe.request({}), timeout=120).json()
        row = [lp for lp, *_ in reply["meta_info"]["input_token_logprobs"][1:]]
        return [row[k] for k in text]
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.tensor([probe.ids])
    with torch.no_grad():
        logits = model.eval()(
            input_ids=ids,
            pixel_values=probe.images.pixel_values,
            image_grid_thw=probe.images.grids,
            mm_token_type_ids=(ids == probe.image_token_id).int(),
        ).logits[0, :-1]
    row = logits.log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0].tolist()
    return [row[k] for k in text]


def served_logprobs(model_dir: Path, log: Path) -> list[float]:
    from relax_launch.inference.server import SGLangServer
    from relax_launch.processes import group_alive

    engine = {"max_total_tokens": 2048, "dtype": "float32", "image_processor_backend": "pil"}
    server = SGLangServer(model_path=model_dir, device="cpu", log_path=log, engine=engine)
    server.start(timeout_s=300)
    try:
        return image_logprobs(model_dir, served=server.url)
    finally:
        pid = server.pid
        server.stop()
        assert not group_alive(pid)


TARGETED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def targeted_bytes(model_dir: Path) -> int:
    """The bytes of the language model's weights LoRA targets (all of trainer.lora's default
    targets), in float32: what each LoRA sync sends, merged."""
    from relax_launch.trainer.hf_dir import read_weights

    weights = read_weights(model_dir)
    names = [n for n in weights if not n.startswith(("visual.", "model.visual."))]
    names = [n for n in names if n.endswith(".weight") and n.split(".")[-2] in TARGETED]
    return sum(4 * weights[n].numel() for n in names)


# LoRA on the language model (rank 8, its lr raised: B starts at zero) against the whole model
LORA = ("trainer.lora.rank=8", "trainer.lr=1.0e-2")


@pytest.mark.parametrize("lora", [False, True], ids=["whole-model", "lora"])
def test_a_vlm_trains_on_images_with_trainer_engine_parity_after_every_sync(tmp_path, lora):
    import torch
    from safetensors.torch import load_file

    from relax_launch.commands.export import export_checkpoint
    from relax_launch.models.build import ensure_model

    result = run_job(
        f"logging.dir={tmp_path}",
        f"checkpoint.dir={tmp_path / 'ckpt'}",
        "checkpoint.every_steps=3",
        *(LORA if lora else ()),
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-3000:]
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    print(
        json.dumps(
            [
                {k: v for k, v in s.items() if k.startswith(("sync/", "time/", "reward", "loss"))}
                for s in steps
            ],
            indent=1,
        )
    )
    assert [s["step"] for s in steps] == [1, 2, 3]
    for s in steps:
        assert s["sync/parity_gap"] <= FP32_PARITY and s["sync/parity_gap_image"] <= FP32_PARITY
        assert 0.0 <= s["reward/count"] <= 1.0 and s["samples_invalid"] == 0
    # every group's rewards vary (vlm_tiny.yaml's second source): every step trains
    assert all(s["grad_norm"] > 0 for s in steps)
    assert "finished 3 steps" in result.stdout

    initial_dir = ensure_model("builtin:tiny-qwen2.5-vl")
    if lora:  # each sync: the targeted weights merged, never the tower (nothing staged)
        assert all(s["sync/bytes"] == targeted_bytes(initial_dir) for s in steps)
        assert all(s["sync/staged_tensors"] == 0 for s in steps)
        checkpoint = tmp_path / "ckpt" / "step_000003" / "trainer_tp0_pp0.pt"
        shard = torch.load(checkpoint, weights_only=False)
        assert sorted({k.rsplit(".", 1)[1] for k in shard["model"]}) == ["lora_a", "lora_b"]

    # `relax-launch export` of the checkpoint = the run's own export of its final policy
    exported = export_checkpoint(tmp_path, tmp_path / "exported", merge_lora=lora)
    ours = load_file(str(exported / "model.safetensors"))
    theirs = load_file(str(next((tmp_path / "hf" / "step_000003").glob("*.safetensors"))))
    assert sorted(ours) == sorted(theirs) and any(k.startswith("visual.") for k in ours)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    # transformers and SGLang load it and agree; it is the trained model, not the initial one
    trained = torch.tensor(image_logprobs(exported))
    served = torch.tensor(served_logprobs(exported, tmp_path / "export-engine.log"))
    initial = torch.tensor(image_logprobs(initial_dir))
    print(
        f"exported: SGLang vs transformers {float((served - trained).abs().max()):.2e}, "
        f"trained vs initial {float((trained - initial).abs().max()):.2e}"
    )
    assert float((served - trained).abs().max()) <= 1e-4
    assert float((trained - initial).abs().max()) > 1e-4


def test_a_vlm_trains_on_packed_micro_batches_with_parity_after_every_sync(tmp_path):
    """``trainer.pack_sequences``: each step's eight samples (prompts with an image) end to
    end in one row, each sequence's multimodal positions from 0 and its attention its own; the
    policy trains, and the engines it syncs to score the probe as the trainer does."""
    result = run_job(
        f"logging.dir={tmp_path}",
        "trainer.pack_sequences=true",
        "trainer.micro_batch_size=8",
        "algorithm.num_steps=2",
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-3000:]
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    print([{k: s[k] for k in ("step", "sync/parity_gap_image", "grad_norm")} for s in steps])
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        assert s["sync/parity_gap"] <= FP32_PARITY and s["sync/parity_gap_image"] <= FP32_PARITY
        assert s["grad_norm"] > 0 and s["samples_invalid"] == 0
