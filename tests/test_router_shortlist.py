"""The live router's decisions in a large fleet: a shortlist of views, not one per worker.

The router reads the fleet (compatibility, contexts) once per version of the live leases and
shows kv_aware only `services.shortlist.shortlist`'s workers past 16 workers, as the
simulator does (docs/ROUTING.md, "Routing cost")."""
from __future__ import annotations

import random
import time

import pytest

from kvmesh.cache_store.events import BlockStored, EventBatch
from kvmesh.cache_store.hashing import Namespace, hash_blocks
from kvmesh.services.cluster_index import ClusterIndex
from kvmesh.services.router import RouterServicer
from kvmesh.services.shortlist import SHORTLIST_HOLDERS, SHORTLIST_LEAST, SHORTLIST_SAMPLE

BS = 16
MODEL = "m-test"
SHORTLIST_SIZE = SHORTLIST_HOLDERS + SHORTLIST_LEAST + SHORTLIST_SAMPLE


class Leases:
    """A subscriber's read side over a lease dict the test edits (bumping the version)."""

    def __init__(self, live):
        self.live, self.live_version, self.reads = live, 1, 0

    def live_workers(self):
        self.reads += 1
        return dict(self.live)


def _lease(i, queued=0, max_model_len=4096):
    return {"address": f"127.0.0.1:{30000 + i}", "model_id": MODEL, "block_size": BS, "max_model_len": max_model_len,
            "ts": time.time(), "load": {"running_requests": 0, "queued_prefill_tokens": queued,
                                        "free_blocks": 100, "total_blocks": 100}}


def _hashes(ids):
    return list(hash_blocks(ids, BS, Namespace(model_id=MODEL).root_hash()).hashes)


def _router(n, seed=0):
    rng = random.Random(seed)
    live = {f"w{i:03d}": _lease(i, queued=rng.randrange(2000)) for i in range(n)}
    index = ClusterIndex()
    router = RouterServicer(index, Leases(live), seed=seed)
    return router, live, index


def _store(index, wid, ids):
    assert index.apply_batch(EventBatch(wid, (index.last_seq(wid) or 0) + 1, time.time(),
                                        [BlockStored(_hashes(ids), None, ids, BS, "device")]))


def test_a_large_fleet_shows_the_policy_a_shortlist_with_the_prefix_holder():
    router, live, index = _router(200)
    rng = random.Random(1)
    prefix = [rng.randrange(1000) for _ in range(20 * BS)]
    _store(index, "w123", prefix)
    ids = prefix + [rng.randrange(1000) for _ in range(3 * BS)]
    fleet = router._fleet()
    chosen, views, _ = router.decide(fleet.usable, len(ids), _hashes(ids), BS, time.monotonic(), set(), None, fleet.ids)
    assert SHORTLIST_LEAST < len(views) <= SHORTLIST_SIZE
    assert "w123" in {v.worker_id for v in views}
    assert chosen.worker_id == "w123" and chosen.matched_blocks == 20
    # a retry excludes the holder: still a shortlist, and never a tried worker
    chosen2, views2, _ = router.decide(fleet.usable, len(ids), _hashes(ids), BS, time.monotonic(), {"w123"}, None,
                                    fleet.ids)
    assert chosen2.worker_id != "w123" and "w123" not in {v.worker_id for v in views2} and views2


def test_a_small_fleet_shows_every_worker_as_before():
    router, live, _ = _router(SHORTLIST_SIZE)
    fleet = router._fleet()
    _, views, _ = router.decide(fleet.usable, 64, _hashes(list(range(64))), BS, time.monotonic(), set())
    assert sorted(v.worker_id for v in views) == sorted(live)


def test_the_share_mean_and_widely_held_depth_are_the_whole_fleets():
    """With a shortlist the policy cannot average its views: the router passes the fleet's
    mean routed share and the depth that more than half of all workers hold."""
    router, live, index = _router(40)
    common = list(range(4 * BS))
    for wid in list(live)[:25]:  # 25 of 40 hold the first four blocks
        _store(index, wid, common)
    ids = common + list(range(500, 500 + 2 * BS))
    fleet = router._fleet()
    for k in range(120):  # uneven shares
        router.routed.note(f"w{k % 7:03d}")
    views, mean, depth = router._views(fleet.usable, _hashes(ids), time.monotonic(), set(), None, fleet.ids)
    assert len(views) <= SHORTLIST_SIZE
    assert mean == pytest.approx(sum(router.routed.value(w) for w in live) / len(live))
    assert depth == 4
    _store(index, "w039", common)  # still 4: holders beyond half change nothing
    assert router._views(fleet.usable, _hashes(ids), time.monotonic(), set(), None, fleet.ids)[2] == 4
    # with another replica's shares, the mean is over both (as each view's share is)
    others = {"w001": (0, 0, 30.0), "w030": (1, 10, 10.0)}
    _, mean2, _ = router._views(fleet.usable, _hashes(ids), time.monotonic(), set(), others, fleet.ids)
    assert mean2 == pytest.approx(mean + 40.0 / len(live))


def test_the_fleet_is_read_once_per_lease_version_and_a_gone_workers_share_is_dropped():
    router, live, _ = _router(30)
    sub = router.subscriber
    calls = []
    select = router.compat.select
    router.compat.select = lambda leases: calls.append(len(leases)) or select(leases)
    for _ in range(25):
        router._fleet()
    assert (sub.reads, calls) == (1, [30])
    router.routed.note("w005")
    assert router.routed.value("w005") > 0
    del sub.live["w005"]
    sub.live["w029"] = _lease(29, max_model_len=1024)  # a lease changed: contexts are re-read
    sub.live_version += 1
    fleet = router._fleet()
    assert (sub.reads, calls) == (2, [30, 29])
    assert "w005" not in fleet.usable and router.routed.value("w005") == 0.0
    assert (fleet.min_context, fleet.max_context) == (1024, 4096)


def test_a_prompt_that_fits_only_some_contexts_is_routed_among_those(tmp_path):
    """A prompt plus max_tokens over the shortest context a lease states takes the filtered
    path; under it the cached fleet is used as it is."""
    import asyncio

    import grpc

    from kvmesh.proto import kvmesh_pb2 as pb

    router, live, _ = _router(20)
    for wid in list(live)[:18]:
        live[wid]["max_model_len"] = 256
    router.subscriber.live_version += 1
    seen = []
    real_decide = router.decide

    def spy(live_, *args, **kwargs):
        seen.append(sorted(live_))
        return None, [], None  # no worker is dialled: the call ends UNAVAILABLE

    router.decide = spy

    class Ctx:
        def time_remaining(self):
            return 5.0

        async def abort(self, code, details):
            raise grpc.aio.AbortError(f"{code.name}: {details}")

        def invocation_metadata(self):
            return ()

        def auth_context(self):
            return {}

        def peer(self):
            return "ipv4:127.0.0.1:1"

    async def run(n_prompt, max_tokens):
        req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(range(n_prompt))))
        if max_tokens is not None:  # None: no sampling message, which a worker reads as 16 tokens
            req.sampling.CopyFrom(pb.SamplingParams(max_tokens=max_tokens))
        try:
            async for _ in router._generate(req, Ctx(), "", "", ""):
                pass
        except grpc.aio.AbortError as exc:
            return str(exc)
        return ""

    assert "UNAVAILABLE" in asyncio.run(run(200, 16))
    assert seen[-1] == sorted(live)  # fits every context: the whole cached fleet
    assert "UNAVAILABLE" in asyncio.run(run(250, 16))
    assert seen[-1] == sorted(list(live)[18:])  # only the two long-context workers
    assert "UNAVAILABLE" in asyncio.run(run(245, None))  # 245 + 16 > 256
    assert seen[-1] == sorted(list(live)[18:])
    router.decide = real_decide


def test_the_decision_cost_bench_runs_both_modes_on_one_state(capsys):
    import json

    from kvmesh.bench.router_decision import main

    assert main(["--workers", "5,40", "--rounds", "1", "--per-round", "20", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["workers"] for r in rows] == [5, 40]
    for r in rows:
        assert r["shortlist_us"] > 0 and r["all_us"] > 0
        # requests extend cached prefixes: both modes mostly pick a deepest holder
        assert r["shortlist_deepest_holder"] >= 0.5 and r["all_deepest_holder"] >= 0.5
    with pytest.raises(SystemExit):
        main(["--workers", "ten"])


def _mixed_contexts(router, live):
    """Half the fleet serves 1,024-token contexts, half 8,192."""
    for i, wid in enumerate(sorted(live)):
        live[wid]["max_model_len"] = 1024 if i < len(live) // 2 else 8192
    router.subscriber.live_version += 1


def test_a_long_prompt_is_routed_among_the_workers_it_fits_with_their_own_holder_and_mean():
    """Ten short-context workers hold 40 blocks of a prefix, one long-context worker 39; a
    1,120-token prompt fits only the long ones. Shown a fleet-wide shortlist, the ten took
    the holder places and were then dropped, and the fleet's mean share (twice that of the
    fitting half) loosened the cap: the holder was found only when sampled. The part of the
    fleet that fits is shown whole, with its own mean."""
    from kvmesh.services.router import fitting_workers

    router, live, index = _router(60)
    _mixed_contexts(router, live)
    rng = random.Random(1)
    prefix = [rng.randrange(1000) for _ in range(40 * BS)]
    for i in range(10):
        _store(index, f"w{i:03d}", prefix)
    _store(index, "w045", prefix[:39 * BS])
    ids = prefix + [rng.randrange(1000) for _ in range(30 * BS)]
    fleet = router._fleet()
    fit = fitting_workers(fleet.usable, len(ids), 16)
    assert len(fit) == 30
    for k in range(3000):  # the short half got more of the traffic
        router.routed.note(f"w{k % 45:03d}")
    for _ in range(5):
        chosen, views, mean = router.decide(fit, len(ids), _hashes(ids), BS, time.monotonic(), set(), None, None)
        assert chosen.worker_id == "w045" and chosen.matched_blocks == 39
        assert sorted(v.worker_id for v in views) == sorted(fit) and mean is None  # the policy averages them


def test_a_retry_does_not_lose_the_next_holder_to_the_tried_one():
    """Eight tried workers hold 21 blocks of a prompt, a ninth 20: the ninth must still be on
    the shortlist (the tried holders once took all eight holder places and were dropped
    after, leaving the next holder to the random sample)."""
    router, live, index = _router(100)
    rng = random.Random(2)
    ids = [rng.randrange(1000) for _ in range(23 * BS)]
    holders = [f"w{i:03d}" for i in range(50, 59)]
    for wid in holders[:8]:
        _store(index, wid, ids[:21 * BS])
    _store(index, holders[8], ids[:20 * BS])
    fleet = router._fleet()
    tried = set(holders[:8])
    for _ in range(10):
        chosen, views, _ = router.decide(fleet.usable, len(ids), _hashes(ids), BS, time.monotonic(), tried, None,
                                         fleet.ids)
        assert holders[8] in {v.worker_id for v in views} and chosen.worker_id == holders[8]


def test_a_worker_that_leaves_the_usable_set_leaves_the_shares():
    """A worker whose lease turns to another block size is still live but never chosen: its
    decaying share once stayed among the least routed (taking the shortlist's places for
    idle workers) and in the total the mean is taken from."""
    router, live, _ = _router(40)
    router._fleet()
    for k in range(400):
        router.routed.note(f"w{k % 40:03d}")
    for wid in ("w000", "w001", "w002", "w003"):
        live[wid]["block_size"] = 2 * BS
    router.subscriber.live_version += 1
    fleet = router._fleet()
    assert len(fleet.usable) == 36
    for k in range(2000):
        router.routed.note(f"w{4 + k % 36:03d}")
    assert not set(router.routed.least(4)) & {"w000", "w001", "w002", "w003"}
    assert router.routed.total() == pytest.approx(sum(router.routed.value(w) for w in fleet.usable))


def test_a_worker_shutting_down_is_named_as_gone():
    from kvmesh.services.router import _from_worker

    class E:
        def __init__(self, details):
            self._d = details

        def details(self):
            return self._d

    assert not _from_worker(E("Cancelling all calls"))  # a worker stopped (SIGTERM) mid-answer
    assert not _from_worker(E("Stream removed (Socket closed)"))
    assert _from_worker(E("queue is full (64 waiting requests): retry later"))


def test_a_retry_on_an_older_fleet_does_not_bring_a_departed_worker_back_into_the_shares():
    """A request reads the fleet once; if its retry picks a worker whose lease has gone since,
    noting it once put it back among the shares for good (at the bottom of the least-routed,
    holding a place the shortlist then dropped)."""
    router, live, _ = _router(40)
    router._fleet()
    gone = [f"w{i:03d}" for i in range(5)]
    for wid in gone:
        del live[wid]
    router.subscriber.live_version += 1
    router._fleet()
    for wid in gone:  # picks made on the older fleet
        router._note_routed(wid, 0)
    for k in range(2000):
        router._note_routed(f"w{5 + k % 35:03d}", 0)
    assert not set(router.routed.least(4)) & set(gone)
    assert router.routed.total() == pytest.approx(sum(router.routed.value(w) for w in live))
    live["w039"]["address"] = ""  # a lease with nothing to dial is not part of the usable fleet
    router.subscriber.live_version += 1
    assert "w039" not in router._fleet().usable and router.routed.value("w039") == 0.0
