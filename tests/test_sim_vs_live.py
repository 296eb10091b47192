"""The simulator and a live local cluster agree on hit rate for the same trace slice."""
from __future__ import annotations

import asyncio

import pytest

from kvmesh.bench.harness import run_bench
from kvmesh.bench.sim import simulate_live
from kvmesh.bench.trace import DEFAULT_SAMPLE, load_mooncake
from kvmesh.services.launcher import ClusterSpec, LocalCluster

pytestmark = pytest.mark.slow

REQUESTS = 200
WORKERS = 2
NUM_BLOCKS = 1500     # per worker: tight enough that eviction matters
TOKENS_PER_BLOCK = 16
CONCURRENCY = 4
MAX_OUTPUT = 4


def test_live_cluster_and_simulator_agree_on_hit_rate(tmp_path):
    reqs = load_mooncake(DEFAULT_SAMPLE, REQUESTS)
    sim = simulate_live(reqs, "kv_aware", WORKERS, NUM_BLOCKS, tokens_per_block=TOKENS_PER_BLOCK,
                        concurrency=CONCURRENCY, max_output_tokens=MAX_OUTPUT)
    spec = ClusterSpec(num_workers=WORKERS, num_blocks=NUM_BLOCKS, policy="kv_aware", threads_per_worker=1,
                       log_dir=str(tmp_path / "logs"))
    with LocalCluster(spec) as cluster:
        live = asyncio.run(run_bench(cluster.router_address, DEFAULT_SAMPLE, str(tmp_path / "out"),
                                     max_requests=REQUESTS, tokens_per_block=TOKENS_PER_BLOCK,
                                     max_output_tokens=MAX_OUTPUT, concurrency=CONCURRENCY,
                                     policy_label="kv_aware"))
    assert live["num_errors"] == 0
    assert live["hit_rate_blocks"] > 0.02  # the slice does reuse prefixes (timing moves it a little)
    assert abs(live["hit_rate_blocks"] - sim["hit_rate_blocks"]) <= 0.02, (live["hit_rate_blocks"],
                                                                           sim["hit_rate_blocks"])
