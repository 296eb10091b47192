"""Server-side view of a bench run: Prometheus counters scraped before and after.

`scrape` reads one ``/metrics`` endpoint (text exposition format, parsed by
prometheus-client); `run_delta` subtracts two scrapes of the same endpoints and sums
them over endpoints: prefix-cache queries and hits by tier (tokens), prompt and
generated tokens, finished requests, and the server-side token hit rate
(hits / queries), which `kvmesh bench` reports beside the hit rate its own requests saw.

Only the workers count prefix-cache tokens (a router exports ``kvmesh:router_*`` series),
so scraping a router and its workers together never counts a request twice.
"""
from __future__ import annotations

import urllib.request
from typing import Sequence

from prometheus_client.parser import text_string_to_metric_families

TIERS = ("device", "host", "disk", "peer", "remote")


def scrape(url: str, timeout_s: float = 10.0, token: str | None = None) -> dict[tuple, float]:
    """``{(sample name, sorted label items): value}`` of one ``/metrics`` endpoint, sending
    ``Authorization: Bearer token`` when ``token`` is given (`services.metrics.bearer_only`).

    Raises:
        OSError: the endpoint could not be read (URLError is an OSError).
    """
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout_s) as resp:
        text = resp.read().decode("utf-8")
    out: dict[tuple, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


def scrape_all(urls: Sequence[str], token: str | None = None) -> list[dict[tuple, float]]:
    """`scrape` of each URL, in order (with bearer ``token`` when given).

    Raises:
        OSError: one could not be read; the message names ``--metrics-url`` and the URL.
    """
    out = []
    for u in urls:
        try:
            out.append(scrape(u, token=token))
        except OSError as exc:
            if getattr(exc, "code", None) == 401:
                raise OSError(f"--metrics-url {u}: the port asks for a bearer token (401); pass "
                              "--metrics-token-file with the file its server was given (`kvmesh up` prints it: "
                              "metrics.token beside the client credentials)" +
                              (", and check it is that cluster's" if token else "")) from None
            raise OSError(f"--metrics-url {u}: could not read it ({getattr(exc, 'reason', exc)}); give the "
                          "/metrics URL of a running router or worker (its --metrics-port), or leave the flag out") \
                from None
    return out


def _total(samples: dict[tuple, float], name: str, **labels) -> float:
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= set(lab))


def run_delta(before: Sequence[dict], after: Sequence[dict]) -> dict:
    """Counters accumulated between two scrapes of the same endpoints, summed over them.

    Returns ``prefix_cache_queries_tokens``, ``prefix_cache_hits_tokens``,
    ``prefix_cache_hits_tokens_by_tier``, ``prompt_tokens``, ``generation_tokens``,
    ``requests`` (finished, any reason), ``hit_rate_tokens`` (hits / queries; None
    without queries) and ``restarted_endpoints``: how many endpoints' counters went down
    between the scrapes (their process restarted, e.g. a worker `kvmesh up` started
    again). Such an endpoint counts what it accumulated since its restart, as Prometheus's
    ``increase()`` does: what it counted before is lost, so the sums cover part of the run.
    """
    restarted = [any(value < b.get(key, 0.0) for key, value in a.items()
                     if key[0].endswith("_total") or key[0].endswith("_count") or key[0].endswith("_sum"))
                 or any(key not in a for key in b if key[0].endswith("_total"))
                 for b, a in zip(before, after)]

    def delta(name: str, **labels) -> float:
        return sum(_total(a, name, **labels) - (0.0 if reset else _total(b, name, **labels))
                   for b, a, reset in zip(before, after, restarted))

    queries = delta("kvmesh:prefix_cache_queries_total")
    by_tier = {t: int(round(delta("kvmesh:prefix_cache_hits_total", tier=t))) for t in TIERS}
    hits = sum(by_tier.values())
    return {
        "prefix_cache_queries_tokens": int(round(queries)),
        "prefix_cache_hits_tokens": hits,
        "prefix_cache_hits_tokens_by_tier": by_tier,
        "prompt_tokens": int(round(delta("kvmesh:prompt_tokens_total"))),
        "generation_tokens": int(round(delta("kvmesh:generation_tokens_total"))),
        "requests": int(round(delta("kvmesh:request_success_total"))),
        "hit_rate_tokens": round(hits / queries, 6) if queries else None,
        "restarted_endpoints": sum(restarted),
    }
