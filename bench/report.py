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
      "worker_id": "w0", "start_s": 0.0, "end_s": 0.04,
    }

Failed requests have ``ok`` False, the gRPC status code name in ``code`` and the message in
``error``; their other fields may be missing. Token and latency figures are taken over the
requests that succeeded.
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


def summarize(records: Sequence[dict], duration_s: float | None = None) -> dict:
    """Aggregate per-request records into the metric part of a bench result.

    ``duration_s`` defaults to the span from the earliest ``start_s`` to the latest
    ``end_s`` of the records. Returns num_requests, num_ok, num_errors, errors (the first few
    as "CODE: message"), error_codes (count per code), hit_rate_blocks, hit_rate_tokens,
    trace_blocks, cached_trace_blocks, prompt_tokens, cached_tokens,
    cached_tokens_by_tier, computed_prefill_tokens, completion_tokens, ttft_ms, e2e_ms,
    server_ttft_ms, server_e2e_ms, queue_ms, prefill_ms (each {p50, p90, p99}),
    request_throughput, output_throughput, worker_share and duration_s.
    """
    ok = [r for r in records if r.get("ok")]
    bad = [r for r in records if not r.get("ok")]
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

    return {
        "num_requests": len(records),
        "num_ok": len(ok),
        "num_errors": len(bad),
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
        "server_ttft_ms": lat("server_ttft_ms"),
        "server_e2e_ms": lat("server_e2e_ms"),
        "queue_ms": lat("queue_ms"),
        "prefill_ms": lat("prefill_ms"),
        "request_throughput": round(_ratio(len(ok), duration_s), 4),
        "output_throughput": round(_ratio(completion, duration_s), 3),
        "worker_share": worker_share,
        "duration_s": round(float(duration_s), 3),
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


def _rows(result: dict) -> list[tuple[str, str]]:
    rows = [
        ("requests (errors)", f"{_num(result.get('num_requests'))} ({_num(result.get('num_errors'))})"),
        ("hit rate, trace blocks", _pct(result.get("hit_rate_blocks"))),
    ]
    if result.get("infinite_cache_hit_rate_blocks") is not None:
        rows.append(("hit rate bound, infinite cache", _pct(result.get("infinite_cache_hit_rate_blocks"))))
    rows += [
        ("hit rate, tokens", _pct(result.get("hit_rate_tokens"))),
        ("computed prefill tokens", _num(result.get("computed_prefill_tokens"))),
        ("TTFT ms p50 / p90 / p99", _pcts(result.get("ttft_ms"))),
        ("E2E ms p50 / p90 / p99", _pcts(result.get("e2e_ms"))),
        ("requests/s", _num(result.get("request_throughput"), 2)),
        ("output tokens/s", _num(result.get("output_throughput"), 1)),
        ("worker share", _share(result.get("worker_share"))),
        ("duration s", _num(result.get("duration_s"), 1)),
    ]
    return rows


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def to_markdown(result: dict) -> str:
    """A short Markdown report of one bench result."""
    head = f"### kvmesh bench: {_cell(result.get('policy') or 'unlabelled')}"
    meta = []
    if result.get("trace"):
        meta.append(f"trace `{result['trace']}`")
    if result.get("tokens_per_block") is not None:
        meta.append(f"K = {result['tokens_per_block']} tokens per trace block")
    if result.get("concurrency") is not None:
        meta.append(f"concurrency {result['concurrency']}")
    lines = [head, ""]
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
