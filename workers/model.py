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

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvmesh.cache_store.block_pool import allocate_kv_cache as _allocate_pool_tensor

from kvmesh.workers import attn_kernel
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
        slot_list: list[int] = []  # built in Python: one tensor per step, not several per sequence
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
            if needed and min(table[:needed]) < 0:
                raise ValueError(f"sequence {i}: negative block id in block table")
            if q == 1:
                slot_list.append(table[c // block_size] * block_size + c % block_size)
            else:
                slot_list.extend(table[p // block_size] * block_size + p % block_size for p in range(c, c + q))
        slots = torch.tensor(slot_list, dtype=torch.int64)
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

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        if fused and x.dtype == torch.bfloat16 and self.weight.dtype == torch.bfloat16:
            # one pass, the same roundings (float32 statistic, bf16 normalized value, bf16 product)
            return torch.ops.kvmesh.rms_norm_bf16(x, self.weight, self.eps)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)  # one fused kernel
        # torch's fused kernel on the float32 copy, then HF's cast-then-scale order
        xf = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
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


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE (Su et al. 2021) on ``x [T, heads, D]`` with ``cos, sin [T, 1, D]``.

    Rotate-half convention (HF Llama): ``x * cos + [-x2, x1] * sin`` where ``x1, x2`` are
    the two halves of each head.
    """
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos, rotated, sin)


def _fuse_rows(params: list[torch.Tensor]) -> torch.Tensor:
    """Stack ``params`` along dim 0 into one tensor and re-point each parameter at its rows.

    The projections then share the stacked storage (no second copy of the weights), and one
    matmul computes all of them. Built outside inference mode so the parameters stay
    editable in place afterwards.
    """
    with torch.inference_mode(False), torch.no_grad():
        fused = torch.cat([p.detach() for p in params])
        row = 0
        for p in params:
            n = p.shape[0]
            p.data = fused[row : row + n]
            row += n
    return fused


def _fuse_key(params: list[torch.Tensor | None]) -> tuple:
    """Identity, in-place version and storage of each parameter: changes when weights do."""
    return tuple((id(p), p._version, p.data_ptr()) for p in params if p is not None)


#: Rows the oneDNN weight layouts of `PackedWeights` are chosen for (any row count works).
PACK_BATCH_ROWS = 512


@functools.lru_cache(maxsize=None)
def _can_pack() -> bool:
    """Whether torch's oneDNN bf16 weight prepacking (``mkldnn::_reorder_linear_weight``) works
    on this CPU: it needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT, so it is tried once on a
    small weight rather than assumed from the build."""
    try:
        if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
            return False
        w = torch.ones(16, 16, dtype=torch.bfloat16)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 4)
        torch.ops.mkldnn._linear_pointwise(torch.ones(4, 16, dtype=torch.bfloat16), packed, None, "none", [], "")
        return True
    except (AttributeError, RuntimeError):
        return False


class PackedWeights:
    """bf16 ``F.linear`` on the CPU with each weight reordered once into oneDNN's blocked
    layout, instead of at every call.

    torch's bf16 linear hands oneDNN the plain ``[out, in]`` matrix, which it reorders on each
    call; over a step of 32-512 tokens that reorder was 8-12 % of the forward (issue-12 model,
    AMX CPU). The prepacked copy (``torch.ops.mkldnn._reorder_linear_weight``, what torch's
    inductor uses for frozen CPU linears) gives the same products, bit for bit on the shapes
    tested, and costs one more copy of the weights in memory. A copy is rebuilt whenever its
    weight object, storage or in-place version changes (`_fuse_key`); each entry keeps the
    weight it was packed from alive, so a new weight cannot be allocated at the old one's
    address and pass for it. An edit through ``.data`` (which has a version counter of its
    own) is not seen: call `clear` after one (`DecoderModel.drop_packed_weights`).
    """

    def __init__(self) -> None:
        # slot -> (key, the weight's storage as packed, its packed copy)
        self._packed: dict[str, tuple[tuple, torch.Tensor, torch.Tensor]] = {}

    def clear(self) -> None:
        """Forget every packed copy; the next call packs the weights as they are then."""
        self._packed.clear()

    def linear(self, slot: str, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
               packed: bool = True) -> torch.Tensor:
        """``x [T, in] -> [T, out]`` = ``x @ w.T + b``; prepacked when ``packed``, x and w are bf16
        CPU tensors and w is not an inference tensor (`torch.inference_mode`)."""
        if not (packed and x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16 and x.device.type == "cpu"
                and x.dim() == 2 and not w.is_inference() and _can_pack()):
            # (an inference tensor has no version counter: an in-place edit could not be seen)
            return F.linear(x, w, b)
        key = _fuse_key([w, b])
        hit = self._packed.get(slot)
        if hit is None or hit[0] != key:
            w = w.detach()  # a tensor of its own on the storage now behind w: keeps that storage alive
            hit = self._packed[slot] = (key, w, torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_ROWS))
        return torch.ops.mkldnn._linear_pointwise(x, hit[2], b, "none", [], "")


class SwiGLU(nn.Module):
    """SwiGLU MLP (Shazeer 2020): ``down(silu(gate(x)) * up(x))``, ``[T, H] -> [T, H]``."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(h, i, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(i, h, bias=False, dtype=dtype)

        self._fused_key: tuple | None = None
        self._fused = torch.empty(0)
        self._packs = PackedWeights()

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """``x [T, H] -> [T, H]``; ``fused``: bf16 through the C++ extension's ``silu_mul_bf16``
        (one pass over the gate/up product, the same two bf16 roundings as torch's ops) and
        prepacked weights (`PackedWeights`)."""
        params = [self.gate_proj.weight, self.up_proj.weight]
        if self._fused_key != _fuse_key(params):  # gate and up as one [2 * I, H] matmul
            self._fused = _fuse_rows(params)
            self._fused_key = _fuse_key(params)
        if fused and x.dtype == torch.bfloat16:
            gu = self._packs.linear("gate_up", x, self._fused)
            return self._packs.linear("down", torch.ops.kvmesh.silu_mul_bf16(gu), self.down_proj.weight)
        gu = F.linear(x, self._fused)
        i = self.gate_proj.weight.shape[0]
        act = F.silu(gu[:, :i], inplace=True)  # in place over the fresh [T, 2I] product: no new buffers
        return self.down_proj(act.mul_(gu[:, i:]))


@dataclass
class _SeqPlan:
    """One sequence with several new tokens (a prefill chunk), attended on its own."""

    start: int  # first row in the flattened batch
    end: int  # one past the last row
    total: int  # context_len + query_len: keys attended to
    blocks: torch.Tensor | None  # [ceil(total / block_size)] int64 block ids, None when self_only
    mask: torch.Tensor | None  # [query_len, total] additive float mask, or None
    is_causal: bool  # plain top-left causal mask (context_len == 0, no window)
    self_only: bool  # context_len == 0: the keys are this step's own K/V, no read from the pool


@dataclass
class _DecodeGroup:
    """All one-token sequences of a step, attended in one batched call per layer.

    Block tables are padded to the longest one (padding reads block 0 and is masked out),
    so one gather per layer reads every sequence's K/V straight into the
    ``[B, kv_heads, max_blocks * block_size, D]`` layout attention takes.
    """

    rows: torch.Tensor | None  # [B] int64 rows in the flattened batch; None when they are 0..B-1
    blocks: torch.Tensor  # [B * max_blocks] int64 block ids, padded per sequence
    num_seqs: int
    max_blocks: int
    mask: torch.Tensor | None  # [B, 1, 1, max_blocks * block_size] additive float mask, or None


@dataclass
class _KernelPlan:
    """Per-sequence metadata of the C++ kernel (`workers.attn_kernel`), one call per layer."""

    op: object  # torch.ops.kvmesh.paged_attention
    query_start: torch.Tensor  # [S + 1] int64 offsets of each sequence's rows in the flattened batch
    context_lens: torch.Tensor  # [S] int64
    block_tables: torch.Tensor  # [S, max_blocks] int64, padded with block 0 (never read)
    window: int  # sliding window, or -1


@dataclass
class _StepPlan:
    """Attention work of one forward step, built once and shared by all layers.

    With ``kernel`` set, every sequence goes through the C++ kernel and ``decode``/``seqs``
    are empty; otherwise torch's SDPA runs per `_DecodeGroup` / `_SeqPlan`.
    """

    decode: _DecodeGroup | None
    seqs: list[_SeqPlan]
    kernel: _KernelPlan | None = None
    #: bfloat16 forward with the C++ extension loaded: RMSNorm, RoPE and SiLU-and-multiply use its fused ops
    #: (`torch.ops.kvmesh.rms_norm_bf16`, ``rope_bf16_``) instead of 3-6 torch ops each
    fused: bool = False


def _gather_kv(kv_cache: torch.Tensor, layer_idx: int, blocks: torch.Tensor) -> torch.Tensor:
    """K and V of ``blocks`` for one layer as ``[2, kv_heads, n * block_size, D]`` (one copy).

    The pool is ``[num_blocks, layers, 2, kv_heads, block_size, D]``; selecting along the
    block dimension of the ``[2, kv_heads, num_blocks, block_size, D]`` view lands each
    head's keys contiguous, in block-table order, with no second reshape copy.
    """
    layer = kv_cache[:, layer_idx].permute(1, 2, 0, 3, 4)
    g = layer.index_select(2, blocks)
    return g.view(g.shape[0], g.shape[1], -1, g.shape[-1])


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
        self._fused_key: tuple | None = None
        self._fused: tuple[torch.Tensor, torch.Tensor | None] = (torch.empty(0), None)
        self._packs = PackedWeights()

    def _fused_qkv(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The q/k/v weights (and biases) stacked into one ``[(H + 2 * kv_heads) * D, hidden]`` matrix.

        The projections' parameters become views of it (`_fuse_rows`: no second copy).
        Rebuilt whenever a parameter object, its storage or its in-place version changes, so
        weights loaded or edited after construction are always the ones used.
        """
        weights = [self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]
        biases = [self.q_proj.bias, self.k_proj.bias, self.v_proj.bias]
        if self._fused_key != _fuse_key(weights + biases):
            w = _fuse_rows(weights)
            b = _fuse_rows(biases) if biases[0] is not None else None
            self._fused = (w, b)
            self._fused_key = _fuse_key(weights + biases)
        return self._fused

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        layer_idx: int,
        slot_blocks: torch.Tensor,
        slot_offsets: torch.Tensor,
        plan: _StepPlan,
        block_size: int,
    ) -> torch.Tensor:
        """``x [T, H]`` -> ``[T, H]``; writes this layer's K/V for the T tokens into ``kv_cache``.

        With the C++ kernel (``plan.kernel``, see `workers.attn_kernel`) all sequences of the
        step are attended in one call that reads K/V from the pool through the block tables.
        Otherwise (torch's SDPA): decoding sequences (one new token each) share one batched
        call that reads their K/V through the padded block tables; each prefill chunk gets one
        call, over its own fresh K/V when it has no cached context (no read from the pool) or
        over its blocks otherwise.
        """
        t = x.shape[0]
        d = self.head_dim
        nh, nkv = self.num_heads, self.num_kv_heads
        w, b = self._fused_qkv()
        qkv = self._packs.linear("qkv", x, w, b, plan.fused).view(t, nh + 2 * nkv, d)
        if plan.fused and qkv.dtype == torch.bfloat16:  # in place over the fresh projection
            qk = qkv[:, : nh + nkv]
            torch.ops.kvmesh.rope_bf16_(qk, cos, sin)
        else:
            qk = _apply_rope(qkv[:, : nh + nkv], cos, sin)  # RoPE on q and k in one pass
        q, k = qk[:, :nh], qk[:, nh:]
        v = qkv[:, nh + nkv:]

        # Scatter the new K/V into their slots: [T, kv_heads, D] each.
        kv_cache[slot_blocks, layer_idx, 0, :, slot_offsets] = k.to(kv_cache.dtype)
        kv_cache[slot_blocks, layer_idx, 1, :, slot_offsets] = v.to(kv_cache.dtype)

        if plan.kernel is not None:  # every sequence in one kernel call, K/V read from the pool
            kp = plan.kernel
            out = kp.op(q, kv_cache, layer_idx, kp.query_start, kp.context_lens, kp.block_tables, block_size,
                        kp.window, d ** -0.5)
            return self._out(out.view(t, nh * d), plan)
        dec = plan.decode
        if dec is not None and dec.rows is None and not plan.seqs:
            out = self._decode(q, kv_cache, layer_idx, dec, x.dtype)  # pure decode step
            return self._out(out.view(t, nh * d), plan)
        if dec is None and len(plan.seqs) == 1 and plan.seqs[0].self_only:  # one cold prefill
            return self._out(self._prefill(plan.seqs[0], q, k, v, kv_cache, layer_idx).reshape(t, nh * d), plan)
        out = torch.empty(t, nh, d, dtype=x.dtype, device=x.device)
        if dec is not None:
            out.index_copy_(0, dec.rows, self._decode(q.index_select(0, dec.rows), kv_cache, layer_idx, dec, x.dtype))
        for p in plan.seqs:
            out[p.start : p.end] = self._prefill(p, q, k, v, kv_cache, layer_idx)
        return self._out(out.view(t, nh * d), plan)

    def _out(self, o: torch.Tensor, plan: _StepPlan) -> torch.Tensor:
        """The output projection ``[T, H * D] -> [T, hidden]``."""
        return self._packs.linear("o", o, self.o_proj.weight, self.o_proj.bias, plan.fused)

    def _prefill(self, p: _SeqPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 layer_idx: int) -> torch.Tensor:
        """Attention of one prefill chunk: rows ``[p.start, p.end)`` of ``q [T, H, D]`` -> ``[q_len, H, D]``.

        Without cached context the keys are the chunk's own fresh ``k``/``v`` (no pool read);
        otherwise its blocks are gathered once from the pool.
        """
        qs = q[p.start : p.end].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D], strided view
        if p.self_only:  # contiguous per head: the CPU flash kernel reads strided K/V slower
            keys = k[p.start : p.end].transpose(0, 1).unsqueeze(0)
            values = v[p.start : p.end].transpose(0, 1).unsqueeze(0)
            if kv_cache.dtype != q.dtype:  # the values a later step reads back from the pool
                keys, values = keys.to(kv_cache.dtype), values.to(kv_cache.dtype)
            keys, values = keys.to(q.dtype).contiguous(), values.to(q.dtype).contiguous()
        else:
            kv = _gather_kv(kv_cache, layer_idx, p.blocks)[:, :, : p.total]
            if kv.dtype != q.dtype:
                kv = kv.to(q.dtype)
            keys, values = kv[0:1], kv[1:2]
        o = F.scaled_dot_product_attention(
            qs, keys, values, attn_mask=p.mask, is_causal=p.is_causal, enable_gqa=self.num_kv_heads != self.num_heads)
        return o[0].transpose(0, 1)

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, layer_idx: int, dec: _DecodeGroup,
                dtype: torch.dtype) -> torch.Tensor:
        """Batched paged attention for one new token per sequence: ``q [B, H, D]`` -> ``[B, H, D]``.

        GQA without copying K/V per query head: with one query token, the ``H / kv_heads``
        query heads of a group are laid out as that group's query rows
        (``[B, kv_heads, H / kv_heads, D]``), which attend to the same keys under the same mask.
        """
        b, nh, d = q.shape
        kv = _gather_kv(kv_cache, layer_idx, dec.blocks)  # [2, kv_heads, B * L, D]
        kv = kv.view(2, self.num_kv_heads, b, -1, d).transpose(1, 2)  # [2, B, kv_heads, L, D]
        if kv.dtype != dtype:
            kv = kv.to(dtype)
        qg = q.reshape(b, self.num_kv_heads, nh // self.num_kv_heads, d)
        o = F.scaled_dot_product_attention(qg, kv[0], kv[1], attn_mask=dec.mask)
        return o.reshape(b, nh, d)


class DecoderLayer(nn.Module):
    """Pre-norm decoder block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))`` (RMSNorm, GQA, SwiGLU)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = PagedAttention(config, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = SwiGLU(config, dtype)

    def forward(self, x: torch.Tensor, *attn_args) -> torch.Tensor:
        fused = attn_args[6].fused  # the step's _StepPlan
        x = x + self.self_attn(self.input_layernorm(x, fused), *attn_args)
        return x.add_(self.mlp(self.post_attention_layernorm(x, fused), fused))  # x is this layer's own sum

    def forward_fused(self, x: torch.Tensor, normed: torch.Tensor, next_norm: "RMSNorm | None",
                      *attn_args) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The bf16 kernel path with each residual add fused into the RMSNorm that reads it
        (``add_rms_norm_bf16``: the same values as the separate ops, bit for bit).

        ``normed`` is ``input_layernorm(x)``, computed by the caller (the previous layer);
        returns ``(x_out [T, H], next_norm(x_out))``, or ``(x_out, None)`` for the last layer.
        """
        a = self.self_attn(normed, *attn_args)
        post = self.post_attention_layernorm
        x, mlp_in = torch.ops.kvmesh.add_rms_norm_bf16(x, a, post.weight, post.eps)
        m = self.mlp(mlp_in, True)
        if next_norm is None:
            return x.add_(m), None
        return torch.ops.kvmesh.add_rms_norm_bf16(x, m, next_norm.weight, next_norm.eps)


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
        self._packs = PackedWeights()
        self._rope_tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        #: "auto" (the C++ kernel of `workers.attn_kernel` where it is loaded and supports
        #: the step, else torch's SDPA), "kernel" or "torch"; see `_plan`
        self.attention_backend = "auto"
        #: on the bf16 kernel path, fuse each residual add into the RMSNorm after it
        #: (`DecoderLayer.forward_fused`; same values, one pass fewer over the hidden states)
        self.fuse_residual_norm = True
        self.tie_weights()

    def drop_packed_weights(self) -> None:
        """Forget the prepacked weight copies of the bf16 forward (`PackedWeights`); needed only
        after weights were edited through ``.data``, which no version counter records."""
        for module in self.modules():
            packs = getattr(module, "_packs", None)
            if isinstance(packs, PackedWeights):
                packs.clear()

    def tie_weights(self) -> None:
        """Share the embedding matrix with the LM head when ``config.tie_word_embeddings``."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype,
              max_position: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[T, 1, D]`` for the given positions, computed in float32 then cast to ``dtype``.

        Rows come from a per-(device, dtype) table of every position seen so far (grown to the
        next power of two, at most ``max_position_embeddings``), so a step gathers ``T`` rows
        instead of evaluating ``2 * T * D`` transcendental functions; the table's rows are the
        same float32 formula, so values are bit-identical to computing them per step.
        ``max_position`` (the largest of ``positions``, known from the step's metadata) spares
        reading it back from the device, a synchronisation on CUDA.
        """
        dev = positions.device
        if max_position is None:
            max_position = int(positions.max()) if positions.numel() else 0
        need = max_position + 1
        key = (dev, dtype)
        table = self._rope_tables.get(key)
        if table is None or table[0].shape[0] < need:
            size = min(max(1 << (need - 1).bit_length(), 1024), max(need, self.config.max_position_embeddings))
            inv = self._inv_freq.get(dev)
            if inv is None:
                inv = rope_inv_freq(self.config, dev)
                self._inv_freq[dev] = inv
            pos = torch.arange(size, dtype=torch.int64, device=dev).to(torch.float32)
            freqs = pos[:, None] * inv[None, :]  # [size, D/2]
            emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
            table = (emb.cos().to(dtype), emb.sin().to(dtype))
            self._rope_tables[key] = table
        return table[0].index_select(0, positions), table[1].index_select(0, positions)

    def _plan(self, meta: AttentionMetadata, device: torch.device, kv_dtype: torch.dtype | None = None,
              backend: str = "auto") -> _StepPlan:
        """The step's attention plan, built once and shared by all layers.

        ``backend``: "kernel" (the C++ kernel, `workers.attn_kernel`; raises RuntimeError if it
        is unavailable), "torch" (SDPA), or "auto" (the kernel when it is loaded and supports
        the device and the model/pool dtypes ``kv_dtype``, default the model dtype).

        For SDPA: one-token decodes go into one `_DecodeGroup`, prefill chunks into one
        `_SeqPlan` each; masks are built here once, not per layer.
        """
        window = self.config.sliding_window
        bs = meta.block_size
        if backend != "torch" and meta.num_seqs:
            dtype = self.embed_tokens.weight.dtype
            if attn_kernel.supports(torch.device(device), dtype, kv_dtype if kv_dtype is not None else dtype):
                return _StepPlan(None, [], self._kernel_plan(meta, device))
            if backend == "kernel":
                raise RuntimeError(f"attention kernel unavailable: {attn_kernel.status()}")
        dtype = self.embed_tokens.weight.dtype
        seqs: list[_SeqPlan] = []
        dec_rows: list[int] = []
        dec_totals: list[int] = []
        dec_tables: list[list[int]] = []
        start = 0
        for q_len, ctx, table in zip(meta.query_lens, meta.context_lens, meta.block_tables):
            total = ctx + q_len
            if q_len == 1:
                dec_rows.append(start)
                dec_totals.append(total)
                dec_tables.append(table[: -(-total // bs)])
                start += 1
                continue
            mask: torch.Tensor | None = None
            is_causal = False
            windowed = window is not None and total > window
            if ctx == 0 and not windowed:
                is_causal = True
            else:
                q_pos = torch.arange(ctx, total, device=device)[:, None]
                k_pos = torch.arange(total, device=device)[None, :]
                visible = k_pos <= q_pos
                if windowed:
                    visible = visible & (k_pos > q_pos - window)
                # additive float mask, built once per step: a bool mask would be converted
                # inside every layer's attention call
                mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))
            blocks = None
            if ctx > 0:
                blocks = torch.tensor(table[: -(-total // bs)], dtype=torch.int64, device=device)
            seqs.append(_SeqPlan(start, start + q_len, total, blocks, mask, is_causal, ctx == 0))
            start += q_len
        decode = None
        if dec_rows:
            n = len(dec_rows)
            max_blocks = max(len(t) for t in dec_tables)
            padded = [t + [t[0]] * (max_blocks - len(t)) for t in dec_tables]
            blocks = torch.tensor(padded, dtype=torch.int64).view(-1).to(device)
            totals = torch.tensor(dec_totals, dtype=torch.int64)
            k_pos = torch.arange(max_blocks * bs, dtype=torch.int64)[None, :]
            visible = k_pos < totals[:, None]
            if window is not None:
                visible &= k_pos >= (totals - window)[:, None]
            mask = None
            if not bool(visible.all()):
                mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf"))
                mask = mask.view(n, 1, 1, -1).to(device)
            rows = None
            if seqs or dec_rows[-1] != n - 1:
                rows = torch.tensor(dec_rows, dtype=torch.int64, device=device)
            decode = _DecodeGroup(rows, blocks, n, max_blocks, mask)
        return _StepPlan(decode, seqs)

    def _kernel_plan(self, meta: AttentionMetadata, device: torch.device) -> _KernelPlan:
        """Offsets, context lengths and block tables (padded with block 0) as int64 tensors."""
        bs = meta.block_size
        needed = [table[: -(-(c + q) // bs)] for q, c, table in zip(meta.query_lens, meta.context_lens, meta.block_tables)]
        width = max(len(t) for t in needed)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in needed], dtype=torch.int64, device=device)
        starts = torch.tensor([0] + meta.query_lens, dtype=torch.int64).cumsum(0).to(device)
        ctx = torch.tensor(meta.context_lens, dtype=torch.int64, device=device)
        window = self.config.sliding_window
        return _KernelPlan(attn_kernel.get(), starts, ctx, tables, -1 if window is None else int(window))

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
        plan = self._plan(meta, device, kv_cache.dtype, self.attention_backend)
        plan.fused = plan.kernel is not None and self.embed_tokens.weight.dtype == torch.bfloat16

        h = self.embed_tokens(input_ids)
        last = max((c + q for c, q in zip(meta.context_lens, meta.query_lens)), default=1) - 1
        cos, sin = self._rope(positions, h.dtype, last)
        layers = list(self.layers)
        norms = [w for layer in layers for w in (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)]
        if plan.fused and self.fuse_residual_norm and h.dtype == torch.bfloat16 and \
                all(w.dtype == torch.bfloat16 for w in norms):
            normed = layers[0].input_layernorm(h, True)
            for i, layer in enumerate(layers):
                nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else None
                h, normed = layer.forward_fused(h, normed, nxt, cos, sin, kv_cache, i, slot_blocks, slot_offsets,
                                                plan, bs)
        else:
            for i, layer in enumerate(layers):
                h = layer(h, cos, sin, kv_cache, i, slot_blocks, slot_offsets, plan, bs)

        if logits_indices is None:
            logits_indices = meta.last_token_indices(device)
        h = self.norm(h.index_select(0, logits_indices.to(device)), plan.fused)
        return self._packs.linear("lm_head", h, self.lm_head.weight, self.lm_head.bias, plan.fused).float()
