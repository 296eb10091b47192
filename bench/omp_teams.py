"""Does torch work on a long-lived helper thread slow the engine thread's steps?

``python -m kvmesh.bench.omp_teams [--rounds N] [--threads N] [--json]``

Each round starts three fresh processes, in rotating order, each with an "engine" thread
that runs a step (32 matmuls of ``[256, 512] x [512, 1376]`` in float32, the issue-12
model's gate projection over a 256-token chunk) after every 50 ms idle gap, 10 steps
before and 30 after one element-wise op over 4M floats (about what encoding a few large KV
blocks costs) that runs:

* ``none``: nowhere (the control);
* ``pool``: on a thread of a ``ThreadPoolExecutor`` that stays alive (what
  ``asyncio.to_thread`` and writer loops are);
* ``fresh``: on a short-lived thread (`cache_store.fresh_thread.run_on_fresh_thread`).

Reported per case: the median over rounds of (median step time after) / (median step
time before). OpenMP keeps a thread team per thread that ran a parallel region; ``pool``
above ``none`` is what an idle team on a long-lived thread costs the engine, ``fresh``
near ``none`` shows the short-lived thread avoids it (`cache_store.fresh_thread`).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CASES = ("none", "pool", "fresh")

_CHILD = r"""
import statistics, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
import torch
from kvmesh.cache_store.fresh_thread import run_on_fresh_thread
torch.set_num_threads(int(sys.argv[2]))
case = sys.argv[1]
a, w, big = torch.randn(256, 512), torch.randn(512, 1376), torch.randn(4_000_000)
pool = ThreadPoolExecutor(1)

def helper():
    (big * 0.5).to(torch.bfloat16).float().sum()

def engine(out):
    for i in range(40):
        if i == 10 and case == "pool":
            pool.submit(helper).result()
        elif i == 10 and case == "fresh":
            run_on_fresh_thread(helper)
        time.sleep(0.05)
        t = time.perf_counter()
        for _ in range(32):
            torch.mm(a, w)
        out.append(time.perf_counter() - t)

steps = []
t = threading.Thread(target=engine, args=(steps,))
t.start()
t.join()
print(statistics.median(steps[12:]) / statistics.median(steps[2:10]))
"""


def run(rounds: int = 5, threads: int = 2) -> dict:
    """``{case: {"after_over_before": median ratio, "rounds": [...]}}`` (see the module doc)."""
    ratios: dict[str, list[float]] = {c: [] for c in CASES}
    for r in range(rounds):
        for k in range(len(CASES)):
            case = CASES[(r + k) % len(CASES)]
            out = subprocess.run([sys.executable, "-c", _CHILD, case, str(threads)], check=True,
                                 capture_output=True, text=True)
            ratios[case].append(float(out.stdout.strip().splitlines()[-1]))
    return {c: {"after_over_before": round(statistics.median(v), 3), "rounds": [round(x, 3) for x in v]}
            for c, v in ratios.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvmesh.bench.omp_teams", description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5, help="processes per case (default 5)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.threads < 1:
        p.error("--rounds and --threads must be >= 1")
    res = run(args.rounds, args.threads)
    control = res["none"]["after_over_before"]
    if abs(control - 1.0) > 0.05:
        print(f"warning: the control (no op) moved by {control - 1:+.0%}: other jobs are disturbing this machine; "
              "rerun with more --rounds on a quiet one", file=sys.stderr)
    if args.json:
        print(json.dumps(res))
    else:
        print("case   engine step after / before the helper's op (median over rounds)")
        for c, v in res.items():
            print(f"{c:6s} {v['after_over_before']:.3f}   rounds {v['rounds']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
