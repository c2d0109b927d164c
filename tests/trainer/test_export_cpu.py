"""A trained policy leaves as a Hugging Face model: the live export (during training) and
``relax-launch export`` of a checkpoint both load with transformers and give the trainer's own
logprobs (fp32), for every family and for TP=2, PP=2 and DP=2 shardings; a LoRA run's checkpoint
exports as a PEFT adapter that gives the merged model's logprobs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torchrun_worker import run_worker

from relax_launch.commands.export import ExportError, export_checkpoint, find_checkpoint

pytestmark = pytest.mark.e2e
WORKER = Path(__file__).with_name("export_worker.py")
TOLERANCE = 1e-5
CASES = {  # name: (model, tp, pp, lora rank)
    "llama-dp2": ("tiny-llama", 1, 1, 0),
    "qwen2-tp2": ("tiny-qwen2", 2, 1, 0),
    "qwen3-pp2": ("tiny-qwen3", 1, 2, 0),
    "llama-lora-tp2": ("tiny-llama", 2, 1, 4),
    "llama-lora-dp2": ("tiny-llama", 1, 1, 4),
    "qwen2-lora-pp2": ("tiny-qwen2", 1, 2, 4),
    "qwen3-lora-dp2": ("tiny-qwen3", 1, 1, 4),
}


def hf_logprobs(model, sequences: list[list[int]]) -> list[list[float]]:
    rows = []
    with torch.no_grad():
        for tokens in sequences:
            ids = torch.tensor([tokens])
            logits = model(ids).logits.float().log_softmax(-1)[0, :-1]
            rows.append(logits.gather(-1, ids[0, 1:, None])[:, 0].tolist())
    return rows


def largest_difference(ours: list[list[float]], theirs: list[list[float]]) -> float:
    # the trainer scores the response tokens (after a 2-token prompt); compare those
    return max(
        float((torch.tensor(a[1:]) - torch.tensor(b[1:])).abs().max())
        for a, b in zip(ours, theirs, strict=True)
    )


def load(directory: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def exported(tmp_path_factory, venv_env) -> dict:
    out = tmp_path_factory.mktemp("exports")
    cases = [f"{name}:{':'.join(map(str, case))}" for name, case in CASES.items()]
    (report,) = run_worker(WORKER, 2, [out, *cases], venv_env)
    return report


@pytest.mark.parametrize("name", CASES)
def test_exports_give_the_trainers_logprobs(exported, name, tmp_path):
    from export_worker import SEQUENCES

    case = exported[name]
    lora = CASES[name][3] > 0
    live = load(Path(case["live"]))
    differences = {"live": largest_difference(case["logprobs"], hf_logprobs(live, SEQUENCES))}
    offline = export_checkpoint(Path(case["checkpoint"]), tmp_path / "full", merge_lora=lora)
    assert (offline / "config.json").is_file() and (offline / "tokenizer.json").is_file()
    assert json.loads((offline / "config.json").read_text())["torch_dtype"] == "float32"
    assert (offline / "generation_config.json").is_file() and (offline / "README.md").is_file()
    merged = hf_logprobs(load(offline), SEQUENCES)
    differences["checkpoint"] = largest_difference(case["logprobs"], merged)
    if lora:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        adapter = export_checkpoint(Path(case["checkpoint"]), tmp_path / "adapter")
        assert sorted(p.name for p in adapter.glob("adapter_*")) == [
            "adapter_config.json", "adapter_model.safetensors",
        ]  # fmt: skip
        base_dir = json.loads((adapter / "adapter_config.json").read_text())
        base = AutoModelForCausalLM.from_pretrained(
            base_dir["base_model_name_or_path"], dtype=torch.float32
        )
        peft = PeftModel.from_pretrained(base, adapter).eval()
        differences["peft"] = largest_difference(merged, hf_logprobs(peft, SEQUENCES))
    print(f"{name}: trainer vs export logprobs {differences}")
    assert max(differences.values()) <= TOLERANCE, differences


def test_lora_moved_the_policy_off_its_base(exported, tmp_path):
    """The LoRA cases' parity is not vacuous: the trained adapters changed the logprobs."""
    from export_worker import SEQUENCES

    from relax_launch.models.build import ensure_model

    case = exported["qwen3-lora-dp2"]
    base = hf_logprobs(load(ensure_model("builtin:tiny-qwen3")), SEQUENCES)
    assert largest_difference(case["logprobs"], base) > 1e-3


def test_lora_trains_alike_at_any_tensor_parallel_size(exported):
    """Each adapter is split with its layer (A whole and B by rows on q/k/v and gate/up, A by
    columns and B whole on o and down): TP=2 starts from the same adapters as one rank and
    takes the same steps."""
    from export_worker import SEQUENCES

    from relax_launch.models.build import ensure_model

    tp2, dp2 = exported["llama-lora-tp2"]["logprobs"], exported["llama-lora-dp2"]["logprobs"]
    base = hf_logprobs(load(ensure_model("builtin:tiny-llama")), SEQUENCES)
    apart, moved = largest_difference(tp2, dp2), largest_difference(tp2, base)
    print(f"LoRA TP=2 vs one rank: {apart:.1e}; both trained away from the base by {moved:.1e}")
    # Adam divides by the gradient's own size, so fp32 rounding of a sum in another order moves
    # a step by ~1e-5: the bound is 1e-4, far below how far the two steps moved the policy
    assert apart <= 1e-4
    assert moved > 100 * 1e-4


def test_a_lora_checkpoint_holds_the_adapters_and_their_optimizer_alone(exported):
    checkpoint = Path(exported["llama-lora-tp2"]["checkpoint"])
    state = torch.load(checkpoint / "trainer_tp1_pp0.pt", weights_only=False)
    names = sorted(state["model"])
    assert names and all(n.rsplit(".", 1)[1] in ("lora_a", "lora_b") for n in names), names
    # 2 layers x 4 targeted linears x (A, B), each with Adam moments: no state for the base
    assert len(names) == 16
    assert len(state["optimizer"]["state"]) == 16


def test_export_refuses_what_it_cannot_do(exported, tmp_path):
    full = Path(exported["llama-dp2"]["checkpoint"])
    with pytest.raises(ExportError, match="not LoRA: drop --merge-lora"):
        export_checkpoint(full, tmp_path / "x", merge_lora=True)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="not empty"):
        export_checkpoint(full, tmp_path / "busy")
    assert (tmp_path / "busy" / "keep.txt").read_text() == "mine"  # nothing lost
    with pytest.raises(ExportError, match="no complete checkpoint"):
        find_checkpoint(tmp_path)
    # the command line: bf16 on request, and the error path exits 2 naming the problem
    cli = Path(sys.executable).with_name("relax-launch")
    run = [str(cli), "export", str(full), "--out", str(tmp_path / "bf16"), "--dtype", "bf16"]
    assert subprocess.run(run, capture_output=True, text=True, timeout=300).returncode == 0
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16"
    again = subprocess.run(run, capture_output=True, text=True, timeout=300)
    assert again.returncode == 2 and "not empty" in again.stderr
