"""Deadline shedding: a request that cannot reach its first token before its caller's
deadline is failed DEADLINE_EXCEEDED before its prefill computes anything, and requests
that are served give the same tokens as a cold run without a deadline."""
from __future__ import annotations

import random
import threading
import time

import pytest

from kvmesh.workers.engine import Engine
from kvmesh.workers.request import SamplingParams
from tests._device import DEVICE

BS = 16
GREEDY = SamplingParams(max_tokens=8)
#: the engine's shed factor in the estimate tests: large, so the deadlines they set are
#: seconds long and scheduling jitter cannot decide the outcome
FACTOR = 200.0


@pytest.fixture(scope="module")
def engine():
    e = Engine(device=DEVICE, num_blocks=512, block_size=BS, deadline_shed_factor=FACTOR).start()
    warm(e)
    yield e
    e.stop()


def warm(e: Engine) -> float:
    """Enough fresh measured prefill steps for `Engine.peak_prefill_rate` to answer (it
    pauses when the newest is `Engine.PEAK_RATE_STALE_S` old); returns it (tokens/s)."""
    for seed in range(Engine.PEAK_RATE_MIN_SAMPLES):
        e.generate(prompt(100 + seed, 200), GREEDY)
    rate = e.peak_prefill_rate()
    assert rate is not None
    return rate


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def slow_spell(e: Engine, steps: int, tokens: int, stall: float) -> None:
    """Run ``steps`` one-step requests of ``tokens`` fresh tokens with every forward pass
    followed by ``stall`` times its own duration of sleep (an injected fault: a slowed
    engine), then restore the model."""
    model = e.model
    forward = model.forward

    def stalled(*a, **kw):
        t0 = time.perf_counter()
        out = forward(*a, **kw)
        time.sleep(stall * (time.perf_counter() - t0))
        return out

    model.forward = stalled
    try:
        for seed in range(steps):
            e.generate(prompt(1000 + 97 * steps + seed, tokens), SamplingParams(max_tokens=1))
    finally:
        del model.forward


def submit(engine: Engine, ids: list[int], deadline: float | None) -> dict:
    """Run one request with ``deadline`` (monotonic seconds) to its end; its outputs joined."""
    done = threading.Event()
    out: dict = {"token_ids": []}

    def on_output(o):
        out["token_ids"].extend(o.new_token_ids)
        if o.finished:
            out.update(finish_reason=o.finish_reason, error=o.error, error_code=o.error_code, usage=o.usage)
            done.set()

    engine.submit(ids, GREEDY, on_output, deadline=deadline)
    assert done.wait(120), "no answer"
    return out


def test_a_request_whose_deadline_has_passed_is_shed_and_computes_nothing():
    from kvmesh.cache_store.tier_store import TierConfig

    e = Engine(device=DEVICE, num_blocks=256, block_size=BS,  # the default factor
               tiers=TierConfig(host_bytes=64 << 20, load_policy="always")).start()
    try:
        held = prompt(11, 200)
        e.generate(held, GREEDY)
        e.offload_device_cache()  # its prefix now only on the host tier
        loaded = e.tiers.stats()["loaded"]
        late = submit(e, held, deadline=time.monotonic() - 0.01)
        assert late["error_code"] == "DEADLINE_EXCEEDED"
        assert e.tiers.stats()["loaded"] == loaded  # shed before its prefix was looked up, no host read
        ids = prompt(1, 200)
        shed_before = e.scheduler.num_shed
        out = submit(e, ids, deadline=time.monotonic() - 0.01)
        assert out["error_code"] == "DEADLINE_EXCEEDED" and "deadline passed" in out["error"], out
        assert out["token_ids"] == []
        assert e.scheduler.num_shed == shed_before + 1
        again = e.generate(ids, GREEDY)  # nothing of the shed prompt was computed or cached
        assert again["usage"]["cached_tokens"] == 0
        assert len(again["token_ids"]) == GREEDY.max_tokens
    finally:
        e.stop()


def test_a_request_that_cannot_make_its_deadline_is_shed_and_one_that_can_is_served(engine):
    ids = prompt(2, 900)
    engine.clear_cache()
    need = len(ids) / warm(engine)  # seconds of prefill, uncached, at the fastest recent rate
    out = submit(engine, ids, deadline=time.monotonic() + FACTOR * need / 4)
    assert out["error_code"] == "DEADLINE_EXCEEDED", out
    assert "shed before its prefill" in out["error"] and "900 uncached prompt tokens" in out["error"], out["error"]
    assert f"--deadline-shed-factor {FACTOR:g} x that" in out["error"], out["error"]  # why, when need < left
    served = submit(engine, ids, deadline=time.monotonic() + FACTOR * need * 4)
    assert not served["error"], served
    engine.clear_cache()
    cold = engine.generate(ids, GREEDY)
    assert cold["usage"]["cached_tokens"] == 0
    assert served["token_ids"] == cold["token_ids"] and len(cold["token_ids"]) == GREEDY.max_tokens


def test_the_estimate_counts_only_the_uncached_tokens(engine):
    """A deadline that sheds the cold prompt serves it once its prefix is cached, with the
    tokens of a cold run."""
    ids = prompt(3, 900)
    engine.clear_cache()
    need = len(ids) / warm(engine)
    tight = FACTOR * need / 4  # seconds: sheds 900 uncached tokens, not 900 - 864 of them
    assert submit(engine, ids, deadline=time.monotonic() + tight)["error_code"] == "DEADLINE_EXCEEDED"
    cold = engine.generate(ids, GREEDY)  # computes and caches the prompt
    assert cold["usage"]["cached_tokens"] == 0
    hit = submit(engine, ids, deadline=time.monotonic() + tight)
    assert not hit["error"], hit
    assert hit["usage"]["cached_tokens"] == BS * ((len(ids) - 1) // BS)
    assert hit["token_ids"] == cold["token_ids"]


def test_a_fresh_engine_sheds_on_the_estimate_only_after_several_measured_steps():
    """One cold step can read many times slower than the engine is: until
    `Engine.PEAK_RATE_MIN_SAMPLES` steps are measured, only past deadlines are shed."""
    e = Engine(device=DEVICE, num_blocks=256, block_size=BS, deadline_shed_factor=1e9).start()
    try:
        e.generate(prompt(12, 200), GREEDY)  # one measured step
        assert e.peak_prefill_rate() is None
        out = submit(e, prompt(13, 200), deadline=time.monotonic() + 60)  # 1e9 x any estimate would shed it
        assert not out["error"], out
    finally:
        e.stop()


def test_a_slow_spell_does_not_make_the_engine_shed_what_it_can_serve(engine):
    """Steps slowed 10-fold for a while (an injected fault: a stalled forward) leave the
    rate shedding estimates with where it was, so a request that fits at the engine's real
    speed is served, with the tokens of a cold run."""
    fast = warm(engine)  # fresh samples: none ages out during the spell
    slow_spell(engine, steps=5, tokens=128, stall=10)
    assert engine.prefill_tokens_per_s() < fast / 2  # the cautious rate did fall
    assert engine.peak_prefill_rate() >= fast * 0.99
    ids = prompt(14, 900)
    need = len(ids) / fast
    served = submit(engine, ids, deadline=time.monotonic() + FACTOR * need * 4)
    assert not served["error"], served
    engine.clear_cache()
    assert served["token_ids"] == engine.generate(ids, GREEDY)["token_ids"]


def test_a_long_slow_spell_pauses_estimate_shedding_until_a_probe_measures_the_engine_again():
    """A slow spell long enough to fill every sample slot (an injected stall), then no
    steps: once the newest sample is `Engine.PEAK_RATE_STALE_S` old, the estimate is off,
    the next tight-deadline request is served, and its step brings the rate back."""
    e = Engine(device=DEVICE, num_blocks=512, block_size=BS, deadline_shed_factor=FACTOR).start()
    e.PEAK_RATE_STALE_S = 1.0  # the instance's own: the test need not wait 5 s
    try:
        fast = warm(e)
        slow_spell(e, steps=Engine.PEAK_RATE_SAMPLES + 1, tokens=64, stall=6)
        slow = e.peak_prefill_rate()
        assert slow is not None and slow < fast / 2  # every slot holds a slow step
        ids = prompt(15, 900)
        # seconds between what the estimate needs at the slow rate and at the fast one: shed
        # at the first, served at the second, whatever this machine's speed
        fits = FACTOR * len(ids) / (fast * slow) ** 0.5
        assert submit(e, ids, deadline=time.monotonic() + fits)["error_code"] == "DEADLINE_EXCEEDED"
        time.sleep(e.PEAK_RATE_STALE_S + 0.2)
        assert e.peak_prefill_rate() is None  # no fresh sample: estimate shedding pauses
        served = submit(e, ids, deadline=time.monotonic() + fits)
        assert not served["error"], served
        assert e.peak_prefill_rate() > slow  # the probe measured the engine again
        e.clear_cache()
        assert served["token_ids"] == e.generate(ids, GREEDY)["token_ids"]
    finally:
        e.stop()


def test_a_step_is_timed_to_the_end_of_its_device_work():
    """On a GPU the forward pass returns once its kernels are queued; the rate must count
    their run. A device wait that takes 1 s (an injected stand-in for queued kernels) is
    inside the measured step."""
    e = Engine(device=DEVICE, num_blocks=64, block_size=BS).start()
    try:
        for seed in (16, 17):  # the first step pays one-off costs
            e.generate(prompt(seed, 200), SamplingParams(max_tokens=1))
        _, warm_rate = e._rate_samples[-1]
        assert warm_rate > 200 / 1.0  # 200 tokens take well under a second here
        e._sync_device = lambda: time.sleep(1.0)
        e.generate(prompt(18, 200), SamplingParams(max_tokens=1))
        _, rate = e._rate_samples[-1]
        assert rate <= 200 / 1.0, rate
    finally:
        e.stop()


def _sched_request(rid: str, n: int, deadline: float | None):
    from kvmesh.cache_store.hashing import Namespace
    from kvmesh.workers.request import Request

    return Request(rid, prompt(sum(map(ord, rid)), n), GREEDY, Namespace("m"), BS, lambda o: None, deadline=deadline)


def test_the_estimate_counts_the_prefill_running_requests_have_left():
    """A request admitted behind a long prompt still in prefill waits for that prompt's
    remaining chunks (running requests take each step's budget first), so a deadline that
    its own prefill fits but the two together do not is shed, naming the tokens ahead; the
    same deadline is served once nothing runs ahead. A fixed rate: no model, no timing."""
    from kvmesh.cache_store.prefix_cache import PrefixCache
    from kvmesh.workers.scheduler import Scheduler

    rate = 1000.0  # tokens/s
    s = Scheduler(PrefixCache(256, BS), max_num_batched_tokens=64, shed_rate=lambda: rate,
                  deadline_shed_factor=1.0)
    long = _sched_request("long", 1000, None)
    s.add(long)
    batch = s.schedule()
    assert batch.requests == [long] and batch.num_new_tokens == [64]
    s.update_after_step(batch)
    left = 936  # prompt tokens the long request has still to compute
    # 100 tokens alone need 0.1 s; behind the long prompt, (936 + 100) / 1000 = 1.04 s
    short = _sched_request("short", 100, time.monotonic() + 0.6)
    s.add(short)
    batch = s.schedule()
    assert batch.requests == [long]
    assert [r for r, _ in batch.shed] == [short]
    why = batch.shed[0][1]
    assert f"after the {left} prompt tokens running requests have still to compute" in why, why
    assert "100 uncached prompt tokens" in why, why
    s.remove(long)  # nothing runs ahead now: the same deadline fits
    again = _sched_request("again", 100, time.monotonic() + 0.6)
    s.add(again)
    batch = s.schedule()
    assert batch.requests == [again] and not batch.shed


def test_requests_admitted_in_one_step_count_for_those_behind_them():
    """Two requests considered in the same step: the second is estimated behind the
    first's whole prompt, which was admitted just before it."""
    from kvmesh.cache_store.prefix_cache import PrefixCache
    from kvmesh.workers.scheduler import Scheduler

    s = Scheduler(PrefixCache(256, BS), max_num_batched_tokens=2048, shed_rate=lambda: 1000.0,
                  deadline_shed_factor=1.0)
    first = _sched_request("first", 800, time.monotonic() + 30)
    second = _sched_request("second", 300, time.monotonic() + 0.8)  # 0.3 s alone, 1.1 s behind the first
    s.add(first)
    s.add(second)
    batch = s.schedule()
    assert batch.requests == [first]
    assert [r for r, _ in batch.shed] == [second]
    assert "after the 800 prompt tokens" in batch.shed[0][1]


def test_a_negative_or_nan_shed_factor_is_refused():
    from kvmesh.cache_store.prefix_cache import PrefixCache
    from kvmesh.workers.scheduler import Scheduler

    for bad in (-0.1, float("nan")):
        with pytest.raises(ValueError, match="deadline_shed_factor"):
            Scheduler(PrefixCache(8, BS), deadline_shed_factor=bad)


def test_the_overload_bench_runs_and_accounts_for_every_request(capsys):
    import json

    from kvmesh.bench import deadline_shed

    assert deadline_shed.main(["--json", "--seconds", "1.5", "--rounds", "1", "--prompt-tokens", "64",
                               "--factors", "0"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["modes"]) == {"off", "shed 0"}
    for mode in out["modes"].values():
        assert mode["requests"] >= 1 and 0.0 <= mode["on_time"] <= 1.0
        assert mode["wasted_prefill_tokens"] >= 0 and mode["shed"] >= 0
    assert out["modes"]["off"]["shed"] == 0  # the engine was never told a deadline


def test_the_worker_flag_parses_and_names_itself(capsys):
    from kvmesh.services.cli import build_parser
    from kvmesh.workers.request import DEFAULT_DEADLINE_SHED_FACTOR

    parser = build_parser()
    assert parser.parse_args(["worker", "--port", "1", "--deadline-shed-factor", "2"]).deadline_shed_factor == 2.0
    assert parser.parse_args(["worker", "--port", "1"]).deadline_shed_factor == DEFAULT_DEADLINE_SHED_FACTOR
    for bad in ("-1", "nan", "inf", "two"):
        with pytest.raises(SystemExit) as exc:
            parser.parse_args(["worker", "--port", "1", "--deadline-shed-factor", bad])
        assert exc.value.code == 2
        assert "--deadline-shed-factor" in capsys.readouterr().err
