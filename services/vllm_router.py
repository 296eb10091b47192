"""Router mode whose workers are vLLM OpenAI servers (``kvmesh router --backend vllm``).

Each vLLM server publishes its KV events over ZMQ (`services.vllm_events`); the router
applies them to the same `ClusterIndex` as for kvmesh workers, hashes every request's
prompt as vLLM does (`services.vllm_compat`), lets the configured routing policy pick a
server from the prefix match and the server's load, and forwards the OpenAI HTTP request
there, relaying the answer (streamed or not) unchanged.

Per request:

1. ``/v1/completions``: a text prompt is tokenized with the model's tokenizer
   (``--model DIR``: ``tokenizer.json``) and forwarded **as token ids**, so the server
   hashes exactly the tokens the router hashed; a token-id prompt is forwarded as is.
   ``/v1/chat/completions``: the messages are rendered with the model's chat template and
   tokenized for hashing only; the body is forwarded unchanged.
2. The request's block keys (``cache_salt`` included) are matched in the index; the
   policy (``--policy``, default ``kv_aware``) chooses among live servers; a short-lived
   speculative entry records the choice until the server's own events arrive.
3. The body goes to the chosen server (aiohttp), less the fields that reach vLLM's
   internals (`INTERNAL_FIELDS`: ``kv_transfer_params`` and others); the response names the server in the
   ``x-kvmesh-worker`` header. A server that cannot be reached before any byte was relayed
   is retried once on the next choice.

Load seen by policies: ``vllm:num_requests_running`` / ``vllm:num_requests_waiting`` from
each server's ``/metrics`` (polled every ``poll_s`` seconds, which also decides liveness),
or this router's own count of requests in flight there when higher; queued prefill tokens
are this router's own count of prefill sent and not yet answered.
"""
from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Sequence

import aiohttp
from aiohttp import web

from kvmesh.services.cluster_index import ClusterIndex, weighted_blocks
from kvmesh.services.http_front import HttpServing, expect_within, read_json_object, serve_app
from kvmesh.services.policies import RoutedShare, RouteRequest, WorkerView, make_policy
from kvmesh.services.vllm_compat import VllmHashConfig, VllmHasher, check_version
from kvmesh.services.vllm_events import VllmEventSubscriber

__all__ = ["VllmServerSpec", "parse_server_spec", "VllmRouter", "serve_vllm_router"]

log = logging.getLogger(__name__)

#: Lifetime of a speculative index entry (seconds), as for kvmesh workers.
SPECULATIVE_TTL_S = 2.0


@dataclass(frozen=True)
class VllmServerSpec:
    """One vLLM server behind the router.

    Attributes:
        name: its worker id in the index and in metrics.
        url: its OpenAI base URL without ``/v1`` (``http://host:8000``).
        events: its ZMQ KV event publisher (``tcp://host:5557``).
        replay: its ZMQ replay endpoint, or None.
    """

    name: str
    url: str
    events: str
    replay: str | None = None


#: Hosts that only a bind can use (every interface): a subscriber cannot connect to them.
_WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "")


def _tcp_host(endpoint: str) -> str:
    """The host of a ``tcp://HOST:PORT`` endpoint (brackets of an IPv6 address removed)."""
    rest = endpoint[len("tcp://"):]
    host = rest.rsplit(":", 1)[0] if ":" in rest else rest
    return host.strip("[]")


def parse_server_spec(text: str, index: int = 0) -> VllmServerSpec:
    """Parse ``[NAME=]URL,EVENTS[,REPLAY]`` as given to ``--vllm-server``.

    Raises:
        ValueError: a missing part, a URL/endpoint of the wrong scheme, or an event
            endpoint on a wildcard host (``*``, ``0.0.0.0``, ``::``: the server's bind
            side); the message names ``--vllm-server`` and what to give.
    """
    name = None
    spec = text.strip()
    if "=" in spec.split(",", 1)[0]:
        name, spec = spec.split("=", 1)
    parts = [p.strip() for p in spec.split(",")]
    form = "--vllm-server takes [NAME=]http://HOST:PORT,tcp://HOST:ZMQ_PORT[,tcp://HOST:REPLAY_PORT]"
    if len(parts) not in (2, 3) or not all(parts):
        raise ValueError(f"{form}; got {text!r}")
    url, events = parts[0].rstrip("/"), parts[1]
    if url.endswith("/v1"):
        url = url[:-3]
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"{form}: the server URL must start with http:// or https://, got {parts[0]!r}")
    for ep in parts[1:]:
        if not ep.startswith(("tcp://", "ipc://")):
            raise ValueError(f"{form}: KV event endpoints are ZMQ addresses (tcp:// or ipc://), got {ep!r}")
        if ep.startswith("tcp://") and _tcp_host(ep) in _WILDCARD_HOSTS:
            raise ValueError(f"--vllm-server {ep!r}: give the vLLM server's address (tcp://HOST:PORT, e.g. "
                             f"tcp://127.0.0.1:5557); {_tcp_host(ep) or '*'!r} is the bind side, what the server's "
                             "--kv-events-config endpoint listens on, and cannot be connected to")
    return VllmServerSpec(name=(name or f"vllm-{index}").strip(), url=url, events=events,
                          replay=parts[2] if len(parts) == 3 else None)


@dataclass
class _ServerState:
    spec: VllmServerSpec
    subscriber: VllmEventSubscriber
    live: bool = False
    running: int = 0          # from the server's /metrics
    waiting: int = 0
    kv_usage: float = 0.0
    version: str | None = None
    local_running: int = 0    # this router's requests in flight there
    local_prefill: int = 0    # prefill tokens this router sent there, not yet answered
    last_error: str = ""
    polled_at: float = 0.0
    failing_since: float | None = None  # monotonic time its polls began to fail; None: answering
    extra: dict = field(default_factory=dict)


#: Seconds a poll of a server's ``/metrics`` (or ``/version``) may take before it counts as
#: failed.
POLL_TIMEOUT_S = 2.0
#: Seconds a server's ``/metrics`` polls must have kept failing before the requests relayed to
#: it are ended (counted from the first failure, itself `POLL_TIMEOUT_S` after its poll
#: began: about 12 s after a server stops answering): a frozen server (SIGSTOP, a hung node, a network partition) keeps its TCP
#: connections open and sends nothing, so without this a relay, and the client behind it,
#: waited forever. A request that has received nothing yet is tried on another server; one
#: whose answer was under way has its connection closed (its stream ends without the final
#: chunk, which clients report as an error). A busy server still answers ``/metrics`` (vLLM's
#: API server runs apart from its engine), so a long prefill is not taken for a freeze.
UNRESPONSIVE_S = 10.0


#: Largest request body relayed (bytes): a 128k-token context as JSON token ids or text,
#: with room to spare (aiohttp's own default, 1 MiB, refuses long prompts).
MAX_BODY_BYTES = 16 << 20


#: Request fields never forwarded to vLLM: they reach its internals, not the model's output.
#: ``kv_transfer_params`` drives vLLM's KV connector (where KV is pulled from or pushed to,
#: under remote block ids); ``vllm_xargs`` goes to custom logits processors;
#: ``logits_processors`` names Python callables for the server to load; ``priority`` reorders
#: the server's queue ahead of other tenants; ``request_id`` sets vLLM's own request id, which
#: another tenant's request could then collide with. docs/VLLM.md lists them.
INTERNAL_FIELDS = ("kv_transfer_params", "vllm_xargs", "logits_processors", "priority", "request_id")


class _HttpError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.type = status, message, param, type_

    def response(self) -> web.Response:
        return web.json_response({"error": {"message": self.message, "type": self.type, "param": self.param,
                                            "code": self.status}}, status=self.status)


class VllmRouter:
    """Routes OpenAI HTTP requests over vLLM servers by their published KV cache.

    Args:
        servers: the servers (names unique).
        hash_config: how they hash blocks (see `services.vllm_compat.VllmHashConfig`).
        model_dir: local HF directory of the served model (``tokenizer.json``, optional
            ``tokenizer_config.json`` chat template); None only with token-id prompts.
        policy: routing policy name (`services.policies`).
        seed: seed of the policy's tie-breaks.
        poll_s: how often each server's ``/health`` and ``/metrics`` are read (seconds).
        max_attempts: servers tried per request when one cannot be reached.
        auth: the router's API keys (`services.auth.Authenticator`, ``--api-keys``); None or
            open = every caller is trusted (loopback or behind an authenticating proxy). With
            keys, each request's tenant comes from its key and the ``cache_salt`` sent to vLLM
            is the tenant's (vLLM keeps blocks of different salts apart; the salt a client
            sends only divides its own tenant's namespace), the caller's ``Authorization`` is
            not passed on, ``/v1/models`` needs a key, and ``/health`` and ``/metrics`` keep
            the servers' details to themselves (``/metrics`` is not served).

    Raises:
        ValueError: duplicate server names or unknown policy.
    """

    def __init__(self, servers: Sequence[VllmServerSpec], hash_config: VllmHashConfig,
                 model_dir: str | None = None, policy: str = "kv_aware", seed: int | None = None,
                 poll_s: float = 0.5, max_attempts: int = 2, auth=None):
        names = [s.name for s in servers]
        self.auth = auth if auth is not None and auth.entries is not None else None
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"--vllm-server names must be unique and at least one is needed, got {names}")
        self.index = ClusterIndex()
        self.hasher = VllmHasher(hash_config)
        self.policy = make_policy(policy)
        self.policy_name = policy
        self.rng = random.Random(seed)
        self.poll_s = poll_s
        self.max_attempts = max_attempts
        self.routed = RoutedShare()
        self.model_dir = model_dir
        self.tokenizer = None
        self.chat_template = None
        if model_dir is not None:
            from kvmesh.services.chat_template import ChatTemplate
            from kvmesh.workers.model_identity import config_without_weights
            from kvmesh.workers.tokenizer import load_tokenizer

            # config.json and the tokenizer only: the weights would cost a read of the whole checkpoint
            self.tokenizer = load_tokenizer(model_dir, config_without_weights(model_dir))
            self.chat_template = ChatTemplate.for_model(model_dir)
        self.servers: dict[str, _ServerState] = {}
        for s in servers:
            sub = VllmEventSubscriber(self.index, s.name, s.events, s.replay, check_root=self._check_root,
                                      on_batch=self._on_batch)
            self.servers[s.name] = _ServerState(s, sub)
        self.metrics = None
        self.requests_unhashed = 0
        self._session: aiohttp.ClientSession | None = None       # relays and /v1/models
        self._poll_session: aiohttp.ClientSession | None = None  # /metrics and /version polls
        self._poller: asyncio.Task | None = None
        self._serving: HttpServing | None = None

    def _on_batch(self, batch) -> None:
        if self.metrics is not None:
            self.metrics.observe_batch(batch)

    # ------------------------------------------------------------ hashing
    def _check_root(self, key: bytes, token_ids: list[int], extra_keys) -> bool:
        if extra_keys:  # salted or adapter blocks: their untagged event form is not re-hashable in general
            return True
        if len(token_ids) != self.hasher.block_size:
            return False
        return self.hasher.digest_key(self.hasher.hash_block(None, token_ids)) == key

    def block_keys(self, ids: Sequence[int], cache_salt: str | None = None) -> list[bytes]:
        """Index keys of a prompt's full blocks as the servers publish them."""
        return self.hasher.keys(ids, cache_salt=cache_salt)

    # ------------------------------------------------------------ liveness/load
    def live_workers(self) -> dict[str, dict]:
        """Live servers -> a small info dict (also what `RouterMetrics` reads)."""
        return {n: {"address": st.spec.url} for n, st in self.servers.items() if st.live}

    # duck-typed counters RouterMetrics reads from a subscriber
    @property
    def resyncs(self) -> int:
        return sum(st.subscriber.gaps + st.subscriber.restarts for st in self.servers.values())

    resync_failures = 0

    @property
    def lease_expiries(self) -> int:
        return 0

    @property
    def subscriber(self):
        return self

    async def _poll_one(self, st: _ServerState) -> None:
        assert self._poll_session is not None
        try:
            async with self._poll_session.get(st.spec.url + "/metrics",
                                              timeout=aiohttp.ClientTimeout(total=POLL_TIMEOUT_S)) as r:
                text = await r.text()
                if r.status != 200:
                    raise RuntimeError(f"/metrics answered {r.status}")
            vals = _scrape(text, ("vllm:num_requests_running", "vllm:num_requests_waiting",
                                  "vllm:kv_cache_usage_perc"))
            st.running = int(vals.get("vllm:num_requests_running", 0))
            st.waiting = int(vals.get("vllm:num_requests_waiting", 0))
            st.kv_usage = float(vals.get("vllm:kv_cache_usage_perc", 0.0))
            if st.version is None:
                async with self._poll_session.get(st.spec.url + "/version",
                                                  timeout=aiohttp.ClientTimeout(total=POLL_TIMEOUT_S)) as r:
                    ver = (await r.json()).get("version", "") if r.status == 200 else ""
                if ver:
                    check_version(ver)  # raises UnsupportedVllm, logged below; the server stays unused
                    st.version = ver
            if not st.live:
                log.info("vLLM server %s at %s is live", st.spec.name, st.spec.url)
            st.live = st.version is not None
            st.last_error = ""
            st.failing_since = None
        except Exception as exc:  # any failure takes the server out of rotation until it answers again
            msg = f"{type(exc).__name__}: {exc}"
            if st.live or msg != st.last_error:
                log.warning("vLLM server %s at %s unusable: %s", st.spec.name, st.spec.url, msg)
            st.live = False
            st.last_error = msg
            if st.failing_since is None:
                st.failing_since = time.monotonic()
        st.polled_at = time.monotonic()

    async def _until_unresponsive(self, st: _ServerState) -> None:
        """Return once ``st``'s polls have failed for `UNRESPONSIVE_S` seconds."""
        while st.failing_since is None or time.monotonic() - st.failing_since < UNRESPONSIVE_S:
            await asyncio.sleep(self.poll_s)

    async def _poll_loop(self) -> None:
        while True:
            await asyncio.gather(*(self._poll_one(st) for st in self.servers.values()))
            await asyncio.sleep(self.poll_s)

    async def wait_live(self, timeout: float = 30.0, count: int | None = None) -> None:
        """Wait until ``count`` (default: all) servers are live.

        Raises:
            TimeoutError: not within ``timeout`` seconds (names the last error per server).
        """
        need = len(self.servers) if count is None else count
        deadline = time.monotonic() + timeout
        while sum(st.live for st in self.servers.values()) < need:
            if time.monotonic() > deadline:
                errs = {n: st.last_error for n, st in self.servers.items() if not st.live}
                raise TimeoutError(f"vLLM servers not live after {timeout} s: {errs}")
            await asyncio.sleep(0.1)

    # ------------------------------------------------------------ routing
    def views(self, keys: list[bytes], now: float, exclude: set[str]) -> list[WorkerView]:
        """One `WorkerView` per live server not in ``exclude``."""
        matches = self.index.match(keys, now) if keys else {}
        out = []
        for name, st in self.servers.items():
            if not st.live or name in exclude:
                continue
            m = matches.get(name)
            out.append(WorkerView(
                worker_id=name, address=st.spec.url,
                matched_blocks=m.num_blocks if m else 0,
                weighted_blocks=weighted_blocks(m) if m else 0.0,
                running_requests=max(st.running, st.local_running),
                waiting_requests=st.waiting,
                queued_prefill_tokens=st.local_prefill,
                routed_recent=self.routed.value(name)))
        return out

    def _prompt_ids(self, path: str, body: dict) -> list[int] | None:
        """Token ids to hash (None: cannot tell); may replace a completions text prompt by its ids."""
        if path == "/v1/completions":
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    return None
                ids = self.tokenizer.encode(prompt)
                body["prompt"] = ids  # the server hashes exactly what the router hashed
                return ids
            if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                return list(prompt)
            if isinstance(prompt, list):
                raise _HttpError(400, "send one prompt per request through the kvmesh router (a batch of prompts "
                                 "would share one routing decision)", "prompt")
            raise _HttpError(400, "'prompt' must be a string or a list of token ids", "prompt")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _HttpError(400, "'messages' must be a non-empty list", "messages")
        if self.tokenizer is None or self.chat_template is None:
            return None
        try:
            text = self.chat_template.render(messages, add_generation_prompt=body.get("add_generation_prompt", True))
        except ValueError:
            return None  # vLLM judges the messages itself; route by load only
        return self.chat_template.encode(self.tokenizer, text)

    async def forward(self, request: web.Request, path: str) -> web.StreamResponse:
        # a stranger gets 401 before its body is read; the tenant also keys kv_aware's prompt mean
        sender = self._tenant(request) if self.auth is not None else ""
        try:
            body = await read_json_object(request)
        except ValueError as exc:
            raise _HttpError(400, str(exc)) from None
        for name in INTERNAL_FIELDS:  # the client's to send, not vLLM's internals to reach
            body.pop(name, None)
        salt = body.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise _HttpError(400, "'cache_salt' must be a string", "cache_salt")
        if self.auth is not None:
            salt = body["cache_salt"] = self._tenant_salt(request, salt or "")  # 401/403 before any other answer
        ids = self._prompt_ids(path, body)
        served = self.served_model()
        if ids is None or (served is not None and body.get("model") not in (None, served)):
            keys: list[bytes] = []   # unknown tokens, or a LoRA adapter whose path the router cannot know
            self.requests_unhashed += 1
        else:
            keys = self.block_keys(ids, salt)
        n_tokens = len(ids) if ids else 0
        tried: set[str] = set()
        last_error = "no live vLLM server"
        for attempt in range(self.max_attempts):
            now = time.monotonic()
            views = self.views(keys, now, tried)
            if not views:
                break
            chosen = self.policy.choose(RouteRequest(n_tokens, keys, self.hasher.block_size, retry=attempt > 0,
                                                     sender=sender), views, self.rng)
            tried.add(chosen.worker_id)
            if self.metrics is not None:
                self.metrics.observe_decision(chosen, views, attempt)
            if keys:
                self.index.add_speculative(chosen.worker_id, keys, now, SPECULATIVE_TTL_S)
            self.routed.note(chosen.worker_id)
            st = self.servers[chosen.worker_id]
            prefill = max(0, n_tokens - chosen.matched_blocks * self.hasher.block_size)
            st.local_running += 1
            st.local_prefill += prefill
            state = {"started": False, "relayed": False}
            try:
                relay = asyncio.ensure_future(self._relay(request, st, path, body, chosen, prefill, state))
                watch = asyncio.ensure_future(self._until_unresponsive(st))
                try:
                    await asyncio.wait((relay, watch), return_when=asyncio.FIRST_COMPLETED)
                finally:
                    watch.cancel()
                    if not relay.done():  # the server stopped answering, or this handler was cancelled
                        relay.cancel()
                        await asyncio.gather(relay, return_exceptions=True)
                    elif not relay.cancelled():
                        relay.exception()  # retrieved: the client left too (it is re-raised below otherwise)
                if not relay.cancelled():
                    return relay.result()
                log.warning("vLLM server %s at %s has not answered for %.0f s; ending the request relayed there",
                            chosen.worker_id, st.spec.url, UNRESPONSIVE_S)
                st.live = False
                if state["started"]:
                    # the answer was under way: the client must see it cut, not complete. A reset,
                    # not a close: an HTTP/1.0 answer (nginx's default to upstreams) has no length
                    # or chunks, and would read as complete at a clean end of the connection
                    _reset(request.transport)
                    raise ConnectionResetError(f"vLLM server {chosen.worker_id} stopped answering")
                last_error = f"vLLM server {chosen.worker_id}: no answer for {UNRESPONSIVE_S:.0f} s"
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
                if state["started"]:
                    raise
                last_error = f"vLLM server {chosen.worker_id}: {type(exc).__name__}"
                log.warning("vLLM server %s at %s: %s: %s; trying another server", chosen.worker_id, st.spec.url,
                            type(exc).__name__, exc)
                st.live = False
            finally:
                st.local_running = max(0, st.local_running - 1)
                if not state["relayed"]:
                    st.local_prefill = max(0, st.local_prefill - prefill)
        raise _HttpError(503, f"no vLLM server could take the request: {last_error}", type_="service_unavailable")

    async def _relay(self, request: web.Request, st: _ServerState, path: str, body: dict, chosen, prefill: int,
                     state: dict) -> web.StreamResponse:
        """POST ``body`` to ``st``'s ``path`` and stream its answer to the client; sets
        ``state["started"]`` once the client has the answer's headers (the request can no
        longer go to another server) and ``state["relayed"]`` at its first byte (``prefill``
        tokens then leave the server's pending count). Raises what aiohttp's client raises
        when the server cannot be reached or the connection breaks."""
        assert self._session is not None
        passed = ("accept",) if self.auth is not None else ("authorization", "accept")
        headers = {k: v for k, v in request.headers.items() if k.lower() in passed}
        async with self._session.post(st.spec.url + path, json=body, headers=headers,
                                      timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0)) as r:
            resp = web.StreamResponse(status=r.status)
            resp.content_type = r.content_type
            resp.headers["x-kvmesh-worker"] = chosen.worker_id
            resp.headers["x-kvmesh-matched-blocks"] = str(chosen.matched_blocks)
            await resp.prepare(request)
            state["started"] = True
            async for chunk in r.content.iter_any():
                if not state["relayed"]:
                    state["relayed"] = True
                    st.local_prefill = max(0, st.local_prefill - prefill)
                await resp.write(chunk)
            await resp.write_eof()
            return resp

    def _tenant(self, request: web.Request) -> str:
        """The caller's tenant from its API key. Raises `_HttpError` 401."""
        from kvmesh.services.auth import Unauthenticated

        try:
            return self.auth.tenant_for(request.headers.get("Authorization"))
        except Unauthenticated as exc:
            raise _HttpError(401, f"{exc}", type_="authentication_error") from None

    def _tenant_salt(self, request: web.Request, client_salt: str) -> str:
        """The ``cache_salt`` vLLM gets for this caller: its tenant (or the shared namespace
        its key may use) and its own salt within it, as one JSON string. Raises `_HttpError`
        401 (no or unknown key) or 403 (the shared namespace without the ``shared`` option)."""
        from kvmesh.services.auth import Forbidden

        try:
            tenant, salt = self.auth.scope(self._tenant(request), client_salt)
        except Forbidden as exc:
            raise _HttpError(403, f"{exc}", "cache_salt", type_="permission_error") from None
        return json.dumps(["kvmesh-tenant", tenant, salt], separators=(",", ":"))

    def served_model(self) -> str | None:
        return self._model_name

    _model_name: str | None = None

    # ------------------------------------------------------------ HTTP
    def app(self) -> web.Application:
        @web.middleware
        async def errors(request, handler):
            try:
                return await handler(request)
            except _HttpError as exc:
                return exc.response()
            except web.HTTPRequestEntityTooLarge:
                resp = _HttpError(413, f"request body over {MAX_BODY_BYTES:,} bytes; shorten the prompt").response()
                resp.force_close()  # the body was not read to its end (see `http_front`'s errors)
                return resp
            except web.HTTPRequestTimeout as exc:  # the body did not arrive in time (`read_json_object`)
                resp = _HttpError(408, exc.reason or "request body not received in time; send it at once").response()
                resp.force_close()
                return resp

        app = web.Application(middlewares=[errors], client_max_size=MAX_BODY_BYTES)
        async def completions(request):
            return await self.forward(request, "/v1/completions")

        async def chat_completions(request):
            return await self.forward(request, "/v1/chat/completions")

        expect = expect_within(MAX_BODY_BYTES, lambda: _HttpError(
            413, f"request body over {MAX_BODY_BYTES:,} bytes; shorten the prompt").response())
        app.router.add_post("/v1/completions", completions, expect_handler=expect)
        app.router.add_post("/v1/chat/completions", chat_completions, expect_handler=expect)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        return app

    async def _models(self, request: web.Request) -> web.Response:
        # the caller's key goes along, as on completions: a vLLM server started with
        # --api-key answers the listing only to a caller holding a key; a router holding
        # keys of its own checks the caller's and passes none on
        if self.auth is not None:
            self._tenant(request)
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() == "authorization" and self.auth is None}
        for st in self.servers.values():
            if st.live:
                assert self._session is not None
                async with self._session.get(st.spec.url + "/v1/models", headers=headers) as r:
                    return web.json_response(await r.json(), status=r.status)
        raise _HttpError(503, "no live vLLM server", type_="service_unavailable")

    async def _health(self, request: web.Request) -> web.Response:
        live = self.live_workers()
        if self.auth is not None:  # probes need the status only; server URLs and errors are the operator's
            return web.json_response({"status": "ok" if live else "no live server"}, status=200 if live else 503)
        status = {n: {"live": st.live, "error": "; ".join(e for e in (st.last_error, st.subscriber.error) if e),
                      "version": st.version,
                      "kv_event_batches": st.subscriber.batches, "kv_event_gaps": st.subscriber.gaps,
                      "hash_checks": st.subscriber.hash_checks, "hash_mismatches": st.subscriber.hash_mismatches}
                  for n, st in self.servers.items()}
        return web.json_response({"status": "ok" if live else "no live server", "servers": status},
                                 status=200 if live else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        if self.metrics is None:
            return web.Response(status=404, text="metrics off")
        if self.auth is not None:  # per-decision counters would show who holds which prefix
            raise _HttpError(404, "this router requires API keys and does not serve /metrics (they would reveal "
                                  "other tenants' cache hits)", type_="not_found_error")
        return web.Response(body=generate_latest(self.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def start(self, host: str, port: int, ssl_context=None) -> int:
        """Connect the event subscribers, start polling and serve HTTP (HTTPS with
        ``ssl_context``); returns the bound port."""
        from kvmesh.services.metrics import RouterMetrics

        self.metrics = RouterMetrics(self)
        # relays are bounded by the front's connection cap, not by a pool (aiohttp's default of
        # 100 connections held the 101st request back); the polls have a session of their own,
        # so that relays in flight cannot starve them and make a busy server look frozen
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        self._poll_session = aiohttp.ClientSession()
        for st in self.servers.values():
            st.subscriber.start()
        self._poller = asyncio.get_running_loop().create_task(self._poll_loop())
        # the HTTP front's connection limits (header timeout, connection cap)
        try:
            self._serving = await serve_app(self.app(), host, port, ssl_context, access_log=None)
        except BaseException:  # e.g. the port is taken: nothing started here is left running
            await self.stop()
            raise
        return self._serving.port

    async def stop(self) -> None:
        """Stop polling, the event subscribers, the HTTP front and the client sessions; also
        after a `start` that failed part-way."""
        if self._poller is not None:
            self._poller.cancel()
        for st in self.servers.values():
            await st.subscriber.stop()
        if self._serving is not None:
            await self._serving.stop()
            self._serving = None
        for session in (self._session, self._poll_session):
            if session is not None:
                await session.close()


def _reset(transport) -> None:
    """Close ``transport``'s connection with a TCP reset (SO_LINGER 0), which a client reads as
    an error whatever its framing; a transport without a socket is just aborted."""
    if transport is None:
        return
    import socket
    import struct

    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    transport.abort()


def _scrape(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """Sum of each named sample over its label sets in a Prometheus text page."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in names:
                out[s.name] = out.get(s.name, 0.0) + float(s.value)
    return out


async def serve_vllm_router(servers: Sequence[VllmServerSpec], hash_config: VllmHashConfig, http_port: int,
                            host: str = "127.0.0.1", model_dir: str | None = None, served_model: str | None = None,
                            policy: str = "kv_aware", seed: int | None = None,
                            stop: asyncio.Event | None = None, auth=None, ssl_context=None) -> None:
    """Serve the vLLM router mode on ``host:http_port`` until ``stop`` is set or SIGINT/SIGTERM
    (``auth``, ``ssl_context``: see `VllmRouter` and `VllmRouter.start`)."""
    import signal

    router = VllmRouter(servers, hash_config, model_dir=model_dir, policy=policy, seed=seed, auth=auth)
    router._model_name = served_model
    port = await router.start(host, http_port, ssl_context)
    print(f"kvmesh router ({policy}, backend vllm, {len(servers)} servers) serving "
          f"{'https' if ssl_context else 'http'}://{host}:{port}/v1", flush=True)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    try:
        await stop.wait()
    finally:
        await router.stop()

