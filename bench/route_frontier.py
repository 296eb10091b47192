"""What a workload lets a router reach: hit rate against TTFT p99 when each prefix group is split.

``python -m kvmesh.bench.route_frontier --workloads bursty,ho-bursty`` replays a sweep
workload (`bench.route_sweep`) through a reference rule that is told each request's group
(the prefix it shares, read off its first block) and splits every group at a fixed pace,
then prints the hit rate, TTFT p99 and imbalance it reaches at each pace, next to kv_aware
and the field's routers on the same caches and load.

The reference rule, ``split every M``: a group's first request goes to the worker with the
least queued prefill; each further ``M`` requests of the group open one more worker (the
least queued of those not serving it yet); a request goes to the least queued worker
serving its group (ties: the smaller routed share). ``M = inf`` keeps every group whole;
small ``M`` spreads a group as soon as it arrives. Splitting a group costs one more
prefill of its prefix and one more copy in the caches, and buys a shorter queue behind it,
so the points trace the trade-off between the two targets of docs/ROUTING.md ("hit rate >=
the best field router's" and "TTFT p99 <= every field router's") on that workload.

It is not a router (it needs to know the groups, and it ignores everything else), and not a
proof: a rule that splits some groups and not others could lie beyond these points. It
shows whether the two targets are far apart on a workload: where every pace that reaches
the best field router's hit rate has a p99 far over the lowest field p99, no router of this
family meets both (on ``bursty``: whole bursts give SGLang's hit rate at about twice
Dynamo's p99).
"""
from __future__ import annotations

import argparse
import math
import sys
from typing import Sequence

from kvmesh.bench.route_sweep import FIELD, workloads
from kvmesh.bench.sim import prepare, simulate
from kvmesh.services.cli_checks import positive_float, positive_int
from kvmesh.services.policies import RoutingPolicy, WorkerView

__all__ = ["SplitEvery", "frontier", "frontier_markdown", "main"]

#: Paces (requests per extra worker) tried by default; inf keeps every group whole.
DEFAULT_PACES = (math.inf, 40, 30, 20, 15, 10, 7, 5)


class SplitEvery(RoutingPolicy):
    """Reference rule: every ``pace`` requests of a prefix group open one more worker for it.

    A request's group is its first block hash (the shared prefix of the sweep's grouped
    workloads); requests with no full block form one group. Keeps one entry per group seen.

    It keeps the groups it has seen: use one instance per replay.

    Args:
        pace: requests per worker a group may take before it opens another (requests),
            > 0; ``math.inf``: never split.

    Raises:
        ValueError: ``pace`` is not > 0.
    """

    name = "split_every"

    def __init__(self, pace: float = math.inf):
        if not pace > 0:
            raise ValueError(f"pace must be > 0 requests (or inf), got {pace}")
        self.pace = float(pace)
        self._groups: dict[bytes | None, tuple[list[str], list[int]]] = {}

    def choose(self, req, workers, rng):
        if not workers:
            raise ValueError("no workers to route to")
        key = req.block_hashes[0] if req.block_hashes else None
        serving, seen = self._groups.setdefault(key, ([], [0]))
        by_id = {w.worker_id: w for w in workers}
        serving[:] = [wid for wid in serving if wid in by_id]

        def load(w: WorkerView):
            return w.queued_prefill_tokens, w.routed_recent, w.worker_id

        if not serving or seen[0] >= self.pace * len(serving):
            spare = [w for w in workers if w.worker_id not in serving]
            if spare:
                serving.append(min(spare, key=load).worker_id)
        seen[0] += 1
        return min((by_id[wid] for wid in serving), key=load)


def frontier(name: str, workers: int = 10, load: float = 0.7, pressure: float = 0.3,
             paces: Sequence[float] = DEFAULT_PACES, others: Sequence[str] = ("kv_aware", *FIELD)) -> dict:
    """Replay workload ``name`` (a `bench.route_sweep` workload) at each pace and through
    each policy in ``others``.

    Returns:
        ``{"workload", "workers", "load", "paces": [{pace, hit_rate_blocks, ttft_p99_ms,
        imbalance}], "policies": {name: {hit_rate_blocks, ttft_p99_ms, imbalance}}}``; hit
        rates are fractions of the workload's block references, p99 in ms.

    Raises:
        ValueError: an unknown workload or policy, or a pace not > 0.
    """
    table = {w.name: w for w, _ in workloads(pressure=pressure)}
    if name not in table:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(table)}")
    w = table[name]
    reqs = w.make(workers, load)
    cap = w.capacity_tokens(workers, reqs, w.block_tokens)
    wl = prepare(reqs, block_tokens=w.block_tokens)

    def cell(r: dict) -> dict:
        return {"hit_rate_blocks": r["hit_rate_blocks"], "ttft_p99_ms": r["ttft_ms"]["p99"],
                "imbalance": r["imbalance"]}
    out = {"workload": name, "workers": workers, "load": load, "paces": [], "policies": {}}
    for pace in paces:
        out["paces"].append({"pace": pace, **cell(simulate(wl, SplitEvery(pace), workers, cap))})
    for p in others:
        out["policies"][p] = cell(simulate(wl, p, workers, cap))
    return out


def frontier_markdown(res: dict) -> str:
    """One workload's frontier as a Markdown table, with the targets' region named."""
    field = {p: v for p, v in res["policies"].items() if p in FIELD}
    best_hit = max((v["hit_rate_blocks"] for v in field.values()), default=math.nan)
    low_p99 = min((v["ttft_p99_ms"] for v in field.values()), default=math.nan)
    lines = [f"{res['workload']}, {res['workers']} workers, load {res['load']}: best field hit rate "
             f"{best_hit:.2%}, lowest field p99 {low_p99:,.0f} ms", "",
             "| rule | hit rate | TTFT p99 (ms) | imbalance | hit >= best field | p99 <= lowest field |",
             "|---|---:|---:|---:|:-:|:-:|"]

    def row(label: str, v: dict) -> str:
        ok_hit = v["hit_rate_blocks"] >= best_hit - 1e-9
        ok_p99 = v["ttft_p99_ms"] <= low_p99 + 1e-6
        return (f"| {label} | {v['hit_rate_blocks']:.2%} | {v['ttft_p99_ms']:,.0f} | {v['imbalance']:.3f} | "
                f"{'✓' if ok_hit else '✗'} | {'✓' if ok_p99 else '✗'} |")
    for pt in res["paces"]:
        pace = "whole groups" if math.isinf(pt["pace"]) else f"split every {pt['pace']:g}"
        lines.append(row(pace, pt))
    for p, v in res["policies"].items():
        lines.append(row(f"**{p}**" if p == "kv_aware" else p, v))
    return "\n".join(lines) + "\n"


def _pace(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"pace {text!r} is not a number (use inf to keep groups whole)") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"pace must be > 0 requests, got {text}")
    return v


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvmesh.bench.route_frontier", description=__doc__.split("\n")[0])
    p.add_argument("--workloads", default="bursty,ho-bursty",
                   help="comma-separated bench.route_sweep workloads (default: bursty,ho-bursty)")
    paces = ",".join("inf" if math.isinf(x) else str(x) for x in DEFAULT_PACES)
    p.add_argument("--workers", type=positive_int("--workers"), default=10, help="fleet size (default 10)")
    p.add_argument("--load", type=positive_float("--load"), default=0.7,
                   help="cold prefill load, fraction of capacity (default 0.7)")
    p.add_argument("--paces", default=paces,
                   help=f"comma-separated requests per extra worker; inf = whole groups (default {paces})")
    args = p.parse_args(argv)
    try:
        paces = [_pace(x) for x in args.paces.split(",") if x.strip()]
    except argparse.ArgumentTypeError as exc:
        p.error(str(exc))
    names = [x.strip() for x in args.workloads.split(",") if x.strip()]
    if not paces or not names:
        p.error("--paces and --workloads must each name at least one value")
    for name in names:
        try:
            res = frontier(name, args.workers, args.load, paces=paces)
        except ValueError as exc:
            p.error(str(exc))
        print(frontier_markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
