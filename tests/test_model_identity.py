"""Cache identity: the model id covers every weight byte, the tokenizer and the config, and
a router routes around workers of another model or block size (logging why)."""
from __future__ import annotations

import logging
import os

import pytest

from kvmesh.services.membership import Compatibility
from kvmesh.workers import model_identity
from kvmesh.workers.loader import read_config, save_tiny_checkpoint
from kvmesh.workers.model_identity import checkpoint_fingerprint


@pytest.fixture()
def ckpt(tmp_path, monkeypatch):
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path / "cache"))
    return save_tiny_checkpoint(str(tmp_path / "tiny"), seed=0)


def _flip_byte(path: str, offset: int, keep_mtime: bool = False) -> None:
    st = os.stat(path)
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0x01]))
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_every_weight_byte_counts(ckpt):
    weights = os.path.join(ckpt, "model.safetensors")
    size = os.path.getsize(weights)
    assert size > 3 << 20  # the old recipe sampled only the first and last MiB
    before = checkpoint_fingerprint(ckpt)
    assert before == checkpoint_fingerprint(ckpt)
    _flip_byte(weights, size // 2)  # the middle of the file, outside any sample
    after = checkpoint_fingerprint(ckpt)
    assert after != before
    assert read_config(ckpt).model_id == f"tiny@{after}"


def test_tokenizer_and_config_count(ckpt):
    base = checkpoint_fingerprint(ckpt)
    tok = os.path.join(ckpt, "tokenizer.json")
    with open(tok, "w") as fh:
        fh.write('{"version": "1.0"}')
    with_tok = checkpoint_fingerprint(ckpt)
    assert with_tok != base  # a folder without tokenizer.json never matches one with it
    with open(tok, "w") as fh:
        fh.write('{"version": "1.1"}')
    assert checkpoint_fingerprint(ckpt) not in (base, with_tok)
    os.remove(tok)
    assert checkpoint_fingerprint(ckpt) == base
    cfg = os.path.join(ckpt, "config.json")
    text = open(cfg).read()
    assert '"torch_dtype": "float32"' in text
    with open(cfg, "w") as fh:
        fh.write(text.replace('"torch_dtype": "float32"', '"torch_dtype": "bfloat16"'))
    assert checkpoint_fingerprint(ckpt) != base  # dtype is part of the identity


def test_digest_cache_is_trusted_only_for_an_unchanged_file(ckpt, monkeypatch):
    weights = os.path.join(ckpt, "model.safetensors")
    first = checkpoint_fingerprint(ckpt)
    cache = model_identity._load_cache()
    assert os.path.realpath(weights) in cache
    # an unchanged file: the cached digest is trusted (no re-read at restart)
    real_open = open

    def no_weight_reads(path, *a, **kw):
        assert not str(path).endswith(".safetensors"), "weights read again"
        return real_open(path, *a, **kw)
    monkeypatch.setattr("builtins.open", no_weight_reads)
    assert checkpoint_fingerprint(ckpt) == first
    monkeypatch.undo()
    # new bytes of the same size with the old mtime set back (cp -p, rsync -t): hashed again
    _flip_byte(weights, 100, keep_mtime=True)
    assert checkpoint_fingerprint(ckpt) != first


def lease(model="m", bs=16):
    return {"model_id": model, "block_size": bs, "address": "x:1"}


def test_compatibility_routes_around_other_models_and_block_sizes(caplog):
    compat = Compatibility("m")
    live = {"a": lease(), "b": lease(), "c": lease(bs=32), "d": lease(model="other")}
    with caplog.at_level(logging.ERROR, logger="kvmesh.services.membership"):
        sel = compat.select(live)
        compat.select(live)  # logged once per worker and reason
    assert set(sel.workers) == {"a", "b"} and sel.block_size == 16 and sel.model_id == "m"
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert any("worker c" in m and "--block-size 32" in m and "--block-size 16" in m for m in lines)
    assert any("worker d" in m and "'other'" in m for m in lines)
    # no worker of the router's model: a reason that says what to do
    sel = Compatibility("m2").select({"a": lease()})
    assert not sel.workers and "--model" in sel.reason


def test_router_without_model_follows_the_majority():
    sel = Compatibility(None).select({"a": lease("x"), "b": lease("x"), "c": lease("y", 32)})
    assert set(sel.workers) == {"a", "b"} and sel.model_id == "x"
    # the block size most workers use; the smallest on a tie
    sel = Compatibility(None).select({"a": lease(bs=32), "b": lease(bs=16)})
    assert sel.block_size == 16 and set(sel.workers) == {"b"}


def test_kv_producer_names_device_instruction_set_torch_and_attention():
    import torch

    from kvmesh.workers import model_identity

    p = model_identity.kv_producer("cpu", "C++ kernel (fp32 avx2)")
    # everything that changes the kernels changes the producer; the same inputs give the same one
    assert p == model_identity.kv_producer("cpu", "C++ kernel (fp32 avx2)")
    assert p != model_identity.kv_producer("cpu", "torch SDPA")
    assert p != model_identity.kv_producer("meta", "C++ kernel (fp32 avx2)")
    assert torch.__version__ in p and model_identity.cpu_isa() in p
    assert model_identity.cpu_isa() in ("amx", "avx512bf16", "avx512", "avx2", "base")
    tag = model_identity.producer_tag(p)
    assert len(tag) == 8 and int(tag, 16) >= 0 and tag != model_identity.producer_tag(p + " ")
