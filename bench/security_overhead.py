"""What security costs a request: a plain cluster and a secure one (mutual TLS between
router and worker, TLS + API key from the client, passworded Redis), side by side in one run.

Both clusters run one worker with the built-in model. Each sends the same requests: short
prompts (``--prompt-tokens``, distinct so nothing is cached) with ``--max-tokens`` outputs,
one at a time over one reused client channel, so the numbers are per-request latency
(client-measured end to end, ms) where the TLS record layer and the API key check add
their cost; and separately the time to open a fresh connection and finish its first
request (TLS handshakes included, ``connect_ms``).

    python -m kvmesh.bench.security_overhead [--requests 40] [--prompt-tokens 64] [--max-tokens 2] [--json]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def measure(secure: bool, requests: int, prompt_tokens: int, max_tokens: int, seed: int = 0) -> dict:
    """Latencies of one cluster (secure or not): ``e2e_ms`` p50/p90/mean and ``connect_ms`` median."""
    from kvmesh.services.cli import generate
    from kvmesh.services.launcher import ClusterSpec, LocalCluster
    from kvmesh.services.security import client_channel

    rng = random.Random(seed)
    prompts = [[rng.randrange(256) for _ in range(prompt_tokens)] for _ in range(requests + 3)]
    with LocalCluster(ClusterSpec(num_workers=1, num_blocks=1024, threads_per_worker=1, secure=secure)) as c:
        opts = c.client_options()
        e2e, connect = [], []
        with client_channel(c.router_address, **opts) as ch:
            for p in prompts[:3]:  # warm-up: model, channels router -> worker
                generate(c.router_address, token_ids=p, max_tokens=max_tokens, channel=ch)
            for p in prompts[3:]:
                t0 = time.perf_counter()
                generate(c.router_address, token_ids=p, max_tokens=max_tokens, channel=ch)
                e2e.append(1000 * (time.perf_counter() - t0))
        for p in prompts[:5]:
            t0 = time.perf_counter()
            generate(c.router_address, token_ids=p, max_tokens=1, **opts)  # a fresh channel each time
            connect.append(1000 * (time.perf_counter() - t0))
    return {"secure": secure, "requests": requests, "e2e_ms": {"p50": _pct(e2e, 0.5), "p90": _pct(e2e, 0.9),
                                                               "mean": statistics.fmean(e2e)},
            "connect_ms": statistics.median(connect)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvmesh.bench.security_overhead",
                                description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--requests", type=int, default=40, help="requests per cluster (default 40)")
    p.add_argument("--prompt-tokens", type=int, default=64, help="tokens of each (distinct) prompt (default 64)")
    p.add_argument("--max-tokens", type=int, default=2, help="output tokens of each request (default 2)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    a = p.parse_args(argv)
    plain, secure = (measure(s, a.requests, a.prompt_tokens, a.max_tokens) for s in (False, True))
    ratio = {k: secure["e2e_ms"][k] / plain["e2e_ms"][k] for k in ("p50", "p90", "mean")}
    out = {"plain": plain, "secure": secure, "secure_over_plain": {**ratio,
                                                                   "connect": secure["connect_ms"] / plain["connect_ms"]}}
    if a.json:
        print(json.dumps(out, indent=2))
    else:
        print("| cluster | e2e ms p50 / p90 / mean | fresh connection + first request, ms |\n|---|---:|---:|")
        for name, r in (("plain", plain), ("secure (mTLS, TLS + API key)", secure)):
            e = r["e2e_ms"]
            print(f"| {name} | {e['p50']:.1f} / {e['p90']:.1f} / {e['mean']:.1f} | {r['connect_ms']:.1f} |")
        o = out["secure_over_plain"]
        print(f"| secure / plain | {o['p50']:.2f} / {o['p90']:.2f} / {o['mean']:.2f} | {o['connect']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
