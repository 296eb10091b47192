"""``kvmesh sim --backend vllm``: simulated vLLM servers named by vLLM's published keys."""
from __future__ import annotations

from pathlib import Path

from kvmesh.bench.sim import prepare, run_policies
from kvmesh.bench.trace import load_mooncake, synthesize_tokens
from kvmesh.bench.vllm_sim import prepare_vllm
from kvmesh.services.vllm_compat import VllmHashConfig, VllmHasher

SAMPLE = Path(__file__).resolve().parents[1] / "bench" / "data" / "mooncake_conversation_sample.jsonl"


def test_vllm_workload_uses_vllm_keys_and_keeps_cache_behaviour():
    reqs = load_mooncake(SAMPLE)
    cfg = VllmHashConfig(block_size=16, hash_seed="0")
    wl = prepare_vllm(reqs, cfg, block_tokens=16, max_output_tokens=4)
    hasher = VllmHasher(cfg)
    for r, spec in zip(reqs[:5], wl.specs[:5]):
        assert spec.route_hashes == hasher.keys(synthesize_tokens(r, 16)) != []
        assert spec.chain.hashes == spec.route_hashes
    kw = dict(num_workers=3, num_blocks=2000, concurrency=4, seed=1)
    ours = run_policies(prepare(reqs, 16, 16, 4), ["kv_aware", "round_robin"], **kw)
    vllm = run_policies(wl, ["kv_aware", "round_robin"], **kw)
    # block naming does not change what is cached or how routing sees it
    for p in ours:
        assert vllm[p]["hit_rate_tokens"] == ours[p]["hit_rate_tokens"]
    assert vllm["kv_aware"]["hit_rate_tokens"] > vllm["round_robin"]["hit_rate_tokens"]


def test_cli_backend_vllm(capsys):
    from kvmesh.services.cli import main

    base = ["sim", "--trace", str(SAMPLE), "--max-requests", "60", "--workers", "2", "--num-blocks", "300",
            "--block-tokens", "16", "--policies", "kv_aware", "--backend", "vllm", "--json"]
    assert main(base) == 2
    assert "--block-size" in capsys.readouterr().err
    assert main([*base, "--block-size", "16", "--vllm-hash-algo", "xxhash"]) == 2
    assert "PYTHONHASHSEED" in capsys.readouterr().err
    assert main([*base, "--block-size", "16"]) == 0
    assert "kv_aware" in capsys.readouterr().out
