"""Cache-tier benchmark: copy and write rates against raw baselines, codec speed, TTFT by tier.

``python -m bench.tiers --json`` prints one JSON object, every figure measured in this run,
each tier path side by side with its baseline (medians over ``--repeats``):

Each tier path is timed in back-to-back pairs with its baseline (order alternating; 3 x
``--repeats`` pairs for copies, 2 x ``--repeats`` for disk writes): rates are medians, and the
``*_over_*`` ratios are the median of the per-pair ratios, so that a burst of background
load on this shared machine hits both sides of a pair alike. Encode rates are best-of;
TTFTs are medians over ``--rounds`` rounds.

* ``d2h_gbps``: the host tier's device->host copy of ``BLOCKS`` scattered blocks of the
  device pool (slot reservation and the batched gather into the slab:
  ``HostTier.reserve`` + ``HostTier.store``);
  ``offload_gbps``: the same blocks (chains of 16, as the pool evicts them) through the
  whole ``TierStore.offload``: that copy plus the host index and the ``BlockStored``
  events a worker publishes (``offload_over_memcpy``: reported, no target);
  ``raw_memcpy_gbps``: one ``Tensor.copy_`` of the same number of bytes, contiguous.
* ``d2h_large_block_gbps`` / ``raw_memcpy_large_block_gbps`` (and the two ratios): the
  same with Llama-3-8B's 2 MiB blocks (32 of them), where per-block bookkeeping is
  negligible.
* ``h2disk_gbps``: from queued write-through jobs to every segment written, fsynced,
  renamed and indexed (``TierStore.flush``); ``raw_disk_gbps``: the same bytes written
  sequentially to one plain file and fsynced once (the best a single stream of writes
  gets from this disk).
* ``fp8_encode_gbps``, ``int4_encode_gbps``: codec encode throughput over the same blocks
  (input bytes per second).
* ``ttft_cold_ms``, ``ttft_device_ms``, ``ttft_host_ms``, ``ttft_disk_ms``: engine TTFT (median) of a
  2,048-token prompt whose first 1,792 tokens are cached in that tier (cold: nothing
  cached). Before the disk case the segment files are dropped from the page cache
  (``posix_fadvise(DONTNEED)``), so it reads from the disk, not from memory.
* ``ttft_remote_ms`` / ``ttft_remote_cold_ms``: the same prompt on a second engine whose
  only copy of the prefix is in the cluster's remote tier (a private redis-server on
  loopback; the read, verification and staging count in the TTFT), and cold on that engine
  (absent without redis-server; no target). Both engines carry a record key, as the workers
  of ``kvmesh up`` do, so the TTFT includes checking each record's MAC;
  ``remote_fetch_ms`` is the part of that TTFT spent reading the 1,792 tokens from Redis,
  checking and staging them (the tier's measured seconds per block, EWMA);
  ``ttft_remote_cost_ms`` / ``ttft_remote_cost_loaded_tokens`` are the remote case under
  the ``cost`` policy (below); ``remote_mac_gbps`` is that MAC's rate (keyed BLAKE2b over
  one 2 MiB block, bytes per second, best of 5) on this machine's CPU.
* The tier TTFTs above are measured under ``--tier-load-policy always`` (every block found
  is read, whatever it costs). ``ttft_disk_cost_ms`` is the disk case again under ``cost``,
  once the engine has measured both the disk's reads and its own prefill: it loads only
  blocks whose tier reads faster than they compute (docs/TIERS.md), and
  ``ttft_disk_cost_loaded_tokens`` says how many of the 1,792 it read (median). Where the
  prefill is faster than the disk (a GPU with a small model) that is 0 and the TTFT is close
  to cold; on the CPUs measured so far it is 1,792.

Rates are in GB/s (10^9 bytes per second); the ``*_over_*`` fields are the ratios the
targets are stated in, and ``targets`` says which are met (the exit status is 0 either way:
this is a measurement, not a test). ``block_bytes`` / ``large_block_bytes`` are the block
sizes measured and ``copy_bytes`` the bytes per copy (bytes). Everything runs on the
engine's device: on a CPU-only machine "device" memory is host memory too, so
``d2h_gbps`` measures the tier's bookkeeping and gather against a plain memcpy.
``--device cuda`` puts the pool and engine on a GPU: then ``d2h_gbps`` is the tier's
device->host path into its page-locked slab and ``raw_memcpy_gbps`` one copy of the same
bytes from device memory into page-locked host memory.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

PROMPT_TOKENS = 2048
CACHED_TOKENS = 1792
BLOCK_SIZE = 16
BLOCKS = 1024  # blocks per copy/write measurement (64 MiB with the built-in model)

TARGETS = {
    "d2h_over_memcpy": (">=", 0.8),
    "h2disk_over_raw_disk": (">=", 0.7),
    "ttft_device_over_cold": ("<=", 0.2),
    "ttft_host_over_cold": ("<=", 0.3),
    "ttft_disk_over_cold": ("<=", 0.5),
}


def _sync() -> None:
    """Wait for queued CUDA work (copies run asynchronously there); nothing on a CPU-only run."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _timed(fn) -> float:
    _sync()
    t0 = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - t0


def _host_buffers(n: int, dtype, device: str):
    """(src, dst) of ``n`` elements for the memcpy baseline: on a CPU run two host buffers;
    with a GPU the device->host copy the tier makes, device memory into page-locked memory."""
    import torch

    if device == "cpu":
        src = torch.empty(n, dtype=dtype).normal_()
        dst = torch.empty_like(src)
    else:
        src = torch.empty(n, dtype=dtype, device=device).normal_()
        dst = torch.empty(n, dtype=dtype, pin_memory=True)
    dst.copy_(src)
    return src, dst


def bench_copies(repeats: int = 7, blocks: int = BLOCKS, directory: str | None = None, device: str = "cpu") -> dict:
    """d2h vs memcpy, host->disk vs raw file writes, codec encode rates; the pool on ``device``."""
    import torch

    from kvmesh.cache_store.kv_codec import make_codec
    from kvmesh.cache_store.tier_store import TierConfig, TierStore
    from kvmesh.workers.config import ModelConfig
    from kvmesh.workers.model import allocate_kv_cache

    cfg = ModelConfig.tiny()
    pool_blocks = 2 * blocks
    kv = allocate_kv_cache(cfg, pool_blocks, BLOCK_SIZE, device, torch.float32)
    kv.normal_()
    block_bytes = kv[0].numel() * kv.element_size()
    nbytes = blocks * block_bytes
    rng = random.Random(0)
    ids = rng.sample(range(pool_blocks), blocks)
    evicted = _evicted_chains(ids, rng)

    src, dst = _host_buffers(nbytes // 4, torch.float32, device)
    disk_src = dst if device == "cpu" else torch.randn(nbytes // 4)
    events: list = []  # the KV events a worker would publish, built as in a worker
    host_only = TierStore(kv, TierConfig(host_bytes=nbytes, peer_bytes=0), events.append)
    host_only.offload(evicted)  # first touch of the slab pages
    d2h, offload = _copy_and_offload(host_only, evicted, events)
    raw = lambda: _timed(lambda: dst.copy_(src))  # noqa: E731
    t_raw, t_d2h = _paired(raw, d2h, 3 * repeats)
    t_raw_o, t_off = _paired(raw, offload, 3 * repeats)

    own_dir = directory is None
    base = directory or tempfile.mkdtemp(prefix="kvmesh-bench-")
    counter = iter(range(1 << 30))

    def raw_disk() -> float:
        return _raw_file_write(os.path.join(base, f"raw-{next(counter)}.bin"), disk_src.numpy().view("u1"))

    def tier_disk() -> float:
        d = os.path.join(base, f"tier-{next(counter)}")
        store = TierStore(kv, TierConfig(host_bytes=nbytes, disk_dir=d, disk_bytes=2 * nbytes, peer_bytes=0))
        try:
            with store.lock:  # the writer thread cannot take a job before t0
                store.offload(evicted)
                t0 = time.perf_counter()
            if not store.flush(300):
                raise RuntimeError("disk writes did not finish")
            elapsed = time.perf_counter() - t0
            if store.stats()["disk_blocks"] != blocks:
                raise RuntimeError(f"expected {blocks} blocks on disk, got {store.stats()}")
            return elapsed
        finally:
            store.close()
            shutil.rmtree(d, ignore_errors=True)

    try:
        raw_disk_times, disk_times = _paired(raw_disk, tier_disk, 2 * repeats)
    finally:
        if own_dir:
            shutil.rmtree(base, ignore_errors=True)

    sample = kv[torch.tensor(ids[:256])]
    sample_bytes = sample.numel() * sample.element_size()
    codecs = {name: make_codec(name, tuple(kv.shape[1:]), kv.dtype) for name in ("fp8", "int4")}
    for c in codecs.values():
        c.encode(sample)  # first call: kernels load / compile
    enc = {name: min(_timed(lambda c=c: c.encode(sample)) for _ in range(repeats)) for name, c in codecs.items()}
    gb = 1e9
    out = {
        "block_bytes": block_bytes,
        "copy_bytes": nbytes,
        "d2h_gbps": round(nbytes / statistics.median(t_d2h) / gb, 3),
        "raw_memcpy_gbps": round(nbytes / statistics.median(t_raw) / gb, 3),
        "offload_gbps": round(nbytes / statistics.median(t_off) / gb, 3),
        "h2disk_gbps": round(nbytes / statistics.median(disk_times) / gb, 3),
        "raw_disk_gbps": round(nbytes / statistics.median(raw_disk_times) / gb, 3),
        "fp8_encode_gbps": round(sample_bytes / enc["fp8"] / gb, 3),
        "int4_encode_gbps": round(sample_bytes / enc["int4"] / gb, 3),
    }
    out.update(_d2h_large_blocks(repeats, device=device))
    out["d2h_over_memcpy"] = _median_ratio(t_raw, t_d2h)
    out["offload_over_memcpy"] = _median_ratio(t_raw_o, t_off)
    out["h2disk_over_raw_disk"] = _median_ratio(raw_disk_times, disk_times)
    return out


def _evicted_chains(block_ids: list[int], rng: random.Random, chain_blocks: int = 16) -> list:
    """Evicted blocks as the pool reports them: chains of ``chain_blocks`` blocks (256
    tokens, a short prompt), each chain tail first, on scattered pool rows."""
    from kvmesh.cache_store.prefix_cache import EvictedBlock

    out = []
    for c in range(0, len(block_ids), chain_blocks):
        chain, parent = [], None
        for b in block_ids[c:c + chain_blocks]:
            h = rng.randbytes(16)
            chain.append(EvictedBlock(b, h, parent, rng.randbytes(4 * BLOCK_SIZE)))
            parent = h
        out.extend(reversed(chain))
    return out


def _d2h_large_blocks(repeats: int, blocks: int = 32, device: str = "cpu") -> dict:
    """d2h against memcpy with a real model's block: Llama-3-8B (32 layers, 8 KV heads of 128,
    bf16) at block size 16 is 2 MiB per block, so per-block bookkeeping weighs far less than
    with the built-in model's 64 KiB blocks."""
    import torch

    from kvmesh.cache_store.tier_store import TierConfig, TierStore

    kv = torch.empty((2 * blocks, 32, 2, 8, BLOCK_SIZE, 128), dtype=torch.bfloat16, device=device).normal_()
    block_bytes = kv[0].numel() * kv.element_size()
    nbytes = blocks * block_bytes
    rng = random.Random(1)
    evicted = _evicted_chains(rng.sample(range(2 * blocks), blocks), rng)
    events: list = []
    store = TierStore(kv, TierConfig(host_bytes=nbytes, peer_bytes=0), events.append)
    store.offload(evicted)
    src, dst = _host_buffers(nbytes // 2, torch.bfloat16, device)
    d2h, offload = _copy_and_offload(store, evicted, events)
    raw = lambda: _timed(lambda: dst.copy_(src))  # noqa: E731
    t_raw, t_d2h = _paired(raw, d2h, 3 * repeats)
    t_raw_o, t_off = _paired(raw, offload, 3 * repeats)
    return {"large_block_bytes": block_bytes,
            "d2h_large_block_gbps": round(nbytes / statistics.median(t_d2h) / 1e9, 3),
            "raw_memcpy_large_block_gbps": round(nbytes / statistics.median(t_raw) / 1e9, 3),
            "d2h_large_block_over_memcpy": _median_ratio(t_raw, t_d2h),
            "offload_large_block_over_memcpy": _median_ratio(t_raw_o, t_off)}


def _copy_and_offload(store, evicted: list, events: list):
    """Timers (seconds) of the two device->host measurements over ``evicted``, both from
    an empty host tier: the copy path alone (slot reservation + batched gather into the
    slab, ``HostTier.reserve`` + ``HostTier.store``) and the whole ``TierStore.offload``
    (that copy plus the host index and the ``BlockStored`` events)."""
    host = store.host
    block_ids = [ev.block_id for ev in reversed(evicted)]  # the order offload copies them in

    def copy() -> float:
        store.clear()
        _sync()
        t0 = time.perf_counter()
        slots, _, _ = host.reserve(len(block_ids))
        done = host.store(store.kv_cache, block_ids, slots)
        if done is not None:  # a CUDA event: the copy is asynchronous
            done.synchronize()
        elapsed = time.perf_counter() - t0
        host.release(slots)
        return elapsed

    def offload() -> float:
        store.clear()
        events.clear()
        return _timed(lambda: store.offload(evicted))

    return copy, offload


def _paired(baseline, measured, n: int) -> tuple[list[float], list[float]]:
    """``n`` back-to-back pairs of timings (seconds), the order alternating, so that the
    machine's background load hits both sides of a pair alike."""
    a, b = [], []
    for i in range(n):
        if i % 2:
            b.append(measured())
            a.append(baseline())
        else:
            a.append(baseline())
            b.append(measured())
    return a, b


def _median_ratio(t_base: list[float], t_measured: list[float]) -> float:
    """Median over pairs of baseline time / measured time (= measured rate / baseline rate)."""
    return round(statistics.median(x / y for x, y in zip(t_base, t_measured)), 4)


def _raw_file_write(path: str, data) -> float:
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view[: 8 << 20])
            view = view[n:]
        os.fsync(fd)
    finally:
        os.close(fd)
    elapsed = time.perf_counter() - t0
    os.unlink(path)
    return elapsed


def _drop_page_cache(store) -> None:
    """Ask the kernel to drop the disk tier's (clean, fsynced) pages from its cache."""
    for seg in store.disk.segments.values():
        fd = os.open(seg.path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _under_cost_policy(engine, prompt: list[int]) -> dict:
    """One 1-token request on ``engine`` under the "cost" load policy (then "always" again)."""
    from kvmesh.workers.request import SamplingParams

    engine.tiers.load_policy = "cost"
    try:
        return engine.generate(prompt, SamplingParams(max_tokens=1))
    finally:
        engine.tiers.load_policy = "always"


def bench_ttft(rounds: int = 5, seed: int = 0, directory: str | None = None, on_round=None,
               device: str = "cpu") -> dict:
    """TTFT of a 2,048-token prompt, cold and with 1,792 tokens cached on each tier.
    ``on_round()`` is called after each round (progress)."""
    from kvmesh.cache_store.tier_store import TierConfig
    from kvmesh.workers.engine import Engine
    from kvmesh.workers.request import SamplingParams

    base = directory or tempfile.mkdtemp(prefix="kvmesh-bench-ttft-")
    engine = Engine(device=device, num_blocks=(3 * PROMPT_TOKENS) // BLOCK_SIZE + 64, block_size=BLOCK_SIZE,
                    max_num_batched_tokens=PROMPT_TOKENS,
                    tiers=TierConfig(host_bytes=256 << 20, disk_dir=os.path.join(base, "disk"),
                                     disk_bytes=1 << 30, peer_bytes=0, load_policy="always")).start()
    rng = random.Random(seed)
    one = SamplingParams(max_tokens=1)
    tail = PROMPT_TOKENS - CACHED_TOKENS

    def toks(n: int) -> list[int]:
        return [rng.randrange(256) for _ in range(n)]

    def measured(prefix, tier):
        out = engine.generate(prefix + toks(tail), one)
        got = out["usage"]["cached_tokens_by_tier"][tier] if tier else out["usage"]["cached_tokens"]
        if got != (CACHED_TOKENS if tier else 0):
            raise RuntimeError(f"expected {CACHED_TOKENS} tokens from {tier}, got {out['usage']}")
        return out["timing"]["ttft_ms"]

    def cached_on(tier: str) -> list[int]:
        engine.clear_cache()
        prefix = toks(CACHED_TOKENS)
        engine.generate(prefix + toks(tail), one)
        if tier != "device":
            engine.offload_device_cache()
            engine.flush_tiers(60)
        if tier == "disk":
            engine.drop_host_tier()
            _drop_page_cache(engine.tiers)
        return prefix

    res: dict[str, list[float]] = {"cold": [], "device": [], "host": [], "disk": [], "disk_cost": []}
    loaded: list[int] = []
    try:
        engine.generate(toks(64), one)  # warm-up
        for _ in range(rounds):
            engine.clear_cache()
            res["cold"].append(measured(toks(CACHED_TOKENS), None))
            for tier in ("device", "host", "disk"):
                res[tier].append(measured(cached_on(tier), tier))
            # the disk case again, weighed: both costs have been measured by now
            out = _under_cost_policy(engine, cached_on("disk") + toks(tail))
            res["disk_cost"].append(out["timing"]["ttft_ms"])
            loaded.append(out["usage"]["cached_tokens_by_tier"]["disk"])
            if on_round is not None:
                on_round()
    finally:
        engine.stop()
        if directory is None:
            shutil.rmtree(base, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in res.items()}
    out = {f"ttft_{k}_ms": round(v, 3) for k, v in med.items()}
    for k in ("device", "host", "disk", "disk_cost"):
        out[f"ttft_{k}_over_cold"] = round(med[k] / med["cold"], 4)
    out["ttft_disk_cost_loaded_tokens"] = statistics.median(loaded)
    return out


def bench_record_mac(repeats: int = 5, nbytes: int = 2 << 20) -> dict:
    """Rate (GB/s, best of ``repeats``) of the remote tier's record MAC, keyed BLAKE2b
    (RFC 7693) over one ``nbytes`` record, on this machine's CPU."""
    import hashlib

    data, key = os.urandom(nbytes), os.urandom(32)
    best = min(_timed(lambda: hashlib.blake2b(data, key=key, digest_size=32).digest()) for _ in range(repeats))
    return {"remote_mac_gbps": round(nbytes / best / 1e9, 3)}


def bench_ttft_remote(rounds: int = 5, seed: int = 1, on_round=None, device: str = "cpu") -> dict:
    """TTFT of the same 2,048-token prompt with its first 1,792 tokens in the cluster's remote
    tier only, read by a second engine (a worker that never saw the prompt), against cold on
    that engine; both engines share a private redis-server. Empty without redis-server.
    ``on_round()`` is called after each round (progress)."""
    if shutil.which("redis-server") is None:
        return {}
    from kvmesh.cache_store.tier_store import TierConfig
    from kvmesh.services.procs import RedisServer
    from kvmesh.workers.engine import Engine
    from kvmesh.workers.request import SamplingParams

    server = RedisServer()
    tiers = TierConfig(host_bytes=64 << 20, peer_bytes=64 << 20, remote_url=server.url, remote_bytes=1 << 30,
                       remote_cluster="bench", remote_record_key=os.urandom(32), load_policy="always")
    blocks = (3 * PROMPT_TOKENS) // BLOCK_SIZE + 64
    writer = Engine(device=device, num_blocks=blocks, block_size=BLOCK_SIZE, max_num_batched_tokens=PROMPT_TOKENS,
                    tiers=tiers).start()
    reader = Engine(device=device, num_blocks=blocks, block_size=BLOCK_SIZE, max_num_batched_tokens=PROMPT_TOKENS,
                    tiers=tiers).start()
    rng = random.Random(seed)
    one = SamplingParams(max_tokens=1)
    tail = PROMPT_TOKENS - CACHED_TOKENS

    def toks(n: int) -> list[int]:
        return [rng.randrange(256) for _ in range(n)]

    res: dict[str, list[float]] = {"cold": [], "remote": [], "remote_cost": [], "fetch": []}
    loaded: list[int] = []
    try:
        reader.generate(toks(64), one)  # warm-up
        for _ in range(rounds):
            reader.clear_cache()
            out = reader.generate(toks(PROMPT_TOKENS), one)
            res["cold"].append(out["timing"]["ttft_ms"])
            prefix = toks(CACHED_TOKENS)
            writer.generate(prefix + toks(tail), one)
            writer.offload_device_cache()
            writer.flush_tiers(60)
            reader.clear_cache()
            out = reader.generate(prefix + toks(tail), one)
            if out["usage"]["cached_tokens_by_tier"]["remote"] != CACHED_TOKENS:
                raise RuntimeError(f"expected {CACHED_TOKENS} tokens from the remote tier, got {out['usage']}")
            res["remote"].append(out["timing"]["ttft_ms"])
            res["fetch"].append(reader.tiers.load_seconds_per_block["remote"] * CACHED_TOKENS / BLOCK_SIZE * 1e3)
            # again under the "cost" policy, the tier's reads and the prefill both measured
            prefix = toks(CACHED_TOKENS)
            writer.generate(prefix + toks(tail), one)
            writer.offload_device_cache()
            writer.flush_tiers(60)
            reader.clear_cache()
            out = _under_cost_policy(reader, prefix + toks(tail))
            res["remote_cost"].append(out["timing"]["ttft_ms"])
            loaded.append(out["usage"]["cached_tokens_by_tier"]["remote"])
            if on_round is not None:
                on_round()
    finally:
        writer.stop()
        reader.stop()
        server.stop()
    med = {k: statistics.median(v) for k, v in res.items()}
    return {"ttft_remote_cold_ms": round(med["cold"], 3), "ttft_remote_ms": round(med["remote"], 3),
            "ttft_remote_over_cold": round(med["remote"] / med["cold"], 4),
            "remote_fetch_ms": round(med["fetch"], 3), "ttft_remote_cost_ms": round(med["remote_cost"], 3),
            "ttft_remote_cost_loaded_tokens": statistics.median(loaded)}


def check_targets(results: dict) -> dict:
    """``{ratio name: {"value", "target", "met"}}`` for every target in ``TARGETS``."""
    out = {}
    for name, (op, bound) in TARGETS.items():
        v = results.get(name)
        met = v is not None and (v >= bound if op == ">=" else v <= bound)
        out[name] = {"value": v, "target": f"{op} {bound}", "met": bool(met)}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvmesh.bench.tiers", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--repeats", type=int, default=7,
                        help="pairs per figure: 3x this for copies, 2x for disk writes (medians; best of for encodes)")
    parser.add_argument("--rounds", type=int, default=5, help="TTFT rounds (median)")
    parser.add_argument("--dir", default=None, help="directory for the disk measurements (default: a temp dir)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    parser.add_argument("--device", default="cpu",
                        help="torch device of the pool and engine: cpu or cuda[:N] (default cpu)")
    parser.add_argument("--no-remote", action="store_true",
                        help="skip the remote-tier TTFT (it starts a redis-server)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    args = parser.parse_args(argv)
    from kvmesh.bench.progress import StepProgress

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    # units: the copy figures count as --repeats, each TTFT round as one
    with StepProgress("bench.tiers", args.repeats + 2 * args.rounds, enabled=not args.no_progress) as bar:
        bar.step("copies and codecs")
        results = bench_copies(args.repeats, directory=args.dir, device=args.device)
        bar.advance(args.repeats, step="TTFT: device, host, disk")
        results.update(bench_ttft(args.rounds, directory=args.dir, on_round=lambda: bar.advance(1),
                                  device=args.device))
        if not args.no_remote:
            bar.step("TTFT: remote")
            results.update(bench_ttft_remote(args.rounds, on_round=lambda: bar.advance(1), device=args.device))
            results.update(bench_record_mac())
    results["device"] = args.device
    results["targets"] = check_targets(results)
    if args.json:
        print(json.dumps(results))
    else:
        for k, v in results.items():
            print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
