"""Micro-benchmarks of the cache-store hot paths.

Run ``python -m bench.micro --json`` for one JSON object of all figures, or
without ``--json`` for one ``name: value`` line each. Units are in the field
names: ``mtok_s`` is millions of tokens per second, ``ms`` milliseconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Callable

import numpy as np
import xxhash

from kvmesh.cache_store.hashing import NATIVE_HASHING, Namespace, hash_blocks
from kvmesh.cache_store.radix_index import RadixIndex

BLOCK_SIZE = 16
HASH_TOKENS = 1 << 20  # tokens hashed per hashing run
PROMPT_TOKENS = 32_768  # tokens of the radix benchmark prompt
VOCAB = 128_256



def _bench_ttft() -> dict:
    from kvmesh.bench.ttft import bench_ttft  # imports torch and the engine: only when run

    return bench_ttft()


#: Each callable returns a dict of figures that main() merges into its output.
EXTRA_BENCHES: list[Callable[[], dict]] = [_bench_ttft]


def _best_seconds(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _median_seconds(fn: Callable[[], object], repeats: int, setup: Callable[[], None] | None = None) -> float:
    times = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_hashing(num_tokens: int = HASH_TOKENS, repeats: int = 7) -> dict:
    """Throughput of ``hash_blocks`` (block size 16) on random token ids, best of ``repeats``.

    Returns:
        ``hash_mtok_s``: from a list of Python ints (conversion included);
        ``hash_ndarray_mtok_s``: from a uint32 numpy array;
        ``hash_32k_mtok_s``: from lists of ``PROMPT_TOKENS`` ints, a typical
            prompt size (1M-token buffers add page-fault time);
        ``raw_xxh3_mtok_s``: one xxh3_128 call over the same token bytes
        (the bound set by the hash itself).
    """
    rng = np.random.default_rng(0)
    arr = rng.integers(0, VOCAB, num_tokens, dtype=np.uint32)
    ids = arr.tolist()
    root = Namespace("bench-model").root_hash()
    raw = arr.astype("<u4").tobytes()
    t_list = _best_seconds(lambda: hash_blocks(ids, BLOCK_SIZE, root), repeats)
    t_arr = _best_seconds(lambda: hash_blocks(arr, BLOCK_SIZE, root), repeats)
    t_raw = _best_seconds(lambda: xxhash.xxh3_128_digest(raw), repeats)
    prompts = [ids[o : o + PROMPT_TOKENS] for o in range(0, num_tokens - PROMPT_TOKENS + 1, PROMPT_TOKENS)]

    def hash_prompts() -> None:
        for p in prompts:
            hash_blocks(p, BLOCK_SIZE, root)

    t_prompts = _best_seconds(hash_prompts, repeats)
    return {
        "hash_mtok_s": round(num_tokens / t_list / 1e6, 1),
        "hash_ndarray_mtok_s": round(num_tokens / t_arr / 1e6, 1),
        "hash_32k_mtok_s": round(len(prompts) * PROMPT_TOKENS / t_prompts / 1e6, 1),
        "raw_xxh3_mtok_s": round(num_tokens / t_raw / 1e6, 1),
        "hash_impl": "c" if NATIVE_HASHING else "python",
    }


def bench_radix(num_tokens: int = PROMPT_TOKENS, repeats: int = 21) -> dict:
    """Latency of ``RadixIndex`` on one prompt (block size 16, token bytes checked), median of ``repeats``.

    Returns:
        ``match_32k_ms``: match of the prompt with all its blocks present;
        ``insert_32k_ms``: insert of all its blocks into an empty index.
    """
    rng = np.random.default_rng(1)
    ids = rng.integers(0, VOCAB, num_tokens, dtype=np.uint32).tolist()
    bh = hash_blocks(ids, BLOCK_SIZE, Namespace("bench-model").root_hash())
    values = list(range(len(bh.hashes)))
    state = {"index": RadixIndex()}

    def fresh() -> None:
        state["index"] = RadixIndex()

    t_insert = _median_seconds(
        lambda: state["index"].insert(bh.hashes, bh.block_tokens, values), repeats, setup=fresh
    )
    index = RadixIndex()
    index.insert(bh.hashes, bh.block_tokens, values)
    hit = index.match(bh.hashes, bh.block_tokens)
    if hit.num_blocks != len(values):
        raise RuntimeError(f"benchmark prompt matched {hit.num_blocks} of {len(values)} blocks")
    t_match = _median_seconds(lambda: index.match(bh.hashes, bh.block_tokens), repeats)
    return {
        "match_32k_ms": round(t_match * 1e3, 3),
        "insert_32k_ms": round(t_insert * 1e3, 3),
    }


def main(argv: list[str] | None = None) -> int:
    """Run all benchmarks; ``--json`` prints one JSON object. Returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m kvmesh.bench.micro", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    args = parser.parse_args(argv)
    from kvmesh.bench.progress import StepProgress

    results: dict = {}
    benches = [bench_hashing, bench_radix, *EXTRA_BENCHES]
    with StepProgress("bench.micro", len(benches), enabled=not args.no_progress) as bar:
        for bench in benches:
            bar.step(bench.__name__)
            results.update(bench())
            bar.advance(1)
    if args.json:
        print(json.dumps(results))
    else:
        for k, v in results.items():
            print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
