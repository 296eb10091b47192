"""Forward passes in another dtype than the checkpoint's: float32 compute over a bf16 pool.

A bfloat16 checkpoint on a CPU runs its forward in float32 by default (``auto``, see
`workers.model_identity.resolve_compute_dtype`: a cached prefix must give the cold run's
tokens) while the KV pool stays bfloat16. Checked:
the choice itself, that cached prefixes give the cold run's tokens and logits, that the pool
and the namespace follow, and that a router matches tagged workers to its checkpoint.
"""
from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from kvmesh.services.membership import Compatibility
from kvmesh.workers import model_identity
from kvmesh.workers.config import ModelConfig
from kvmesh.workers.engine import Engine
from kvmesh.workers.loader import save_tiny_checkpoint
from kvmesh.workers.model_identity import base_model_id, kv_model_id, resolve_compute_dtype
from kvmesh.workers.request import SamplingParams


def test_resolve_compute_dtype(monkeypatch):
    # whatever the CPU measures or has, a 16-bit checkpoint computes in float32 on a CPU by
    # default: a 16-bit GEMM's rounding depends on the rows per call, so a prefix hit would
    # not give the cold run's tokens (test_auto_cached_prefixes_equal_cold_runs)
    probed = []
    monkeypatch.setattr(model_identity, "cpu_gemm_seconds", lambda dtype: probed.append(dtype) or (0.1, 1.0))
    for amx in (False, True):
        monkeypatch.setattr(model_identity, "cpu_has_amx", lambda amx=amx: amx)
        assert resolve_compute_dtype("auto", "bfloat16", "cpu") == "float32"
        assert resolve_compute_dtype("auto", "float16", "cpu") == "float32"
    assert probed == []  # nothing is measured to decide
    assert resolve_compute_dtype("auto", "float32", "cpu") == "float32"
    assert resolve_compute_dtype("auto", "bfloat16", "cuda:0") == "bfloat16"
    assert resolve_compute_dtype("model", "bfloat16", "cpu") == "bfloat16"
    assert resolve_compute_dtype("bf16", "float32", "cpu") == "bfloat16"
    for bad in ("int8", "fp8", "", "float64"):
        with pytest.raises(ValueError, match="compute dtype"):
            resolve_compute_dtype(bad, "bfloat16", "cpu")


def test_gemm_probe_measures_both_dtypes_once():
    import threading

    model_identity._probe_cache.pop("bfloat16", None)
    before = threading.active_count()
    low, f32 = model_identity.cpu_gemm_seconds("bfloat16")
    assert 0 < low < 1 and 0 < f32 < 1
    assert model_identity.cpu_gemm_seconds("bfloat16") == (low, f32)  # cached: the choice cannot flip
    assert threading.active_count() == before  # measured on a thread that is gone


def test_kv_model_id_tags_only_a_different_compute_dtype():
    assert kv_model_id("m@1", "bfloat16", "bfloat16") == "m@1"
    tagged = kv_model_id("m@1", "bfloat16", "float32")
    assert tagged != "m@1" and "float32" in tagged and base_model_id(tagged) == "m@1"
    assert base_model_id("m@1") == "m@1"


@pytest.fixture(scope="module")
def bf16_ckpt(tmp_path_factory):
    cfg = dataclasses.replace(ModelConfig.tiny(), dtype="bfloat16", num_hidden_layers=2)
    return save_tiny_checkpoint(str(tmp_path_factory.mktemp("bf16")), cfg, seed=3)


def _engine(ckpt: str, compute: str) -> Engine:
    return Engine(model_dir=ckpt, block_size=16, num_blocks=256, max_num_batched_tokens=512,
                  compute_dtype=compute).start()


def test_auto_cached_prefixes_equal_cold_runs(tmp_path):
    """The default (``auto``) on a bf16 checkpoint, one request at a time: a prompt run after
    another request cached its prefix (that request had another suffix, so another prefill
    length) gives the tokens of the same prompt on a cleared cache, for 24 prompts of 24
    greedy tokens each (whole and partial last blocks, prefixes of 16-200 tokens). In
    bfloat16 compute 5 of 30 such prompts differed: a 16-bit GEMM rounds a row differently
    with the rows per call, and a hit computes only the uncached suffix."""
    import random

    ckpt = save_tiny_checkpoint(str(tmp_path / "bf16"), dataclasses.replace(ModelConfig.tiny(), dtype="bfloat16"),
                                seed=0)
    eng = Engine(model_dir=ckpt, block_size=16, num_blocks=512, max_num_batched_tokens=1024).start()
    try:
        assert eng.compute_dtype == "float32" and eng.kv_cache.dtype == torch.bfloat16
        differ = []
        for seed in range(24):
            rng = random.Random(seed)
            prefix = [rng.randrange(256) for _ in range(rng.randrange(16, 200))]
            prompt = prefix + [rng.randrange(256) for _ in range(rng.randrange(1, 40))]
            other = prefix + [rng.randrange(256) for _ in range(rng.randrange(1, 300))]
            sp = SamplingParams(max_tokens=24, ignore_eos=True)
            eng.clear_cache()
            cold = eng.generate(prompt, sp)
            eng.clear_cache()
            eng.generate(other, SamplingParams(max_tokens=1))
            hit = eng.generate(prompt, sp)
            assert cold["usage"]["cached_tokens"] == 0 and hit["usage"]["cached_tokens"] >= len(prefix) // 16 * 16
            if hit["token_ids"] != cold["token_ids"]:
                differ.append(seed)
        assert differ == [], f"cached prefixes changed the greedy output of prompts {differ}"
    finally:
        eng.stop()


@pytest.mark.parametrize("compute", ["float32", "auto"])
def test_cached_prefix_equals_cold_run(bf16_ckpt, compute):
    """Same prompt cold, then after a prefix hit (same engine), then on a fresh engine:
    identical tokens and logits rows within float rounding of the last step's chunking."""
    eng = _engine(bf16_ckpt, compute)
    cold_eng = _engine(bf16_ckpt, compute)
    try:
        assert eng.kv_cache.dtype == torch.bfloat16  # the pool keeps the checkpoint's dtype
        assert eng.model.lm_head.weight.dtype == torch.float32
        assert eng.kv_model_id != eng.config.model_id  # tagged: the namespace follows the compute dtype
        rows: dict[int, list[torch.Tensor]] = {id(eng): [], id(cold_eng): []}
        for e in (eng, cold_eng):
            e.logits_hook = lambda rid, row, e=e: rows[id(e)].append(row.clone())
        g = torch.Generator().manual_seed(5)
        prefix = torch.randint(0, 256, (80,), generator=g).tolist()
        sp = SamplingParams(max_tokens=6, temperature=0.0)
        eng.generate(prefix + [1, 2, 3], sp)  # fills the cache with the prefix's blocks
        hit = eng.generate(prefix + [7, 8, 9, 10], sp)
        cold = cold_eng.generate(prefix + [7, 8, 9, 10], sp)
        assert hit["usage"]["cached_tokens"] == 80 and cold["usage"]["cached_tokens"] == 0
        assert hit["token_ids"] == cold["token_ids"]
        # the hit's rows against the cold run's: K/V of the cold prefill were rounded to the pool's
        # dtype exactly as the hit reads them back, so only summation order differs
        diff = (torch.stack(rows[id(eng)][-6:]) - torch.stack(rows[id(cold_eng)])).abs().max().item()
        print("max |logit diff|", diff)
        assert diff < 1e-4
    finally:
        eng.stop()
        cold_eng.stop()


def test_router_matches_tagged_workers_to_its_checkpoint(caplog):
    tagged = kv_model_id("m", "bfloat16", "float32")

    def lease(model):
        return {"model_id": model, "block_size": 16}

    sel = Compatibility("m").select({"a": lease(tagged), "b": lease(tagged)})
    assert set(sel.workers) == {"a", "b"} and sel.model_id == tagged  # hashes under the tagged id
    with caplog.at_level(logging.ERROR, logger="kvmesh.services.membership"):
        sel = Compatibility("m").select({"a": lease(tagged), "b": lease(tagged), "c": lease("m"),
                                         "d": lease("other")})
    assert set(sel.workers) == {"a", "b"} and sel.model_id == tagged
    lines = [r.getMessage() for r in caplog.records]
    assert any("worker c" in m and "--compute-dtype" in m for m in lines)
    assert any("worker d" in m and "--model" in m for m in lines)
    sel = Compatibility(None).select({"a": lease(tagged), "c": lease("m"), "e": lease("m")})
    assert set(sel.workers) == {"c", "e"} and sel.model_id == "m"


def test_router_with_the_checkpoint_serves_text_through_tagged_workers(bf16_ckpt, tmp_path):
    """Real redis-server, worker and router processes on one bf16 checkpoint: the worker
    computes in float32 and advertises the tagged id; a router started with the same
    ``--model`` tokenizes text, hashes under the tagged id and routes to it (prefix hit on
    the second request, same tokens as the first). A second worker with another block size
    is routed around, and `kvmesh status` says so and why."""
    import time

    from kvmesh.services.ops_cli import router_status, status_table
    from kvmesh.services.client import KvmeshClient
    from kvmesh.services.procs import RedisServer, free_port, python_cmd, spawn, stop_process, wait_healthy

    redis = RedisServer()
    procs = []
    try:
        waddr, raddr = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        procs.append(spawn(python_cmd("worker", "--port", waddr.rsplit(":", 1)[1], "--worker-id", "w0", "--threads",
                                      "1", "--model", bf16_ckpt, "--compute-dtype", "float32", "--num-blocks", "128",
                                      "--redis-url", redis.url, "--cluster", "cd"), str(tmp_path / "w0.log")))
        wait_healthy(waddr, proc=procs[-1])
        w1addr = f"127.0.0.1:{free_port()}"
        procs.append(spawn(python_cmd("worker", "--port", w1addr.rsplit(":", 1)[1], "--worker-id", "w1", "--threads",
                                      "1", "--model", bf16_ckpt, "--compute-dtype", "float32", "--num-blocks", "64",
                                      "--block-size", "32", "--redis-url", redis.url, "--cluster", "cd"),
                           str(tmp_path / "w1.log")))
        wait_healthy(w1addr, proc=procs[-1])
        procs.append(spawn(python_cmd("router", "--port", raddr.rsplit(":", 1)[1], "--model", bf16_ckpt,
                                      "--redis-url", redis.url, "--cluster", "cd"), str(tmp_path / "router.log")))
        wait_healthy(raddr, proc=procs[-1])
        deadline = time.monotonic() + 60
        while len((status := router_status(raddr))["workers"]) < 2:
            assert time.monotonic() < deadline, status
            time.sleep(0.2)
        by_id = {w["worker_id"]: w for w in status["workers"]}
        assert by_id["w0"]["routed_around"] == "" and by_id["w0"]["block_size"] == 16
        assert by_id["w0"]["model_id"].endswith("+compute=float32")
        assert "--block-size 16" in by_id["w1"]["routed_around"] and by_id["w1"]["block_size"] == 32
        assert "not routing to w1" in status_table(status)
        prompt = "A shared system prompt long enough for several sixteen-token blocks of bytes. Question: 1"
        with KvmeshClient(raddr, backoff_s=0.2, retries=20) as c:
            first = c.generate(prompt, max_tokens=4, temperature=0.0, timeout=60)
            again = c.generate(prompt, max_tokens=4, temperature=0.0, timeout=60)
        assert first.worker_id == again.worker_id == "w0"
        assert again.usage.cached_tokens >= 16 * ((again.usage.prompt_tokens - 1) // 16) > 0
        assert again.token_ids == first.token_ids
    finally:
        for p in procs:
            stop_process(p)
        redis.stop()


def test_router_keeps_the_tagged_id_in_use_on_a_tie():
    """Two float32 workers serve; two bf16-computing workers join: the router keeps hashing
    under the id in use (its workers' caches stay warm) instead of flipping on the tie."""
    tagged = kv_model_id("m", "bfloat16", "float32")
    compat = Compatibility("m")
    lease = lambda model: {"model_id": model, "block_size": 16}  # noqa: E731
    assert compat.select({"a": lease(tagged), "b": lease(tagged)}).model_id == tagged
    sel = compat.select({"a": lease(tagged), "b": lease(tagged), "c": lease("m"), "d": lease("m")})
    assert sel.model_id == tagged and set(sel.workers) == {"a", "b"}
    # a majority still decides
    sel = compat.select({"a": lease(tagged), "c": lease("m"), "d": lease("m")})
    assert sel.model_id == "m" and set(sel.workers) == {"c", "d"}


@pytest.mark.parametrize("compute", ["float32", "model"])
def test_host_and_disk_tier_hits_equal_cold(bf16_ckpt, tmp_path, compute):
    """The bf16 pool's blocks go down to the host tier and disk and come back into an engine
    computing in float32 or in bf16 (the kernel's bf16 pair products and fused ops on CPUs
    that have them): same tokens as a cold run, and the host hit reads back the very bytes a
    device hit reads (identical logits)."""
    from kvmesh.cache_store.tier_store import TierConfig

    eng = Engine(model_dir=bf16_ckpt, block_size=16, num_blocks=64, compute_dtype=compute,
                 tiers=TierConfig(host_bytes=64 << 20, disk_dir=str(tmp_path), disk_bytes=64 << 20,
                                  peer_bytes=0)).start()
    try:
        rows: list[torch.Tensor] = []
        eng.logits_hook = lambda rid, row: rows.append(row.clone())
        sp = SamplingParams(max_tokens=4, temperature=0.0)
        prompt = torch.randint(0, 256, (120,), generator=torch.Generator().manual_seed(9)).tolist()

        def one() -> tuple[dict, list[torch.Tensor]]:
            rows.clear()
            out = eng.generate(prompt, sp)
            return out, list(rows)

        eng.clear_cache()
        cold, cold_rows = one()
        dev, dev_rows = one()
        assert dev["usage"]["cached_tokens_by_tier"]["device"] == 112
        eng.offload_device_cache()
        assert eng.tiers.flush(30)
        host, host_rows = one()
        assert host["usage"]["cached_tokens_by_tier"]["host"] == 112
        assert cold["token_ids"] == dev["token_ids"] == host["token_ids"]
        assert all(torch.equal(a, b) for a, b in zip(host_rows, dev_rows))
        # as in test_cached_prefix_equals_cold_run: only summation order of the chunking differs
        assert max(float((a - b).abs().max()) for a, b in zip(host_rows, cold_rows)) < (
            1e-4 if compute == "float32" else 0.1)
        eng.offload_device_cache()
        eng.drop_host_tier()
        disk, disk_rows = one()
        assert disk["usage"]["cached_tokens_by_tier"]["disk"] == 112
        assert disk["token_ids"] == cold["token_ids"]
        assert all(torch.equal(a, b) for a, b in zip(disk_rows, dev_rows))
    finally:
        eng.stop()


def test_router_keeps_the_block_size_in_use_on_a_tie():
    """A warm worker with block size 16 and one with 32 serve (16 wins the tie, smallest); a
    third joins with 8: the tie now spans three sizes and the size in use stays, so one
    misconfigured worker cannot take the routing from the warm ones. A majority decides."""
    compat = Compatibility("m")
    lease = lambda bs: {"model_id": "m", "block_size": bs}  # noqa: E731
    assert compat.select({"a": lease(16), "b": lease(32)}).block_size == 16
    sel = compat.select({"a": lease(16), "b": lease(32), "c": lease(8)})
    assert sel.block_size == 16 and set(sel.workers) == {"a"}
    assert "--block-size 16" in compat.reason("c") and compat.reason("a") == ""
    sel = compat.select({"a": lease(16), "b": lease(32), "c": lease(8), "d": lease(8)})
    assert sel.block_size == 8 and set(sel.workers) == {"c", "d"}
