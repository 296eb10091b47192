"""bench.route_frontier: the split-every reference rule and the hit-rate / p99 frontier."""
from __future__ import annotations

import math
import random

import pytest

from kvmesh.bench import route_frontier
from kvmesh.bench.route_frontier import SplitEvery
from kvmesh.bench.route_sweep import workloads
from kvmesh.bench.sim import prepare, simulate
from kvmesh.services.policies import KVAwarePolicy, RouteRequest, WorkerView


def _views(queues):
    return [WorkerView(worker_id=f"w{i}", address="", queued_prefill_tokens=q) for i, q in enumerate(queues)]


def _req(group: int) -> RouteRequest:
    return RouteRequest(num_tokens=64, block_hashes=[bytes([group]), bytes([group, 1])], block_size=32)


def test_whole_groups_stay_on_the_worker_that_took_their_first_request():
    rule = SplitEvery(math.inf)
    rng = random.Random(0)
    first = rule.choose(_req(1), _views([5, 0, 9]), rng).worker_id
    assert first == "w1"  # the least queued
    # later requests of the group stay there even when it is the busiest worker
    assert {rule.choose(_req(1), _views([0, 1000, 0]), rng).worker_id for _ in range(50)} == {"w1"}
    # another group starts on the least queued worker of its own moment
    assert rule.choose(_req(2), _views([0, 1000, 7]), rng).worker_id == "w0"


def test_a_group_opens_one_more_worker_every_pace_requests():
    rule = SplitEvery(3)
    rng = random.Random(0)
    queues = [0, 0, 0, 0]
    picks = []
    for _ in range(10):
        w = rule.choose(_req(1), _views(queues), rng).worker_id
        queues[int(w[1:])] += 10  # each request queues there
        picks.append(w)
    # requests 0-2 on one worker, 3-5 may use two, 6-8 three, 9 four
    assert len(set(picks[:3])) == 1
    assert len(set(picks[:6])) == 2 and len(set(picks[:9])) == 3 and len(set(picks)) == 4


@pytest.mark.parametrize("pace", [0, -1, math.nan])
def test_a_pace_that_is_not_positive_is_refused(pace):
    with pytest.raises(ValueError, match="pace"):
        SplitEvery(pace)


def test_the_simulator_takes_a_policy_instance_as_it_takes_a_name():
    w = {x.name: x for x, _ in workloads()}["bursty"]
    reqs = w.make(4, 0.7)
    cap = w.capacity_tokens(4, reqs, w.block_tokens)
    wl = prepare(reqs[:600], block_tokens=w.block_tokens)
    by_name = simulate(wl, "kv_aware", 4, cap)
    by_instance = simulate(wl, KVAwarePolicy(), 4, cap)
    for key in ("hit_rate_blocks", "ttft_ms", "worker_requests"):
        assert by_instance[key] == by_name[key]
    assert by_instance["policy"] == "kv_aware"


def test_splitting_bursts_trades_hits_for_a_shorter_tail():
    res = route_frontier.frontier("bursty", workers=4, paces=(math.inf, 5), others=("sglang_cache_aware",))
    whole, split = res["paces"]
    assert whole["pace"] == math.inf and split["pace"] == 5
    # each extra worker per burst recomputes the burst's prefix once: fewer hits ...
    assert whole["hit_rate_blocks"] > split["hit_rate_blocks"]
    # ... and spreads the burst's queue: a lower p99
    assert whole["ttft_p99_ms"] > split["ttft_p99_ms"]
    table = route_frontier.frontier_markdown(res)
    assert "| whole groups |" in table and "| split every 5 |" in table and "| sglang_cache_aware |" in table


def test_the_command_refuses_bad_paces_and_unknown_workloads(capsys):
    with pytest.raises(SystemExit) as exc:
        route_frontier.main(["--paces", "inf,0"])
    assert exc.value.code == 2 and "pace must be > 0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        route_frontier.main(["--workloads", "nope"])
    assert exc.value.code == 2 and "unknown workload 'nope'" in capsys.readouterr().err
