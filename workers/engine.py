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

import itertools
import logging
import threading
import time
from collections import deque
from typing import Callable

import torch

from cache_store.hashing import Namespace
from cache_store.prefix_cache import PrefixCache
from workers.loader import load_model
from workers.model import AttentionMetadata, allocate_kv_cache
from workers.request import (
    InvalidRequest,
    Overloaded,
    Request,
    RequestOutput,
    RequestStatus,
    SamplingParams,
)
from workers.scheduler import ScheduledBatch, Scheduler
from workers.tokenizer import load_tokenizer

log = logging.getLogger(__name__)

MEDIUMS = ("device", "host", "disk", "peer", "remote")


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
        max_model_len: context limit in tokens (default: the model's).
        event_sink: receives KV events (BlockStored/BlockRemoved/AllBlocksCleared).
        seed: seed of the built-in model's random weights.
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
    ):
        if block_size < 1 or num_blocks < 1:
            raise ValueError("block_size and num_blocks must be >= 1")
        self.device = torch.device(device)
        self.config, self.model = load_model(model_dir, device=device, seed=seed)
        self.model.eval()
        self.tokenizer = load_tokenizer(model_dir, self.config)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_model_len = min(max_model_len or self.config.max_position_embeddings,
                                 self.config.max_position_embeddings)
        self.max_waiting = max_waiting
        self.kv_cache = allocate_kv_cache(self.config, num_blocks, block_size, self.device,
                                          next(self.model.parameters()).dtype)
        self.cache = PrefixCache(num_blocks, block_size, event_sink=event_sink)
        self.scheduler = Scheduler(self.cache, max_num_batched_tokens, max_num_seqs)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids or ())
        self._ids = itertools.count()
        self._requests: dict[str, Request] = {}
        self._inbox: deque[tuple[str, object]] = deque()
        self._cv = threading.Condition()
        self._lock = threading.RLock()  # guards scheduler/cache state across threads
        self._thread: threading.Thread | None = None
        self._stop = False
        self.steps = 0
        #: Called under the engine lock when a snapshot is taken; returns the sequence
        #: number of the last KV event batch the snapshot reflects (the publisher's).
        self.snapshot_seq_fn: Callable[[], int] | None = None
        #: Optional observer of every sampled logits row ``[vocab_size]`` (float32), called
        #: on the engine thread with the request id; tests use it to compare cold and hit runs.
        self.logits_hook: Callable[[str, torch.Tensor], None] | None = None

    # ------------------------------------------------------------------ edge
    def namespace(self, cache_salt: str = "", adapter_id: str = "") -> Namespace:
        """The hash namespace of requests under this model, tenant and adapter."""
        return Namespace(model_id=self.config.model_id, cache_salt=cache_salt, adapter_id=adapter_id)

    def validate(self, prompt_ids: list[int], sampling: SamplingParams) -> None:
        """Check a request before queueing it.

        Raises:
            InvalidRequest: empty prompt, a token id outside [0, vocab_size), max_tokens
                < 1, temperature < 0, top_p outside [0, 1], or a prompt of max_model_len
                tokens or more.
            Overloaded: the request could not fit in the pool even alone, or the queue
                is full.
        """
        vocab = self.config.vocab_size
        if not prompt_ids:
            raise InvalidRequest("prompt is empty: send at least one token or non-empty text")
        bad = next((t for t in prompt_ids if t < 0 or t >= vocab), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad} is out of range: ids must be in [0, {vocab}) for model "
                                 f"{self.config.model_id}")
        if sampling.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be >= 1 (got {sampling.max_tokens})")
        if sampling.temperature < 0:
            raise InvalidRequest(f"temperature must be >= 0 (got {sampling.temperature})")
        if not 0.0 <= sampling.top_p <= 1.0:
            raise InvalidRequest(f"top_p must be in [0, 1] (got {sampling.top_p})")
        if len(prompt_ids) >= self.max_model_len:
            raise InvalidRequest(
                f"prompt has {len(prompt_ids)} tokens but the model's context is {self.max_model_len} tokens: "
                f"shorten it to at most {self.max_model_len - 1} tokens")
        total = min(len(prompt_ids) + sampling.max_tokens, self.max_model_len)
        need = -(-total // self.block_size)
        if need > self.num_blocks:
            raise Overloaded(
                f"request needs {need} KV blocks ({len(prompt_ids)} prompt + {sampling.max_tokens} max_tokens at "
                f"block_size {self.block_size}) but the pool has {self.num_blocks}: lower max_tokens or start the "
                f"worker with more --num-blocks")
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
    ) -> str:
        """Validate and queue a request; returns its id. Thread-safe.

        Raises:
            InvalidRequest, Overloaded: see `validate`.
        """
        prompt_ids = [int(t) for t in prompt_ids]
        self.validate(prompt_ids, sampling)
        rid = request_id or f"req-{next(self._ids)}"
        req = Request(rid, prompt_ids, sampling, self.namespace(cache_salt, adapter_id),
                      self.block_size, on_output)
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
        """Stop the loop; queued and running requests fail with UNAVAILABLE."""
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

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stop and not self._inbox and not self.scheduler.has_work():
                    self._cv.wait()
                if self._stop:
                    return
            self.step()

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
            self._drain_inbox()
            batch = self.scheduler.schedule()
            if not batch:
                return 0
            try:
                logits = self._forward(batch)
            except Exception as exc:  # keep the worker up; fail what was in flight
                log.exception("model step failed")
                for req in list(batch.requests):
                    self._fail(req, f"model step failed: {exc}", "INTERNAL")
                return 0
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

    def _sample_and_emit(self, batch: ScheduledBatch, logits: torch.Tensor) -> None:
        now = time.monotonic()
        row = 0
        for req in list(batch.requests):
            if req.num_computed < req.num_tokens:
                continue  # prefill chunk, nothing to sample yet
            if self.logits_hook is not None:
                self.logits_hook(req.request_id, logits[row].clone())
            token = sample_token(logits[row], req.sampling, req.generator)
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
                self.scheduler.remove(req)
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
        self.scheduler.remove(req)
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
    def generate(self, prompt_ids: list[int], sampling: SamplingParams | None = None,
                 cache_salt: str = "", timeout: float = 300.0) -> dict:
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

        self.submit(prompt_ids, sampling or SamplingParams(), on_output, cache_salt=cache_salt)
        if not done.wait(timeout):
            raise TimeoutError(f"no result within {timeout} s")
        if out.get("error"):
            raise RuntimeError(f"{out['error_code']}: {out['error']}")
        return out

    def load(self) -> dict:
        """Load snapshot: running/waiting requests, queued prefill tokens, free blocks."""
        with self._lock:
            return {
                "running_requests": len(self.scheduler.running),
                "waiting_requests": len(self.scheduler.waiting) + len(self._inbox),
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
        with self._lock:
            seq = self.snapshot_seq_fn() if self.snapshot_seq_fn else 0
            nodes = [self.cache.index.node(h) for h, _ in self.cache.index.items()]
            nodes.sort(key=lambda n: n.depth)
            blocks = [(n.block_hash, n.parent.block_hash if n.parent is not None else None, "device")
                      for n in nodes]
            return {"seq": seq, "blocks": blocks}

    def clear_cache(self) -> int:
        """Drop every cached block not in use (emits AllBlocksCleared). Returns blocks dropped."""
        with self._lock:
            before = len(self.cache.index)
            self.cache.clear()
            return before - len(self.cache.index)

    def check_integrity(self) -> None:
        """Pool and index invariants hold (raises otherwise)."""
        with self._lock:
            self.cache.check_integrity()


def sample_token(logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick the next token from one row of logits ``[vocab_size]`` (float32).

    Greedy (argmax) when temperature is 0; otherwise softmax(logits / temperature),
    restricted to the smallest set of tokens whose probability reaches top_p (nucleus
    sampling, Holtzman et al. 2020), drawn with the request's own generator.
    """
    if sampling.temperature <= 0 or generator is None:
        return int(torch.argmax(logits).item())
    probs = torch.softmax(logits / sampling.temperature, dim=-1)
    if 0.0 < sampling.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < sampling.top_p
        keep[0] = True
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1, generator=generator).item())
