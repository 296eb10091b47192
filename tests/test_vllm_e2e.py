"""kvmesh's vLLM router mode in front of two real vLLM CPU servers.

Two vLLM OpenAI servers (the CPU build from PyPI in the virtualenv ``scripts/setup.sh``
makes, serving a tiny random Llama written by `bench.vllm_peer`) publish their KV events
over ZMQ; a ``kvmesh router --backend vllm`` process routes OpenAI requests over them.
vLLM's own ``usage.prompt_tokens_details.cached_tokens`` is the ground truth of every hit.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import pytest

from kvmesh.bench.trace import load_mooncake, synthesize_tokens
from kvmesh.bench.vllm_peer import VLLM_ENV, make_tiny_llama, vllm_command, vllm_python, vllm_ready
from kvmesh.services.procs import free_port

VLLM_PY = vllm_python()
BLOCK = 32   # vLLM's CPU backend block size
TRACE = Path(__file__).resolve().parents[1] / "bench" / "data" / "mooncake_conversation_sample.jsonl"

pytestmark = [
    pytest.mark.slow,
    # the module's first test also pays for starting two vLLM servers (1-3 minutes each on two
    # shared cores: vLLM's import, model load and CPU warm-up), which the suite's 300 s per
    # test does not cover; the tests themselves take seconds
    pytest.mark.timeout(900),
    pytest.mark.skipif(not vllm_ready(), reason=f"no vLLM virtualenv at {VLLM_PY.parent.parent} "
                                                    "(scripts/setup.sh makes it)"),
]


def _http(url: str, body: dict | None = None, timeout: float = 120.0) -> tuple[int, dict, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), json.loads(r.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read() or b"null")


def _wait(url: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:3]} exited {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready after {timeout} s:\n{log.read_text()[-4000:]}")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Two vLLM servers and one kvmesh router (kv_aware) in front of them."""
    tmp = tmp_path_factory.mktemp("vllm")
    model = make_tiny_llama(tmp / "tiny-llama")
    procs: list[subprocess.Popen] = []
    servers = []
    env = {**os.environ, **VLLM_ENV, "PYTHONHASHSEED": "0"}
    try:
        for i in range(2):
            port, ev = free_port(), free_port()
            log = tmp / f"vllm{i}.log"
            cmd = vllm_command(VLLM_PY, model, port, ev, block_size=BLOCK, max_model_len=8192,
                               enforce_eager=True)   # routing is under test here, not vLLM's speed
            p = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env,
                                 start_new_session=True)
            procs.append(p)
            servers.append((f"v{i}", port, ev, log, p))
        for name, port, ev, log, p in servers:
            _wait(f"http://127.0.0.1:{port}/health", p, log, timeout=600)
        routers = {}
        for policy in ("kv_aware", "round_robin"):
            rport = free_port()
            rlog = tmp / f"router-{policy}.log"
            cmd = [sys.executable, "-m", "kvmesh.services.cli", "router", "--backend", "vllm",
                   "--http-port", str(rport), "--model", str(model), "--policy", policy, "--seed", "0",
                   "--served-model-name", "tiny-llama", "--vllm-block-size", str(BLOCK), "--vllm-hash-seed", "0"]
            for name, port, ev, _, _ in servers:
                cmd += ["--vllm-server", f"{name}=http://127.0.0.1:{port},tcp://127.0.0.1:{ev}"]
            rp = subprocess.Popen(cmd, stdout=open(rlog, "w"), stderr=subprocess.STDOUT, start_new_session=True)
            procs.append(rp)
            _wait(f"http://127.0.0.1:{rport}/health", rp, rlog, timeout=60)
            routers[policy] = f"http://127.0.0.1:{rport}"
        yield {"routers": routers, "servers": {n: f"http://127.0.0.1:{port}" for n, port, *_ in servers},
               "tmp": tmp}
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _complete(base: str, prompt, salt: str | None = None, max_tokens: int = 1):
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    if salt:
        body["cache_salt"] = salt
    status, headers, out = _http(base + "/v1/completions", body)
    assert status == 200, out
    usage = out["usage"]
    cached = ((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0
    return headers["x-kvmesh-worker"], int(headers["x-kvmesh-matched-blocks"]), usage["prompt_tokens"], cached, out


def _settle(base: str, min_batches: int = 1, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        _, _, h = _http(base + "/health")
        if sum(s["kv_event_batches"] for s in h["servers"].values()) >= min_batches or time.monotonic() > deadline:
            return h
        time.sleep(0.1)


def test_shared_prefix_goes_to_holder_and_vllm_confirms_hits(fleet):
    base = fleet["routers"]["kv_aware"]
    prefix = "".join(chr(97 + (i * 7) % 26) for i in range(6 * BLOCK))   # 6 blocks of bytes (+ BOS)
    holder, matched, n, cached, first = _complete(base, prefix + " first question", salt="holder-test")
    assert matched == 0 and cached == 0
    time.sleep(0.5)   # the holder's BlockStored events reach the router
    for k in range(4):
        w, matched, n, cached, out = _complete(base, prefix + f" follow-up {k}", salt="holder-test")
        assert w == holder, f"request {k} went to {w}, not to the holder {holder}"
        # the router's keys matched vLLM's published hashes: it knew what vLLM then reused
        assert cached >= 6 * BLOCK - BLOCK, out["usage"]
        assert matched * BLOCK == cached, (matched, cached)
    h = _settle(base)
    # every parent-less block vLLM published was re-hashed by the router with the same result
    assert sum(s["hash_checks"] for s in h["servers"].values()) >= 1, h
    assert sum(s["hash_mismatches"] for s in h["servers"].values()) == 0, h


def test_chat_follow_up_goes_to_holder(fleet):
    """Chat prompts are hashed from the model's chat template as vLLM renders them."""
    base = fleet["routers"]["kv_aware"]
    system = "You answer in riddles. " * 12
    w0 = None
    for k in range(3):
        body = {"model": "tiny-llama", "max_tokens": 1, "temperature": 0.0, "cache_salt": "chat-test",
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"question {k}"}]}
        status, headers, out = _http(base + "/v1/chat/completions", body)
        assert status == 200, out
        cached = (out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        matched = int(headers["x-kvmesh-matched-blocks"])
        if k == 0:
            w0 = headers["x-kvmesh-worker"]
            assert cached == 0
        else:
            assert headers["x-kvmesh-worker"] == w0
            assert cached >= len(system) // BLOCK * BLOCK - BLOCK and matched * BLOCK == cached, (matched, cached)
        time.sleep(0.5)


def test_router_errors_are_openai_shaped(fleet):
    base = fleet["routers"]["kv_aware"]
    status, _, out = _http(base + "/v1/completions", {"model": "tiny-llama", "prompt": ["a", "b"], "max_tokens": 1})
    assert status == 400 and "one prompt per request" in out["error"]["message"]
    status, _, out = _http(base + "/v1/completions", {"model": "tiny-llama", "prompt": 5})
    assert status == 400 and out["error"]["param"] == "prompt"


def _conversation_slice(max_blocks: int = 32) -> list:
    """The sample's multi-turn requests: those whose second trace block another request shares.

    Most single requests of the sample share only trace block 0 (a system prompt every
    request starts with), which any policy hits on every server; the turns of a
    conversation are where routing decides the hit rate.
    """
    reqs = load_mooncake(TRACE)
    seconds = Counter(r.hash_ids[1] for r in reqs if len(r.hash_ids) > 1)
    return [r for r in reqs if len(r.hash_ids) > 1 and seconds[r.hash_ids[1]] > 1 and len(r.hash_ids) <= max_blocks]


def test_kv_aware_beats_round_robin_on_trace_slice(fleet):
    reqs = _conversation_slice()
    assert len(reqs) >= 40
    rates = {}
    for policy, base in fleet["routers"].items():
        prompt_tokens = cached_tokens = 0
        for r in reqs:
            ids = [256] + synthesize_tokens(r, 16, vocab_size=256)   # 16 tokens per 512-token trace block
            _, _, n, cached, _ = _complete(base, ids, salt=f"trace-{policy}")  # each policy starts cold
            prompt_tokens += n
            cached_tokens += cached
            time.sleep(0.05)
        rates[policy] = cached_tokens / prompt_tokens
    print("vLLM-reported token hit rate:", rates)
    assert rates["kv_aware"] > rates["round_robin"] + 0.05, rates
