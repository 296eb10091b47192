"""Continuous-batching scheduler with chunked prefill over a paged prefix cache.

Each step the scheduler hands the model runner a token budget's worth of work:
running requests first (one token per decoding request, a chunk per prefilling
request), then waiting requests in arrival order. A waiting request first looks up
its longest cached prefix and locks those blocks, so prefill runs only over the
uncached suffix. The design follows vLLM v1's unified scheduler (every request is
"num_computed tokens of num_tokens") and Sarathi-Serve's chunked prefill
(Agrawal et al., OSDI 2024).

Cache hit rule (documented in README): the cached prefix is capped at
``floor((num_tokens - 1) / block_size)`` full blocks, so at least one prompt token is
always computed and a fully cached prompt recomputes its whole last block. A shared
block is therefore never written by a second request.

Lower tiers: with a `TierStore`, the device match continues into the host tier, the
staging area of peer fetches and the disk tier (``TierStore.locate``: every block's hash,
parent, tokens and layout are verified against the request's chain). The blocks found
get device blocks, their KV is copied in (``TierStore.load``: disk payloads are
checksummed; a block that fails ends the run and the rest is recomputed) and they are
committed to the device index like freshly computed ones. This happens synchronously
while the request is first scheduled, so a load's time is part of the request's TTFT
and of that engine step.

Memory pressure: blocks come from `PrefixCache.allocate`, which evicts unlocked cached
blocks LRU-first (chain tails first). If that is not enough, the newest running request
is preempted (its blocks are freed; it is re-queued at the front and recomputes, mostly
from the prefix cache) so that the oldest request always makes progress. A request always fits the pool alone: the
engine's context limit (``max_model_len``) is at most what the pool holds
(`workers.limits.fit_max_model_len_to_pool`), and longer prompts are refused at admission
(INVALID_ARGUMENT).

Tenants: blocks are allocated for the request's tenant (``namespace.tenant``), and the
pool's eviction is fair between tenants (`BlockPool`). While more than one tenant is active
on the worker (a request waiting, running, or ended within ``tenant_idle_s``), each is
protected down to an equal split of the pool (`BlockPool.set_protection`: blocks of idle
tenants go first) and a tenant that already runs a request waits to start another whose
prompt (with what every running prompt still needs) would need more blocks than it can
take without pushing another active tenant under that split (`BlockPool.room_for`); its
later requests wait behind it (so that its running ones drain) and other tenants' go ahead
meanwhile. A tenant's first running request is always admitted (it fits the pool alone),
and a running request's growth is never held back, so the split can be crossed by one
request per tenant, by decode growth and by blocks loaded from lower tiers for a prompt's
prefix.
"""
from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

from kvmesh.cache_store.prefix_cache import PrefixCache
from kvmesh.cache_store.tier_store import TierStore
from kvmesh.workers.request import DEFAULT_DEADLINE_SHED_FACTOR, Request, RequestStatus


#: seconds a tenant stays active (protected) after its last request (`Scheduler`)
DEFAULT_TENANT_IDLE_S = 600.0


@dataclass
class ScheduledBatch:
    """Work for one model step: request i computes tokens [start_i, start_i + n_i)."""

    requests: list[Request]
    num_new_tokens: list[int]
    #: requests dropped before their prefill, each with why (its deadline could not be
    #: met): the engine fails them with DEADLINE_EXCEEDED; they hold no blocks
    shed: list[tuple[Request, str]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.requests)


#: Default ``--long-prefill-token-threshold``: this fraction (1/N) of the step's token budget.
LONG_PREFILL_BUDGET_SHARE = 4
#: Default most requests in a partial prefill at once (``--max-num-partial-prefills``).
DEFAULT_MAX_NUM_PARTIAL_PREFILLS = 2


class DeadlinePressure:
    """How much more cautious deadline shedding is than its configured factor now: a
    multiplier (>= 1) that grows each time a request admitted with a deadline ends past
    it, shrinks each time one ends in time, and decays back to 1 with time.

    The estimate that sheds counts prefill only. It cannot see what else makes an
    admitted request miss under overload: decode steps slowed by the prefills of requests
    admitted after it, or prompts slower per token than the linear estimate. Outcomes show
    it: a caller whose admitted requests miss their deadlines is shed on a larger factor,
    and one whose requests make it (on an idle worker, with tight but sufficient
    deadlines) stays at the configured factor. A miss is a whole request's: a caller whose
    deadlines do not cover its own generations raises its own factor too, which sheds its
    later requests sooner (they would miss as well). Kept per caller
    (`Scheduler.deadline_pressure`). Feedback from accepted work to admission follows the
    adaptive throttling of Google's SRE book (ch. 21, "Handling Overload"); the update is
    multiplicative (in log space), as in AIMD controllers.

    Args:
        up: multiplier per miss (> 1).
        down: multiplier per request in time (in (0, 1]).
        most: the largest multiplier.
        half_life_s: seconds for the multiplier's logarithm to halve with no outcomes,
            so a caller whose requests are all shed (no outcomes) returns to the
            configured factor.
    """

    UP = 1.25
    DOWN = 0.98
    MOST = 16.0
    HALF_LIFE_S = 10.0

    def __init__(self, up: float = UP, down: float = DOWN, most: float = MOST, half_life_s: float = HALF_LIFE_S):
        if not (up > 1 and 0 < down <= 1 and most >= 1 and half_life_s > 0):
            raise ValueError("need up > 1, 0 < down <= 1, most >= 1 and half_life_s > 0")
        self._up, self._down = math.log(up), math.log(down)
        self._most = math.log(most)
        self.half_life_s = half_life_s
        self._level = 0.0  # log of the multiplier
        self._at = time.monotonic()
        #: admitted requests with a deadline that ended past it / in time, so far
        self.misses = 0
        self.in_time = 0

    def _decay(self, now: float) -> None:
        if self._level:
            self._level *= 0.5 ** (max(0.0, now - self._at) / self.half_life_s)
        self._at = now

    def value(self, now: float | None = None) -> float:
        """The multiplier now (>= 1)."""
        self._decay(time.monotonic() if now is None else now)
        return math.exp(self._level)

    def note(self, missed: bool, now: float | None = None) -> None:
        """One admitted request with a deadline ended: past it (``missed``) or in time."""
        self._decay(time.monotonic() if now is None else now)
        if missed:
            self.misses += 1
            self._level = min(self._most, self._level + self._up)
        else:
            self.in_time += 1
            self._level = max(0.0, self._level + self._down)


def _first_lossier(ranks: Sequence[int], req: Request, offset: int = 0) -> int:
    """Index of the first of ``ranks`` (the loss ranks of ``req``'s blocks ``offset``,
    ``offset + 1``, ...) lossier than ``req``'s first schedule had at that block, ``len(ranks)``
    if none: blocks it reused then are held to the rank each had (`Request.cached_loss`),
    blocks it computed then to the rank of the context it computed them over
    (`Request.allowed_loss`)."""
    caps, beyond = req.cached_loss, req.allowed_loss
    n = len(caps)
    for i, r in enumerate(ranks):
        j = offset + i
        if r > (caps[j] if j < n else beyond):
            return i
    return len(ranks)


class Scheduler:
    """Decides which requests run each step and owns their block tables.

    Args:
        cache: the worker's prefix cache (pool + radix index).
        max_num_batched_tokens: token budget of one step (prefill chunks + decodes).
        max_num_seqs: most requests running at once.
        tiers: the lower cache tiers, or None.
        long_prefill_token_threshold: most prompt tokens one request computes per step
            while other requests are running or waiting (tokens); 0 = no cap; None (default)
            = a quarter of ``max_num_batched_tokens``. A prompt alone on the worker still
            takes the whole budget; with company, a long prefill first leaves budget to the
            decodes and short prompts of the step, then takes back what they left unused.
        max_num_partial_prefills: most requests whose prompt is partly computed at once
            (>= 1). A waiting request that would become one more is passed over (a later
            request that finishes its prompt in this step can still start), so short
            prompts are not queued behind several long ones.
        deadline_shed_factor: a request with a ``deadline`` is checked each time it is
            considered until it first runs, and shed if its deadline has passed (checked
            before its cached prefix is looked up, so no tier load is made for it), or, once
            its cached prefix is locked and before anything is computed, if ``factor x
            (tokens running requests compute before it + its uncached prompt tokens) /
            shed_rate()`` seconds exceed what is left of it (0: shed only requests already
            past their deadline). Running requests take each step's budget first; what
            they compute before it is counted at its least (`_tokens_ahead`: chunked
            prefill lets it run beside a long prompt). The factor is the configured floor:
            each caller's is raised while that caller's admitted requests miss their
            deadlines and falls back as they make them (`DeadlinePressure`). ``shed_rate``
            is optimistic (the fastest recent step, `Engine.peak_prefill_rate`), and at its
            floor the default factor of 0.25 sheds only requests that would miss even at
            four times that rate. A shed request costs
            no prefill; it would otherwise run until its caller's deadline cancels it,
            delaying the requests queued behind it for nothing.
        shed_rate: the prefill rate (tokens/s; None: not known yet) deadline shedding
            estimates with; None (the argument): shed only requests past their deadline.
        tenant_idle_s: seconds after its last request waited, ran or ended that a tenant
            stops being active, and so stops being protected (its cached blocks are
            evicted first; module docstring). 0: only tenants with a request on the
            worker are active.

    Fair scheduling of long prefills follows vLLM's ``long_prefill_token_threshold`` and
    ``max_num_partial_prefills`` (vLLM engine arguments, v0.8+).

    In-flight prefix sharing: a waiting request whose next uncached block is being
    computed right now by a running request (same block hash, not yet committed) is not
    scheduled this step; once that block is committed, the request finds it in the prefix
    cache instead of computing it again (and ``cached_tokens`` counts it).
    """

    def __init__(self, cache: PrefixCache, max_num_batched_tokens: int = 1024, max_num_seqs: int = 32,
                 tiers: TierStore | None = None,
                 long_prefill_token_threshold: int | None = None,
                 max_num_partial_prefills: int = DEFAULT_MAX_NUM_PARTIAL_PREFILLS,
                 prefill_rate: Callable[[], float | None] | None = None,
                 deadline_shed_factor: float = DEFAULT_DEADLINE_SHED_FACTOR,
                 shed_rate: Callable[[], float | None] | None = None,
                 tenant_idle_s: float = DEFAULT_TENANT_IDLE_S):
        if long_prefill_token_threshold is None:
            long_prefill_token_threshold = max(1, max_num_batched_tokens // LONG_PREFILL_BUDGET_SHARE)
        if long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0 (got {long_prefill_token_threshold})")
        if max_num_partial_prefills < 1:
            raise ValueError(f"max_num_partial_prefills must be >= 1 (got {max_num_partial_prefills})")
        if not tenant_idle_s >= 0:  # NaN too
            raise ValueError(f"tenant_idle_s must be >= 0 (got {tenant_idle_s})")
        if not deadline_shed_factor >= 0:  # NaN too
            raise ValueError(f"deadline_shed_factor must be >= 0 (got {deadline_shed_factor})")
        self.cache = cache
        self.tiers = tiers
        #: the engine's measured prefill throughput (tokens/s), None until measured: what a
        #: lower tier's load is weighed against (`TierStore.worth_loading`)
        self.prefill_rate = prefill_rate
        #: an optimistic prefill rate (tokens/s; None: not known), what deadline shedding
        #: estimates with (`Engine.peak_prefill_rate`); None: shed only past deadlines
        self.shed_rate = shed_rate
        self.block_size = cache.block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.max_num_partial_prefills = max_num_partial_prefills
        self.deadline_shed_factor = float(deadline_shed_factor)
        #: requests shed so far (`deadline_shed_factor`)
        self.num_shed = 0
        #: how far outcomes have raised the shed factor, per caller (`DeadlinePressure`,
        #: `deadline_pressure`; `Request.caller`): one caller's hopeless deadlines make
        #: only its own requests shed sooner
        self._pressure: OrderedDict[str, DeadlinePressure] = OrderedDict()
        self._contended = False
        self.tenant_idle_s = float(tenant_idle_s)
        #: tenant -> when a request of its last waited, ran or ended (monotonic s), oldest first
        self._tenant_seen: OrderedDict[object, float] = OrderedDict()
        #: requests held back (once or more) to keep other tenants' shares (`_fair_to_admit`)
        self.num_held_for_fairness = 0
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    # ----------------------------------------------------------------- queries
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def queued_prefill_tokens(self) -> int:
        """Prompt tokens not yet computed, over waiting and running requests (tokens)."""
        return sum(max(0, r.num_tokens - r.num_computed - 1) for r in self.running) + sum(
            r.num_tokens for r in self.waiting
        )

    #: Most callers whose `DeadlinePressure` is kept; the least recently used go first
    #: (back to the configured factor: errs towards serving).
    MAX_PRESSURE_CALLERS = 4096

    def deadline_pressure(self, caller: str) -> DeadlinePressure:
        """The shed factor's multiplier for ``caller``'s requests (created at 1)."""
        p = self._pressure.get(caller)
        if p is None:
            p = self._pressure[caller] = DeadlinePressure()
            while len(self._pressure) > self.MAX_PRESSURE_CALLERS:
                self._pressure.popitem(last=False)
        else:
            self._pressure.move_to_end(caller)
        return p

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---------------------------------------------------------------- commands
    def add(self, req: Request) -> None:
        """Queue a validated request (arrival order)."""
        self.waiting.append(req)
        self._seen(req)

    def _seen(self, req: Request) -> None:
        owner = req.namespace.tenant or None
        self._tenant_seen[owner] = time.monotonic()
        self._tenant_seen.move_to_end(owner)

    def remove(self, req: Request, finished: bool = False, failed: bool = False) -> None:
        """Drop a request wherever it is and release its blocks: an abort (its caller
        left or gave up), or with ``finished`` its last token, or with ``failed`` an error
        of the worker's (a failed step, shutdown).

        A request that carried a deadline and was admitted tells its caller's
        `deadline_pressure` whether it finished in time, or ended past its deadline (an
        abort then is the caller's deadline cancelling it). An abort before the deadline
        (a caller that left) and a failure tell nothing.
        """
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._release(req)
        self._seen(req)
        if (req.deadline is not None and req.first_scheduled is not None and not failed
                and req.status is not RequestStatus.FINISHED):
            now = time.monotonic()
            if now >= req.deadline:
                self.deadline_pressure(req.caller).note(True, now)
            elif finished:
                self.deadline_pressure(req.caller).note(False, now)
        req.status = RequestStatus.FINISHED

    def schedule(self) -> ScheduledBatch:
        """Pick this step's work; allocates the blocks it needs.

        Mutates block tables, ``running`` and ``waiting``. The returned batch is valid
        until `update_after_step` is called for it.
        """
        budget = self.max_num_batched_tokens
        batch = ScheduledBatch([], [])
        fair = self._protect_active_tenants()
        # a prompt alone on the worker takes the whole budget; with company it is capped
        self._contended = len(self.running) + len(self.waiting) > 1
        # 1. running requests, oldest first; preempt from the newest when out of blocks
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(self._chunk(req), budget)
            if not self._grow(req, req.num_computed + n):
                # free space by preempting the newest request (possibly this one)
                while not self._grow(req, req.num_computed + n):
                    victim = self.running[-1]
                    self._preempt(victim)
                    if victim is req:
                        break
                if req.status is not RequestStatus.RUNNING:
                    break
            batch.requests.append(req)
            batch.num_new_tokens.append(n)
            budget -= n
            i += 1
        # 2. waiting requests in arrival order; a request waiting on an in-flight prefix, or
        # that would exceed the partial-prefill limit, is passed over for this step
        partial = sum(1 for r, n in zip(batch.requests, batch.num_new_tokens)
                      if r.num_computed + n < r.num_prompt_tokens)
        inflight = self._inflight_blocks()
        # tokens each running request has still to compute (prompt, or generated tokens a
        # resumed request recomputes, or its next decode token), admitted ones appended
        ahead = [r.num_tokens - r.num_computed for r in self.running] if self.shed_rate is not None else []
        passed: list[Request] = []
        held: set = set()  # tenants with a request held back this step: their later ones wait too
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting.popleft()
            check = req.deadline is not None and req.first_scheduled is None
            why = self._past_deadline(req) if check else None
            if why is None and held and (req.namespace.tenant or None) in held:
                passed.append(req)  # behind its tenant's held request: let its running ones drain
                continue
            if why is None and not self._lock_cached_prefix(req, inflight):
                passed.append(req)  # its prefix is being computed: attach once committed
                continue
            if check and why is None:
                why = self._hopeless(req, ahead)
            if why is not None:
                self._release(req)
                req.status = RequestStatus.FINISHED
                batch.shed.append((req, why))
                self.num_shed += 1
                continue
            if fair and not self._fair_to_admit(req):
                self._release(req)
                passed.append(req)  # another tenant's share: wait for one of its own to end
                held.add(req.namespace.tenant or None)
                if not req.held_for_share:
                    req.held_for_share = True
                    self.num_held_for_fairness += 1
                continue
            n = min(self._chunk(req), budget)
            unfinished = req.num_computed + n < req.num_prompt_tokens
            if unfinished and partial >= self.max_num_partial_prefills:
                self._release(req)
                passed.append(req)
                continue
            if not self._grow(req, req.num_computed + n):
                self._release(req)  # keep it waiting without holding blocks
                self.waiting.appendleft(req)
                break
            req.status = RequestStatus.RUNNING
            self._note_first_run(req)
            if req.first_scheduled is None:
                req.first_scheduled = time.monotonic()
            self.running.append(req)
            batch.requests.append(req)
            batch.num_new_tokens.append(n)
            budget -= n
            partial += unfinished
            if self.shed_rate is not None:
                ahead.append(req.num_tokens - req.num_computed)
            for j in range(req.num_committed_blocks, len(req.block_hashes)):
                inflight.add(req.block_hashes[j])
        self.waiting.extendleft(reversed(passed))
        # 3. budget nobody else wanted goes back to prefills the threshold capped, in
        # order; it stops at one that cannot get the blocks, so a later request never
        # overtakes an earlier one (deadline shedding's estimate relies on that order)
        for k, req in enumerate(batch.requests):
            if budget <= 0:
                break
            want = req.num_tokens - req.num_computed - batch.num_new_tokens[k]
            if want > 0 and req.status is RequestStatus.RUNNING:
                extra = min(want, budget)
                if not self._grow(req, req.num_computed + batch.num_new_tokens[k] + extra):
                    break
                batch.num_new_tokens[k] += extra
                budget -= extra
        return batch

    @staticmethod
    def _past_deadline(req: Request) -> str | None:
        """Why ``req`` is shed if its deadline has passed, else None."""
        late = time.monotonic() - req.deadline
        if late < 0:
            return None
        return (f"its deadline passed {late:.3f} s ago while it waited; retry with a longer deadline or when the "
                f"worker is less busy")

    def _tokens_ahead(self, uncached: int, ahead: list[int]) -> int:
        """The fewest tokens that running requests (``ahead``: what each has still to
        compute) compute before a request with ``uncached`` prompt tokens, admitted now,
        reaches its first token (tokens): a lower bound, so that the estimate errs towards
        serving.

        Running requests take each step's budget first. Without a long-prefill threshold
        each may take all it has left in the first step; with threshold T, a running
        prefill computes at most T tokens per step, and this request's prompt takes at
        least ``ceil(uncached / T)`` steps, so each running request computes at least
        ``min(left, T * ceil(uncached / T))`` tokens before it.
        """
        cap = self.long_prefill_token_threshold
        if not cap:
            return sum(ahead)
        most = cap * -(-uncached // cap)
        return sum(min(left, most) for left in ahead)

    def _hopeless(self, req: Request, ahead: list[int] | None = None) -> str | None:
        """Why ``req`` (its cached prefix locked, nothing computed) cannot reach its first
        token before its deadline, or None if it may (see ``deadline_shed_factor``).

        ``ahead`` holds the tokens each running request (those admitted earlier in this
        step included) has still to compute: the estimate is
        ``(_tokens_ahead(uncached, ahead) + uncached) / shed_rate()`` seconds.
        """
        why = self._past_deadline(req)
        if why is not None:
            return why
        left = req.deadline - time.monotonic()
        rate = self.shed_rate() if self.shed_rate is not None else None
        uncached = req.num_prompt_tokens - req.num_computed
        if not rate or self.deadline_shed_factor <= 0:
            return None
        before = self._tokens_ahead(uncached, ahead) if ahead else 0
        need = (before + uncached) / rate
        held = self._pressure.get(req.caller)  # a read: no entry for a caller with no outcomes yet
        pressure = held.value() if held is not None else 1.0
        factor = self.deadline_shed_factor * pressure
        if factor * need <= left:
            return None
        queue = f" after at least {before} tokens of the requests running before it" if before else ""
        raised = (f" (raised {pressure:.2f}x while this caller's admitted requests missed their deadlines)"
                  if pressure >= 1.005 else "")
        return (f"shed before its prefill: its {uncached} uncached prompt tokens{queue} need about {need:.2f} s at "
                f"this worker's fastest recent prefill rate ({rate:.0f} tokens/s), and --deadline-shed-factor "
                f"{self.deadline_shed_factor:g}{raised} x that ({factor * need:.2f} s) is more than the "
                f"{left:.2f} s left of its deadline; retry with a longer deadline, a shorter prompt, or when the worker "
                f"is less busy (a worker operator can lower the factor)")

    def _protect_active_tenants(self) -> bool:
        """Set the pool's protected share for this step: an equal split between the active
        tenants, idle holders' blocks first (module docstring). Returns whether more than one
        tenant is active (else protection is off)."""
        now = time.monotonic()
        seen = self._tenant_seen
        active = {r.namespace.tenant or None for r in self.running}
        active.update(r.namespace.tenant or None for r in self.waiting)
        for owner in active:  # seen now: the oldest entries are then of tenants with no request
            seen[owner] = now
            seen.move_to_end(owner)
        while seen:  # forget tenants idle for longer than the window, oldest first
            owner, t = next(iter(seen.items()))
            if now - t <= self.tenant_idle_s:
                break
            del seen[owner]
        active.update(seen)
        pool = self.cache.pool
        if len(active) < 2:
            pool.set_protection(None)
            return False
        pool.set_protection(pool.num_blocks // len(active),
                            [o for o in pool.blocks_by_owner() if o not in active])
        return True

    def _fair_to_admit(self, req: Request) -> bool:
        """Whether ``req`` may start now under the tenants' protected shares: its tenant runs
        no other request, or the blocks its whole prompt and the rest of every running
        request's prompt still need are within what its tenant can take without pushing an
        active tenant under its share (`BlockPool.room_for`). Counting every tenant's
        running prompts is conservative (another tenant may take some from its own cached
        blocks) but never counts the same free blocks for two tenants."""
        owner = req.namespace.tenant or None
        if not any((r.namespace.tenant or None) == owner for r in self.running):
            return True
        # chunked prefill allocates as it goes: what every running request will still take comes
        # out of the same free blocks (another tenant's as well as this one's)
        need = sum(max(0, self.blocks_needed(r.num_tokens) - len(r.block_table)) for r in self.running + [req])
        return need <= self.cache.pool.room_for(owner)

    def _chunk(self, req: Request) -> int:
        """Tokens ``req`` may compute this step before the budget: its remaining tokens,
        capped at the long-prefill threshold while it is in prefill and other requests
        are running or waiting."""
        n = req.num_tokens - req.num_computed
        cap = self.long_prefill_token_threshold
        if cap and self._contended and req.num_computed < req.num_prompt_tokens and n > cap:
            return cap
        return n

    def _inflight_blocks(self) -> set[bytes]:
        """Hashes of prompt blocks that running requests will compute but have not committed."""
        out: set[bytes] = set()
        for r in self.running:
            if r.num_computed < r.num_prompt_tokens:
                out.update(r.block_hashes[r.num_committed_blocks:r.num_prompt_tokens // self.block_size])
        return out

    def update_after_step(self, batch: ScheduledBatch) -> None:
        """Advance ``num_computed`` and commit newly full blocks to the prefix cache."""
        for req, n in zip(batch.requests, batch.num_new_tokens):
            req.num_computed += n
            self._commit_full_blocks(req)

    # ---------------------------------------------------------------- internals
    def _lock_cached_prefix(self, req: Request, inflight: set[bytes] | None = None) -> bool:
        """Lock the longest cached prefix of ``req`` (device, then lower tiers).

        Returns False, locking nothing, when the first block past the device match is in
        ``inflight`` (another request is computing it this moment): the caller retries later.
        """
        max_blocks = (req.num_tokens - 1) // self.block_size
        match = self.cache.index.match(req.block_hashes[:max_blocks], req.block_token_bytes)
        block_ids = list(match.values[:max_blocks])
        if inflight and len(block_ids) < max_blocks and req.block_hashes[len(block_ids)] in inflight:
            return False
        self.cache.lock(block_ids)
        if self.tiers is not None and req.num_cached >= 0:
            # scheduled again after a preemption: never on KV lossier than the request's first
            # schedule used, block by block (usage reported that one), so a request that
            # started on exact KV stays equal to a cold run and one that reused some lossy
            # blocks uses no more of them than it reported. Lossier device rows are loaded
            # again where a lower tier holds a good enough copy (`_load_from_tiers` applies the
            # same rule), else computed again; either copy then takes the lossier one's place in
            # the device index (`PrefixCache.commit`)
            row_loss = self.tiers.row_loss
            cut = _first_lossier([row_loss[b] for b in block_ids], req)
            if cut < len(block_ids):
                self.cache.unlock(block_ids[cut:])
                del block_ids[cut:]
        num_device = len(block_ids)
        media: list[str] = []
        if self.tiers is not None and num_device < max_blocks:
            media = self._load_from_tiers(req, block_ids, max_blocks)
        if self.tiers is not None:  # rows loaded from a lossy codec stay lossy on the device
            loss = [self.tiers.row_loss[b] for b in block_ids]
            # the rows this request computes depend on that KV: they carry its loss rank on
            # (`_grow`), so a later hit on them is reported lossy and never exported as exact
            req.context_loss = max(loss, default=0)
        req.block_table = block_ids
        req.num_computed = len(block_ids) * self.block_size
        req.num_committed_blocks = len(block_ids)
        if req.num_cached < 0:  # not run yet: what usage reports if this attempt is admitted
            # loads are this request's even when an attempt passed over made them (they stay in
            # the device pool): each block is reported by the tier it was loaded from
            for j, m in enumerate(media, num_device):
                req.loaded_from[j] = m
            by_tier: dict[str, int] = {}
            for j in range(len(block_ids)):
                m = req.loaded_from.get(j, "device")
                by_tier[m] = by_tier.get(m, 0) + self.block_size
            loss_bytes = bytes(loss) if self.tiers is not None else b""
            req.pending_usage = (req.num_computed, by_tier, loss_bytes)
        return True

    @staticmethod
    def _note_first_run(req: Request) -> None:
        """Fix what usage reports for ``req``, admitted to run for the first time: the
        cached prefix of this attempt (`_lock_cached_prefix`). An earlier attempt that was
        passed over (partial-prefill limit, no blocks, a prefix in flight) unlocked its
        blocks, and what it matched may since have been evicted or grown."""
        if req.num_cached >= 0 or req.pending_usage is None:
            return
        num_cached, by_tier, loss = req.pending_usage
        req.pending_usage = None
        req.loaded_from = {}
        req.allowed_loss = req.context_loss
        req.num_cached = num_cached
        req.cached_by_tier = by_tier
        req.cached_loss = loss
        req.num_lossy_cached = sum(1 for r in loss if r) * req.block_size

    def _load_from_tiers(self, req: Request, block_ids: list[int], max_blocks: int) -> list[str]:
        """Extend ``block_ids`` (the locked device prefix) with blocks loaded from lower tiers.

        Returns:
            the medium of each block loaded, in order.
        """
        start = len(block_ids)
        located = self.tiers.locate(req.block_hashes, req.block_token_bytes, start, max_blocks,
                                    req.namespace.root_hash())
        rate = self.prefill_rate() if self.prefill_rate is not None else None
        keep = self.tiers.worth_loading(located, self.block_size / rate if rate else None)
        if keep < len(located):  # slower than computing them: the request computes those
            self.tiers.release(located[keep:])
            located = located[:keep]
        if located and req.num_cached >= 0:  # scheduled again: nothing lossier than its first schedule
            cut = _first_lossier(self.tiers.loss_ranks(located), req, start)
            if cut < len(located):  # (`_lock_cached_prefix`)
                self.tiers.release(located[cut:])
                located = located[:cut]
        if not located:
            return []
        new = self.cache.allocate(len(located), req.namespace.tenant or None)
        if new is None:  # no room now; the request computes those blocks instead
            self.tiers.release(located)
            return []
        media = self.tiers.load(located, new)
        n = len(media)
        if n < len(new):
            self.cache.unlock(new[n:])
        block_ids.extend(new[:n])
        if n:
            self.cache.commit(_ChainView(req), block_ids, start, start + n, req.namespace.tenant or None)
        return media

    def _grow(self, req: Request, num_tokens: int) -> bool:
        """Make ``req.block_table`` cover ``num_tokens`` tokens; False if out of blocks."""
        need = self.blocks_needed(num_tokens) - len(req.block_table)
        if need <= 0:
            return True
        new = self.cache.allocate(need, req.namespace.tenant or None)
        if new is None:
            return False
        if self.tiers is not None:  # computed here, over the request's context (its loss rank)
            self.tiers.mark_computed(new, req.context_loss)
        req.block_table.extend(new)
        return True

    def _release(self, req: Request) -> None:
        if req.block_table:
            self.cache.unlock(req.block_table)
        req.block_table = []
        req.num_computed = 0
        req.num_committed_blocks = 0

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release(req)
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    def _commit_full_blocks(self, req: Request) -> None:
        full = min(req.num_computed // self.block_size, len(req.block_hashes))
        if full > req.num_committed_blocks:
            self.cache.commit(_ChainView(req), req.block_table, req.num_committed_blocks, full,
                              req.namespace.tenant or None)
            req.num_committed_blocks = full


class _ChainView:
    """Adapts a Request to the ``BlockHashes`` shape `PrefixCache.commit` reads."""

    __slots__ = ("_req",)

    def __init__(self, req: Request):
        self._req = req

    @property
    def hashes(self) -> list[bytes]:
        return self._req.block_hashes

    @property
    def block_size(self) -> int:
        return self._req.block_size

    @property
    def token_bytes(self) -> bytearray:
        return self._req.token_bytes

    def block_tokens(self, i: int) -> bytes:
        return self._req.block_token_bytes(i)
