"""Deadline shedding: a request that cannot reach its first token before its caller's
deadline is failed DEADLINE_EXCEEDED before its prefill computes anything, and requests
that are served give the same tokens as a cold run without a deadline."""
from __future__ import annotations

import random
import threading
import time

import pytest
import torch

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


def test_step_rates_come_from_the_step_clock_when_it_reports():
    """The engine folds a step into its rates with the seconds its `StepClock` measured on
    the device, when the clock reports them (on CUDA, after the step's end event
    completes), not the forward call's wall time. A clock that holds its reports (an
    injected stand-in for kernels still running) and then reports 1 s per step."""
    from kvmesh.workers.engine import StepClock

    class HeldClock(StepClock):
        def __init__(self):
            super().__init__(torch.device("cpu"))
            self.held = []

        def stop(self, started, done):
            self.held.append(done)  # reported below, as CUDA would once the step completes

    e = Engine(device=DEVICE, num_blocks=64, block_size=BS).start()
    try:
        e.generate(prompt(16, 200), SamplingParams(max_tokens=1))
        before = len(e._rate_samples)
        e.step_clock = clock = HeldClock()
        e.generate(prompt(17, 200), SamplingParams(max_tokens=1))
        assert len(e._rate_samples) == before and clock.held  # nothing folded in before the report
        ran_at = time.monotonic() - 3.0
        for done in clock.held:
            done(1.0, ran_at)
        at, rate = e._rate_samples[-1]
        assert rate == pytest.approx(200.0)  # 200 prompt tokens in the 1 s the clock measured
        assert at == ran_at  # dated when the step ran, not when it was reported
    finally:
        e.stop()


def test_the_step_clock_on_cpu_reports_the_wall_time_at_once():
    from kvmesh.workers.engine import StepClock

    clock = StepClock(torch.device("cpu"))
    got = []
    t = clock.start()
    time.sleep(0.05)
    clock.stop(t, lambda seconds, at: got.append((seconds, at)))
    assert len(got) == 1 and got[0][0] >= 0.05 and got[0][1] <= time.monotonic()


def _sched_request(rid: str, n: int, deadline: float | None, caller: str = ""):
    from kvmesh.cache_store.hashing import Namespace
    from kvmesh.workers.request import Request

    return Request(rid, prompt(sum(map(ord, rid)), n), GREEDY, Namespace("m"), BS, lambda o: None,
                   deadline=deadline, caller=caller)


def test_the_estimate_counts_what_running_requests_compute_before_it():
    """Running requests take each step's budget first. With no long-prefill threshold a
    long prompt in prefill computes all it has left in the step a short request joins, so
    the short one's first token waits for it: a deadline that its own prefill fits but the
    two together do not is shed, naming the tokens ahead, and the same deadline is served
    once nothing runs ahead. A fixed rate of 100 tokens/s: no model, deadlines of seconds."""
    from kvmesh.cache_store.prefix_cache import PrefixCache
    from kvmesh.workers.scheduler import Scheduler

    s = Scheduler(PrefixCache(256, BS), max_num_batched_tokens=2048, long_prefill_token_threshold=0,
                  shed_rate=lambda: 100.0, deadline_shed_factor=1.0)
    long = _sched_request("long", 1000, None)
    s.add(long)
    s.update_after_step(_partial(s.schedule(), long, 64))
    # 100 tokens alone need 1 s; after the 936 the long prompt has left, 10.36 s
    short = _sched_request("short", 100, time.monotonic() + 6)
    s.add(short)
    batch = s.schedule()
    assert batch.requests == [long] and batch.num_new_tokens == [936]
    assert [r for r, _ in batch.shed] == [short]
    why = batch.shed[0][1]
    assert "after at least 936 tokens of the requests running before it" in why, why
    assert "100 uncached prompt tokens" in why, why
    s.remove(long)  # nothing runs ahead now: the same deadline fits
    again = _sched_request("again", 100, time.monotonic() + 6)
    s.add(again)
    batch = s.schedule()
    assert batch.requests == [again] and not batch.shed


def _partial(batch, req, n: int):
    """``batch`` with ``req`` computing only ``n`` tokens (a step cut short, for a test)."""
    k = batch.requests.index(req)
    batch.num_new_tokens[k] = n
    return batch


def test_with_chunked_prefill_a_short_request_is_not_charged_a_long_prompt_it_runs_beside():
    """With a long-prefill threshold T, a long prompt computes at most T tokens per step
    and a short request runs beside it, so only T x (the short one's steps) of the long
    prompt counts ahead of it: a deadline the short request meets is not shed, whatever
    the long prompt's length. Requests admitted earlier in the same step count the same
    way."""
    from kvmesh.cache_store.prefix_cache import PrefixCache
    from kvmesh.workers.scheduler import Scheduler

    s = Scheduler(PrefixCache(4096, BS), max_num_batched_tokens=1024, long_prefill_token_threshold=256,
                  shed_rate=lambda: 100.0, deadline_shed_factor=1.0)
    long = _sched_request("long", 20000, time.monotonic() + 1000)
    first = _sched_request("first", 300, time.monotonic() + 1000)  # two steps of 256: 512 of the long one
    fits = _sched_request("fits", 100, time.monotonic() + 4.5)  # (256 + 256 + 100) / 100 = 6.12 s > 4.5 s
    for r in (long, first, fits):
        s.add(r)
    batch = s.schedule()
    assert batch.requests[:2] == [long, first]
    assert [r for r, _ in batch.shed] == [fits]
    assert "after at least 512 tokens" in batch.shed[0][1], batch.shed[0][1]
    # a deadline that 256 + 256 + 100 tokens fit is served (the long prompt's 19,744 others do not count)
    served = _sched_request("served", 100, time.monotonic() + 9)
    s.add(served)
    batch = s.schedule()
    assert served in batch.requests and not batch.shed


@pytest.mark.parametrize("seed", range(6))
def test_the_tokens_counted_ahead_never_exceed_what_runs_before_the_first_token(seed):
    """`Scheduler._tokens_ahead` is a lower bound: replay random arrivals through the real
    scheduler (no model: each step's tokens count as computed, prompts are done when their
    last token is, decodes of 0-6 tokens follow) with small and large pools (preemption,
    blocks refused), several thresholds, budgets and partial-prefill limits, shared
    prefixes; for each request admitted, the tokens its estimate counted ahead must be at
    most those that requests running at its admission computed from then to its first
    token."""
    from kvmesh.cache_store.prefix_cache import PrefixCache
    from kvmesh.workers.scheduler import Scheduler

    rng = random.Random(seed)
    violations, checked = [], 0
    for trial in range(12):
        blocks = rng.choice([24, 40, 64, 256, 2048])
        budget = rng.choice([64, 256, 512, 1024])
        s = Scheduler(PrefixCache(blocks, BS), max_num_batched_tokens=budget,
                      long_prefill_token_threshold=rng.choice([0, 32, 64, None]),
                      max_num_partial_prefills=rng.choice([1, 2, 4]), shed_rate=lambda: 1e9,
                      deadline_shed_factor=1.0)
        counted: dict = {}  # request -> (estimate, ids running before it, tokens they computed so far)
        estimate = s._tokens_ahead

        def hopeless(req, ahead=None):
            before = estimate(req.num_prompt_tokens - req.num_computed, ahead) if ahead else 0
            # running now, or admitted earlier in this step: `schedule` appends to running as it admits
            counted[req] = [before, {id(r) for r in s.running}, 0]
            return None

        s._hopeless = hopeless
        prefixes = [prompt(1000 * seed + trial * 10 + k, rng.choice([16, 48, 96])) for k in range(3)]
        decodes: dict = {}
        steps = 0
        for step in range(400):
            if step < 60 and rng.random() < 0.5:
                most = min(blocks * BS // 2, 700)
                n = rng.randrange(8, most)
                ids = (rng.choice(prefixes) if rng.random() < 0.4 else []) + prompt(rng.randrange(10**6), n)
                ids = ids[:most]
                from kvmesh.cache_store.hashing import Namespace
                from kvmesh.workers.request import Request
                r = Request(f"r{step}", ids, GREEDY, Namespace("m"), BS, lambda o: None, deadline=time.monotonic() + 1e6)
                decodes[r] = rng.randrange(0, 7)
                s.add(r)
            if not s.has_work():
                if step >= 60:
                    break
                continue
            batch = s.schedule()
            steps += 1
            for r, n in zip(batch.requests, batch.num_new_tokens):
                for x, entry in counted.items():
                    if entry is not None and id(r) in entry[1]:
                        entry[2] += n
            s.update_after_step(batch)
            for r in list(batch.requests):
                if r.num_computed < r.num_tokens:
                    continue
                if r in counted and counted[r] is not None:  # its first token: compare
                    before, _, ran = counted[r]
                    checked += 1
                    if before > ran:
                        violations.append((trial, r.request_id, before, ran))
                    counted[r] = None
                if decodes[r] > 0:
                    decodes[r] -= 1
                    r.append_token(1)
                else:
                    s.remove(r, finished=True)
    assert checked > 50
    assert not violations, violations[:5]


def test_pressure_rises_on_misses_falls_on_requests_in_time_and_decays():
    from kvmesh.workers.scheduler import DeadlinePressure

    p = DeadlinePressure(up=2.0, down=0.5, most=8.0, half_life_s=10.0)
    t = 100.0
    assert p.value(t) == 1.0
    p.note(True, t)
    p.note(True, t)
    assert p.value(t) == pytest.approx(4.0)
    for _ in range(5):
        p.note(True, t)
    assert p.value(t) == pytest.approx(8.0)  # capped at `most`
    p.note(False, t)
    assert p.value(t) == pytest.approx(4.0)
    assert p.value(t + 10.0) == pytest.approx(2.0)  # log halves per half-life
    for _ in range(10):
        p.note(False, t + 10.0)
    assert p.value(t + 10.0) == 1.0  # never below the configured factor
    assert (p.misses, p.in_time) == (7, 11)
    with pytest.raises(ValueError):
        DeadlinePressure(up=1.0)


def test_admitted_requests_that_miss_raise_the_factor_and_ones_in_time_do_not():
    """The scheduler learns from how admitted requests with deadlines end: one aborted at
    or after its deadline is a miss, one that finished before it is in time, one aborted
    before it (its caller left) tells nothing. After misses, a deadline that the
    configured factor admits is shed, and the message says the factor was raised."""
    from kvmesh.cache_store.prefix_cache import PrefixCache
    from kvmesh.workers.scheduler import Scheduler

    s = Scheduler(PrefixCache(256, BS), max_num_batched_tokens=2048, shed_rate=lambda: 100.0,
                  deadline_shed_factor=1.0)

    def admit(rid: str, deadline: float):
        r = _sched_request(rid, 100, deadline)
        s.add(r)
        batch = s.schedule()
        assert batch.requests == [r] and not batch.shed
        return r

    pressure = s.deadline_pressure("")
    done = admit("done", time.monotonic() + 5)
    s.remove(done, finished=True)
    left = admit("left", time.monotonic() + 5)
    s.remove(left)  # aborted with time to spare: the caller went away
    broken = admit("broken", time.monotonic() + 5)
    broken.deadline = time.monotonic() - 0.001
    s.remove(broken, failed=True)  # the worker's failure (a step error, shutdown), late or not: not a miss
    assert (pressure.misses, pressure.in_time) == (0, 1) and pressure.value() == 1.0
    for i in range(8):
        late = admit(f"late{i}", time.monotonic() + 5)
        late.deadline = time.monotonic() - 0.001  # its caller's deadline has come
        s.remove(late)
    assert pressure.misses == 8 and pressure.value() > 5
    # 100 tokens at 100 tokens/s need 1 s: factor 1 admits a 3 s deadline, the raised one (> 5) does not
    r = _sched_request("after", 100, time.monotonic() + 3)
    s.add(r)
    batch = s.schedule()
    assert [x for x, _ in batch.shed] == [r]
    assert "--deadline-shed-factor 1 (raised" in batch.shed[0][1], batch.shed[0][1]
    # another caller's misses are not this caller's: the same deadline is admitted for it,
    # though both share one cache namespace (a shared salt)
    other = _sched_request("other", 100, time.monotonic() + 3, caller="b")
    s.add(other)
    batch = s.schedule()
    assert batch.requests == [other] and not batch.shed
    assert s.deadline_pressure("b").value() == 1.0


def test_an_idle_engine_serving_tight_deadlines_keeps_its_factor(engine):
    """Requests with tight but sufficient deadlines that finish in time never raise the
    factor: the pressure stays at 1 and every one is served, with the cold run's tokens."""
    ids = prompt(19, 300)
    engine.clear_cache()
    need = len(ids) / warm(engine)
    pressure = engine.scheduler.deadline_pressure("")
    before, in_time = pressure.misses, pressure.in_time
    outs = []
    for _ in range(5):
        engine.clear_cache()
        outs.append(submit(engine, ids, deadline=time.monotonic() + FACTOR * need * 4))
    assert all(not o["error"] for o in outs), outs
    assert pressure.misses == before
    assert pressure.in_time == in_time + 5  # the engine reports each finish in time
    assert engine.scheduler.deadline_pressure("").value() == pytest.approx(1.0)
    engine.clear_cache()
    cold = engine.generate(ids, GREEDY)
    assert all(o["token_ids"] == cold["token_ids"] for o in outs)


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
                               "--factors", "0", "--fixed-factors", "0.5"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["modes"]) == {"off", "shed 0", "fixed 0.5"}
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


def test_the_worker_passes_the_callers_identity_and_deadline_to_the_engine(monkeypatch):
    """Generate hands `Engine.submit` the caller's tenant (what deadline pressure is kept
    per), not the cache tenant, with the gRPC deadline. A router-forwarded request on a
    trusted port: the caller is ``caller_tenant``, the cache namespace ``tenant``. The
    engine is real; submit is wrapped to record what it was given."""
    import asyncio

    import grpc

    from kvmesh.proto import kvmesh_pb2 as pb
    from kvmesh.proto import kvmesh_pb2_grpc as pb_grpc
    from kvmesh.workers.server import WorkerServicer

    e = Engine(device=DEVICE, num_blocks=64, block_size=BS).start()
    seen = []
    real = e.submit

    def recording(*args, **kwargs):
        seen.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(e, "submit", recording)

    async def run():
        server = grpc.aio.server()
        pb_grpc.add_WorkerServicer_to_server(WorkerServicer(e, "w0"), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.WorkerStub(channel)
                request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt(21, 40)),
                                             sampling=pb.SamplingParams(max_tokens=2),
                                             tenant="shared-ns", caller_tenant="alice")
                return [m async for m in stub.Generate(request, timeout=60)]
        finally:
            await server.stop(None)

    try:
        sent = time.monotonic()
        messages = asyncio.run(run())
    finally:
        e.stop()
    assert messages and seen
    assert seen[0]["caller"] == "alice" and seen[0]["tenant"] == "shared-ns"
    assert sent + 50 < seen[0]["deadline"] <= sent + 61  # the call's 60 s deadline, on the monotonic clock
