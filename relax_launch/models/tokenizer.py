"""The tiny built-in models' tokenizer: byte-level BPE trained on a few sentences in well under
a second, with the chat markers as special tokens."""

from __future__ import annotations

from typing import Any

CHAT_SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]


def train_tiny_tokenizer(
    corpus: list[str], vocab_size: int, chat_template: str, extra_specials: tuple[str, ...] = ()
) -> Any:
    """A ``PreTrainedTokenizerFast`` trained on ``corpus`` (four times over)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[*CHAT_SPECIALS, *extra_specials],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="<|im_end|>",
        pad_token="<pad>",
    )
    fast.chat_template = chat_template
    return fast
