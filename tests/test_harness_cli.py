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
    # --concurrency is the closed loop's: with --rate it was dropped without a word
    with pytest.raises(ValueError, match="--concurrency applies to the closed loop.*--max-concurrency"):
        arrival_from_args(_parse("--target", "h:1", "--rate", "2", "--concurrency", "8"))


@pytest.mark.parametrize("argv, message", [
    ([], "exactly one of --target"),
    (["--target", "h:1", "--policies", "kv_aware"], "exactly one of --target"),
    (["--target", "h:1", "--workers", "3"], "--workers only applies with --policies"),
    (["--policies", "kv_aware", "--policy-label", "x"], "only apply with --target"),
    (["--policies", "nope"], "unknown routing policy 'nope'"),
    (["--policies", "kv_aware,kv_aware"], "repeat a name"),
    (["--target", "h:1", "--gsp-num-groups", "2"], "--gsp-num-groups only applies to --workload shared-prefix"),
    (["--target", "h:1", "--workload", "shared-prefix", "--mt-turns", "2"], "only applies to --workload multi-turn"),
    (["--target", "h:1", "--workload", "multi-turn", "--trace", __file__], "--trace only applies"),
    (["--target", "h:1", "--arrival", "poisson"], "needs --rate"),
    (["--target", "h:1", "--rate", "1", "--arrival", "closed"], "--rate only applies"),
    (["--target", "h:1", "--max-concurrency", "2"], "a closed loop uses --concurrency"),
    (["--target", "h:1", "--arrival", "trace", "--workload", "shared-prefix"], "need a timestamp"),
    (["--target", "h:1", "--max-requests", "3", "--warmup-requests", "3"], "leave nothing to measure"),
    (["--policies", "kv_aware", "--max-requests", "3", "--warmup-requests", "5"], "leave nothing to measure"),
    (["--target", "h:1", "--grace-s", "5"], "--grace-s only applies with --duration-s"),
    (["--target", "nonsense"], "--target 'nonsense' is not HOST:PORT"),
    (["--target", "h:0"], "is not HOST:PORT"),
    (["--target", "http://127.0.0.1:1/v1"], "pass --api openai"),
    (["--target", "ftp://h:1", "--api", "openai"], "is not an http:// or https:// URL"),
    (["--target", "nonsense", "--api", "openai"], "is neither HOST:PORT"),
])
def test_bad_flags_exit_2_with_a_message(argv, message, tmp_path, capsys):
    assert main([*argv, "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err, err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("argv, message", [
    (["--concurrency", "0"], "--concurrency must be"),
    (["--rate", "0"], "--rate must be a number > 0"),
    (["--rate", "nan"], "--rate must be a number > 0"),
    (["--gsp-num-groups", "0"], "--gsp-num-groups must be"),
    (["--gsp-system-prompt-len", "-1"], "--gsp-system-prompt-len must be an integer >= 0"),
    (["--mt-turns", "0"], "--mt-turns must be"),
    (["--vocab-size", "1"], "--vocab-size must be an integer >= 2"),
    (["--duration-s", "0"], "--duration-s must be"),
    (["--duration-s", "3", "--grace-s", "-1"], "--grace-s must be a number >= 0"),
    (["--tokens-per-block", "0"], "--tokens-per-block must be"),
    (["--slo-ttft-ms", "-5"], "--slo-ttft-ms must be"),
    (["--slo-tpot-ms", "nan"], "--slo-tpot-ms must be"),
    (["--timeout", "0"], "--timeout must be"),
    (["--max-output-tokens", "0"], "--max-output-tokens must be"),
    (["--max-requests", "-1"], "--max-requests must be an integer >= 1"),
    (["--max-requests", "0"], "--max-requests must be an integer >= 1"),  # a run of nothing is no benchmark
    (["--max-error-rate", "1.5"], "--max-error-rate must be a number >= 0 and <= 1"),
    (["--trace", "/nonexistent/t.jsonl"], "--trace /nonexistent/t.jsonl: no such file"),
    (["--metrics-url", "notaurl"], "--metrics-url 'notaurl' is not an http:// or https:// URL"),
    (["--metrics-url", "http://h:99999/metrics"], "--metrics-url 'http://h:99999/metrics' is not a valid URL"),
])
def test_bad_values_are_argparse_errors_that_name_the_flag(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--target", "h:1", *argv, "--out", str(tmp_path / "o"), "--no-progress"])
    err = capsys.readouterr().err
    flag = argv[-2] if argv[-2].startswith("--") else argv[0]
    assert exc.value.code == 2 and f"argument {flag}: {message}" in err, err
    assert not (tmp_path / "o").exists()


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self"), reason="needs Linux /proc")
def test_an_out_that_is_a_file_or_cannot_be_written_is_refused(tmp_path, capsys):
    (tmp_path / "a-file").write_text("x")
    for out, message in ((tmp_path / "a-file", "a file of that name exists"),
                         (tmp_path / "a-file" / "sub", "is not a folder"),
                         ("/proc/kvmesh-bench-out", "cannot write in /proc")):
        with pytest.raises(SystemExit) as exc:
            main(["--target", "h:1", "--out", str(out), "--no-progress"])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and f"argument --out: --out {out}: " in err and message in err, err
    assert [p.name for p in tmp_path.iterdir()] == ["a-file"]


def test_a_truncated_or_empty_trace_names_the_flag(tmp_path, capsys):
    from kvmesh.bench.trace import DEFAULT_SAMPLE

    cut = tmp_path / "t.jsonl.gz"
    cut.write_bytes((DEFAULT_SAMPLE.parent / "mooncake_conversation_trace.jsonl.gz").read_bytes()[:1000])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    for trace, message in ((cut, "truncated"), (empty, "holds no requests")):
        assert main(["--target", "h:1", "--trace", str(trace), "--out", str(tmp_path / "o"), "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: --trace {trace}") and message in err, err


def test_grace_s_applies_with_duration_s():
    args = _parse("--target", "h:1", "--duration-s", "2", "--grace-s", "5")
    assert args.grace_s == 5.0 and _parse("--target", "h:1").grace_s is None


def test_comparison_markdown_heading_and_plots():
    md = comparison_markdown({"policies": ["a", "b"], "workers": 2, "cluster": {"num_blocks": 64},
                              "workload": "shared-prefix", "workload_params": {"num_groups": 2},
                              "arrival": {"kind": "poisson", "rate": 4.0, "max_concurrency": None},
                              "results": [{"policy": "a"}, {"policy": "b"}], "plots": ["ttft_cdf.png"]})
    assert md.startswith("### kvmesh bench: a, b")
    assert "Poisson arrivals at 4.0 req/s" in md and "num_blocks 64" in md
    assert "| metric | a | b |" in md and "![ttft_cdf](ttft_cdf.png)" in md


def test_an_unreachable_metrics_url_is_named():
    """A refused --metrics-url printed only "<urlopen error [Errno 111] Connection refused>"."""
    from kvmesh.bench.server_metrics import scrape_all
    from kvmesh.services.procs import free_port

    url = f"http://127.0.0.1:{free_port()}/metrics"
    with pytest.raises(OSError) as err:
        scrape_all([url])
    assert f"--metrics-url {url}: could not read it" in str(err.value) and "--metrics-port" in str(err.value)


def test_a_metrics_port_that_wants_a_token_is_named_and_the_token_needs_urls(tmp_path, capsys):
    """A 401 from a --metrics-url said "Unauthorized; give the /metrics URL of a running
    router or worker": it now names --metrics-token-file; and a token file without any
    --metrics-url is a usage error, not ignored."""
    from prometheus_client import CollectorRegistry

    from kvmesh.bench.server_metrics import scrape_all
    from kvmesh.services.metrics import serve_metrics

    port, server = serve_metrics(CollectorRegistry(), 0, token="right")
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        for token in (None, "wrong"):
            with pytest.raises(OSError) as err:
                scrape_all([url], token)
            assert "401" in str(err.value) and "--metrics-token-file" in str(err.value)
        assert scrape_all([url], "right") == [{}]
    finally:
        server.shutdown()
    (tmp_path / "tok").write_text("right\n")
    assert main(["--target", "h:1", "--metrics-token-file", str(tmp_path / "tok"), "--out", str(tmp_path / "o"),
                 "--no-progress"]) == 2
    assert "--metrics-token-file" in capsys.readouterr().err


def test_server_counters_that_went_down_are_counted_from_the_restart():
    """A worker restarted during a run (its counters start again from 0) made the server
    hit rate the ratio of two negative numbers (-47440 / -95807 = 49.5 %); such an endpoint
    now counts what it did since the restart, as Prometheus's increase() does, and the
    result says how many restarted."""
    from kvmesh.bench.server_metrics import run_delta

    def sample(queries, hits):
        return {("kvmesh:prefix_cache_queries_total", ()): float(queries),
                ("kvmesh:prefix_cache_hits_total", (("tier", "device"),)): float(hits)}

    steady = run_delta([sample(100, 40), sample(1000, 500)], [sample(300, 140), sample(1400, 700)])
    assert (steady["prefix_cache_queries_tokens"], steady["prefix_cache_hits_tokens"]) == (600, 300)
    assert steady["restarted_endpoints"] == 0
    restarted = run_delta([sample(100, 40), sample(1000, 500)], [sample(300, 140), sample(50, 10)])
    assert (restarted["prefix_cache_queries_tokens"], restarted["prefix_cache_hits_tokens"]) == (250, 110)
    assert restarted["restarted_endpoints"] == 1 and restarted["hit_rate_tokens"] == round(110 / 250, 6)


def test_a_run_into_a_used_folder_leaves_no_plot_of_the_earlier_run(tmp_path):
    """A second run into the same --out (say with --no-plots) must not leave the first run's
    PNGs beside its own numbers."""
    from kvmesh.bench.harness import _write_outputs
    from kvmesh.bench.plots import PLOT_FILES
    from kvmesh.bench.report import summarize

    for name in PLOT_FILES:
        (tmp_path / name).write_bytes(b"old run")
    _write_outputs(tmp_path, {"policy": "kv_aware", **summarize([])}, [])
    assert (tmp_path / "result.json").exists()
    assert not any((tmp_path / name).exists() for name in PLOT_FILES)
