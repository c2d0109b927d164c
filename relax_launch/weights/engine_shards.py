"""Each rollout engine TP rank's slice of a weight, as SGLang 0.5.23 holds it, so that rank
receives its slice straight into its parameter (``WeightSender`` broadcasts slice k in the
group of the engines' TP rank k).

The sender holds the engine's fused layout (``hf_conversion.megatron_to_hf(fused=True)``). A
TP rank of an SGLang engine holds:

- ``qkv_proj`` (``QKVParallelLinear``), rows: its q heads, then its k and v heads; with fewer
  key/value heads than TP ranks (``tp_size % num_kv_heads == 0``) each rank holds the one kv
  head ``rank * num_kv_heads // tp_size`` (replicated over its ranks).
- ``gate_up_proj`` and a routed expert's ``w13_weight[e]`` (``MergedColumnParallelLinear``,
  ``FusedMoE``), rows: its part of gate, then its part of up.
- ``o_proj``, ``down_proj``, ``w2_weight[e]`` (``RowParallelLinear``, ``FusedMoE``): its
  columns.
- ``embed_tokens``, ``lm_head`` (``VocabParallelEmbedding``): its rows of the vocabulary padded
  to a multiple of 64, rows past the vocabulary zero.
- anything else (norms, the router, a shared expert's gate) whole.

SGLang's CPU engine pads intermediate sizes to a multiple of ``tp_size * 32``
(``adjust_config_with_unaligned_cpu_tp``) and attention heads that TP does not divide; a rank's
part is then its rows of the padded size, zero past the real ones (the ``weight_loader``'s
``narrow_padded_param_and_loaded_weight``). Heads the CPU engine pads are not cut here: such a
tensor goes whole, and the engine's ``load_weights`` cuts it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

VOCAB_MULTIPLE = 64  # SGLang's DEFAULT_VOCAB_PADDING_SIZE
CPU_INTERMEDIATE_MULTIPLE = 32  # SGLang's DEFAULT_MOE_PADDING_SIZE, per TP rank, on the CPU
# (rows of the whole tensor from, to) of one rank's part of one segment, and its padded size
Part = tuple[int, int, int]


@dataclass(frozen=True)
class EngineShards:
    """How a rollout engine of ``tp_size`` ranks holds a model of ``num_heads`` query and
    ``num_kv_heads`` key/value heads; ``pads_for_tp``: SGLang's CPU engine (see the module)."""

    tp_size: int
    num_heads: int
    num_kv_heads: int
    pads_for_tp: bool = False
    # (name, shape) -> _cut's answer: the same few thousand names every sync
    _cuts: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def slices(self, name: str, whole: torch.Tensor) -> list[torch.Tensor]:
        """Tensor ``name`` (engine layout, whole) as each TP rank holds it, in rank order; each
        contiguous. A tensor every rank holds whole is the same tensor ``tp_size`` times (no
        copy)."""
        cut = self._cut(name, list(whole.shape))
        if cut is None:
            return [whole.contiguous()] * self.tp_size
        dim, segments = cut
        return [self._gather(whole, dim, [parts[k] for parts in segments]) for k in self.ranks]

    def shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of one TP rank's slice of tensor ``name`` of ``shape`` (the same on every
        rank)."""
        cut = self._cut(name, list(shape))
        if cut is None:
            return tuple(shape)
        dim, segments = cut
        sliced = list(shape)
        sliced[dim] = sum(parts[0][2] for parts in segments)
        return tuple(sliced)

    @property
    def ranks(self) -> range:
        return range(self.tp_size)

    def _cut(self, name: str, shape: list[int]) -> tuple[int, list[list[Part]]] | None:
        """The dimension along which ``name`` is split, and each segment's part per rank (the
        segments are concatenated along it); None when every rank holds it whole."""
        key = (name, tuple(shape))
        if key not in self._cuts:
            cut = self._work_out_cut(name, shape)
            if cut is not None and self.tp_size == 1:  # one rank: unless it pads, the whole
                dim, segments = cut
                rows = [part for parts in segments for part in parts]
                follow = all(a[1] == b[0] for a, b in zip(rows, rows[1:], strict=False))
                if follow and all(e - b == size for b, e, size in rows) and rows[0][0] == 0:
                    cut = None if rows[-1][1] == shape[dim] else cut
            self._cuts[key] = cut
        return self._cuts[key]

    def _work_out_cut(self, name: str, shape: list[int]) -> tuple[int, list[list[Part]]] | None:
        if self.tp_size == 1 and not self.pads_for_tp:
            return None
        stem = name.partition("[")[0]
        if stem.endswith(("qkv_proj.weight", "qkv_proj.bias")):
            return self._qkv(shape[0])
        if stem.endswith(("gate_up_proj.weight", "experts.w13_weight")):
            half = shape[0] // 2
            return 0, [self._padded(0, half), self._padded(half, half)]
        if stem.endswith(("down_proj.weight", "experts.w2_weight")):
            return 1, [self._padded(0, shape[1])]
        if stem.endswith("o_proj.weight"):
            return None if self._pads_heads else (1, [self._even(0, shape[1])])
        if stem.endswith(("embed_tokens.weight", "lm_head.weight")):
            padded = -(-shape[0] // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
            if padded % self.tp_size:
                return None
            return 0, [self._parts(0, shape[0], padded // self.tp_size)]
        return None

    @property
    def _pads_heads(self) -> bool:
        """The CPU engine pads heads (with zeros) that TP does not divide: not cut here."""
        uneven = self.num_heads % self.tp_size or self.num_kv_heads % self.tp_size
        return bool(self.pads_for_tp and uneven)

    def _qkv(self, rows: int) -> tuple[int, list[list[Part]]] | None:
        heads, kv_heads = self.num_heads, self.num_kv_heads
        head_dim = rows // (heads + 2 * kv_heads)
        if self._pads_heads or heads % self.tp_size:
            return None
        q = self._even(0, heads * head_dim)
        if kv_heads % self.tp_size == 0:
            k = self._even(heads * head_dim, kv_heads * head_dim)
            v = self._even((heads + kv_heads) * head_dim, kv_heads * head_dim)
            return 0, [q, k, v]
        if self.tp_size % kv_heads:
            return None
        owner = [rank * kv_heads // self.tp_size for rank in self.ranks]  # replicated kv heads
        k_start, v_start = heads * head_dim, (heads + kv_heads) * head_dim
        k = [(k_start + h * head_dim, k_start + (h + 1) * head_dim, head_dim) for h in owner]
        v = [(v_start + h * head_dim, v_start + (h + 1) * head_dim, head_dim) for h in owner]
        return 0, [q, k, v]

    def _even(self, start: int, length: int) -> list[Part]:
        return self._parts(start, length, length // self.tp_size)

    def _padded(self, start: int, length: int) -> list[Part]:
        """An intermediate size: padded on the CPU to a multiple of ``tp_size * 32``."""
        multiple = self.tp_size * (CPU_INTERMEDIATE_MULTIPLE if self.pads_for_tp else 1)
        padded = -(-length // multiple) * multiple
        return self._parts(start, length, padded // self.tp_size)

    def _parts(self, start: int, length: int, size: int) -> list[Part]:
        """Rank k's rows of a segment of ``length`` rows at ``start``, ``size`` per rank (rows
        past ``length`` are padding)."""
        return [
            (start + min(k * size, length), start + min((k + 1) * size, length), size)
            for k in self.ranks
        ]

    @staticmethod
    def _gather(whole: torch.Tensor, dim: int, parts: list[Part]) -> torch.Tensor:
        """One rank's parts of ``whole`` along ``dim``, each zero-padded to its size. Parts
        that follow one another in ``whole`` stay one view (one TP rank's q, k and v, gate and
        up: the whole tensor, not a copy)."""
        spans: list[list[int] | int] = []  # [begin, end] of rows of ``whole``, or zero rows
        for begin, end, size in parts:
            if spans and isinstance(spans[-1], list) and spans[-1][1] == begin:
                spans[-1][1] = end
            else:
                spans.append([begin, end])
            if size > end - begin:
                spans.append(size - (end - begin))
        pieces = []
        for span in spans:
            if isinstance(span, list):
                pieces.append(whole.narrow(dim, span[0], span[1] - span[0]))
            else:
                padding = list(whole.shape)
                padding[dim] = span
                pieces.append(whole.new_zeros(padding))
        return torch.cat(pieces, dim=dim) if len(pieces) > 1 else pieces[0].contiguous()
