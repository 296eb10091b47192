"""bench.peer_engine: argument errors, paired ratios, and a peer that fails to start."""
from __future__ import annotations

import sys

import pytest

from kvmesh.bench import peer_engine


def test_bad_arguments_name_the_flag(capsys):
    for argv, flag in ((["--cold-lengths", "512,9000"], "--cold-lengths"),
                       (["--cold-lengths", "a,b"], "--cold-lengths"),
                       (["--rounds", "0"], "--rounds"),
                       (["--vllm-python", "/nonexistent/python"], "--vllm-python")):
        with pytest.raises(SystemExit) as exc:
            peer_engine.main(argv)
        assert exc.value.code == 2
        assert flag in capsys.readouterr().err


def test_ratio_is_median_of_pairs():
    assert peer_engine._ratio([2.0, 9.0, 3.0], [1.0, 3.0, 1.0]) == 3.0
    assert peer_engine._ratio([1.0], None) is None
    assert peer_engine._ratio([1.0], []) is None


def test_peer_without_vllm_fails_with_its_log(tmp_path):
    """A python without vLLM: the server exits and the error points at its log."""
    with pytest.raises(RuntimeError, match="vLLM server exited") as exc:
        peer_engine.VllmSide(sys.executable, str(tmp_path), threads=1, kv_gib=1, startup_s=60)
    log = str(exc.value).split("log: ")[1]
    assert "vllm" in open(log).read().lower()


def test_model_config_is_the_issue_shape():
    cfg = peer_engine.model_config()
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers,
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.dtype) == (4096, 512, 1376, 8, 8, 2, "bfloat16")


def test_kvmesh_alone_runs_every_scenario():
    """One short round of every scenario, kvmesh alone (no peer): in-flight sharing reports
    7 x 384 cached tokens, the fp32 check agrees with HF, and ratios stay empty."""
    from kvmesh.bench.peer_engine import run

    r = run(rounds=1, cold_lengths=(64,), fp32_prompts=1)
    assert r["shared_prefix_cached_tokens"] == r["shared_prefix_cached_tokens_expected"] == 7 * 384
    assert r["fp32_equal"] == "1/1"
    assert r["vllm"] is None and r["cold_ttft_ratio"] == {"64": None} and r["hit_ttft_ratio"] is None
    ours = r["kvmesh"]
    assert ours["cold_ttft_ms"]["64"] > 0 and ours["hit_ttft_ms"] > 0 and ours["decode_tok_s"] > 0
