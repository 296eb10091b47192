"""bench.route_sweep: workload conversion and one small sweep row."""
from __future__ import annotations

from kvmesh.bench import route_sweep
from kvmesh.bench.sim import prepare
from kvmesh.bench.trace import block_token_lengths


def test_token_prompts_become_prefix_block_ids_with_their_lengths():
    a = list(range(64)) + [1, 2, 3]          # two full blocks of 32, tail of 3
    b = list(range(64)) + list(range(40))    # same two blocks, then 32 + 8 of its own
    c = [9] + list(range(63))                # differs in block 0: nothing shared
    reqs = route_sweep.tokens_to_trace([b, a, c], [5, 6, 7], [2.0, 1.0, 3.0], 32)
    assert [r.timestamp_ms for r in reqs] == [1000, 2000, 3000]  # arrival order
    ra, rb, rc = reqs
    assert ra.hash_ids[:2] == rb.hash_ids[:2] and ra.hash_ids[2] != rb.hash_ids[2]
    assert not set(rc.hash_ids) & set(ra.hash_ids)
    assert [sum(block_token_lengths(r, 32)) for r in reqs] == [67, 104, 64]
    assert (ra.output_length, rb.output_length) == (6, 5)
    # the simulator replays them at 32 tokens per block with the original token counts
    wl = prepare(reqs, block_tokens=32)
    assert [s.num_tokens for s in wl.specs] == [67, 104, 64]


def test_a_sweep_row_compares_kv_aware_with_the_field(capsys):
    rc = route_sweep.main(["--workloads", "bursty", "--workers", "4", "--quiet",
                           "--policies", "pooled,kv_aware,sglang_cache_aware,dynamo_kv"])
    assert rc == 0
    out = capsys.readouterr().out
    row = [line for line in out.splitlines() if line.startswith("| bursty | 4 |")]
    assert len(row) == 1 and row[0].count("|") == 12
    rows = route_sweep.run_sweep(["bursty"], [4], policies=["pooled", "kv_aware", "sglang_cache_aware"])
    r = rows[0]
    assert r["best_field"] == "sglang_cache_aware" and r["requests"] == 3000
    kv = r["results"]["kv_aware"]
    assert r["hit_ok"] == (kv["hit_rate_blocks"] >= r["results"]["sglang_cache_aware"]["hit_rate_blocks"])
    assert r["balance_ok"] == (kv["imbalance"] <= 1.10)
    assert route_sweep.main(["--workloads", "nope", "--quiet"]) == 2
