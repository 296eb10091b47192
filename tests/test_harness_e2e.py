"""End to end: `kvmesh bench --policies round_robin,kv_aware` on live local clusters (redis-server,
router and 2 workers, a fresh cluster per policy), a small multi-turn workload."""
from __future__ import annotations

import json

import pytest

from kvmesh.bench.harness import main

pytestmark = pytest.mark.slow

REQUIRED = ("policy", "num_requests", "num_errors", "hit_rate_blocks", "hit_rate_tokens", "computed_prefill_tokens",
            "ttft_ms", "e2e_ms", "request_throughput", "output_throughput", "worker_share")
CONVERSATIONS, TURNS, USER, OUT = 5, 4, 8, 2


def test_two_policies_on_fresh_clusters(tmp_path):
    out = tmp_path / "cmp"
    rc = main(["--policies", "round_robin,kv_aware", "--workers", "2", "--num-blocks", "256", "--threads", "1",
               "--workload", "multi-turn", "--mt-conversations", str(CONVERSATIONS), "--mt-turns", str(TURNS),
               "--mt-system-len", "32", "--mt-user-len", str(USER), "--max-output-tokens", str(OUT),
               "--rate", "40", "--slo-ttft-ms", "10000", "--out", str(out), "--no-progress"])
    assert rc == 0
    results = {}
    for policy in ("round_robin", "kv_aware"):
        r = json.loads((out / policy / "result.json").read_text())
        results[policy] = r
        for key in REQUIRED:
            assert key in r, (policy, key)
        assert r["policy"] == policy and r["service"] == "router"
        assert r["num_requests"] == CONVERSATIONS * TURNS and r["num_errors"] == 0 and r["num_ok"] == 20
        assert set(r["ttft_ms"]) >= {"p50", "p90", "p99"} and r["ttft_ms"]["p50"] > 0
        assert r["e2e_ms"]["p99"] >= r["ttft_ms"]["p99"] > 0
        assert r["tpot_ms"]["p50"] is not None and r["itl_ms"]["p50"] is not None
        assert r["completion_tokens"] == 20 * OUT and r["request_throughput"] > 0
        assert sum(r["worker_share"].values()) == pytest.approx(1.0, abs=1e-5)
        assert set(r["worker_share"]) <= {"worker-0", "worker-1"}
        assert r["goodput"] is not None and 0 <= r["slo_attainment"] <= 1
        assert r["prompt_tokens"] == r["cached_tokens"] + r["computed_prefill_tokens"]
        assert (out / policy / "result.md").read_text().startswith("### kvmesh bench: " + policy)
        # Each turn's prompt is the previous prompt + the completion it received + new user tokens.
        rows = {x["index"]: x for x in map(json.loads, (out / policy / "requests.jsonl").read_text().splitlines())}
        for row in rows.values():
            if row.get("parent") is not None:
                assert row["prompt_tokens"] == rows[row["parent"]]["prompt_tokens"] + OUT + USER
    # kv_aware sends a turn where the previous one's KV blocks are: it must see hits.
    assert results["kv_aware"]["hit_rate_tokens"] > 0
    comparison = json.loads((out / "comparison.json").read_text())
    assert [r["policy"] for r in comparison["results"]] == ["round_robin", "kv_aware"]
    assert comparison["workers"] == 2 and comparison["cluster"]["num_blocks"] == 256
    md = (out / "comparison.md").read_text()
    assert "| metric | round_robin | kv_aware |" in md and "goodput" in md
    for name in comparison["plots"]:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(comparison["plots"]) == 3
