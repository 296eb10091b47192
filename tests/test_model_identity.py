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
    assert sel.text_reason == ""
    # no worker of the router's model (nor tokenizer): token ids still go to the workers'
    # model, text is refused with a reason that says what to do
    sel = Compatibility("m2").select({"a": lease()})
    assert set(sel.workers) == {"a"} and sel.model_id == "m" and sel.reason == ""
    assert "--model" in sel.text_reason and "token_ids" in sel.text_reason


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


def test_kv_producer_names_the_cpu_thread_count(monkeypatch):
    """torch's CPU GEMMs sum some shapes in a thread-count-dependent order, so workers at
    other --threads compute other KV bits: their producers (and remote namespaces) differ."""
    import torch

    one = model_identity.kv_producer("cpu", "C++ kernel (fp32 avx2)", threads=1)
    two = model_identity.kv_producer("cpu", "C++ kernel (fp32 avx2)", threads=2)
    assert one != two and model_identity.producer_tag(one) != model_identity.producer_tag(two)
    assert "1 thread," in one and "2 threads," in two
    assert two == model_identity.kv_producer("cpu", "C++ kernel (fp32 avx2)", threads=2)
    # by default, torch's thread count when the producer is computed
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert model_identity.kv_producer("cpu", "C++ kernel (fp32 avx2)") == one
        torch.set_num_threads(2)
        assert model_identity.kv_producer("cpu", "C++ kernel (fp32 avx2)") == two
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="threads"):
        model_identity.kv_producer("cpu", "torch SDPA", threads=0)
    # on a GPU the CPU threads compute no KV: the count is left out
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    gpu = model_identity.kv_producer("cuda", "torch SDPA", threads=1)
    assert gpu == model_identity.kv_producer("cuda", "torch SDPA", threads=2)
    assert gpu.startswith("cuda sm90, torch ") and "thread" not in gpu


def test_worker_producer_counts_the_threads_flag():
    """`make_engine` applies --threads before the engine computes its producer."""
    import torch

    from kvmesh.services.cli import build_parser, make_engine

    before = torch.get_num_threads()
    try:
        producers = {}
        for n in (1, 2):
            args = build_parser().parse_args(["worker", "--port", "0", "--threads", str(n), "--num-blocks", "64"])
            producers[n] = make_engine(args).kv_producer
        assert f", 1 thread, torch {torch.__version__}" in producers[1]
        assert f", 2 threads, torch {torch.__version__}" in producers[2]
    finally:
        torch.set_num_threads(before)


def test_a_disk_tier_written_at_another_thread_count_is_not_reused(tmp_path):
    """A worker restarted on its disk folder with the same thread count starts warm; one
    restarted with another count computes the prompt itself: the segments were written by
    another KV producer and are dropped at start."""
    import torch

    from kvmesh.cache_store.tier_config import TierConfig
    from kvmesh.workers.engine import Engine
    from kvmesh.workers.request import SamplingParams

    prompt = [(7 * i + 3) % 256 for i in range(200)]  # 12 full 16-token blocks
    before = torch.get_num_threads()
    from_disk = []
    try:
        for threads in (1, 1, 2):
            torch.set_num_threads(threads)
            e = Engine(num_blocks=64, tiers=TierConfig(host_bytes=8 << 20, disk_dir=str(tmp_path / "disk"),
                                                       disk_bytes=64 << 20, peer_bytes=0, load_policy="always"))
            e.start()
            try:
                out = e.generate(prompt, SamplingParams(max_tokens=1))
                from_disk.append(out["usage"]["cached_tokens_by_tier"].get("disk", 0))
            finally:
                e.stop()  # offloads the prompt's blocks and writes them to disk
    finally:
        torch.set_num_threads(before)
    assert from_disk == [0, 192, 0]
