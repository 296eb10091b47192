"""Routing sweep: kv_aware against the field's routers on many workloads and fleet sizes.

``python -m kvmesh.bench.route_sweep`` replays each workload below through `bench.sim`
(same caches, index, load model and GPU-class cost model for every policy) at each fleet
size, and prints one row per (workload, fleet): the pooled reference, kv_aware, the best
of the field's cache-aware routers (``sglang_cache_aware``, ``ray_prefix_affinity``,
``dynamo_kv``, ``llmd_precise``) and whether kv_aware meets its targets there:

* hit rate >= the best field policy's (``hit``), and >= the best field policy's among
  those that meet the balance target (``hit (balanced field)``): where the two differ, a
  field router's extra hits come with an imbalance over 1.10 and the targets conflict,
* imbalance (max over mean of per-worker request counts) <= 1.10 (``bal``),
* TTFT p99 <= every field policy's (``p99``).

Workloads (each a list of `bench.trace.TraceRequest`, replayed one cache block per trace
block of ``block_tokens`` tokens):

* ``mooncake``: the bundled Mooncake conversation trace at its own timestamps (3M tokens
  per worker, as in docs/ROUTING.md); ``--mooncake-requests`` takes a slice.
* ``gsp-*``: SGLang's generated-shared-prefix workload (`bench.workloads.shared_prefix_workload`)
  at several group counts, group sizes and prompt lengths.
* ``multiturn-*``: the harness's multi-turn chats (`bench.workloads.multi_turn_workload`),
  each turn sent after the previous one finished plus a think time.
* ``tenants``: many small tenants (Zipf popularity) with short system prompts and short
  conversations; ``docs``: long documents with few reuses; ``zipf``: shared prefixes of
  Zipf popularity; ``bursty``: bursts of requests sharing a new prefix within a second;
  ``agents``: tool-using agent sessions (a Zipf-popular tool prompt shared across
  sessions, then one request per step carrying every earlier step's output).

Two sets: ``TUNING`` (the workloads above; ``--workloads tuning``), on which kv_aware's
defaults were chosen, and ``HELD_OUT`` (``ho-*``; ``--workloads held-out``): the same
generators with other seeds, group counts and sizes, lengths, Zipf exponents, follow-up
rates and burst sizes, plus ``ho-tree`` (Zipf-popular root prompts, each with six branches,
then a unique tail), a reuse structure the tuning set lacks, and ``ho-mooncake-synthetic``:
Mooncake's synthetic trace (long documents asked about again and short chats, prompts of 17
to 191,378 tokens; bench/data/README.md) at its own timestamps with 3M tokens per worker,
like ``mooncake``. They check that the defaults hold on workloads they were not tuned on.

The generated workloads grow with the fleet (``workers // 10`` times as many groups,
conversations, tenants, documents, prefixes and requests, at least once), arrive as a Poisson process (bursty: ON/OFF) at a rate that keeps
the fleet's cold prefill load at ``--load`` of its capacity at every fleet size, and each
worker holds ``--pressure`` of the workload's distinct tokens divided by the fleet size, so
a fleet of any size is as loaded and as short of cache as the others. Token-level
workloads are cut into blocks of ``block_tokens`` tokens and each distinct prefix becomes
a block id, as in a Mooncake trace.

Cost: seconds to a few minutes per workload and fleet on one core; ``--quick`` runs a
small subset for iteration.
"""
from __future__ import annotations

import argparse
import json
import inspect
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from kvmesh.bench.sim import (DEFAULT_TRACE, POOLED, SYNTHETIC_TRACE, CostModel, PeerFetch, add_peer_fetch_args, peer_fetch_from_args,
                              prepare, simulate)
from kvmesh.bench.cli_args import numeric_kwargs, output_file_problem
from kvmesh.bench.trace import TraceRequest, load_mooncake
from kvmesh.services.cli_checks import positive_float, positive_int
from kvmesh.services.policies import POLICIES, make_policy

__all__ = ["FIELD", "WORKLOADS", "TUNING", "HELD_OUT", "SweepWorkload", "tokens_to_trace", "run_sweep", "sweep_markdown", "main"]

#: The field's cache-aware routers kv_aware is measured against.
FIELD = ("sglang_cache_aware", "ray_prefix_affinity", "dynamo_kv", "llmd_precise")
#: Imbalance (max over mean of per-worker request counts) kv_aware must stay under.
BALANCE_TARGET = 1.10
#: Prefill tokens per second of a worker in the default cost model.
_PREFILL_TPS = 1.0 / CostModel().prefill_s_per_token


@dataclass
class SweepWorkload:
    """One workload: requests with arrival times at fleet size ``workers``.

    Attributes:
        name: row label.
        make: ``make(workers, load)`` -> requests (arrivals scaled to the fleet).
        block_tokens: tokens per trace block.
        capacity_tokens: ``capacity_tokens(workers, reqs, block_tokens)`` -> KV tokens per worker.
    """

    name: str
    make: Callable[[int, float], list[TraceRequest]]
    block_tokens: int
    capacity_tokens: Callable[[int, list[TraceRequest], int], int]


# ---------------------------------------------------------------- conversions
def tokens_to_trace(prompts: Sequence[Sequence[int]], outputs: Sequence[int], arrivals_s: Sequence[float],
                    block_tokens: int) -> list[TraceRequest]:
    """Token prompts as Mooncake-format requests: one hash id per distinct prefix block.

    Block ``k`` of a prompt gets the id of (id of block ``k - 1``, its tokens), so equal ids
    at the same position mean equal prefixes, as in the Mooncake traces; the last block may
    be partial. Requests are returned in arrival order.
    """
    ids: dict[tuple, int] = {}
    out = []
    for prompt, n_out, t in sorted(zip(prompts, outputs, arrivals_s), key=lambda x: x[2]):
        parent = -1
        chain = []
        for i in range(0, len(prompt), block_tokens):
            key = (parent, tuple(prompt[i:i + block_tokens]))
            hid = ids.get(key)
            if hid is None:
                hid = ids[key] = len(ids)
            chain.append(hid)
            parent = hid
        # input_length in the trace's 512-token blocks, so that `prepare(block_tokens=B)` gives back
        # B tokens per full block and the partial tail exactly
        tail = len(prompt) - block_tokens * (len(chain) - 1)
        length = 512 * (len(chain) - 1) + tail * 512 // block_tokens
        out.append(TraceRequest(int(round(t * 1000)), length, int(n_out), tuple(chain)))
    return out


def _unique_tokens(reqs: Sequence[TraceRequest], block_tokens: int) -> int:
    seen = set()
    for r in reqs:
        seen.update(r.hash_ids)
    return len(seen) * block_tokens


def _poisson(rng: random.Random, n: int, rate: float) -> list[float]:
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def _rate(load: float, workers: int, mean_tokens: float) -> float:
    """Requests/s that keep cold prefill at ``load`` of the fleet's capacity."""
    return load * workers * _PREFILL_TPS / max(1.0, mean_tokens)


def _zipf(rng: random.Random, n: int, s: float) -> Callable[[], int]:
    weights = [1.0 / (i + 1) ** s for i in range(n)]
    cum, acc = [], 0.0
    for w in weights:
        acc += w
        cum.append(acc)
    import bisect

    return lambda: min(n - 1, bisect.bisect_left(cum, rng.random() * acc))


# ------------------------------------------------------------------ generators
def _scale(workers: int) -> int:
    """Workload size factor: generated workloads grow with the fleet (x1 up to 10 workers)."""
    return max(1, workers // 10)


def _gsp(groups: int, per_group: int, system: int, question: int, output: int, bt: int, seed: int = 0):
    from kvmesh.bench.workloads import shared_prefix_workload

    def make(workers: int, load: float) -> list[TraceRequest]:
        wl = shared_prefix_workload(groups * _scale(workers), per_group, system, question, output, seed=1 + seed)
        rate = _rate(load, workers, (system + question) * 0.5)
        arr = _poisson(random.Random(2 + seed), len(wl.items), rate)
        return tokens_to_trace([it.tokens for it in wl.items], [it.max_tokens for it in wl.items], arr, bt)
    return make


def _multiturn(convs: int, turns: int, system: int, user: int, output: int, bt: int, think_s: float = 5.0,
               seed: int = 0):
    from kvmesh.bench.workloads import multi_turn_workload

    def make(workers: int, load: float) -> list[TraceRequest]:
        n_conv = convs * _scale(workers)
        wl = multi_turn_workload(n_conv, turns, system, user, output, seed=3 + seed)
        rng = random.Random(4 + seed)
        mean_tok = system + user * (turns + 1) / 2 + output * (turns - 1) / 2
        starts = _poisson(rng, n_conv, _rate(load, workers, mean_tok * 0.5) / turns)
        prompts, outs, arr, hist, when = [], [], [], {}, {}
        for it in wl.items:
            if it.parent is None:
                prompt = list(it.tokens)
                t = starts[it.group]
            else:
                prompt = hist[it.parent] + list(it.tokens)
                # the previous turn's prefill + decode at the cost model's speed, then a think time
                t = when[it.parent] + len(hist[it.parent]) / _PREFILL_TPS + 0.03 * output + rng.expovariate(1 / think_s)
            completion = [rng.randrange(256) for _ in range(it.max_tokens)]
            hist[it.index] = prompt + completion
            when[it.index] = t
            prompts.append(prompt)
            outs.append(it.max_tokens)
            arr.append(t)
        return tokens_to_trace(prompts, outs, arr, bt)
    return make


def _tenants(n_req: int = 3000, tenants: int = 300, s: float = 1.1, follow: float = 0.35, seed: int = 0):
    def make(workers: int, load: float) -> list[TraceRequest]:
        rng = random.Random(5 + seed)
        n_ten, n = tenants * _scale(workers), n_req * _scale(workers)
        pick = _zipf(rng, n_ten, s)
        sys_len = [rng.randint(2, 8) for _ in range(n_ten)]
        next_id = [10 ** 7]

        def fresh(k: int) -> list[int]:
            out = list(range(next_id[0], next_id[0] + k))
            next_id[0] += k
            return out
        system = [fresh(n) for n in sys_len]
        convs: list[list[int]] = []
        chains = []
        for _ in range(n):
            if convs and rng.random() < follow:
                c = convs[rng.randrange(max(0, len(convs) - 200), len(convs))]
                c.extend(fresh(rng.randint(1, 3)))
            else:
                c = system[pick()] + fresh(rng.randint(1, 4))
                convs.append(c)
            chains.append(list(c))
        return _chains(chains, rng, workers, load)
    return make


def _docs(n_docs: int = 600, n_req: int = 1500, blocks: tuple[int, int] = (16, 64), new: float = 0.55, seed: int = 0):
    def make(workers: int, load: float) -> list[TraceRequest]:
        rng = random.Random(6 + seed)
        nd, n = n_docs * _scale(workers), n_req * _scale(workers)
        docs = [list(range(10 ** 7 + 1000 * d, 10 ** 7 + 1000 * d + rng.randint(*blocks))) for d in range(nd)]
        chains = []
        used = 0
        for i in range(n):
            # mostly new documents, a few asked about again soon after
            if used < nd and (i == 0 or rng.random() < new):
                d = used
                used += 1
            else:
                d = rng.randrange(max(0, used - 40), max(1, used))
            chains.append(docs[d] + [2 * 10 ** 8 + i])
        return _chains(chains, rng, workers, load)
    return make


def _zipf_prefixes(n_req: int = 3000, prefixes: int = 1000, s: float = 1.2, blocks: tuple[int, int] = (4, 16),
                   seed: int = 0):
    def make(workers: int, load: float) -> list[TraceRequest]:
        rng = random.Random(7 + seed)
        n_pre, n = prefixes * _scale(workers), n_req * _scale(workers)
        pick = _zipf(rng, n_pre, s)
        pre = [list(range(10 ** 7 + 100 * p, 10 ** 7 + 100 * p + rng.randint(*blocks))) for p in range(n_pre)]
        chains = [pre[pick()] + [2 * 10 ** 9 + 10 * i + k for k in range(rng.randint(1, 4))] for i in range(n)]
        return _chains(chains, rng, workers, load)
    return make


def _bursty(n_req: int = 3000, burst: tuple[int, int] = (20, 60), seed: int = 0):
    def make(workers: int, load: float) -> list[TraceRequest]:
        rng = random.Random(8 + seed)
        n = n_req * _scale(workers)
        chains, arr = [], []
        t = 0.0
        base = 10 ** 7
        mean_blocks = 12.0
        rate = _rate(load, workers, mean_blocks * 512 * 0.5)
        while len(chains) < n:
            size = rng.randint(*burst)
            pre = list(range(base, base + rng.randint(6, 16)))
            base += 100
            for _ in range(size):
                chains.append(pre + [2 * 10 ** 8 + len(chains)])
                arr.append(t + rng.random())  # a burst lands within a second
            t += size / rate  # long-run average rate as the others
        return [TraceRequest(int(a * 1000), 512 * len(c), rng.randint(50, 300), tuple(c))
                for a, c in sorted(zip(arr, chains))][:n]
    return make


def _tree(n_req: int = 3000, roots: int = 40, branches: int = 6, s: float = 1.0, seed: int = 0):
    """Two-level prefix tree: a root prompt (Zipf popularity), one of its branches, a unique tail."""
    def make(workers: int, load: float) -> list[TraceRequest]:
        rng = random.Random(9 + seed)
        n_root, n = roots * _scale(workers), n_req * _scale(workers)
        pick = _zipf(rng, n_root, s)
        root = [list(range(10 ** 7 + 1000 * r, 10 ** 7 + 1000 * r + rng.randint(8, 24))) for r in range(n_root)]
        branch = [[list(range(3 * 10 ** 8 + 10 ** 4 * r + 100 * b, 3 * 10 ** 8 + 10 ** 4 * r + 100 * b
                              + rng.randint(4, 12))) for b in range(branches)] for r in range(n_root)]
        chains = []
        for i in range(n):
            r = pick()
            chains.append(root[r] + branch[r][rng.randrange(branches)]
                          + [2 * 10 ** 9 + 10 * i + k for k in range(rng.randint(1, 3))])
        return _chains(chains, rng, workers, load)
    return make


def _agents(n_req: int = 3000, tools: int = 24, s: float = 1.0, steps: tuple[int, int] = (2, 10),
            tool_blocks: tuple[int, int] = (6, 20), step_blocks: tuple[int, int] = (1, 3),
            think_s: tuple[float, float] = (0.2, 3.0), seed: int = 0):
    """Tool-using agent sessions: a Zipf-popular tool prompt (tool definitions, shared across
    sessions), the session's task, then one request per step, each carrying every earlier
    step's tool output. Arrivals are fixed in advance: a step follows the previous one by
    an estimate of its prefill and decode at the cost model's speed plus a short gap (a
    tool call), so a session's requests come within seconds of each other (under queueing
    a step can arrive before the previous one has finished)."""
    def make(workers: int, load: float) -> list[TraceRequest]:
        rng = random.Random(11 + seed)
        n_tool, n = tools * _scale(workers), n_req * _scale(workers)
        pick = _zipf(rng, n_tool, s)
        tool = [list(range(10 ** 7 + 1000 * t, 10 ** 7 + 1000 * t + rng.randint(*tool_blocks))) for t in range(n_tool)]
        sessions, total = [], 0
        nxt = 2 * 10 ** 9
        while total < n:
            k = min(rng.randint(*steps), n - total)
            task = [nxt]
            nxt += 1
            chains = []
            ctx = tool[pick()] + task
            for _ in range(k):
                ctx = ctx + list(range(nxt, nxt + rng.randint(*step_blocks)))
                nxt += 100
                chains.append(list(ctx))
            sessions.append(chains)
            total += k
        mean_blocks = sum(len(c) for ss in sessions for c in ss) / max(1, total)
        starts = _poisson(rng, len(sessions), _rate(load, workers, mean_blocks * 512 * 0.5) * len(sessions) / total)
        out = []
        for t0, ss in zip(starts, sessions):
            t = t0
            for c in ss:
                out.append(TraceRequest(int(t * 1000), 512 * len(c), rng.randint(50, 300), tuple(c)))
                # the step's prefill at the cost model's speed (uncached part ~ the new blocks), decode, a tool call
                t += 512 * 3 / _PREFILL_TPS + 0.03 * 150 + rng.uniform(*think_s)
        out.sort(key=lambda r: r.timestamp_ms)
        return out
    return make


def _chains(chains: list[list[int]], rng: random.Random, workers: int, load: float) -> list[TraceRequest]:
    mean_blocks = sum(len(c) for c in chains) / max(1, len(chains))
    arr = _poisson(rng, len(chains), _rate(load, workers, mean_blocks * 512 * 0.5))
    return [TraceRequest(int(a * 1000), 512 * len(c), rng.randint(50, 300), tuple(c)) for a, c in zip(arr, chains)]


def _pressure(p: float):
    return lambda workers, reqs, bt: max(bt, int(p * _unique_tokens(reqs, bt) / workers))


def _mooncake(max_requests: int | None, path=DEFAULT_TRACE):
    def make(workers: int, load: float) -> list[TraceRequest]:
        return load_mooncake(path, max_requests)
    return make


def workloads(mooncake_requests: int | None = None, pressure: float = 0.3) -> list[tuple[SweepWorkload, float]]:
    """The sweep's workloads with the pressure each is run at: ``[(workload, pressure)]``."""
    press = _pressure(pressure)
    fixed3m = lambda workers, reqs, bt: 3_000_000  # noqa: E731
    wl = [
        (SweepWorkload("mooncake", _mooncake(mooncake_requests), 512, fixed3m), pressure),
        (SweepWorkload("gsp-64x16", _gsp(64, 16, 2048, 128, 256, 32), 32, press), pressure),
        (SweepWorkload("gsp-16x64", _gsp(16, 64, 1024, 256, 128, 32), 32, press), pressure),
        (SweepWorkload("gsp-256x4", _gsp(256, 4, 4096, 64, 64, 64), 64, press), pressure),
        (SweepWorkload("multiturn-200x6", _multiturn(200, 6, 512, 128, 128, 32), 32, press), pressure),
        (SweepWorkload("multiturn-50x20", _multiturn(50, 20, 2048, 256, 64, 64), 64, press), pressure),
        (SweepWorkload("tenants", _tenants(), 512, press), pressure),
        (SweepWorkload("docs", _docs(), 512, press), pressure),
        (SweepWorkload("zipf", _zipf_prefixes(), 512, press), pressure),
        (SweepWorkload("bursty", _bursty(), 512, press), pressure),
        (SweepWorkload("agents", _agents(), 512, press), pressure),
        # held out: other seeds, sizes, lengths and reuse; never used to choose kv_aware's defaults
        (SweepWorkload("ho-gsp-32x32", _gsp(32, 32, 1536, 192, 192, 32, seed=10), 32, press), pressure),
        (SweepWorkload("ho-gsp-128x8", _gsp(128, 8, 3072, 96, 96, 64, seed=10), 64, press), pressure),
        (SweepWorkload("ho-multiturn-100x10", _multiturn(100, 10, 1024, 192, 96, 32, think_s=3.0, seed=10), 32,
                       press), pressure),
        (SweepWorkload("ho-tenants", _tenants(3000, 500, 0.9, follow=0.5, seed=10), 512, press), pressure),
        (SweepWorkload("ho-docs", _docs(400, 1500, blocks=(24, 96), new=0.4, seed=10), 512, press), pressure),
        (SweepWorkload("ho-zipf", _zipf_prefixes(3000, 500, 1.0, blocks=(8, 24), seed=10), 512, press), pressure),
        (SweepWorkload("ho-bursty", _bursty(3000, burst=(5, 120), seed=10), 512, press), pressure),
        (SweepWorkload("ho-tree", _tree(seed=10), 512, press), pressure),
        (SweepWorkload("ho-agents", _agents(3000, 60, 0.8, steps=(3, 16), tool_blocks=(4, 24), step_blocks=(1, 4),
                                            think_s=(0.1, 6.0), seed=10), 512, press), pressure),
        # a real trace of another shape (long documents asked about again, short chats) at its own
        # arrival times, 3M tokens per worker as the conversation trace's row
        (SweepWorkload("ho-mooncake-synthetic", _mooncake(None, SYNTHETIC_TRACE), 512, fixed3m), pressure),
    ]
    return wl


#: Names of the sweep's workloads.
WORKLOADS = tuple(w.name for w, _ in workloads())
#: The workloads kv_aware's defaults were tuned on (``--workloads tuning``).
TUNING = tuple(n for n in WORKLOADS if n != "mooncake" and not n.startswith("ho-"))
#: Held-out workloads, never used for tuning (``--workloads held-out``).
HELD_OUT = tuple(n for n in WORKLOADS if n.startswith("ho-"))


# ---------------------------------------------------------------------- sweep
def run_sweep(names: Sequence[str], fleets: Sequence[int], load: float = 0.7, pressure: float = 0.3,
              policies: Sequence[str] = (POOLED, "kv_aware", *FIELD), mooncake_requests: int | None = None,
              policy_kwargs: dict | None = None, seed: int = 0, progress=None,
              peer_fetch: PeerFetch | None = None) -> list[dict]:
    """Run every (workload, fleet) and return one row per pair.

    Each row: ``workload``, ``workers``, ``requests``, ``capacity_tokens``, and
    ``results`` {policy: {hit_rate_blocks, imbalance, ttft_p50_ms, ttft_p99_ms,
    sim_seconds}}, plus the target checks ``hit_ok``, ``hit_ok_balanced``, ``balance_ok``,
    ``p99_ok``, ``best_field`` (the field policy with the highest hit rate) and
    ``best_balanced_field`` (the same among field policies with imbalance <= 1.10; None
    when there is none). ``peer_fetch`` (a `bench.sim.PeerFetch`) runs every policy with
    kvmesh's peer tier; each result then also has ``peer_hit_rate_blocks`` (the hit rates
    judged stay those of each worker's own cache).
    """
    rows = []
    table = {w.name: w for w, _ in workloads(mooncake_requests, pressure)}
    unknown = [n for n in names if n not in table]
    if unknown:
        raise ValueError(f"unknown workload {', '.join(unknown)}; known: {', '.join(table)}")
    for name in names:
        w = table[name]
        for workers in fleets:
            reqs = w.make(workers, load)
            cap = w.capacity_tokens(workers, reqs, w.block_tokens)
            wl = prepare(reqs, block_tokens=w.block_tokens)
            res = {}
            for p in policies:
                r = simulate(wl, p, workers, cap, seed=seed,
                             policy_kwargs=policy_kwargs if p == "kv_aware" else None, peer_fetch=peer_fetch)
                res[p] = {"hit_rate_blocks": r["hit_rate_blocks"], "imbalance": r["imbalance"],
                          "ttft_p50_ms": r["ttft_ms"]["p50"], "ttft_p99_ms": r["ttft_ms"]["p99"],
                          "sim_seconds": r["sim_seconds"]}
                if peer_fetch is not None:
                    res[p]["peer_hit_rate_blocks"] = r["peer_hit_rate_blocks"]
                if progress is not None:
                    progress(name, workers, p)
            rows.append(_judge({"workload": name, "workers": workers, "requests": len(reqs),
                                "capacity_tokens": cap, "results": res}))
    return rows


def _judge(row: dict) -> dict:
    res = row["results"]
    field = [p for p in FIELD if p in res]
    kv = res.get("kv_aware")
    if kv is None or not field:
        return row
    best = max(field, key=lambda p: res[p]["hit_rate_blocks"])
    row["best_field"] = best
    row["hit_ok"] = kv["hit_rate_blocks"] >= res[best]["hit_rate_blocks"] - 1e-9
    # the best field router that also meets the balance target: where it differs from
    # best_field, the extra hits of best_field come with an imbalance over 1.10
    balanced = [p for p in field if res[p]["imbalance"] <= BALANCE_TARGET]
    best_bal = max(balanced, key=lambda p: res[p]["hit_rate_blocks"]) if balanced else None
    row["best_balanced_field"] = best_bal
    row["hit_ok_balanced"] = best_bal is None or kv["hit_rate_blocks"] >= res[best_bal]["hit_rate_blocks"] - 1e-9
    row["balance_ok"] = kv["imbalance"] <= BALANCE_TARGET
    row["p99_ok"] = kv["ttft_p99_ms"] <= min(res[p]["ttft_p99_ms"] for p in field) + 1e-6
    return row


def sweep_markdown(rows: Sequence[dict]) -> str:
    """The sweep as a Markdown table (hit rates in %, p99 in ms, ✓/✗ per target); with a
    "from a peer" column (kv_aware's / the best field router's) when the peer tier ran."""
    def mark(ok):
        return "—" if ok is None else ("✓" if ok else "✗")
    peer = any("peer_hit_rate_blocks" in r for row in rows for r in row["results"].values())
    lines = ["| workload | workers | pooled | kv_aware | best field | best field at imbalance <= 1.10 | "
             + ("from a peer (kv / best field) | " if peer else "") +
             "kv imbalance | kv p99 (ms) | lowest field p99 (ms) | hit | hit (balanced field) | bal | p99 |",
             "|---|---:|---:|---:|---|---|" + ("---:|" if peer else "") + "---:|---:|---:|:-:|:-:|:-:|:-:|"]
    for row in rows:
        res = row["results"]
        kv = res.get("kv_aware", {})
        pooled = res.get(POOLED, {}).get("hit_rate_blocks")
        best = row.get("best_field")
        bal = row.get("best_balanced_field")
        bal_cell = "none" if bal is None else f"{bal} {res[bal]['hit_rate_blocks']:.2%} @{res[bal]['imbalance']:.2f}"
        field_p99 = min((res[p]["ttft_p99_ms"] for p in FIELD if p in res), default=math.nan)
        peer_cell = (f"{kv.get('peer_hit_rate_blocks', math.nan):.2%} / "
                     f"{res[best].get('peer_hit_rate_blocks', math.nan):.2%} | ") if peer and best else ""
        lines.append(
            f"| {row['workload']} | {row['workers']} | "
            f"{'—' if pooled is None else f'{pooled:.2%}'} | {kv.get('hit_rate_blocks', math.nan):.2%} | "
            f"{best} {res[best]['hit_rate_blocks']:.2%} @{res[best]['imbalance']:.2f} | {bal_cell} | {peer_cell}"
            f"{kv.get('imbalance', math.nan):.3f} | {kv.get('ttft_p99_ms', math.nan):,.0f} | {field_p99:,.0f} | "
            f"{mark(row.get('hit_ok'))} | {mark(row.get('hit_ok_balanced'))} | {mark(row.get('balance_ok'))} | "
            f"{mark(row.get('p99_ok'))} |"
            if best else f"| {row['workload']} | {row['workers']} |" + " |" * (12 if peer else 11))
    return "\n".join(lines) + "\n"


#: What the printed table's columns mean (printed under it).
LEGEND = """
pooled: one LRU cache of the whole fleet's capacity behind one queue (a reference, not a bound).
best field: the field router (sglang_cache_aware, ray_prefix_affinity, dynamo_kv, llmd_precise)
with the most hits, @ its imbalance (max over mean of per-worker request counts).
hit: kv_aware's hit rate >= the best field router's; hit (balanced field): >= the best among
field routers with imbalance <= 1.10 (none: no such router); bal: kv_aware's imbalance <= 1.10;
p99: kv_aware's TTFT p99 <= the lowest field router's."""


def _fleets(text: str) -> list[int]:
    """argparse type of ``--workers``: comma-separated fleet sizes, each >= 1."""
    parse = positive_int("--workers")
    sizes = [parse(x.strip()) for x in text.split(",") if x.strip()]
    if not sizes:
        raise argparse.ArgumentTypeError("--workers takes comma-separated fleet sizes >= 1 (e.g. 10,100)")
    return sizes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvmesh.bench.route_sweep", description=__doc__.split("\n")[0])
    p.add_argument("--workloads", default="tuning,held-out",
                   help=f"comma-separated; 'tuning' and 'held-out' name the two sets (default: both): "
                        f"{', '.join(WORKLOADS)}")
    p.add_argument("--workers", type=_fleets, default=[10, 100], help="comma-separated fleet sizes (default 10,100)")
    p.add_argument("--load", type=positive_float("--load"), default=0.7,
                   help="generated workloads: cold prefill load as a fraction of the fleet's capacity (default 0.7)")
    p.add_argument("--pressure", type=positive_float("--pressure"), default=0.3,
                   help="generated workloads: fleet KV capacity as a fraction of the distinct tokens (default 0.3)")
    p.add_argument("--mooncake-requests", type=positive_int("--mooncake-requests"), default=None,
                   help="first N requests of the bundled trace (default: all 12,031)")
    p.add_argument("--policies", default=",".join((POOLED, "kv_aware", *FIELD)),
                   help="comma-separated (default: pooled, kv_aware and the four field routers)")
    p.add_argument("--kv-aware", default="{}", help="JSON of kv_aware constructor arguments (default: {})")
    add_peer_fetch_args(p)
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    args = p.parse_args(argv)
    fleets = args.workers
    try:
        # finite numbers only (no NaN or strings); null only where it means "off"
        kw = numeric_kwargs(args.kv_aware, "--kv-aware", nullable=("escape_prompts", "share_tokens_cap"))
    except ValueError as exc:
        p.error(str(exc))
    known = [n for n in inspect.signature(POLICIES["kv_aware"]).parameters if n != "self"]
    unknown = [k for k in kw if k not in known]
    if unknown:
        p.error(f"--kv-aware: unknown argument(s) {', '.join(unknown)}; kv_aware takes {', '.join(known)}")
    try:
        make_policy("kv_aware", **kw)  # out-of-range arguments, before any replay
    except (ValueError, TypeError) as exc:
        p.error(f"--kv-aware takes a JSON object of kv_aware's constructor arguments: {exc}")
    names = []
    for x in args.workloads.split(","):
        x = x.strip()
        names.extend(TUNING if x == "tuning" else HELD_OUT if x == "held-out" else [x] if x else [])
    if not names:
        p.error("--workloads names no workload (give 'tuning', 'held-out' or names, comma-separated)")
    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    unknown = [x for x in policies if x not in POLICIES and x != POOLED]
    if unknown or not policies:
        p.error(f"--policies: unknown {', '.join(unknown) or '(none given)'}; known: {POOLED}, "
                f"{', '.join(sorted(POLICIES))}")
    if args.json:  # checked before the sweep (a temporary file in its folder, removed), not after it
        problem = output_file_problem(args.json, "--json")
        if problem:
            p.error(problem)
    try:
        peer_fetch = peer_fetch_from_args(args)
    except ValueError as exc:
        p.error(str(exc))
    total = len(names) * len(fleets) * len(policies)
    done = [0]
    t0 = time.monotonic()

    def progress(name, workers, policy):
        done[0] += 1
        if not args.quiet:
            el = time.monotonic() - t0
            eta = el / done[0] * (total - done[0])
            print(f"[{done[0]}/{total}] {name} x{workers} {policy}  {el:.0f}s elapsed, ETA {eta:.0f}s",
                  file=sys.stderr, flush=True)
    try:
        rows = run_sweep(names, fleets, args.load, args.pressure, policies, args.mooncake_requests, kw,
                         progress=progress, peer_fetch=peer_fetch)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        try:
            Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
        except OSError as exc:
            print(f"error: --json {args.json}: {exc.strerror or exc}", file=sys.stderr)
            return 2
    print(sweep_markdown(rows), end="")
    print(LEGEND)
    return 0


if __name__ == "__main__":
    sys.exit(main())
