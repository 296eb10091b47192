"""Overload with client deadlines: goodput with and without deadline shedding, side by side.

``python -m kvmesh.bench.deadline_shed [--json]`` runs the built-in model's engine in this
process and offers it more requests than it can serve: unique prompts of
``--prompt-tokens`` tokens (nothing to reuse), ``--max-tokens`` output tokens each,
arriving at ``--load`` times the engine's measured capacity (16 requests submitted at once,
after warm-up) for ``--seconds`` seconds
(Poisson arrivals, one seed for every mode). Each request's client gives up at its
deadline, ``--deadline-x`` times one request's TTFT on the idle engine after its arrival,
and aborts the request then (what a gRPC deadline does to a worker's request).

Modes, run in turn within each round (``--rounds``), so machine noise hits all alike:
    off: the engine is not told the deadline (it learns only from the abort);
    shed F: the engine gets the deadline and sheds with ``deadline_shed_factor`` F
        (``--factors``, default "0,0.25,1": 0 sheds only requests already past it), raised
        while admitted requests miss (`workers.scheduler.DeadlinePressure`), as served;
    fixed F: the same with the factor held at F (``--fixed-factors``, default "0.25"), to
        show what the raising adds.

Per mode (medians over rounds): ``goodput`` (requests finished before their deadline, per
second offered), ``on_time`` (their share of the requests), ``shed`` (requests failed
before their prefill), ``wasted_prefill_tokens`` (prompt tokens computed for requests that
then missed their deadline: the engine's own count of computed prompt tokens minus those of
on-time requests), and the on-time requests' TTFT p50. ``goodput_ratio`` is each shed
mode's goodput over ``off``'s.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time


def _engine(factor: float, num_blocks: int, fixed: bool = False):
    from kvmesh.workers.engine import Engine
    from kvmesh.workers.scheduler import DeadlinePressure

    engine = Engine(num_blocks=num_blocks, block_size=16, deadline_shed_factor=factor)
    if fixed:  # one multiplier for every tenant that outcomes never move
        held = DeadlinePressure()
        held.note = lambda *args, **kwargs: None
        engine.scheduler.deadline_pressure = lambda tenant: held
    return engine.start()


def _capacity(engine, prompt_tokens: int, max_tokens: int, rng: random.Random) -> tuple[float, float]:
    """(median TTFT seconds of one request alone over 3 runs, requests per second when 16
    are submitted together), after two unrecorded warm-up requests."""
    from kvmesh.workers.request import SamplingParams

    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)

    def fresh() -> list[int]:
        return [rng.randrange(256) for _ in range(prompt_tokens)]

    for _ in range(2):
        engine.generate(fresh(), sampling)
    ttft = statistics.median(engine.generate(fresh(), sampling)["timing"]["ttft_ms"] / 1000 for _ in range(3))
    done = threading.Semaphore(0)
    t0 = time.monotonic()
    for _ in range(16):
        engine.submit(fresh(), sampling, lambda o: o.finished and done.release())
    for _ in range(16):
        done.acquire(timeout=600)
    return ttft, 16 / (time.monotonic() - t0)


def run_mode(engine, arrivals: list[float], prompts: list[list[int]], max_tokens: int, deadline_s: float,
             tell_engine: bool) -> dict:
    """Offer ``prompts`` at ``arrivals`` (seconds from start); each is aborted at its
    deadline unless finished. Returns the mode's counts (see the module docstring)."""
    from kvmesh.workers.request import SamplingParams

    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    lock = threading.Lock()
    results: list[dict] = [{} for _ in prompts]
    finished = threading.Semaphore(0)
    timers: list[threading.Timer] = []
    computed_before = engine.computed_prompt_tokens
    shed_before = engine.scheduler.num_shed
    start = time.monotonic()

    def collector(i: int, sent: float):
        slot = results[i]

        def on_output(o):
            with lock:
                if o.new_token_ids and "first" not in slot:
                    slot["first"] = time.monotonic() - sent
                if o.finished and "end" not in slot:
                    slot["end"] = time.monotonic() - sent
                    slot["error_code"] = o.error_code
                    slot["prompt_computed"] = (o.usage or {}).get("computed_prefill_tokens", 0)
                    finished.release()
        return on_output

    def give_up(i: int, rid: str):
        with lock:
            if "end" in results[i]:
                return
            results[i].update(end=deadline_s, error_code="ABORTED")
        engine.abort(rid)
        finished.release()

    for i, (at, ids) in enumerate(zip(arrivals, prompts)):
        delay = start + at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        sent = time.monotonic()
        rid = engine.submit(ids, sampling, collector(i, sent),
                            deadline=sent + deadline_s if tell_engine else None)
        t = threading.Timer(deadline_s, give_up, (i, rid))
        t.daemon = True
        t.start()
        timers.append(t)
    for _ in prompts:
        finished.acquire(timeout=deadline_s + 60)
    for t in timers:
        t.cancel()
    time.sleep(0.2)  # aborts reach the engine thread
    on_time = [r for r in results if not r.get("error_code") and r.get("end", 1e9) <= deadline_s]
    computed = engine.computed_prompt_tokens - computed_before
    span = max(arrivals[-1], 1e-9)
    return {
        "requests": len(prompts),
        "on_time": len(on_time) / len(prompts),
        "goodput": len(on_time) / span,
        "shed": engine.scheduler.num_shed - shed_before,
        "wasted_prefill_tokens": computed - sum(r["prompt_computed"] for r in on_time),
        "ttft_p50_s": statistics.median([r["first"] for r in on_time]) if on_time else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvmesh.bench.deadline_shed", description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--load", type=float, default=2.0, help="offered requests / the engine's capacity")
    parser.add_argument("--seconds", type=float, default=12.0, help="how long requests arrive")
    parser.add_argument("--deadline-x", type=float, default=4.0,
                        help="each request's deadline, in idle-engine TTFTs after its arrival")
    parser.add_argument("--factors", default="0,0.25,1", help="deadline_shed_factor values to compare")
    parser.add_argument("--fixed-factors", default="0.25",
                        help="deadline_shed_factor values to run held fixed as well (\"\": none)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    factors = [float(f) for f in args.factors.split(",") if f.strip()]
    fixed = [float(f) for f in args.fixed_factors.split(",") if f.strip()]
    modes = [("off", None)] + [(f"shed {f:g}", f) for f in factors] + [(f"fixed {f:g}", f) for f in fixed]
    num_blocks = 4096
    engines = {name: _engine(f if f is not None else 0.0, num_blocks, fixed=name.startswith("fixed"))
               for name, f in modes}
    rng = random.Random(args.seed)
    try:
        ttft, capacity = _capacity(engines["off"], args.prompt_tokens, args.max_tokens, rng)
        for name, _ in modes[1:]:
            _capacity(engines[name], args.prompt_tokens, args.max_tokens, rng)  # warm: the rate is measured
        rate = args.load * capacity  # requests per second offered
        deadline_s = args.deadline_x * ttft
        per_mode: dict[str, list[dict]] = {name: [] for name, _ in modes}
        for r in range(args.rounds):
            arng = random.Random(args.seed * 1000 + r)
            arrivals, t = [], 0.0
            while t < args.seconds:
                arrivals.append(t)
                t += arng.expovariate(rate)
            prompts = [[arng.randrange(256) for _ in range(args.prompt_tokens)] for _ in arrivals]
            for name, factor in modes:
                engines[name].clear_cache()
                per_mode[name].append(run_mode(engines[name], arrivals, prompts, args.max_tokens, deadline_s,
                                               tell_engine=factor is not None))
    finally:
        for e in engines.values():
            e.stop()

    def med(rows: list[dict], key: str):
        vals = [row[key] for row in rows if row[key] is not None]
        return statistics.median(vals) if vals else None

    summary = {name: {k: med(rows, k) for k in rows[0]} for name, rows in per_mode.items()}
    base = summary["off"]["goodput"] or 0.0
    out = {
        "idle_ttft_s": round(ttft, 4), "capacity_per_s": round(capacity, 3), "offered_per_s": round(rate, 3),
        "deadline_s": round(deadline_s, 3), "modes": summary,
        "goodput_ratio": {name: (summary[name]["goodput"] / base if base else None) for name, _ in modes[1:]},
    }
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print(f"idle TTFT {ttft:.3f} s, capacity {capacity:.2f}/s; offered {rate:.2f}/s for {args.seconds:g} s; "
              f"deadline {deadline_s:.2f} s; medians of {args.rounds} rounds")
        print(f"{'mode':<10} {'on time':>8} {'goodput/s':>10} {'shed':>6} {'wasted prefill':>15} {'TTFT p50':>9}")
        for name, s in summary.items():
            p50 = f"{s['ttft_p50_s']:.3f}" if s["ttft_p50_s"] is not None else "-"
            print(f"{name:<10} {s['on_time']:>8.2f} {s['goodput']:>10.2f} {s['shed']:>6.0f} "
                  f"{s['wasted_prefill_tokens']:>15.0f} {p50:>9}")
        for name, ratio in out["goodput_ratio"].items():
            print(f"goodput {name} / off: {ratio:.2f}" if ratio is not None else f"goodput {name} / off: -")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
