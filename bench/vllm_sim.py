"""``kvmesh sim --backend vllm``: replay a trace on simulated vLLM servers behind kvmesh.

The simulator (`bench.sim`) already runs the router's own index and policies over each
worker's `PrefixCache`, whose semantics are vLLM's V1 prefix cache: only full blocks are
cached, a hit covers at most ``floor((L - 1) / B)`` blocks (the last prompt token is
always computed), freed blocks stay cached and are evicted LRU, chain tails first. What
changes for a vLLM fleet is the block identity: here every request's blocks are named by
the keys vLLM publishes in its KV events (`services.vllm_compat`, the servers' block size,
hash algorithm and seed), so the simulated servers' events are the ones real servers would
send and the router matches them the way ``kvmesh router --backend vllm`` does. Everything
sits on the device medium (vLLM's GPU pool; no host, disk or peer tier). Prefill and decode
costs are `bench.sim.CostModel`'s, to be set from the fleet's measured rates
(``--prefill-s-per-token``, ``--decode-s-per-step``).
"""
from __future__ import annotations

import struct

from kvmesh.bench.sim import Workload, prepare
from kvmesh.cache_store.hashing import BlockHashes
from kvmesh.services.vllm_compat import VllmHashConfig, VllmHasher

__all__ = ["prepare_vllm"]


def prepare_vllm(reqs, hash_config: VllmHashConfig, block_tokens: int = 512, max_output_tokens: int | None = None,
                 vocab_size: int = 256) -> Workload:
    """`bench.sim.prepare` in token mode, with blocks named by vLLM's published keys.

    Args:
        reqs: `bench.trace.TraceRequest` s.
        hash_config: the servers' hashing (its ``block_size`` is the cache block size).
        block_tokens: tokens one trace block stands for.
        max_output_tokens: cap on each request's output length.
        vocab_size: token id range of the synthesized prompts.

    Raises:
        ValueError: from `bench.sim.prepare`.
    """
    hasher = VllmHasher(hash_config)
    bs = hash_config.block_size
    wl = prepare(reqs, block_tokens, bs, max_output_tokens, vocab_size)
    for spec in wl.specs:
        raw = spec.chain.token_bytes
        tokens = struct.unpack(f"<{len(raw) // 4}I", raw)
        keys = hasher.keys(tokens)
        spec.route_hashes = keys
        spec.chain = BlockHashes(keys, raw, bs)
    return wl
