"""Metrics, the OpenAI-compatible HTTP front and the Python client against a real `kvmesh up`
(redis-server, two worker processes and a router on loopback, the built-in model)."""
from __future__ import annotations

import asyncio
import json
import os
import queue
import re
import signal
import subprocess
import threading
import time

import pytest

from kvmesh.bench import server_metrics
from kvmesh.services.procs import python_cmd

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read_lines(proc: subprocess.Popen, out: queue.Queue) -> None:
    for line in proc.stdout:
        out.put(line.rstrip("\n"))


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    """`kvmesh up` as a user runs it; its printed lines give the addresses."""
    log_dir = tmp_path_factory.mktemp("up")
    args = ["up", "--workers", "2", "--threads", "1", "--num-blocks", "512"]
    # where `up` is secure by default, this module tests the plain loopback cluster
    if "--insecure" in subprocess.run(python_cmd("up", "--help"), capture_output=True, text=True).stdout:
        args.append("--insecure")
    proc = subprocess.Popen(python_cmd(*args),
                            stdout=subprocess.PIPE, stderr=open(log_dir / "up.err", "w"), text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_read_lines, args=(proc, lines), daemon=True).start()
    seen: list[str] = []
    deadline = time.monotonic() + 180
    try:
        while sum(1 for s in seen if s.endswith("/metrics")) < 3:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"kvmesh up did not start: {seen} {(log_dir / 'up.err').read_text()}")
            try:
                seen.append(lines.get(timeout=1.0))
            except queue.Empty:
                pass
        grpc_addr = next(s for s in seen if re.fullmatch(r"127\.0\.0\.1:\d+", s))
        http_url = next(s for s in seen if re.fullmatch(r"http://127\.0\.0\.1:\d+/v1", s))
        metrics = [s for s in seen if re.fullmatch(r"http://127\.0\.0\.1:\d+/metrics", s)]
        router_metrics = [u for u in metrics if ("kvmesh:router_live_workers", ()) in server_metrics.scrape(u)]
        assert len(router_metrics) == 1, metrics
        yield {"grpc": grpc_addr, "http": http_url, "router_metrics": router_metrics[0],
               "worker_metrics": [u for u in metrics if u not in router_metrics], "lines": seen}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _prompt(seed: int, n: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(0, 256) for _ in range(n)]


# ------------------------------------------------------------------------- launcher


def test_up_prints_one_url_per_line(up):
    assert up["http"].endswith("/v1")
    assert len(up["worker_metrics"]) == 2
    for url in up["worker_metrics"]:
        samples = server_metrics.scrape(url)
        assert ("kvmesh:num_requests_running", ()) in samples
        assert ("kvmesh:router_live_workers", ()) not in samples


# -------------------------------------------------------------------------- metrics


def test_counters_equal_what_a_bench_run_saw(up, tmp_path):
    """Scrape around `kvmesh bench`: the servers' counters equal the run's own records."""
    from kvmesh.bench import harness

    urls = up["worker_metrics"] + [up["router_metrics"]]
    router_before = server_metrics.scrape(up["router_metrics"])
    rc = harness.main(["--target", up["grpc"], "--workload", "shared-prefix", "--gsp-num-groups", "2",
                       "--gsp-prompts-per-group", "4", "--gsp-system-prompt-len", "96", "--gsp-question-len", "16",
                       "--gsp-output-len", "4", "--concurrency", "2", "--out", str(tmp_path), "--no-plots",
                       "--no-progress", *sum((["--metrics-url", u] for u in urls), [])])
    assert rc == 0
    result = json.loads((tmp_path / "result.json").read_text())
    records = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    ok = [r for r in records if r.get("ok")]
    assert len(ok) == 8
    server = result["server"]
    by_tier = {t: sum(r["cached_tokens_by_tier"].get(t, 0) for r in ok) for t in server_metrics.TIERS}
    assert server["prefix_cache_hits_tokens_by_tier"] == by_tier
    assert server["prefix_cache_hits_tokens"] == sum(r["cached_tokens"] for r in ok) > 0
    assert server["prefix_cache_queries_tokens"] == server["prompt_tokens"] == sum(r["prompt_tokens"] for r in ok)
    assert server["generation_tokens"] == sum(r["completion_tokens"] for r in ok) == 8 * 4
    assert server["requests"] == 8
    assert result["server_hit_rate_tokens"] == pytest.approx(result["hit_rate_tokens"], abs=1e-6)
    assert "hit rate, tokens, server metrics" in (tmp_path / "result.md").read_text()

    router_after = server_metrics.scrape(up["router_metrics"])

    def delta(name, **labels):
        want = set(labels.items())
        return sum(v - router_before.get(k, 0.0) for k, v in router_after.items()
                   if k[0] == name and want <= set(k[1]))

    assert delta("kvmesh:router_decisions_total") == 8
    assert delta("kvmesh:router_decisions_total", reason="retry") == 0
    per_worker = {}
    for r in ok:
        per_worker[r["worker_id"]] = per_worker.get(r["worker_id"], 0) + 1
    for wid, n in per_worker.items():
        assert delta("kvmesh:router_routed_requests_total", worker=wid) == n
    assert router_after[("kvmesh:router_live_workers", ())] == 2
    assert router_after[("kvmesh:router_indexed_blocks", ())] > 0
    assert router_after[("kvmesh:router_event_lag_seconds_count", ())] > 0


def test_grafana_panels_use_exposed_metrics(up):
    """Every metric a dashboard panel queries is one that a worker or the router exposes."""
    exposed = set()
    for url in up["worker_metrics"] + [up["router_metrics"]]:
        exposed |= {name for name, _ in server_metrics.scrape(url)}
    path = os.path.join(ROOT, "k8s", "grafana", "kvmesh-dashboard.json")
    with open(path, encoding="utf-8") as fh:
        dashboard = json.load(fh)
    panels = [p for p in dashboard["panels"] if p.get("type") != "row"]
    assert len(panels) >= 6
    for panel in panels:
        exprs = [t["expr"] for t in panel.get("targets", [])]
        assert exprs, f"panel {panel['title']!r} has no query"
        names = {n for e in exprs for n in re.findall(r"kvmesh:[a-zA-Z0-9_]+", e)}
        assert names, f"panel {panel['title']!r} queries no kvmesh metric"
        missing = names - exposed
        assert not missing, f"panel {panel['title']!r} queries {sorted(missing)}, not exposed"


# ---------------------------------------------------------------------- HTTP front


@pytest.fixture(scope="module")
def oa(up):
    import openai

    return openai.OpenAI(base_url=up["http"], api_key="unused", max_retries=0, timeout=120)


def _grpc_generate(up, **kw):
    from kvmesh.services.client import KvmeshClient

    with KvmeshClient(up["grpc"]) as c:
        return c.generate(**kw)


def test_completions_match_grpc_token_for_token(up, oa):
    prompt = "The quick brown fox jumps over the lazy dog. " * 3
    ref = _grpc_generate(up, prompt=prompt, max_tokens=12)
    model = oa.models.list().data[0].id
    out = oa.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0,
                                extra_body={"return_token_ids": True})
    choice = out.choices[0]
    assert choice.model_extra["token_ids"] == ref.token_ids
    assert choice.text == ref.text
    assert out.usage.completion_tokens == 12 and out.usage.prompt_tokens == ref.usage.prompt_tokens

    ids, text, usage = [], "", None
    for chunk in oa.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"return_token_ids": True}):
        for c in chunk.choices:
            ids += c.model_extra.get("token_ids") or []
            text += c.text
        usage = chunk.usage or usage
    assert ids == ref.token_ids and text == ref.text
    assert usage is not None and usage.completion_tokens == 12


def test_chat_matches_grpc_with_the_rendered_template(up, oa):
    from kvmesh.services.chat_template import ChatTemplate
    from kvmesh.workers.config import ModelConfig
    from kvmesh.workers.tokenizer import load_tokenizer

    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    tmpl = ChatTemplate.for_model(None)
    ids = ChatTemplate.encode(load_tokenizer(None, ModelConfig.tiny()), tmpl.render(messages))
    ref = _grpc_generate(up, token_ids=ids, max_tokens=10)
    out = oa.chat.completions.create(model="", messages=messages, max_tokens=10, temperature=0,
                                     extra_body={"return_token_ids": True})
    assert out.choices[0].model_extra["token_ids"] == ref.token_ids
    assert out.choices[0].message.content == ref.text
    assert out.usage.prompt_tokens == len(ids)
    pieces, roles = [], []
    for chunk in oa.chat.completions.create(model="", messages=messages, max_tokens=10, temperature=0, stream=True):
        for c in chunk.choices:
            pieces.append(c.delta.content or "")
            roles.append(c.delta.role)
    assert "".join(pieces) == ref.text
    assert roles[0] == "assistant"


def test_second_request_with_same_prefix_reports_cached_tokens(up, oa):
    """A repeated prefix is reported as OpenAI's cached_tokens, and the hit's output equals the cold one."""
    prefix = _prompt(7, 80)
    cold = oa.completions.create(model="", prompt=prefix + [1, 2, 3], max_tokens=6, temperature=0,
                                 extra_body={"return_token_ids": True})
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    hit = oa.completions.create(model="", prompt=prefix + [1, 2, 3], max_tokens=6, temperature=0,
                                extra_body={"return_token_ids": True})
    cached = hit.usage.prompt_tokens_details.cached_tokens
    assert cached >= 64
    assert sum(hit.usage.model_extra["kvmesh"]["cached_tokens_by_tier"].values()) == cached
    assert hit.choices[0].model_extra["token_ids"] == cold.choices[0].model_extra["token_ids"]


def test_errors_use_openai_bodies_and_statuses(up, oa):
    import openai

    with pytest.raises(openai.BadRequestError) as exc:
        oa.completions.create(model="", prompt="hi", max_tokens=4, stop=["x"])
    assert exc.value.status_code == 400 and "stop" in exc.value.message
    with pytest.raises(openai.NotFoundError):
        oa.completions.create(model="no-such-model", prompt="hi", max_tokens=4)
    with pytest.raises(openai.BadRequestError) as exc:
        oa.chat.completions.create(model="", messages=[{"role": "wizard", "content": "hi"}], max_tokens=4)
    assert "role" in exc.value.message
    with pytest.raises(openai.BadRequestError) as exc:  # the worker's own validation, mapped from gRPC
        oa.completions.create(model="", prompt=[999999], max_tokens=4)
    assert "out of range" in exc.value.message
    # the front's early length check quotes the context the workers serve (--num-blocks 512 x
    # 16 tokens), not the model's own (32,768), which they could not take
    with pytest.raises(openai.BadRequestError) as exc:
        oa.completions.create(model="", prompt=[1] * 40000, max_tokens=1)
    assert "at most 8191 tokens" in exc.value.message, exc.value.message


def test_bench_targets_the_http_front(up, tmp_path):
    from kvmesh.bench import harness

    rc = harness.main(["--target", up["http"], "--api", "openai", "--workload", "shared-prefix", "--gsp-num-groups",
                       "1", "--gsp-prompts-per-group", "3", "--gsp-system-prompt-len", "64", "--gsp-question-len",
                       "8", "--gsp-output-len", "3", "--concurrency", "1", "--out", str(tmp_path), "--no-plots",
                       "--no-progress"])
    assert rc == 0
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["num_ok"] == 3 and result["service"] == "openai"
    records = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert all(r["completion_tokens"] == 3 and r["ttft_ms"] > 0 for r in records)
    assert sum(r["cached_tokens"] for r in records) >= 64  # the later prompts reuse the shared system prompt


# ------------------------------------------------------------------------- client


def test_sync_and_async_clients_agree(up):
    from kvmesh.services.client import AsyncKvmeshClient, KvmeshClient

    ids = _prompt(11, 40)
    with KvmeshClient(up["grpc"]) as c:
        whole = c.generate(token_ids=ids, max_tokens=8)
        streamed = list(c.stream(token_ids=ids, max_tokens=8))
    assert [t for ch in streamed for t in ch.token_ids] == whole.token_ids and len(whole.token_ids) == 8
    assert streamed[-1].finished and streamed[-1].usage.completion_tokens == 8
    assert whole.usage.prompt_tokens == 40 and whole.timing.client_e2e_ms >= whole.timing.client_ttft_ms > 0

    async def run():
        async with AsyncKvmeshClient(up["grpc"]) as ac:
            out = await ac.generate(token_ids=ids, max_tokens=8)
            chunks = [ch async for ch in ac.stream(token_ids=ids, max_tokens=8)]
            return out, chunks

    aout, achunks = asyncio.run(run())
    assert aout.token_ids == whole.token_ids
    assert [t for ch in achunks for t in ch.token_ids] == whole.token_ids
    # the same prompt again: on the worker that served it, its full blocks are cached (kv_aware may
    # also send a 40-token prompt to the less loaded worker, which computes it)
    assert aout.usage.cached_tokens >= 32 or aout.worker_id != whole.worker_id


# ------------------------------------------------------------ a single worker's front


def test_single_worker_serves_http_and_metrics_with_flags(spawn_worker):
    import urllib.request

    import openai

    from kvmesh.services.client import KvmeshClient
    from kvmesh.services.procs import free_port

    http, metrics = free_port(), free_port()
    address, _ = spawn_worker("--http-port", str(http), "--metrics-port", str(metrics))
    ids = _prompt(3, 40)
    with KvmeshClient(address) as c:
        ref = c.generate(token_ids=ids, max_tokens=5)
    oa = openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="unused", max_retries=0, timeout=60)
    out = oa.completions.create(model="", prompt=ids, max_tokens=5, temperature=0,
                                extra_body={"return_token_ids": True})
    assert out.choices[0].model_extra["token_ids"] == ref.token_ids
    assert out.usage.prompt_tokens_details.cached_tokens == 32  # the gRPC request cached 2 full blocks
    with urllib.request.urlopen(f"http://127.0.0.1:{http}/health", timeout=10) as r:
        assert json.loads(r.read()) == {"status": "ok"}
    for url in (f"http://127.0.0.1:{metrics}/metrics", f"http://127.0.0.1:{http}/metrics"):
        s = server_metrics.scrape(url)
        assert s[("kvmesh:request_success_total", (("finished_reason", "length"),))] == 2
        assert s[("kvmesh:prefix_cache_hits_total", (("tier", "device"),))] == 32


def test_policy_runs_report_the_servers_hit_rate(tmp_path):
    """`kvmesh bench --policies` scrapes each fresh cluster's own metrics around its run."""
    from kvmesh.bench import harness
    from kvmesh.bench.workloads import shared_prefix_workload

    workload = shared_prefix_workload(1, 4, 64, 8, 3, seed=3)
    comparison = harness.run_policies(["round_robin"], workload, tmp_path, workers=1, plots=False, progress=False,
                                      cluster_options={"num_blocks": 256, "threads_per_worker": 1})
    result = comparison["results"][0]
    assert result["num_ok"] == 4
    assert result["server"]["requests"] == 4
    assert result["server"]["prefix_cache_hits_tokens"] == round(result["hit_rate_tokens"] * result["prompt_tokens"]) > 0
    assert result["server_hit_rate_tokens"] == pytest.approx(result["hit_rate_tokens"], abs=1e-6)


def test_a_worker_with_a_metrics_token_serves_no_metrics_without_it(spawn_worker, tmp_path):
    """`--metrics-token-file` guards the counters: the metrics port answers 401 without the
    token, and the same process's HTTP front, which cannot ask for it, answers 404 naming
    the flag instead of serving them (a review read them there without a token)."""
    import urllib.error
    import urllib.request

    from kvmesh.services.procs import free_port

    token = tmp_path / "metrics.token"
    token.write_text("tok-" + "x" * 20 + "\n")
    http, metrics = free_port(), free_port()
    spawn_worker("--http-port", str(http), "--metrics-port", str(metrics), "--metrics-token-file", str(token))
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=10)
    assert err.value.code == 401
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(f"http://127.0.0.1:{http}/metrics", timeout=10)
    body = err.value.read().decode()
    assert err.value.code == 404 and "--metrics-token-file" in body and "kvmesh:" not in body
    for scheme in ("Bearer", "bearer"):  # the scheme's case does not matter (RFC 7235)
        req = urllib.request.Request(f"http://127.0.0.1:{metrics}/metrics",
                                     headers={"Authorization": f"{scheme} tok-{'x' * 20}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert b"kvmesh:" in r.read()
