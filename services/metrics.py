"""Prometheus metrics of workers and routers (prometheus-client).

Names follow vLLM's (``vllm:prompt_tokens_total``, ``vllm:time_to_first_token_seconds``,
``vllm:prefix_cache_queries_total``...) with a ``kvmesh:`` prefix and the same units:
tokens for token counters, seconds for latencies, a fraction in [0, 1] for
``kv_cache_usage_perc``, bytes for sizes. Every process owns its own
`prometheus_client.CollectorRegistry`, so several workers in one test process never
share a series.

The scrape never waits on a model step. Per-request counters and histograms are
updated by the gRPC layer when a request finishes; gauges (queue lengths, pool usage,
tier sizes, index size) are read at scrape time by `collect` methods that read plain
attributes and take no lock (the engine's step lock, the tier store's lock and Redis are
never touched). A value read while another thread changes it is off by at most that one
change, as any gauge is.

Labels are bounded: ``tier`` (the five mediums), ``finished_reason``, ``decision``,
``policy`` and ``reason`` (fixed sets), and ``worker`` on the router (one per live worker).
Request ids and tenants never become labels.

`serve_metrics` serves ``/metrics`` on its own daemon thread (prometheus-client's WSGI
app and threading WSGI server), independent of the gRPC event loop and the engine thread.
Each connection has a socket timeout (``METRICS_SOCKET_TIMEOUT_S``: a client that stops
sending or reading is dropped) and at most ``METRICS_MAX_CONNECTIONS`` are served at once
(one thread each); a connection past the cap is closed unread.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = logging.getLogger(__name__)

PREFIX = "kvmesh:"
#: Tiers a prefix-cache hit can come from (``Usage.cached_tokens_by_tier`` keys).
TIERS = ("device", "host", "disk", "peer", "remote")
#: Why the router picked a worker (``router_decisions_total{reason}``):
#: prefix_hit: it holds the most leading blocks of any worker (at least one);
#: cold: no worker holds any block of the prompt (chosen by load / balance alone);
#: load: another worker held more blocks but was more loaded;
#: share_cap: the best holder was over its share cap (kv_aware);
#: retry: a second attempt after the first worker was unavailable.
ROUTE_REASONS = ("prefix_hit", "cold", "load", "share_cap", "retry")
#: Outcome of a peer-fetch hint (``peer_fetch_decisions_total{decision}``).
FETCH_DECISIONS = ("fetched", "recomputed", "deadline")

# Bucket bounds (seconds): roughly logarithmic from 1 ms to the longest request a
# serving fleet keeps open, in the same spirit as vLLM's latency histograms.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0, 120.0, 600.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.075, 0.1, 0.2, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 900.0, 3600.0)
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


#: Seconds a metrics connection may stay silent (reading the request or taking the answer)
#: before it is closed.
METRICS_SOCKET_TIMEOUT_S = 10.0
#: Metrics connections served at once (a thread each); one past it is closed unread.
METRICS_MAX_CONNECTIONS = 16


#: ``finished_reason`` label values of the request counter: "shed" is a request failed
#: DEADLINE_EXCEEDED before its prefill (`workers.scheduler.Scheduler`), "abort" one
#: whose caller left or whose deadline passed while it ran.
FINISH_REASONS = ("stop", "length", "error", "shed", "abort")


class _QuietHandler(WSGIRequestHandler):
    """A WSGI request handler that logs nothing (prometheus-client's does the same)."""

    def log_message(self, format, *args):  # noqa: A002 - stdlib signature
        pass


class _CappedWSGIServer(ThreadingWSGIServer):
    """prometheus-client's threading WSGI server with at most ``max_connections`` handler
    threads: `verify_request` (socketserver's hook) refuses a connection when every slot is
    taken, and socketserver then closes it without reading it."""

    max_connections = METRICS_MAX_CONNECTIONS

    def server_activate(self) -> None:
        self._slots = threading.BoundedSemaphore(self.max_connections)
        super().server_activate()

    def verify_request(self, request, client_address) -> bool:
        return self._slots.acquire(blocking=False)

    def process_request(self, request, client_address) -> None:
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread started: its slot is free again
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request, client_address) -> None:
        import sys

        if isinstance(sys.exc_info()[1], OSError):  # a client that timed out or left: nothing to report
            return
        super().handle_error(request, client_address)


def bearer_only(app, token: str):
    """WSGI ``app`` answered only to requests with ``Authorization: Bearer <token>``
    (RFC 6750 section 2.1; the scheme's case does not matter, RFC 7235 section 2.1; the
    token is compared in constant time), else 401 with a ``WWW-Authenticate: Bearer``
    challenge, as Prometheus's ``authorization`` scrape setting (``credentials_file``)
    sends it."""
    import hmac

    expected = token.encode()
    body = b"401: this metrics port needs 'Authorization: Bearer <token>' (the file of --metrics-token-file)\n"

    def guarded(environ, start_response):
        scheme, _, got = environ.get("HTTP_AUTHORIZATION", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(got.encode("latin-1", "replace"), expected):
            return app(environ, start_response)
        start_response("401 Unauthorized", [("Content-Type", "text/plain"), ("Content-Length", str(len(body))),
                                            ("WWW-Authenticate", 'Bearer realm="kvmesh metrics"')])
        return [body]

    return guarded


def read_metrics_token(path: str) -> str:
    """The bearer token in file ``path`` (surrounding whitespace stripped).

    Raises:
        ValueError: the file cannot be read, is empty, or holds characters a header value
            cannot carry (names ``--metrics-token-file``).
    """
    try:
        with open(path, encoding="ascii") as f:
            token = f.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--metrics-token-file {path}: cannot read it ({exc}); name a file holding one "
                         "printable ASCII token") from None
    if not token or not token.isprintable() or any(c.isspace() for c in token):
        raise ValueError(f"--metrics-token-file {path}: holds no token (or one with spaces or control "
                         "characters); write one printable ASCII token into it")
    return token


def serve_metrics(registry: CollectorRegistry, port: int, host: str = "127.0.0.1",
                  socket_timeout_s: float = METRICS_SOCKET_TIMEOUT_S,
                  max_connections: int = METRICS_MAX_CONNECTIONS, token: str | None = None):
    """Serve ``registry`` at ``http://host:port/metrics`` on a daemon thread, with
    prometheus-client's WSGI app (`prometheus_client.make_wsgi_app`); with ``token``, only
    to requests bearing it (`bearer_only`): the counters move with each request and would
    tell a stranger polling them around another tenant's request whether it was cached.

    Returns ``(bound_port, server)``; ``server.shutdown()`` stops it.

    Port 0 picks a free one. A connection silent for ``socket_timeout_s`` seconds is
    closed; at most ``max_connections`` are served at once, and one more is closed unread.

    Raises:
        RuntimeError: the port could not be bound (names the ``--metrics-port`` flag).
    """
    app = make_wsgi_app(registry)
    if token is not None:
        app = bearer_only(app, token)
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                       flags=socket.AI_PASSIVE)[0]
        server_cls = type("MetricsServer", (_CappedWSGIServer,),
                          {"address_family": family, "max_connections": max_connections})
        handler_cls = type("MetricsHandler", (_QuietHandler,), {"timeout": socket_timeout_s})
        server = make_server(sockaddr[0], port, app, server_cls, handler_class=handler_cls)
    except OSError as exc:
        raise RuntimeError(f"--metrics-port {port}: could not bind {host}:{port} ({exc}); "
                           f"pick a free port or 0") from None
    threading.Thread(target=server.serve_forever, name="kvmesh-metrics", daemon=True).start()
    return int(server.server_port), server


def _name(short: str) -> str:
    return PREFIX + short


def _tier_block_bytes(engine) -> int:
    """Device-format bytes of one KV block (the unit offload/load bytes are counted in)."""
    kv = engine.kv_cache
    return int(kv[0].numel() * kv.element_size())


class WorkerMetrics:
    """The metrics of one worker process.

    Args:
        engine: the worker's `workers.engine.Engine`; read (never locked) at scrape time.
        worker_id: reported in ``kvmesh:worker_info``.
        registry: where the metrics live (a new one by default).

    Counters of requests and tokens are updated by `observe_finished` (the gRPC layer
    calls it once per finished request) and `observe_fetch` (once per peer-fetch hint).
    """

    def __init__(self, engine, worker_id: str = "", registry: CollectorRegistry | None = None):
        self.engine = engine
        self.worker_id = worker_id
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.queries = Counter(_name("prefix_cache_queries"), "Prompt tokens looked up in the prefix cache "
                               "(tokens).", registry=r)
        self.hits = Counter(_name("prefix_cache_hits"), "Prompt tokens served from the prefix cache, by the tier "
                            "the blocks came from (tokens).", ["tier"], registry=r)
        self.prompt_tokens = Counter(_name("prompt_tokens"), "Prompt tokens of finished requests, and of "
                                     "cancelled ones whose prefill ended (tokens).", registry=r)
        self.computed_prefill = Counter(_name("computed_prefill_tokens"), "Prompt tokens computed by prefill "
                                        "(not cached) of finished requests (tokens).", registry=r)
        self.generation_tokens = Counter(_name("generation_tokens"), "Generated tokens of finished and "
                                         "cancelled requests (tokens).", registry=r)
        self.requests = Counter(_name("request_success"), "Finished requests by finish reason.",
                                ["finished_reason"], registry=r)
        self.ttft = Histogram(_name("time_to_first_token_seconds"), "Time to first token, arrival at the worker "
                              "to first token (seconds).", buckets=TTFT_BUCKETS, registry=r)
        self.e2e = Histogram(_name("e2e_request_latency_seconds"), "Arrival at the worker to last token "
                             "(seconds).", buckets=E2E_BUCKETS, registry=r)
        self.itl = Histogram(_name("inter_token_latency_seconds"), "Time between consecutive streamed token "
                             "messages of one request (seconds).", buckets=ITL_BUCKETS, registry=r)
        self.queue_time = Histogram(_name("request_queue_time_seconds"), "Arrival to first scheduled "
                                    "(seconds).", buckets=TTFT_BUCKETS, registry=r)
        self.fetch_decisions = Counter(_name("peer_fetch_decisions"), "Requests whose router named a peer "
                                       "holding more of their prefix, by what the worker did: fetched (blocks "
                                       "staged), recomputed (decided not to fetch, or the fetch failed), deadline "
                                       "(the fetch ran out of time).", ["decision"], registry=r)
        self.fetch_bytes = Counter(_name("peer_fetch_bytes"), "KV payload bytes received from peers (bytes).",
                                   registry=r)
        for t in TIERS:
            self.hits.labels(tier=t)
        for d in FETCH_DECISIONS:
            self.fetch_decisions.labels(decision=d)
        for reason in FINISH_REASONS:
            self.requests.labels(finished_reason=reason)
        r.register(_EngineCollector(self))

    # ----------------------------------------------------------- per request
    def observe_finished(self, usage: dict | None, timing: dict | None, finish_reason: str,
                         token_times: list[float] = ()) -> None:
        """Count one finished request.

        Args:
            usage: the engine's usage dict (``prompt_tokens``, ``cached_tokens_by_tier``,
                ``computed_prefill_tokens``, ``completion_tokens``; tokens), None for a
                failed request.
            timing: the engine's timing dict (``ttft_ms``, ``e2e_ms``, ``queue_ms``).
            finish_reason: "stop", "length", "error", "shed" (dropped before its prefill:
                its deadline could not be met) or "abort".
            token_times: ``time.monotonic()`` of each streamed message that carried tokens.
        """
        self.requests.labels(finished_reason=finish_reason if finish_reason in FINISH_REASONS else "abort").inc()
        if usage:
            prompt = int(usage.get("prompt_tokens", 0))
            self.queries.inc(prompt)
            self.prompt_tokens.inc(prompt)
            self.computed_prefill.inc(int(usage.get("computed_prefill_tokens", 0)))
            self.generation_tokens.inc(int(usage.get("completion_tokens", 0)))
            for tier, n in (usage.get("cached_tokens_by_tier") or {}).items():
                if n and tier in TIERS:
                    self.hits.labels(tier=tier).inc(int(n))
        if timing:
            if timing.get("ttft_ms"):
                self.ttft.observe(timing["ttft_ms"] / 1000.0)
            if timing.get("e2e_ms"):
                self.e2e.observe(timing["e2e_ms"] / 1000.0)
            self.queue_time.observe(max(0.0, timing.get("queue_ms", 0.0)) / 1000.0)
        for a, b in zip(token_times, token_times[1:]):
            self.itl.observe(max(0.0, b - a))

    def observe_cancelled(self, prompt_tokens: int, completion_tokens: int) -> None:
        """Count one request its client cancelled (or whose deadline passed) before it finished.

        Its work counts as vLLM counts it, per step: ``completion_tokens`` (the tokens streamed
        to it) into ``generation_tokens_total`` and, once its prefill ended (it produced a
        token), ``prompt_tokens`` into ``prompt_tokens_total``. Cache queries and hits count
        finished requests only, whose usage says what was reused.
        """
        self.requests.labels(finished_reason="abort").inc()
        if completion_tokens > 0:
            self.prompt_tokens.inc(max(0, int(prompt_tokens)))
            self.generation_tokens.inc(int(completion_tokens))

    def observe_fetch(self, result) -> None:
        """Count one peer-fetch hint's outcome (a `workers.peer_fetch.FetchResult`)."""
        if result is None:
            return
        self.fetch_bytes.inc(int(result.nbytes))
        outcome = result.outcome or ""
        if result.staged > 0:
            decision = "fetched"
        elif outcome in ("deadline", "projected past deadline"):
            decision = "deadline"
        else:
            decision = "recomputed"
        self.fetch_decisions.labels(decision=decision).inc()


class AdmissionCollector:
    """The gRPC server's call admission (`kvmesh.workers.grpc_guard.CallAdmission`), read at
    scrape time: data-plane calls in flight, calls still sending their request message, and
    the calls refused at their start or whose message never came (counters since start)."""

    def __init__(self, admission):
        self.a = admission

    def describe(self):
        return []

    def collect(self):
        a = self.a
        one = [(GaugeMetricFamily, "grpc_data_plane_calls_in_flight",
                "Data-plane gRPC calls holding a --max-concurrent-rpcs slot.", a.cap.active if a.cap else 0),
               (GaugeMetricFamily, "grpc_streams_open", "Long-lived control streams open (health Watch, "
                "reflection).", a.watches.total),
               (CounterMetricFamily, "grpc_calls_refused_at_start", "gRPC calls refused when they started: too "
                "many from one client host still sending their message, or too many streams.", a.refused),
               (CounterMetricFamily, "grpc_calls_message_timeout", "gRPC calls whose request message did not "
                "arrive in time (DEADLINE_EXCEEDED).", a.timed_out)]
        for family, name, help_text, value in one:
            metric = family(_name(name), help_text)
            metric.add_metric([], value)
            yield metric
        awaiting = GaugeMetricFamily(_name("grpc_calls_awaiting_message"), "Data-plane gRPC calls whose request "
                                     "message did not come with them and has not arrived yet.")
        awaiting.add_metric([], a.data_pending.total)
        yield awaiting
        control = GaugeMetricFamily(_name("grpc_control_calls_open"), "Control-plane gRPC calls open (health, "
                                    "GetLoad, Status, ...), from their start to their end.")
        control.add_metric([], a.control.total + a.anonymous_control.total)
        yield control
        anonymous = GaugeMetricFamily(_name("grpc_anonymous_control_calls_open"), "Of those, the calls of callers "
                                      "without a peer certificate (at most grpc_guard.ANONYMOUS_CONTROL_LIMIT).")
        anonymous.add_metric([], a.anonymous_control.total)
        yield anonymous


class _EngineCollector:
    """Gauges and tier counters read from the engine at scrape time, without locks."""

    def __init__(self, metrics: WorkerMetrics):
        self.m = metrics

    def describe(self):
        return []  # not known before the first scrape; keeps registration cheap

    def collect(self):
        e = self.m.engine
        sched = e.scheduler
        running = GaugeMetricFamily(_name("num_requests_running"), "Requests in the running batch.")
        running.add_metric([], len(sched.running))
        yield running
        waiting = GaugeMetricFamily(_name("num_requests_waiting"), "Requests queued, not yet scheduled.")
        waiting.add_metric([], len(sched.waiting) + len(e._inbox))
        yield waiting
        held = CounterMetricFamily(_name("requests_held_for_tenant_share"), "Requests held back (once or more) "
                                   "because starting them would push another active tenant under its share of "
                                   "the device KV pool (docs/SECURITY.md).")
        held.add_metric([], int(sched.num_held_for_fairness))
        yield held
        pool = e.cache.pool
        total = int(e.num_blocks)
        free = int(pool.num_free_blocks)
        usage = GaugeMetricFamily(_name("kv_cache_usage_perc"), "Fraction of device KV blocks held by requests "
                                  "(1 = full; cached blocks nobody uses count as free, as in vLLM).")
        usage.add_metric([], (total - free) / total if total else 0.0)
        yield usage
        block_bytes = _tier_block_bytes(e)
        evictable = int(getattr(pool, "num_evictable_blocks", 0))
        used_blocks = GaugeMetricFamily(_name("tier_used_blocks"), "KV blocks held by a tier (blocks); device: "
                                        "blocks in use or holding a cached block.", labels=["tier"])
        used_bytes = GaugeMetricFamily(_name("tier_used_bytes"), "Bytes held by a tier (bytes).", labels=["tier"])
        cap_blocks = GaugeMetricFamily(_name("tier_capacity_blocks"), "Capacity of a tier (blocks).",
                                       labels=["tier"])
        cap_bytes = GaugeMetricFamily(_name("tier_capacity_bytes"), "Capacity of a tier (bytes).", labels=["tier"])
        dev_used = total - free + evictable
        used_blocks.add_metric(["device"], dev_used)
        used_bytes.add_metric(["device"], dev_used * block_bytes)
        cap_blocks.add_metric(["device"], total)
        cap_bytes.add_metric(["device"], total * block_bytes)
        tiers = e.tiers
        counters: dict = {}
        if tiers is not None:
            counters = dict(tiers.stats_counters)
            host = tiers.host
            if host is not None:
                used_blocks.add_metric(["host"], len(host))
                used_bytes.add_metric(["host"], host.used_bytes)
                cap_bytes.add_metric(["host"], host.capacity_bytes)
            if tiers.peer is not None:
                used_blocks.add_metric(["peer"], len(tiers.peer))
            disk = tiers.disk
            if disk is not None:
                used_blocks.add_metric(["disk"], len(disk.entries))
                used_bytes.add_metric(["disk"], disk.used_bytes)
                cap_bytes.add_metric(["disk"], disk.capacity_bytes)
            if tiers.remote is not None:
                cap_bytes.add_metric(["remote"], tiers.remote.capacity_bytes)
        yield from (used_blocks, used_bytes, cap_blocks, cap_bytes)
        offload = CounterMetricFamily(_name("tier_offload_bytes"), "KV bytes offloaded from the device pool to "
                                      "the host tier, in device format (bytes).")
        offload.add_metric([], counters.get("offloaded", 0) * block_bytes)
        yield offload
        load = CounterMetricFamily(_name("tier_load_bytes"), "KV bytes loaded into the device pool from host, "
                                   "disk, peer staging or remote, in device format (bytes).")
        load.add_metric([], counters.get("loaded", 0) * block_bytes)
        yield load
        skipped = CounterMetricFamily(_name("tier_blocks_not_stored"), "Blocks not stored in a lower tier, by "
                                      "reason: offload (evicted from the device pool while no host slot was free: "
                                      "not cached below at all), disk_queue and remote_queue (their write queue "
                                      "was full) (blocks).", labels=["reason"])
        skipped.add_metric(["offload"], counters.get("offload_skipped", 0))
        skipped.add_metric(["disk_queue"], counters.get("writes_skipped", 0))
        skipped.add_metric(["remote_queue"], counters.get("remote_puts_skipped", 0))
        yield skipped
        computed = CounterMetricFamily(_name("tier_loads_not_worth_it"), "Under --tier-load-policy cost: blocks "
                                       "found in a lower tier but computed instead, their tier having measured "
                                       "slower per block than the prefill (blocks), and prefetches that did not "
                                       "read the disk or remote tier for the same reason (reads).",
                                       labels=["stage"])
        computed.add_metric(["load"], counters.get("loads_not_worth_it", 0))
        computed.add_metric(["prefetch"], counters.get("fetches_not_worth_it", 0))
        yield computed
        if tiers is not None and tiers.load_seconds_per_block:
            cost = GaugeMetricFamily(_name("tier_load_seconds_per_block"), "Measured time to bring one block "
                                     "in from a source: host slab, peer staging, disk, remote (EWMA, seconds); "
                                     "what the cost load policy weighs against the prefill.", labels=["source"])
            for source, seconds in sorted(tiers.load_seconds_per_block.items()):
                cost.add_metric([source], seconds)
            yield cost
        disk_fail = CounterMetricFamily(_name("disk_write_failures"), "Disk tier segment writes that failed.")
        disk_fail.add_metric([], counters.get("write_errors", 0))
        yield disk_fail
        bad = CounterMetricFamily(_name("checksum_failures"), "Blocks whose payload failed its checksum or "
                                  "header check when read back, by tier (blocks).", labels=["tier"])
        disk = tiers.disk if tiers is not None else None
        remote = tiers.remote if tiers is not None else None
        bad.add_metric(["disk"], int(getattr(disk, "num_damaged", 0) or 0) + int(getattr(disk, "num_torn", 0) or 0))
        bad.add_metric(["remote"], int((getattr(remote, "_counters", None) or {}).get("remote_damaged", 0)))
        yield bad
        info = GaugeMetricFamily(_name("worker_info"), "Constant 1, labelled with the worker's identity.",
                                 labels=["worker_id", "model_id", "block_size"])
        info.add_metric([self.m.worker_id, e.config.model_id, str(e.block_size)], 1.0)
        yield info


class RouterMetrics:
    """The metrics of one router process.

    Args:
        router: the `services.router.RouterServicer` (index, subscriber, policy name).
        registry: where the metrics live (a new one by default).
    """

    def __init__(self, router, registry: CollectorRegistry | None = None):
        self.router = router
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.decisions = Counter(_name("router_decisions"), "Routing decisions by policy and reason: "
                                 + "; ".join(ROUTE_REASONS) + ".", ["policy", "reason"], registry=r)
        self.routed = Counter(_name("router_routed_requests"), "Requests sent to each worker (attempts).",
                              ["worker"], registry=r)
        self.event_lag = Histogram(_name("router_event_lag_seconds"), "Seconds from a KV event batch's creation "
                                   "on its worker to its apply in this router's index (wall clocks).",
                                   buckets=LAG_BUCKETS, registry=r)
        for reason in ROUTE_REASONS:
            self.decisions.labels(policy=router.policy_name, reason=reason)
        r.register(_RouterCollector(self))

    def observe_decision(self, chosen, views, attempt: int, routed_mean: float | None = None) -> str:
        """Count one routing decision; returns its reason (see `ROUTE_REASONS`)."""
        reason = route_reason(self.router.policy, chosen, views, attempt, routed_mean)
        self.decisions.labels(policy=self.router.policy_name, reason=reason).inc()
        self.routed.labels(worker=chosen.worker_id).inc()
        return reason

    def observe_batch(self, batch) -> None:
        """Count one applied KV event batch (``batch.ts``: its creation, wall-clock seconds)."""
        ts = getattr(batch, "ts", None)
        if ts:
            self.event_lag.observe(max(0.0, time.time() - float(ts)))


def route_reason(policy, chosen, views, attempt: int, routed_mean: float | None = None) -> str:
    """Why ``chosen`` was picked among ``views`` (`services.policies.WorkerView`); pure.

    ``policy`` may have a ``share_cap`` (kv_aware): holders over it were passed over.
    ``routed_mean`` is the fleet's mean routed share when ``views`` are a shortlist (None:
    the views' own mean, as the policy computes it then).
    """
    if attempt > 0:
        return "retry"
    best = max((v.matched_blocks for v in views), default=0)
    if best <= 0:
        return "cold"
    if chosen.matched_blocks >= best:
        return "prefix_hit"
    holders = [v for v in views if v.matched_blocks == best]
    share = getattr(policy, "share_cap", None)
    if share is not None and views:
        mean = routed_mean if routed_mean is not None else sum(v.routed_recent for v in views) / len(views)
        limit = (1.0 + share) * mean + getattr(policy, "share_slack", 0.0)
        if all(h.routed_recent > limit for h in holders):
            return "share_cap"
    return "load"


class _RouterCollector:
    def __init__(self, metrics: RouterMetrics):
        self.m = metrics

    def describe(self):
        return []

    def collect(self):
        router = self.m.router
        sub = router.subscriber
        live = GaugeMetricFamily(_name("router_live_workers"), "Workers with a live lease.")
        live.add_metric([], len(sub.live_workers()))
        yield live
        idx = GaugeMetricFamily(_name("router_indexed_blocks"), "Distinct block hashes in the router's index "
                                "(blocks).")
        idx.add_metric([], router.index.num_blocks())
        yield idx
        gaps = CounterMetricFamily(_name("router_gap_resyncs"), "Snapshots applied after a gap, a malformed "
                                   "entry or a new worker.")
        gaps.add_metric([], getattr(sub, "resyncs", 0))
        yield gaps
        fails = CounterMetricFamily(_name("router_resync_failures"), "Resync snapshots that failed.")
        fails.add_metric([], getattr(sub, "resync_failures", 0))
        yield fails
        exp = CounterMetricFamily(_name("router_lease_expiries"), "Workers dropped because their lease lapsed "
                                  "(or was withdrawn at shutdown).")
        exp.add_metric([], getattr(sub, "lease_expiries", 0))
        yield exp
        lost = CounterMetricFamily(_name("router_redis_data_losses"), "Times the cluster's Redis was seen to have "
                                   "lost its keys (a restart empty, FLUSHALL or FLUSHDB); known workers were kept "
                                   "while they re-registered.")
        lost.add_metric([], getattr(sub, "data_losses", 0))
        yield lost
        stalls = CounterMetricFamily(_name("router_redis_stalls"), "Times the cluster's Redis answered a registry "
                                     "poll late (2 s or more) with most leases lapsed meanwhile; the workers were "
                                     "kept while they beat again.")
        stalls.add_metric([], getattr(sub, "stalls", 0))
        yield stalls
        limited = getattr(router, "rate_limit", None)
        if limited is not None:
            refused = CounterMetricFamily(_name("router_rate_limited"), "Generate requests refused for a tenant's "
                                          "--tenant-request-limit or --tenant-token-limit, by budget.",
                                          labels=["budget"])
            for budget, n in sorted(limited.refused.items()):
                refused.add_metric([budget], n)
            yield refused
            failed = CounterMetricFamily(_name("router_rate_limit_failed_open"), "Requests admitted without a "
                                         "rate-limit check because the cluster's Redis failed or took over "
                                         "a second.")
            failed.add_metric([], limited.failed_open)
            yield failed
