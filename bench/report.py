"""Benchmark statistics and Markdown reports. Every function here is pure.

A *record* is the outcome of one replayed request, as the harness builds it::

    {
      "index": 0,                       # position in the trace
      "ok": True, "code": "OK", "error": "",
      "prompt_tokens": 34, "cached_tokens": 16, "computed_prefill_tokens": 18,
      "completion_tokens": 4, "cached_tokens_by_tier": {"device": 16},
      "block_lengths": [16, 16, 2],     # synthesized tokens of each trace block
      "ttft_ms": 12.5, "e2e_ms": 40.1,  # measured by the client
      "server_ttft_ms": 11.9, "server_e2e_ms": 39.0, "queue_ms": 0.4, "prefill_ms": 10.2,
      "worker_id": "w0", "start_s": 0.0, "end_s": 0.04,   # seconds from the run's start
      "itl_ms": [9.1, 9.3, 9.0],        # gaps between streamed messages, client side
    }

Failed requests have ``ok`` False, the gRPC status code name in ``code`` and the message in
``error``; their other fields may be missing. Requests cut off at a run's grace deadline
have ``cancelled`` True and code ``CANCELLED``; they are counted apart from errors. Token
and latency figures are taken over the requests that succeeded.

Latency definitions follow vLLM's ``benchmarks/benchmark_serving.py``: TTFT is the time
from sending a request to its first streamed token; TPOT ("time per output token,
excluding the first") is ``(e2e - ttft) / (completion_tokens - 1)``; ITL ("inter-token
latency") is every gap between consecutive streamed messages, pooled over all requests
(a kvmesh worker streams one message per engine step); goodput is the number of
requests that meet every given SLO, divided by the run's duration.
"""
from __future__ import annotations

import math
from typing import Iterable, Sequence

PERCENTILES = (50, 90, 99)

#: How many error messages a result keeps.
MAX_ERRORS_KEPT = 5


def percentiles(values: Iterable[float], ps: Sequence[float] = PERCENTILES) -> list[float | None]:
    """Percentiles of ``values`` for each p in ``ps`` (0..100), by linear interpolation.

    Matches ``numpy.percentile(values, ps)`` with its default method. An empty input gives
    None for every p.
    """
    xs = sorted(float(v) for v in values)
    out: list[float | None] = []
    for p in ps:
        if not 0 <= p <= 100:
            raise ValueError(f"percentile must be within [0, 100], got {p}")
        if not xs:
            out.append(None)
            continue
        rank = (len(xs) - 1) * (p / 100.0)
        lo = math.floor(rank)
        hi = min(lo + 1, len(xs) - 1)
        frac = rank - lo
        out.append(xs[lo] + (xs[hi] - xs[lo]) * frac)
    return out


def percentile_dict(values: Iterable[float], ps: Sequence[float] = PERCENTILES, ndigits: int = 3) -> dict:
    """``{"p50": ..., "p90": ..., "p99": ...}`` (None where there are no values)."""
    vals = percentiles(values, ps)
    return {f"p{p:g}": (None if v is None else round(v, ndigits)) for p, v in zip(ps, vals)}


def covered_blocks(block_lengths: Sequence[int], cached_tokens: int) -> int:
    """Leading trace blocks whose synthesized tokens all lie within the first ``cached_tokens``."""
    end = 0
    n = 0
    for length in block_lengths:
        end += length
        if end > cached_tokens:
            break
        n += 1
    return n


def _ratio(num: float, den: float) -> float:
    return (num / den) if den else 0.0


def _mean(values: Iterable[float], ndigits: int = 3) -> float | None:
    xs = [float(v) for v in values]
    return round(sum(xs) / len(xs), ndigits) if xs else None


# ---------------------------------------------------------------------------- latency metrics


def tpot_ms(record: dict) -> float | None:
    """Time per output token after the first, ms: ``(e2e_ms - ttft_ms) / (completion_tokens - 1)``.

    None for a failed request and for one with fewer than 2 completion tokens (it has no
    decode step to time). Definition of vLLM's ``benchmark_serving`` (TPOT excludes the
    first token).
    """
    if not record.get("ok"):
        return None
    n = int(record.get("completion_tokens") or 0)
    ttft, e2e = record.get("ttft_ms"), record.get("e2e_ms")
    if n < 2 or ttft is None or e2e is None:
        return None
    return (float(e2e) - float(ttft)) / (n - 1)


def itl_values(records: Iterable[dict]) -> list[float]:
    """Inter-token latencies, ms: the ``itl_ms`` gaps of every successful request, pooled."""
    out: list[float] = []
    for r in records:
        if r.get("ok"):
            out.extend(float(x) for x in (r.get("itl_ms") or ()))
    return out


#: SLO keys: a request is good when each given bound holds (values in ms).
SLO_KEYS = ("ttft_ms", "tpot_ms", "e2e_ms")


def make_slo(ttft_ms: float | None = None, tpot_ms: float | None = None, e2e_ms: float | None = None) -> dict:
    """Service-level objectives in ms, only the ones given: e.g. ``{"ttft_ms": 500.0}``.

    Raises:
        ValueError: a bound that is not a finite number > 0.
    """
    out = {}
    for key, value in (("ttft_ms", ttft_ms), ("tpot_ms", tpot_ms), ("e2e_ms", e2e_ms)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"SLO {key} must be a finite number of milliseconds > 0, got {value!r}")
        out[key] = float(value)
    return out


def meets_slo(record: dict, slo: dict) -> bool:
    """Whether a request succeeded and met every bound of ``slo`` (see `make_slo`).

    As in vLLM's ``benchmark_serving`` goodput, a bound holds when the request's value is
    at most the bound, and a request with a single completion token has a TPOT of 0.
    """
    if not record.get("ok"):
        return False
    for key, bound in slo.items():
        if key == "tpot_ms":
            value = tpot_ms(record) or 0.0
        elif key in ("ttft_ms", "e2e_ms"):
            value = record.get(key)
            if value is None:
                return False
        else:
            raise ValueError(f"unknown SLO key {key!r}; known: {', '.join(SLO_KEYS)}")
        if float(value) > bound:
            return False
    return True


def goodput(records: Sequence[dict], duration_s: float, slo: dict) -> dict:
    """Requests per second that met every SLO (vLLM ``benchmark_serving``'s ``request_goodput``).

    Returns ``{"good_requests": n, "goodput": n / duration_s (requests/s),
    "slo_attainment": n / len(records)}``; the last two are 0.0 when undefined. Failed and
    cancelled requests count in the denominator of ``slo_attainment`` and are never good.
    """
    good = sum(1 for r in records if meets_slo(r, slo))
    return {"good_requests": good, "goodput": round(_ratio(good, duration_s), 4),
            "slo_attainment": round(_ratio(good, len(records)), 6)}


# ---------------------------------------------------------------------------- series for plots


def ecdf(values: Iterable[float]) -> tuple[list[float], list[float]]:
    """Empirical CDF: sorted values and, for the i-th (1-based), the fraction i / n."""
    xs = sorted(float(v) for v in values)
    n = len(xs)
    return xs, [(i + 1) / n for i in range(n)]


def hit_rate_series(records: Sequence[dict], num_bins: int = 20) -> list[dict]:
    """Prefix-cache token hit rate over time, binned by request completion time.

    The span from the earliest ``start_s`` to the latest ``end_s`` of the successful
    requests is cut into ``num_bins`` equal bins; each bin reports its end ``t_s``
    (seconds from the run's start), the ``requests`` that finished in it, their
    ``hit_rate_tokens`` (cached over prompt tokens; None when no request finished) and
    ``cumulative_hit_rate_tokens`` over every request finished by the bin's end.
    """
    if num_bins < 1:
        raise ValueError(f"num_bins must be >= 1, got {num_bins}")
    ok = [r for r in records if r.get("ok") and r.get("end_s") is not None]
    if not ok:
        return []
    t0 = min(float(r.get("start_s", r["end_s"])) for r in ok)
    t1 = max(float(r["end_s"]) for r in ok)
    width = (t1 - t0) / num_bins or 1.0
    prompt = [0] * num_bins
    cached = [0] * num_bins
    count = [0] * num_bins
    for r in ok:
        b = min(num_bins - 1, int((float(r["end_s"]) - t0) / width))
        prompt[b] += int(r.get("prompt_tokens", 0))
        cached[b] += int(r.get("cached_tokens", 0))
        count[b] += 1
    out = []
    cum_prompt = cum_cached = 0
    for b in range(num_bins):
        cum_prompt += prompt[b]
        cum_cached += cached[b]
        out.append({"t_s": round(t0 + (b + 1) * width, 4), "requests": count[b],
                    "hit_rate_tokens": round(cached[b] / prompt[b], 6) if prompt[b] else None,
                    "cumulative_hit_rate_tokens": round(cum_cached / cum_prompt, 6) if cum_prompt else None})
    return out


def in_flight_series(records: Sequence[dict]) -> dict[str, list[tuple[float, int]]]:
    """Requests in flight on each worker over time, as step points ``(t_s, count)``.

    A request counts on its ``worker_id`` from ``start_s`` to ``end_s`` (requests with no
    known worker are left out). Each worker's list starts at its first request's start,
    changes at every start and end, and ends at zero.
    """
    events: dict[str, list[tuple[float, int]]] = {}
    for r in records:
        wid = r.get("worker_id")
        if not wid or r.get("start_s") is None or r.get("end_s") is None:
            continue
        ev = events.setdefault(wid, [])
        ev.append((float(r["start_s"]), 1))
        ev.append((float(r["end_s"]), -1))
    out: dict[str, list[tuple[float, int]]] = {}
    for wid in sorted(events):
        level = 0
        points: list[tuple[float, int]] = []
        for t, step in sorted(events[wid], key=lambda e: (e[0], e[1])):  # ends before starts at a tie
            level += step
            if points and points[-1][0] == t:
                points[-1] = (t, level)
            else:
                points.append((t, level))
        out[wid] = points
    return out


def load_series(records: Sequence[dict], num_bins: int = 40) -> dict[str, list[tuple[float, float]]]:
    """Time-averaged requests in flight on each worker, per time bin: ``{worker: [(t_s, mean)]}``.

    The span from the earliest ``start_s`` to the latest ``end_s`` is cut into
    ``num_bins`` equal bins; a bin's value is the total time requests spent on that worker
    within the bin divided by the bin width (so 2.0 means two requests in flight on
    average); ``t_s`` is the bin's middle. Requests with no known worker are left out.
    """
    if num_bins < 1:
        raise ValueError(f"num_bins must be >= 1, got {num_bins}")
    spans = [(r["worker_id"], float(r["start_s"]), float(r["end_s"])) for r in records
             if r.get("worker_id") and r.get("start_s") is not None and r.get("end_s") is not None]
    if not spans:
        return {}
    t0 = min(s for _, s, _ in spans)
    t1 = max(e for _, _, e in spans)
    width = (t1 - t0) / num_bins or 1.0
    busy: dict[str, list[float]] = {}
    for wid, start, end in spans:
        acc = busy.setdefault(wid, [0.0] * num_bins)
        first = min(num_bins - 1, int((start - t0) / width))
        last = min(num_bins - 1, int((end - t0) / width))
        for b in range(first, last + 1):
            lo, hi = t0 + b * width, t0 + (b + 1) * width
            acc[b] += max(0.0, min(end, hi) - max(start, lo))
    return {wid: [(round(t0 + (b + 0.5) * width, 4), round(acc[b] / width, 4)) for b in range(num_bins)]
            for wid, acc in sorted(busy.items())}


def worker_load(records: Sequence[dict]) -> dict[str, dict]:
    """Per worker: successful ``requests`` and their ``prompt_tokens``, ``cached_tokens``,
    ``computed_prefill_tokens`` and ``completion_tokens``."""
    out: dict[str, dict] = {}
    keys = ("prompt_tokens", "cached_tokens", "computed_prefill_tokens", "completion_tokens")
    for r in records:
        if not r.get("ok"):
            continue
        d = out.setdefault(r.get("worker_id") or "?", dict.fromkeys(("requests",) + keys, 0))
        d["requests"] += 1
        for k in keys:
            d[k] += int(r.get(k, 0))
    return dict(sorted(out.items()))


def summarize(records: Sequence[dict], duration_s: float | None = None, slo: dict | None = None,
              num_bins: int = 20) -> dict:
    """Aggregate per-request records into the metric part of a bench result.

    ``duration_s`` defaults to the span from the earliest ``start_s`` to the latest
    ``end_s`` of the records. Returns num_requests, num_ok, num_errors, errors (the first few
    as "CODE: message"), error_codes (count per code), hit_rate_blocks, hit_rate_tokens,
    trace_blocks, cached_trace_blocks, prompt_tokens, cached_tokens,
    cached_tokens_by_tier, computed_prefill_tokens, completion_tokens, ttft_ms, e2e_ms,
    server_ttft_ms, server_e2e_ms, queue_ms, prefill_ms (each {p50, p90, p99}),
    request_throughput, output_throughput, worker_share and duration_s; and tpot_ms, itl_ms
    ({p50, p90, p99}), mean_ms (ttft, tpot, itl, e2e), num_cancelled, slo, good_requests,
    goodput (requests/s meeting every SLO; None without SLOs), slo_attainment,
    worker_load (`worker_load`) and hit_rate_over_time (`hit_rate_series`, ``num_bins``).
    """
    ok = [r for r in records if r.get("ok")]
    cancelled = [r for r in records if not r.get("ok") and r.get("cancelled")]
    bad = [r for r in records if not r.get("ok") and not r.get("cancelled")]
    if duration_s is None:
        starts = [r["start_s"] for r in records if r.get("start_s") is not None]
        ends = [r["end_s"] for r in records if r.get("end_s") is not None]
        duration_s = (max(ends) - min(starts)) if starts and ends else 0.0

    trace_blocks = sum(len(r.get("block_lengths") or ()) for r in ok)
    cached_trace_blocks = sum(covered_blocks(r.get("block_lengths") or (), int(r.get("cached_tokens", 0)))
                              for r in ok)
    prompt_tokens = sum(int(r.get("prompt_tokens", 0)) for r in ok)
    cached_tokens = sum(int(r.get("cached_tokens", 0)) for r in ok)
    computed = sum(int(r.get("computed_prefill_tokens", 0)) for r in ok)
    completion = sum(int(r.get("completion_tokens", 0)) for r in ok)
    by_tier: dict[str, int] = {}
    for r in ok:
        for tier, n in (r.get("cached_tokens_by_tier") or {}).items():
            by_tier[tier] = by_tier.get(tier, 0) + int(n)

    per_worker: dict[str, int] = {}
    for r in ok:
        wid = r.get("worker_id") or "?"
        per_worker[wid] = per_worker.get(wid, 0) + 1
    worker_share = {w: round(n / len(ok), 6) for w, n in sorted(per_worker.items())}

    error_codes: dict[str, int] = {}
    for r in bad:
        code = r.get("code") or "UNKNOWN"
        error_codes[code] = error_codes.get(code, 0) + 1
    errors = [(f"{r.get('code') or 'UNKNOWN'}: {r['error']}" if r.get("error") else (r.get("code") or "UNKNOWN"))
              for r in bad[:MAX_ERRORS_KEPT]]

    def lat(key: str) -> dict:
        return percentile_dict(r[key] for r in ok if r.get(key) is not None)

    tpots = [t for t in (tpot_ms(r) for r in ok) if t is not None]
    itls = itl_values(ok)
    slo = dict(slo or {})
    good = goodput(records, float(duration_s), slo) if slo else {"good_requests": None, "goodput": None,
                                                                  "slo_attainment": None}
    return {
        "num_requests": len(records),
        "num_ok": len(ok),
        "num_errors": len(bad),
        "num_cancelled": len(cancelled),
        "errors": errors,
        "error_codes": error_codes,
        "hit_rate_blocks": round(_ratio(cached_trace_blocks, trace_blocks), 6),
        "hit_rate_tokens": round(_ratio(cached_tokens, prompt_tokens), 6),
        "trace_blocks": trace_blocks,
        "cached_trace_blocks": cached_trace_blocks,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached_tokens,
        "cached_tokens_by_tier": dict(sorted(by_tier.items())),
        "computed_prefill_tokens": computed,
        "completion_tokens": completion,
        "ttft_ms": lat("ttft_ms"),
        "e2e_ms": lat("e2e_ms"),
        "tpot_ms": percentile_dict(tpots),
        "itl_ms": percentile_dict(itls),
        "mean_ms": {"ttft": _mean(r["ttft_ms"] for r in ok if r.get("ttft_ms") is not None), "tpot": _mean(tpots),
                    "itl": _mean(itls), "e2e": _mean(r["e2e_ms"] for r in ok if r.get("e2e_ms") is not None)},
        "server_ttft_ms": lat("server_ttft_ms"),
        "server_e2e_ms": lat("server_e2e_ms"),
        "queue_ms": lat("queue_ms"),
        "prefill_ms": lat("prefill_ms"),
        "request_throughput": round(_ratio(len(ok), duration_s), 4),
        "output_throughput": round(_ratio(completion, duration_s), 3),
        "worker_share": worker_share,
        "duration_s": round(float(duration_s), 3),
        "slo": slo,
        **good,
        "worker_load": worker_load(records),
        "hit_rate_over_time": hit_rate_series(records, num_bins),
    }


# ---------------------------------------------------------------------------- Markdown


def _pct(x) -> str:
    return "-" if x is None else f"{100.0 * float(x):.1f}%"


def _num(x, digits: int = 1) -> str:
    if x is None:
        return "-"
    if isinstance(x, int):
        return f"{x:,}"
    return f"{float(x):,.{digits}f}"


def _pcts(d: dict | None) -> str:
    d = d or {}
    return " / ".join(_num(d.get(k)) for k in ("p50", "p90", "p99"))


def _share(d: dict | None) -> str:
    if not d:
        return "-"
    return ", ".join(f"{w} {100.0 * f:.0f}%" for w, f in d.items())


def _blocks_label(result: dict) -> str:
    if result.get("workload", "mooncake") == "mooncake":
        return "hit rate, trace blocks"
    return f"hit rate, {result.get('tokens_per_block', '?')}-token blocks"


def _slo_text(slo: dict) -> str:
    names = {"ttft_ms": "TTFT", "tpot_ms": "TPOT", "e2e_ms": "E2E"}
    return ", ".join(f"{names.get(k, k)} <= {v:g} ms" for k, v in slo.items())


def _rows(result: dict) -> list[tuple[str, str]]:
    rows = [
        ("requests (errors)", f"{_num(result.get('num_requests'))} ({_num(result.get('num_errors'))})"),
    ]
    if result.get("error_codes"):
        rows.append(("errors by code", ", ".join(f"{c} {n}" for c, n in result["error_codes"].items())))
        if result.get("errors"):  # the reason, not only its code (the rest: requests.jsonl)
            first = str(result["errors"][0])
            rows.append(("first error", first if len(first) <= 300 else first[:297] + "..."))
    stopped = f"interrupted ({result['interrupted_by']})" if result.get("partial") else None
    if result.get("num_cancelled"):
        rows.append((f"cancelled, {stopped}" if stopped else "cancelled at the deadline",
                     _num(result.get("num_cancelled"))))
    if result.get("num_not_sent"):
        rows.append((f"not sent, {stopped}" if stopped else "not sent (time bound)", _num(result.get("num_not_sent"))))
    rows.append((_blocks_label(result), _pct(result.get("hit_rate_blocks"))))
    if result.get("infinite_cache_hit_rate_blocks") is not None:
        # the workload's own reuse, from an empty cache: a cluster warm from earlier runs can exceed it
        rows.append(("hit rate bound, infinite cache from empty", _pct(result.get("infinite_cache_hit_rate_blocks"))))
    rows += [
        ("hit rate, tokens", _pct(result.get("hit_rate_tokens"))),
        *([("hit rate, tokens, server metrics" + _restarts(result.get("server")),
            _pct(result["server_hit_rate_tokens"]))]
          if result.get("server_hit_rate_tokens") is not None else []),
        ("computed prefill tokens", _num(result.get("computed_prefill_tokens"))),
        ("TTFT ms p50 / p90 / p99", _pcts(result.get("ttft_ms"))),
        ("TPOT ms p50 / p90 / p99", _pcts(result.get("tpot_ms"))),
        ("ITL ms p50 / p90 / p99", _pcts(result.get("itl_ms"))),
        ("E2E ms p50 / p90 / p99", _pcts(result.get("e2e_ms"))),
        ("requests/s", _num(result.get("request_throughput"), 2)),
    ]
    if result.get("slo"):
        rows += [(f"goodput req/s ({_slo_text(result['slo'])})", _num(result.get("goodput"), 2)),
                 ("requests meeting the SLOs", _pct(result.get("slo_attainment")))]
    rows += [
        ("output tokens/s", _num(result.get("output_throughput"), 1)),
        ("worker share", _share(result.get("worker_share"))),
        ("duration s", _num(result.get("duration_s"), 1)),
    ]
    return rows


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def arrival_text(arrival: dict) -> str:
    """One phrase for an arrival setting (`bench.arrivals.ArrivalSpec.describe`)."""
    kind = arrival.get("kind", "closed")
    if kind == "closed":
        text = f"closed loop, concurrency {arrival.get('concurrency')}"
    elif kind == "poisson":
        text = f"Poisson arrivals at {arrival.get('rate')} req/s"
    else:
        text = f"trace timestamps x {arrival.get('time_scale')}"
    if arrival.get("max_concurrency"):
        text += f", at most {arrival['max_concurrency']} in flight"
    return text


def _restarts(server: dict | None) -> str:
    """A note for the server-side hit rate when endpoints restarted during the run."""
    n = (server or {}).get("restarted_endpoints") or 0
    return f" ({n} server{'s' if n > 1 else ''} restarted during the run: counts since the restart)" if n else ""


def to_markdown(result: dict) -> str:
    """A short Markdown report of one bench result."""
    head = f"### kvmesh bench: {_cell(result.get('policy') or 'unlabelled')}"
    meta = []
    if result.get("workload") and result["workload"] != "mooncake":
        meta.append(f"workload {result['workload']}")
    if result.get("trace"):
        meta.append(f"trace `{result['trace']}`")
    if result.get("tokens_per_block") is not None and result.get("workload", "mooncake") == "mooncake":
        meta.append(f"K = {result['tokens_per_block']} tokens per trace block")
    arrival = result.get("arrival") or {}
    if arrival.get("kind", "closed") != "closed":
        meta.append(arrival_text(arrival))
    elif result.get("concurrency") is not None:
        meta.append(f"concurrency {result['concurrency']}")
    if result.get("warmup_requests"):
        meta.append(f"{result['warmup_requests']} warm-up requests left out")
    lines = [head, ""]
    if result.get("partial"):
        lines += [f"**Partial run**: interrupted by {result.get('interrupted_by') or 'a signal'}; the metrics cover "
                  "only the requests that finished.", ""]
    if meta:
        lines += [", ".join(meta), ""]
    lines += ["| metric | value |", "|---|---:|"]
    lines += [f"| {name} | {_cell(value)} |" for name, value in _rows(result)]
    errors = result.get("errors") or []
    if errors:
        lines += ["", "First errors:", ""] + [f"- `{_cell(e)}`" for e in errors]
    return "\n".join(lines) + "\n"


def compare_markdown(results: Sequence[dict]) -> str:
    """One Markdown table with a column per result (policy), metrics as rows."""
    if not results:
        return "(no results)\n"
    labels = [_cell(r.get("policy") or f"run {i + 1}") for i, r in enumerate(results)]
    table = [_rows(r) for r in results]
    names = [name for name, _ in table[0]]
    # A row present in some results only (the infinite-cache bound) is filled with "-".
    for rows in table[1:]:
        for name, _ in rows:
            if name not in names:
                names.append(name)
    lookup = [dict(rows) for rows in table]
    lines = ["| metric | " + " | ".join(labels) + " |",
             "|---|" + "---:|" * len(labels)]
    for name in names:
        lines.append(f"| {name} | " + " | ".join(_cell(d.get(name, "-")) for d in lookup) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:  # pragma: no cover - thin CLI
    """``python -m bench.report DIR_OR_JSON ...``: print a side-by-side table of results."""
    import json
    import sys
    from pathlib import Path

    args = sys.argv[1:] if argv is None else argv
    if not args:
        print("usage: python -m bench.report RESULT_DIR_OR_JSON [...]", file=sys.stderr)
        return 2
    results = []
    for a in args:
        p = Path(a)
        if p.is_dir():
            p = p / "result.json"
        results.append(json.loads(p.read_text(encoding="utf-8")))
    print(compare_markdown(results) if len(results) > 1 else to_markdown(results[0]), end="")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
