"""bench.route_sweep: workload conversion and one small sweep row."""
from __future__ import annotations

import pytest

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
    assert len(row) == 1 and row[0].count("|") == 14
    rows = route_sweep.run_sweep(["bursty"], [4], policies=["pooled", "kv_aware", "sglang_cache_aware"])
    r = rows[0]
    assert r["best_field"] == "sglang_cache_aware" and r["requests"] == 3000
    kv = r["results"]["kv_aware"]
    assert r["hit_ok"] == (kv["hit_rate_blocks"] >= r["results"]["sglang_cache_aware"]["hit_rate_blocks"])
    assert r["balance_ok"] == (kv["imbalance"] <= 1.10)
    sg = r["results"]["sglang_cache_aware"]
    if sg["imbalance"] <= 1.10:
        assert r["best_balanced_field"] == "sglang_cache_aware"
        assert r["hit_ok_balanced"] == r["hit_ok"]
    else:
        assert r["best_balanced_field"] is None and r["hit_ok_balanced"]
    assert route_sweep.main(["--workloads", "nope", "--quiet"]) == 2


def test_a_sweep_with_the_peer_tier_reports_what_came_from_a_peer(capsys):
    rc = route_sweep.main(["--workloads", "agents", "--workers", "4", "--quiet", "--peer-fetch-gbps", "100",
                           "--policies", "pooled,kv_aware,dynamo_kv"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "from a peer (kv / best field)" in out
    row = [line for line in out.splitlines() if line.startswith("| agents | 4 |")]
    assert len(row) == 1 and row[0].count("|") == 15
    rows = route_sweep.run_sweep(["agents"], [4], policies=["kv_aware", "dynamo_kv"],
                                 peer_fetch=route_sweep.PeerFetch(bytes_per_s=12.5e9))
    # dynamo_kv's load term sends steps away from their session's holder: those fetch their context
    assert rows[0]["results"]["dynamo_kv"]["peer_hit_rate_blocks"] > 0.01
    assert all(0 <= r["peer_hit_rate_blocks"] < 1 for r in rows[0]["results"].values())


def test_the_balanced_comparison_skips_field_routers_over_the_balance_target():
    def res(hit, imb):
        return {"hit_rate_blocks": hit, "imbalance": imb, "ttft_p99_ms": 100.0}
    row = route_sweep._judge({"workload": "w", "workers": 10, "results": {
        "kv_aware": res(0.50, 1.05), "sglang_cache_aware": res(0.60, 2.0), "dynamo_kv": res(0.45, 1.08),
        "llmd_precise": res(0.55, 1.11)}})
    assert row["best_field"] == "sglang_cache_aware" and not row["hit_ok"]
    assert row["best_balanced_field"] == "dynamo_kv" and row["hit_ok_balanced"]
    assert row["balance_ok"] and row["p99_ok"]
    md = route_sweep.sweep_markdown([row])
    assert "dynamo_kv 45.00% @1.08" in md and "| ✗ | ✓ | ✓ | ✓ |" in md


def test_held_out_workloads_are_named_apart_and_differ_from_the_tuning_ones():
    assert set(route_sweep.TUNING).isdisjoint(route_sweep.HELD_OUT) and len(route_sweep.HELD_OUT) >= 6
    table = {w.name: w for w, _ in route_sweep.workloads()}
    a = table["gsp-64x16"].make(10, 0.7)
    b = table["ho-gsp-32x32"].make(10, 0.7)
    assert len(a) == len(b) == 1024 and [r.hash_ids for r in a[:5]] != [r.hash_ids for r in b[:5]]
    # the workloads are deterministic: the same call gives the same requests
    assert [r.hash_ids for r in table["ho-tree"].make(10, 0.7)[:50]] == \
        [r.hash_ids for r in table["ho-tree"].make(10, 0.7)[:50]]


def test_agent_sessions_extend_their_own_context_step_by_step():
    table = {w.name: w for w, _ in route_sweep.workloads()}
    reqs = table["agents"].make(10, 0.7)
    assert len(reqs) == 3000 and reqs == table["agents"].make(10, 0.7)
    assert [r.timestamp_ms for r in reqs] == sorted(r.timestamp_ms for r in reqs)
    # a step's blocks start with an earlier request's whole chain (its session's previous step),
    # and sessions of one tool share the tool prompt's leading blocks but not the task
    chains = {r.hash_ids for r in reqs}
    continued = sum(1 for r in reqs if any(r.hash_ids[:k] in chains for k in range(1, len(r.hash_ids))))
    assert continued > len(reqs) // 2
    firsts = {}
    for r in reqs:
        firsts.setdefault(r.hash_ids[0], set()).add(r.hash_ids[:1] + r.hash_ids[1:2])
    assert len(firsts) < len(reqs) // 10  # few tool prompts, many sessions each
    assert table["agents"].make(20, 0.7)[-1].timestamp_ms < 2 * reqs[-1].timestamp_ms  # rate grows with the fleet


@pytest.mark.parametrize("argv,named", [
    (["--workers", "0"], "--workers"),
    (["--workers", "10,,x"], "--workers"),
    (["--load", "-0.5"], "--load"),
    (["--pressure", "0"], "--pressure"),
    (["--mooncake-requests", "0"], "--mooncake-requests"),
    (["--kv-aware", '{"bogus": 1}'], "bogus"),
    (["--kv-aware", "[1]"], "--kv-aware"),
    (["--kv-aware", '{"share_cap": NaN}'], "--kv-aware: share_cap must be a finite number"),
    (["--kv-aware", '{"share_cap": Infinity}'], "--kv-aware: share_cap must be a finite number"),
    (["--kv-aware", '{"share_cap": "0.1"}'], "--kv-aware: share_cap must be a number"),
    (["--kv-aware", '{"widely_held": null}'], "--kv-aware: widely_held must be a number"),
    (["--kv-aware", '{"share_cap": true}'], "--kv-aware: share_cap must be a number"),
    (["--kv-aware", '{"share_cap": [1]}'], "--kv-aware: share_cap must be a number"),
    (["--kv-aware", '{"bogus": 1}'], "--kv-aware: unknown argument(s) bogus"),
    (["--kv-aware", "{share_cap: 1}"], "--kv-aware is not valid JSON"),
    (["--policies", "kv_aware,nope"], "nope"),
    (["--peer-fetch-gbps", "0"], "--peer-fetch-gbps"),
    (["--kv-bytes-per-token", "-1"], "--kv-bytes-per-token"),
    (["--kv-bytes-per-token", "5"], "it needs --peer-fetch-gbps"),  # was ignored without it
])
def test_bad_sweep_arguments_are_usage_errors_before_any_replay(argv, named, capsys, monkeypatch):
    monkeypatch.setattr(route_sweep, "run_sweep", lambda *a, **k: pytest.fail("replayed despite a bad argument"))
    with pytest.raises(SystemExit) as exc:
        route_sweep.main(["--workloads", "bursty", "--quiet", *argv])
    assert exc.value.code == 2 and named in capsys.readouterr().err


def test_kv_aware_arguments_that_mean_off_may_be_null(monkeypatch):
    """``escape_prompts`` and ``share_tokens_cap`` are off as null, so a sweep can compare
    kv_aware with and without them."""
    seen = {}
    monkeypatch.setattr(route_sweep, "run_sweep", lambda names, fleets, load, pressure, policies, mooncake, kw,
                        **_: seen.update(kw) or [])
    monkeypatch.setattr(route_sweep, "sweep_markdown", lambda rows: "")
    route_sweep.main(["--workloads", "bursty", "--quiet", "--kv-aware", '{"escape_prompts": null, "share_cap": 0.1}'])
    assert seen == {"escape_prompts": None, "share_cap": 0.1}


def test_an_unwritable_json_path_is_refused_before_the_sweep(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(route_sweep, "run_sweep", lambda *a, **k: pytest.fail("replayed despite a bad --json"))
    with pytest.raises(SystemExit) as exc:
        route_sweep.main(["--workloads", "bursty", "--quiet", "--json", str(tmp_path / "missing" / "x.json")])
    assert exc.value.code == 2 and "--json" in capsys.readouterr().err


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self"), reason="needs Linux /proc")
def test_a_json_path_in_a_folder_that_takes_no_files_is_refused_before_the_sweep(tmp_path, capsys, monkeypatch):
    # /proc passes os.access(W_OK) for root but takes no new files: only a real try tells.
    monkeypatch.setattr(route_sweep, "run_sweep", lambda *a, **k: pytest.fail("replayed despite a bad --json"))
    (tmp_path / "a-file").write_text("x")
    for path in ("/proc/kvmesh-sweep.json", str(tmp_path / "a-file" / "x.json"), str(tmp_path)):
        with pytest.raises(SystemExit) as exc:
            route_sweep.main(["--workloads", "bursty", "--quiet", "--json", path])
        assert exc.value.code == 2 and f"--json {path}" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["a-file"]


def test_a_writable_json_path_is_checked_without_leaving_a_file(tmp_path, capsys, monkeypatch):
    def sweep(*a, **k):
        assert list(tmp_path.iterdir()) == []  # the check's temporary file is gone, and x.json not made yet
        return []
    monkeypatch.setattr(route_sweep, "run_sweep", sweep)
    assert route_sweep.main(["--workloads", "bursty", "--quiet", "--json", str(tmp_path / "x.json")]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"]
