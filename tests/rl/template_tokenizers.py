"""Tokenizers with a real model family's tokenizer configuration (its added and special tokens,
its eos, its chat template, stored verbatim in tests/rl/chat_templates/) over a tiny BPE
vocabulary trained here in well under a second, and a tiny random model for each; nothing is
downloaded. The tokens' ids differ from the real ones; which strings are single tokens, which
are special, and what the template renders are the real model's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TEMPLATES = Path(__file__).parent / "chat_templates"
FAMILIES = ("qwen3", "qwen2_5", "llama3_1")
VOCAB = 320  # the builtin tiny models' vocabulary size
_CORPUS = [
    "What is 3 + 4? The calculator says 7, so the answer is 7.",
    "I need the calculator for this. Let me think about the sum first.",
    'The tool call is {"name": "calculator", "arguments": {"expression": "3+4"}} with a result.',
    "Result: 7. Answer: 7. Cutting Knowledge Date Today Environment ipython functions JSON.",
]


def config_of(family: str) -> dict[str, Any]:
    """The family's tokenizer_config.json as stored in the fixtures."""
    return json.loads((TEMPLATES / f"{family}_tokenizer_config.json").read_text())


def tokenizer_of(family: str) -> Any:
    """A fast tokenizer with ``family``'s tokenizer configuration over a tiny BPE vocabulary."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    config = config_of(family)
    added = [config["added_tokens_decoder"][i] for i in sorted(config["added_tokens_decoder"])]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(  # with the added tokens: VOCAB ids, every one a token
        vocab_size=VOCAB - len(added), initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(_CORPUS * 4, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe)
    tokenizer.add_tokens(
        [AddedToken(t["content"], special=t["special"], normalized=False) for t in added]
    )
    specials = {k: config[k] for k in ("bos_token", "eos_token", "pad_token") if config.get(k)}
    extra = config.get("additional_special_tokens", [])
    tokenizer.add_special_tokens(specials | {"additional_special_tokens": extra})
    tokenizer.chat_template = config["chat_template"]
    return tokenizer


def build_tiny_model(family: str, out: Path, seed: int = 0) -> Path:
    """A 2-layer random model of the family's architecture (Qwen3, Qwen2, Llama) with
    ``tokenizer_of(family)``, saved to ``out`` for SGLang and the trainer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = tokenizer_of(family)
    tokenizer.save_pretrained(out)
    model_type = {"qwen3": "qwen3", "qwen2_5": "qwen2", "llama3_1": "llama"}[family]
    eos = tokenizer.convert_tokens_to_ids(config_of(family)["eos_token"])
    config = AutoConfig.for_model(
        model_type,
        vocab_size=len(tokenizer),  # no id the engine may sample is unknown to it
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
        **({"head_dim": 32} if family == "qwen3" else {}),
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out, safe_serialization=True)
    saved = json.loads((out / "config.json").read_text())
    saved["architectures"] = [type(model).__name__]
    (out / "config.json").write_text(json.dumps(saved, indent=2))
    return out
