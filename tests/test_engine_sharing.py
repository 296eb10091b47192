"""In-flight prefix sharing and fair scheduling of long prefills (workers.scheduler), on a real engine."""
from __future__ import annotations

import random
import threading
import time

import pytest

from kvmesh.cache_store.tier_store import TierConfig
from kvmesh.workers.engine import Engine
from tests._device import DEVICE
from kvmesh.workers.request import RequestOutput, SamplingParams
from kvmesh.workers.scheduler import Scheduler

BLOCK = 32
PREFIX = 384
SUFFIX = 128
GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)


def _toks(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(256) for _ in range(n)]


class _Collector:
    """Collects one request's outputs, the monotonic time of its first token and, given the
    engine, the index of the engine step that produced it (``Engine.steps`` during that step)."""

    def __init__(self, engine: Engine | None = None) -> None:
        self.engine = engine
        self.tokens: list[int] = []
        self.first: float | None = None
        self.first_step: int | None = None
        self.usage: dict | None = None
        self.timing: dict | None = None
        self.done = threading.Event()

    def __call__(self, out: RequestOutput) -> None:
        if out.new_token_ids and self.first is None:
            self.first = time.monotonic()
            self.first_step = self.engine.steps if self.engine is not None else None
        self.tokens.extend(out.new_token_ids)
        if out.finished:
            assert not out.error, out.error
            self.usage, self.timing = out.usage, out.timing
            self.done.set()


@pytest.fixture(scope="module")
def engine():
    eng = Engine(device=DEVICE, block_size=BLOCK, num_blocks=512, max_num_batched_tokens=1024)
    yield eng
    eng.stop()


def test_concurrent_same_prefix_computes_prefix_once(engine):
    rng = random.Random(12)
    prefix = _toks(rng, PREFIX)
    prompts = [prefix + _toks(rng, SUFFIX) for _ in range(8)]
    engine.stop()
    engine.clear_cache()
    outs = [_Collector() for _ in prompts]
    for p, c in zip(prompts, outs):  # all queued before the step loop runs: admitted together
        engine.submit(p, GREEDY, c)
    engine.start()
    for c in outs:
        assert c.done.wait(120)
    cached = sorted(c.usage["cached_tokens"] for c in outs)
    assert cached == [0] + [PREFIX] * 7, cached
    assert sum(c.usage["computed_prefill_tokens"] for c in outs) == 8 * (PREFIX + SUFFIX) - 7 * PREFIX

    # every output equals its cold run (empty cache, request alone)
    for p, c in zip(prompts, outs):
        engine.clear_cache()
        cold = engine.generate(p, GREEDY)
        assert cold["usage"]["cached_tokens"] == 0
        assert cold["token_ids"] == c.tokens
    engine.check_integrity()


def test_different_prefixes_do_not_wait(engine):
    """Negative control: requests that share no block are all computed in the first step."""
    rng = random.Random(13)
    engine.stop()
    engine.clear_cache()
    outs = [_Collector() for _ in range(3)]
    for c in outs:
        engine.submit(_toks(rng, 200), GREEDY, c)
    steps0 = engine.steps
    engine.step()
    assert all(c.first is not None for c in outs)  # one step prefilled all three
    assert engine.steps == steps0 + 1
    engine.start()
    for c in outs:
        assert c.done.wait(60)
        assert c.usage["cached_tokens"] == 0


def _long_and_short(threshold: int) -> tuple[_Collector, _Collector, int]:
    """A 4,096-token prompt, then a 4-token one sent once the long prefill has started.

    Returns the two collectors and the engine's step index when the short request was sent
    (the step then running, or the next one). Waits are counted in engine steps, not seconds,
    so a busy machine slows every step alike and cannot change the outcome.
    """
    eng = Engine(device=DEVICE, block_size=BLOCK, num_blocks=256, max_num_batched_tokens=512,
                 long_prefill_token_threshold=threshold)
    try:
        rng = random.Random(14)
        long_c, short_c = _Collector(eng), _Collector(eng)
        eng.submit(_toks(rng, 4096), SamplingParams(max_tokens=1), long_c)
        eng.step()  # the long prefill's first chunk (alone: the whole budget)
        eng.start()
        sent = eng.steps
        eng.submit(_toks(rng, 4), SamplingParams(max_tokens=1), short_c)
        assert long_c.done.wait(120) and short_c.done.wait(120)
        return long_c, short_c, sent
    finally:
        eng.stop()


def test_short_request_not_queued_behind_long_prefill():
    long_c, short_c, sent = _long_and_short(threshold=64)
    assert long_c.usage["prompt_tokens"] == 4096
    assert short_c.first < long_c.first  # answered while the long prompt is still in prefill
    # admitted at the next step at the latest: the step running when it was sent, or the next
    assert short_c.first_step - sent <= 1, (short_c.first_step, sent)
    # while the long prompt still needs 3,584 tokens: at most 64 of them (the threshold) go
    # beside the short one, and the rest at 512 per step (the budget) take 6 more steps
    assert long_c.first_step - sent >= (4096 - 512 - 2 * 64) // 512, (long_c.first_step, sent)


def test_without_threshold_short_request_waits_for_long_prefill():
    """Control: with the cap off, the long prompt takes every step's whole budget."""
    long_c, short_c, _ = _long_and_short(threshold=0)
    assert short_c.first >= long_c.first
    assert short_c.first_step >= long_c.first_step


def test_scheduler_rejects_bad_limits(engine):
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        Scheduler(engine.cache, long_prefill_token_threshold=-1)
    with pytest.raises(ValueError, match="max_num_partial_prefills"):
        Scheduler(engine.cache, max_num_partial_prefills=0)


def test_worker_flags_parse_and_name_themselves(capsys):
    from kvmesh.services.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["worker", "--port", "1", "--long-prefill-token-threshold", "128",
                              "--max-num-partial-prefills", "3"])
    assert (args.long_prefill_token_threshold, args.max_num_partial_prefills) == (128, 3)
    defaults = parser.parse_args(["worker", "--port", "1"])
    assert defaults.long_prefill_token_threshold is None and defaults.max_num_partial_prefills == 2
    threshold = "--long-prefill-token-threshold"
    for argv, flag in ((["worker", "--port", "1", threshold, "-1"], threshold),
                       (["worker", "--port", "1", "--max-num-partial-prefills", "0"], "--max-num-partial-prefills"),
                       (["worker", "--port", "1", "--max-num-partial-prefills", "two"], "--max-num-partial-prefills")):
        with pytest.raises(SystemExit) as exc:
            parser.parse_args(argv)
        assert exc.value.code == 2
        assert flag in capsys.readouterr().err


def test_default_threshold_is_a_quarter_of_the_budget(engine):
    assert Scheduler(engine.cache, max_num_batched_tokens=2048).long_prefill_token_threshold == 512
    assert Scheduler(engine.cache, long_prefill_token_threshold=0).long_prefill_token_threshold == 0


def _prompt_tokens_computed(eng: Engine) -> dict[str, int]:
    """Wrap ``eng``'s scheduler so that it counts, per request id, the prompt tokens each step
    really computes (the truth that usage's ``computed_prefill_tokens`` must report)."""
    counted: dict[str, int] = {}
    sched = eng.scheduler
    inner = sched.update_after_step

    def update(batch):
        for req, n in zip(batch.requests, batch.num_new_tokens):
            done = max(0, min(req.num_computed + n, req.num_prompt_tokens) - req.num_computed)
            counted[req.request_id] = counted.get(req.request_id, 0) + done
        return inner(batch)

    sched.update_after_step = update
    return counted


def _step_until(eng: Engine, collectors: list[_Collector], limit: int = 500) -> None:
    for _ in range(limit):
        if all(c.done.is_set() for c in collectors):
            return
        eng.step()
    raise AssertionError("requests did not finish")


def _assert_equals_cold(eng: Engine, prompt: list[int], tokens: list[int]) -> None:
    """``tokens`` are what ``prompt`` gives cold: an empty cache, the request alone."""
    eng.clear_cache()
    cold = _Collector(eng)
    eng.submit(prompt, GREEDY, cold)
    _step_until(eng, [cold])
    assert cold.usage["cached_tokens"] == 0 and cold.tokens == tokens


def test_usage_is_the_cached_prefix_of_the_attempt_that_ran():
    """A waiting request passed over (here by the partial-prefill limit) is matched again
    when it is admitted; its usage must report that match, not the first one, whose
    blocks a long prefill evicted meanwhile. Checked against the prompt tokens the steps
    really computed, and its output against a cold run."""
    rng = random.Random(15)
    prefix = _toks(rng, 8 * BLOCK)
    prompt_a = prefix + _toks(rng, 300)
    long_prompt = _toks(rng, 2200)  # 69 blocks: its growth evicts most of the prefix's 8
    eng = Engine(device=DEVICE, block_size=BLOCK, num_blocks=72, max_num_batched_tokens=512,
                 long_prefill_token_threshold=64, max_num_partial_prefills=1)
    try:
        warm = _Collector(eng)
        eng.submit(prefix + [1], GREEDY, warm)
        _step_until(eng, [warm])
        counted = _prompt_tokens_computed(eng)
        long_c, a_c = _Collector(eng), _Collector(eng)
        long_id = eng.submit(long_prompt, SamplingParams(max_tokens=1), long_c)
        a_id = eng.submit(prompt_a, GREEDY, a_c)
        eng.step()
        assert a_c.first is None and a_id not in counted  # passed over: the long prompt holds the one partial slot
        _step_until(eng, [long_c, a_c])
        assert counted[long_id] == len(long_prompt)
        usage = a_c.usage
        assert usage["computed_prefill_tokens"] == counted[a_id], (usage, counted[a_id])
        assert usage["cached_tokens"] == len(prompt_a) - counted[a_id]
        assert sum(usage["cached_tokens_by_tier"].values()) == usage["cached_tokens"]
        assert usage["cached_tokens"] < len(prefix)  # the prefix was evicted in part: the case under test
        _assert_equals_cold(eng, prompt_a, a_c.tokens)
    finally:
        eng.stop()


def test_a_tier_load_by_an_attempt_passed_over_is_reported_by_its_tier():
    """An attempt that loads a prefix from the host tier and is then passed over (the
    partial-prefill limit) leaves the loaded blocks in the device pool; the admitted attempt
    finds them there, but the load was this request's: usage reports them as host."""
    bs = 16
    block_bytes = 4 * 2 * 2 * bs * 64 * 4  # built-in model, float32
    rng = random.Random(16)
    prefix = _toks(rng, 8 * bs)
    prompt_a = prefix + _toks(rng, 40)
    eng = Engine(device=DEVICE, block_size=bs, num_blocks=160, max_num_batched_tokens=256,
                 long_prefill_token_threshold=32, max_num_partial_prefills=1,
                 tiers=TierConfig(host_bytes=256 * block_bytes, load_policy="always"))
    try:
        warm = _Collector(eng)
        eng.submit(prefix + [1], GREEDY, warm)
        _step_until(eng, [warm])
        assert eng.offload_device_cache() > 0  # the prefix is on the host tier only
        counted = _prompt_tokens_computed(eng)
        long_c, a_c = _Collector(eng), _Collector(eng)
        eng.submit(_toks(rng, 600), SamplingParams(max_tokens=1), long_c)
        a_id = eng.submit(prompt_a, GREEDY, a_c)
        eng.step()
        assert a_c.first is None and a_id not in counted  # passed over, after loading its prefix
        _step_until(eng, [long_c, a_c])
        usage = a_c.usage
        assert usage["cached_tokens_by_tier"]["host"] == len(prefix), usage
        assert usage["cached_tokens_by_tier"]["device"] == 0, usage
        assert usage["computed_prefill_tokens"] == counted[a_id] == len(prompt_a) - len(prefix)
        _assert_equals_cold(eng, prompt_a, a_c.tokens)
    finally:
        eng.stop()
