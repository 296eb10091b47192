"""The main job: a local cluster replays the bundled Mooncake trace sample per policy.

For each policy (default: round_robin, then kv_aware) a fresh local cluster starts —
private redis-server, N workers with the built-in model, one router — and the load
harness replays the sample through the router. Then the pooled reference is computed: one
LRU prefix cache holding all workers' blocks, fed the same requests in the same order
(the same `PrefixCache` code the workers run, without a model). It is a reference, not an
upper bound: a router that keeps some conversations apart from others' churn can beat it. The comparison is
printed and written to ``OUT/comparison.json`` and ``OUT/comparison.md``.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import sys

from kvmesh.cache_store.hashing import Namespace, hash_blocks
from kvmesh.cache_store.prefix_cache import PrefixCache

DEFAULT_POLICIES = ("round_robin", "kv_aware")
#: Pool size per worker, as a fraction of the sample's distinct KV blocks, when not given.
DEFAULT_POOL_FRACTION = 0.6
#: Acceptance thresholds printed by the demo.
MIN_FRACTION_OF_POOLED = 0.90
MAX_SHARE_OVER_MEAN = 1.25
#: Fewest requests per worker for the share and round_robin checks: on fewer, a couple of
#: requests more on one worker pass MAX_SHARE_OVER_MEAN by chance (30 requests on 2
#: workers: 19 and 11), and both policies hit about what a cache holding everything would.
MIN_REQUESTS_PER_WORKER_CHECKED = 100


def distinct_blocks(reqs, tokens_per_block: int, block_size: int) -> int:
    """KV blocks needed to hold every distinct trace block once (upper bound)."""
    ids = {h for r in reqs for h in r.hash_ids}
    return len(ids) * max(1, math.ceil(tokens_per_block / block_size))


def simulate_pooled(reqs, tokens_per_block: int, num_blocks: int, block_size: int = 16,
                    max_output_tokens: int | None = None, vocab_size: int = 256) -> dict:
    """Hit rate of one LRU prefix cache of ``num_blocks`` blocks over the trace, in order.

    Each request locks its cached prefix (capped so one prompt token is computed, as in
    the worker), allocates blocks for the rest of its prompt and its output, caches its
    prompt blocks and frees everything, so cache pressure matches a worker's. Returns
    ``hit_rate_blocks`` (trace blocks whose synthesized tokens are fully cached, over all
    trace block references) and ``hit_rate_tokens``.
    """
    from kvmesh.bench.trace import synthesize_tokens

    cache = PrefixCache(num_blocks, block_size)
    root = Namespace(model_id="pooled-bound").root_hash()
    hit_blocks = total_blocks = cached_tokens = prompt_tokens = 0
    for req in reqs:
        tokens = synthesize_tokens(req, tokens_per_block, vocab_size=vocab_size)
        bh = hash_blocks(tokens, block_size, root)
        max_blocks = (len(tokens) - 1) // block_size
        match = cache.index.match(bh.hashes[:max_blocks], bh.block_tokens)
        held = list(match.values)
        cache.lock(held)
        out = req.output_length if max_output_tokens is None else min(req.output_length, max_output_tokens)
        need = -(-(len(tokens) + out) // block_size) - len(held)
        new = cache.allocate(need)
        if new is not None:
            ids = held + new
            cache.commit(bh, ids, len(held), len(bh.hashes))
            cache.unlock(ids)
        else:
            cache.unlock(held)
        cached = len(held) * block_size
        cached_tokens += cached
        prompt_tokens += len(tokens)
        hit_blocks += trace_blocks_within(req, tokens_per_block, cached)
        total_blocks += len(req.hash_ids)
    return {
        "policy": "pooled",
        "hit_rate_blocks": hit_blocks / max(1, total_blocks),
        "hit_rate_tokens": cached_tokens / max(1, prompt_tokens),
        "num_blocks": num_blocks,
    }


def trace_blocks_within(req, tokens_per_block: int, cached_tokens: int) -> int:
    """Leading trace blocks of ``req`` whose synthesized tokens all lie in the cached prefix."""
    n = 0
    covered = 0
    last = len(req.hash_ids) - 1
    for i in range(len(req.hash_ids)):
        tail = req.input_length - 512 * last
        covered += tokens_per_block if i < last else math.ceil(tokens_per_block * tail / 512)
        if covered > cached_tokens:
            break
        n += 1
    return n


def max_share_over_mean(share: dict) -> float:
    if not share:
        return 0.0
    mean = 1.0 / len(share)
    return max(share.values()) / mean


def demo_checks(results: list[dict], pooled_hit: float, num_requests: int, workers: int) -> tuple[dict, list[str]]:
    """The demo's acceptance checks: ``(checks, failed)``, ``failed`` naming each check
    missed with its threshold (empty: all passed).

    ``results`` are the harness's per-policy results; ``pooled_hit`` the block hit rate of
    one pooled LRU cache of the fleet's size. No request may fail, and kv_aware must reach
    `MIN_FRACTION_OF_POOLED` of the pooled hit rate. From `MIN_REQUESTS_PER_WORKER_CHECKED`
    requests per worker, it must also keep its busiest worker's share within
    `MAX_SHARE_OVER_MEAN` of the mean and hit more than round_robin; on fewer, two
    requests more on one worker pass the share limit and the two policies' hits differ
    by a block or two (``*_checked``: False).
    """
    by_policy = {r["policy"]: r for r in results}
    checks: dict = {}
    failed = [f"{r['policy']}: {r['num_errors']} requests failed" for r in results if r["num_errors"]]
    kv = by_policy.get("kv_aware")
    if kv is None:
        return checks, failed
    checks["kv_aware_vs_pooled"] = kv["hit_rate_blocks"] / max(1e-9, pooled_hit)
    if checks["kv_aware_vs_pooled"] < MIN_FRACTION_OF_POOLED:
        failed.append(f"kv_aware_vs_pooled {checks['kv_aware_vs_pooled']:.3f} < {MIN_FRACTION_OF_POOLED}")
    checks["kv_aware_max_share_over_mean"] = share = max_share_over_mean(kv["worker_share"])
    long_enough = num_requests >= MIN_REQUESTS_PER_WORKER_CHECKED * workers
    if not long_enough:
        checks["kv_aware_max_share_over_mean_checked"] = False
    elif share > MAX_SHARE_OVER_MEAN:
        failed.append(f"kv_aware_max_share_over_mean {share:.3f} > {MAX_SHARE_OVER_MEAN}")
    if "round_robin" in by_policy:
        kv_hit, rr_hit = kv["hit_rate_blocks"], by_policy["round_robin"]["hit_rate_blocks"]
        checks["kv_aware_hit_rate_above_round_robin"] = kv_hit > rr_hit
        if not long_enough:
            checks["kv_aware_hit_rate_above_round_robin_checked"] = False
        elif kv_hit <= rr_hit:
            failed.append(f"kv_aware hit rate {kv_hit:.4f} is not above round_robin's {rr_hit:.4f}")
    return checks, failed


def run_demo(workers: int = 2, max_requests: int | None = None, tokens_per_block: int = 16,
             max_output_tokens: int = 4, concurrency: int = 4, num_blocks: int | None = None,
             out_dir: str = os.path.join("runs", "demo"), trace: str | None = None,
             policies=DEFAULT_POLICIES, block_size: int = 16) -> dict:
    """Run the demo; returns the comparison dict (also written under ``out_dir``)."""
    from kvmesh.bench.harness import run_bench
    from kvmesh.bench.report import compare_markdown
    from kvmesh.bench.trace import DEFAULT_SAMPLE, load_mooncake
    from kvmesh.services.launcher import ClusterSpec, LocalCluster

    trace = trace or DEFAULT_SAMPLE
    try:
        reqs = load_mooncake(trace, max_requests)
    except ValueError as exc:  # malformed, truncated or corrupt: name the flag it came from
        raise ValueError(f"--trace {trace}: {exc}") from None
    if num_blocks is None:
        num_blocks = max(256, math.ceil(DEFAULT_POOL_FRACTION * distinct_blocks(reqs, tokens_per_block, block_size)
                                        / workers))
    os.makedirs(out_dir, exist_ok=True)
    print(f"kvmesh demo: {len(reqs)} requests of {os.path.basename(trace)}, {workers} workers x {num_blocks} blocks "
          f"of {block_size} tokens, {tokens_per_block} tokens per trace block, policies {', '.join(policies)}",
          flush=True)
    results = []
    for policy in policies:
        spec = ClusterSpec(num_workers=workers, policy=policy, num_blocks=num_blocks, block_size=block_size,
                           log_dir=os.path.join(out_dir, policy, "logs"), secure=True)
        os.makedirs(spec.log_dir, exist_ok=True)
        print(f"[{policy}] starting a cold cluster ...", flush=True)
        with LocalCluster(spec) as cluster:
            result = asyncio.run(run_bench(cluster.router_address, trace, os.path.join(out_dir, policy),
                                           max_requests=max_requests, tokens_per_block=tokens_per_block,
                                           max_output_tokens=max_output_tokens, concurrency=concurrency,
                                           policy_label=policy, credentials=cluster.client_options()))
        results.append(result)
    pooled = simulate_pooled(reqs, tokens_per_block, workers * num_blocks, block_size, max_output_tokens)
    checks, failed = demo_checks(results, pooled["hit_rate_blocks"], len(reqs), workers)
    ok = not failed
    comparison = {"results": results, "pooled": pooled, "checks": checks, "ok": ok,
                  "workers": workers, "num_blocks_per_worker": num_blocks}
    md = compare_markdown(results) + (
        f"\nPooled reference (one LRU cache of {workers * num_blocks} blocks, same requests; not a bound): "
        f"hit_rate_blocks {pooled['hit_rate_blocks']:.3f}, hit_rate_tokens {pooled['hit_rate_tokens']:.3f}\n")
    for name, value in checks.items():
        md += f"- {name}: {value if isinstance(value, bool) else round(value, 3)}\n"
    with open(os.path.join(out_dir, "comparison.json"), "w") as f:
        json.dump(comparison, f, indent=2)
    with open(os.path.join(out_dir, "comparison.md"), "w") as f:
        f.write(md)
    print(md, flush=True)
    print(("OK" if ok else "CHECKS FAILED: " + "; ".join(failed)) + f": results in {out_dir}",
          file=sys.stderr if not ok else sys.stdout)
    return comparison
