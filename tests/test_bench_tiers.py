"""bench.tiers runs end to end on small sizes and reports every field the issue names."""
from __future__ import annotations

import json

import pytest

from kvmesh.bench import tiers


def test_bench_copies_small(tmp_path):
    out = tiers.bench_copies(repeats=1, blocks=32, directory=str(tmp_path))
    for k in ("d2h_gbps", "raw_memcpy_gbps", "offload_gbps", "h2disk_gbps", "raw_disk_gbps", "fp8_encode_gbps",
              "int4_encode_gbps", "d2h_large_block_gbps", "raw_memcpy_large_block_gbps"):
        assert out[k] > 0, k
    assert out["copy_bytes"] == 32 * out["block_bytes"]
    for k in ("d2h_over_memcpy", "offload_over_memcpy", "h2disk_over_raw_disk", "d2h_large_block_over_memcpy"):
        assert 0 < out[k] < 10, k
    assert list(tmp_path.iterdir()) == []  # the disk measurement cleans up after itself


def test_check_targets_reports_met_and_missed():
    res = tiers.check_targets({"d2h_over_memcpy": 0.79, "h2disk_over_raw_disk": 0.7, "ttft_device_over_cold": 0.2,
                               "ttft_host_over_cold": 0.31})
    assert res["d2h_over_memcpy"]["met"] is False and res["h2disk_over_raw_disk"]["met"] is True
    assert res["ttft_device_over_cold"]["met"] is True and res["ttft_host_over_cold"]["met"] is False
    assert res["ttft_disk_over_cold"] == {"value": None, "target": "<= 0.5", "met": False}


@pytest.mark.slow
def test_main_prints_one_json_object_with_ttfts(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(tiers, "BLOCKS", 32)
    monkeypatch.setattr(tiers, "bench_copies", lambda repeats, directory=None, device="cpu": {})
    assert tiers.main(["--json", "--rounds", "1", "--dir", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ttft_cold_ms"] > out["ttft_device_ms"] > 0
    for tier in ("device", "host", "disk", "remote"):
        assert 0 < out[f"ttft_{tier}_over_cold"] < 1
    assert set(out["targets"]) == set(tiers.TARGETS)
    assert out["device"] == "cpu"
    # the disk case under the "cost" policy: it read all of the prefix or none of it
    assert out["ttft_disk_cost_loaded_tokens"] in (0, tiers.CACHED_TOKENS)
    assert out["ttft_disk_cost_ms"] > 0 and out["remote_mac_gbps"] > 0
