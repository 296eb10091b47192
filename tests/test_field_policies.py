"""The field's routing policies (services/field_policies.py): sources' defaults and rules."""
from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from kvmesh.services.field_policies import RoutedPrefixTree
from kvmesh.services.policies import POLICIES, RouteRequest, WorkerView, make_policy

FIELD = ("sglang_cache_aware", "ray_prefix_affinity", "dynamo_kv", "llmd_precise", "power_of_two")
BS = 16


def H(i: int) -> bytes:
    return i.to_bytes(16, "big")


def view(wid: str, **kw) -> WorkerView:
    kw.setdefault("total_blocks", 1000)
    kw.setdefault("free_blocks", 1000)
    if "matched_blocks" in kw:
        kw.setdefault("weighted_blocks", float(kw["matched_blocks"]))
    return WorkerView(wid, f"{wid}:50051", **kw)


def request(hashes, num_tokens=None) -> RouteRequest:
    hashes = [H(h) for h in hashes]
    return RouteRequest(num_tokens if num_tokens is not None else BS * len(hashes), hashes, BS)


def picks(policy, req, workers, n=300, seed=0) -> Counter:
    rng = random.Random(seed)
    return Counter(policy.choose(req, workers, rng).worker_id for _ in range(n))


# ------------------------------------------------------------------- registry
def test_field_policies_are_registered_with_their_sources_defaults():
    assert set(FIELD) <= set(POLICIES)
    s = make_policy("sglang_cache_aware")  # sgl-router RouterArgs
    assert (s.cache_threshold, s.balance_abs_threshold, s.balance_rel_threshold, s.max_tree_size) == \
        (0.3, 64, 1.5, 2 ** 26)
    r = make_policy("ray_prefix_affinity")  # Ray Serve PrefixCacheAffinityRouter
    assert (r.imbalanced_threshold, r.match_rate_threshold) == (math.inf, 0.1)
    d = make_policy("dynamo_kv")  # Dynamo router flags
    assert (d.overlap_score_weight, d.overlap_credit, d.router_temperature) == (1.0, 1.0, 0.0)
    m = make_policy("llmd_precise")  # llm-d precise prefix-cache guide
    assert (m.prefix_weight, m.queue_weight, m.kv_utilization_weight) == (3.0, 2.0, 2.0)


@pytest.mark.parametrize("name", FIELD)
def test_every_field_policy_rejects_no_workers_and_returns_a_view(name):
    with pytest.raises(ValueError):
        make_policy(name).choose(request([1, 2]), [], random.Random(0))
    p = make_policy(name)
    ws = [view("a", matched_blocks=1, running_requests=2), view("b", queued_prefill_tokens=40)]
    rng = random.Random(3)
    for i in range(30):
        pick = p.choose(request([1, 2, 3 + i]), ws, rng)
        assert any(pick is w for w in ws)


@pytest.mark.parametrize("name,kwargs", [
    ("sglang_cache_aware", {"cache_threshold": 1.5}), ("sglang_cache_aware", {"balance_rel_threshold": 0.5}),
    ("ray_prefix_affinity", {"match_rate_threshold": -0.1}), ("dynamo_kv", {"overlap_credit": 2.0}),
    ("dynamo_kv", {"router_temperature": -1}), ("llmd_precise", {"queue_weight": -1}),
])
def test_bad_parameters_are_rejected(name, kwargs):
    with pytest.raises(ValueError):
        make_policy(name, **kwargs)


# -------------------------------------------------------------- router's tree
def test_routed_prefix_tree_matches_leading_runs_per_worker():
    t = RoutedPrefixTree()
    t.insert("a", [H(1), H(2), H(3)])
    t.insert("b", [H(1), H(7)])
    assert t.match([H(1), H(2), H(3), H(4)], ["a", "b", "c"]) == {"a": 3, "b": 1, "c": 0}
    assert t.match([H(9), H(2)], ["a", "b"]) == {"a": 0, "b": 0}
    assert (t.size("a"), t.size("b"), t.size("c")) == (3, 2, 0)
    t.insert("a", [H(1), H(2)])  # already there: no growth
    assert t.size("a") == 3


def test_routed_prefix_tree_trims_least_recent_leaves_first():
    t = RoutedPrefixTree(max_tokens=4 * BS)
    t.insert("a", [H(1), H(2), H(3)], BS)
    t.insert("a", [H(1), H(4), H(5)], BS)  # 5 blocks > 4: the oldest leaf (3) goes, not its parents
    assert t.size("a") == 4
    assert t.match([H(1), H(2), H(3)], ["a"]) == {"a": 2}
    assert t.match([H(1), H(4), H(5)], ["a"]) == {"a": 3}
    with pytest.raises(ValueError):
        RoutedPrefixTree(max_tokens=0)


# -------------------------------------------------------------------- SGLang
def test_sglang_follows_a_match_above_the_cache_threshold_else_the_smallest_tree():
    p = make_policy("sglang_cache_aware")
    ws = [view("a"), view("b"), view("c")]
    rng = random.Random(0)
    first = p.choose(request(range(10)), ws, rng).worker_id
    # 4 of 10 blocks match (0.4 > 0.3): the holder.
    assert {p.choose(request([0, 1, 2, 3, 20 + i, 40 + i, 60 + i, 80 + i, 90 + i, 99]), ws, rng).worker_id
            for i in range(5)} == {first}
    # 3 of 10 (0.3, not above it): the smallest tree, i.e. a worker that got nothing yet.
    pick = p.choose(request([0, 1, 2, 200, 201, 202, 203, 204, 205, 206]), ws, rng).worker_id
    assert pick != first


def test_sglang_imbalance_needs_both_thresholds_then_takes_the_least_loaded():
    p = make_policy("sglang_cache_aware", balance_abs_threshold=32, balance_rel_threshold=1.5)
    rng = random.Random(0)
    ws = [view("hot"), view("cold")]
    p.choose(request(range(8)), ws, rng)
    holder = p.tree.match([H(i) for i in range(8)], ["hot", "cold"])
    name = "hot" if holder["hot"] else "cold"
    other = "cold" if name == "hot" else "hot"
    for a, b in ((100, 67), (30, 10)):  # abs 33 > 32 but 100 <= 1.5 * 67; 30 > 1.5 * 10 but abs 20
        load = {name: a, other: b}        # balanced either way: the holder keeps it
        ws = [view(w, running_requests=load[w]) for w in ("hot", "cold")]
        assert set(picks(p, request(range(8)), ws, n=20)) == {name}
    load = {name: 100, other: 66}  # 100 > 99 but abs 34 > 32: imbalanced, the least loaded
    ws = [view(w, running_requests=load[w]) for w in ("hot", "cold")]
    assert p.choose(request(range(8)), ws, rng).worker_id == other


# ----------------------------------------------------------------------- Ray
def test_ray_sends_matches_to_the_holders_shortest_queue_and_misses_to_the_smallest_tree():
    p = make_policy("ray_prefix_affinity")
    ws = [view("a", running_requests=5), view("b", running_requests=0), view("c", running_requests=9)]
    rng = random.Random(0)
    # Empty trees: all are "smallest", the shortest queue wins.
    assert p.choose(request(range(10)), ws, rng).worker_id == "b"
    # A 20 % match: the holder, even with a longer queue than another worker.
    ws[1].running_requests = 7
    assert p.choose(request([0, 1, 50, 51, 52, 53, 54, 55, 56, 57]), ws, rng).worker_id == "b"
    # A 5 % match (1 of 20 blocks): the smallest trees (a and c, empty), shortest queue among them.
    assert p.choose(request([0] + list(range(100, 119))), ws, rng).worker_id == "a"


def test_ray_imbalance_falls_back_to_two_random_choices():
    p = make_policy("ray_prefix_affinity", imbalanced_threshold=10)
    ws = [view("x", running_requests=0), view("y", running_requests=20), view("z", running_requests=20)]
    c = picks(p, request(range(4)), ws, n=600)
    # x wins whenever it is one of the two drawn (2/3 of draws); y and z share the rest.
    assert 330 < c["x"] < 470 and c["y"] > 50 and c["z"] > 50


# -------------------------------------------------------------------- Dynamo
def test_dynamo_reproduces_its_documented_example():
    # Dynamo's KV routing doc: prefill 8/5/2 blocks, decode 10/5/9 blocks -> costs 18/10/11, worker 2.
    p = make_policy("dynamo_kv")
    req = request(range(10))  # 10 blocks of 16 tokens
    ws = [view("w1", matched_blocks=2, total_blocks=100, free_blocks=90),
          view("w2", matched_blocks=5, total_blocks=100, free_blocks=95),
          view("w3", matched_blocks=8, total_blocks=100, free_blocks=91)]
    own = 10  # the request's own blocks join every worker's decode load alike
    assert [c - own for c in p.costs(req, ws)] == pytest.approx([18, 10, 11])
    assert set(picks(p, req, ws, n=50)) == {"w2"}


def test_dynamo_charges_queued_prefill_and_weights_it():
    req = request(range(4))
    ws = [view("a", matched_blocks=4, queued_prefill_tokens=160), view("b")]
    p = make_policy("dynamo_kv")
    # a: (160 + 64 - 64) / 16 = 10 prefill blocks; b: 4. b wins.
    assert p.choose(req, ws, random.Random(0)).worker_id == "b"
    p = make_policy("dynamo_kv", overlap_score_weight=0.0)  # decode load only: a tie
    assert set(picks(p, req, ws, n=100)) == {"a", "b"}


def test_dynamo_temperature_samples_by_softmax_of_normalized_costs():
    req = request(range(10))
    ws = [view("cheap", matched_blocks=9), view("dear")]
    assert set(picks(make_policy("dynamo_kv"), req, ws, n=100)) == {"cheap"}
    c = picks(make_policy("dynamo_kv", router_temperature=1.0), req, ws, n=4000)
    # normalized costs 0 and 1: P(dear) = e^-1 / (1 + e^-1) = 0.269
    assert c["dear"] / 4000 == pytest.approx(math.exp(-1) / (1 + math.exp(-1)), abs=0.03)


# --------------------------------------------------------------------- llm-d
def test_llmd_scores_follow_its_scorers_and_weights():
    p = make_policy("llmd_precise")
    req = request(range(10))
    ws = [view("a", matched_blocks=6, waiting_requests=4, total_blocks=100, free_blocks=50),
          view("b", matched_blocks=2, waiting_requests=0, total_blocks=100, free_blocks=100),
          view("c", matched_blocks=0, waiting_requests=2, total_blocks=100, free_blocks=75)]
    # prefix: min-max over the pods with a hit (a 1.0, b 0.0), c without a hit 0.0
    # queue: (4 - q) / 4 -> 0, 1, 0.5; KV utilization: 1 - used -> 0.5, 1.0, 0.75
    assert p.scores(req, ws) == pytest.approx([3 * 1 + 2 * 0 + 2 * 0.5, 0 + 2 * 1 + 2 * 1.0, 0 + 2 * 0.5 + 2 * 0.75])
    assert p.choose(req, ws, random.Random(0)).worker_id == "b"


def test_llmd_equal_hits_all_score_one_and_a_lone_holder_takes_all_prefix_credit():
    p = make_policy("llmd_precise")
    req = request(range(10))
    ws = [view("a", matched_blocks=1), view("b", matched_blocks=1)]
    assert p.scores(req, ws) == pytest.approx([3 + 2 + 2, 3 + 2 + 2])
    ws = [view("a", matched_blocks=1, waiting_requests=3), view("b", waiting_requests=0)]
    # the sole holder keeps a 3-point prefix lead over a worse queue score (2 points)
    assert p.choose(req, ws, random.Random(0)).worker_id == "a"


# -------------------------------------------------------------- power of two
def test_power_of_two_never_picks_the_most_loaded_of_three():
    p = make_policy("power_of_two")
    ws = [view("idle", running_requests=0), view("mid", running_requests=5), view("busy", running_requests=9)]
    c = picks(p, request([1]), ws, n=900)
    assert "busy" not in c
    assert 520 < c["idle"] < 680  # chosen whenever drawn: 2/3 of pairs
    assert p.choose(request([1]), [ws[2]], random.Random(0)) is ws[2]
