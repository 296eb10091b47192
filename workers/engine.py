"""The worker's inference engine: model + paged KV pool + prefix cache + scheduler.

`Engine` validates requests at the edge, queues them, and runs a step loop on its own
thread (`start`). Each step: the scheduler picks work under a token budget, the model
runs one forward over all scheduled tokens (continuous batching, chunked prefill),
requests whose prompt is fully computed sample a token, and full blocks enter the
prefix cache. Outputs go to each request's ``on_output`` callback on the engine thread;
the gRPC layer forwards them to asyncio.

Tests and benchmarks may instead call `generate` (blocking) on a started engine, or
drive `step()` directly on a stopped one.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import math
import logging
import threading
import time
from collections import deque
from typing import Callable

import torch

from kvmesh.cache_store.block_record import ZERO_HASH, RecordMeta, checksum, dtype_name
from kvmesh.cache_store.events import MEDIUMS
from kvmesh.cache_store.fresh_thread import run_on_fresh_thread
from kvmesh.cache_store.hashing import Namespace, hash_blocks
from kvmesh.cache_store.kv_codec import codec_of_rank
from kvmesh.cache_store.prefix_cache import PrefixCache
from kvmesh.cache_store.tier_store import TierConfig, TierStore
from kvmesh.workers import limits, model_identity
from kvmesh.workers.loader import load_model
from kvmesh.workers.model import AttentionMetadata, allocate_kv_cache
from kvmesh.workers.request import (
    DEFAULT_DEADLINE_SHED_FACTOR,
    InvalidRequest,
    Overloaded,
    Request,
    RequestOutput,
    SamplingParams,
)
from kvmesh.workers.scheduler import DEFAULT_MAX_NUM_PARTIAL_PREFILLS, ScheduledBatch, Scheduler
from kvmesh.workers.tokenizer import load_tokenizer

log = logging.getLogger(__name__)


class StepClock:
    """Times model steps on their device without waiting for it.

    On CPU a step's time is the wall time of its forward call. CUDA kernels run
    asynchronously, so timing the call would measure their launch, not their compute, and
    the prefill rates built on it (tier weights, the tier load policy, deadline shedding)
    would read far high; a synchronize would make the host stop overlapping the next
    step's scheduling with the device. Instead a pair of CUDA events is recorded around
    the step on its stream (`torch.cuda.Event`, ``enable_timing=True``), and the time
    between them is read once the second has completed, at a later `stop` or `poll`.
    Events also leave out work queued on the stream before the step (tier copies).

    ``stop(start, done)`` calls ``done(seconds, at)`` now on CPU, later on CUDA. Engine
    thread.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self._pending: collections.deque = collections.deque()

    def start(self):
        """A mark for `stop`: a CUDA event recorded on the device's current stream (the
        engine's device, not the thread's: ``cuda:1`` included), or `time.perf_counter()`
        seconds."""
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(torch.cuda.current_stream(self.device))
            return ev
        return time.perf_counter()

    def stop(self, started, done: Callable[[float, float], None]) -> None:
        """The step begun at ``started`` was queued in full: ``done(seconds, at)`` once it
        ran, ``at`` being `time.monotonic()` when it was queued (when it ran, near enough),
        not when it is reported."""
        at = time.monotonic()
        if not self.cuda:
            done(time.perf_counter() - started, at)
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record(torch.cuda.current_stream(self.device))
        self._pending.append((started, end, done, at))
        self.poll()

    def poll(self) -> None:
        """Report the steps whose end event has completed, oldest first."""
        while self._pending and self._pending[0][1].query():
            started, end, done, at = self._pending.popleft()
            done(started.elapsed_time(end) / 1000.0, at)  # elapsed_time is in milliseconds


class Engine:
    """A single-model inference engine with prefix caching.

    Args:
        model_dir: local HF-format directory (config.json + *.safetensors), or None for
            the built-in tiny Llama with seeded random weights.
        device: torch device name ("cpu", "cuda", "cuda:1").
        block_size: tokens per KV block.
        num_blocks: blocks in the device pool (KV memory = num_blocks x
            `kv_bytes_per_block`).
        max_num_batched_tokens: token budget of one step.
        max_num_seqs: most requests running at once.
        max_waiting: most queued requests; beyond it `submit` raises `Overloaded`.
        max_model_len: context limit in tokens (default: the model's
            ``max_position_embeddings``, lowered to ``num_blocks * block_size`` when the
            pool holds less; more than either is an error, not capped).
        event_sink: receives KV events (BlockStored/BlockRemoved/AllBlocksCleared), from
            the engine thread and, for disk-tier changes, the disk writer thread.
        seed: seed of the built-in model's random weights.
        tiers: host / disk / peer-staging tiers below the device pool
            (`cache_store.tier_store.TierConfig`); None for the device pool only.
        long_prefill_token_threshold, max_num_partial_prefills: fair scheduling of long
            prefills (`workers.scheduler.Scheduler`; threshold None = a quarter of the budget).
        deadline_shed_factor: how sure the scheduler must be that a request with a deadline
            (`submit`) misses it before it sheds the request instead of computing its prompt
            (`workers.scheduler.Scheduler`; 0 = only requests already past it).

    Raises:
        ValueError: bad sizes or tier configuration, or ``max_model_len`` above the model's
            ``max_position_embeddings`` (`workers.limits.resolve_max_model_len`) or above
            what the pool holds (`workers.limits.fit_max_model_len_to_pool`).
    """

    def __init__(
        self,
        model_dir: str | None = None,
        device: str = "cpu",
        block_size: int = 16,
        num_blocks: int = 4096,
        max_num_batched_tokens: int = 1024,
        max_num_seqs: int = 32,
        max_waiting: int = 512,
        max_model_len: int | None = None,
        event_sink: Callable[[object], None] | None = None,
        seed: int = 0,
        tiers: TierConfig | None = None,
        long_prefill_token_threshold: int | None = None,
        max_num_partial_prefills: int = DEFAULT_MAX_NUM_PARTIAL_PREFILLS,
        compute_dtype: str = "auto",
        deadline_shed_factor: float = DEFAULT_DEADLINE_SHED_FACTOR,
    ):
        for name, value in (("block_size", block_size), ("num_blocks", num_blocks),
                            ("max_num_batched_tokens", max_num_batched_tokens), ("max_num_seqs", max_num_seqs),
                            ("max_waiting", max_waiting)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1 (got {value})")
        if tiers is not None:
            tiers.validate()  # before the model loads: a bad flag fails fast
        self.device = torch.device(device)
        self.model_dir = model_dir
        # Loaded on a short-lived thread: an OpenMP thread team stays with every thread that
        # ran a parallel torch op, and an idle team on the caller's (long-lived) thread made
        # each of the engine thread's steps after an idle gap ~1.5x slower on a 2-core box
        # (`cache_store.fresh_thread`).
        self.config, self.model = run_on_fresh_thread(lambda: load_model(model_dir, device=device, seed=seed))
        self.compute_dtype = model_identity.resolve_compute_dtype(compute_dtype, self.config.dtype, str(self.device))
        self._compute_auto = compute_dtype == "auto"
        if self.compute_dtype != self.config.dtype:  # weights upcast once; the KV pool keeps config.dtype
            run_on_fresh_thread(lambda: self.model.to(getattr(torch, self.compute_dtype)))
        self.model.eval()
        #: The id this worker's KV is hashed and advertised under (`model_identity.kv_model_id`).
        self.kv_model_id = model_identity.kv_model_id(self.config.model_id, self.config.dtype, self.compute_dtype)
        self.tokenizer = load_tokenizer(model_dir, self.config)
        self.block_size = block_size
        self.num_blocks = num_blocks
        model_len = limits.resolve_max_model_len(max_model_len, self.config.max_position_embeddings)
        self.max_model_len = limits.fit_max_model_len_to_pool(model_len, max_model_len, num_blocks, block_size)
        #: True when the model's own context was lowered to what the KV pool holds.
        self.pool_capped = self.max_model_len < model_len
        self.max_waiting = max_waiting
        self.kv_cache = run_on_fresh_thread(lambda: allocate_kv_cache(self.config, num_blocks, block_size, self.device))
        #: What computes this worker's KV (`model_identity.kv_producer`): KV is exchanged (remote
        #: tier, peer fetch) only between workers with equal producers.
        self.kv_producer = model_identity.kv_producer(str(self.device), self._attention_path())
        if tiers is not None and tiers.enabled:
            tiers = dataclasses.replace(tiers, producer=model_identity.producer_tag(self.kv_producer))
        self.tiers = TierStore(self.kv_cache, tiers, event_sink) if tiers is not None and tiers.enabled else None
        offload = self.tiers.offload if self.tiers is not None and self.tiers.can_offload else None
        # a block cached in a lossy copy is replaced by an exact (or less lossy) one computed later
        self.cache = PrefixCache(num_blocks, block_size, event_sink=event_sink, on_offload=offload,
                                 row_rank=self.tiers.row_loss.__getitem__ if self.tiers is not None else None)
        self.scheduler = Scheduler(self.cache, max_num_batched_tokens, max_num_seqs, tiers=self.tiers,
                                   long_prefill_token_threshold=long_prefill_token_threshold,
                                   max_num_partial_prefills=max_num_partial_prefills,
                                   prefill_rate=lambda: self._prefill_rate,
                                   deadline_shed_factor=deadline_shed_factor,
                                   shed_rate=self.peak_prefill_rate)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids or ())
        self._ids = itertools.count()
        self._requests: dict[str, Request] = {}
        self._inbox: deque[tuple[str, object]] = deque()
        self._cv = threading.Condition()
        self._lock = threading.RLock()  # guards scheduler/cache state across threads
        self._thread: threading.Thread | None = None
        self._stop = False
        self.steps = 0
        #: prompt tokens computed by model steps so far (tokens; cached ones not counted)
        self.computed_prompt_tokens = 0
        #: Called under the engine lock when a snapshot is taken; returns the sequence
        #: number of the last KV event batch the snapshot reflects (the publisher's).
        self.snapshot_seq_fn: Callable[[], int] | None = None
        #: EWMA of prefill throughput measured on this engine's own steps (tokens/s), None
        #: until measured; see `prefill_tokens_per_s`.
        self._prefill_rate: float | None = None
        #: ``(time.monotonic(), tokens/s)`` of the latest measured steps (`peak_prefill_rate`)
        self._rate_samples: collections.deque[tuple[float, float]] = collections.deque(maxlen=self.PEAK_RATE_SAMPLES)
        #: how long each step runs on the device (`StepClock`): CUDA steps by events, read
        #: once they complete, so timing never waits for the device
        self.step_clock = StepClock(self.device)
        if self.tiers is not None:  # tier loads timed the same way (its own queue of events)
            self.tiers.clock = StepClock(self.device)
        #: Optional observer of every sampled logits row ``[vocab_size]`` (float32), called
        #: on the engine thread with the request id; tests use it to compare cold and hit runs.
        self.logits_hook: Callable[[str, torch.Tensor], None] | None = None
        #: Load as of the last scheduling step, replaced whole by the engine thread and read
        #: without the engine lock (see `load`): control-plane reads never wait on a model step.
        self._load_snapshot: dict = self._count_load()

    # ------------------------------------------------------------------ edge
    def namespace(self, cache_salt: str = "", adapter_id: str = "", tenant: str = "") -> Namespace:
        """The hash namespace of requests under this model, tenant, cache salt and adapter."""
        return Namespace(model_id=self.kv_model_id, cache_salt=cache_salt, adapter_id=adapter_id, tenant=tenant)

    def describe(self) -> str:
        """One line on how this engine computes: KV id, weight/compute/pool dtypes, attention path."""
        attention = self._attention_path()
        why = ""
        if self._compute_auto and self.compute_dtype != self.config.dtype:
            why = (" (auto: so that a cached prefix gives the cold run's tokens; --compute-dtype model keeps "
                   f"{self.config.dtype}, faster where its GEMMs are, e.g. with AMX)")
        elif self.compute_dtype in ("bfloat16", "float16"):
            why = (f" (a {self.compute_dtype} forward rounds with the rows per step: a cached prefix may change an "
                   "output; --compute-dtype float32 on a CPU where it must not)")
        return (f"model {self.kv_model_id}, {self.config.dtype} checkpoint computed in {self.compute_dtype}{why}, "
                f"{str(self.kv_cache.dtype).replace('torch.', '')} KV pool, attention: {attention}")

    def _attention_path(self) -> str:
        from kvmesh.workers import attn_kernel

        if self.device.type == "cpu" and self.model.attention_backend != "torch":
            return attn_kernel.describe_path(getattr(torch, self.compute_dtype), self.kv_cache.dtype,
                                             self.config.head_dim, self.block_size)
        return "torch SDPA"

    @property
    def context_owner(self) -> tuple[str, str]:
        """Whose context ``max_model_len`` is, and why, for error messages: ("the model", "")
        or, when the pool lowered it, ("this worker", " (what its KV pool of N blocks holds)")."""
        if self.pool_capped:
            return "this worker", f" (what its KV pool of {self.num_blocks} blocks holds)"
        return "the model", ""

    def validate(self, prompt_ids: list[int], sampling: SamplingParams) -> None:
        """Check a request before queueing it.

        Raises:
            InvalidRequest: empty prompt, a token id outside [0, vocab_size), max_tokens
                < 1, temperature < 0, top_p outside [0, 1], a prompt of max_model_len
                tokens or more, or a prompt plus ``max_tokens`` over max_model_len (as
                vLLM's server refuses it; max_model_len is at most what the pool holds, so
                a request that passes fits the pool alone).
            Overloaded: the queue is full.
        """
        vocab = self.config.vocab_size
        if not prompt_ids:
            raise InvalidRequest("prompt is empty: send at least one token or non-empty text")
        if len(prompt_ids) >= self.max_model_len:  # before the per-token scan: cheap for huge prompts
            raise InvalidRequest(
                f"prompt has {len(prompt_ids)} tokens but {self.context_owner[0]}'s context is {self.max_model_len} "
                f"tokens{self.context_owner[1]}: "
                f"shorten it to at most {self.max_model_len - 1} tokens")
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            bad = next(t for t in prompt_ids if t < 0 or t >= vocab)
            raise InvalidRequest(f"token id {bad} is out of range: ids must be in [0, {vocab}) for model "
                                 f"{self.config.model_id}")
        if sampling.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be >= 1 (got {sampling.max_tokens})")
        limits.check_completion_room(len(prompt_ids), sampling.max_tokens, self.max_model_len,
                                     *self.context_owner)
        if not (math.isfinite(sampling.temperature) and sampling.temperature >= 0):
            raise InvalidRequest(f"temperature must be a finite number >= 0 (got {sampling.temperature})")
        if not 0.0 <= sampling.top_p <= 1.0:  # also false for NaN
            raise InvalidRequest(f"top_p must be in [0, 1] (got {sampling.top_p})")
        if len(self.scheduler.waiting) + len(self._inbox) >= self.max_waiting:
            raise Overloaded(f"queue is full ({self.max_waiting} waiting requests): retry later or use another worker")

    def submit(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        on_output: Callable[[RequestOutput], None],
        cache_salt: str = "",
        adapter_id: str = "",
        request_id: str = "",
        arrival: float | None = None,
        tenant: str = "",
        deadline: float | None = None,
        caller: str = "",
    ) -> str:
        """Validate and queue a request; returns its id. Thread-safe.

        ``tenant`` (resolved by the server from credentials), ``cache_salt`` and
        ``adapter_id`` choose the request's hash namespace (`namespace`).
        ``arrival`` (``time.monotonic()`` seconds) is when the request reached the worker,
        if earlier than now (e.g. before a peer fetch); timing is measured from it.
        ``deadline`` (``time.monotonic()`` seconds; None: none) is when the caller stops
        waiting: a request that cannot reach its first token by then is shed before its
        prefill, its output an error with code DEADLINE_EXCEEDED (``deadline_shed_factor``).
        ``caller`` (the server's caller identity) is whose deadline outcomes it counts
        towards (`workers.scheduler.DeadlinePressure`); "" for callers not told apart.

        Raises:
            InvalidRequest, Overloaded: see `validate`.
        """
        prompt_ids = [int(t) for t in prompt_ids]
        self.validate(prompt_ids, sampling)
        rid = f"{request_id or 'req'}#{next(self._ids)}"  # unique even if a client repeats its id
        req = Request(rid, prompt_ids, sampling, self.namespace(cache_salt, adapter_id, tenant),
                      self.block_size, on_output)
        if arrival is not None:
            req.arrival = min(arrival, req.arrival)
        req.deadline = deadline
        req.caller = caller
        with self._cv:
            self._inbox.append(("add", req))
            self._cv.notify()
        return rid

    def abort(self, request_id: str) -> None:
        """Stop a request (client went away) and free its blocks. Thread-safe."""
        with self._cv:
            self._inbox.append(("abort", request_id))
            self._cv.notify()

    # ------------------------------------------------------------ engine loop
    def start(self) -> "Engine":
        """Run the step loop on a daemon thread."""
        if self._thread is None:
            self._stop = False
            self._thread = threading.Thread(target=self._loop, name="kvmesh-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the loop; queued and running requests fail with UNAVAILABLE.

        With a disk tier, the device pool's cached blocks are then offloaded to the host
        tier, and `TierStore.close` writes the host tier's blocks that have no disk copy yet
        (in either write mode) and lets queued disk writes finish: 10 s to queue and wait
        (what is not queued then is logged), then up to 10 s more for each writer thread
        (disk, remote) to finish what it holds; so a restart on the same directory starts
        warm. The engine thread itself is given up to 30 s to leave its step.
        """
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        with self._lock:
            self._drain_inbox()
            for req in list(self._requests.values()):
                self._fail(req, "worker is shutting down", "UNAVAILABLE")
        if self.tiers is not None:
            if self.tiers.disk is not None or self.tiers.remote is not None:
                # keep what the device pool cached: on disk for a restart, remotely for the cluster
                with self._lock:
                    self.cache.evict_unused()
            self.tiers.close()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stop and not self._inbox and not self.scheduler.has_work():
                    self._cv.wait()
                if self._stop:
                    return
            try:
                self.step()
            except Exception:  # never let the engine thread die behind a healthy server
                log.exception("engine step failed; failing in-flight requests")
                with self._lock:
                    for req in list(self._requests.values()):
                        self._fail(req, "engine step failed; see the worker log", "INTERNAL")

    def _drain_inbox(self) -> None:
        while True:
            with self._cv:
                if not self._inbox:
                    return
                kind, item = self._inbox.popleft()
            if kind == "add":
                self._requests[item.request_id] = item
                self.scheduler.add(item)
            elif kind == "abort":
                req = self._requests.pop(item, None)
                if req is not None:
                    self.scheduler.remove(req)

    def step(self) -> int:
        """Run one scheduling step and model forward. Returns tokens computed."""
        with self._lock:
            try:
                return self._step_locked()
            finally:
                self._load_snapshot = self._count_load()

    def _step_locked(self) -> int:
        self._drain_inbox()
        batch = self.scheduler.schedule()
        for req, why in batch.shed:  # before any compute: the caller would be gone by its first token
            self._fail(req, why, "DEADLINE_EXCEEDED")
        self._load_snapshot = self._count_load()  # what the forward below is busy with
        if not batch:
            return 0
        try:
            prompt_tokens = self._step_prompt_tokens(batch)  # before num_computed advances
            started = self.step_clock.start()
            logits = self._forward(batch)
            self.step_clock.stop(started, lambda seconds, at: self._note_step_rate(prompt_tokens, seconds, at))
        except Exception as exc:  # keep the worker up; fail what was in flight
            log.exception("model step failed")
            for req in list(batch.requests):
                self._fail(req, f"model step failed: {exc}", "INTERNAL")
            return 0
        self.computed_prompt_tokens += sum(min(n, max(0, r.num_prompt_tokens - r.num_computed))
                                           for r, n in zip(batch.requests, batch.num_new_tokens))
        self.scheduler.update_after_step(batch)
        self._sample_and_emit(batch, logits)
        self.steps += 1
        return batch.num_tokens

    @torch.inference_mode()
    def _forward(self, batch: ScheduledBatch) -> torch.Tensor:
        ids: list[int] = []
        pos: list[int] = []
        logits_rows: list[int] = []
        for req, n in zip(batch.requests, batch.num_new_tokens):
            start = req.num_computed
            ids.extend(req.token_ids[start:start + n])
            pos.extend(range(start, start + n))
            if start + n == req.num_tokens:
                logits_rows.append(len(ids) - 1)
        meta = AttentionMetadata.build(
            query_lens=list(batch.num_new_tokens),
            context_lens=[r.num_computed for r in batch.requests],
            block_tables=[r.block_table for r in batch.requests],
            block_size=self.block_size,
            device=self.device,
        )
        dev = self.device
        return self.model(
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.tensor(pos, dtype=torch.long, device=dev),
            meta,
            self.kv_cache,
            torch.tensor(logits_rows, dtype=torch.long, device=dev),
        ).float()

    #: Smoothing of the prefill-rate EWMA (weight of the newest sample).
    RATE_ALPHA = 0.25
    #: Steps with fewer prompt tokens than this do not update the prefill rate (decode-bound).
    RATE_MIN_TOKENS = 64

    @staticmethod
    def _step_prompt_tokens(batch: ScheduledBatch) -> int:
        """Prompt tokens the step computes (before ``num_computed`` advances)."""
        return sum(k for r, k in zip(batch.requests, batch.num_new_tokens) if r.num_computed < r.num_prompt_tokens)

    def _note_step_rate(self, n: int, seconds: float, at: float | None = None) -> None:
        """Fold one step of ``n`` prompt tokens that took ``seconds`` on the device, run at
        ``at`` (`time.monotonic()`; None: now), into the prefill-rate EWMA and the peak
        rate's samples.

        Only prompt tokens count; a step that also decodes charges its whole time to them,
        which errs towards a slower rate (more fetching, never less).
        """
        if n < self.RATE_MIN_TOKENS or seconds <= 0:
            return
        rate = n / seconds
        old = self._prefill_rate
        self._prefill_rate = rate if old is None else old + self.RATE_ALPHA * (rate - old)
        self._rate_samples.append((time.monotonic() if at is None else at, rate))

    #: Steps whose rates `peak_prefill_rate` keeps (the newest), how recent they must be
    #: (seconds), how many of them there must be, and how recent the newest must be
    #: (seconds), before it answers.
    PEAK_RATE_SAMPLES = 32
    PEAK_RATE_MAX_AGE_S = 60.0
    PEAK_RATE_MIN_SAMPLES = 4
    PEAK_RATE_STALE_S = 5.0

    def peak_prefill_rate(self) -> float | None:
        """The fastest prefill rate (tokens/s) of the last ``PEAK_RATE_SAMPLES`` measured steps
        that ran in the last ``PEAK_RATE_MAX_AGE_S`` seconds; None with fewer than
        ``PEAK_RATE_MIN_SAMPLES`` of them, or when no step was measured in the last
        ``PEAK_RATE_STALE_S`` seconds.

        Optimistic where `prefill_tokens_per_s` is cautious, for deadline shedding, which
        must not drop a request that could have made it: one slow step (a cold first pass,
        a step full of decodes, a noisy neighbour) does not lower it. Shed requests run no
        steps, so samples from a slow spell would otherwise stay until they age out, and
        every tight-deadline request meanwhile be shed: with no fresh sample the answer is
        None, shedding on the estimate pauses, and the next request admitted measures the
        engine again (a probe, at most ``PEAK_RATE_STALE_S`` seconds after the last step).
        Engine thread (the scheduler), or any thread for a reading.
        """
        now = time.monotonic()
        samples = list(self._rate_samples)
        if not samples or now - samples[-1][0] > self.PEAK_RATE_STALE_S:
            return None
        recent = [rate for t, rate in samples if t >= now - self.PEAK_RATE_MAX_AGE_S]
        return max(recent) if len(recent) >= self.PEAK_RATE_MIN_SAMPLES else None

    def prefill_tokens_per_s(self) -> float:
        """Measured prefill throughput (tokens/s): an EWMA over steps of at least
        ``RATE_MIN_TOKENS`` new tokens. Before any such step, measured once with a
        256-token forward pass on a scratch KV tensor (the pool is not touched).
        Thread-safe; may block for that one forward pass.
        """
        if self._prefill_rate is None:
            with self._lock:
                if self._prefill_rate is None:
                    self._prefill_rate = self._calibrate_prefill()
        return self._prefill_rate

    @torch.inference_mode()
    def _calibrate_prefill(self, num_tokens: int = 256) -> float:
        n = max(1, min(num_tokens, self.max_model_len - 1))
        blocks = -(-n // self.block_size)
        scratch = allocate_kv_cache(self.config, blocks, self.block_size, self.device, self.kv_cache.dtype)
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, self.config.vocab_size, (n,), generator=gen).to(self.device)
        pos = torch.arange(n, device=self.device)
        meta = AttentionMetadata.build([n], [0], [list(range(blocks))], self.block_size, self.device)
        best = float("inf")
        for _ in range(2):  # the first pass pays one-off allocation costs
            t0 = time.perf_counter()
            self.model(ids, pos, meta, scratch)
            if self.device.type == "cuda":  # once, before serving: time the kernels, not their launch
                torch.cuda.synchronize(self.device)
            best = min(best, time.perf_counter() - t0)
        return n / max(best, 1e-6)

    def local_prefix_blocks(self, block_hashes: list[bytes], block_tokens: Callable[[int], bytes], root: bytes,
                            limit: int) -> int:
        """Leading blocks of a chain (at most ``limit``) this worker holds on any tier, verified. Thread-safe."""
        with self._lock:
            hit = self.cache.index.match(block_hashes[:limit], block_tokens).num_blocks
            if self.tiers is not None and hit < limit:
                located = self.tiers.locate(block_hashes, block_tokens, hit, limit, root)
                self.tiers.release(located)
                hit += len(located)
            return hit

    def export_blocks(self, block_hashes: list[bytes], parent: bytes | None = None,
                      check_first_parent: bool = False) -> list[tuple[RecordMeta, bytes]]:
        """Records of the leading run of ``block_hashes`` this worker holds (device, host or disk).

        Device blocks are copied out under the engine lock in the pool dtype (codec
        ``none``), or, when their KV was loaded from a lossy codec, in that codec (so a peer
        that accepts only exact KV misses them); host and disk blocks keep their tier's
        codec or the lossier one their KV went through. The run stops at the
        first block not held, or whose parent in the device index is not the previous
        hash (``parent`` for the first block, when ``check_first_parent``). Thread-safe.

        Returns:
            ``(meta, payload)`` per block, in order (checksums filled in).
        """
        out: list[tuple[RecordMeta, bytes]] = []
        shape = tuple(self.kv_cache.shape[1:])
        dt = dtype_name(self.kv_cache.dtype)
        with self._lock:
            index = self.cache.index
            prev = parent
            for i, h in enumerate(block_hashes):
                node = index.node(h)
                if node is None:
                    break
                parent = node.parent.block_hash if node.parent is not None else None
                if parent != prev and (i > 0 or check_first_parent):
                    break
                rank = self.tiers.row_loss[node.value] if self.tiers is not None else 0
                if rank:  # loaded from a lossy codec: passed on in it, never as exact
                    codec = self.tiers.codec(codec_of_rank(rank))
                    payload = codec.encode(self.kv_cache[node.value:node.value + 1])[0].cpu().numpy().tobytes()
                else:
                    codec = None
                    payload = self.kv_cache[node.value].cpu().contiguous().view(torch.uint8).numpy().tobytes()
                out.append((RecordMeta(h, parent or ZERO_HASH, node.tokens, codec.name if codec else "none", dt,
                                       shape, len(payload), checksum(payload)), payload))
                prev = h
        if self.tiers is not None and len(out) < len(block_hashes):
            rest = self.tiers.export(block_hashes, len(out))
            first_unchecked = not out and not check_first_parent
            if rest and (first_unchecked or rest[0][0].parent_hash == (prev or ZERO_HASH)):
                out.extend(rest)
        return out

    def _sample_and_emit(self, batch: ScheduledBatch, logits: torch.Tensor) -> None:
        now = time.monotonic()
        row = 0
        for req in list(batch.requests):
            if req.num_computed < req.num_tokens:
                continue  # prefill chunk, nothing to sample yet
            if self.logits_hook is not None:
                self.logits_hook(req.request_id, logits[row].clone())
            try:
                token = sample_token(logits[row], req.sampling, req.generator)
            except Exception as exc:  # this request fails; the others and the worker go on
                log.exception("sampling failed for %s", req.request_id)
                self._fail(req, f"sampling failed: {exc}", "INTERNAL")
                row += 1
                continue
            row += 1
            if req.prefill_done is None:
                req.prefill_done = now
            if req.first_token is None:
                req.first_token = now
            req.append_token(token)
            reason = self._finish_reason(req, token)
            new = req.output_ids[req.num_emitted:]
            req.num_emitted += len(new)
            if reason:
                self._requests.pop(req.request_id, None)
                self.scheduler.remove(req, finished=True)
                req.on_output(RequestOutput(req.request_id, new, True, reason,
                                            usage=self._usage(req), timing=self._timing(req, now)))
            else:
                req.on_output(RequestOutput(req.request_id, new))

    def _finish_reason(self, req: Request, token: int) -> str:
        if token in self.eos_token_ids and not req.sampling.ignore_eos:
            return "stop"
        if len(req.output_ids) >= req.sampling.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return ""

    def _fail(self, req: Request, message: str, code: str) -> None:
        self._requests.pop(req.request_id, None)
        self.scheduler.remove(req, failed=True)
        req.on_output(RequestOutput(req.request_id, [], True, "error", error=message, error_code=code))

    @staticmethod
    def _usage(req: Request) -> dict:
        cached = max(req.num_cached, 0)
        by_tier = {m: 0 for m in MEDIUMS}
        by_tier.update(req.cached_by_tier)
        return {
            "prompt_tokens": req.num_prompt_tokens,
            "cached_tokens": cached,
            "cached_tokens_by_tier": by_tier,
            "lossy_cached_tokens": req.num_lossy_cached,
            "computed_prefill_tokens": req.num_prompt_tokens - cached,
            "completion_tokens": len(req.output_ids),
        }

    @staticmethod
    def _timing(req: Request, now: float) -> dict:
        def ms(a, b):
            return round(1000.0 * (b - a), 3) if a is not None and b is not None else 0.0
        return {
            "queue_ms": ms(req.arrival, req.first_scheduled),
            "prefill_ms": ms(req.first_scheduled, req.prefill_done),
            "ttft_ms": ms(req.arrival, req.first_token),
            "e2e_ms": ms(req.arrival, now),
        }

    # --------------------------------------------------------------- helpers
    def prefetch(self, prompt_ids: list[int], cache_salt: str = "", adapter_id: str = "",
                 tenant: str = "") -> dict[str, int]:
        """Stage what only the disk or the cluster's remote tier holds of this prompt.

        Call it before `submit`, from the submitter's thread: it reads the disk and
        waits for Redis (at most the remote tier's timeout per call), and briefly for
        the engine lock to read the device index; the scheduler then loads the staged
        blocks without waiting for either (`TierStore.prefetch`). Thread-safe. A no-op
        without a staging area or without a disk or remote tier.

        Returns:
            blocks staged per medium.
        """
        if self.tiers is None or not self.tiers.can_prefetch:
            return {}
        limit = (len(prompt_ids) - 1) // self.block_size
        if limit <= 0:
            return {}
        root = self.namespace(cache_salt, adapter_id, tenant).root_hash()
        hashed = hash_blocks([int(t) for t in prompt_ids[:limit * self.block_size]], self.block_size, root)
        with self._lock:
            hit = self.cache.index.match(hashed.hashes, hashed.block_tokens).num_blocks
        rate = self._prefill_rate  # measured steps only: never a calibration pass here
        return self.tiers.prefetch(hashed.hashes, hashed.block_tokens, hit, limit, root,
                                   compute_seconds_per_block=self.block_size / rate if rate else None,
                                   owner=tenant or None)

    def generate(self, prompt_ids: list[int], sampling: SamplingParams | None = None,
                 cache_salt: str = "", timeout: float = 300.0, tenant: str = "") -> dict:
        """Blocking generate for tests and benchmarks (the engine must be started).

        Returns a dict with ``token_ids``, ``finish_reason``, ``usage`` and ``timing``.

        Raises:
            InvalidRequest, Overloaded: from `submit`.
            RuntimeError: the request failed in the engine.
            TimeoutError: no result within ``timeout`` seconds.
        """
        done = threading.Event()
        out: dict = {"token_ids": []}

        def on_output(o: RequestOutput) -> None:
            out["token_ids"].extend(o.new_token_ids)
            if o.finished:
                out.update(finish_reason=o.finish_reason, usage=o.usage, timing=o.timing,
                           error=o.error, error_code=o.error_code)
                done.set()

        arrival = time.monotonic()
        sampling = sampling or SamplingParams()
        self.validate([int(t) for t in prompt_ids], sampling)  # a refused request reads nothing
        self.prefetch(prompt_ids, cache_salt, tenant=tenant)
        self.submit(prompt_ids, sampling, on_output, cache_salt=cache_salt, arrival=arrival, tenant=tenant)
        if not done.wait(timeout):
            raise TimeoutError(f"no result within {timeout} s")
        if out.get("error"):
            raise RuntimeError(f"{out['error_code']}: {out['error']}")
        return out

    def load(self) -> dict:
        """Load snapshot: running/waiting requests, queued prefill tokens (tokens), free blocks.

        Lock-free: the counts are those the engine thread published at its last scheduling
        step (taken before that step's forward, so a long prefill shows as running with its
        prompt still queued), plus the requests submitted since. Never waits on a model
        step; for the lease heartbeat, health, GetLoad and metrics. Thread-safe.
        """
        snap = dict(self._load_snapshot)
        snap["waiting_requests"] += len(self._inbox)
        snap["tier_weights"] = self.tier_weights()
        return snap

    def tier_weights(self) -> dict[str, float]:
        """Measured credit of one cached block on each lower tier, for routers: the
        fraction of its prefill that loading it from there saves,
        ``max(0, 1 - load_seconds_per_block / prefill_seconds_per_block)``
        (the formula of `services.cluster_index.TIER_WEIGHTS`, here from this worker's
        own measurements). "host" is the host slab's load; "disk" and "remote" are the
        disk or Redis read (and checks) plus, where the block came through the staging
        area, the load from there. Media not measured yet, or all media before any
        prefill step was timed, are absent. Lock-free; never waits on a model step.
        """
        rate = self._prefill_rate
        if self.tiers is None or not rate:
            return {}
        compute = self.block_size / rate  # seconds of prefill per block
        costs = dict(self.tiers.load_seconds_per_block)
        staging = costs.get("peer", 0.0)
        out = {}
        for medium, cost in (("host", costs.get("host")), ("disk", costs.get("disk")),
                             ("remote", costs.get("remote"))):
            if cost is None:
                continue
            if medium == "remote" or (medium == "disk" and self.tiers.can_prefetch):
                cost += staging
            out[medium] = round(max(0.0, 1.0 - cost / compute), 4)
        return out

    def _count_load(self) -> dict:
        """Load counted from the scheduler (engine thread, or under the engine lock)."""
        return {
            "running_requests": len(self.scheduler.running),
            "waiting_requests": len(self.scheduler.waiting),
            "queued_prefill_tokens": self.scheduler.queued_prefill_tokens(),
            "free_blocks": self.cache.pool.num_free_blocks,
            "total_blocks": self.num_blocks,
        }

    def snapshot(self) -> dict:
        """Everything the prefix cache holds, for a router resyncing its index.

        Returns ``{"seq": S, "blocks": [(block_hash, parent_block_hash | None, medium)]}``
        with parents before children. Taken under the engine lock after the event
        publisher assigned sequence number S to every event emitted so far, so the
        snapshot equals the state after applying batches 1..S.
        """
        with self._lock, (self.tiers.lock if self.tiers is not None else contextlib.nullcontext()):
            seq = self.snapshot_seq_fn() if self.snapshot_seq_fn else 0
            nodes = [self.cache.index.node(h) for h, _ in self.cache.index.items()]
            nodes.sort(key=lambda n: n.depth)
            blocks = [(n.block_hash, n.parent.block_hash if n.parent is not None else None, "device")
                      for n in nodes]
            if self.tiers is not None:
                blocks.extend(self.tiers.snapshot())
            return {"seq": seq, "blocks": blocks}

    def clear_cache(self) -> int:
        """Drop every cached block not in use, in every tier (emits AllBlocksCleared).

        Returns:
            blocks dropped, all tiers together.
        """
        with self._lock:
            before = len(self.cache.index)
            dropped = self.tiers.clear() if self.tiers is not None else 0
            self.cache.clear()
            return before - len(self.cache.index) + dropped

    def offload_device_cache(self) -> int:
        """Evict every unused cached device block through the offload path (to the host tier,
        and from there to disk per the write mode). Returns blocks evicted from the device."""
        with self._lock:
            return self.cache.evict_unused()

    def drop_host_tier(self) -> int:
        """Drop the host tier's blocks (the disk tier keeps its copies). Returns blocks dropped."""
        with self._lock:
            return self.tiers.clear_host() if self.tiers is not None else 0

    def flush_tiers(self, timeout: float = 30.0) -> bool:
        """Wait until queued disk writes are on disk. Returns False on timeout."""
        return self.tiers.flush(timeout) if self.tiers is not None else True

    def tier_stats(self) -> dict:
        """Per-tier block/byte counts and offload/load counters (empty without tiers)."""
        return self.tiers.stats() if self.tiers is not None else {}

    def check_integrity(self) -> None:
        """Pool and index invariants hold (raises otherwise)."""
        with self._lock:
            self.cache.check_integrity()


def sample_token(logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick the next token from one row of logits ``[vocab_size]`` (float32).

    Greedy (argmax) when temperature is 0; otherwise softmax(logits / temperature),
    restricted to the smallest set of tokens whose probability reaches top_p (nucleus
    sampling, Holtzman et al. 2020), drawn with the request's own generator, on its device
    (the CPU, whatever ``logits``' device). The logits
    are shifted by their maximum before scaling, in float64, so a tiny temperature turns
    into greedy instead of overflowing.

    Raises:
        FloatingPointError: the logits hold NaN (a broken model or checkpoint); the
            engine fails that request alone.
    """
    if torch.isnan(logits).any():
        raise FloatingPointError("model produced NaN logits")
    if sampling.temperature <= 0 or generator is None:
        return int(torch.argmax(logits).item())
    # drawn where the request's generator lives (the CPU): one row of logits is copied from a
    # GPU, and a seed gives the same draw on CPU and GPU workers
    logits = logits.to(generator.device)
    shifted = logits.double() - logits.max().double()
    probs = torch.softmax(shifted / sampling.temperature, dim=-1)
    if 0.0 < sampling.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < sampling.top_p
        keep[0] = True
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1, generator=generator).item())
