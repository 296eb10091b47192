"""Load harness: ``kvmesh bench`` replays a workload against a worker, a router, or a
fresh local cluster per routing policy.

What is sent (`bench.workloads`): a Mooncake trace (prompts synthesized from its block
ids), SGLang-style generated shared-prefix groups, or multi-turn chats whose every turn
extends the previous turn's prompt and actual completion. Decoding is greedy with
``ignore_eos``, so each request produces exactly its requested output length.

When it is sent (`bench.arrivals`): a closed loop at a fixed concurrency, or an open loop
(Poisson arrivals at a rate, or the trace's timestamps times a scale factor, optionally
capped in flight). A multi-turn turn waits for the turn before it in either case. The
first ``warmup_requests`` requests run first, as a closed loop, and are left out of the
metrics. A run is bounded in requests (``max_requests``) and may be bounded in time
(``duration_s``: no request is sent after it; requests still in flight get ``grace_s``
more seconds, then are cancelled and counted apart).

What is measured, client side, per request: TTFT (send to first streamed token), the
arrival time of every streamed message (ITL = the gaps), E2E, and the server's usage
(cached and computed prefill tokens, worker). `bench.report` aggregates them into TTFT,
TPOT, ITL and E2E percentiles, hit rates, throughput and goodput under SLOs.

Outputs, in ``out_dir``:

- ``result.json``: the run's settings and metrics (`bench.report.summarize`).
- ``result.md``: the same as a short Markdown table.
- ``requests.jsonl``: one line per request (usage, latencies, worker, error); warm-up
  requests have ``"warmup": true``.
- with ``plots``: ``ttft_cdf.png``, ``hit_rate_over_time.png``, ``worker_load.png``.

`run_policies` (``kvmesh bench --policies a,b``) starts a fresh `LocalCluster` per policy,
writes each run to ``OUT/<policy>/`` and the side-by-side ``OUT/comparison.{json,md}``
plus the plots of all policies in ``OUT/``.

Requests the target rejects (a prompt longer than its context, a full queue) are counted
in ``num_errors`` with their gRPC status code; they do not stop the run.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import heapq
import json
import math
import sys
import time
import uuid
from pathlib import Path
from typing import Awaitable, Callable, Sequence

import grpc

from kvmesh.bench import report
from kvmesh.bench.arrivals import ARRIVALS, ArrivalSpec, release_offsets
from kvmesh.bench.cli_args import existing_file, float_in, http_url, int_at_least, output_dir, target_problem
from kvmesh.bench.trace import DEFAULT_SAMPLE
from kvmesh.bench.workloads import (
    WORKLOADS,
    WorkItem,
    Workload,
    build_prompt,
    chunk_lengths,
    mooncake_workload,
    multi_turn_workload,
    shared_prefix_workload,
)
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.services.cli_checks import positive_float, positive_int
from kvmesh.services.security import client_options

SERVICES = ("auto", "worker", "router")
_MAX_MSG = 64 * 1024 * 1024
#: Seconds requests in flight may run past a ``duration_s`` bound before being cancelled.
DEFAULT_GRACE_S = 30.0

class TargetUnreachable(ConnectionError):
    """The target did not accept a connection in time."""


def _code_name(exc: grpc.RpcError) -> str:
    try:
        code = exc.code()
        return code.name if code is not None else "UNKNOWN"
    except Exception:  # noqa: BLE001 - an RpcError without a code
        return "UNKNOWN"


def _details(exc: grpc.RpcError) -> str:
    try:
        return str(exc.details() or "")
    except Exception:  # noqa: BLE001
        return str(exc)


async def detect_service(channel: grpc.aio.Channel, service: str = "auto", timeout_s: float = 10.0,
                         metadata=None) -> dict:
    """Find out whether ``channel`` leads to a Router or a Worker.

    Asks ``Router/Status`` first; UNIMPLEMENTED there means a worker, which is then asked
    ``Worker/GetInfo`` (with ``metadata``, the client's API key: a secure worker answers
    GetInfo only to callers a Generate would accept). With ``service`` "worker" or "router"
    only that one is asked.
    Returns ``{"service": "router"|"worker", "policy": str, "worker_id": str,
    "vocab_size": int, "max_model_len": int}`` (0 / "" where unknown).
    """
    if service not in SERVICES:
        raise ValueError(f"service must be one of {', '.join(SERVICES)}, got {service!r}")
    info = {"service": "", "policy": "", "worker_id": "", "vocab_size": 0, "max_model_len": 0}
    if service in ("auto", "router"):
        status = channel.unary_unary("/kvmesh.v1.Router/Status",
                                     request_serializer=pb.RouterStatusRequest.SerializeToString,
                                     response_deserializer=pb.RouterStatus.FromString)
        try:
            st = await status(pb.RouterStatusRequest(), timeout=timeout_s, metadata=metadata)
            info.update(service="router", policy=st.policy)
            return info
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                if service == "router":
                    raise ValueError("target does not implement kvmesh.v1.Router") from None
                # auto: not a router; try the worker service below
            elif service == "router":
                # Status failing for another reason still leaves Generate usable.
                info.update(service="router")
                return info
            else:
                raise
    get_info = channel.unary_unary("/kvmesh.v1.Worker/GetInfo",
                                   request_serializer=pb.WorkerInfoRequest.SerializeToString,
                                   response_deserializer=pb.WorkerInfo.FromString)
    try:
        wi = await get_info(pb.WorkerInfoRequest(), timeout=timeout_s, metadata=metadata)
        info.update(service="worker", worker_id=wi.worker_id, vocab_size=int(wi.vocab_size),
                    max_model_len=int(wi.max_model_len))
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
            if service == "worker":
                # GetInfo is optional for the bench; Generate is what counts.
                info.update(service="worker")
                return info
            raise ValueError("target implements neither kvmesh.v1.Router nor kvmesh.v1.Worker") from None
        raise
    return info



# ---------------------------------------------------------------------------- progress


class _Progress:
    """A rich progress bar on stderr: done / total, elapsed, in flight, errors, token hit rate."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._bar = None
        self._task = None
        self.in_flight = self.errors = self.prompt = self.cached = 0

    def __enter__(self) -> "_Progress":
        if self.enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TextColumn("{task.fields[stats]}"),
                                 console=Console(stderr=True), transient=False)
            self._bar.start()
        return self

    def phase(self, label: str, total: int) -> None:
        """Start a new bar line (warm-up, then the measured run)."""
        self.in_flight = self.errors = self.prompt = self.cached = 0
        if self._bar is not None:
            self._task = self._bar.add_task(label, total=total, stats=self._stats())

    def _stats(self) -> str:
        hit = (self.cached / self.prompt) if self.prompt else 0.0
        return f"in flight {self.in_flight}  errors {self.errors}  token hit {100 * hit:.1f}%"

    def sent(self) -> None:
        self.in_flight += 1
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, stats=self._stats())

    def done(self, record: dict, was_sent: bool = True) -> None:
        if was_sent:
            self.in_flight -= 1
        if record.get("ok"):
            self.prompt += int(record.get("prompt_tokens", 0))
            self.cached += int(record.get("cached_tokens", 0))
        elif not record.get("cancelled"):
            self.errors += 1
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, advance=1, stats=self._stats())

    def __exit__(self, *exc) -> bool:
        if self._bar is not None:
            self._bar.stop()
        return False


# ---------------------------------------------------------------------------- interrupts


class _Interrupt:
    """While entered (in the event loop's thread, the main one), SIGINT and SIGTERM set
    ``event`` instead of killing the run, so the run can stop sending, cancel what is in
    flight and still write what finished; ``signal`` names the first one. A second signal
    raises KeyboardInterrupt (stop now, write nothing). Outside the main thread it does
    nothing. Restores the previous handlers on exit."""

    def __init__(self):
        self.event = asyncio.Event()
        self.signal: str | None = None
        self._previous: dict = {}

    def __enter__(self) -> "_Interrupt":
        import signal
        import threading

        if threading.current_thread() is not threading.main_thread():
            return self
        loop = asyncio.get_running_loop()

        def handler(signum, _frame):
            if self.signal is not None:
                raise KeyboardInterrupt
            self.signal = signal.Signals(signum).name
            print(f"\n{self.signal}: stopping; writing the requests that finished (again to quit at once)",
                  file=sys.stderr, flush=True)
            loop.call_soon_threadsafe(self.event.set)

        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, handler)
        return self

    def __exit__(self, *exc) -> bool:
        import signal

        for sig, previous in self._previous.items():
            signal.signal(sig, signal.SIG_DFL if previous is None else previous)  # None: not set from Python
        return False


# ---------------------------------------------------------------------------- one request


async def _one(generate, item: WorkItem, prompt: list[int], block_lengths: list[int], tenant: str, run_id: str,
               timeout_s: float, t_origin: float) -> tuple[dict, list[int]]:
    """Send one request and time its stream; returns (record, completion token ids).

    Never raises for a failed RPC (the record carries the status code). If the task is
    cancelled (the run's grace deadline), the RPC is cancelled and the record says so.
    """
    req = pb.GenerateRequest(
        request_id=f"bench-{run_id}-{item.index}",
        token_ids=pb.TokenIds(ids=prompt),
        sampling=pb.SamplingParams(max_tokens=item.max_tokens, temperature=0.0, top_p=1.0, seed=0, ignore_eos=True),
        cache_salt=tenant,
    )
    rec: dict = {"index": item.index, "ok": False, "code": "", "error": "", "block_lengths": block_lengths,
                 "max_tokens": item.max_tokens, "group": item.group, "turn": item.turn}
    if item.parent is not None:
        rec["parent"] = item.parent
    completion: list[int] = []
    times: list[float] = []
    final = None
    worker_id = ""
    call = None
    t0 = time.perf_counter()
    rec["start_s"] = round(t0 - t_origin, 6)
    try:
        call = generate(req, timeout=timeout_s)
        async for msg in call:
            if len(msg.token_ids):
                times.append(time.perf_counter())
                completion.extend(msg.token_ids)
            worker_id = msg.worker_id or worker_id
            if msg.finished:
                final = msg
    except asyncio.CancelledError:
        if call is not None:
            call.cancel()
        rec.update(code="CANCELLED", error="cancelled at the run's grace deadline or by an interrupt", cancelled=True)
    except grpc.aio.AioRpcError as exc:
        rec.update(code=_code_name(exc), error=_details(exc))
    except grpc.RpcError as exc:  # pragma: no cover - other RpcError flavours
        rec.update(code=_code_name(exc), error=_details(exc))
    end = time.perf_counter()
    rec["end_s"] = round(end - t_origin, 6)
    rec["worker_id"] = worker_id
    if rec["code"]:
        return rec, completion
    if final is None:
        rec.update(code="INCOMPLETE_STREAM", error="stream ended without a finished message")
        return rec, completion
    u, t = final.usage, final.timing
    rec.update(
        ok=True, code="OK",
        prompt_tokens=int(u.prompt_tokens), cached_tokens=int(u.cached_tokens),
        cached_tokens_by_tier={k: int(v) for k, v in u.cached_tokens_by_tier.items()},
        computed_prefill_tokens=int(u.computed_prefill_tokens), completion_tokens=int(u.completion_tokens),
        finish_reason=final.finish_reason,
        ttft_ms=round(1000.0 * ((times[0] if times else end) - t0), 3), e2e_ms=round(1000.0 * (end - t0), 3),
        itl_ms=[round(1000.0 * (b - a), 3) for a, b in zip(times, times[1:])],
        server_ttft_ms=round(float(t.ttft_ms), 3), server_e2e_ms=round(float(t.e2e_ms), 3),
        queue_ms=round(float(t.queue_ms), 3), prefill_ms=round(float(t.prefill_ms), 3),
    )
    return rec, completion


# ---------------------------------------------------------------------------- dispatcher


async def drive(items: Sequence[WorkItem], send: Callable[[WorkItem], Awaitable[dict]], *,
                offsets: Sequence[float] | None = None, cap: int | None = None, stop_after_s: float | None = None,
                grace_s: float = DEFAULT_GRACE_S, finished: dict[int, bool] | None = None,
                on_sent: Callable[[], None] | None = None,
                on_record: Callable[[dict, bool], None] | None = None,
                interrupt: asyncio.Event | None = None) -> tuple[list[dict], int]:
    """Send ``items`` through ``send`` under an arrival schedule; returns (records, not sent).

    Args:
        items: the requests of this phase, in workload order.
        send: coroutine function that sends one item and returns its record (it must not
            raise; a cancelled send returns a record with ``cancelled`` True).
        offsets: release time of each item, seconds after the start (open loop); None
            releases every item at once (closed loop).
        cap: most items in flight (None: no cap). A closed loop is ``offsets=None, cap=C``.
        stop_after_s: send nothing after this many seconds; in-flight items then get
            ``grace_s`` more seconds before they are cancelled.
        finished: ``{index: ok}`` of items finished before this phase (a later turn's
            parent may be among them); updated in place.
        on_sent: called when an item is sent.
        on_record: called with each record, and whether its item was sent (False for an
            item skipped because the turn it extends failed).
        interrupt: once set (Ctrl-C), nothing more is sent and the items in flight are
            cancelled at once; the records of what finished are returned as usual.

    An item with a ``parent`` is sent only once the parent has finished, and items become
    ready in release order, ties broken by workload order. An item whose parent failed is
    not sent; its record has code ``PARENT_FAILED``.
    """
    if offsets is not None and len(offsets) != len(items):
        raise ValueError(f"{len(offsets)} offsets for {len(items)} items")
    if cap is not None and cap < 1:
        raise ValueError(f"cap must be >= 1, got {cap}")
    loop = asyncio.get_running_loop()
    t_start = loop.time()
    done = finished if finished is not None else {}
    n = len(items)
    order = sorted(range(n), key=lambda k: ((offsets[k] if offsets is not None else 0.0), k))
    next_release = 0
    ready: list[int] = []                   # heap of positions in ``items``
    waiting: dict[int, list[int]] = {}      # parent index -> positions waiting for it
    in_flight: dict[asyncio.Task, int] = {}
    records: list[dict] = []
    sent = skipped = 0

    def release(k: int) -> None:
        parent = items[k].parent
        if parent is None or done.get(parent) is True:
            heapq.heappush(ready, k)
        elif parent in done:  # the parent failed: this turn cannot be built
            skip(k)
        else:
            waiting.setdefault(parent, []).append(k)

    def skip(k: int) -> None:
        nonlocal skipped
        skipped += 1
        item = items[k]
        rec = {"index": item.index, "ok": False, "code": "PARENT_FAILED", "group": item.group, "turn": item.turn,
               "parent": item.parent, "max_tokens": item.max_tokens,
               "error": f"not sent: turn {item.parent} it extends did not succeed"}
        settle(k, rec, sent=False)

    def settle(k: int, rec: dict, sent: bool) -> None:
        records.append(rec)
        done[items[k].index] = bool(rec.get("ok"))
        if on_record is not None:
            on_record(rec, sent)
        for child in waiting.pop(items[k].index, []):
            release(child)

    def collect(tasks) -> None:
        for task in tasks:
            k = in_flight.pop(task)
            exc = None if task.cancelled() else task.exception()
            if task.cancelled() or exc is not None:
                rec = {"index": items[k].index, "ok": False, "group": items[k].group, "turn": items[k].turn,
                       "code": "CANCELLED" if task.cancelled() else "CLIENT_ERROR",
                       "cancelled": task.cancelled(), "error": "" if exc is None else repr(exc)}
            else:
                rec = task.result()
            settle(k, rec, sent=True)

    stop_at = None if stop_after_s is None else t_start + stop_after_s
    interrupted = asyncio.ensure_future(interrupt.wait()) if interrupt is not None else None
    wake_on = [interrupted] if interrupted is not None else []
    while True:
        now = loop.time()
        if stop_at is not None and now >= stop_at:
            break
        if interrupt is not None and interrupt.is_set():
            break
        while next_release < n and (offsets is None or t_start + offsets[order[next_release]] <= now):
            release(order[next_release])
            next_release += 1
        while ready and (cap is None or len(in_flight) < cap):
            k = heapq.heappop(ready)
            in_flight[asyncio.ensure_future(send(items[k]))] = k
            sent += 1
            if on_sent is not None:
                on_sent()
        if not in_flight and not ready and next_release >= n:
            break  # everything sent and finished (anything still waiting has a parent that never ran)
        wake = None
        if next_release < n and offsets is not None:
            wake = t_start + offsets[order[next_release]]
        if stop_at is not None:
            wake = stop_at if wake is None else min(wake, stop_at)
        timeout = None if wake is None else max(0.0, wake - loop.time())
        if in_flight:
            finished_tasks, _ = await asyncio.wait(list(in_flight) + wake_on, timeout=timeout,
                                                   return_when=asyncio.FIRST_COMPLETED)
            collect(t for t in finished_tasks if t is not interrupted)
        elif wake_on:
            await asyncio.wait(wake_on, timeout=timeout if timeout is not None else 0.0)
        else:
            await asyncio.sleep(timeout if timeout is not None else 0.0)

    # Sending is over; let what is in flight finish, up to the grace deadline if bounded.
    hard_stop = None if stop_at is None else stop_at + max(0.0, grace_s)
    while in_flight and not (interrupt is not None and interrupt.is_set()):
        timeout = None if hard_stop is None else max(0.0, hard_stop - loop.time())
        finished_tasks, _ = await asyncio.wait(list(in_flight) + wake_on, timeout=timeout,
                                               return_when=asyncio.FIRST_COMPLETED)
        finished_tasks = [t for t in finished_tasks if t is not interrupted]
        if not finished_tasks and not (interrupt is not None and interrupt.is_set()):
            break
        collect(finished_tasks)
    if interrupted is not None and not interrupted.done():
        interrupted.cancel()
    if in_flight:
        pending = list(in_flight)
        for task in pending:
            task.cancel()
        await asyncio.wait(pending)
        collect(pending)
    return records, n - sent - skipped


# ---------------------------------------------------------------------------- one run


def _row(rec: dict) -> dict:
    row = {k: v for k, v in rec.items() if k != "block_lengths"}
    lengths = rec.get("block_lengths")
    if lengths is not None:
        row["trace_blocks"] = len(lengths)
        if rec.get("ok"):
            row["cached_trace_blocks"] = report.covered_blocks(lengths, int(rec.get("cached_tokens", 0)))
    return row


def _drop_stale_plots(out_dir: Path) -> None:
    """Remove an earlier run's plots from ``out_dir``: this run writes its own, or none
    (``--no-plots``), and a folder must not pair this run's numbers with another's figures."""
    from kvmesh.bench.plots import PLOT_FILES

    for name in PLOT_FILES:
        (out_dir / name).unlink(missing_ok=True)


def _write_outputs(out_dir: Path, result: dict, records: list[dict]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    _drop_stale_plots(out_dir)
    (out_dir / "result.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    (out_dir / "result.md").write_text(report.to_markdown(result), encoding="utf-8")
    with (out_dir / "requests.jsonl").open("w", encoding="utf-8") as fh:
        for r in records:
            fh.write(json.dumps(_row(r)) + "\n")


def _check_run(workload: Workload, arrival: ArrivalSpec, *, warmup_requests: int = 0, duration_s: float | None = None,
               grace_s: float = DEFAULT_GRACE_S, tokens_per_block: int = 16,
               slo: dict | None = None, **_ignored) -> tuple[dict, list[float] | None]:
    """Validate a run's settings before anything starts; returns (SLO dict, release offsets)."""
    if warmup_requests < 0:
        raise ValueError(f"warmup_requests must be >= 0, got {warmup_requests}")
    if workload.items and warmup_requests >= len(workload.items):
        raise ValueError(f"{warmup_requests} warm-up requests leave nothing to measure "
                         f"(the workload has {len(workload.items)} requests)")
    if duration_s is not None and not (duration_s > 0 and math.isfinite(duration_s)):
        raise ValueError(f"duration_s must be a finite number of seconds > 0, got {duration_s!r}")
    if not (grace_s >= 0 and math.isfinite(grace_s)):
        raise ValueError(f"grace_s must be a finite number of seconds >= 0, got {grace_s!r}")
    if tokens_per_block < 1:
        raise ValueError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
    measured = workload.items[warmup_requests:]
    offsets = release_offsets(arrival, len(measured), [it.timestamp_s for it in measured])
    return report.make_slo(**(slo or {})), offsets


async def run_workload(target: str, workload: Workload, out_dir: str | Path, arrival: ArrivalSpec | None = None,
                       *, tokens_per_block: int = 16, warmup_requests: int = 0, duration_s: float | None = None,
                       grace_s: float = DEFAULT_GRACE_S, slo: dict | None = None, policy_label: str = "",
                       vocab_size: int = 256, tenant: str = "", timeout_s: float = 600.0, service: str = "auto",
                       progress: bool = True, connect_timeout_s: float = 30.0,
                       plots: bool = False, api: str = "grpc",
                       metrics_urls: Sequence[str] = (), metrics_token: str | None = None,
                       credentials: dict | None = None) -> tuple[dict, list[dict]]:
    """Run ``workload`` against ``target`` and write the outputs; returns (result, records).

    ``credentials`` (``tls_ca``, ``api_key``, ...) open a TLS channel with an API key
    (`kvmesh.services.security.client_channel`); None = a plain channel.

    Args:
        target: HOST:PORT of a kvmesh worker or router.
        workload: what to send (`bench.workloads`).
        out_dir: output folder (created).
        arrival: when to send (`bench.arrivals.ArrivalSpec`); default a closed loop of 4.
        tokens_per_block: K, the block unit of ``hit_rate_blocks`` for workloads without
            trace blocks (the prompt cut into K-token blocks).
        warmup_requests: the first N items run first as a closed loop (at the arrival's
            concurrency cap, else its ``concurrency``) and are left out of the metrics.
        duration_s: time bound of the measured run, seconds: nothing is sent after it.
        grace_s: seconds in-flight requests get after ``duration_s`` before they are
            cancelled (counted in ``num_cancelled``).
        slo: service-level objectives in ms (`bench.report.make_slo`) for goodput.
        policy_label: the ``policy`` in the result; default: the router's policy, or
            "worker" for a single worker.
        vocab_size: largest token id + 1 the workload may use; checked against a worker.
        tenant: cache salt sent with every request.
        timeout_s: deadline of each request, seconds.
        service: "auto", "worker" or "router" (which gRPC service to call).
        progress: show a progress bar on stderr.
        connect_timeout_s: how long to wait (seconds) for the target to accept a connection;
            a refused connection is retried until then (a server may still be starting), with
            one line on stderr (when ``progress``) saying why after a few seconds.
        plots: also write the PNG plots of this run into ``out_dir``.
        api: "grpc" (``target`` is HOST:PORT of the gRPC API, through
            `services.client.AsyncKvmeshClient`) or "openai" (``target`` is the HTTP
            front's base URL or HOST:PORT; `bench.openai_target`).
        metrics_urls: ``/metrics`` endpoints scraped before and after the measured run;
            their counters go in ``result["server"]`` (`bench.server_metrics.run_delta`)
            and ``server_hit_rate_tokens``. ``metrics_token``: the bearer token they ask for.

    Raises:
        TargetUnreachable: no connection within ``connect_timeout_s``.
        ValueError: bad arguments, or a target that is neither service.
    """
    arrival = arrival or ArrivalSpec()
    slo, offsets = _check_run(workload, arrival, warmup_requests=warmup_requests, duration_s=duration_s,
                              grace_s=grace_s, tokens_per_block=tokens_per_block, slo=slo)
    out_dir = Path(out_dir)
    items = workload.items
    warm, measured = items[:warmup_requests], items[warmup_requests:]
    needs_history = {it.parent for it in items if it.parent is not None}
    history: dict[int, list[int]] = {}
    run_id = uuid.uuid4().hex[:8]

    if api not in ("grpc", "openai"):
        raise ValueError(f"api must be grpc or openai, got {api!r}")
    from kvmesh.bench import server_metrics

    async with contextlib.AsyncExitStack() as stack:
        if api == "openai":
            from kvmesh.bench.openai_target import OpenAITarget

            front = await stack.enter_async_context(OpenAITarget(
                target, **{k: v for k, v in (credentials or {}).items() if v}))
            try:
                info = await front.detect(connect_timeout_s)
            except ConnectionError as exc:
                raise TargetUnreachable(str(exc)) from None
            generate = front.generate
        else:
            from kvmesh.services.client import AsyncKvmeshClient

            client = await stack.enter_async_context(AsyncKvmeshClient(target, timeout=timeout_s,
                                                                          **(credentials or {})))
            try:
                await client.wait_ready(connect_timeout_s, on_wait=lambda why: print(
                    f"bench: {target} not reachable yet: {why}; retrying for up to {connect_timeout_s:g} s",
                    file=sys.stderr, flush=True) if progress else None)
            except TimeoutError as exc:
                raise TargetUnreachable(str(exc)) from None
            channel = client.channel
            info = await detect_service(channel, service, metadata=client.metadata)
            if info["vocab_size"] and vocab_size > info["vocab_size"]:
                raise ValueError(f"vocab_size {vocab_size} exceeds the worker's vocabulary ({info['vocab_size']})")
            svc = "Router" if info["service"] == "router" else "Worker"
            generate = functools.partial(channel.unary_stream(
                f"/kvmesh.v1.{svc}/Generate", request_serializer=pb.GenerateRequest.SerializeToString,
                response_deserializer=pb.GenerateResponse.FromString), metadata=client.metadata)
        policy = policy_label or info["policy"] or info["service"]
        origin = {"t": time.perf_counter()}

        async def send(item: WorkItem) -> dict:
            prompt = build_prompt(item, history)
            lengths = item.block_lengths if item.block_lengths is not None else chunk_lengths(len(prompt),
                                                                                              tokens_per_block)
            rec, completion = await _one(generate, item, prompt, lengths, tenant, run_id, timeout_s, origin["t"])
            if rec.get("ok") and item.index in needs_history:
                history[item.index] = prompt + completion
            return rec

        finished: dict[int, bool] = {}
        records: list[dict] = []
        not_sent = len(measured)
        duration = 0.0
        with _Progress(progress) as bar, _Interrupt() as interrupt:
            warm_records: list[dict] = []
            if warm:
                bar.phase(f"{policy} warm-up", len(warm))
                origin["t"] = time.perf_counter()
                warm_records, _ = await drive(warm, send, cap=arrival.cap or arrival.concurrency,
                                              finished=finished, on_sent=bar.sent, on_record=bar.done,
                                              interrupt=interrupt.event)
                for r in warm_records:
                    r["warmup"] = True
            if not interrupt.event.is_set():
                if progress:
                    print(f"[{policy}] sending {len(measured)} requests to {target}; Ctrl-C stops and writes the "
                          "requests that finished", file=sys.stderr, flush=True)
                bar.phase(f"{policy}", len(measured))
                scraped = await asyncio.to_thread(server_metrics.scrape_all, metrics_urls,
                                                  metrics_token) if metrics_urls else None
                origin["t"] = time.perf_counter()
                records, not_sent = await drive(measured, send, offsets=offsets, cap=arrival.cap,
                                                stop_after_s=duration_s, grace_s=grace_s, finished=finished,
                                                on_sent=bar.sent, on_record=bar.done, interrupt=interrupt.event)
                duration = time.perf_counter() - origin["t"]
                if scraped is not None:
                    server = server_metrics.run_delta(scraped, await asyncio.to_thread(
                        server_metrics.scrape_all, metrics_urls, metrics_token))
                    if server["restarted_endpoints"]:
                        print(f"warning: {server['restarted_endpoints']} of the --metrics-url servers restarted during "
                              "the run (their counters went down): the server-side figures count only what they "
                              "did since", file=sys.stderr, flush=True)

    records.sort(key=lambda r: r["index"])
    warm_records.sort(key=lambda r: r["index"])
    result = {
        "policy": policy,
        "target": target,
        "service": info["service"],
        "workload": workload.name,
        "workload_params": workload.params,
        "tokens_per_block": tokens_per_block,
        "arrival": arrival.describe(),
        "concurrency": arrival.concurrency if arrival.kind == "closed" else arrival.max_concurrency,
        "max_requests": workload.params.get("max_requests"),
        "max_output_tokens": workload.params.get("max_output_tokens"),
        "vocab_size": vocab_size,
        "tenant": tenant,
        "warmup_requests": len(warm),
        "duration_limit_s": duration_s,
        "grace_s": grace_s if duration_s is not None else None,
        "num_not_sent": not_sent,
        "infinite_cache_hit_rate_blocks": workload.infinite_cache_hit_rate_blocks,
        # interrupted (SIGINT/SIGTERM): the metrics cover only the requests that finished
        "partial": interrupt.signal is not None,
        "interrupted_by": interrupt.signal,
    }
    if workload.name == "mooncake":
        result["trace"] = workload.params.get("trace")
        result["synthesized_prompt_tokens"] = sum(len(it.tokens) for it in items)
    result.update(report.summarize(records, duration_s=duration, slo=slo))
    if scraped is not None:
        result.update(server=server, server_hit_rate_tokens=server["hit_rate_tokens"])
    _write_outputs(out_dir, result, warm_records + records)
    if plots:
        from kvmesh.bench import plots as _plots

        result["plots"] = [p.name for p in _plots.write_plots({policy: records}, out_dir)]
        (out_dir / "result.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return result, warm_records + records


async def run_bench(target: str, trace_path: str | Path | None, out_dir: str | Path, max_requests: int | None = None,
                    tokens_per_block: int = 16, max_output_tokens: int | None = None, concurrency: int = 4,
                    policy_label: str = "", vocab_size: int = 256, tenant: str = "", timeout_s: float = 600,
                    service: str = "auto", progress: bool = True, connect_timeout_s: float = 30.0, *,
                    workload: Workload | None = None, arrival: ArrivalSpec | None = None, warmup_requests: int = 0,
                    duration_s: float | None = None, grace_s: float = DEFAULT_GRACE_S, slo: dict | None = None,
                    plots: bool = False, credentials: dict | None = None) -> dict:
    """Replay a Mooncake trace (or ``workload``) against ``target``; returns the result dict.

    Without ``workload``, the first ``max_requests`` requests of ``trace_path`` (default:
    the bundled sample) are synthesized at ``tokens_per_block`` tokens per trace block,
    with outputs capped at ``max_output_tokens``; with ``workload``, ``max_requests``
    keeps its first N items. Without ``arrival`` the run is a closed loop of
    ``concurrency``. Writes result.json, result.md and requests.jsonl into ``out_dir``;
    the other arguments are those of `run_workload`.

    Raises:
        TargetUnreachable: no connection within ``connect_timeout_s``.
        ValueError: bad arguments, a malformed trace, or a target that is neither service.
        OSError: the trace cannot be read.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if max_output_tokens is not None and max_output_tokens < 1:
        raise ValueError(f"max_output_tokens must be >= 1, got {max_output_tokens}")
    if workload is None:
        workload = mooncake_workload(trace_path or DEFAULT_SAMPLE, max_requests=max_requests,
                                     tokens_per_block=tokens_per_block, max_output_tokens=max_output_tokens,
                                     vocab_size=vocab_size)
    else:
        workload = workload.head(max_requests)
    result, _ = await run_workload(
        target, workload, out_dir, arrival or ArrivalSpec("closed", concurrency=concurrency),
        tokens_per_block=tokens_per_block, warmup_requests=warmup_requests, duration_s=duration_s, grace_s=grace_s,
        slo=slo, policy_label=policy_label, vocab_size=vocab_size, tenant=tenant, timeout_s=timeout_s,
        service=service, progress=progress, connect_timeout_s=connect_timeout_s, plots=plots,
        credentials=credentials)
    return result


# ---------------------------------------------------------------------------- several policies


def known_policies() -> list[str]:
    """Routing policy names a router accepts."""
    from kvmesh.services.policies import POLICIES  # registers the field's policies too

    return sorted(POLICIES)


def run_policies(policies: Sequence[str], workload: Workload, out_dir: str | Path, *, workers: int = 2,
                 cluster_options: dict | None = None, arrival: ArrivalSpec | None = None, plots: bool = True,
                 progress: bool = True, **run_kwargs) -> dict:
    """Run ``workload`` once per routing policy, each on a fresh (cold) local cluster.

    For each policy a secure `services.launcher.LocalCluster` starts (private redis-server,
    ``workers`` worker processes built from ``cluster_options`` — `ClusterSpec` fields
    such as num_blocks, block_size, threads_per_worker, model — and a router running that
    policy); the run goes through the router and the cluster is stopped before the next
    policy, so no policy sees another's cache. Writes ``OUT/<policy>/`` (see
    `run_workload`; cluster logs in ``OUT/<policy>/logs``), ``OUT/comparison.json``
    (``results`` in policy order plus the settings), ``OUT/comparison.md`` and, with
    ``plots``, the PNG plots of all policies in ``OUT/``. ``run_kwargs`` go to
    `run_workload`. Returns the comparison dict.

    Raises:
        ValueError: no policy, a repeated or unknown policy, or workers < 1.
        RuntimeError: a cluster failed to start.
    """
    from kvmesh.services.launcher import ClusterSpec, LocalCluster

    policies = [p.strip() for p in policies if p.strip()]
    if not policies:
        raise ValueError("no routing policy given")
    if len(set(policies)) != len(policies):
        raise ValueError(f"policies repeat a name: {', '.join(policies)}")
    known = known_policies()
    unknown = [p for p in policies if p not in known]
    if unknown:
        raise ValueError(f"unknown routing policy {', '.join(map(repr, unknown))}; known: {', '.join(known)}")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    _check_run(workload, arrival or ArrivalSpec(), **run_kwargs)  # fail before any cluster starts
    out_dir = Path(out_dir)
    options = dict(cluster_options or {})
    results: list[dict] = []
    runs: dict[str, list[dict]] = {}
    for policy in policies:
        run_dir = out_dir / policy
        log_dir = run_dir / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        spec = ClusterSpec(num_workers=workers, policy=policy, log_dir=str(log_dir), secure=True, **options)
        print(f"[{policy}] starting a cold cluster: {workers} workers, router, redis-server (logs in {log_dir})",
              file=sys.stderr, flush=True)
        result = None
        try:
            with LocalCluster(spec) as cluster:
                result, records = asyncio.run(run_workload(cluster.router_address, workload, run_dir, arrival,
                                                           policy_label=policy, progress=progress,
                                                           metrics_urls=list(cluster.metrics_urls.values()),
                                                           metrics_token=cluster.metrics_token,
                                                           credentials=cluster.client_options(),
                                                           **run_kwargs))
        except KeyboardInterrupt:
            if result is None:
                raise
            # the run had ended and its cluster was stopping (its stop cleans up all the same):
            # keep the result, run no further policy, write the comparison
            result = {**result, "partial": True,
                      "interrupted_by": result.get("interrupted_by") or "a signal while its cluster stopped"}
        results.append(result)
        runs[policy] = [r for r in records if not r.get("warmup")]
        if result.get("partial"):  # interrupted: the policies after this one do not run
            break
    comparison = {
        "policies": policies,
        "workers": workers,
        "cluster": options,
        "workload": workload.name,
        "workload_params": workload.params,
        "arrival": (arrival or ArrivalSpec()).describe(),
        "results": results,
        "partial": any(r.get("partial") for r in results),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    _drop_stale_plots(out_dir)
    if plots:
        from kvmesh.bench import plots as _plots

        comparison["plots"] = [p.name for p in _plots.write_plots(runs, out_dir)]
    (out_dir / "comparison.json").write_text(json.dumps(comparison, indent=2) + "\n", encoding="utf-8")
    (out_dir / "comparison.md").write_text(comparison_markdown(comparison), encoding="utf-8")
    return comparison


def comparison_markdown(comparison: dict) -> str:
    """Heading with the settings, then `bench.report.compare_markdown` of the results, then the plots."""
    params = ", ".join(f"{k} {v}" for k, v in (comparison.get("workload_params") or {}).items() if v is not None)
    cluster = ", ".join(f"{k} {v}" for k, v in (comparison.get("cluster") or {}).items() if v not in (None, []))
    lines = [f"### kvmesh bench: {', '.join(comparison.get('policies') or [])}", "",
             f"workload {comparison.get('workload')} ({params}); {report.arrival_text(comparison.get('arrival') or {})}; "
             f"{comparison.get('workers')} workers" + (f" ({cluster})" if cluster else "") +
             "; a fresh cluster per policy", "",
             report.compare_markdown(comparison.get("results") or []).rstrip("\n")]
    if comparison.get("plots"):
        lines += [""] + [f"![{name[:-4]}]({name})" for name in comparison["plots"]]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- CLI

_CLUSTER_FLAGS = {  # flag dest -> ClusterSpec field
    "num_blocks": "num_blocks", "block_size": "block_size", "max_batched_tokens": "max_batched_tokens",
    "threads": "threads_per_worker", "model": "model",
}
_GSP_FLAGS = ("gsp_num_groups", "gsp_prompts_per_group", "gsp_system_prompt_len", "gsp_question_len",
              "gsp_output_len")
_MT_FLAGS = ("mt_conversations", "mt_turns", "mt_system_len", "mt_user_len", "mt_output_len")
_GSP_DEFAULTS = {"gsp_num_groups": 8, "gsp_prompts_per_group": 8, "gsp_system_prompt_len": 512,
                 "gsp_question_len": 64, "gsp_output_len": 16}
_MT_DEFAULTS = {"mt_conversations": 8, "mt_turns": 4, "mt_system_len": 256, "mt_user_len": 64, "mt_output_len": 16}


def add_arguments(p: argparse.ArgumentParser) -> None:
    where = p.add_argument_group("target (one of)")
    where.add_argument("--target", default=None, help="HOST:PORT of a running worker or router")
    where.add_argument("--policies", default=None,
                       help="comma-separated routing policies: start a fresh local cluster per policy "
                            "(e.g. round_robin,kv_aware) and compare them")
    cl = p.add_argument_group("local cluster (with --policies)")
    cl.add_argument("--workers", type=positive_int("--workers"), default=None, help="workers per cluster (default 2)")
    cl.add_argument("--num-blocks", type=positive_int("--num-blocks"), default=None, help="KV blocks per worker (default 4096)")
    cl.add_argument("--block-size", type=positive_int("--block-size"), default=None, help="tokens per KV block (default 16)")
    cl.add_argument("--max-batched-tokens", type=positive_int("--max-batched-tokens"), default=None, help="token budget per engine step (default 1024)")
    cl.add_argument("--threads", type=positive_int("--threads"), default=None, help="torch threads per worker (default cores / workers)")
    cl.add_argument("--model", default=None, help="local HF model directory (default: the built-in model)")
    cl.add_argument("--device", default=None, help="torch device of the workers: cpu or cuda[:N] (default cpu)")
    cl.add_argument("--max-seqs", type=positive_int("--max-seqs"), default=None, help="running requests per worker (default 32)")

    wl = p.add_argument_group("workload")
    wl.add_argument("--workload", default="mooncake", choices=WORKLOADS, help="what to send (default mooncake)")
    wl.add_argument("--trace", default=str(DEFAULT_SAMPLE), type=existing_file("--trace", "Mooncake-format JSON Lines trace"),
                    help="mooncake: JSON Lines trace (default: the bundled conversation sample)")
    wl.add_argument("--tokens-per-block", type=positive_int("--tokens-per-block"), default=16,
                    help="synthesized tokens per 512-token trace block; for the other workloads the block unit "
                         "of hit_rate_blocks (default 16)")
    wl.add_argument("--max-output-tokens", type=positive_int("--max-output-tokens"), default=None,
                    help="cap on each request's output length, tokens (default: the workload's)")
    wl.add_argument("--seed", type=int, default=0, help="seed of generated prompts and Poisson gaps (default 0)")
    wl.add_argument("--gsp-num-groups", type=positive_int("--gsp-num-groups"), default=None, help="shared-prefix: groups (default 8)")
    wl.add_argument("--gsp-prompts-per-group", type=positive_int("--gsp-prompts-per-group"), default=None,
                    help="shared-prefix: prompts per group (default 8)")
    wl.add_argument("--gsp-system-prompt-len", type=int_at_least(0, "--gsp-system-prompt-len", "tokens"), default=None,
                    help="shared-prefix: system prompt tokens, shared within a group (default 512)")
    wl.add_argument("--gsp-question-len", type=positive_int("--gsp-question-len"), default=None,
                    help="shared-prefix: question tokens per prompt (default 64)")
    wl.add_argument("--gsp-output-len", type=positive_int("--gsp-output-len"), default=None, help="shared-prefix: output tokens (default 16)")
    wl.add_argument("--gsp-ordered", action="store_true",
                    help="shared-prefix: send group by group instead of shuffled")
    wl.add_argument("--mt-conversations", type=positive_int("--mt-conversations"), default=None, help="multi-turn: conversations (default 8)")
    wl.add_argument("--mt-turns", type=positive_int("--mt-turns"), default=None, help="multi-turn: turns per conversation (default 4)")
    wl.add_argument("--mt-system-len", type=int_at_least(0, "--mt-system-len", "tokens"), default=None,
                    help="multi-turn: system prompt tokens shared by all conversations (default 256)")
    wl.add_argument("--mt-user-len", type=positive_int("--mt-user-len"), default=None, help="multi-turn: new user tokens per turn (default 64)")
    wl.add_argument("--mt-output-len", type=positive_int("--mt-output-len"), default=None, help="multi-turn: output tokens per turn (default 16)")

    ar = p.add_argument_group("arrivals and bounds")
    ar.add_argument("--arrival", default=None, choices=ARRIVALS,
                    help="closed (fixed concurrency), poisson (--rate) or trace (timestamps x --time-scale); "
                         "default: poisson with --rate, trace with --time-scale, else closed")
    ar.add_argument("--concurrency", type=positive_int("--concurrency"), default=None, help="closed loop: requests in flight (default 4)")
    ar.add_argument("--rate", type=float_in("--rate", 0, low_open=True, allow_inf=True, what="requests per second"), default=None, help="poisson: mean requests per second (inf: all at once)")
    ar.add_argument("--time-scale", type=positive_float("--time-scale"), default=None,
                    help="trace: multiply the trace's inter-arrival times by this (0.1 = 10x faster; default 1)")
    ar.add_argument("--max-concurrency", type=positive_int("--max-concurrency"), default=None,
                    help="open loop: cap on requests in flight (default: no cap)")
    ar.add_argument("--max-requests", type=int_at_least(1, "--max-requests", "requests"), default=None,
                    help="use only the first N requests of the workload, warm-up included (default: all)")
    ar.add_argument("--warmup-requests", type=int_at_least(0, "--warmup-requests", "requests"), default=0,
                    help="send the first N requests first, as a closed loop, and leave them out of the metrics "
                         "(default 0)")
    ar.add_argument("--duration-s", type=positive_float("--duration-s"), default=None,
                    help="stop sending after this many seconds of the measured run (default: no time bound)")
    ar.add_argument("--grace-s", type=float_in("--grace-s", 0, what="seconds"), default=None,
                    help=f"with --duration-s: seconds in-flight requests may still run before they are cancelled "
                         f"(default {DEFAULT_GRACE_S:g})")

    slo = p.add_argument_group("SLOs for goodput (requests/s meeting all of them)")
    slo.add_argument("--slo-ttft-ms", type=positive_float("--slo-ttft-ms"), default=None, help="TTFT bound, ms (default: none)")
    slo.add_argument("--slo-tpot-ms", type=positive_float("--slo-tpot-ms"), default=None, help="TPOT bound, ms (default: none)")
    slo.add_argument("--slo-e2e-ms", type=positive_float("--slo-e2e-ms"), default=None, help="E2E latency bound, ms (default: none)")

    out = p.add_argument_group("output and client")
    out.add_argument("--out", required=True, type=output_dir("--out"), help="output folder")
    out.add_argument("--policy-label", default="", help="with --target: name of the run (default: detected)")
    out.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    out.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    out.add_argument("--service", default="auto", choices=SERVICES,
                     help="with --target: gRPC service to call (default: auto-detect)")
    out.add_argument("--vocab-size", type=int_at_least(2, "--vocab-size"), default=256, help="token ids lie in [0, N) (default 256)")
    out.add_argument("--tenant", default="", help="cache salt sent with every request (default: none)")
    from kvmesh.services.security import add_client_args

    add_client_args(p)  # --api-key, --tls-ca, ... for a --target started secure (kvmesh up)
    out.add_argument("--timeout", type=positive_float("--timeout"), default=600.0, help="deadline of each request, seconds (default 600)")
    out.add_argument("--max-error-rate", type=float_in("--max-error-rate", 0, 1), default=0.0, metavar="FRACTION",
                     help="exit 1 when more than this fraction of the measured requests failed (default 0: any "
                          "failed request fails the run; requests cancelled at a --duration-s bound do not count)")
    out.add_argument("--api", default="grpc", choices=("grpc", "openai"),
                     help="with --target: grpc (HOST:PORT of the gRPC API, default) or openai (the HTTP front: "
                          "http://HOST:PORT/v1 or HOST:PORT)")
    out.add_argument("--metrics-url", action="append", type=http_url("--metrics-url"), default=[], metavar="URL",
                     help="with --target: a /metrics endpoint to scrape around the run (repeat for each worker); "
                          "the report then shows the server-side hit rate beside the client-side one "
                          "(default: none)")
    out.add_argument("--metrics-token-file", default=None, metavar="FILE",
                     help="with --metrics-url: the bearer token file those ports ask for (the servers' "
                          "--metrics-token-file; `kvmesh up` prints it)")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _only(flags: list[str], where: str) -> str:
    return f"{', '.join(flags)} only appl{'ies' if len(flags) == 1 else 'y'} {where}"


def workload_from_args(args: argparse.Namespace) -> Workload:
    """The workload the parsed flags describe, cut to ``--max-requests``.

    Raises:
        ValueError: a flag of another workload, or a bad value.
        OSError: the trace cannot be read.
    """
    given = lambda names: [_flag(n) for n in names if getattr(args, n) is not None]  # noqa: E731
    if args.workload != "shared-prefix" and (given(_GSP_FLAGS) or args.gsp_ordered):
        raise ValueError(_only(given(_GSP_FLAGS) or ["--gsp-ordered"], "to --workload shared-prefix"))
    if args.workload != "multi-turn" and given(_MT_FLAGS):
        raise ValueError(_only(given(_MT_FLAGS), "to --workload multi-turn"))
    if args.workload != "mooncake" and args.trace != str(DEFAULT_SAMPLE):
        raise ValueError("--trace only applies to --workload mooncake")
    if args.max_output_tokens is not None and args.max_output_tokens < 1:
        raise ValueError(f"--max-output-tokens must be >= 1, got {args.max_output_tokens}")
    if args.max_requests is not None and args.max_requests < 0:
        raise ValueError(f"--max-requests must be >= 0, got {args.max_requests}")

    def value(name: str, defaults: dict) -> int:
        v = getattr(args, name)
        return defaults[name] if v is None else v

    if args.workload == "mooncake":
        try:
            w = mooncake_workload(args.trace, max_requests=args.max_requests,
                                  tokens_per_block=args.tokens_per_block, max_output_tokens=args.max_output_tokens,
                                  vocab_size=args.vocab_size, seed=0)
        except (OSError, ValueError) as exc:  # unreadable, truncated or malformed
            raise ValueError(f"--trace {args.trace}: {getattr(exc, 'strerror', None) or exc}") from None
        if not w.items and args.max_requests != 0:
            raise ValueError(f"--trace {args.trace} holds no requests (an empty file, or only blank lines); give a "
                             "Mooncake-format JSON Lines trace with at least one request")
        return w
    if args.workload == "shared-prefix":
        w = shared_prefix_workload(*(value(n, _GSP_DEFAULTS) for n in _GSP_FLAGS), vocab_size=args.vocab_size,
                                   seed=args.seed, shuffle=not args.gsp_ordered,
                                   max_output_tokens=args.max_output_tokens)
    else:
        w = multi_turn_workload(*(value(n, _MT_DEFAULTS) for n in _MT_FLAGS), vocab_size=args.vocab_size,
                                seed=args.seed, max_output_tokens=args.max_output_tokens)
    return w.head(args.max_requests)


def arrival_from_args(args: argparse.Namespace) -> ArrivalSpec:
    """The arrival process the parsed flags describe (see ``--arrival``)."""
    kind = args.arrival or ("poisson" if args.rate is not None else "trace" if args.time_scale is not None
                            else "closed")
    if kind == "poisson" and args.rate is None:
        raise ValueError("--arrival poisson needs --rate (requests per second)")
    if args.rate is not None and kind != "poisson":
        raise ValueError(f"--rate only applies to --arrival poisson, not {kind}")
    if args.time_scale is not None and kind != "trace":
        raise ValueError(f"--time-scale only applies to --arrival trace, not {kind}")
    if args.max_concurrency is not None and kind == "closed":
        raise ValueError("--max-concurrency applies to open-loop arrivals; a closed loop uses --concurrency")
    if args.concurrency is not None and kind != "closed":
        raise ValueError(f"--concurrency applies to the closed loop, not --arrival {kind}; cap an open loop's "
                         "requests in flight with --max-concurrency")
    return ArrivalSpec(kind, concurrency=4 if args.concurrency is None else args.concurrency, rate=args.rate,
                       time_scale=1.0 if args.time_scale is None else args.time_scale,
                       max_concurrency=args.max_concurrency, seed=args.seed)


def _cluster_options(args: argparse.Namespace) -> dict:
    opts = {field: getattr(args, dest) for dest, field in _CLUSTER_FLAGS.items() if getattr(args, dest) is not None}
    extra = []
    if args.device is not None:
        extra += ["--device", args.device]
    if args.max_seqs is not None:
        extra += ["--max-seqs", str(args.max_seqs)]
    if extra:
        opts["extra_worker_args"] = extra
    return opts


def _check_mode(args: argparse.Namespace) -> None:
    if (args.target is None) == (args.policies is None):
        raise ValueError("give exactly one of --target HOST:PORT (a running server) and --policies P1,P2 "
                         "(a fresh local cluster per policy)")
    if args.target is not None:
        cluster_given = [_flag(d) for d in list(_CLUSTER_FLAGS) + ["workers", "device", "max_seqs"]
                         if getattr(args, d) is not None]
        if cluster_given:
            raise ValueError(_only(cluster_given, "with --policies (a local cluster)"))
        problem = target_problem(args.target, args.api)  # before waiting for a connection to it
        if problem:
            raise ValueError(problem)
    elif (args.policy_label or args.service != "auto" or args.api != "grpc" or args.metrics_url
          or args.metrics_token_file):
        raise ValueError("--policy-label, --service, --api, --metrics-url and --metrics-token-file only apply with "
                         "--target "
                         "(with --policies each local cluster's metrics are scraped on their own)")


def error_rate_problem(result: dict, max_error_rate: float) -> str | None:
    """Why ``result`` fails ``--max-error-rate`` (failed requests over measured requests,
    cancelled ones excluded), naming the error codes; None when it passes."""
    n, errors = int(result.get("num_requests") or 0), int(result.get("num_errors") or 0)
    if not errors or errors / max(1, n) <= max_error_rate:
        return None
    codes = ", ".join(f"{code} {count}" for code, count in (result.get("error_codes") or {}).items())
    return (f"{result.get('policy') or 'run'}: {errors} of {n} requests failed ({codes}), above "
            f"--max-error-rate {max_error_rate:g}")


def _exit_code(results: list[dict], max_error_rate: float, out: str) -> int:
    """130 after an interrupt, 1 when a run has too many failed requests, else 0; says why on stderr."""
    if any(r.get("partial") for r in results):
        sig = next(r["interrupted_by"] for r in results if r.get("partial"))
        print(f"interrupted by {sig}: wrote the requests that finished to {out} (result.json has \"partial\": true)",
              file=sys.stderr)
        return 130
    problems = [p for p in (error_rate_problem(r, max_error_rate) for r in results) if p]
    for p in problems:
        print(f"error: {p}", file=sys.stderr)
    return 1 if problems else 0


def cmd_bench(args: argparse.Namespace) -> int:
    """``kvmesh bench``: 0 success, 1 failed requests (above ``--max-error-rate``) or a
    cluster that did not start, 2 bad flags, 130 interrupted (SIGINT/SIGTERM).

    SIGTERM or SIGINT outside a run (e.g. while a local cluster starts) stops like Ctrl-C,
    also where SIGINT was ignored at start (a background job): the cluster is stopped on the
    way out. The previous handlers are restored."""
    import signal
    import threading

    def stop(signum, _frame):
        raise KeyboardInterrupt

    main_thread = threading.current_thread() is threading.main_thread()
    # SIGINT too: a shell starts a background job (`kvmesh bench ... &`) with SIGINT ignored,
    # and Python then keeps it ignored, so `kill -INT` did nothing while a cluster started
    sigs = (signal.SIGTERM, signal.SIGINT)
    previous = {sig: signal.signal(sig, stop) for sig in sigs} if main_thread else {}
    try:
        return _cmd_bench(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)


def _cmd_bench(args: argparse.Namespace) -> int:
    try:
        if not 0.0 <= args.max_error_rate <= 1.0:
            raise ValueError(f"--max-error-rate must be a fraction in [0, 1], got {args.max_error_rate}")
        _check_mode(args)
        if args.grace_s is not None and args.duration_s is None:
            raise ValueError(_only(["--grace-s"], "with --duration-s (a time-bounded run)"))
        if args.policies is not None:  # the workers' device and model, before any cluster starts
            from kvmesh.services.cli_checks import device_problem, model_problem

            problem = device_problem(args.device or "cpu") or model_problem(args.model)
            if problem:
                raise ValueError(problem)
        workload = workload_from_args(args)
        arrival = arrival_from_args(args)
        slo = report.make_slo(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2e_ms)
        common = dict(tokens_per_block=args.tokens_per_block, warmup_requests=args.warmup_requests,
                      duration_s=args.duration_s, grace_s=DEFAULT_GRACE_S if args.grace_s is None else args.grace_s,
                      slo=slo, vocab_size=args.vocab_size,
                      tenant=args.tenant, timeout_s=args.timeout)
        if args.target is not None:
            from kvmesh.services.metrics import read_metrics_token

            if args.metrics_token_file and not args.metrics_url:
                raise ValueError("--metrics-token-file is the token of the --metrics-url endpoints: add them, or "
                                 "leave the token file out")
            metrics_token = read_metrics_token(args.metrics_token_file) if args.metrics_token_file else None
            result, _ = asyncio.run(run_workload(args.target, workload, args.out, arrival,
                                                 policy_label=args.policy_label, service=args.service,
                                                 api=args.api, metrics_urls=args.metrics_url, credentials=client_options(args),
                                                 metrics_token=metrics_token,
                                                 progress=not args.no_progress, plots=not args.no_plots, **common))
            print(report.to_markdown(result), end="")
            print(f"wrote {Path(args.out) / 'result.json'}", file=sys.stderr)
            return _exit_code([result], args.max_error_rate, args.out)
        comparison = run_policies(args.policies.split(","), workload, args.out,
                                  workers=2 if args.workers is None else args.workers,
                                  cluster_options=_cluster_options(args), arrival=arrival,
                                  plots=not args.no_plots, progress=not args.no_progress, **common)
    except (TargetUnreachable, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # a local cluster that did not start
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except grpc.RpcError as exc:
        print(f"error: {_code_name(exc)}: {_details(exc)}", file=sys.stderr)
        return 1
    print(comparison_markdown(comparison), end="")
    print(f"wrote {Path(args.out) / 'comparison.json'}", file=sys.stderr)
    return _exit_code(comparison["results"], args.max_error_rate, args.out)


def register(subparsers) -> argparse.ArgumentParser:
    """Add the ``bench`` sub-command to an argparse sub-parser set."""
    p = subparsers.add_parser("bench", help="load-test a worker or router, or compare routing policies "
                                            "on fresh local clusters")
    add_arguments(p)
    p.set_defaults(func=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvmesh bench",
                                     description="Load-test a kvmesh worker or router, or compare routing policies.")
    add_arguments(parser)
    return cmd_bench(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
