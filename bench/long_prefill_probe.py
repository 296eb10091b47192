"""Does a long prefill take its worker out of the cluster? A probe against a live router.

Sends one long prompt (``--tokens``, default 32,000) through the router and, every
``--interval-s`` (0.1 s) while it runs, one short request (8 tokens, 1 output token) and a
``Router.Status`` call. Prints, as JSON: the prefill's wall time, the probes' status codes,
in how many Status polls the long request's worker was listed and shown busy, and the
longest probe latency. Exit status 1 if any probe got ``UNAVAILABLE`` or the worker was
missing from any poll.

    python -m kvmesh.bench.long_prefill_probe --router 127.0.0.1:50051 --tokens 32000

Start the cluster with a context of at least ``--tokens + 1`` (the built-in model: 32,768).
"""
from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import threading
import time

import grpc

from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.proto import kvmesh_pb2_grpc as pb_grpc


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def probe(router: str, tokens: int, interval_s: float = 0.1, probe_timeout_s: float = 120.0,
          long_timeout_s: float = 3600.0) -> dict:
    """Run the probe once; returns the measurements (see module docstring).

    Raises:
        grpc.RpcError: the long request itself failed.
    """
    channel = grpc.insecure_channel(router)
    stub = pb_grpc.WorkerStub(channel)
    rstub = pb_grpc.RouterStub(channel)
    done = threading.Event()
    result: dict = {}

    def run_long():
        req = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=1))
        req.token_ids.ids.extend(_ids(1, tokens))
        try:
            for msg in stub.Generate(req, timeout=long_timeout_s):
                result["worker_id"] = msg.worker_id
        except grpc.RpcError as exc:
            result["error"] = exc
        finally:
            done.set()

    codes: collections.Counter = collections.Counter()
    worst = [0.0]
    lock = threading.Lock()

    def one(i: int):
        req = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=1))
        req.token_ids.ids.extend(_ids(1000 + i, 8))
        t = time.monotonic()
        try:
            for _ in stub.Generate(req, timeout=probe_timeout_s):
                pass
            code = "OK"
        except grpc.RpcError as exc:
            code = exc.code().name
        with lock:
            codes[code] += 1
            worst[0] = max(worst[0], time.monotonic() - t)

    polls = listed = busy = 0
    workers_before = {w.worker_id for w in rstub.Status(pb.RouterStatusRequest(), timeout=5).workers}
    threads = []
    t0 = time.monotonic()
    threading.Thread(target=run_long, daemon=True).start()
    while not done.is_set():
        th = threading.Thread(target=one, args=(len(threads),), daemon=True)
        th.start()
        threads.append(th)
        st = rstub.Status(pb.RouterStatusRequest(), timeout=5)
        polls += 1
        ids = {w.worker_id for w in st.workers}
        listed += workers_before <= ids
        busy += any(w.load.running_requests > 0 for w in st.workers)
        time.sleep(interval_s)
    prefill_s = time.monotonic() - t0
    for th in threads:
        th.join(probe_timeout_s)
    channel.close()
    if "error" in result:
        raise result["error"]
    return {"tokens": tokens, "prefill_s": round(prefill_s, 2), "probes": dict(codes),
            "status_polls": polls, "polls_with_every_worker": listed, "polls_showing_busy": busy,
            "worst_probe_s": round(worst[0], 2), "worker_id": result.get("worker_id", "")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvmesh.bench.long_prefill_probe",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--router", required=True, help="HOST:PORT of the router")
    p.add_argument("--tokens", type=int, default=32_000, help="long prompt length in tokens (default 32000)")
    p.add_argument("--interval-s", type=float, default=0.1, help="seconds between probes (default 0.1)")
    args = p.parse_args(argv)
    out = probe(args.router, args.tokens, args.interval_s)
    print(json.dumps(out, indent=2))
    ok = out["probes"].get("UNAVAILABLE", 0) == 0 and out["polls_with_every_worker"] == out["status_polls"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
