"""`kvmesh bench` flags: how they map to workloads and arrivals, and clear errors for bad ones."""
from __future__ import annotations

import argparse
import math

import pytest

from kvmesh.bench.harness import add_arguments, arrival_from_args, comparison_markdown, main, workload_from_args


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(["--out", "x", *argv])


def test_defaults_are_the_trace_replay_of_the_earlier_version():
    args = _parse("--target", "h:1")
    w = workload_from_args(args)
    a = arrival_from_args(args)
    assert w.name == "mooncake" and len(w) == 400 and w.params["tokens_per_block"] == 16
    assert a.kind == "closed" and a.concurrency == 4
    args = _parse("--target", "h:1", "--max-requests", "7", "--max-output-tokens", "2", "--concurrency", "3")
    w = workload_from_args(args)
    assert len(w) == 7 and all(it.max_tokens <= 2 for it in w.items) and arrival_from_args(args).cap == 3


def test_generated_workload_flags():
    w = workload_from_args(_parse("--target", "h:1", "--workload", "shared-prefix", "--gsp-num-groups", "3",
                                  "--gsp-prompts-per-group", "2", "--gsp-system-prompt-len", "20",
                                  "--gsp-question-len", "4", "--gsp-output-len", "5", "--gsp-ordered"))
    assert len(w) == 6 and [it.group for it in w.items] == [0, 0, 1, 1, 2, 2]
    assert all(len(it.tokens) == 24 and it.max_tokens == 5 for it in w.items)
    w = workload_from_args(_parse("--target", "h:1", "--workload", "multi-turn", "--mt-conversations", "2",
                                  "--mt-turns", "3", "--max-requests", "5", "--max-output-tokens", "1"))
    assert len(w) == 5 and w.items[4].parent == 2 and all(it.max_tokens == 1 for it in w.items)


def test_arrival_inference():
    assert arrival_from_args(_parse("--target", "h:1", "--rate", "2.5")).rate == 2.5
    assert arrival_from_args(_parse("--target", "h:1", "--rate", "inf")).rate == math.inf
    a = arrival_from_args(_parse("--target", "h:1", "--time-scale", "0.1", "--max-concurrency", "8"))
    assert a.kind == "trace" and a.time_scale == 0.1 and a.cap == 8
    assert arrival_from_args(_parse("--target", "h:1", "--arrival", "trace")).time_scale == 1.0


@pytest.mark.parametrize("argv, message", [
    ([], "exactly one of --target"),
    (["--target", "h:1", "--policies", "kv_aware"], "exactly one of --target"),
    (["--target", "h:1", "--workers", "3"], "--workers only applies with --policies"),
    (["--policies", "kv_aware", "--policy-label", "x"], "only apply with --target"),
    (["--policies", "nope"], "unknown routing policy 'nope'"),
    (["--policies", "kv_aware,kv_aware"], "repeat a name"),
    (["--target", "h:1", "--gsp-num-groups", "2"], "--gsp-num-groups only applies to --workload shared-prefix"),
    (["--target", "h:1", "--workload", "shared-prefix", "--mt-turns", "2"], "only applies to --workload multi-turn"),
    (["--target", "h:1", "--workload", "multi-turn", "--trace", "t.jsonl"], "--trace only applies"),
    (["--target", "h:1", "--arrival", "poisson"], "needs --rate"),
    (["--target", "h:1", "--rate", "1", "--arrival", "closed"], "--rate only applies"),
    (["--target", "h:1", "--max-concurrency", "2"], "a closed loop uses --concurrency"),
    (["--target", "h:1", "--arrival", "trace", "--workload", "shared-prefix"], "need a timestamp"),
    (["--target", "h:1", "--slo-tpot-ms", "-3"], "SLO tpot_ms"),
    (["--target", "h:1", "--duration-s", "0"], "duration_s must be"),
    (["--target", "h:1", "--max-requests", "3", "--warmup-requests", "3"], "leave nothing to measure"),
    (["--policies", "kv_aware", "--max-requests", "3", "--warmup-requests", "5"], "leave nothing to measure"),
    (["--policies", "kv_aware", "--grace-s", "-1", "--duration-s", "3"], "grace_s must be"),
    (["--target", "h:1", "--max-output-tokens", "0"], "--max-output-tokens must be >= 1"),
    (["--target", "h:1", "--trace", "/nonexistent/t.jsonl"], "No such file"),
])
def test_bad_flags_exit_2_with_a_message(argv, message, tmp_path, capsys):
    assert main([*argv, "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err, err
    assert not (tmp_path / "o").exists()


def test_comparison_markdown_heading_and_plots():
    md = comparison_markdown({"policies": ["a", "b"], "workers": 2, "cluster": {"num_blocks": 64},
                              "workload": "shared-prefix", "workload_params": {"num_groups": 2},
                              "arrival": {"kind": "poisson", "rate": 4.0, "max_concurrency": None},
                              "results": [{"policy": "a"}, {"policy": "b"}], "plots": ["ttft_cdf.png"]})
    assert md.startswith("### kvmesh bench: a, b")
    assert "Poisson arrivals at 4.0 req/s" in md and "num_blocks 64" in md
    assert "| metric | a | b |" in md and "![ttft_cdf](ttft_cdf.png)" in md
