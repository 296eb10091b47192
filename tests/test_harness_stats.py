"""bench.report statistics and Markdown; bench.harness against an in-process fake service."""
from __future__ import annotations

import asyncio
import json

import grpc
import numpy as np
import pytest

from kvmesh.bench import report
from kvmesh.bench.harness import main as bench_main
from kvmesh.bench.harness import register, run_bench
from kvmesh.bench.trace import TraceRequest, synthesize_tokens
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.proto import kvmesh_pb2_grpc as pb_grpc

# ---------------------------------------------------------------------------- percentiles


@pytest.mark.parametrize("n", [1, 2, 7, 100, 1001])
def test_percentiles_match_numpy(n):
    rng = np.random.default_rng(n)
    values = rng.exponential(50.0, size=n).tolist()
    ps = [0, 1, 25, 50, 90, 99, 99.9, 100]
    ours = report.percentiles(values, ps)
    assert ours == pytest.approx(np.percentile(values, ps).tolist(), rel=1e-12, abs=1e-12)


def test_percentiles_edge_cases():
    assert report.percentiles([], [50, 99]) == [None, None]
    assert report.percentiles([3.0], [0, 50, 100]) == [3.0, 3.0, 3.0]
    assert report.percentile_dict([1, 2, 3, 4]) == {"p50": 2.5, "p90": 3.7, "p99": 3.97}
    with pytest.raises(ValueError):
        report.percentiles([1.0], [101])


# ---------------------------------------------------------------------------- summarize


def test_covered_blocks():
    assert report.covered_blocks([16, 16, 2], 0) == 0
    assert report.covered_blocks([16, 16, 2], 15) == 0
    assert report.covered_blocks([16, 16, 2], 16) == 1
    assert report.covered_blocks([16, 16, 2], 33) == 2
    assert report.covered_blocks([16, 16, 2], 34) == 3
    assert report.covered_blocks([], 10) == 0


def _ok(index, lengths, cached, completion, worker, ttft, e2e):
    prompt = sum(lengths)
    return {"index": index, "ok": True, "code": "OK", "error": "", "block_lengths": lengths,
            "prompt_tokens": prompt, "cached_tokens": cached, "computed_prefill_tokens": prompt - cached,
            "completion_tokens": completion, "cached_tokens_by_tier": {"device": cached},
            "ttft_ms": ttft, "e2e_ms": e2e, "worker_id": worker, "start_s": 0.0, "end_s": 1.0}


def test_summarize_by_hand():
    records = [
        _ok(0, [16, 16, 2], 0, 4, "w0", 10.0, 20.0),        # 0 of 3 blocks, 0 of 34 tokens
        _ok(1, [16, 16, 16, 5], 32, 2, "w1", 30.0, 60.0),   # 2 of 4 blocks, 32 of 53 tokens
        _ok(2, [16, 16, 16], 40, 6, "w0", 20.0, 40.0),      # 40 < 48: 2 of 3 blocks, 40 of 48 tokens
        {"index": 3, "ok": False, "code": "INVALID_ARGUMENT", "error": "prompt too long",
         "block_lengths": [16] * 300, "start_s": 0.0, "end_s": 0.1},
    ]
    s = report.summarize(records, duration_s=2.0)
    assert s["num_requests"] == 4 and s["num_ok"] == 3 and s["num_errors"] == 1
    assert s["errors"] == ["INVALID_ARGUMENT: prompt too long"]
    assert s["error_codes"] == {"INVALID_ARGUMENT": 1}
    # blocks: (0 + 2 + 2) / (3 + 4 + 3) = 0.4; the failed request is left out.
    assert s["trace_blocks"] == 10 and s["cached_trace_blocks"] == 4
    assert s["hit_rate_blocks"] == pytest.approx(0.4)
    # tokens: (0 + 32 + 40) / (34 + 53 + 48) = 72 / 135
    assert s["hit_rate_tokens"] == pytest.approx(round(72 / 135, 6))
    assert s["computed_prefill_tokens"] == 135 - 72
    assert s["cached_tokens_by_tier"] == {"device": 72}
    assert s["completion_tokens"] == 12
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["output_throughput"] == pytest.approx(6.0)
    assert s["worker_share"] == {"w0": pytest.approx(2 / 3, abs=1e-6), "w1": pytest.approx(1 / 3, abs=1e-6)}
    assert s["ttft_ms"] == {"p50": 20.0, "p90": 28.0, "p99": 29.8}
    assert s["e2e_ms"]["p50"] == 40.0
    assert s["duration_s"] == 2.0


def test_summarize_duration_from_records_and_empty():
    recs = [dict(_ok(0, [16], 0, 1, "w", 1.0, 2.0), start_s=1.0, end_s=3.0),
            dict(_ok(1, [16], 16, 1, "w", 1.0, 2.0), start_s=2.0, end_s=5.0)]
    s = report.summarize(recs)
    assert s["duration_s"] == 4.0 and s["request_throughput"] == 0.5
    # The second request's cached_tokens (16) covers its one block.
    assert s["hit_rate_blocks"] == 0.5
    empty = report.summarize([])
    assert empty["num_requests"] == 0 and empty["hit_rate_blocks"] == 0.0
    assert empty["ttft_ms"] == {"p50": None, "p90": None, "p99": None}


# ---------------------------------------------------------------------------- markdown


def _result(policy, hit):
    s = report.summarize([_ok(0, [16, 16], 16, 4, "w0", 5.0, 9.0)], duration_s=1.0)
    return dict(s, policy=policy, hit_rate_blocks=hit, trace="sample.jsonl", tokens_per_block=16, concurrency=4)


def test_to_markdown_has_metrics():
    md = report.to_markdown(_result("kv_aware", 0.25))
    assert "kv_aware" in md and "25.0%" in md
    for word in ("hit rate, trace blocks", "hit rate, tokens", "TTFT", "E2E", "requests/s", "output tokens/s",
                 "worker share", "computed prefill tokens"):
        assert word in md
    assert md.count("\n| ") >= 8


def test_compare_markdown_contains_each_policy():
    results = [_result("round_robin", 0.1), _result("kv_aware", 0.3), _result("a|b", 0.2)]
    md = report.compare_markdown(results)
    header = md.splitlines()[0]
    for name in ("round_robin", "kv_aware", "a\\|b"):
        assert name in header
    row = next(line for line in md.splitlines() if line.startswith("| hit rate, trace blocks"))
    assert "10.0%" in row and "30.0%" in row and "20.0%" in row
    assert report.compare_markdown([]) == "(no results)\n"


# ---------------------------------------------------------------------------- harness, fake service


class _FakeWorker(pb_grpc.WorkerServicer):
    """Prefix cache in 16-token blocks, no model: enough to exercise the harness."""

    def __init__(self, worker_id="fake-0", max_len=200, block=16):
        self.worker_id, self.max_len, self.block = worker_id, max_len, block
        self.blocks: set[tuple[int, ...]] = set()
        self.in_flight = self.max_in_flight = 0

    async def Generate(self, request, context):
        ids = list(request.token_ids.ids)
        if len(ids) > self.max_len:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"prompt of {len(ids)} tokens exceeds max_model_len {self.max_len}")
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            cached = 0
            full = (len(ids) - 1) // self.block  # the last prompt token is always computed
            while cached < full and tuple(ids[:(cached + 1) * self.block]) in self.blocks:
                cached += 1
            for n in range(1, len(ids) // self.block + 1):
                self.blocks.add(tuple(ids[:n * self.block]))
            await asyncio.sleep(0.002)
            n_out = request.sampling.max_tokens
            assert request.sampling.ignore_eos and request.sampling.temperature == 0
            for i in range(n_out - 1):
                yield pb.GenerateResponse(request_id=request.request_id, token_ids=[i % 7],
                                          worker_id=self.worker_id)
            ct = cached * self.block
            yield pb.GenerateResponse(
                request_id=request.request_id, token_ids=[1], finished=True, finish_reason="length",
                worker_id=self.worker_id,
                usage=pb.Usage(prompt_tokens=len(ids), cached_tokens=ct, cached_tokens_by_tier={"device": ct},
                               computed_prefill_tokens=len(ids) - ct, completion_tokens=n_out),
                timing=pb.Timing(queue_ms=0.1, prefill_ms=1.0, ttft_ms=1.5, e2e_ms=2.0 + n_out))
        finally:
            self.in_flight -= 1

    async def GetInfo(self, request, context):
        return pb.WorkerInfo(worker_id=self.worker_id, block_size=self.block, vocab_size=384,
                             max_model_len=self.max_len)


class _FakeRouter(pb_grpc.RouterServicer):
    def __init__(self, worker):
        self.worker = worker

    async def Generate(self, request, context):
        async for msg in self.worker.Generate(request, context):
            yield msg

    async def Status(self, request, context):
        return pb.RouterStatus(policy="fake_policy")


def _trace(tmp_path):
    lines = [
        {"timestamp": 0, "input_length": 1074, "output_length": 5, "hash_ids": [0, 1, 2]},
        {"timestamp": 1, "input_length": 1600, "output_length": 500, "hash_ids": [0, 1, 3, 4]},
        {"timestamp": 2, "input_length": 512 * 20, "output_length": 3, "hash_ids": list(range(100, 120))},
        {"timestamp": 3, "input_length": 1536, "output_length": 2, "hash_ids": [0, 1, 3]},
        {"timestamp": 4, "input_length": 600, "output_length": 1, "hash_ids": [0, 9]},
    ]
    p = tmp_path / "mini.jsonl"
    p.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    return p


async def _serve(router: bool):
    worker = _FakeWorker()
    server = grpc.aio.server()
    if router:
        pb_grpc.add_RouterServicer_to_server(_FakeRouter(worker), server)
    else:
        pb_grpc.add_WorkerServicer_to_server(worker, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port, worker


@pytest.mark.parametrize("router", [False, True])
def test_run_bench_against_fake_service(tmp_path, router):
    trace = _trace(tmp_path)

    async def go():
        server, port, worker = await _serve(router)
        try:
            result = await run_bench(f"127.0.0.1:{port}", trace, tmp_path / "out", max_output_tokens=4,
                                     concurrency=1, progress=False)
        finally:
            await server.stop(None)
        return result, worker

    result, worker = asyncio.run(go())
    assert result["service"] == ("router" if router else "worker")
    assert result["policy"] == ("fake_policy" if router else "worker")
    assert result["num_requests"] == 5
    # Request 2 has 20 blocks = 320 tokens > 200: counted as an error, not a crash.
    assert result["num_errors"] == 1 and result["errors"][0].startswith("INVALID_ARGUMENT")
    # Cached blocks by hand (K = 16, fake block 16, serial order):
    #   r0 [0,1,2]   nothing cached                                -> 0 of 3
    #   r1 [0,1,3,4] 0,1 cached (32 tokens)                        -> 2 of 4
    #   r3 [0,1,3]   0,1,3 stored by r1 but the last token is kept -> 2 of 3
    #   r4 [0,9]     0 cached                                      -> 1 of 2
    assert result["trace_blocks"] == 12 and result["cached_trace_blocks"] == 5
    assert result["hit_rate_blocks"] == pytest.approx(5 / 12, abs=1e-6)
    assert result["completion_tokens"] == 4 + 4 + 2 + 1
    assert result["worker_share"] == {"fake-0": 1.0}
    assert set(result["ttft_ms"]) == {"p50", "p90", "p99"}
    saved = json.loads((tmp_path / "out" / "result.json").read_text())
    assert saved["hit_rate_blocks"] == result["hit_rate_blocks"]
    assert "| hit rate, trace blocks |" in (tmp_path / "out" / "result.md").read_text()
    rows = [json.loads(x) for x in (tmp_path / "out" / "requests.jsonl").read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2, 3, 4]
    assert rows[1]["cached_tokens"] == 32
    assert worker.max_in_flight == 1


def test_closed_loop_keeps_concurrency(tmp_path):
    lines = [json.dumps({"timestamp": i, "input_length": 512, "output_length": 3, "hash_ids": [i]})
             for i in range(12)]
    trace = tmp_path / "flat.jsonl"
    trace.write_text("\n".join(lines) + "\n", encoding="utf-8")

    async def go():
        server, port, worker = await _serve(False)
        try:
            result = await run_bench(f"127.0.0.1:{port}", trace, tmp_path / "o", concurrency=3,
                                     policy_label="label", progress=False)
        finally:
            await server.stop(None)
        return result, worker

    result, worker = asyncio.run(go())
    assert result["policy"] == "label" and result["num_errors"] == 0 and result["num_requests"] == 12
    assert worker.max_in_flight == 3
    assert result["hit_rate_blocks"] == 0.0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_target_raises(tmp_path):
    from kvmesh.bench.harness import TargetUnreachable

    with pytest.raises(TargetUnreachable, match="cannot reach"):
        asyncio.run(run_bench(f"127.0.0.1:{_free_port()}", _trace(tmp_path), tmp_path / "o", progress=False,
                              connect_timeout_s=0.5))
    assert not (tmp_path / "o").exists()


def test_cli_register_and_errors(tmp_path, capsys):
    import argparse

    from kvmesh.bench.harness import arrival_from_args

    parser = argparse.ArgumentParser(prog="kvmesh")
    sub = parser.add_subparsers(dest="command")
    register(sub)
    args = parser.parse_args(["bench", "--target", "127.0.0.1:1", "--out", str(tmp_path), "--max-requests", "1",
                              "--no-progress"])
    assert args.func is not None and args.tokens_per_block == 16 and arrival_from_args(args).concurrency == 4
    assert args.trace.endswith("mooncake_conversation_sample.jsonl")
    with pytest.raises(SystemExit) as exc:  # an argparse error naming the flag
        bench_main(["--target", "127.0.0.1:1", "--trace", str(tmp_path / "missing.jsonl"),
                    "--out", str(tmp_path / "x"), "--no-progress"])
    assert exc.value.code == 2
    assert "error: argument --trace: --trace " in capsys.readouterr().err


def test_synthesized_prompts_in_fake_trace():
    r = TraceRequest(1, 1600, 500, (0, 1, 3, 4))
    assert len(synthesize_tokens(r, 16)) == 16 * 3 + 2
