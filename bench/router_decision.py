"""Cost of one routing decision in the live router, by fleet size: shortlist against every worker.

``python -m kvmesh.bench.router_decision [--workers 10,100,1000] [--rounds 5] [--json]``

Builds a `services.router.RouterServicer` over a `services.cluster_index.ClusterIndex`
holding, for each of N workers, a few cached prompt prefixes (chains of block hashes, some
shared by several workers), and a fixed set of N leases with loads. It then times the
router's per-request work after hashing, in the order `RouterServicer._generate` does it,
without the network: read the fleet (`_fleet`), check the context, build the views and let
kv_aware choose (`decide`), and note the choice (hashing the prompt costs both modes the
same and is left out). Two modes run on the same router state,
interleaved round by round:

* ``shortlist``: kv_aware as served, shown `services.shortlist.shortlist`'s workers
  (the deepest holders, the least routed, a random sample) once the fleet is larger than
  a shortlist;
* ``all``: the same policy shown a view of every worker (how the router worked before).

Prints, per fleet size, the median time per decision (microseconds) of each mode over the
rounds and their ratio (all / shortlist), and how often both modes picked a worker holding
the request's deepest cached prefix. Wall-clock on a shared machine: read the ratio, not
the absolute figures.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from kvmesh.cache_store.events import BlockStored, EventBatch
from kvmesh.cache_store.hashing import Namespace, hash_blocks
from kvmesh.services.cluster_index import ClusterIndex
from kvmesh.services.router import RouterServicer

BLOCK = 16
#: cached prefixes per worker, and the blocks of each
PREFIXES_PER_WORKER = 4
PREFIX_BLOCKS = 32
MODEL = "kvmesh-bench"


class _StaticLeases:
    """A subscriber whose live leases never change (`IndexSubscriber`'s read side)."""

    live_version = 1

    def __init__(self, live: dict[str, dict]):
        self._live = live

    def live_workers(self) -> dict[str, dict]:
        return dict(self._live)


def build(num_workers: int, seed: int = 0) -> tuple[RouterServicer, list[list[int]]]:
    """A router over ``num_workers`` leases and an index of their prefixes; the prompts
    (token ids) whose prefixes are cached somewhere."""
    rng = random.Random(seed)
    root = Namespace(model_id=MODEL).root_hash()
    index = ClusterIndex()
    live: dict[str, dict] = {}
    prompts = []
    for i in range(num_workers):
        wid = f"w{i:04d}"
        live[wid] = {"address": f"127.0.0.1:{20000 + i}", "model_id": MODEL, "block_size": BLOCK, "max_model_len": 32768,
                     "ts": time.time(), "load": {"running_requests": rng.randrange(8),
                                                 "queued_prefill_tokens": rng.randrange(4096),
                                                 "free_blocks": 1000, "total_blocks": 4000}}
        for _ in range(PREFIXES_PER_WORKER):
            ids = [rng.randrange(32000) for _ in range(PREFIX_BLOCKS * BLOCK)]
            prompts.append(ids)
            hashes = list(hash_blocks(ids, BLOCK, root).hashes)
            holders = [wid] + [f"w{rng.randrange(num_workers):04d}" for _ in range(rng.randrange(3))]
            for w in holders:
                applied = index.apply_batch(EventBatch(w, (index.last_seq(w) or 0) + 1, time.time(),
                                                       [BlockStored(hashes, None, ids, BLOCK, "device")]))
                assert applied
    router = RouterServicer(index, _StaticLeases(live), seed=seed)
    return router, prompts


def decide_once(router: RouterServicer, num_tokens: int, hashes: list[bytes], max_tokens: int = 16) -> str:
    """One decision as `_generate` makes it, from its block hashes on; the chosen worker."""
    fleet = router._fleet()
    ids_of_live = fleet.ids if fleet.min_context is None or num_tokens + max_tokens <= fleet.min_context else None
    chosen, _, _ = router.decide(fleet.usable, num_tokens, hashes, BLOCK, time.monotonic(), set(), None, ids_of_live)
    router._note_routed(chosen.worker_id, num_tokens - chosen.matched_blocks * BLOCK)
    st = router._inflight[chosen.worker_id]  # as if the request ended at once
    st.running, st.pending_prefill_tokens = 0, 0
    return chosen.worker_id


def measure(num_workers: int, rounds: int, per_round: int, seed: int = 0) -> dict:
    routers = {}
    for mode in ("shortlist", "all"):
        router, prompts = build(num_workers, seed)
        if mode == "all":
            router.policy.uses_shortlist = False
        routers[mode] = router
    root = Namespace(model_id=MODEL).root_hash()
    rng = random.Random(seed + 1)
    times: dict[str, list[float]] = {m: [] for m in routers}
    deepest: dict[str, int] = {m: 0 for m in routers}
    for _ in range(rounds):
        picks = []
        for _ in range(per_round):
            ids = rng.choice(prompts) + [rng.randrange(32000) for _ in range(64)]
            picks.append((len(ids), list(hash_blocks(ids, BLOCK, root).hashes)))
        for mode, router in routers.items():
            t0 = time.perf_counter()
            chosen = [decide_once(router, n, hashes) for n, hashes in picks]
            times[mode].append((time.perf_counter() - t0) / per_round)
            now = time.monotonic()
            for wid, (_, hashes) in zip(chosen, picks):  # outside the timing: did it pick a deepest holder?
                matches = router.index.match(hashes, now)
                best = max((m.num_blocks for m in matches.values()), default=0)
                deepest[mode] += (matches[wid].num_blocks if wid in matches else 0) >= best
    total = rounds * per_round
    out = {"workers": num_workers}
    for mode in routers:
        out[f"{mode}_us"] = round(statistics.median(times[mode]) * 1e6, 1)
        out[f"{mode}_deepest_holder"] = round(deepest[mode] / total, 3)
    out["all_over_shortlist"] = round(statistics.median(a / s for a, s in zip(times["all"], times["shortlist"])), 2)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvmesh.bench.router_decision", description=__doc__.split("\n")[0])
    ap.add_argument("--workers", default="10,100,1000", help="fleet sizes, comma-separated (default 10,100,1000)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds per size (default 5)")
    ap.add_argument("--per-round", type=int, default=200, help="decisions per mode per round (default 200)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    try:
        sizes = [int(x) for x in args.workers.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--workers takes comma-separated integers, got {args.workers!r}")
    if not sizes or min(sizes) < 1 or args.rounds < 1 or args.per_round < 1:
        ap.error("--workers sizes, --rounds and --per-round must be >= 1")
    rows = [measure(n, args.rounds, args.per_round) for n in sizes]
    if args.json:
        print(json.dumps({"rows": rows}))
    else:
        print("workers  shortlist us  all us  all/shortlist  deepest holder (shortlist / all)")
        for r in rows:
            print(f"{r['workers']:>7}  {r['shortlist_us']:>12}  {r['all_us']:>6}  {r['all_over_shortlist']:>13}  "
                  f"{r['shortlist_deepest_holder']} / {r['all_deepest_holder']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
