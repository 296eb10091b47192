"""KV codecs: exact round trip for ``none``, bounded element error for ``fp8`` and ``int4``,
payload sizes, zero blocks, registry and input checks."""
from __future__ import annotations

import pytest
import torch

from kvmesh.cache_store.kv_codec import CODECS, FP8_E4M3_MAX, KVCodec, make_codec, register_codec

SHAPE = (4, 2, 2, 16, 64)  # the built-in model's block at block_size 16


def blocks(n=3, scale=3.0, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((n, *SHAPE), generator=g) * scale
    x[0, 1, 0, 1] *= 50  # one head with a much larger range
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_none_is_exact(dtype):
    c = make_codec("none", SHAPE, dtype)
    x = blocks(dtype=dtype)
    p = c.encode(x)
    assert p.dtype == torch.uint8 and p.shape == (3, c.payload_bytes) and c.payload_bytes == c.block_bytes
    assert torch.equal(c.decode(p.clone()), x)


def test_fp8_error_bound_per_head():
    c = make_codec("fp8", SHAPE, torch.float32)
    x = blocks()
    y = c.decode(c.encode(x))
    amax = x.abs().amax(dim=(-2, -1), keepdim=True)
    # e4m3: 3 mantissa bits -> relative rounding error <= 2^-4 for normals; subnormal step 2^-9 of the scale
    bound = x.abs() / 16 + amax / FP8_E4M3_MAX * 2.0 ** -10 + 1e-7
    assert bool(((y - x).abs() <= bound).all())
    assert float((y - x).abs().max()) > 0  # it is lossy: the bound is not vacuous


def test_int4_error_bound_per_group():
    c = make_codec("int4", SHAPE, torch.float32)
    x = blocks()
    y = c.decode(c.encode(x))
    g = x.reshape(3, -1, 32)
    scale = g.abs().amax(dim=-1, keepdim=True) / 7
    err = (y.reshape(3, -1, 32) - g).abs()
    assert bool((err <= scale / 2 + 1e-6).all())
    # the error follows the group scale, not the block's largest value
    assert float(err.max()) > float(err.reshape(3, -1).median())


@pytest.mark.parametrize("name", ["fp8", "int4"])
def test_zero_blocks_decode_to_zero(name):
    c = make_codec(name, SHAPE, torch.float32)
    z = torch.zeros((2, *SHAPE))
    assert torch.equal(c.decode(c.encode(z)), z)


def test_payload_sizes_and_ratio():
    numel = 4 * 2 * 2 * 16 * 64
    fp8 = make_codec("fp8", SHAPE, torch.float32)
    int4 = make_codec("int4", SHAPE, torch.float32)
    assert fp8.payload_bytes == 4 * (4 * 2 * 2) + numel
    assert int4.payload_bytes == 4 * (numel // 32) + numel // 2
    assert fp8.payload_bytes < 0.26 * fp8.block_bytes and int4.payload_bytes < 0.16 * int4.block_bytes


def test_bfloat16_pool_roundtrips_through_fp8():
    c = make_codec("fp8", SHAPE, torch.bfloat16)
    x = blocks(dtype=torch.bfloat16)
    y = c.decode(c.encode(x))
    assert y.dtype == torch.bfloat16
    assert float((y.float() - x.float()).abs().max()) <= float(x.float().abs().max()) / 8


def test_registry_and_input_checks():
    with pytest.raises(ValueError, match="fp8.*int4.*none|known"):
        make_codec("zstd", SHAPE, torch.float32)
    with pytest.raises(ValueError, match="block shape"):
        make_codec("none", (4, 3, 2, 16, 64), torch.float32)
    c = make_codec("int4", SHAPE, torch.float32)
    with pytest.raises(ValueError, match="expected blocks"):
        c.encode(torch.zeros(2, 4, 2, 2, 16, 32))
    with pytest.raises(ValueError, match="expected torch.float32"):
        c.encode(torch.zeros((1, *SHAPE), dtype=torch.float16))
    with pytest.raises(ValueError, match="uint8 payload"):
        c.decode(torch.zeros(1, c.payload_bytes + 1, dtype=torch.uint8))

    class Dup(KVCodec):
        name = "fp8"

        def _payload_bytes(self):
            return 1

        def encode(self, blocks):
            return blocks

        def decode(self, payload):
            return payload

    with pytest.raises(ValueError, match="already registered"):
        register_codec(Dup)
    assert CODECS["fp8"].__name__ == "Fp8Codec"


def test_cli_codec_names_are_the_registered_ones():
    """The CLI lists codec names without importing torch; they must match the registry."""
    from kvmesh.cache_store.kv_codec import CODECS
    from kvmesh.cache_store.tier_store import WRITE_MODES
    from kvmesh.services.cli import build_parser

    worker = build_parser()._subparsers._group_actions[0].choices["worker"]
    by_dest = {a.dest: a for a in worker._actions}
    assert set(by_dest["host_codec"].choices) == set(CODECS) == set(by_dest["disk_codec"].choices)
    assert set(by_dest["disk_write_mode"].choices) == set(WRITE_MODES)
