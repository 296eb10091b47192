"""Arrival processes of the load harness: when each request of a workload is sent.

Two families:

- **Open loop.** Every request has a release time fixed before the run starts, whatever
  the target does: Poisson arrivals at a mean rate (``poisson``: independent exponential
  gaps of mean ``1 / rate`` seconds, the arrival model of vLLM's ``benchmark_serving``
  with burstiness 1), or the trace's own timestamps (``trace``) multiplied by
  ``time_scale``. An optional ``max_concurrency`` caps the requests in flight; a request
  released while the cap is reached waits for a free slot.
- **Closed loop** (``closed``). ``concurrency`` requests are in flight at all times; the
  next one starts as soon as one finishes.

In both families a multi-turn request is also held until the turn before it has finished
(its prompt contains that turn's completion), so it is sent at the later of its release
time and its predecessor's completion. The harness (`bench.harness`) does that sequencing;
this module only computes release times.
"""
from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass
from typing import Sequence

#: Names of the arrival processes.
ARRIVALS = ("closed", "poisson", "trace")


@dataclass(frozen=True)
class ArrivalSpec:
    """How requests are released.

    Attributes:
        kind: "closed", "poisson" or "trace".
        concurrency: closed loop: requests in flight at all times (>= 1).
        rate: poisson: mean arrival rate, requests per second (> 0; ``math.inf`` sends
            everything at once).
        time_scale: trace: factor applied to the trace's inter-arrival times (> 0;
            0.1 replays ten times faster, 2 twice slower).
        max_concurrency: open loop: cap on requests in flight, or None for no cap.
        seed: seed of the Poisson gaps.

    Raises:
        ValueError: an unknown kind or an out-of-range number.
    """

    kind: str = "closed"
    concurrency: int = 4
    rate: float | None = None
    time_scale: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ARRIVALS:
            raise ValueError(f"arrival must be one of {', '.join(ARRIVALS)}, got {self.kind!r}")
        if isinstance(self.concurrency, bool) or not isinstance(self.concurrency, int) or self.concurrency < 1:
            raise ValueError(f"concurrency must be an integer >= 1, got {self.concurrency!r}")
        if self.kind == "poisson":
            if self.rate is None:
                raise ValueError("poisson arrivals need a rate (requests per second)")
            if not (isinstance(self.rate, (int, float)) and self.rate > 0) or math.isnan(self.rate):
                raise ValueError(f"rate must be > 0 requests per second, got {self.rate!r}")
        elif self.rate is not None:
            raise ValueError(f"a rate only applies to poisson arrivals, not to {self.kind!r}")
        if not (self.time_scale > 0 and math.isfinite(self.time_scale)):
            raise ValueError(f"time_scale must be a finite number > 0, got {self.time_scale!r}")
        if self.kind != "trace" and self.time_scale != 1.0:
            raise ValueError(f"a time scale only applies to trace arrivals, not to {self.kind!r}")
        if self.max_concurrency is not None:
            if self.kind == "closed":
                raise ValueError("max_concurrency applies to open-loop arrivals; use concurrency for a closed loop")
            if isinstance(self.max_concurrency, bool) or not isinstance(self.max_concurrency, int) \
                    or self.max_concurrency < 1:
                raise ValueError(f"max_concurrency must be an integer >= 1, got {self.max_concurrency!r}")

    @property
    def open_loop(self) -> bool:
        return self.kind != "closed"

    @property
    def cap(self) -> int | None:
        """Most requests in flight at once (None: no cap)."""
        return self.concurrency if self.kind == "closed" else self.max_concurrency

    def describe(self) -> dict:
        """The settings that matter for this kind, for result files."""
        d = asdict(self)
        if self.kind == "closed":
            return {"kind": "closed", "concurrency": self.concurrency}
        d.pop("concurrency")
        if self.kind == "poisson":
            d.pop("time_scale")
            if math.isinf(self.rate):
                d["rate"] = "inf"
        else:
            d.pop("rate")
            d.pop("seed")
        return d


def poisson_offsets(n: int, rate: float, seed: int = 0) -> list[float]:
    """Release times, in seconds from the start, of ``n`` Poisson arrivals at ``rate`` per second.

    The first request goes at 0; each later one follows its predecessor after an
    independent exponential gap of mean ``1 / rate`` s drawn from ``random.Random(seed)``
    (so the same seed gives the same schedule on every platform). ``rate = inf`` releases
    everything at 0.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests per second, got {rate!r}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    out: list[float] = []
    t = 0.0
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        out.append(t)
    return out


def trace_offsets(timestamps_s: Sequence[float], time_scale: float = 1.0) -> list[float]:
    """Release times, in seconds, from a trace's timestamps (seconds): ``(t - min(t)) * time_scale``.

    The earliest request goes at 0; the gaps between requests are kept, multiplied by
    ``time_scale``.
    """
    if not (time_scale > 0 and math.isfinite(time_scale)):
        raise ValueError(f"time_scale must be a finite number > 0, got {time_scale!r}")
    if not timestamps_s:
        return []
    if any(t is None for t in timestamps_s):
        raise ValueError("trace arrivals need a timestamp on every request; this workload has none")
    t0 = min(timestamps_s)
    return [(float(t) - t0) * time_scale for t in timestamps_s]


def release_offsets(spec: ArrivalSpec, n: int, timestamps_s: Sequence[float | None] | None = None) -> list[float] | None:
    """Release times (seconds from the start) of ``n`` requests, or None for a closed loop.

    Raises:
        ValueError: trace arrivals without one timestamp per request.
    """
    if spec.kind == "closed":
        return None
    if spec.kind == "poisson":
        return poisson_offsets(n, float(spec.rate), spec.seed)
    if timestamps_s is None or len(timestamps_s) != n:
        raise ValueError("trace arrivals need a workload with timestamps (the mooncake workload has them)")
    return trace_offsets(list(timestamps_s), spec.time_scale)
