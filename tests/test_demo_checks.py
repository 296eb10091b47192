"""The demo's acceptance checks (`bench.demo.demo_checks`): each failure names the check
and its threshold, and short runs are not failed for what they cannot show."""
from __future__ import annotations

from kvmesh.bench.demo import MAX_SHARE_OVER_MEAN, MIN_FRACTION_OF_POOLED, demo_checks


def result(policy: str, hit: float, share: list[float], errors: int = 0) -> dict:
    return {"policy": policy, "hit_rate_blocks": hit, "num_errors": errors,
            "worker_share": {f"worker-{i}": x for i, x in enumerate(share)}}


def test_a_healthy_run_passes():
    checks, failed = demo_checks([result("round_robin", 0.10, [0.5, 0.5]), result("kv_aware", 0.15, [0.51, 0.49])],
                                 pooled_hit=0.14, num_requests=400, workers=2)
    assert failed == []
    assert checks["kv_aware_hit_rate_above_round_robin"] is True
    assert checks["kv_aware_vs_pooled"] > 1


def test_each_miss_is_named_with_its_threshold():
    _, failed = demo_checks([result("round_robin", 0.10, [0.5, 0.5], errors=2),
                             result("kv_aware", 0.09, [0.8, 0.2])],
                            pooled_hit=0.14, num_requests=400, workers=2)
    text = "; ".join(failed)
    assert "round_robin: 2 requests failed" in text
    assert f"< {MIN_FRACTION_OF_POOLED}" in text and "kv_aware_vs_pooled 0.643" in text
    assert f"> {MAX_SHARE_OVER_MEAN}" in text and "kv_aware_max_share_over_mean 1.600" in text
    assert "not above round_robin's 0.1000" in text
    assert len(failed) == 4


def test_a_short_run_is_judged_on_errors_and_the_pooled_ratio_only():
    """30 requests (the case that once failed): equal hit rates and a share imbalance that
    two requests make are not routing failures there; a low pooled ratio still is."""
    short = [result("round_robin", 0.0223, [0.5, 0.5]), result("kv_aware", 0.0223, [19 / 30, 11 / 30])]
    checks, failed = demo_checks(short, pooled_hit=0.023, num_requests=30, workers=2)
    assert failed == []
    assert checks["kv_aware_max_share_over_mean_checked"] is False
    assert checks["kv_aware_hit_rate_above_round_robin_checked"] is False
    _, failed = demo_checks(short, pooled_hit=0.05, num_requests=30, workers=2)
    assert len(failed) == 1 and "kv_aware_vs_pooled" in failed[0]
    # the same hit rates on a long run are a miss
    _, failed = demo_checks([result("round_robin", 0.02, [0.5, 0.5]), result("kv_aware", 0.02, [0.5, 0.5])],
                            pooled_hit=0.02, num_requests=400, workers=2)
    assert len(failed) == 1 and "not above round_robin" in failed[0]
