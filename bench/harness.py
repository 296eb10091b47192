"""Trace replay against a worker or a router: ``kvmesh bench``.

The harness replays a Mooncake trace in file order as a closed loop: ``concurrency``
requests are in flight at all times, and a new one starts as soon as one finishes (the
trace timestamps are not used). Prompts are synthesized from the trace's block ids (see
`bench.trace.synthesize_tokens`), decoding is greedy with ``ignore_eos`` so every request
produces exactly its (capped) output length.

Outputs, in ``--out DIR``:

- ``result.json``: the run's settings and metrics (`bench.report.summarize`).
- ``result.md``: the same as a short Markdown table.
- ``requests.jsonl``: one line per request (usage, latencies, worker, error).

Requests the target rejects (a prompt longer than its context, for instance) are counted
in ``num_errors`` with their gRPC status code; they do not stop the run.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from pathlib import Path

import grpc

from bench import report
from bench.trace import DEFAULT_SAMPLE, block_token_lengths, infinite_cache_hit_rate, load_mooncake, synthesize_tokens
from proto import kvmesh_pb2 as pb

SERVICES = ("auto", "worker", "router")
_MAX_MSG = 64 * 1024 * 1024


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


async def detect_service(channel: grpc.aio.Channel, service: str = "auto", timeout_s: float = 10.0) -> dict:
    """Find out whether ``channel`` leads to a Router or a Worker.

    Asks ``Router/Status`` first; UNIMPLEMENTED there means a worker, which is then asked
    ``Worker/GetInfo``. With ``service`` "worker" or "router" only that one is asked.
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
            st = await status(pb.RouterStatusRequest(), timeout=timeout_s)
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
        wi = await get_info(pb.WorkerInfoRequest(), timeout=timeout_s)
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


class _Progress:
    """Progress line on stderr: a rich bar when rich is installed, else plain lines."""

    def __init__(self, total: int, label: str, enabled: bool = True):
        self.total, self.label, self.enabled = total, label, enabled
        self.done = self.errors = 0
        self.prompt = self.cached = 0
        self._rich = None
        self._task = None
        self._t0 = time.perf_counter()
        self._step = max(1, total // 20)
        if not enabled:
            return
        try:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._rich = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                  TimeElapsedColumn(), TextColumn("{task.fields[stats]}"),
                                  console=Console(stderr=True), transient=False)
        except ImportError:
            self._rich = None

    def _stats(self) -> str:
        hit = (self.cached / self.prompt) if self.prompt else 0.0
        return f"errors {self.errors}  token hit {100 * hit:.1f}%"

    def __enter__(self):
        if self.enabled and self._rich is not None:
            self._rich.start()
            self._task = self._rich.add_task(self.label, total=self.total, stats=self._stats())
        elif self.enabled:
            print(f"{self.label}: 0/{self.total}", file=sys.stderr, flush=True)
        return self

    def update(self, record: dict) -> None:
        self.done += 1
        if record.get("ok"):
            self.prompt += int(record.get("prompt_tokens", 0))
            self.cached += int(record.get("cached_tokens", 0))
        else:
            self.errors += 1
        if not self.enabled:
            return
        if self._rich is not None:
            self._rich.update(self._task, advance=1, stats=self._stats())
        elif self.done % self._step == 0 or self.done == self.total:
            print(f"{self.label}: {self.done}/{self.total} ({time.perf_counter() - self._t0:.1f} s, {self._stats()})",
                  file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        if self.enabled and self._rich is not None:
            self._rich.stop()
        return False


async def _one(generate, index: int, prompt: list[int], block_lengths: list[int], max_tokens: int,
               tenant: str, run_id: str, timeout_s: float, t_origin: float) -> dict:
    req = pb.GenerateRequest(
        request_id=f"bench-{run_id}-{index}",
        token_ids=pb.TokenIds(ids=prompt),
        sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, top_p=1.0, seed=0, ignore_eos=True),
        cache_salt=tenant,
    )
    rec: dict = {"index": index, "ok": False, "code": "", "error": "", "block_lengths": block_lengths,
                 "max_tokens": max_tokens}
    t0 = time.perf_counter()
    rec["start_s"] = round(t0 - t_origin, 6)
    first = None
    final = None
    worker_id = ""
    try:
        call = generate(req, timeout=timeout_s)
        async for msg in call:
            if first is None and len(msg.token_ids):
                first = time.perf_counter()
            worker_id = msg.worker_id or worker_id
            if msg.finished:
                final = msg
    except grpc.aio.AioRpcError as exc:
        rec.update(code=_code_name(exc), error=_details(exc))
    except grpc.RpcError as exc:  # pragma: no cover - other RpcError flavours
        rec.update(code=_code_name(exc), error=_details(exc))
    end = time.perf_counter()
    rec["end_s"] = round(end - t_origin, 6)
    rec["worker_id"] = worker_id
    if rec["code"]:
        return rec
    if final is None:
        rec.update(code="INCOMPLETE_STREAM", error="stream ended without a finished message")
        return rec
    u, t = final.usage, final.timing
    rec.update(
        ok=True, code="OK",
        prompt_tokens=int(u.prompt_tokens), cached_tokens=int(u.cached_tokens),
        cached_tokens_by_tier={k: int(v) for k, v in u.cached_tokens_by_tier.items()},
        computed_prefill_tokens=int(u.computed_prefill_tokens), completion_tokens=int(u.completion_tokens),
        finish_reason=final.finish_reason,
        ttft_ms=round(1000.0 * ((first or end) - t0), 3), e2e_ms=round(1000.0 * (end - t0), 3),
        server_ttft_ms=round(float(t.ttft_ms), 3), server_e2e_ms=round(float(t.e2e_ms), 3),
        queue_ms=round(float(t.queue_ms), 3), prefill_ms=round(float(t.prefill_ms), 3),
    )
    return rec


def _write_outputs(out_dir: Path, result: dict, records: list[dict]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "result.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    (out_dir / "result.md").write_text(report.to_markdown(result), encoding="utf-8")
    with (out_dir / "requests.jsonl").open("w", encoding="utf-8") as fh:
        for r in records:
            row = {k: v for k, v in r.items() if k != "block_lengths"}
            lengths = r.get("block_lengths") or []
            row["trace_blocks"] = len(lengths)
            if r.get("ok"):
                row["cached_trace_blocks"] = report.covered_blocks(lengths, int(r.get("cached_tokens", 0)))
            fh.write(json.dumps(row) + "\n")


async def run_bench(target: str, trace_path: str | Path, out_dir: str | Path, max_requests: int | None = None,
                    tokens_per_block: int = 16, max_output_tokens: int | None = None, concurrency: int = 4,
                    policy_label: str = "", vocab_size: int = 256, tenant: str = "", timeout_s: float = 600,
                    service: str = "auto", progress: bool = True, connect_timeout_s: float = 30.0) -> dict:
    """Replay ``trace_path`` against ``target`` and write result.json / result.md / requests.jsonl.

    Args:
        target: HOST:PORT of a kvmesh worker or router.
        trace_path: Mooncake JSON Lines trace.
        out_dir: output folder (created).
        max_requests: replay only the first N requests.
        tokens_per_block: K, synthesized tokens per 512-token trace block.
        max_output_tokens: cap on each request's output length (None: the trace's length).
        concurrency: requests in flight at once (closed loop).
        policy_label: the ``policy`` name in the result; default: the router's policy, or
            "worker" for a single worker.
        vocab_size: synthesized token ids lie in [0, vocab_size).
        tenant: cache salt sent with every request.
        timeout_s: deadline of each request.
        service: "auto", "worker" or "router" (which gRPC service to call).
        progress: show a progress bar / lines on stderr.
        connect_timeout_s: how long to wait for the target to accept a connection.

    Returns:
        The result dict that was written to result.json.

    Raises:
        TargetUnreachable: no connection within ``connect_timeout_s``.
        ValueError: bad arguments, a malformed trace, or a target that is neither service.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if max_output_tokens is not None and max_output_tokens < 1:
        raise ValueError(f"max_output_tokens must be >= 1, got {max_output_tokens}")
    trace_path = Path(trace_path)
    out_dir = Path(out_dir)
    reqs = load_mooncake(trace_path, max_requests=max_requests)
    prompts = [synthesize_tokens(r, tokens_per_block, vocab_size=vocab_size) for r in reqs]
    lengths = [block_token_lengths(r, tokens_per_block) for r in reqs]
    max_tokens = [max(1, min(r.output_length, max_output_tokens) if max_output_tokens else r.output_length)
                  for r in reqs]
    bound_hits, bound_total = infinite_cache_hit_rate(reqs)
    run_id = uuid.uuid4().hex[:8]

    options = [("grpc.max_send_message_length", _MAX_MSG), ("grpc.max_receive_message_length", _MAX_MSG)]
    async with grpc.aio.insecure_channel(target, options=options) as channel:
        try:
            await asyncio.wait_for(channel.channel_ready(), timeout=connect_timeout_s)
        except asyncio.TimeoutError:
            raise TargetUnreachable(f"cannot reach {target} within {connect_timeout_s:g} s") from None
        info = await detect_service(channel, service)
        if info["vocab_size"] and vocab_size > info["vocab_size"]:
            raise ValueError(f"vocab_size {vocab_size} exceeds the worker's vocabulary ({info['vocab_size']})")
        svc = "Router" if info["service"] == "router" else "Worker"
        generate = channel.unary_stream(f"/kvmesh.v1.{svc}/Generate",
                                        request_serializer=pb.GenerateRequest.SerializeToString,
                                        response_deserializer=pb.GenerateResponse.FromString)
        policy = policy_label or info["policy"] or info["service"]
        records: list[dict] = []
        next_index = iter(range(len(reqs)))
        t_origin = time.perf_counter()

        with _Progress(len(reqs), f"bench {policy}", enabled=progress) as bar:
            async def loop() -> None:
                for i in next_index:  # shared iterator: requests start in trace order
                    rec = await _one(generate, i, prompts[i], lengths[i], max_tokens[i], tenant, run_id,
                                     timeout_s, t_origin)
                    records.append(rec)
                    bar.update(rec)

            await asyncio.gather(*(loop() for _ in range(min(concurrency, max(1, len(reqs))))))
        duration = time.perf_counter() - t_origin

    records.sort(key=lambda r: r["index"])
    result = {
        "policy": policy,
        "target": target,
        "service": info["service"],
        "trace": trace_path.name,
        "tokens_per_block": tokens_per_block,
        "concurrency": concurrency,
        "max_requests": max_requests,
        "max_output_tokens": max_output_tokens,
        "vocab_size": vocab_size,
        "tenant": tenant,
        "infinite_cache_hit_rate_blocks": round(bound_hits / bound_total, 6) if bound_total else 0.0,
        "synthesized_prompt_tokens": sum(len(p) for p in prompts),
    }
    result.update(report.summarize(records, duration_s=duration))
    _write_outputs(out_dir, result, records)
    return result


# ---------------------------------------------------------------------------- CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="HOST:PORT of a worker or router")
    p.add_argument("--trace", default=str(DEFAULT_SAMPLE),
                   help="Mooncake JSON Lines trace (default: the bundled conversation sample)")
    p.add_argument("--max-requests", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--tokens-per-block", type=int, default=16,
                   help="synthesized tokens per 512-token trace block (default 16)")
    p.add_argument("--max-output-tokens", type=int, default=None,
                   help="cap on each request's output length (default: the trace's)")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight (closed loop, default 4)")
    p.add_argument("--out", required=True, help="output folder for result.json, result.md, requests.jsonl")
    p.add_argument("--policy-label", default="", help="name of this run in the result (default: detected)")
    p.add_argument("--service", default="auto", choices=SERVICES,
                   help="gRPC service to call (default: auto-detect)")
    p.add_argument("--vocab-size", type=int, default=256, help="synthesized token ids lie in [0, N) (default 256)")
    p.add_argument("--tenant", default="", help="cache salt sent with every request")
    p.add_argument("--timeout", type=float, default=600.0, help="deadline of each request, seconds")
    p.add_argument("--no-progress", action="store_true", help="no progress output on stderr")


def cmd_bench(args: argparse.Namespace) -> int:
    try:
        result = asyncio.run(run_bench(
            args.target, args.trace, args.out, max_requests=args.max_requests,
            tokens_per_block=args.tokens_per_block, max_output_tokens=args.max_output_tokens,
            concurrency=args.concurrency, policy_label=args.policy_label, vocab_size=args.vocab_size,
            tenant=args.tenant, timeout_s=args.timeout, service=args.service, progress=not args.no_progress))
    except (TargetUnreachable, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except grpc.RpcError as exc:
        print(f"error: {_code_name(exc)}: {_details(exc)}", file=sys.stderr)
        return 1
    print(report.to_markdown(result), end="")
    print(f"wrote {Path(args.out) / 'result.json'}", file=sys.stderr)
    return 1 if result["num_requests"] and not result["num_ok"] else 0


def register(subparsers) -> argparse.ArgumentParser:
    """Add the ``bench`` sub-command to an argparse sub-parser set."""
    p = subparsers.add_parser("bench", help="replay a Mooncake trace against a worker or router")
    add_arguments(p)
    p.set_defaults(func=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvmesh bench",
                                     description="Replay a Mooncake trace against a kvmesh worker or router.")
    add_arguments(parser)
    return cmd_bench(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
