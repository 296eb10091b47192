"""Llama-family decoder (Llama, Mistral, Qwen2) running over a paged KV cache.

Building blocks and their sources:

* RMSNorm: Zhang & Sennrich 2019, ``y = w * x / sqrt(mean(x^2) + eps)`` computed in float32.
* RoPE: Su et al. 2021, rotate-half convention as in HF Llama (the two halves of each head
  are the pair coordinates); Llama 3 frequency scaling from Meta's Llama 3.1 reference code.
* GQA: Ainslie et al. 2023, query head ``h`` reads KV head ``h // (heads / kv_heads)``.
* SwiGLU: Shazeer 2020, ``down(silu(gate(x)) * up(x))``.
* Paged KV cache: PagedAttention, Kwon et al. SOSP 2023.
* Qwen2 = Llama with biases on the q/k/v projections.

KV cache layout: one preallocated tensor ``kv_cache`` of shape
``[num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]`` (index 0 of dim 2 is K,
1 is V). The token at position ``p`` of a sequence lives in block ``block_table[p // block_size]``
at offset ``p % block_size``. One block therefore holds all layers' K and V for
``block_size`` consecutive tokens, which is the unit the prefix cache stores and ships.

Batches are flattened (continuous batching, no padding): the new tokens of every sequence
are concatenated into one ``[T]`` vector and `AttentionMetadata` says where each sequence
starts and how much cached context it has.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvmesh.cache_store.block_pool import allocate_kv_cache as _allocate_pool_tensor

from kvmesh.workers.config import ModelConfig

__all__ = [
    "AttentionMetadata",
    "DecoderModel",
    "kv_cache_shape",
    "allocate_kv_cache",
    "rope_inv_freq",
]


def kv_cache_shape(config: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """Shape of the paged KV cache: ``(num_blocks, layers, 2, kv_heads, block_size, head_dim)``."""
    return (
        num_blocks,
        config.num_hidden_layers,
        2,
        config.num_key_value_heads,
        block_size,
        config.head_dim,
    )


def allocate_kv_cache(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`cache_store.block_pool.allocate_kv_cache` with the dimensions taken from ``config``.

    Shape `kv_cache_shape`; dtype defaults to the model dtype.

    Raises:
        ValueError: ``num_blocks`` or ``block_size`` is not positive.
    """
    dt = dtype if dtype is not None else getattr(torch, config.dtype)
    return _allocate_pool_tensor(num_blocks, config.num_hidden_layers, config.num_key_value_heads, block_size,
                                 config.head_dim, dt, device)


@dataclass
class AttentionMetadata:
    """Where the new tokens of one forward step come from and where their KV goes.

    Attributes:
        query_lens: new tokens per sequence in this step, in flattened batch order (each >= 1).
        context_lens: tokens of that sequence already in the KV cache before this step
            (= position of its first new token).
        block_tables: per sequence, block ids covering at least ``context_len + query_len`` tokens.
        slot_mapping: ``[T]`` int64, ``block_id * block_size + offset`` of each new token.
        block_size: tokens per KV block.
    """

    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    slot_mapping: torch.Tensor
    block_size: int

    @property
    def num_tokens(self) -> int:
        """T, the number of new tokens in the step."""
        return int(sum(self.query_lens))

    @property
    def num_seqs(self) -> int:
        """Number of sequences in the step."""
        return len(self.query_lens)

    @staticmethod
    def build(
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: str | torch.device = "cpu",
    ) -> "AttentionMetadata":
        """Validate the per-sequence lists and compute ``slot_mapping`` (PagedAttention, Kwon et al. 2023).

        Token ``p`` (``context_len <= p < context_len + query_len``) maps to slot
        ``block_table[p // block_size] * block_size + p % block_size``.

        Raises:
            ValueError: list lengths differ, a query length is < 1, a context length is < 0,
                ``block_size`` < 1, a block id is negative, or a block table is too short for
                ``context_len + query_len`` tokens.
        """
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not (len(query_lens) == len(context_lens) == len(block_tables)):
            raise ValueError(
                "query_lens, context_lens and block_tables must have one entry per sequence; got "
                f"{len(query_lens)}, {len(context_lens)}, {len(block_tables)}"
            )
        pieces: list[torch.Tensor] = []
        for i, (q, c, table) in enumerate(zip(query_lens, context_lens, block_tables)):
            if q < 1:
                raise ValueError(f"sequence {i}: query_len must be >= 1, got {q}")
            if c < 0:
                raise ValueError(f"sequence {i}: context_len must be >= 0, got {c}")
            needed = -(-(c + q) // block_size)
            if len(table) < needed:
                raise ValueError(
                    f"sequence {i}: block table has {len(table)} blocks but {c + q} tokens need {needed}"
                )
            bt = torch.tensor(list(table[:needed]), dtype=torch.int64)
            if bool((bt < 0).any()):
                raise ValueError(f"sequence {i}: negative block id in block table")
            pos = torch.arange(c, c + q, dtype=torch.int64)
            pieces.append(bt[pos // block_size] * block_size + pos % block_size)
        slots = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)
        return AttentionMetadata(
            query_lens=[int(q) for q in query_lens],
            context_lens=[int(c) for c in context_lens],
            block_tables=[list(t) for t in block_tables],
            slot_mapping=slots.to(device),
            block_size=int(block_size),
        )

    def positions(self, device: str | torch.device | None = None) -> torch.Tensor:
        """``[T]`` int64 positions of the new tokens: ``context_len + arange(query_len)`` per sequence."""
        parts = [torch.arange(c, c + q, dtype=torch.int64) for q, c in zip(self.query_lens, self.context_lens)]
        out = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
        return out.to(device if device is not None else self.slot_mapping.device)

    def last_token_indices(self, device: str | torch.device | None = None) -> torch.Tensor:
        """``[num_seqs]`` int64 row of each sequence's last new token in the flattened batch."""
        ends = torch.tensor(self.query_lens, dtype=torch.int64).cumsum(0) - 1
        return ends.to(device if device is not None else self.slot_mapping.device)


# ---------------------------------------------------------------------------- building blocks


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019): ``w * x / sqrt(mean(x^2, -1) + eps)``.

    The statistic is computed in float32 and the normalized value cast back to the input
    dtype before the weight is applied (HF Llama order). Input/output ``[..., H]``.
    """

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(config: ModelConfig, device: str | torch.device = "cpu") -> torch.Tensor:
    """RoPE inverse frequencies ``theta ** (-2i / D)`` for ``i < D/2``, shape ``[D/2]`` float32.

    RoPE: Su et al. 2021. With ``config.rope_scaling`` set, applies the Llama 3 scaling
    (Meta Llama 3.1 reference ``apply_scaling``): with ``wavelen = 2*pi / f``, low-frequency
    components (``wavelen > L0 / low_freq_factor``) become ``f / factor``, high-frequency
    ones (``wavelen < L0 / high_freq_factor``) stay ``f``, and in between
    ``(1 - s) * f / factor + s * f`` with ``s = (L0 / wavelen - low) / (high - low)``,
    where ``L0 = original_max_position_embeddings``.
    """
    d = config.head_dim
    exponent = torch.arange(0, d, 2, dtype=torch.int64).to(device=device, dtype=torch.float32) / d
    inv_freq = 1.0 / (config.rope_theta ** exponent)
    rs = config.rope_scaling
    if rs is None:
        return inv_freq
    old = float(rs.original_max_position_embeddings)
    low_wavelen = old / rs.low_freq_factor
    high_wavelen = old / rs.high_freq_factor
    wavelen = 2 * torch.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
    smooth = (old / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
    blended = (1 - smooth) * scaled / rs.factor + smooth * scaled
    mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(mid, blended, scaled)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last dim (rotate-half convention, HF Llama)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE (Su et al. 2021) on ``x [T, heads, D]`` with ``cos, sin [T, 1, D]``."""
    return x * cos + _rotate_half(x) * sin


class SwiGLU(nn.Module):
    """SwiGLU MLP (Shazeer 2020): ``down(silu(gate(x)) * up(x))``, ``[T, H] -> [T, H]``."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(h, i, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(i, h, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


@dataclass
class _SeqPlan:
    """Per-sequence attention work shared by all layers of one forward step."""

    start: int  # first row in the flattened batch
    end: int  # one past the last row
    total: int  # context_len + query_len: keys attended to
    blocks: torch.Tensor  # [ceil(total / block_size)] int64 block ids on the model device
    mask: torch.Tensor | None  # [query_len, total] bool (True = attend), or None
    is_causal: bool  # plain top-left causal mask (context_len == 0, no window)


class PagedAttention(nn.Module):
    """Grouped-query self-attention over the paged KV cache.

    GQA: Ainslie et al. 2023; PagedAttention: Kwon et al. SOSP 2023; RoPE: Su et al. 2021.
    Scores are scaled by ``1/sqrt(head_dim)``. q/k/v projections carry biases when
    ``config.attention_bias`` (Qwen2); the output projection has none.
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = d
        bias = config.attention_bias
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=bias, dtype=dtype)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias, dtype=dtype)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias, dtype=dtype)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False, dtype=dtype)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        layer_idx: int,
        slot_blocks: torch.Tensor,
        slot_offsets: torch.Tensor,
        plans: list[_SeqPlan],
        block_size: int,
    ) -> torch.Tensor:
        """``x [T, H]`` -> ``[T, H]``; writes this layer's K/V for the T tokens into ``kv_cache``."""
        t = x.shape[0]
        d = self.head_dim
        q = _apply_rope(self.q_proj(x).view(t, self.num_heads, d), cos, sin)
        k = _apply_rope(self.k_proj(x).view(t, self.num_kv_heads, d), cos, sin)
        v = self.v_proj(x).view(t, self.num_kv_heads, d)

        # Scatter the new K/V into their slots: [T, kv_heads, D] each.
        kv_cache[slot_blocks, layer_idx, 0, :, slot_offsets] = k.to(kv_cache.dtype)
        kv_cache[slot_blocks, layer_idx, 1, :, slot_offsets] = v.to(kv_cache.dtype)

        out = torch.empty(t, self.num_heads, d, dtype=x.dtype, device=x.device)
        for p in plans:
            # [n_blocks, 2, kv_heads, block_size, D] -> [2, kv_heads, n_blocks * block_size, D]
            kv = kv_cache[p.blocks, layer_idx]
            n = kv.shape[0]
            kv = kv.permute(1, 2, 0, 3, 4).reshape(2, self.num_kv_heads, n * block_size, d)
            # 4-D [1, heads, len, D] inputs let CPU SDPA pick its fused kernel (3-D falls back to math).
            keys = kv[0:1, :, : p.total].to(x.dtype)
            values = kv[1:2, :, : p.total].to(x.dtype)
            qs = q[p.start : p.end].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(
                qs,
                keys,
                values,
                attn_mask=p.mask,
                is_causal=p.is_causal,
                enable_gqa=self.num_kv_heads != self.num_heads,
            )
            out[p.start : p.end] = o[0].transpose(0, 1)
        return self.o_proj(out.view(t, self.num_heads * d))


class DecoderLayer(nn.Module):
    """Pre-norm decoder block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))`` (RMSNorm, GQA, SwiGLU)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = PagedAttention(config, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = SwiGLU(config, dtype)

    def forward(self, x: torch.Tensor, *attn_args) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), *attn_args)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    """Llama-family causal LM over a paged KV cache.

    Parameter names mirror the HF checkpoint layout without the ``model.`` prefix
    (``embed_tokens``, ``layers.{i}.self_attn.q_proj``, ..., ``norm``, ``lm_head``), so
    `workers.loader` maps a checkpoint by stripping that prefix. Parameters are created in
    ``config.dtype`` with PyTorch's default initialization; `workers.loader.load_model`
    supplies real or seeded weights.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        dtype = getattr(torch, config.dtype)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(config, dtype) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        self._inv_freq: dict[torch.device, torch.Tensor] = {}
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding matrix with the LM head when ``config.tie_word_embeddings``."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[T, 1, D]`` for the given positions, computed in float32 then cast to ``dtype``."""
        dev = positions.device
        inv = self._inv_freq.get(dev)
        if inv is None:
            inv = rope_inv_freq(self.config, dev)
            self._inv_freq[dev] = inv
        freqs = positions.to(torch.float32)[:, None] * inv[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def _plans(self, meta: AttentionMetadata, device: torch.device) -> list[_SeqPlan]:
        window = self.config.sliding_window
        bs = meta.block_size
        plans: list[_SeqPlan] = []
        start = 0
        for q_len, ctx, table in zip(meta.query_lens, meta.context_lens, meta.block_tables):
            total = ctx + q_len
            blocks = torch.tensor(table[: -(-total // bs)], dtype=torch.int64, device=device)
            mask: torch.Tensor | None = None
            is_causal = False
            windowed = window is not None and total > window
            if ctx == 0 and not windowed:
                is_causal = q_len > 1
            elif q_len > 1 or windowed:
                q_pos = torch.arange(ctx, total, device=device)[:, None]
                k_pos = torch.arange(total, device=device)[None, :]
                visible = k_pos <= q_pos
                if windowed:
                    visible = visible & (k_pos > q_pos - window)
                # additive float mask, built once per step: a bool mask would be converted
                # inside every layer's attention call
                dtype = self.embed_tokens.weight.dtype
                mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))
            plans.append(_SeqPlan(start, start + q_len, total, blocks, mask, is_causal))
            start += q_len
        return plans

    def _check(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv_cache: torch.Tensor) -> None:
        t = input_ids.shape[0]
        if input_ids.dim() != 1 or positions.dim() != 1:
            raise ValueError("input_ids and positions must be 1-D [T] tensors")
        if positions.shape[0] != t or meta.slot_mapping.shape[0] != t or meta.num_tokens != t:
            raise ValueError(
                f"token counts disagree: input_ids {t}, positions {positions.shape[0]}, "
                f"slot_mapping {meta.slot_mapping.shape[0]}, sum(query_lens) {meta.num_tokens}"
            )
        expected = kv_cache_shape(self.config, kv_cache.shape[0] if kv_cache.dim() else 0, meta.block_size)
        if tuple(kv_cache.shape) != expected:
            raise ValueError(f"kv_cache has shape {tuple(kv_cache.shape)}, expected {expected}")
        if max((c + q for c, q in zip(meta.context_lens, meta.query_lens)), default=0) > self.config.max_position_embeddings:
            raise ValueError(
                f"a sequence exceeds max_position_embeddings ({self.config.max_position_embeddings})"
            )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
        logits_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run one step over the new tokens of all sequences and return selected logits.

        Args:
            input_ids: ``[T]`` int64, the new tokens of all sequences concatenated.
            positions: ``[T]`` int64, absolute position of each token; must equal
                ``context_len + arange(query_len)`` per sequence (`AttentionMetadata.positions`).
            meta: batch layout and KV slots (`AttentionMetadata.build`).
            kv_cache: ``[num_blocks, layers, 2, kv_heads, block_size, head_dim]``; each layer's
                new K (post-RoPE) and V are written at ``meta.slot_mapping``.
            logits_indices: ``[N]`` int64 rows of the flattened batch to return logits for;
                default the last new token of each sequence.

        Each sequence attends causally over its ``context_len`` cached tokens plus its new
        tokens, read back from its block table (so a prefill split over steps, or one that
        starts from shared prefix blocks, sees the same keys as a one-shot prefill). Call
        under ``torch.inference_mode()``.

        Returns:
            ``[N, vocab_size]`` float32 logits.

        Raises:
            ValueError: inconsistent token counts, a KV cache of the wrong shape, or a
                sequence longer than ``max_position_embeddings``.
        """
        self._check(input_ids, positions, meta, kv_cache)
        device = input_ids.device
        bs = meta.block_size
        slots = meta.slot_mapping.to(device)
        slot_blocks = torch.div(slots, bs, rounding_mode="floor")
        slot_offsets = slots - slot_blocks * bs
        plans = self._plans(meta, device)

        h = self.embed_tokens(input_ids)
        cos, sin = self._rope(positions, h.dtype)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, kv_cache, i, slot_blocks, slot_offsets, plans, bs)

        if logits_indices is None:
            logits_indices = meta.last_token_indices(device)
        h = self.norm(h.index_select(0, logits_indices.to(device)))
        return self.lm_head(h).float()
