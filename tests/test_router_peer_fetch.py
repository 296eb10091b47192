"""End-to-end peer fetch through the router: real redis-server, router and workers.

With ``round_robin`` the second request of a shared prefix lands on the worker that does
not hold it; the router names the holder in ``prefix_location`` (from the cluster index,
fed by KV events), the worker pulls the blocks over ``FetchBlocks`` and its answer equals
a cold run.
"""
from __future__ import annotations

import random
import time

import grpc
import pytest

from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.proto import kvmesh_pb2_grpc as pb_grpc
from kvmesh.services.cli import generate
from kvmesh.services.launcher import ClusterSpec, LocalCluster

pytestmark = pytest.mark.slow
BS = 16


def test_router_sends_prefix_location_and_worker_fetches(tmp_path):
    spec = ClusterSpec(num_workers=2, policy="round_robin", num_blocks=256, threads_per_worker=1,
                       log_dir=str(tmp_path), extra_worker_args=["--host-bytes", "8M"])
    rng = random.Random(5)
    prompt = [rng.randrange(256) for _ in range(1024)]
    with LocalCluster(spec) as c:
        first = generate(c.router_address, token_ids=prompt + [1], max_tokens=4)
        holder = first["worker_id"]
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:  # the router's index learns the holder's blocks
            with grpc.insecure_channel(c.router_address) as ch:
                st = pb_grpc.RouterStub(ch).Status(pb.RouterStatusRequest(), timeout=5)
            if any(w.worker_id == holder and w.cached_blocks >= len(prompt) // BS for w in st.workers):
                break
            time.sleep(0.1)
        second = generate(c.router_address, token_ids=prompt + [2], max_tokens=8)
        assert second["worker_id"] != holder
        assert second["usage"]["cached_tokens_by_tier"]["peer"] == len(prompt)
        other = c.workers[second["worker_id"]][0]
        with grpc.insecure_channel(other) as ch:
            pb_grpc.WorkerStub(ch).ClearCache(pb.ClearCacheRequest(), timeout=10)
        cold = generate(other, token_ids=prompt + [2], max_tokens=8)
        assert cold["usage"]["cached_tokens"] == 0
        assert second["token_ids"] == cold["token_ids"]
