"""bench.arrivals: Poisson schedules, trace timestamp scaling, arrival settings."""
from __future__ import annotations

import math
import statistics

import pytest

from kvmesh.bench.arrivals import ArrivalSpec, poisson_offsets, release_offsets, trace_offsets


def test_poisson_mean_rate_and_exponential_gaps():
    rate, n = 8.0, 20_000
    offs = poisson_offsets(n, rate, seed=7)
    assert offs[0] == 0.0 and len(offs) == n
    assert all(b >= a for a, b in zip(offs, offs[1:]))
    gaps = [b - a for a, b in zip(offs, offs[1:])]
    # Mean rate within 3 % (the standard error of the mean gap is 1/sqrt(n) = 0.7 %).
    assert (n - 1) / offs[-1] == pytest.approx(rate, rel=0.03)
    # Exponential gaps: coefficient of variation 1 (constant gaps would give 0) and
    # P(gap > mean) = exp(-1).
    mean = statistics.fmean(gaps)
    assert statistics.pstdev(gaps) / mean == pytest.approx(1.0, abs=0.05)
    assert sum(g > 1 / rate for g in gaps) / len(gaps) == pytest.approx(math.exp(-1), abs=0.02)


def test_poisson_seeded_and_infinite_rate():
    assert poisson_offsets(50, 3.0, seed=1) == poisson_offsets(50, 3.0, seed=1)
    assert poisson_offsets(50, 3.0, seed=1) != poisson_offsets(50, 3.0, seed=2)
    assert poisson_offsets(4, math.inf) == [0.0] * 4
    assert poisson_offsets(0, 1.0) == []
    with pytest.raises(ValueError, match="rate must be > 0"):
        poisson_offsets(3, 0.0)


def test_trace_offsets_scale_the_gaps():
    ts = [393.0, 393.0, 394.5, 400.0]
    assert trace_offsets(ts) == [0.0, 0.0, 1.5, 7.0]
    assert trace_offsets(ts, 0.1) == pytest.approx([0.0, 0.0, 0.15, 0.7])
    assert trace_offsets(ts, 2.0) == pytest.approx([0.0, 0.0, 3.0, 14.0])
    # Out of order: relative to the earliest request.
    assert trace_offsets([5.0, 3.0], 1.0) == [2.0, 0.0]
    assert trace_offsets([], 1.0) == []
    with pytest.raises(ValueError, match="time_scale"):
        trace_offsets(ts, 0.0)
    with pytest.raises(ValueError, match="timestamp"):
        trace_offsets([1.0, None], 1.0)


def test_release_offsets_by_kind():
    assert release_offsets(ArrivalSpec("closed", concurrency=3), 5) is None
    assert release_offsets(ArrivalSpec("poisson", rate=2.0, seed=4), 5) == poisson_offsets(5, 2.0, 4)
    assert release_offsets(ArrivalSpec("trace", time_scale=0.5), 3, [10.0, 12.0, 20.0]) == [0.0, 1.0, 5.0]
    with pytest.raises(ValueError, match="timestamps"):
        release_offsets(ArrivalSpec("trace"), 3, None)
    with pytest.raises(ValueError, match="timestamp"):
        release_offsets(ArrivalSpec("trace"), 2, [None, None])


@pytest.mark.parametrize("kwargs, pattern", [
    ({"kind": "burst"}, "arrival must be one of"),
    ({"kind": "closed", "concurrency": 0}, "concurrency must be"),
    ({"kind": "poisson"}, "need a rate"),
    ({"kind": "poisson", "rate": -1.0}, "rate must be > 0"),
    ({"kind": "poisson", "rate": float("nan")}, "rate must be > 0"),
    ({"kind": "closed", "rate": 3.0}, "only applies to poisson"),
    ({"kind": "trace", "time_scale": 0.0}, "time_scale must be"),
    ({"kind": "poisson", "rate": 1.0, "time_scale": 2.0}, "only applies to trace"),
    ({"kind": "closed", "max_concurrency": 2}, "max_concurrency applies to open-loop"),
    ({"kind": "poisson", "rate": 1.0, "max_concurrency": 0}, "max_concurrency must be"),
])
def test_arrival_spec_rejects_bad_settings(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        ArrivalSpec(**kwargs)


def test_arrival_spec_cap_and_describe():
    closed = ArrivalSpec("closed", concurrency=3)
    assert closed.cap == 3 and not closed.open_loop
    assert closed.describe() == {"kind": "closed", "concurrency": 3}
    pois = ArrivalSpec("poisson", rate=math.inf, max_concurrency=5, seed=2)
    assert pois.cap == 5 and pois.open_loop
    assert pois.describe() == {"kind": "poisson", "rate": "inf", "max_concurrency": 5, "seed": 2}
    assert ArrivalSpec("trace", time_scale=0.1).describe() == {"kind": "trace", "time_scale": 0.1,
                                                                "max_concurrency": None}
    assert ArrivalSpec("trace").cap is None
