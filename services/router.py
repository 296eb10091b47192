"""KV-aware router: kvmesh.v1.Router, with the same Generate contract as a worker.

For each request the router tokenizes once, hashes the prompt's full blocks in the
request's namespace (model, cache salt, adapter) exactly as workers do, asks the
`ClusterIndex` how many leading blocks each live worker holds, and lets the routing
policy pick a worker from that and each worker's load. It then records a short-lived
speculative index entry for the chosen worker (so a burst of same-prefix requests lands
together before the worker's KV events arrive) and relays the worker's token stream.

Load seen by policies is the larger of what the worker last reported in its lease and
what this router knows it has sent there and not yet seen finish (fresh within one
request). If the chosen worker is unreachable before any token was relayed, the router
retries once on the next choice; after that the client gets UNAVAILABLE.

Peer fetch hint: when the policy picks a worker that holds fewer of the request's leading
blocks than another live worker (the holder was overloaded or over its share), the
forwarded request names that holder in ``prefix_location`` (`prefix_holder`). The chosen
worker decides from measured rates whether pulling the blocks beats recomputing them
(`workers.peer_fetch`).

Model: a request's ``model_id``, when set, must name what the routed workers serve (their
KV model id, or the checkpoint's id without the compute-dtype tag); any other gets
NOT_FOUND from the router itself, with the served ids, as the HTTP front answers 404 for
an unknown ``model``, and is never forwarded. Empty means whatever is served. The namespace
a request is hashed in always takes the workers' model id (weights included). The HTTP
front lists the workers' checkpoint id once the leases are read, and answers to it, to its
compute-tagged form, to its name before ``@`` (while no other live checkpoint has that
name) and to the router's folder name (what it listed before the leases were read; only
while the workers routed to share the router's tokenizer) as the same model (`_fleet`,
`_aliases`). A full id (with ``@``) that a client names there becomes the request's
``model_id``, so a request that waited while the fleet moved to another checkpoint is
refused NOT_FOUND rather than answered by another model.

Tokenizer: the router never runs the model, so at start it reads only config.json and the
tokenizer files of ``--model`` (`model_identity.tokenizer_fingerprint`), never the weights.
Text, Tokenize, and chat prompts its HTTP front renders (token ids of the router's tokenizer,
flagged on the front's context: `_from_text`) go only to workers whose lease names the same
``tokenizer_id``, checked on the fleet each request is routed in; otherwise
FAILED_PRECONDITION says what to fix (HTTP 400: the client may send token ids), and token-id
prompts are still served (`services.membership`). Where a lease carries no tokenizer id (an
older worker) the router compares model ids as it used to: it hashes its own checkpoint then,
once, on a thread of its own (`_CheckpointId`), and text, chat and Tokenize requests wait for
that, within their deadline (token-id ones only when the workers serve several checkpoints).
A ``--model`` folder without weight files cannot be compared so: such workers then get
token ids only, and the refusal says so.

No usable worker (none of the router's model with an address, or a worker that refuses the
model its lease names, having restarted with another ``--model``) is UNAVAILABLE, as no
worker at all is: the fleet, not the request, is at fault, and a retry may find it fixed.

Access: the tenant of each request comes from the client's credentials (`Gate.tenant`,
`kvmesh.services.auth`), goes into the namespace the router hashes in, and is forwarded to
the worker in the cluster-internal ``tenant`` field over mutual TLS. ``Status`` details
(worker addresses, loads) are for peers only; other callers see the policy name.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import random
import re
import threading
import time
import uuid
from dataclasses import dataclass

import grpc

from kvmesh.cache_store.hashing import Namespace, hash_blocks
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.proto import kvmesh_pb2_grpc as pb_grpc
from kvmesh.services.auth import Gate
from kvmesh.services.cluster_index import ClusterIndex, reported_tier_weights, weighted_blocks
from kvmesh.services.index_subscriber import IndexSubscriber
from kvmesh.services.membership import Compatibility
from kvmesh.services.shared_load import SharedLoad, matched_prefix
from kvmesh.services.shortlist import SHORTLIST_HOLDERS, SHORTLIST_LEAST, SHORTLIST_SAMPLE, shortlist
from kvmesh.services.policies import RoutedShare, RouteRequest, WorkerView, make_policy, prefix_holder
from kvmesh.services.rate_limit import TenantRateLimit
from kvmesh.workers.config import ModelConfig
from kvmesh.workers.grpc_guard import LogLimiter, TenantCap, clip
from kvmesh.workers.model_identity import (NoWeightFiles, base_model_id, checkpoint_model_id,
                                           config_without_weights, tokenizer_fingerprint)
from kvmesh.workers.grpc_host import (CHANNEL_OPTIONS, DEFAULT_MAX_CONCURRENT_RPCS, ChannelPool, GrpcHost,
                                      accepts_keepalive)
from kvmesh.workers import limits, wire
from kvmesh.workers.request import InvalidRequest
from kvmesh.workers.tokenizer import load_tokenizer

log = logging.getLogger(__name__)

#: Lifetime of a speculative index entry (seconds).
SPECULATIVE_TTL_S = 2.0


@dataclass
class _Fleet:
    """What the router derives from one version of the live leases (`IndexSubscriber.
    live_version`), kept until the next, so that a request costs no pass over the fleet."""

    version: object
    live: dict[str, dict]          # every live lease
    usable: dict[str, dict]        # those of the router's model and block size (`Compatibility`)
    ids: list[str]                 # usable worker ids, for the shortlist's random sample
    block_size: int
    model_id: str
    why: str                       # why none is usable ("" when some are)
    text_reason: str               # why text may not go to them ("" when it may; `Selection`)
    needs_model_id: bool           # the router's checkpoint id would change the choice (`Selection`)
    checkpoints: int               # distinct checkpoints (model ids without compute tag) among the live
    max_context: int               # longest context any live worker serves (tokens)
    min_context: int | None        # shortest context a usable lease states; None: none states one


class _Usable:
    """Membership in ``live`` minus ``exclude`` (a shortlist's filter), without a copy."""

    __slots__ = ("live", "exclude")

    def __init__(self, live: dict, exclude: set[str]):
        self.live, self.exclude = live, exclude

    def __contains__(self, wid) -> bool:
        return wid in self.live and wid not in self.exclude


@dataclass
class _Inflight:
    """What this router has sent to one worker and not yet seen answered."""

    running: int = 0
    pending_prefill_tokens: int = 0
    last_done_wall: float = 0.0   # time.time() when a request of ours there last ended


class RouterServicer(pb_grpc.RouterServicer):
    """Implements kvmesh.v1.Router over a ClusterIndex fed by an IndexSubscriber."""

    def __init__(self, index: ClusterIndex, subscriber: IndexSubscriber, policy_name: str = "kv_aware",
                 model_dir: str | None = None, seed: int | None = None, max_attempts: int = 2,
                 gate: Gate | None = None):
        self.index = index
        self.subscriber = subscriber
        self.policy = make_policy(policy_name)
        self.policy_name = policy_name
        self.model_dir = model_dir
        self.config = _load_config(model_dir)  # config.json only: model_id is the folder's name
        #: the router's tokenizer (text prompts, Tokenize, the HTTP front's chat prompts); whether
        #: the workers routed to share it is checked per request (`_generate`, `refuse_text`)
        self.tokenizer = load_tokenizer(model_dir, self.config)
        try:
            #: `model_identity.tokenizer_fingerprint` of ``model_dir``, compared with the workers' leases
            self.tokenizer_id = tokenizer_fingerprint(model_dir)
        except OSError as exc:
            raise ValueError(f"--model {model_dir}: cannot read its tokenizer files ({exc})") from None
        # the router's own checkpoint id (weights hashed), only once a lease needs it
        self.checkpoint_id = _CheckpointId(model_dir, self._checkpoint_id_done) if model_dir is not None else None
        self.compat = Compatibility(None if model_dir is not None else self.config.model_id, self.tokenizer_id,
                                    own_model=model_dir is not None,
                                    router_name=f"--model {model_dir}" if model_dir is not None else
                                    "the built-in model (no --model)")
        self.compat.model_id_pending = model_dir is not None
        #: HTTP fronts whose served model name follows the workers' (`_fleet`, `_follow_fleet`)
        self.http_fronts: list = []
        #: set by `begin_shutdown`: waits for the checkpoint id end UNAVAILABLE
        self.stopping = False
        self._stop_waiters: set[asyncio.Future] = set()
        self.rng = random.Random(seed)
        self.max_attempts = max_attempts
        self.gate = gate or Gate()
        #: per-tenant bound on Generate calls in flight (`--max-inflight-per-tenant`; 0: none)
        self.tenant_cap = TenantCap(0)
        #: per-tenant request and token budgets (`services.rate_limit`); None: none
        self.rate_limit: TenantRateLimit | None = None
        self._channels = ChannelPool(tls=self.gate.tls)  # mutual TLS to workers when configured
        self._inflight: dict[str, _Inflight] = {}
        self.routed = RoutedShare()
        self._fleet_cache: _Fleet | None = None
        # one line per retry would let a flood of requests to busy workers flood the log
        self._retry_log = LogLimiter(log, "retries on another worker")
        #: `services.metrics.RouterMetrics` when metrics are served, else None
        self.metrics = None
        #: other router replicas' in-flight counts (`services.shared_load`); None: this router alone
        self.shared: SharedLoad | None = None

    # ------------------------------------------------------------- helpers
    def _channel(self, address: str, keepalive: bool = False) -> grpc.aio.Channel:
        return self._channels.get(address, keepalive)

    async def close(self) -> None:
        await self._channels.close()

    def _select(self, live: dict[str, dict]):
        """`Compatibility.select` of ``live``; starts hashing the router's checkpoint (on a
        thread) when the selection needs its id."""
        if self.checkpoint_id is not None:
            self.compat.model_id_pending = self.checkpoint_id.pending()
        sel = self.compat.select(live)
        if sel.needs_model_id:
            try:
                self.checkpoint_id.start()
            except RuntimeError:  # no event loop running: the next selection on one starts it
                pass
        return sel

    def _checkpoint_id_done(self, value: str | None, problem: str) -> None:
        """`_CheckpointId`'s result, on the event loop: select again with it."""
        self.compat.router_model_id = value
        self.compat.model_id_problem = problem
        self.compat.model_id_weightless = self.checkpoint_id.weightless
        self.compat.model_id_pending = self.checkpoint_id.pending()
        self._fleet_cache = None

    def begin_shutdown(self) -> None:
        """The server is stopping: requests waiting for the router's checkpoint id end now
        (UNAVAILABLE, `_wait_checkpoint_id`), and later ones do not start waiting, so that
        the HTTP front and the gRPC server stop without waiting for a hash. Call on the
        event loop."""
        self.stopping = True
        for waiter in list(self._stop_waiters):
            if not waiter.done():
                waiter.set_result(None)

    async def _wait_checkpoint_id(self, context=None) -> None:
        """Wait until the router's checkpoint id is computed or failed (it is computed once;
        a caller that leaves does not stop it), at most until ``context``'s deadline (None,
        or a context without one: no bound), which ends the call DEADLINE_EXCEEDED, and
        until the server begins to stop (`begin_shutdown`), which ends it UNAVAILABLE."""
        fut = self.checkpoint_id.start() if self.checkpoint_id is not None else None
        if fut is None:
            return
        if self.stopping:
            await self._abort_stopping(context)
        left = context.time_remaining() if context is not None else None
        done = asyncio.shield(fut)
        stopped = asyncio.get_running_loop().create_future()
        self._stop_waiters.add(stopped)
        try:
            await asyncio.wait((done, stopped), timeout=left, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._stop_waiters.discard(stopped)
            stopped.cancel()
            if not done.done():
                done.cancel()  # the shield only: the hash goes on for the next caller
        if fut.done() or context is None:
            return
        if self.stopping:
            await self._abort_stopping(context)
        await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                            "the request's deadline passed while the router hashed its checkpoint (to compare "
                            "it with workers that publish no tokenizer id): retry with a longer deadline, or "
                            "send token_ids")

    @staticmethod
    async def _abort_stopping(context) -> None:
        if context is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                "the router is shutting down: retry (another router replica answers)")

    def text_refusal(self) -> str:
        """Why text must not be tokenized for the workers routed to now ("" when it may).
        Does not wait for the router's checkpoint id (`refuse_text` does)."""
        fleet = self._fleet()
        return fleet.text_reason if fleet.usable else ""

    async def refuse_text(self, context) -> None:
        """Abort FAILED_PRECONDITION (`Selection.text_reason`) when text must not be tokenized
        for the workers routed to now; first, when an older lease needs the router's checkpoint
        id to decide, wait for it as a text Generate does (bounded by ``context``'s deadline)."""
        fleet = self._fleet()
        if fleet.needs_model_id:
            await self._wait_checkpoint_id(context)
            fleet = self._fleet()
        if fleet.usable and fleet.text_reason:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, fleet.text_reason)

    def served_context(self) -> int:
        """Longest context (tokens) a live worker serves (`context_limit`; the model's own
        when no lease states one): what an HTTP front checks a prompt's length against."""
        return self._fleet().max_context

    def _fleet(self) -> _Fleet:
        """The live leases and what follows from them, recomputed only when the subscriber's
        `live_version` moves (every request when the subscriber has none)."""
        version = getattr(self.subscriber, "live_version", None)
        cached = self._fleet_cache
        if cached is not None and version is not None and cached.version == version:
            return cached
        live = self.subscriber.live_workers()
        sel = self._select(live)
        usable = {w: info for w, info in sel.workers.items() if info.get("address")}  # nothing to dial otherwise
        stated = [int(info["max_model_len"]) for info in usable.values()
                  if isinstance(info.get("max_model_len"), int) and info["max_model_len"] > 0]
        checkpoints = len({base_model_id(str(info.get("model_id", ""))) for info in live.values()})
        fleet = _Fleet(version, live, usable, list(usable), sel.block_size, sel.model_id, sel.reason,
                       sel.text_reason, sel.needs_model_id, checkpoints,
                       context_limit(live, self.config.max_position_embeddings), min(stated) if stated else None)
        if sel.model_id and self.model_dir is not None:
            served = base_model_id(sel.model_id)
            for front in self.http_fronts:
                front.model_id = served
                front.model_aliases = _aliases(served, sel.model_id, self.config.model_id,
                                               speaks=bool(usable) and not sel.text_reason, live=live)
                # a full checkpoint id a client names is checked again where the request is routed
                front.forward_model_id = True
        # gone, or now of another model or block size: a worker's share must not weigh on the
        # mean nor fill the least-routed places
        self.routed.keep_only(usable)
        for wid in usable:
            self.routed.track(wid)  # idle workers are candidates of the shortlist's least-routed
        self.routed.set_fleet(len(usable))  # the share window grows with the fleet
        self._fleet_cache = fleet
        return fleet

    def _views(self, live: dict[str, dict], hashes: list[bytes], now: float, exclude: set[str],
               others: dict | None = None, ids: list[str] | None = None
               ) -> tuple[list[WorkerView], float | None, int | None]:
        """Views of the workers a policy is shown, with `RouteRequest`'s ``routed_mean`` and
        ``common_blocks`` (None: the policy computes them from the views).

        A policy that takes a shortlist (`uses_shortlist`, kv_aware) sees, in a fleet larger
        than a shortlist, only `services.shortlist.shortlist`'s workers: the cost per request
        is O(matched blocks + holders + a sample), not O(workers); the fleet's mean share and
        widely-held depth come from `RoutedShare.total` and `ClusterIndex.common_depth`, as in
        the simulator.

        ``ids``: the keys of ``live`` when ``live`` is the whole usable fleet (`_Fleet.ids`),
        the set whose shares `routed` tracks; None when ``live`` is a part of it (the workers
        whose context fits a long request), which is then shown in full: the least-routed
        workers and the mean share of the whole fleet would not be those of that part."""
        routed_mean = common = None
        if getattr(self.policy, "uses_shortlist", False) and ids is not None and \
                len(live) > SHORTLIST_HOLDERS + SHORTLIST_LEAST + SHORTLIST_SAMPLE:
            matches = shortlist(self.index, self.routed, hashes, now, ids, self.rng, live_set=_Usable(live, exclude))
            shown = [(wid, live[wid]) for wid in matches]
            mean_total = self.routed.total() + (sum(o[2] for w, o in others.items() if w in live) if others else 0.0)
            routed_mean = mean_total / len(live)
            widely = getattr(self.policy, "widely_held", None)
            if widely is not None:
                common = self.index.common_depth(hashes, int(widely * len(live)) + 1) if hashes else 0
        else:
            matches = self.index.match(hashes, now) if hashes else {}
            shown = [(wid, info) for wid, info in live.items() if wid not in exclude]
        views = []
        for wid, info in shown:
            if not info.get("address"):
                continue
            load = info.get("load") or {}
            local = self._inflight.get(wid) or _Inflight()
            o_running, o_prefill, o_routed = (others or {}).get(wid, (0, 0, 0.0))
            if o_running or o_prefill:  # other replicas' requests there count as ours would
                local = _Inflight(local.running + o_running, local.pending_prefill_tokens + o_prefill,
                                  local.last_done_wall)
            # a lease written before our last request there ended still counts that request:
            # trust our own, fresher, counts until the next heartbeat
            stale = float(info.get("ts", 0.0)) < local.last_done_wall
            m = matches.get(wid)
            views.append(WorkerView(
                worker_id=wid,
                address=info["address"],
                matched_blocks=m.num_blocks if m else 0,
                weighted_blocks=weighted_blocks(m, reported_tier_weights(load.get("tier_weights"))) if m else 0.0,
                running_requests=local.running if stale else max(int(load.get("running_requests", 0)),
                                                                 local.running),
                waiting_requests=int(load.get("waiting_requests", 0)),
                queued_prefill_tokens=local.pending_prefill_tokens if stale else max(
                    int(load.get("queued_prefill_tokens", 0)), local.pending_prefill_tokens),
                free_blocks=int(load.get("free_blocks", 0)),
                total_blocks=int(load.get("total_blocks", 0)),
                routed_recent=self.routed.value(wid) + o_routed,
            ))
        return views, routed_mean, common

    def decide(self, live: dict[str, dict], num_tokens: int, hashes: list[bytes], block_size: int, now: float,
               exclude: set[str], others: dict | None = None, ids: list[str] | None = None, sender: str = ""
               ) -> tuple[WorkerView | None, list[WorkerView], float | None]:
        """One routing decision: the policy's choice among `_views` of ``live`` minus
        ``exclude`` for a request of ``num_tokens`` tokens (``hashes``: its block hashes),
        the views it chose from, and the fleet's mean routed share when the views are a
        shortlist (else None); (None, [], None) when no worker is left to show."""
        views, routed_mean, common = self._views(live, hashes, now, exclude, others, ids)
        if not views:
            return None, [], None
        req = RouteRequest(num_tokens, hashes, block_size, routed_mean, common, retry=bool(exclude), sender=sender)
        return self.policy.choose(req, views, self.rng), views, routed_mean

    def _apply_shared_placements(self, hashes: list[bytes], live: dict[str, dict]) -> None:
        """Other replicas' recent placements that share this request's prefix become
        speculative entries here too (`services.shared_load.matched_prefix`)."""
        now, wall = time.monotonic(), time.time()
        for wid, expiry, cps in self.shared.remote_placements:
            if wid in live:
                n = matched_prefix(hashes, cps)
                if n:
                    self.index.add_speculative(wid, hashes[:n], now, min(SPECULATIVE_TTL_S, expiry - wall))

    def shared_counts(self) -> dict[str, tuple[int, int, float]]:
        """This router's ``{worker_id: (running, pending prefill tokens, routed share)}``."""
        return {w: (st.running, st.pending_prefill_tokens, self.routed.value(w)) for w, st in self._inflight.items()}

    def _note_routed(self, wid: str, prefill_tokens: int) -> _Inflight:
        fleet = self._fleet_cache
        if fleet is None or wid in fleet.usable:  # a request on an older fleet (a retry) may pick
            self.routed.note(wid)                 # a worker that has left since: not counted
        st = self._inflight.setdefault(wid, _Inflight())
        st.running += 1
        st.pending_prefill_tokens += prefill_tokens
        return st

    def _prompt_ids(self, request: pb.GenerateRequest) -> list[int]:
        kind = request.WhichOneof("prompt")
        if kind == "token_ids":
            return list(request.token_ids.ids)
        if kind == "text":
            return self.tokenizer.encode(request.text)
        return []

    # ----------------------------------------------------------------- RPCs
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        caller, tenant, salt = await self.gate.identity(context, request, edge=True)
        # aclosing at each layer: a caller that stops reading (a cancelled stream, the HTTP
        # front's aclose) runs _generate's own clean-up now (engine abort, in-flight counts)
        async with contextlib.aclosing(self.tenant_cap.stream(
                caller, context, self._generate(request, context, tenant, salt, caller))) as out:
            async for msg in out:
                yield msg

    async def _generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, tenant: str,
                        salt: str, caller: str):
        # text, or token ids the HTTP front made from text with this router's tokenizer (a chat
        # prompt): either may go only to workers of the router's tokenizer, checked now, on the
        # fleet this request is routed in (`_from_text`)
        text = _from_text(request, context)
        fleet = self._fleet()
        # an older worker's lease, or checkpoints to choose from: the router's own checkpoint id
        # decides whether text may go there, and (of several checkpoints) where anything goes
        if fleet.needs_model_id and (text or fleet.checkpoints > 1):
            await self._wait_checkpoint_id(context)
            fleet = self._fleet()
        max_len = fleet.max_context
        # tokens the completion needs room for: the worker lowers an up-to-context max_tokens
        completion = 1 if request.sampling.max_tokens_up_to_context else \
            max(1, request.sampling.max_tokens) if request.HasField("sampling") else wire.DEFAULT_MAX_TOKENS
        try:  # before tokenizing or hashing: a huge body costs milliseconds, not the router
            limits.check_prompt_size(request, max_len, "the workers' model")
            ids = self._prompt_ids(request)
            limits.check_token_count(len(ids), max_len, "the workers' model")
            limits.check_completion_room(len(ids), completion, max_len, "the workers' model")
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if not ids:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "prompt is empty: send at least one token or non-empty text")
        if not fleet.live:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no live workers registered: start workers or retry")
        # only workers of the router's model identity and the cluster's block size (others are logged)
        live, block_size, model_id, ids_of_live = fleet.usable, fleet.block_size, fleet.model_id, fleet.ids
        if not live:  # the fleet's configuration, not the request: UNAVAILABLE (HTTP 503) until it changes
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                fleet.why or "no live worker of the router's model can be reached yet: retry")
        # a worker of a shorter context would only refuse it (no pass over the fleet when all fit)
        fitting = live if fleet.min_context is None or len(ids) + completion <= fleet.min_context else \
            fitting_workers(live, len(ids), completion)
        if fitting is not live:
            ids_of_live = None
        if not fitting:
            limit = context_limit(live, self.config.max_position_embeddings)
            if request.sampling.max_tokens_up_to_context:  # the client named no max_tokens
                why = (f"prompt has {len(ids)} tokens but the workers serving this model take at most {limit - 1} "
                       f"(context {limit} tokens): shorten it")
            else:
                why = (f"prompt has {len(ids)} tokens and max_tokens is {completion}, but the workers serving this "
                       f"model take at most {limit} tokens of prompt and completion together (context {limit} "
                       f"tokens): shorten the prompt or lower max_tokens")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)
        live = fitting
        served = sorted({model_id, base_model_id(model_id)})
        if request.model_id and request.model_id not in served:  # a client's error: refused here, not logged
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"model_id {clip(request.model_id)!r} is not served here; the workers serve {' or '.join(map(repr, served))}: "
                f"send one of these, or leave model_id empty for whatever is served")
        if text and fleet.text_reason:  # the workers' tokenizer is not ours
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, fleet.text_reason)
        if self.rate_limit is not None:  # last: a request refused for any other reason spends nothing
            refused = await self.rate_limit.check(caller, len(ids))
            if refused is not None:
                message, wait = refused
                if wait is None:  # larger than the whole budget: no wait makes it fit (HTTP 400, not 429)
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
                context.set_trailing_metadata((("retry-after", str(math.ceil(wait))),))
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
        ns = Namespace(model_id=model_id, cache_salt=salt, adapter_id=request.adapter_id, tenant=tenant)
        hashes = list(hash_blocks(ids, block_size, ns.root_hash()).hashes)
        forward = pb.GenerateRequest()
        forward.CopyFrom(request)
        forward.DiscardUnknownFields()  # fields this router does not know never reach a worker
        forward.token_ids.ids[:] = ids  # tokenized once; workers never re-tokenize
        forward.request_id = request.request_id or uuid.uuid4().hex
        forward.tenant, forward.cache_salt, forward.caller_tenant = tenant, salt, caller
        forward.model_id = model_id  # a worker of another model refuses (and logs) instead of computing
        tried: set[str] = set()
        last_error = ""
        last_code = grpc.StatusCode.UNAVAILABLE
        others = None
        if self.shared is not None:
            others = await self.shared.others()
            self._apply_shared_placements(hashes, live)
        for _attempt in range(self.max_attempts):
            now = time.monotonic()
            chosen, views, routed_mean = self.decide(live, len(ids), hashes, block_size, now, tried, others,
                                                     ids_of_live, sender=caller)
            if chosen is None:
                break
            tried.add(chosen.worker_id)
            if self.metrics is not None:
                self.metrics.observe_decision(chosen, views, _attempt, routed_mean)
            self.index.add_speculative(chosen.worker_id, hashes, now, SPECULATIVE_TTL_S)
            prefill = len(ids) - chosen.matched_blocks * block_size
            holder = prefix_holder(chosen, same_producer(chosen, views, live))
            if holder is not None:
                forward.prefix_location.CopyFrom(pb.PrefixLocation(
                    worker_id=holder.worker_id, address=holder.address, num_blocks=holder.matched_blocks))
            else:
                forward.ClearField("prefix_location")
            st = self._note_routed(chosen.worker_id, prefill)
            if self.shared is not None:
                self.shared.note_placement(chosen.worker_id, hashes, SPECULATIVE_TTL_S)
                await self.shared.publish()  # seen by the other replicas before their next decision
            relayed = False
            # keepalive PINGs (a frozen worker's call fails in ~10 s) to workers that accept them
            stub = pb_grpc.WorkerStub(self._channel(chosen.address,
                                                    accepts_keepalive(live.get(chosen.worker_id) or {})))
            timeout = context.time_remaining()
            call = None
            try:
                call = stub.Generate(forward, timeout=timeout)
                async for msg in call:
                    if not relayed:
                        relayed = True
                        st.pending_prefill_tokens = max(0, st.pending_prefill_tokens - prefill)
                        if self.shared is not None:
                            self.shared.publish_soon()
                    yield msg
                return
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                # the worker refused the model id its own lease names (`forward.model_id`): it
                # restarted with another --model and its lease is not renewed yet. Nothing the
                # client sent is wrong: another worker may take it, else UNAVAILABLE (retry)
                stale = code == grpc.StatusCode.FAILED_PRECONDITION and not relayed
                retryable = code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED) or stale
                if retryable and not relayed and _attempt + 1 < self.max_attempts:
                    # the client sees the worker's id, as in every response, but not its address
                    last_error = _stale_lease(chosen.worker_id, exc) if stale else \
                        f"worker {chosen.worker_id}: {code.name}: {_client_details(exc)}"
                    last_code = grpc.StatusCode.UNAVAILABLE if stale else code
                    self._retry_log.warn("worker %s at %s: %s: %s; trying another worker", chosen.worker_id,
                                         chosen.address, code.name, clip(exc.details() or ""))
                    continue
                details = _client_details(exc) or code.name
                if stale:
                    code, details = grpc.StatusCode.UNAVAILABLE, _stale_lease(chosen.worker_id, exc)
                if relayed and code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL,
                                        grpc.StatusCode.UNKNOWN) and not _from_worker(exc):
                    # the stream broke under way (a worker killed, a connection lost): say so,
                    # not only gRPC's "Stream removed (Socket closed)"
                    details = (f"worker {chosen.worker_id} went away during the answer ({details}); the tokens "
                               f"streamed so far are all there is: retry the request")
                await context.abort(code, details)
            finally:
                if call is not None and not call.done():
                    # the caller left (a cancelled stream, an HTTP client gone): the worker aborts the
                    # request now instead of generating to the end for nobody
                    call.cancel()
                st.running = max(0, st.running - 1)
                st.last_done_wall = time.time()
                if not relayed:
                    st.pending_prefill_tokens = max(0, st.pending_prefill_tokens - prefill)
                if self.shared is not None:
                    self.shared.publish_soon()
        await context.abort(last_code, last_error or "no live worker could take the request")

    async def Status(self, request, context):
        if not self.gate.caller(context).is_peer:  # addresses and loads are for operators
            if any(k == "authorization" for k, _ in context.invocation_metadata() or ()):
                # a caller who sent a key learns that it is wrong, rather than a "withheld" that
                # reads as success (the policy name stays public to anyone who sends none)
                await self.gate.require_caller(context, "Status")
            return pb.RouterStatus(policy=self.policy_name, details_withheld=True)
        live = self.subscriber.live_workers()
        usable = self._select(live).workers
        out = pb.RouterStatus(policy=self.policy_name, indexed_blocks=self.index.num_blocks())
        for wid, info in sorted(live.items()):
            load = info.get("load") or {}
            out.workers.append(pb.WorkerStatus(
                worker_id=wid, address=info.get("address", ""),
                load=pb.Load(**{k: int(load.get(k, 0)) for k in (
                    "running_requests", "waiting_requests", "queued_prefill_tokens", "free_blocks",
                    "total_blocks")}, tier_weights=reported_tier_weights(load.get("tier_weights"), {})),
                cached_blocks=self.index.num_blocks(wid), model_id=str(info.get("model_id", "")),
                block_size=int(info.get("block_size", 0) or 0),
                routed_around="" if wid in usable else (self.compat.reason(wid) or "not compatible")))
        return out


class WorkerFacade(pb_grpc.WorkerServicer):
    """kvmesh.v1.Worker's Generate and Tokenize served by the router.

    Lets any Worker client (``kvmesh generate``, the load harness) target the router
    unchanged; the worker-only RPCs (GetInfo, GetLoad, GetSnapshot, ClearCache, FetchBlocks)
    answer UNIMPLEMENTED here, without a log line (the generated base class would log a
    NotImplementedError traceback for each call, which anyone could use to flood the log).
    """

    def __init__(self, router: RouterServicer):
        self.router = router

    @staticmethod
    async def _worker_only(context, method: str) -> None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                            f"{method} is served by workers, not by the router: call a worker")

    async def GetInfo(self, request, context):
        await self._worker_only(context, "GetInfo")

    async def GetLoad(self, request, context):
        await self._worker_only(context, "GetLoad")

    async def GetSnapshot(self, request, context):
        await self._worker_only(context, "GetSnapshot")

    async def ClearCache(self, request, context):
        await self._worker_only(context, "ClearCache")

    async def FetchBlocks(self, request, context):
        await self._worker_only(context, "FetchBlocks")
        yield pb.BlockData()  # never reached: a generator, as the streaming RPC's handler must be

    async def Generate(self, request, context):
        async for msg in self.router.Generate(request, context):
            yield msg

    async def Tokenize(self, request, context):
        await self.router.gate.require_caller(context, "Tokenize")
        max_len = context_limit(self.router.subscriber.live_workers(), self.router.config.max_position_embeddings)
        try:
            limits.check_text_size(request.text, max_len, "the workers' model")
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        # the ids are only worth having if the workers routed to would make the same ones
        await self.router.refuse_text(context)
        return pb.TokenizeResponse(ids=self.router.tokenizer.encode(request.text))


def _load_config(model_dir: str | None) -> ModelConfig:
    """The router's model config: config.json only (its ``model_id`` is the folder's name, not
    the workers' id), or the built-in model's."""
    if model_dir is None:
        return ModelConfig.tiny()
    return config_without_weights(model_dir)


def model_dir_problem(model_dir: str | None) -> str | None:
    """What is wrong with a router's ``--model`` folder (missing, no usable config.json or
    tokenizer, a tokenizer file that cannot be read), or None. Reads config.json and the
    tokenizer files; never a weight file (the router needs none to start)."""
    if model_dir is None:
        return None
    if not os.path.isdir(model_dir):
        what = "a file, not a directory" if os.path.isfile(model_dir) else "no such directory"
        return f"--model {model_dir}: {what} (the workers' Hugging Face folder: config.json and tokenizer files)"
    try:
        load_tokenizer(model_dir, config_without_weights(model_dir))
        tokenizer_fingerprint(model_dir)
    except ValueError as exc:
        return f"--model: {exc}"
    except OSError as exc:
        return f"--model {model_dir}: cannot read its tokenizer files ({exc})"
    return None


def _aliases(served: str, tagged: str, folder: str, speaks: bool, live: dict[str, dict]) -> frozenset[str]:
    """The names an HTTP front answers to besides ``served`` (the checkpoint id the workers
    routed to serve; ``tagged``: with their compute tag): those two; the name before ``@``
    only when no other live checkpoint has it (it would name either); the router's folder
    name (``folder``: what the front listed before the leases were read) only when the
    workers routed to share the router's tokenizer (``speaks``): otherwise that folder is
    not the model they serve. Pure."""
    names = {served, tagged}
    base = served.partition("@")[0]
    if len({base_model_id(str(info.get("model_id", ""))) for info in live.values()
            if str(info.get("model_id", "")).partition("@")[0] == base}) <= 1:
        names.add(base)
    if speaks:
        names.add(folder)
    return frozenset(names)


def _from_text(request: pb.GenerateRequest, context) -> bool:
    """Whether ``request``'s prompt is text, or token ids that this process's HTTP front made
    from text with the router's tokenizer (a chat prompt: its `_HttpContext` says
    ``tokenized_from_text``). Token ids a client sent, over gRPC or HTTP, are neither."""
    return request.WhichOneof("prompt") == "text" or getattr(context, "tokenized_from_text", False) is True


def _stale_lease(worker_id: str, exc: grpc.aio.AioRpcError) -> str:
    """What the client is told when ``worker_id`` refused the model its lease names."""
    return (f"worker {worker_id} no longer serves the model its lease names ({clip(exc.details() or '', 300)}); "
            f"the router routes around it once its lease is renewed: retry in a moment")


class _CheckpointId:
    """The router's checkpoint id (`model_identity.checkpoint_model_id`: every weight file
    hashed), computed only when a selection needs it, at most once at a time, on a daemon
    thread (a shutdown does not wait for it), and kept. After a failure it is tried again no
    sooner than ``RETRY_S`` seconds later, and after each further failure twice as late, up
    to ``MAX_RETRY_S`` (each attempt reads every weight file); a success ends the retries.
    The first failure, each longer wait and a new problem are logged as errors, the others
    as warnings. A folder without weight files fails at once (``weightless``: no worker
    loads it, so no worker's id could match).

    Args:
        model_dir: the router's ``--model``.
        on_done: ``(id or None, problem)``, called on the event loop with each result.
    """

    #: Seconds after the first failed attempt before the next may start.
    RETRY_S = 60.0
    #: The longest wait between attempts (the wait doubles from ``RETRY_S`` up to it).
    MAX_RETRY_S = 3600.0

    def __init__(self, model_dir: str, on_done):
        self.model_dir = model_dir
        self.on_done = on_done
        self.value: str | None = None
        self.problem = ""
        #: the last attempt found no weight file in ``model_dir`` (`model_identity.NoWeightFiles`)
        self.weightless = False
        self._future: asyncio.Future | None = None
        self._failed_at: float | None = None
        #: seconds from the last failure before the next attempt (0: none failed)
        self.retry_s = 0.0

    def pending(self) -> bool:
        """Whether the id is unknown and being computed, or may be computed now."""
        if self.value is not None:
            return False
        return self._future is not None or self._failed_at is None or \
            time.monotonic() - self._failed_at >= self.retry_s

    def start(self) -> asyncio.Future | None:
        """The running computation's future (its result: the id, or None on failure), started
        now if none runs; None when the id is known or the wait after a failure
        (``retry_s``) has not passed.
        Call on the event loop."""
        if self._future is not None or not self.pending():
            return self._future
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._future = fut
        began = time.monotonic()
        log.info("hashing the weight files of %s for the model id older workers are compared by", self.model_dir)

        def finish(value: str | None, problem: str, weightless: bool) -> None:
            self._future = None
            self.weightless = weightless
            if value is not None:
                self.value, self.problem, self.retry_s, self._failed_at = value, "", 0.0, None
                log.info("router's checkpoint id: %s (%.1f s)", value, time.monotonic() - began)
            else:
                before, again = self.retry_s, (problem != self.problem)
                self.retry_s = self.RETRY_S if before == 0 else min(before * 2, self.MAX_RETRY_S)
                self.problem, self._failed_at = problem, time.monotonic()
                level = logging.ERROR if self.retry_s != before or again else logging.WARNING
                if weightless:
                    log.log(level, "the router's --model %s holds no weight files (*.safetensors): workers that "
                            "publish no tokenizer id (an older kvmesh) get no text prompts; upgrade them or give "
                            "the router the full checkpoint (looking again in %.0f s at the earliest)",
                            self.model_dir, self.retry_s)
                else:
                    log.log(level, "could not hash the router's checkpoint %s (%s): workers that publish no "
                            "tokenizer id get no text prompts; retrying in %.0f s at the earliest",
                            self.model_dir, problem, self.retry_s)
            try:
                self.on_done(self.value, self.problem)
            finally:
                if not fut.done():
                    fut.set_result(self.value)

        def work() -> None:
            try:
                result = (checkpoint_model_id(self.model_dir), "", False)
            except Exception as exc:  # noqa: BLE001 - OSError mostly; any failure is reported, not raised
                result = (None, str(exc) or type(exc).__name__, isinstance(exc, NoWeightFiles))
            try:
                loop.call_soon_threadsafe(finish, *result)
            except RuntimeError:  # the loop has closed: nobody waits any more
                pass

        threading.Thread(target=work, name="kvmesh-checkpoint-id", daemon=True).start()
        return fut


async def _follow_fleet(servicer: RouterServicer, period_s: float) -> None:
    """Recompute the router's fleet every ``period_s`` seconds (only when the leases moved),
    so that what follows it (the HTTP front's model name) does between requests too."""
    while True:
        await asyncio.sleep(period_s)
        try:
            servicer._fleet()
        except Exception:  # noqa: BLE001 - a bug here must not end the loop nor the server
            log.exception("recomputing the router's fleet failed")


_ADDRESS = re.compile(r"(ipv4|ipv6|unix|dns):\S+|\b\d{1,3}(\.\d{1,3}){3}(:\d+)?|\[[0-9a-fA-F:]+\](:\d+)?")


def _client_details(exc: grpc.aio.AioRpcError) -> str:
    """A worker call's error details as a client may see them: a failure to reach the
    worker says so without its address (addresses are for peers: `Router.Status`); the
    worker's own refusals pass unchanged."""
    details = exc.details() or ""
    if exc.code() == grpc.StatusCode.UNAVAILABLE and ("failed to connect" in details.lower()
                                                      or _ADDRESS.search(details)):
        return "the worker could not be reached"
    return details


def _from_worker(exc: grpc.aio.AioRpcError) -> bool:
    """True when the worker itself ended the call with this status (its servicer aborted),
    rather than the transport breaking: a worker's aborts carry its own wording, a broken
    stream gRPC's ("Stream removed", "Socket closed", "Connection reset", ...)."""
    details = (exc.details() or "").lower()
    return not any(s in details for s in ("stream removed", "socket closed", "connection reset", "goaway",
                                          "broken pipe", "connection refused", "failed to connect", "eof",
                                          "cancelling all calls"))  # the last: a server shutting down


def same_producer(chosen: WorkerView, views: list[WorkerView], live: dict[str, dict]) -> list[WorkerView]:
    """The views of workers whose leases name the chosen worker's KV producer
    (`workers.model_identity.kv_producer`): the only holders it may fetch a prefix from, as
    other kernels' KV differs in low bits from what its own cold run computes. Leases without
    a producer (older workers) match each other only."""
    producer = live.get(chosen.worker_id, {}).get("kv_producer")
    return [v for v in views if live.get(v.worker_id, {}).get("kv_producer") == producer]


def fitting_workers(live: dict[str, dict], num_tokens: int, max_tokens: int = 1) -> dict[str, dict]:
    """The workers whose context (``max_model_len`` in their lease) takes a prompt of
    ``num_tokens`` tokens and a completion of ``max_tokens`` (`workers.limits.
    check_completion_room`: both together within the context); a lease that does not say
    counts as fitting. Pure."""
    def fits(info: dict) -> bool:
        n = info.get("max_model_len")
        return not (isinstance(n, int) and n > 0 and num_tokens + max(1, max_tokens) > n)

    return {wid: info for wid, info in live.items() if fits(info)}


def context_limit(live: dict[str, dict], default: int) -> int:
    """Longest context (tokens) any live worker serves, from the ``max_model_len`` in
    their leases; ``default`` (the router's model config) when no lease says. Pure."""
    lens = [int(info["max_model_len"]) for info in live.values()
            if isinstance(info.get("max_model_len"), int) and info["max_model_len"] > 0]
    return max(lens) if lens else int(default)


async def _resync(address: str, tls=None) -> tuple[int, list[tuple[bytes, bytes | None, str]]]:
    channel = (tls.peer_channel(address, CHANNEL_OPTIONS) if tls is not None
               else grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS))
    async with channel as ch:
        snap = await pb_grpc.WorkerStub(ch).GetSnapshot(pb.SnapshotRequest(), timeout=10.0)
    return snap.seq, [(b.block_hash, b.parent_block_hash or None, b.medium or "device") for b in snap.blocks]


async def serve_router(port: int, redis_url: str, policy: str = "kv_aware", host: str = "127.0.0.1",
                       model_dir: str | None = None, cluster: str = "default", seed: int | None = None,
                       ready: asyncio.Event | None = None, stop: asyncio.Event | None = None,
                       metrics_port: int | None = None, http_port: int | None = None,
                       metrics_token: str | None = None, gate: Gate | None = None, reflection: bool = False,
                       max_concurrent_rpcs: int = DEFAULT_MAX_CONCURRENT_RPCS,
                       max_inflight_per_tenant: int = 0, tenant_request_limit: str | None = None,
                       tenant_token_limit: str | None = None) -> None:
    """Serve kvmesh.v1.Router on host:port until ``stop`` is set or SIGINT/SIGTERM.

    ``metrics_port`` serves Prometheus ``/metrics`` (`services.metrics`; only to bearers of
    ``metrics_token`` when given); ``http_port`` serves the OpenAI-compatible HTTP front
    (`services.http_front`); None = off.
    ``gate`` holds the port's TLS config and the tenant resolution (default: no TLS, open);
    its TLS config also secures the calls to workers. ``reflection`` turns on gRPC reflection;
    ``max_concurrent_rpcs`` caps the Generate and Tokenize calls in flight (`GrpcHost`), and
    ``max_inflight_per_tenant`` each tenant's Generate calls (`grpc_guard.TenantCap`; 0: no cap).
    ``tenant_request_limit`` / ``tenant_token_limit`` ("N/minute", ...; None: none) are each
    tenant's request and prompt-token budgets, counted in ``redis_url`` for every router of
    the cluster (`services.rate_limit.TenantRateLimit`).

    Raises:
        ValueError: unknown policy name, a negative ``max_inflight_per_tenant`` or a malformed
            budget.
        RuntimeError: the port could not be bound.
    """
    index = ClusterIndex()
    gate = gate or Gate()

    async def resync(worker_id: str, address: str):
        return await _resync(address, gate.tls)

    subscriber = IndexSubscriber(redis_url, index, resync, cluster=cluster)
    servicer = RouterServicer(index, subscriber, policy, model_dir=model_dir, seed=seed, gate=gate)
    servicer.tenant_cap = TenantCap(max_inflight_per_tenant)
    if tenant_request_limit or tenant_token_limit:
        servicer.rate_limit = TenantRateLimit(redis_url, cluster, tenant_request_limit, tenant_token_limit)
    grpc_host = GrpcHost(host, port, [
        (pb_grpc.add_RouterServicer_to_server, servicer, pb.DESCRIPTOR.services_by_name["Router"].full_name),
        (pb_grpc.add_WorkerServicer_to_server, WorkerFacade(servicer),
         pb.DESCRIPTOR.services_by_name["Worker"].full_name),
    ], tls=gate.tls, reflection_on=reflection,
        # without --model the router cannot know its workers' context: token ids for 128K tokens
        max_receive_bytes=limits.request_bytes_limit(
            servicer.config.max_position_embeddings, limits.ROUTER_TOKEN_ID_CONTEXT if model_dir is None else 0),
        max_concurrent_rpcs=max_concurrent_rpcs, admit=gate.admit)
    servicer.admission = grpc_host.admission  # for the metrics
    servicer.shared = SharedLoad(redis_url, cluster, servicer.shared_counts)
    from kvmesh.services import observability

    extras = await observability.start_router_extras(
        servicer, host, metrics_port, http_port,
        ssl_context=gate.tls.server_ssl_context() if gate.tls is not None else None, metrics_token=metrics_token)
    await subscriber.start()
    startup_check = asyncio.get_running_loop().call_later(
        2.0, lambda: servicer._select(subscriber.live_workers()))  # logs mismatched workers at start
    follower = None
    if model_dir is not None:
        servicer.http_fronts = list(extras.http_fronts)
        if servicer.http_fronts:  # the front's model name follows the workers' between requests too
            follower = asyncio.get_running_loop().create_task(_follow_fleet(servicer, subscriber.poll_interval_s))
    bound = await grpc_host.start()
    print(f"kvmesh router ({policy}) listening on {host}:{bound}", flush=True)
    if ready is not None:
        ready.set()
    await grpc_host.wait(stop)
    # health first: load balancers and probes see NOT_SERVING while the fronts stop; requests
    # waiting for the checkpoint id end now, so neither the HTTP front (which waits for its
    # handlers) nor the gRPC server waits for a hash
    await grpc_host.health.enter_graceful_shutdown()
    servicer.begin_shutdown()
    startup_check.cancel()
    if follower is not None:
        follower.cancel()
    await extras.stop()
    await grpc_host.stop()
    await subscriber.stop()
    await servicer.shared.close()
    if servicer.rate_limit is not None:
        await servicer.rate_limit.close()
    await servicer.close()
