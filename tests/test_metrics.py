"""Worker and router metrics in-process: counters, reasons, and scrapes that never wait on a step."""
from __future__ import annotations

import threading

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.services.metrics import ROUTE_REASONS, RouterMetrics, WorkerMetrics, route_reason, serve_metrics
from kvmesh.services.policies import KVAwarePolicy, RoundRobinPolicy, WorkerView


def samples(registry) -> dict[tuple, float]:
    out = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


@pytest.fixture(scope="module")
def engine():
    from kvmesh.cache_store.tier_store import TierConfig
    from kvmesh.workers.engine import Engine

    e = Engine(num_blocks=64, block_size=16, tiers=TierConfig(host_bytes=4 << 20, peer_bytes=0)).start()
    yield e
    e.stop()


def test_counters_follow_finished_requests(engine):
    m = WorkerMetrics(engine, "w0")
    m.observe_finished({"prompt_tokens": 100, "cached_tokens": 48, "cached_tokens_by_tier": {"device": 32, "host": 16},
                        "computed_prefill_tokens": 52, "completion_tokens": 7},
                       {"ttft_ms": 20.0, "e2e_ms": 90.0, "queue_ms": 1.0}, "length", [1.0, 1.01, 1.03])
    m.observe_finished(None, None, "abort")
    s = samples(m.registry)
    assert s[("kvmesh:prefix_cache_queries_total", ())] == 100
    assert s[("kvmesh:prefix_cache_hits_total", (("tier", "device"),))] == 32
    assert s[("kvmesh:prefix_cache_hits_total", (("tier", "host"),))] == 16
    assert s[("kvmesh:prefix_cache_hits_total", (("tier", "disk"),))] == 0
    assert s[("kvmesh:generation_tokens_total", ())] == 7
    assert s[("kvmesh:request_success_total", (("finished_reason", "length"),))] == 1
    assert s[("kvmesh:request_success_total", (("finished_reason", "abort"),))] == 1
    assert s[("kvmesh:inter_token_latency_seconds_count", ())] == 2
    assert s[("kvmesh:time_to_first_token_seconds_sum", ())] == pytest.approx(0.02)


def test_cancelled_requests_count_the_tokens_they_used(engine):
    """A cancelled request's streamed tokens (and, once its prefill ended, its prompt) count,
    as vLLM counts tokens per step; cache queries and hits stay those of finished requests."""
    m = WorkerMetrics(engine, "w0")
    m.observe_cancelled(100, 5)  # cancelled while decoding
    m.observe_cancelled(80, 0)   # cancelled before its first token: its prefill did not end
    s = samples(m.registry)
    assert s[("kvmesh:generation_tokens_total", ())] == 5
    assert s[("kvmesh:prompt_tokens_total", ())] == 100
    assert s[("kvmesh:prefix_cache_queries_total", ())] == 0
    assert s[("kvmesh:request_success_total", (("finished_reason", "abort"),))] == 2


def test_engine_gauges_match_the_engine(engine):
    m = WorkerMetrics(engine, "w0")
    engine.generate(list(range(1, 50)), timeout=60)
    s = samples(m.registry)
    assert s[("kvmesh:tier_capacity_blocks", (("tier", "device"),))] == 64
    assert s[("kvmesh:tier_capacity_bytes", (("tier", "host"),))] == 4 << 20
    assert ("kvmesh:tier_used_bytes", (("tier", "host"),)) in s
    assert s[("kvmesh:tier_used_blocks", (("tier", "device"),))] >= 3  # the prompt's 3 full blocks stay cached
    assert s[("kvmesh:num_requests_running", ())] == 0
    assert s[("kvmesh:kv_cache_usage_perc", ())] == 0.0  # cached but unused blocks count as free, as in vLLM
    assert s[("kvmesh:requests_held_for_tenant_share_total", ())] == engine.scheduler.num_held_for_fairness


def test_scrape_never_waits_on_the_engine_lock(engine):
    """A scrape while another thread holds the engine's step lock completes."""
    m = WorkerMetrics(engine, "w0")
    held, release = threading.Event(), threading.Event()

    def hold():
        with engine._lock:
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(10)
    out = {}
    scraper = threading.Thread(target=lambda: out.setdefault("text", generate_latest(m.registry)))
    scraper.start()
    scraper.join(10)
    finished = not scraper.is_alive()
    release.set()
    holder.join()
    scraper.join()
    assert finished, "the scrape waited for the engine lock"
    assert b"kvmesh:num_requests_waiting" in out["text"]


def test_metrics_port_in_use_names_the_flag(engine):
    m = WorkerMetrics(engine, "w0")
    port, server = serve_metrics(m.registry, 0)
    try:
        with pytest.raises(RuntimeError, match="--metrics-port"):
            serve_metrics(m.registry, port)
    finally:
        server.shutdown()


def _view(wid, matched=0, routed=0.0):
    return WorkerView(wid, f"{wid}:1", matched_blocks=matched, weighted_blocks=float(matched), routed_recent=routed)


def test_route_reasons():
    kv = KVAwarePolicy()
    a, b = _view("a", 4), _view("b", 0)
    assert route_reason(kv, a, [a, b], 0) == "prefix_hit"
    assert route_reason(kv, b, [a, b], 0) == "load"
    assert route_reason(kv, b, [a, b], 1) == "retry"
    c, d = _view("c"), _view("d")
    assert route_reason(kv, c, [c, d], 0) == "cold"
    hot, cool = _view("hot", 4, routed=40.0), _view("cool", 0, routed=0.0)
    assert route_reason(kv, cool, [hot, cool], 0) == "share_cap"
    assert route_reason(RoundRobinPolicy(), cool, [hot, cool], 0) == "load"  # no share cap in that policy
    # a shortlist's views: the fleet's mean decides whether the holder was over its cap
    assert route_reason(kv, cool, [hot, cool], 0, routed_mean=38.0) == "load"
    assert route_reason(kv, cool, [hot, cool], 0, routed_mean=20.0) == "share_cap"


def test_router_metrics_count_decisions_and_lag():
    class Sub:
        resyncs, resync_failures, lease_expiries, data_losses, stalls = 2, 0, 1, 3, 4

        def live_workers(self):
            return {"a": {}, "b": {}}

    class Index:
        def num_blocks(self):
            return 17

    class Router:
        policy_name, policy, subscriber, index = "kv_aware", KVAwarePolicy(), Sub(), Index()

    m = RouterMetrics(Router())
    a, b = _view("a", 2), _view("b")
    assert m.observe_decision(a, [a, b], 0) == "prefix_hit"
    m.observe_decision(b, [a, b], 1)

    class Batch:
        ts = 0.0

    import time

    Batch.ts = time.time() - 0.5
    m.observe_batch(Batch)
    s = samples(m.registry)
    assert s[("kvmesh:router_decisions_total", (("policy", "kv_aware"), ("reason", "prefix_hit")))] == 1
    assert s[("kvmesh:router_decisions_total", (("policy", "kv_aware"), ("reason", "retry")))] == 1
    assert {r for (n, lab) in s if n == "kvmesh:router_decisions_total" for k, r in lab if k == "reason"} \
        == set(ROUTE_REASONS)
    assert s[("kvmesh:router_routed_requests_total", (("worker", "a"),))] == 1
    assert s[("kvmesh:router_live_workers", ())] == 2
    assert s[("kvmesh:router_indexed_blocks", ())] == 17
    assert s[("kvmesh:router_gap_resyncs_total", ())] == 2
    assert s[("kvmesh:router_lease_expiries_total", ())] == 1
    assert s[("kvmesh:router_redis_data_losses_total", ())] == 3
    assert s[("kvmesh:router_redis_stalls_total", ())] == 4
    assert s[("kvmesh:router_event_lag_seconds_count", ())] == 1
    assert 0.4 < s[("kvmesh:router_event_lag_seconds_sum", ())] < 5.0


def test_offload_and_load_bytes_follow_the_tier_store(engine):
    """Blocks evicted to the host tier and loaded back are counted in device-format bytes."""
    m = WorkerMetrics(engine, "w0")
    block_bytes = engine.kv_cache.nbytes // engine.num_blocks
    prompt = list(range(60, 109))  # 49 tokens: 3 full blocks
    engine.generate(prompt, timeout=60)
    before = samples(m.registry)
    offloaded = engine.offload_device_cache()
    out = engine.generate(prompt, timeout=60)
    m.observe_finished(out["usage"], out["timing"], out["finish_reason"])
    after = samples(m.registry)
    assert offloaded >= 3
    assert out["usage"]["cached_tokens_by_tier"]["host"] == 48
    off = after[("kvmesh:tier_offload_bytes_total", ())] - before[("kvmesh:tier_offload_bytes_total", ())]
    load = after[("kvmesh:tier_load_bytes_total", ())] - before[("kvmesh:tier_load_bytes_total", ())]
    assert off == offloaded * block_bytes
    assert load == 3 * block_bytes
    assert after[("kvmesh:prefix_cache_hits_total", (("tier", "host"),))] == 48
    # the host load was timed, and nothing was computed instead ("always" on the CPU)
    assert after[("kvmesh:tier_load_seconds_per_block", (("source", "host"),))] > 0
    assert after[("kvmesh:tier_loads_not_worth_it_total", (("stage", "load"),))] == 0


def test_peer_fetch_outcomes(engine):
    from kvmesh.workers.peer_fetch import FetchResult

    m = WorkerMetrics(engine, "w0")
    m.observe_fetch(FetchResult(staged=4, nbytes=4096, outcome="complete"))
    m.observe_fetch(FetchResult(outcome="transfer slower than recompute"))
    m.observe_fetch(FetchResult(staged=0, nbytes=100, outcome="deadline"))
    m.observe_fetch(FetchResult(staged=0, nbytes=100, outcome="projected past deadline"))
    s = samples(m.registry)
    assert s[("kvmesh:peer_fetch_decisions_total", (("decision", "fetched"),))] == 1
    assert s[("kvmesh:peer_fetch_decisions_total", (("decision", "recomputed"),))] == 1
    assert s[("kvmesh:peer_fetch_decisions_total", (("decision", "deadline"),))] == 2
    assert s[("kvmesh:peer_fetch_bytes_total", ())] == 4296


def test_blocks_that_find_no_host_slot_are_counted_as_not_stored():
    """A host tier of two blocks under a device pool evicting five or more: all but two are
    not cached below at all, and the metric says so (reason "offload")."""
    from kvmesh.cache_store.tier_store import TierConfig
    from kvmesh.workers.engine import Engine

    probe = Engine(num_blocks=8, block_size=16, tiers=TierConfig(host_bytes=1 << 20, peer_bytes=0))
    payload = probe.tiers.host.codec.payload_bytes
    e = Engine(num_blocks=32, block_size=16, tiers=TierConfig(host_bytes=2 * payload, peer_bytes=0)).start()
    try:
        m = WorkerMetrics(e, "w0")
        e.generate(list(range(1, 82)), timeout=60)  # 81 tokens: 5 full blocks
        offloaded = e.offload_device_cache()
        s = samples(m.registry)
        assert offloaded >= 5 and len(e.tiers.host) == 2
        assert s[("kvmesh:tier_blocks_not_stored_total", (("reason", "offload"),))] == offloaded - 2
        assert s[("kvmesh:tier_blocks_not_stored_total", (("reason", "disk_queue"),))] == 0
    finally:
        e.stop()


def _closed_within(sock, seconds: float) -> bool:
    """Whether the server closes ``sock`` (EOF or reset) within ``seconds``; what it sends
    first is read and dropped."""
    import socket
    import time

    deadline = time.monotonic() + seconds
    while True:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            if not sock.recv(4096):
                return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except socket.timeout:
            return False


def test_a_silent_metrics_connection_is_closed_after_the_socket_timeout():
    import socket

    registry = CollectorRegistry()
    port, server = serve_metrics(registry, 0, socket_timeout_s=0.5)
    try:
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
            assert _closed_within(s, 20.0), "a partial request held its metrics thread past the timeout"
    finally:
        server.shutdown()
        server.server_close()


def test_metrics_connections_over_the_cap_are_closed_unread_and_scrapes_resume():
    import socket
    import time
    import urllib.request

    registry = CollectorRegistry()
    Counter("kvmesh:probe", "probe", registry=registry).inc()
    port, server = serve_metrics(registry, 0, socket_timeout_s=120.0, max_connections=2)
    held = []
    try:
        for _ in range(2):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"GET /metrics HTTP/1.1\r\n")
            held.append(s)
        time.sleep(0.5)  # both are accepted and hold their slots (the timeout is far away)
        with socket.create_connection(("127.0.0.1", port)) as extra:
            assert _closed_within(extra, 20.0), "a connection over the cap was kept open"
        for s in held:
            s.close()
        deadline = time.monotonic() + 20.0
        while True:  # the held slots come back once their threads see the close
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=20) as r:
                    assert b"kvmesh:probe_total 1.0" in r.read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
    finally:
        for s in held:
            s.close()
        server.shutdown()
        server.server_close()


def test_the_small_host_tier_warning_and_docs_name_the_exported_series(tmp_path, caplog):
    """The worker's start-up warning about a host tier smaller than the device pool, and
    docs/TIERS.md, name the not-stored counter as it is scraped (a counter's ``_total``)."""
    import logging
    import os
    import re

    from kvmesh.services.cli import build_parser, make_engine

    args = build_parser().parse_args(["worker", "--port", "0", "--num-blocks", "32", "--host-bytes", "64K",
                                      "--disk-dir", str(tmp_path / "disk"), "--disk-bytes", "1M"])
    with caplog.at_level(logging.WARNING, logger="kvmesh.worker"):
        e = make_engine(args)
    try:
        (warning,) = [r.getMessage() for r in caplog.records if "--host-bytes holds" in r.getMessage()]
        (name,) = re.findall(r'(kvmesh:[a-z_]+)\{reason="offload"\}', warning)
        exported = samples(WorkerMetrics(e, "w0").registry)
        assert (name, (("reason", "offload"),)) in exported, name
    finally:
        e.stop()
    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "TIERS.md"), encoding="utf-8") as fh:
        named = set(re.findall(r"kvmesh:tier_blocks_not_stored\w*", fh.read()))
    assert named == {name}


def test_a_metrics_port_with_a_token_answers_only_its_bearers(tmp_path):
    """`--metrics-token-file`: without ``Authorization: Bearer TOKEN`` (or with another
    token) the port answers 401 with a Bearer challenge and no counter; a bad token file
    is a usage error naming the flag."""
    import urllib.error
    import urllib.request

    from prometheus_client import CollectorRegistry, Counter

    from kvmesh.services.metrics import read_metrics_token, serve_metrics

    registry = CollectorRegistry()
    Counter("kvmesh_secret_hits", "hits", registry=registry).inc(7)
    token_file = tmp_path / "metrics.token"
    token_file.write_text("s3cr3t-token\n")
    port, server = serve_metrics(registry, 0, token=read_metrics_token(str(token_file)))
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        for headers in ({}, {"Authorization": "Bearer s3cr3t-toke"}, {"Authorization": "Basic s3cr3t-token"},
                        {"Authorization": "Bearer s3cr3t-token2"}):
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=20)
            assert err.value.code == 401 and err.value.headers["WWW-Authenticate"].startswith("Bearer")
            assert b"kvmesh_secret_hits" not in err.value.read()
        ok = urllib.request.urlopen(urllib.request.Request(url, headers={"Authorization": "Bearer s3cr3t-token"}),
                                    timeout=20).read()
        assert b"kvmesh_secret_hits_total 7.0" in ok
    finally:
        server.shutdown()
    for content in ("", "  \n", "two words"):
        token_file.write_text(content)
        with pytest.raises(ValueError, match="--metrics-token-file"):
            read_metrics_token(str(token_file))
    with pytest.raises(ValueError, match="--metrics-token-file"):
        read_metrics_token(str(tmp_path / "missing"))


def test_a_metrics_token_without_a_metrics_port_is_a_usage_error(tmp_path):
    """A token file given to a process with no --metrics-port guarded nothing, silently."""
    import argparse

    from kvmesh.services.observability import server_ports

    token = tmp_path / "t"
    token.write_text("tok\n")
    with pytest.raises(ValueError, match="--metrics-token-file guards --metrics-port"):
        server_ports(argparse.Namespace(metrics_port=None, http_port=0, metrics_token_file=str(token)))
    assert server_ports(argparse.Namespace(metrics_port=0, http_port=None, metrics_token_file=str(token))) == \
        {"metrics_port": 0, "metrics_token": "tok"}
