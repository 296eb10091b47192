"""The C++ attention kernel (workers/paged_attention.cpp) on its own, and its loader.

Its agreement with a float64 reference over ragged batches is in tests/test_paged_attention.py
(both backends); here: cold prefill vs the same positions computed as a chunk after cached
context (and as decodes) must give bit-identical outputs, the argument checks, and the
loader's fallbacks (KVMESH_ATTN=torch, a library built from another source).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from kvmesh.workers import attn_kernel

from tests._model_utils import needs_kernel_mark

needs_kernel = needs_kernel_mark()


def _pool(num_blocks: int, kv_heads: int, block_size: int, d: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_blocks, 2, 2, kv_heads, block_size, d, generator=g).to(dtype)


def _call(q, kv, q_lens, ctx, tables, block_size, window):
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
    starts = torch.tensor([0] + q_lens, dtype=torch.int64).cumsum(0)
    return attn_kernel.get()(q, kv, 1, starts, torch.tensor(ctx, dtype=torch.int64), bt, block_size, window,
                             1 / math.sqrt(q.shape[-1]))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size,window,heads,kv_heads", [(16, -1, 8, 2), (32, 40, 8, 1), (4, -1, 4, 4)])
def test_cold_and_cached_positions_are_bit_identical(dtype, block_size, window, heads, kv_heads):
    """A prompt's rows from a cold prefill equal, bit for bit, the same rows computed as a
    chunk after the prefix was cached, and as one-token decodes, in batches of other work."""
    n, cached, d = 150, 67, 64
    kv = _pool(128, kv_heads, block_size, d, dtype, seed=1)
    table = list(range(40, 40 + -(-n // block_size)))
    other = list(range(1, 1 + -(-90 // block_size)))  # another sequence, decoding at position 89
    q = torch.randn(n, heads, d, generator=torch.Generator().manual_seed(2)).to(dtype)
    q_other = torch.randn(1, heads, d, generator=torch.Generator().manual_seed(3)).to(dtype)

    cold = _call(q, kv, [n], [0], [table], block_size, window)
    chunk = _call(torch.cat([q_other, q[cached:]]), kv, [1, n - cached], [89, cached], [other, table],
                  block_size, window)
    assert torch.equal(chunk[1:], cold[cached:])
    last = _call(torch.cat([q[n - 1 :], q_other]), kv, [1, 1], [n - 1, 89], [table, other], block_size, window)
    assert torch.equal(last[0], cold[n - 1])
    assert torch.equal(last[1], chunk[0])  # the other sequence's decode, in a different batch


def _reference(q, kv, q_lens, ctx, tables, block_size, window):
    """float64 attention reading every key/value slot through the block table (layer 1)."""
    t, heads, d = q.shape
    group = heads // kv.shape[3]
    out = torch.zeros(t, heads, d, dtype=torch.float64)
    row = 0
    for q_len, c, table in zip(q_lens, ctx, tables):
        total = c + q_len
        keys = torch.stack([kv[table[p // block_size], 1, 0, :, p % block_size] for p in range(total)]).double()
        vals = torch.stack([kv[table[p // block_size], 1, 1, :, p % block_size] for p in range(total)]).double()
        k_pos = torch.arange(total)
        for i in range(q_len):
            pos = c + i
            hidden = (k_pos > pos) | ((k_pos <= pos - window) if window > 0 else torch.zeros(total, dtype=torch.bool))
            for h in range(heads):
                scores = keys[:, h // group] @ q[row + i, h].double() / math.sqrt(d)
                out[row + i, h] = torch.softmax(scores.masked_fill(hidden, -math.inf), 0) @ vals[:, h // group]
        row += q_len
    return out


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [-1, 100])
def test_long_sequences_match_reference(dtype, window):
    """Sequences long enough to be split into several work items per KV head (256 query
    rows each), next to short chunks and decodes, block tables out of order."""
    block_size, heads, kv_heads, d = 16, 8, 2, 64
    kv = _pool(160, kv_heads, block_size, d, dtype, seed=4)
    q_lens, ctx = [300, 1, 130, 1, 20], [0, 77, 170, 250, 35]
    tables, nxt = [], 1
    for q_len, c in zip(q_lens, ctx):
        n = -(-(q_len + c) // block_size)
        tables.append(list(range(nxt + n - 1, nxt - 1, -1)))  # blocks in reverse order
        nxt += n
    q = torch.randn(sum(q_lens), heads, d, generator=torch.Generator().manual_seed(5)).to(dtype)
    ours = _call(q, kv, q_lens, ctx, tables, block_size, window).double()
    ref = _reference(q, kv, q_lens, ctx, tables, block_size, window)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's own rounding
    assert (ours - ref).abs().max().item() < tol


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_propagates_as_in_the_reference(dtype):
    """A NaN in a query row, or in a cached key, makes exactly the outputs that the float64
    reference (and torch's SDPA) makes NaN: that row's head, or every row that sees the key;
    on the full-tile path (a prefill) and on the few-row path (decodes) alike."""
    block_size, heads, kv_heads, d = 16, 8, 2, 64
    kv = _pool(40, kv_heads, block_size, d, dtype, seed=6)
    kv[3, 1, 0, 1, 5, 7] = math.nan  # layer 1, key, KV head 1, slot 5 of block 3: position 5 of sequence 1
    q_lens, ctx = [40, 1, 1], [0, 30, 20]
    tables = [[0, 1, 2], [3, 4], [5, 6]]
    q = torch.randn(sum(q_lens), heads, d, generator=torch.Generator().manual_seed(7)).to(dtype)
    q[10, 2, 0] = math.nan  # sequence 0's position 10, head 2 (KV head 0)
    ours = _call(q, kv, q_lens, ctx, tables, block_size, -1)
    ref = _reference(q, kv, q_lens, ctx, tables, block_size, -1)
    assert torch.equal(torch.isnan(ours), torch.isnan(ref))
    assert torch.isnan(ours[10, 2]).all() and torch.isnan(ours[40, 4:]).all()  # the decode sees the NaN key
    assert not torch.isnan(ours[41]).any() and not torch.isnan(ours[:10]).any()


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("amx", [True, False])
def test_huge_finite_scores_match_the_reference(dtype, amx):
    """Query rows scaled by 1e10 to 1e30 (finite in bf16 and fp32, scores up to ~1e31) give
    what the float64 reference gives (softmax nearly one-hot), not NaN: the exponent's argument
    must not exceed the lazy max's bound by the rounding of a huge scaled score. On the tile
    path and on the pair path, in a prefill tile and a decode."""
    if amx and not (dtype == torch.bfloat16 and torch.ops.kvmesh.built_with_amx()):
        pytest.skip("the AMX tile path serves bf16 on AMX builds only")
    torch.ops.kvmesh.set_amx(amx)
    try:
        block_size, heads, kv_heads, d = 16, 8, 2, 64
        kv = _pool(20, kv_heads, block_size, d, dtype, seed=8)
        q_lens, ctx, tables = [70, 1], [0, 40], [[0, 1, 2, 3, 4], [5, 6, 7]]
        q = torch.randn(sum(q_lens), heads, d, generator=torch.Generator().manual_seed(9))
        q[12, 1] *= 1e10
        q[30, 5] *= 1e30
        q[70, 3] *= 1e20
        q = q.to(dtype)
        ours = _call(q, kv, q_lens, ctx, tables, block_size, -1).double()
        ref = _reference(q, kv, q_lens, ctx, tables, block_size, -1)
        assert not torch.isnan(ours).any()
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert (ours - ref).abs().max().item() < tol
    finally:
        torch.ops.kvmesh.set_amx(True)


@needs_kernel
def test_rejects_inconsistent_arguments():
    kv = _pool(8, 2, 16, 64, torch.float32, seed=0)
    q = torch.randn(5, 8, 64)
    with pytest.raises(RuntimeError, match="block table too short"):
        _call(q, kv, [5], [20], [[1]], 16, -1)
    with pytest.raises(RuntimeError, match="block id out of range"):
        _call(q, kv, [5], [0], [[8]], 16, -1)
    with pytest.raises(RuntimeError, match="block_size"):
        _call(q, kv, [5], [0], [[1]], 32, -1)
    with pytest.raises(RuntimeError, match="query_start"):
        _call(q, kv, [4], [0], [[1]], 16, -1)


def _status_in_subprocess(env: dict) -> str:
    code = "from kvmesh.workers import attn_kernel; print(attn_kernel.status())"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                         check=True, timeout=120)
    return out.stdout.strip()


def test_env_var_forces_torch_attention():
    assert _status_in_subprocess({"KVMESH_ATTN": "torch"}) == "disabled by KVMESH_ATTN=torch"


def test_library_from_another_source_is_not_loaded(tmp_path):
    (tmp_path / "stamp.json").write_text(json.dumps({"source_sha256": "0" * 64, "torch": torch.__version__}))
    (tmp_path / "kvmesh_paged_attention.so").write_bytes(b"not a library")
    status = _status_in_subprocess({"KVMESH_EXT_DIR": str(tmp_path), "KVMESH_ATTN": ""})
    assert status.startswith("built for another source") and "--build" in status, status


def test_only_instruction_set_flags_decide_whether_a_build_runs_here(tmp_path):
    """A build stamped on a CPU whose extra flags name no instructions (a VM's ``hypervisor``)
    is still loaded; one from a CPU with an extension this one lacks is not."""
    here = attn_kernel._cpu_flags()
    stamp = dict(attn_kernel._stamp(), cpu_flags=here + ["hypervisor", "tsc_known_freq"])
    (tmp_path / "stamp.json").write_text(json.dumps(stamp))
    (tmp_path / "kvmesh_paged_attention.so").write_bytes(b"not a library")
    status = _status_in_subprocess({"KVMESH_EXT_DIR": str(tmp_path), "KVMESH_ATTN": ""})
    assert status.startswith("load failed"), status  # got past the flag check to the (bad) library
    stamp["cpu_flags"] = here + ["avx512_not_on_this_cpu"]
    (tmp_path / "stamp.json").write_text(json.dumps(stamp))
    status = _status_in_subprocess({"KVMESH_EXT_DIR": str(tmp_path), "KVMESH_ATTN": ""})
    assert "lacks" in status and "avx512_not_on_this_cpu" in status, status


def test_broken_library_falls_back(tmp_path):
    """A library whose stamp matches but that cannot be loaded leaves the kernel off."""
    stamp = dict(attn_kernel._stamp(), cpu_flags=[])
    (tmp_path / "stamp.json").write_text(json.dumps(stamp))
    (tmp_path / "kvmesh_paged_attention.so").write_bytes(b"not a library")
    status = _status_in_subprocess({"KVMESH_EXT_DIR": str(tmp_path), "KVMESH_ATTN": ""})
    assert status.startswith("load failed"), status


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,window", [(8, 2, -1), (4, 2, 33), (8, 8, -1), (6, 1, -1)])
def test_rows_are_bit_identical_whatever_the_chunking(dtype, heads, kv_heads, window):
    """Micro-tiles with few rows (decodes, short chunks, a long chunk's last rows) take the
    kernel's key-lane path, full ones the row-lane path; every row must come out bit for bit
    the same whichever computed it: the prompt computed in one call, then as chunks of 1, 2,
    3, 5 and 7 positions after its own cached prefix."""
    block_size, d, n = 16, 64, 77
    kv = _pool(64, kv_heads, block_size, d, dtype, seed=7)
    table = list(range(3, 3 + -(-n // block_size)))
    q = torch.randn(n, heads, d, generator=torch.Generator().manual_seed(8)).to(dtype)
    cold = _call(q, kv, [n], [0], [table], block_size, window)
    for step in (1, 2, 3, 5, 7):
        for start in range(0, n, step):
            stop = min(n, start + step)
            part = _call(q[start:stop], kv, [stop - start], [start], [table], block_size, window)
            assert torch.equal(part, cold[start:stop]), (step, start)


@needs_kernel
def test_fused_rms_norm_and_rope_match_torch():
    """The bf16 forward's fused ops against the torch ops they replace: RMSNorm with the same
    roundings (float32 statistic, bf16 normalized value, bf16 product), RoPE within one bf16
    rounding of the float32 result (torch rounds x * cos first, the fused op once)."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(11)
    x = (torch.randn(300, 512, generator=g) * 3).bfloat16()
    w = (torch.rand(512, generator=g) + 0.5).bfloat16()
    ref = w * F.rms_norm(x.float(), (512,), None, 1e-5).to(torch.bfloat16)
    out = torch.ops.kvmesh.rms_norm_bf16(x, w, 1e-5)
    ulp = ref.float().abs() * 2.0 ** -7
    assert ((out.float() - ref.float()).abs() <= ulp).all()
    # rows of ones normalize to exactly 1.0, so the output is the weight, bit for bit: denormal
    # weights included (a rounding instruction that flushes denormals would give 0 there)
    tiny = torch.full((512,), 3e-39).bfloat16()
    assert tiny.float().abs().min() > 0 and tiny.float().abs().max() < torch.finfo(torch.float32).tiny
    assert torch.equal(torch.ops.kvmesh.rms_norm_bf16(torch.ones(3, 512).bfloat16(), tiny, 1e-5)[2], tiny)

    qkv = torch.randn(37, 12, 64, generator=g).bfloat16()  # rope on the first 10 heads, as q and k
    cos, sin = torch.randn(37, 1, 64, generator=g).bfloat16(), torch.randn(37, 1, 64, generator=g).bfloat16()
    x = qkv[:, :10]
    rot = torch.cat((-x[..., 32:], x[..., :32]), dim=-1)
    exact = x.float() * cos.float() + rot.float() * sin.float()
    before = qkv[:, 10:].clone()
    torch.ops.kvmesh.rope_bf16_(x, cos, sin)
    assert torch.equal(qkv[:, :10], exact.to(torch.bfloat16))  # one rounding of the fp32 result
    assert torch.equal(qkv[:, 10:], before)  # v untouched


@needs_kernel
def test_fused_residual_add_and_norm_equal_the_separate_ops():
    """``add_rms_norm_bf16(x, y, w)`` gives ``x + y`` (torch's bf16 add) and
    ``rms_norm_bf16(x + y, w)`` bit for bit, and the model's bf16 kernel path with it
    (``fuse_residual_norm``) gives the same logits as without, bit for bit."""
    g = torch.Generator().manual_seed(13)
    for h in (512, 70):  # a multiple of 16 and a tail
        x = (torch.randn(33, h, generator=g) * 3).bfloat16()
        y = (torch.randn(33, h, generator=g) * 3).bfloat16()
        w = (torch.rand(h, generator=g) + 0.5).bfloat16()
        s, n = torch.ops.kvmesh.add_rms_norm_bf16(x, y, w, 1e-5)
        assert torch.equal(s, x + y)
        assert torch.equal(n, torch.ops.kvmesh.rms_norm_bf16(x + y, w, 1e-5))
    with pytest.raises(RuntimeError, match=r"y must be bf16 of x's shape BFloat16 \[33, 70\], got BFloat16 \[33, 5\]"):
        torch.ops.kvmesh.add_rms_norm_bf16(x, y[:, :5], w, 1e-5)

    from kvmesh.bench.peer_engine import model_config
    from kvmesh.workers.model import AttentionMetadata, DecoderModel, allocate_kv_cache

    cfg = model_config()
    model = DecoderModel(cfg).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.05, generator=g)
    kv = allocate_kv_cache(cfg, 64, 32)
    meta = AttentionMetadata.build([100, 1, 37], [0, 60, 20], [list(range(0, 4)), list(range(4, 6)), list(range(6, 8))], 32)
    ids = torch.randint(0, cfg.vocab_size, (meta.num_tokens,), generator=g)
    logits = {}
    with torch.inference_mode():
        for fuse in (True, False):
            model.fuse_residual_norm = fuse
            logits[fuse] = model(ids, meta.positions(), meta, kv, torch.arange(meta.num_tokens))
    assert torch.equal(logits[True], logits[False])


@needs_kernel
def test_fused_silu_mul_matches_torch():
    """SwiGLU's fused activation against torch's bf16 ``silu_`` then ``mul_`` (two roundings):
    the products agree within one bf16 rounding (the fused op's e^-g is its own polynomial,
    not torch's), mostly exactly, over the range a projection gives; a strided [T, 2I] view
    (gate then up) is read as it is; NaN stays NaN."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(12)
    for i in (1376, 37):  # a multiple of 16 and a tail
        gu = (torch.randn(61, 2 * i, generator=g) * 4).bfloat16()
        gu[0, 0] = math.nan
        ref = F.silu(gu[:, :i].clone()).mul_(gu[:, i:])
        out = torch.ops.kvmesh.silu_mul_bf16(gu)
        assert out.shape == (61, i) and out.dtype == torch.bfloat16
        assert torch.isnan(out[0, 0]) and torch.equal(torch.isnan(out), torch.isnan(ref))
        r, o = ref.float().nan_to_num(), out.float().nan_to_num()
        assert ((o - r).abs() <= r.abs() * 2.0 ** -7 + 1e-30).all()
        assert (o == r).float().mean() > 0.99
        wide = torch.cat([gu, gu[:, :8]], dim=1)[:, : 2 * i]  # row stride 2i + 8: not contiguous
        assert torch.equal(torch.ops.kvmesh.silu_mul_bf16(wide).nan_to_num(), out.nan_to_num())
    # extreme gates, in the vector loop (16 of them) and in the scalar tail (17th)
    gates = torch.tensor([-88.0, -100.0, -1e30, -3e38, -math.inf, 88.0, 1e30, math.inf, 0.0, -0.0, 1e-38, -1e-38,
                          -87.0, -60.0, 3.0, -3.0, -3e38]).bfloat16()
    ref = F.silu(gates.float()).bfloat16()  # up = 1: the product is the activation
    out = torch.ops.kvmesh.silu_mul_bf16(torch.cat([gates, torch.ones_like(gates)])[None])[0]
    assert torch.equal(torch.isnan(out), torch.isnan(ref)), (out, ref)
    r, o = ref.float().nan_to_num(posinf=1e38), out.float().nan_to_num(posinf=1e38)
    assert ((o - r).abs() <= r.abs() * 2.0 ** -7).all(), (out, ref)
    with pytest.raises(RuntimeError, match=r"bf16 \[T, 2I\], got BFloat16 \[4, 7\]"):
        torch.ops.kvmesh.silu_mul_bf16(torch.zeros(4, 7, dtype=torch.bfloat16))


@pytest.mark.skipif(attn_kernel.get() is None or not torch.ops.kvmesh.built_with_amx(),
                    reason="the kernel was not built with AMX here")
@pytest.mark.parametrize("amx", [True, False])
@pytest.mark.parametrize("d", [64, 32, 128])
def test_amx_and_vector_paths_match_reference_and_keep_bit_identity(amx, d):
    """On an AMX build both bf16 paths stay right: the tile path (the default where the OS
    grants the tiles; head_dim 32 and 64 keep O^T in tile registers, 128 passes half of it
    through memory) and the AVX512_BF16 pair path it replaces
    (``set_amx(False)``), against the float64 reference over ragged batches with a sliding
    window, and cold rows against the same rows as chunks and as decodes, bit for bit."""
    assert torch.ops.kvmesh.set_amx(amx) == amx
    try:
        block_size, heads, kv_heads = 16, 8, 2
        kv = _pool(160, kv_heads, block_size, d, torch.bfloat16, seed=4)
        q_lens, ctx = [300, 1, 130, 1, 20], [0, 77, 170, 250, 35]
        tables, nxt = [], 1
        for q_len, c in zip(q_lens, ctx):
            n = -(-(q_len + c) // block_size)
            tables.append(list(range(nxt + n - 1, nxt - 1, -1)))
            nxt += n
        q = torch.randn(sum(q_lens), heads, d, generator=torch.Generator().manual_seed(5)).bfloat16()
        for window in (-1, 100):
            ours = _call(q, kv, q_lens, ctx, tables, block_size, window).double()
            ref = _reference(q, kv, q_lens, ctx, tables, block_size, window)
            # within one bf16 step of the output (|out| < 4 here: 2^-6) plus the rounding of P
            assert ((ours - ref).abs() <= 2.0 ** -7 * ref.abs().clamp(min=1.0) + 2e-3).all()
        table, n = tables[0], q_lens[0]
        cold = _call(q[:n], kv, [n], [0], [table], block_size, -1)
        for start, stop in ((0, 1), (1, 17), (17, 150), (150, 151), (151, 300)):
            part = _call(q[start:stop], kv, [stop - start], [start], [table], block_size, -1)
            assert torch.equal(part, cold[start:stop]), (start, stop)
    finally:
        torch.ops.kvmesh.set_amx(True)


@needs_kernel
def test_described_path_is_the_one_taken():
    """The worker's start line names the path its dtypes and shapes take, not everything the
    library can do: AMX only for bf16 with head_dim % 32 == 0 and block_size % 16 == 0,
    torch's SDPA for float16."""
    bf16, f32 = torch.bfloat16, torch.float32
    amx = torch.ops.kvmesh.amx_active()
    pairs = torch.ops.kvmesh.built_with_avx512_bf16()
    assert attn_kernel.describe_path(bf16, bf16, 64, 32) == (
        "C++ kernel (AMX tiles)" if amx else "C++ kernel (AVX512_BF16 pairs)" if pairs else
        attn_kernel.describe_path(f32, bf16, 64, 32))
    assert "AMX" not in attn_kernel.describe_path(bf16, bf16, 64, 8)
    assert "AMX" not in attn_kernel.describe_path(bf16, bf16, 80, 32)
    assert attn_kernel.describe_path(f32, bf16, 64, 32).startswith("C++ kernel (fp32 ")
    assert attn_kernel.describe_path(torch.float16, torch.float16, 64, 32).startswith("torch SDPA (")


@needs_kernel
def test_fused_rope_refuses_bad_arguments():
    x = torch.zeros(4, 2, 16, dtype=torch.bfloat16)
    cs = torch.ones(4, 1, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="share memory"):
        torch.ops.kvmesh.rope_bf16_(torch.ones(1, 1, 16, dtype=torch.bfloat16).expand(4, 2, 16), cs, cs)
    with pytest.raises(RuntimeError, match="even for rotate-half RoPE, got 15"):
        torch.ops.kvmesh.rope_bf16_(torch.zeros(4, 2, 15, dtype=torch.bfloat16), cs[..., :15], cs[..., :15])
    with pytest.raises(RuntimeError, match=r"\[T, D\] or \[T, 1, D\] with T = 4 and D = 16, got BFloat16 \[4, 2, 8\]"):
        torch.ops.kvmesh.rope_bf16_(x, torch.ones(4, 2, 8, dtype=torch.bfloat16), cs)
    empty = torch.zeros(0, 2, 16, dtype=torch.bfloat16)
    torch.ops.kvmesh.rope_bf16_(empty, cs[:0], cs[:0])  # nothing to do, no error
    assert empty.shape == (0, 2, 16)


_PORTABLE_CHECK = r"""
import os, sys
os.environ["KVMESH_ATTN"] = "torch"  # the test module must not load the set-up's own build
import torch
from torch.utils import cpp_extension
root, out, march = sys.argv[1], sys.argv[2], sys.argv[3]
cpp_extension.load(name="kvmesh_paged_attention_portable", sources=[os.path.join(root, "workers", "paged_attention.cpp")],
                   extra_cflags=["-O2", "-march=" + march, "-ffp-contract=off", "-fopenmp"], extra_ldflags=["-fopenmp"],
                   build_directory=out, is_python_module=False)
assert not torch.ops.kvmesh.built_with_avx512() and not torch.ops.kvmesh.built_with_avx512_bf16()
assert not torch.ops.kvmesh.built_with_amx()
assert torch.ops.kvmesh.built_with_avx2() == (march == "x86-64-v3")
sys.path.insert(0, root)
import tests.test_attn_kernel as T
from kvmesh.workers import attn_kernel
attn_kernel.get = lambda: torch.ops.kvmesh.paged_attention
for dtype in (torch.float32, torch.bfloat16):
    for window in (-1, 100):
        T.test_long_sequences_match_reference(dtype, window)
    for args in [(16, -1, 8, 2), (32, 40, 8, 1), (4, -1, 4, 4)]:
        T.test_cold_and_cached_positions_are_bit_identical(dtype, *args)
    for args in [(8, 2, -1), (6, 1, -1)]:
        T.test_rows_are_bit_identical_whatever_the_chunking(dtype, *args)
    T.test_nan_propagates_as_in_the_reference(dtype)
T.test_fused_rms_norm_and_rope_match_torch()
T.test_fused_silu_mul_matches_torch()
T.test_fused_residual_add_and_norm_equal_the_separate_ops()
T.test_fused_rope_refuses_bad_arguments()
print("portable build ok")
"""


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return {w for line in f if line.startswith("flags") for w in line.split(":", 1)[1].split()}
    except OSError:
        return set()


# what -march=x86-64-v3 code may use beyond baseline x86-64 (the flags /proc/cpuinfo names)
_V3_FLAGS = {"avx", "avx2", "fma", "bmi1", "bmi2", "f16c", "movbe", "abm"}


_MARCHES = ("x86-64-v3", "x86-64")


def _setup_build_is_v3() -> bool:
    """The set-up's own build (the one every other test here checks) is already the
    AVX2 + FMA code without AVX-512, i.e. what an x86-64-v3 build compiles: building that
    again adds no coverage, only a minute or more of compiling."""
    return attn_kernel.get() is not None and torch.ops.kvmesh.built_with_avx2() \
        and not torch.ops.kvmesh.built_with_avx512() and not torch.ops.kvmesh.built_with_amx()


@pytest.fixture(scope="module")
def portable_builds(tmp_path_factory):
    """Both portable builds and their checks, started at once as two processes (each compile
    is single-threaded, so on two cores the pair takes about as long as one); each test
    waits for its own. Output goes to files, so that neither process blocks on a full pipe."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runs = {}
    for march in _MARCHES:
        if march == "x86-64-v3" and (not _V3_FLAGS <= _cpu_flags() or _setup_build_is_v3()):
            continue  # the test skips it, or checks the set-up's build
        out = tmp_path_factory.mktemp(march)
        log = open(out / "log.txt", "w+")
        proc = subprocess.Popen([sys.executable, "-c", _PORTABLE_CHECK, root, str(out), march],
                                stdout=log, stderr=subprocess.STDOUT, text=True)
        runs[march] = (proc, log)
    yield runs
    for proc, log in runs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


@pytest.mark.slow
@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the portable builds are x86-64 code")
@pytest.mark.parametrize("march", _MARCHES)
def test_build_without_avx512_is_correct_too(portable_builds, march):
    """The kernel's code for CPUs without AVX-512 and no bf16 pair products: built for
    x86-64-v3 (the AVX2 + FMA steps) and for baseline x86-64 (the portable scalar steps), each
    checked with the same tests: against the float64 reference, cold vs cached
    bit-identity, chunking, and the fused ops. In a separate process: one process can hold
    one build of the ``kvmesh`` operator namespace."""
    if march == "x86-64-v3" and not _V3_FLAGS <= _cpu_flags():
        pytest.skip(f"this CPU lacks {sorted(_V3_FLAGS - _cpu_flags())}, which x86-64-v3 code may use")
    if march == "x86-64-v3" and _setup_build_is_v3():
        pytest.skip("the set-up's own build is this code (AVX2 + FMA, no AVX-512): the module's other tests check it")
    proc, log = portable_builds[march]
    rc = proc.wait(timeout=900)
    log.seek(0)
    text = log.read()
    assert rc == 0 and "portable build ok" in text, text[-6000:]


@pytest.mark.parametrize("args,word", [(["--rounds", "0"], "--rounds"), (["--block-size", "0"], "--block-size"),
                                       (["--compute-dtypes", "float16"], "float32 or bfloat16")])
def test_bench_refuses_bad_arguments(capsys, args, word):
    """`bench.attn_kernel` answers a bad flag with usage and the flag, before any work."""
    from kvmesh.bench import attn_kernel as bench

    with pytest.raises(SystemExit) as exc:
        bench.main(args)
    assert exc.value.code == 2 and word in capsys.readouterr().err
