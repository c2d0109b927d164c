"""TokenBatch: the trainer's input, sequences with a loss mask and a weight per token."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenBatch:
    """Sequences of token ids (prompt + response) and, per token, whether it is trained on.

    ``loss_mask[i][t]`` and ``token_weights[i][t]`` refer to predicting token ``t`` from the
    tokens before it, so position 0 is never trained on.
    """

    tokens: tuple[tuple[int, ...], ...]
    loss_mask: tuple[tuple[float, ...], ...]
    token_weights: tuple[tuple[float, ...], ...]

    def __post_init__(self) -> None:
        for i, (t, m, w) in enumerate(
            zip(self.tokens, self.loss_mask, self.token_weights, strict=True)
        ):
            if not len(t) == len(m) == len(w) or len(t) < 2:
                raise ValueError(
                    f"sequence {i}: tokens, loss_mask and token_weights need one entry per token "
                    f"and at least 2 tokens (got {len(t)}, {len(m)}, {len(w)})"
                )

    @classmethod
    def next_token(cls, tokens: list[list[int]], prompt_lengths: list[int]) -> TokenBatch:
        """Plain next-token training on the tokens after each prompt, weight 1."""
        masks = tuple(
            tuple(float(j >= n) for j in range(len(t)))
            for t, n in zip(tokens, prompt_lengths, strict=True)
        )
        return cls(tuple(map(tuple, tokens)), masks, tuple(tuple(1.0 for _ in t) for t in tokens))

    def __len__(self) -> int:
        return len(self.tokens)

    def select(self, indices: range) -> TokenBatch:
        return TokenBatch(
            tuple(self.tokens[i] for i in indices),
            tuple(self.loss_mask[i] for i in indices),
            tuple(self.token_weights[i] for i in indices),
        )

    def tensors(self, pad_id: int = 0) -> dict[str, torch.Tensor]:
        """Right-padded inputs, targets, mask and weights, each [batch, longest - 1]."""
        longest = max(len(t) for t in self.tokens)

        def pad(
            rows: tuple[tuple[float, ...], ...], value: float, dtype: torch.dtype
        ) -> torch.Tensor:
            return torch.tensor([list(r) + [value] * (longest - len(r)) for r in rows], dtype=dtype)

        tokens = pad(self.tokens, pad_id, torch.long)
        return {
            "inputs": tokens[:, :-1].contiguous(),
            "targets": tokens[:, 1:].contiguous(),
            "mask": pad(self.loss_mask, 0.0, torch.float32)[:, 1:].contiguous(),
            "weights": pad(self.token_weights, 0.0, torch.float32)[:, 1:].contiguous(),
        }
