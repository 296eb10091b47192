"""Routing policies: registry, each policy's contract, and kv_aware's behaviour."""
from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from kvmesh.services.policies import (
    RoutedShare,
    DEFAULT_POLICY,
    POLICIES,
    KVAwarePolicy,
    RouteRequest,
    RoutingPolicy,
    WorkerView,
    make_policy,
    register,
)

BS = 16


def H(i: int) -> bytes:
    return i.to_bytes(16, "big")


def view(wid: str, **kw) -> WorkerView:
    kw.setdefault("total_blocks", 1000)
    kw.setdefault("free_blocks", 500)
    if "matched_blocks" in kw:
        kw.setdefault("weighted_blocks", float(kw["matched_blocks"]))
    return WorkerView(wid, f"{wid}:50051", **kw)


def request(num_blocks: int) -> RouteRequest:
    return RouteRequest(num_blocks * BS, [H(i) for i in range(num_blocks)], BS)


def picks(policy, req, workers, n=400, seed=0) -> Counter:
    rng = random.Random(seed)
    return Counter(policy.choose(req, workers, rng).worker_id for _ in range(n))


# ------------------------------------------------------------------- registry
def test_registry_has_the_builtin_policies():
    assert {"round_robin", "random", "least_loaded", "prefix", "kv_aware"} <= set(POLICIES)
    assert DEFAULT_POLICY == "kv_aware"
    for name, cls in POLICIES.items():
        p = make_policy(name)
        assert isinstance(p, cls) and p.name == name
    assert isinstance(make_policy(), KVAwarePolicy)


def test_make_policy_unknown_name_lists_known_ones():
    with pytest.raises(ValueError) as err:
        make_policy("fastest")
    for name in ("round_robin", "random", "least_loaded", "prefix", "kv_aware"):
        assert name in str(err.value)


def test_make_policy_passes_kwargs_and_validates():
    p = make_policy("kv_aware", decode_weight=3.0, share_cap=0.5)
    assert (p.decode_weight, p.share_cap) == (3.0, 0.5)
    with pytest.raises(ValueError):
        make_policy("kv_aware", share_cap=-1)
    with pytest.raises(ValueError):
        make_policy("kv_aware", recompute_weight=-0.1)


def test_register_rejects_a_taken_name_and_accepts_a_new_one():
    class Impostor(RoutingPolicy):
        name = "random"

        def choose(self, req, workers, rng):
            return workers[0]

    with pytest.raises(ValueError):
        register(Impostor)
    assert POLICIES["random"] is not Impostor

    class First(RoutingPolicy):
        name = "test_first_worker"

        def choose(self, req, workers, rng):
            return workers[0]

    try:
        assert register(First) is First
        w = [view("x"), view("y")]
        assert make_policy("test_first_worker").choose(request(1), w, random.Random(0)) is w[0]
    finally:
        POLICIES.pop("test_first_worker", None)


@pytest.mark.parametrize("name", ["round_robin", "random", "least_loaded", "prefix", "kv_aware"])
def test_every_policy_rejects_an_empty_worker_list(name):
    with pytest.raises(ValueError):
        make_policy(name).choose(request(4), [], random.Random(0))


@pytest.mark.parametrize("name", ["round_robin", "random", "least_loaded", "prefix", "kv_aware"])
def test_every_policy_returns_one_of_the_views(name):
    workers = [view("a", matched_blocks=2), view("b", queued_prefill_tokens=10)]
    rng = random.Random(1)
    p = make_policy(name)
    for _ in range(20):
        pick = p.choose(request(4), workers, rng)
        assert any(pick is w for w in workers)


# ------------------------------------------------------------ simple policies
def test_round_robin_cycles_in_id_order_across_membership_changes():
    p = make_policy("round_robin")
    rng = random.Random(0)
    ws = [view("c"), view("a"), view("b")]
    assert [p.choose(request(1), ws, rng).worker_id for _ in range(4)] == ["a", "b", "c", "a"]
    # b leaves, d joins: the rotation continues after the last id chosen ("a").
    ws = [view("d"), view("a"), view("c")]
    assert [p.choose(request(1), ws, rng).worker_id for _ in range(4)] == ["c", "d", "a", "c"]


def test_random_is_reproducible_and_covers_all_workers():
    ws = [view(f"w{i}") for i in range(4)]
    p = make_policy("random")
    a, b = picks(p, request(2), ws, seed=7), picks(p, request(2), ws, seed=7)
    assert a == b
    assert set(a) == {"w0", "w1", "w2", "w3"} and min(a.values()) > 60


def test_least_loaded_orders_by_queued_tokens_then_running():
    p = make_policy("least_loaded")
    ws = [view("a", queued_prefill_tokens=500, running_requests=0),
          view("b", queued_prefill_tokens=100, running_requests=9),
          view("c", queued_prefill_tokens=100, running_requests=3, matched_blocks=50)]
    assert set(picks(p, request(60), ws)) == {"c"}
    ws[2].running_requests = 9
    assert set(picks(p, request(60), ws)) == {"b", "c"}


def test_prefix_takes_the_longest_match_ignoring_load():
    p = make_policy("prefix")
    ws = [view("a", matched_blocks=3, queued_prefill_tokens=10**6),
          view("b", matched_blocks=1), view("c", matched_blocks=3)]
    assert set(picks(p, request(8), ws)) == {"a", "c"}
    ws[0].matched_blocks = 4
    assert set(picks(p, request(8), ws)) == {"a"}


# ------------------------------------------------------------------- kv_aware
def test_kv_aware_a_long_prefix_goes_to_its_holder_when_loads_are_comparable():
    p = make_policy("kv_aware")
    req = request(100)
    ws = [view("holder", matched_blocks=80, queued_prefill_tokens=300, running_requests=5, routed_recent=3.0),
          view("b", matched_blocks=0, queued_prefill_tokens=200, running_requests=4, routed_recent=2.5),
          view("c", matched_blocks=1, queued_prefill_tokens=250, running_requests=6, routed_recent=2.8)]
    assert set(picks(p, req, ws)) == {"holder"}


def test_kv_aware_a_host_tier_hit_is_worth_less_than_a_device_hit():
    p = make_policy("kv_aware")
    req = request(40)
    ws = [view("host", matched_blocks=30, weighted_blocks=30 * 0.8),
          view("device", matched_blocks=27, weighted_blocks=27.0)]
    assert set(picks(p, req, ws)) == {"device"}
    ws[1].matched_blocks, ws[1].weighted_blocks = 23, 23.0
    assert set(picks(p, req, ws)) == {"host"}


def test_kv_aware_b_sustained_burst_spills_once_the_queue_costs_more_than_recompute():
    p = make_policy("kv_aware", recompute_weight=1.0)
    req = request(64)  # 1024 tokens; 60 blocks (960 tokens) cached on the holder
    holder = view("holder", matched_blocks=60)
    others = [view("b"), view("c")]
    rng = random.Random(3)
    seq = []
    # A burst of identical requests, none finishing; routing history kept even (as with
    # many routers), so only the queues speak. Each request queues its uncached prefill
    # (64 tokens on the holder, 1024 elsewhere) where it lands.
    for _ in range(100):
        w = p.choose(req, [holder, *others], rng)
        seq.append(w.worker_id)
        w.queued_prefill_tokens += req.num_tokens - BS * w.matched_blocks
        if w is not holder:  # it computed the prefix, so it caches it from now on
            w.matched_blocks, w.weighted_blocks = 60, 60.0
    # Each computed token costs 1 + recompute_weight = 2: the holder keeps the burst while
    # its queue (64 tokens per request) plus 2 x 64 stays under 2 x 1024 elsewhere, i.e.
    # while the queue is under twice the 960 tokens the hit saves: 30 requests; by the
    # 32nd it spills.
    assert seq[:30] == ["holder"] * 30
    assert {"b", "c"} & set(seq[30:32])
    assert {"b", "c"} <= set(seq)


def test_kv_aware_blocks_every_worker_holds_give_no_preference():
    p = make_policy("kv_aware")
    req = request(12)
    # All hold the same 10-block system prompt: a fair coin.
    ws = [view("a", matched_blocks=10), view("b", matched_blocks=10)]
    c = picks(p, req, ws)
    assert set(c) == {"a", "b"} and min(c.values()) > 150
    # A block beyond the shared ones does count...
    ws[1].matched_blocks, ws[1].weighted_blocks = 11, 11.0
    assert set(picks(p, req, ws)) == {"b"}
    # ...and so does holding the shared ones on a slower tier.
    ws[1].matched_blocks, ws[1].weighted_blocks = 10, 8.0
    assert set(picks(p, req, ws)) == {"a"}


def test_kv_aware_share_cap_overrides_a_full_hit_well_above_mean():
    p = make_policy("kv_aware")
    req = request(20)
    # mean 10, limit 1.05 * 10 + 4 = 14.5: "hot" at 16, busy, takes nothing despite a full hit.
    ws = [view("hot", matched_blocks=20, routed_recent=16.0, running_requests=1), view("b", routed_recent=10.0),
          view("c", routed_recent=9.0), view("d", routed_recent=5.0)]
    assert "hot" not in picks(p, req, ws)
    # An idle worker over the cap keeps a request when it holds at least half of its prompt
    # (idle_exempt_hit): no queue to protect, and the hit saves the recompute.
    ws[0].running_requests = 0
    assert set(picks(p, req, ws)) == {"hot"}
    ws[0].matched_blocks = ws[0].weighted_blocks = 9  # under half: capped
    assert "hot" not in picks(p, req, ws)
    ws[0].matched_blocks = ws[0].weighted_blocks = 20
    ws[0].queued_prefill_tokens = 1                    # not idle: capped
    assert "hot" not in picks(p, req, ws)
    ws[0].running_requests = 1
    ws[0].queued_prefill_tokens = 0
    # Within the cap a large hit is kept.
    ws[0].routed_recent, ws[3].routed_recent = 14.0, 7.0  # mean 10, limit 14.5
    assert set(picks(p, req, ws)) == {"hot"}
    # When every worker is over (impossible with a true mean, but views may be stale), none is excluded.
    assert p.costs(req, [view("x", routed_recent=10.0)]) == [pytest.approx(13 * 20 * BS)]


def test_kv_aware_a_worker_over_the_cap_takes_a_request_the_cap_would_queue_far_behind():
    """Over the cap (5 % + 4 requests) but within the hard cap (8 %, no slack), a worker
    still takes a request that costs more than 16 mean prompts less there than on every
    worker within the cap (escape_prompts): the cap must not queue a request behind that
    much more prefill."""
    p = make_policy("kv_aware")
    req = request(20)  # 320 tokens, the mean prompt: the margin is 16 x 320 = 5,120 tokens
    # mean share 200: cap 1.05 x 200 + 4 = 214, hard cap 1.08 x 200 = 216
    ws = [view("over", routed_recent=215.0, running_requests=1), view("b", routed_recent=200.0),
          view("c", routed_recent=200.0), view("d", routed_recent=185.0)]
    for w in ws[1:]:
        w.queued_prefill_tokens = 20000
    assert set(picks(p, req, ws)) == {"over"}
    # the others' cheapest (d: 5,000 queued + 13 x 320 - 72 share = 9,088) is within the margin
    # of over's 4,232 (320 + 12 x 320 + 72): the cap holds
    for w in ws[1:]:
        w.queued_prefill_tokens = 5000
    assert "over" not in picks(p, req, ws)
    for w in ws[1:]:
        w.queued_prefill_tokens = 20000
    ws[0].routed_recent, ws[3].routed_recent = 217.0, 183.0  # past the hard cap: no cost lets it in
    assert "over" not in picks(p, req, ws)
    ws[0].routed_recent, ws[3].routed_recent = 215.0, 185.0
    assert "over" not in picks(make_policy("kv_aware", escape_prompts=None), req, ws)
    # with a small mean share the slack makes the cap looser than the hard cap: no escape
    small = [view("over", routed_recent=14.8, running_requests=1), view("b", routed_recent=10.0,
             queued_prefill_tokens=20000), view("c", routed_recent=10.0, queued_prefill_tokens=20000),
             view("d", routed_recent=5.2, queued_prefill_tokens=20000)]
    assert "over" not in picks(p, req, small)
    with pytest.raises(ValueError, match="escape_prompts"):
        make_policy("kv_aware", escape_prompts=-1)
    for bad in (-0.1, math.nan, math.inf):
        with pytest.raises(ValueError, match="hard_cap"):
            make_policy("kv_aware", hard_cap=bad)


def test_kv_aware_a_holder_keeps_a_request_until_its_queue_passes_13_times_the_saved_prefill():
    # cost = queued + 13 x uncached (recompute_weight 12): predicted TTFT plus the recompute
    p = make_policy("kv_aware")
    req = request(64)  # 1024 tokens, 60 blocks cached on the holder
    ws = [view("holder", matched_blocks=60, queued_prefill_tokens=12000), view("b")]
    assert set(picks(p, req, ws)) == {"holder"}  # 12000 + 13 * 64 < 13 * 1024
    ws[0].queued_prefill_tokens = 12500          # 12500 + 832 > 13312
    assert set(picks(p, req, ws)) == {"b"}
    # between workers without a hit the queue decides at full weight
    ws = [view("a", queued_prefill_tokens=100), view("b", queued_prefill_tokens=99)]
    assert set(picks(p, req, ws)) == {"b"}


def test_kv_aware_costs_follow_the_documented_formula():
    p = KVAwarePolicy(recompute_weight=3.0, decode_weight=10.0, share_cap=0.5, share_slack=1.0, share_weight=0.0)
    req = request(10)  # 160 tokens
    ws = [view("a", matched_blocks=4, weighted_blocks=3.0, queued_prefill_tokens=50, running_requests=2,
               routed_recent=6.0),
          view("b", matched_blocks=2, weighted_blocks=2.0, queued_prefill_tokens=0, running_requests=1,
               routed_recent=2.0)]
    # mean 4, limit 1.5 * 4 + 1 = 7: both eligible
    cost_a = 50 + 4 * (160 - BS * 3.0) + 10 * 2
    cost_b = 0 + 4 * (160 - BS * 2.0) + 10 * 1
    assert p.costs(req, ws) == pytest.approx([cost_a, cost_b])
    ws[0].routed_recent = 9.0  # mean 5.5, limit 9.25: still eligible
    assert p.costs(req, ws)[0] == pytest.approx(cost_a)
    ws[0].routed_recent = 10.0  # mean 6, limit 10: equal is allowed
    assert p.costs(req, ws)[0] == pytest.approx(cost_a)
    ws[0].routed_recent = 10.5  # mean 6.25, limit 10.375: over
    assert p.costs(req, ws)[0] == math.inf
    # the share term: share_weight / mean of the uncached tokens per request of excess...
    p = KVAwarePolicy(recompute_weight=3.0, decode_weight=10.0, share_cap=0.5, share_slack=1.0, share_weight=2.0,
                      share_tokens_cap=None)
    ws[0].routed_recent = 6.0  # mean 4
    assert p.costs(req, ws) == pytest.approx([cost_a + 2.0 / 4 * 112 * 2, cost_b + 2.0 / 4 * 128 * -2])
    # ...counting at most share_tokens_cap of the mean prompt length routed so far (the
    # default, 1.0, binds only on prompts longer than the mean; here 0.5 to show it)
    p = KVAwarePolicy(recompute_weight=3.0, decode_weight=10.0, share_cap=0.5, share_slack=1.0, share_weight=2.0,
                      share_tokens_cap=0.5, prompt_window=4)
    assert p.costs(req, ws) == pytest.approx([cost_a + 2.0 / 4 * 80 * 2, cost_b + 2.0 / 4 * 80 * -2])  # none yet: N
    for n in (160, 64, 64):
        p.note_prompt(n)
    assert p.mean_prompt == pytest.approx(160 + (64 - 160) / 4 + (64 - 160 - (64 - 160) / 4) / 4)  # 118
    assert p.costs(req, ws) == pytest.approx([cost_a + 2.0 / 4 * 59 * 2, cost_b + 2.0 / 4 * 59 * -2])
    with pytest.raises(ValueError):
        KVAwarePolicy(share_tokens_cap=0.0)
    for bad in (0.5, math.inf, math.nan):
        with pytest.raises(ValueError):
            KVAwarePolicy(prompt_window=bad)
    # choose() counts a request once: not again on a retry, and not one without tokens
    q = KVAwarePolicy(prompt_window=2)
    q.choose(request(10), ws, random.Random(0))
    assert q.mean_prompt == 160
    for again in (RouteRequest(2 * 160, [], BS, retry=True), RouteRequest(0, [], BS)):
        q.choose(again, ws, random.Random(0))
        assert q.mean_prompt == 160
    q.choose(request(20), ws, random.Random(0))
    assert q.mean_prompt == 160 + (320 - 160) / 2


def test_kv_aware_mean_prompt_is_the_median_over_senders():
    # Three tenants with prompts of 1,000-3,000 tokens; a fourth floods one-token prompts.
    p = KVAwarePolicy(prompt_window=8)
    for _ in range(50):
        for sender, n in (("a", 1000), ("b", 2000), ("c", 3000)):
            p.note_prompt(n, sender)
    assert p.mean_prompt == pytest.approx(2000)
    for _ in range(5000):
        p.note_prompt(1, "flood")
    # the flood moves only its own average: the median of {1000, 2000, 3000, 1} is 1,500
    assert 1000 <= p.mean_prompt <= 2000
    for _ in range(5000):
        p.note_prompt(10 ** 6, "flood")
    assert 2000 <= p.mean_prompt <= 3000
    # one sender: its own average, as before
    one = KVAwarePolicy(prompt_window=4)
    for _ in range(200):
        one.note_prompt(1, "x")
    assert one.mean_prompt == pytest.approx(1)
    # senders beyond MAX_SENDERS: the least recently heard leave the median
    many = KVAwarePolicy()
    for i in range(KVAwarePolicy.MAX_SENDERS + 10):
        many.note_prompt(100, f"t{i}")
    assert len(many._by_sender) == KVAwarePolicy.MAX_SENDERS and "t0" not in many._by_sender


def test_kv_aware_share_term_pulls_new_work_to_under_share_workers():
    # A new conversation (only the shared first block in common) on a worker that holds the
    # block but has a large share, against a cold worker with none: the share term
    # (3 / mean of the uncached tokens per request of difference from the mean) outweighs one block.
    p = make_policy("kv_aware")
    req = request(40)  # 640 tokens
    ws = [view("warm", matched_blocks=1, routed_recent=9.0), view("cold", routed_recent=1.0)]
    # mean 5 (cap 9.25): warm 13 * 624 + 0.6 * 624 * 4 = 9609.6, cold 13 * 640 - 0.6 * 640 * 4 = 6784
    assert set(picks(p, req, ws)) == {"cold"}
    assert p.costs(req, ws) == pytest.approx([9609.6, 6784])
    # routed_mean from the caller (a shortlist of a larger fleet) replaces the mean of the views
    req.routed_mean = 10.0
    assert p.costs(req, ws) == pytest.approx([13 * 624 - 0.3 * 624, 13 * 640 - 0.3 * 640 * 9])
    # without the term the holder of the shared block wins
    assert set(picks(make_policy("kv_aware", share_weight=0.0), request(40), ws)) == {"warm"}
    # a request with a large hit hardly feels it: the term scales with the uncached tokens
    ws[0].matched_blocks = ws[0].weighted_blocks = 36
    assert set(picks(p, request(40), ws)) == {"warm"}


def test_kv_aware_a_prefix_most_workers_hold_is_charged_its_prefill_time_only():
    # A 32-block system prompt held by 6 of 8 workers; the request adds 8 blocks of its own.
    p = make_policy("kv_aware")
    req = request(40)  # 640 tokens
    ws = [view(f"warm{i}", matched_blocks=32, routed_recent=10.0) for i in range(6)]
    ws += [view("cold", routed_recent=0.0), view("cold2", routed_recent=10.0)]
    # mean 8.75; more than half hold 32 blocks: only the 8 own blocks are charged the recompute
    mean = 8.75
    warm = 128 + 12 * 128 + 3 / mean * 128 * (10 - mean)
    cold = 640 + 12 * 128 + 3 / mean * 640 * (0 - mean)
    assert p.costs(req, ws)[0] == pytest.approx(warm) and p.costs(req, ws)[6] == pytest.approx(cold)
    # so the cold worker with no share gets the new conversation...
    assert set(picks(p, req, ws)) == {"cold"}
    # ...which it would not if the prompt were charged as a recompute (held by only half)
    for w in ws[3:6]:
        w.matched_blocks = w.weighted_blocks = 0
    assert p.costs(req, ws)[6] == pytest.approx(13 * 640 - 3 * 640)
    assert set(picks(p, req, ws)) <= {"warm0", "warm1", "warm2"}
    # widely_held = 1: nothing is common, every computed token is charged
    q = make_policy("kv_aware", widely_held=1.0)
    ws[3].matched_blocks = ws[3].weighted_blocks = 32
    assert q.costs(req, ws)[6] == pytest.approx(13 * 640 - 3 * 640)
    with pytest.raises(ValueError):
        make_policy("kv_aware", widely_held=1.5)


def test_routed_share_window_grows_with_the_fleet():
    default = RoutedShare()
    default.set_fleet(10)
    assert default.window == 3000       # 300 decisions per worker by default
    share = RoutedShare(window=400, per_worker=40)
    assert share.window == 400
    share.set_fleet(5)
    assert share.window == 400          # never below the base window
    share.set_fleet(100)
    assert share.window == 4000
    for i in range(8000):
        share.note(f"w{i % 100}")
    # mean per worker near per_worker once the window is full
    assert share.total() / 100 == pytest.approx(40 * (1 - (1 - 1 / 4000) ** 8000), rel=1e-3)
    assert sum(share.value(f"w{i}") for i in range(100)) == pytest.approx(share.total(), rel=1e-9)


def test_routed_share_least_finds_idle_and_least_routed_workers():
    share = RoutedShare()
    for w in ("a", "b", "c", "d"):
        share.track(w)
    for w in ("a", "a", "b", "c", "a", "b"):
        share.note(w)
    assert share.least(1) == ["d"]       # tracked, never routed
    assert share.least(2) == ["d", "c"]
    assert share.least(10) == ["d", "c", "b", "a"]
    assert share.least(10) == ["d", "c", "b", "a"]  # least() leaves the heap intact
    share.note("d"); share.note("d"); share.note("d")
    assert share.least(1) == ["c"]
    share.forget("c")
    assert "c" not in share.least(10)
    # many notes: stale heap entries are dropped, answers stay exact
    for i in range(5000):
        share.note("abd"[i % 3])
    vals = {w: share.value(w) for w in "abd"}
    assert share.least(3) == sorted(vals, key=vals.get)


def test_routed_share_decays_per_decision():
    share = RoutedShare(window=4)
    share.note("a")
    assert share.value("a") == pytest.approx(1.0)
    share.note("b")
    assert share.value("a") == pytest.approx(0.75) and share.value("b") == pytest.approx(1.0)
    for _ in range(2000):  # long runs renormalise instead of underflowing
        share.note("b")
    assert share.value("b") == pytest.approx(4.0, rel=1e-6)
    assert share.value("a") < 1e-100
    with pytest.raises(ValueError):
        RoutedShare(window=0.5)


# ---------------------------------------------------------------- simulation
def simulate(policy_name: str, workers=4, n=500, follow_up=0.8, service_tokens=None, seed=0, **kw):
    """Closed-loop routing of a conversation workload.

    Every request starts with one block all requests share; a new conversation adds
    8-24 blocks of its own, a follow-up (probability ``follow_up``) picks an earlier
    conversation and appends 2-8 blocks. Workers cache whatever they served (no
    eviction), queue the uncached prefill tokens and drain ``service_tokens`` per
    arrival (default: 70 % utilisation); running requests last 2 x workers arrivals;
    routed_recent is a `RoutedShare` (window 400 decisions), as in the router.

    Returns (request counts per worker, tokens hit, tokens the best worker held).
    """
    rng, prng = random.Random(seed), random.Random(seed + 1)
    policy = make_policy(policy_name, **kw)
    shared = b"\x00" * 15 + b"\x01"
    if service_tokens is None:
        service_tokens = (16 * (1 - follow_up) + 5 * follow_up) * BS / (workers * 0.7)
    caches = [set() for _ in range(workers)]
    queued = [0.0] * workers
    routed = RoutedShare()
    ends = [[] for _ in range(workers)]
    convs: list[list[bytes]] = []
    sent = [0] * workers
    hit = best = 0
    for t in range(n):
        if convs and rng.random() < follow_up:
            conv = rng.choice(convs)
            conv.extend(rng.randbytes(16) for _ in range(rng.randint(2, 8)))
        else:
            conv = [shared] + [rng.randbytes(16) for _ in range(rng.randint(8, 24))]
            convs.append(conv)
        hashes = list(conv)
        views = []
        for i in range(workers):
            m = 0
            for h in hashes:
                if h not in caches[i]:
                    break
                m += 1
            ends[i] = [e for e in ends[i] if e > t]
            views.append(WorkerView(f"w{i}", "", m, float(m), len(ends[i]), 0, int(queued[i]), 0, 0,
                                    routed.value(f"w{i}")))
        w = policy.choose(RouteRequest(len(hashes) * BS, hashes, BS), views, prng)
        i = views.index(w)
        sent[i] += 1
        hit += w.matched_blocks * BS
        best += max(v.matched_blocks for v in views) * BS
        caches[i].update(hashes)
        queued[i] += (len(hashes) - w.matched_blocks) * BS
        ends[i].append(t + 2 * workers)
        for j in range(workers):
            queued[j] = max(0.0, queued[j] - service_tokens)
        routed.note(w.worker_id)
    return sent, hit, best


def share_ratio(sent) -> float:
    return max(sent) / (sum(sent) / len(sent))


@pytest.mark.parametrize("workers", [2, 3, 4])
def test_simulation_kv_aware_balances_and_keeps_prefix_hits(workers):
    for seed in range(2):
        sent, hit, best = simulate("kv_aware", workers=workers, seed=seed)
        assert share_ratio(sent) <= 1.25, sent
        assert hit / best >= 0.75
        rnd_sent, rnd_hit, rnd_best = simulate("random", workers=workers, seed=seed)
        assert hit > rnd_hit * 1.1  # it does exploit the cache


def test_simulation_idle_queues_still_no_pile_up_on_the_shared_block():
    # Prefill drains at once, so queues never push back: only the share cap does.
    sent, hit, best = simulate("kv_aware", workers=4, service_tokens=10**9)
    assert share_ratio(sent) <= 1.25, sent
    assert hit / best >= 0.75
    # Without it (nor the decode and share terms) every request follows the shared block to one worker,
    # as the pure prefix policy does.
    for name, kw in (("kv_aware", dict(share_cap=1e9, decode_weight=0, share_weight=0)), ("prefix", {})):
        sent, _, _ = simulate(name, workers=4, service_tokens=10**9, **kw)
        assert share_ratio(sent) > 3.5, (name, sent)


def test_c_simulation_short_common_prefix_only_stays_balanced():
    for workers in (2, 4):
        for service in (None, 10**9):
            sent, _, _ = simulate("kv_aware", workers=workers, follow_up=0.0, service_tokens=service, n=400)
            assert share_ratio(sent) <= 1.25, sent


def test_kv_aware_on_a_shortlist_counts_widely_held_blocks_over_the_whole_fleet():
    """A caller that shows kv_aware a shortlist passes `common_blocks` counted over every
    worker; a cold worker's cost is then the one it has when kv_aware sees the whole fleet."""
    p = make_policy("kv_aware")
    n_blocks = 10
    full = [view(f"w{i}", matched_blocks=8 if i < 60 else 0, weighted_blocks=8.0 if i < 60 else 0.0,
                 routed_recent=5.0) for i in range(100)]
    req = RouteRequest(n_blocks * 16, [H(i) for i in range(n_blocks)], 16)
    full_costs = p.costs(req, full)
    short = full[:8] + full[60:68]  # 8 holders, 8 workers without the prefix
    shown = RouteRequest(n_blocks * 16, req.block_hashes, 16, routed_mean=5.0, common_blocks=8)
    short_costs = p.costs(shown, short)
    assert short_costs[0] == pytest.approx(full_costs[0])
    assert short_costs[8] == pytest.approx(full_costs[60])
    # read off the shortlist alone, 8 of 16 holders are not "more than half": the cold
    # worker is charged the recompute of the whole prefix
    alone = p.costs(RouteRequest(n_blocks * 16, req.block_hashes, 16, routed_mean=5.0), short)
    assert alone[8] > short_costs[8] + 8 * 16


def test_cluster_index_common_depth_counts_holders_of_the_whole_chain():
    from kvmesh.cache_store.events import BlockStored, EventBatch
    from kvmesh.services.cluster_index import ClusterIndex

    idx = ClusterIndex()
    chain = [H(i) for i in range(6)]
    held = {"a": 6, "b": 6, "c": 3, "d": 1}
    for wid, n in held.items():
        events = [BlockStored(block_hashes=chain[:n], parent_block_hash=None, token_ids=[0] * (16 * n), block_size=16)]
        idx.apply_batch(EventBatch(worker_id=wid, seq=1, ts=0.0, events=events))
    assert idx.common_depth(chain, 1) == 6
    assert idx.common_depth(chain, 2) == 6
    assert idx.common_depth(chain, 3) == 3
    assert idx.common_depth(chain, 4) == 1
    assert idx.common_depth(chain, 5) == 0
    assert idx.common_depth([b"x"] + chain, 1) == 0  # the first block unknown: nothing is common


def test_the_router_leaves_out_workers_whose_context_a_prompt_does_not_fit():
    """A cluster whose workers serve contexts of 64 and 4,096 tokens: a 100-token prompt is
    offered only to the long-context workers (the short one would refuse it, and kv_aware
    sends cold prompts to empty workers); the longest context bounds what the router takes."""
    from kvmesh.services.router import context_limit, fitting_workers

    live = {"w1": {"max_model_len": 4096}, "w7": {"max_model_len": 64}, "old": {}}
    assert sorted(fitting_workers(live, 100)) == ["old", "w1"]
    assert sorted(fitting_workers(live, 63)) == ["old", "w1", "w7"]
    assert sorted(fitting_workers(live, 64)) == ["old", "w1"]  # a prompt must leave room: 63 at most
    assert sorted(fitting_workers(live, 60, 4)) == ["old", "w1", "w7"]  # prompt and completion: 64 at most
    assert sorted(fitting_workers(live, 60, 5)) == ["old", "w1"]
    assert context_limit(live, 2048) == 4096 and context_limit({"old": {}}, 2048) == 2048


def test_a_worker_that_cannot_be_reached_is_not_named_by_address():
    """A client's error for an unreachable worker says so without the worker's address (for
    peers only); a worker's own refusal reaches the client unchanged."""
    import grpc

    from kvmesh.services.router import _client_details

    class Err(grpc.aio.AioRpcError):
        def __init__(self, code, details):
            self._c, self._d = code, details

        def code(self):
            return self._c

        def details(self):
            return self._d

    refused = ("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:37595: "
               "Failed to connect to remote host: Connection refused")
    assert _client_details(Err(grpc.StatusCode.UNAVAILABLE, refused)) == "the worker could not be reached"
    assert "37595" not in _client_details(Err(grpc.StatusCode.UNAVAILABLE, "Socket closed 10.0.0.7:50051"))
    own = "queue is full (512 requests waiting): retry later"
    assert _client_details(Err(grpc.StatusCode.RESOURCE_EXHAUSTED, own)) == own


def test_a_prefix_is_fetched_only_from_a_holder_of_the_same_kv_producer():
    """The router names a peer-fetch holder among workers whose kernels compute the chosen
    worker's KV bit for bit: the deepest holder on other hardware is passed over."""
    from kvmesh.services.policies import prefix_holder
    from kvmesh.services.router import same_producer

    live = {"cpu-a": {"kv_producer": "cpu avx2"}, "gpu": {"kv_producer": "cuda sm90"},
            "cpu-b": {"kv_producer": "cpu avx2"}, "old": {}}
    views = [WorkerView("cpu-a", "a:1", matched_blocks=0), WorkerView("gpu", "g:1", matched_blocks=9),
             WorkerView("cpu-b", "b:1", matched_blocks=4), WorkerView("old", "o:1", matched_blocks=7)]
    chosen = views[0]
    assert prefix_holder(chosen, views).worker_id == "gpu"  # deepest overall
    assert prefix_holder(chosen, same_producer(chosen, views, live)).worker_id == "cpu-b"
    assert [v.worker_id for v in same_producer(views[3], views, live)] == ["old"]
