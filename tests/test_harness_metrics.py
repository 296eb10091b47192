"""bench.report: TPOT, ITL, goodput under SLOs, time series for plots, on records built by hand."""
from __future__ import annotations

import pytest

from kvmesh.bench import report


def _rec(index, ttft, e2e, completion, itl=(), ok=True, worker="w0", start=0.0, end=1.0, prompt=32, cached=0,
         **extra):
    r = {"index": index, "ok": ok, "code": "OK" if ok else "UNAVAILABLE", "ttft_ms": ttft, "e2e_ms": e2e,
         "completion_tokens": completion, "itl_ms": list(itl), "worker_id": worker, "start_s": start, "end_s": end,
         "prompt_tokens": prompt, "cached_tokens": cached, "computed_prefill_tokens": prompt - cached,
         "block_lengths": [16, 16]}
    r.update(extra)
    return r


def test_tpot_definition():
    assert report.tpot_ms(_rec(0, 100.0, 400.0, 4)) == pytest.approx(100.0)   # (400 - 100) / 3
    assert report.tpot_ms(_rec(0, 50.0, 60.0, 2)) == pytest.approx(10.0)
    assert report.tpot_ms(_rec(0, 50.0, 50.0, 1)) is None                       # no decode step
    assert report.tpot_ms(_rec(0, 50.0, 90.0, 3, ok=False)) is None


def test_itl_values_pool_gaps_of_successful_requests():
    recs = [_rec(0, 10, 40, 4, itl=[10, 10, 10]), _rec(1, 5, 35, 3, itl=[20, 10]),
            _rec(2, 5, 35, 3, itl=[999], ok=False)]
    assert report.itl_values(recs) == [10.0, 10.0, 10.0, 20.0, 10.0]


def test_goodput_counts_requests_meeting_every_slo():
    recs = [
        _rec(0, 100.0, 400.0, 4),    # TTFT 100, TPOT 100
        _rec(1, 300.0, 330.0, 4),    # TTFT 300 (too slow), TPOT 10
        _rec(2, 50.0, 350.0, 2),     # TTFT 50, TPOT 300 (too slow)
        _rec(3, 80.0, 80.0, 1),      # one token: TPOT counts as 0
        _rec(4, 10.0, 20.0, 2, ok=False),
        {"index": 5, "ok": False, "cancelled": True, "code": "CANCELLED"},
    ]
    slo = report.make_slo(ttft_ms=200, tpot_ms=150)
    assert slo == {"ttft_ms": 200.0, "tpot_ms": 150.0}
    assert [report.meets_slo(r, slo) for r in recs] == [True, False, False, True, False, False]
    g = report.goodput(recs, duration_s=2.0, slo=slo)
    assert g == {"good_requests": 2, "goodput": 1.0, "slo_attainment": pytest.approx(2 / 6, abs=1e-6)}
    # A bound equal to the value holds (<=), as in vLLM's benchmark.
    assert report.meets_slo(recs[0], report.make_slo(ttft_ms=100, tpot_ms=100, e2e_ms=400))
    assert not report.meets_slo(recs[0], report.make_slo(e2e_ms=399.9))
    for bad in (0, -1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="SLO ttft_ms"):
            report.make_slo(ttft_ms=bad)
    with pytest.raises(ValueError, match="unknown SLO key"):
        report.meets_slo(recs[0], {"queue_ms": 1.0})


def test_summarize_reports_tpot_itl_goodput_and_cancelled():
    recs = [_rec(0, 100.0, 400.0, 4, itl=[100, 100, 100]), _rec(1, 20.0, 40.0, 3, itl=[10, 10]),
            _rec(2, 10.0, 10.0, 1), {"index": 3, "ok": False, "cancelled": True, "code": "CANCELLED",
                                     "error": "cancelled"},
            {"index": 4, "ok": False, "code": "RESOURCE_EXHAUSTED", "error": "queue full"}]
    s = report.summarize(recs, duration_s=4.0, slo=report.make_slo(ttft_ms=50))
    assert s["num_requests"] == 5 and s["num_ok"] == 3
    assert s["num_errors"] == 1 and s["num_cancelled"] == 1
    assert s["error_codes"] == {"RESOURCE_EXHAUSTED": 1}
    # TPOTs 100 and 10 (the one-token request has none).
    assert s["tpot_ms"] == {"p50": 55.0, "p90": 91.0, "p99": 99.1}
    assert s["itl_ms"]["p50"] == 100.0 and s["mean_ms"]["itl"] == pytest.approx(64.0)
    assert s["mean_ms"]["tpot"] == 55.0 and s["mean_ms"]["ttft"] == pytest.approx(130 / 3, abs=1e-3)
    assert s["good_requests"] == 2 and s["goodput"] == 0.5 and s["slo"] == {"ttft_ms": 50.0}
    no_slo = report.summarize(recs, duration_s=4.0)
    assert no_slo["goodput"] is None and no_slo["slo"] == {}
    md = report.to_markdown(dict(s, policy="p"))
    assert "| goodput req/s (TTFT <= 50 ms) | 0.50 |" in md
    assert "| cancelled at the deadline | 1 |" in md
    stopped = report.to_markdown(dict(s, policy="p", partial=True, interrupted_by="SIGINT", num_not_sent=7))
    assert "| cancelled, interrupted (SIGINT) | 1 |" in stopped and "| not sent, interrupted (SIGINT) | 7 |" in stopped
    assert "deadline" not in stopped and "time bound" not in stopped
    assert "| TPOT ms p50 / p90 / p99 | 55.0 / 91.0 / 99.1 |" in md
    assert "goodput" not in report.to_markdown(dict(no_slo, policy="p"))


def test_hit_rate_series_bins_by_completion_time():
    recs = [_rec(0, 1, 2, 1, start=0.0, end=1.0, prompt=100, cached=0),
            _rec(1, 1, 2, 1, start=0.5, end=2.0, prompt=100, cached=50),
            _rec(2, 1, 2, 1, start=1.0, end=4.0, prompt=100, cached=100),
            _rec(3, 1, 2, 1, start=0.0, end=3.9, prompt=100, cached=0, ok=False)]
    series = report.hit_rate_series(recs, num_bins=2)   # span 0..4: bins [0, 2) and [2, 4]
    assert series == [
        {"t_s": 2.0, "requests": 1, "hit_rate_tokens": 0.0, "cumulative_hit_rate_tokens": 0.0},
        {"t_s": 4.0, "requests": 2, "hit_rate_tokens": 0.75, "cumulative_hit_rate_tokens": 0.5},
    ]
    assert report.hit_rate_series([], 5) == []
    with pytest.raises(ValueError):
        report.hit_rate_series(recs, 0)


def test_in_flight_and_load_series_per_worker():
    recs = [_rec(0, 1, 2, 1, worker="a", start=0.0, end=2.0), _rec(1, 1, 2, 1, worker="a", start=1.0, end=3.0),
            _rec(2, 1, 2, 1, worker="b", start=2.0, end=4.0), _rec(3, 1, 2, 1, worker="", start=0.0, end=4.0)]
    steps = report.in_flight_series(recs)
    assert steps == {"a": [(0.0, 1), (1.0, 2), (2.0, 1), (3.0, 0)], "b": [(2.0, 1), (4.0, 0)]}
    load = report.load_series(recs, num_bins=4)   # bins of 1 s over 0..4
    assert load["a"] == [(0.5, 1.0), (1.5, 2.0), (2.5, 1.0), (3.5, 0.0)]
    assert load["b"] == [(0.5, 0.0), (1.5, 0.0), (2.5, 1.0), (3.5, 1.0)]
    # The time-averaged load integrates to the total busy time: 4 s on a, 2 s on b.
    assert sum(v for _, v in load["a"]) == pytest.approx(4.0)
    assert report.worker_load(recs)["a"] == {"requests": 2, "prompt_tokens": 64, "cached_tokens": 0,
                                             "computed_prefill_tokens": 64, "completion_tokens": 2}


def test_ecdf():
    assert report.ecdf([3, 1, 2, 2]) == ([1.0, 2.0, 2.0, 3.0], [0.25, 0.5, 0.75, 1.0])
    assert report.ecdf([]) == ([], [])
