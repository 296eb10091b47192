"""Python client of kvmesh's gRPC API (a router or a single worker), sync and asyncio.

    from kvmesh.services.client import KvmeshClient

    with KvmeshClient("127.0.0.1:50051") as client:
        out = client.generate("The capital of France is", max_tokens=16)
        print(out.text, out.usage.cached_tokens, out.timing.ttft_ms)
        for chunk in client.stream("Tell me a story", max_tokens=64):
            print(chunk.text, end="", flush=True)

`AsyncKvmeshClient` has the same methods as coroutines / async iterators.

Behaviour:

* Every call has a deadline (``timeout``, seconds; default `DEFAULT_TIMEOUT_S`).
* A call that fails with UNAVAILABLE before any token arrived is retried up to
  ``retries`` times with exponential backoff and full jitter (``backoff_s`` doubling up
  to ``max_backoff_s``), within the call's deadline; a stream that already yielded
  tokens is never replayed. Other status codes raise at once.
* TLS: ``tls_ca`` (PEM file of the CA that signed the server) turns TLS on;
  ``tls_cert`` / ``tls_key`` add a client certificate (mTLS). Each defaults to the
  environment variable ``KVMESH_TLS_CA`` / ``KVMESH_TLS_CERT`` / ``KVMESH_TLS_KEY``.
  Without a CA the channel is plaintext (loopback and private networks).
* ``api_key`` (default: the ``KVMESH_API_KEY`` environment variable) is sent as
  ``authorization: Bearer KEY`` metadata on every call, and only over TLS: a key without
  a CA raises ValueError rather than cross the network in clear (unless the caller passes
  its own ``channel``).

Errors are `grpc.RpcError` with the server's status code and message; where gRPC's own
message names no fix (a plaintext client at a TLS port gets only ``UNAVAILABLE: Socket
closed``), a `ClientRpcError` with the same code and the advice appended (`connect_hint`).

Results are typed: `Completion` (token ids, text, `Usage`, `Timing`, worker id) and
`Chunk` (one streamed message; the last one carries usage and timing).
"""
from __future__ import annotations

import asyncio
import operator
import os
import random
import time
from dataclasses import asdict, dataclass, field
from typing import AsyncIterator, Iterator

import grpc

from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.proto import kvmesh_pb2_grpc as pb_grpc
from kvmesh.services.aio import within
from kvmesh.workers.limits import as_float32

#: Tiers of ``Usage.cached_tokens_by_tier`` (always all present, 0 when unused).
TIERS = ("device", "host", "disk", "peer", "remote")
#: Default deadline of one call (seconds).
DEFAULT_TIMEOUT_S = 600.0
#: Largest message either side accepts (bytes), as the servers.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]


#: Every hint `connect_hint` gives starts with this, so that it is given once.
HINT_MARK = " (hint: "


def connect_hint(code: str, message: str) -> str:
    """What to fix when a connection was dropped before any RPC ran, or "".

    A TLS server (``kvmesh up`` without ``--insecure``) closes a plaintext connection, and a
    router with ``--client-ca`` closes one without a client certificate; gRPC then reports only
    ``UNAVAILABLE ... Socket closed`` or a failed handshake, which names no flag. A stream
    that gRPC removed after it started ("Stream removed") was connected: no hint then.

    Args:
        code: the status code's name ("UNAVAILABLE").
        message: the error's details.

    Returns:
        "" or the advice, starting with `HINT_MARK` (and "" for a message that already has it).
    """
    text = message.lower()
    if HINT_MARK in message:  # already explained (a `ClientRpcError`)
        return ""
    if code != "UNAVAILABLE" or not any(s in text for s in ("socket closed", "handshake", "ssl", "tls", "alpn")):
        return ""
    if "stream removed" in text:  # the call had been running: the server (or a worker) went away
        return ""
    if "alpn" in text:  # TLS was spoken, HTTP/2 was not: an HTTPS front, not a gRPC port
        return (HINT_MARK + "that port speaks TLS but not gRPC: it is likely the HTTP front (--http-port) or another "
                "server; give --target the router's or worker's gRPC --port)")
    if "wrong_version_number" in text or "wrong version number" in text:  # TLS spoken to a plaintext port
        return (HINT_MARK + "the server does not speak TLS (a cluster started with --insecure?): leave out --tls-ca, "
                "--tls-cert, --tls-key and --api-key, and unset the KVMESH_TLS_* and KVMESH_API_KEY variables a "
                "client.env set)")
    if "certificate_verify_failed" in text or "certificate verify failed" in text:
        return (HINT_MARK + "the server's certificate is not signed by --tls-ca, or does not name this address: credentials "
                "from another cluster or an earlier `kvmesh up`? Source the client.env the running one printed)")
    return (HINT_MARK + "the server closed the connection: it may require TLS and a client certificate; pass --tls-ca, "
            "--tls-cert and --tls-key (the Python client: tls_ca=, tls_cert=, tls_key=), or source the client.env "
            "that kvmesh up printed; if they are given, check that the target is a gRPC --port, not a metrics or "
            "HTTP port)")


class ClientRpcError(grpc.RpcError):
    """A failed call whose cause gRPC reports without naming a fix (a TLS server closing a
    plaintext connection is only ``UNAVAILABLE: Socket closed``): the same status code, and
    the details with `connect_hint`'s advice appended. A `grpc.RpcError`, so callers that
    catch those, or read ``code()`` / ``details()``, need no change; ``cause`` is gRPC's own
    error."""

    def __init__(self, cause: grpc.RpcError, details: str):
        super().__init__(details)
        self.cause = cause
        self._code = cause.code()
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def __str__(self) -> str:
        return f"{self._code.name}: {self._details}"


def with_hint(exc: grpc.RpcError) -> grpc.RpcError:
    """``exc``, or a `ClientRpcError` carrying `connect_hint`'s advice when there is some."""
    code = exc.code() if hasattr(exc, "code") else None
    details = (exc.details() if hasattr(exc, "details") else str(exc)) or ""
    hint = connect_hint(code.name, details) if code is not None else ""
    return ClientRpcError(exc, details + hint) if hint else exc


@dataclass(frozen=True)
class Usage:
    """Prompt-cache usage of one request (tokens): prompt = cached + computed_prefill, as
    of the request's first admission to a step (a request preempted and run again keeps
    these figures, as vLLM reports, whatever its rerun computed or found cached)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    cached_tokens_by_tier: dict = field(default_factory=dict)   # device, host, disk, peer, remote
    computed_prefill_tokens: int = 0
    completion_tokens: int = 0
    #: of the cached tokens, those whose KV was decoded from a lossy (fp8/int4) tier
    lossy_cached_tokens: int = 0

    @classmethod
    def from_proto(cls, u: pb.Usage) -> "Usage":
        by_tier = {t: 0 for t in TIERS}
        by_tier.update({k: int(v) for k, v in u.cached_tokens_by_tier.items()})
        return cls(int(u.prompt_tokens), int(u.cached_tokens), by_tier, int(u.computed_prefill_tokens),
                   int(u.completion_tokens), int(u.lossy_cached_tokens))


@dataclass(frozen=True)
class Timing:
    """Latencies of one request (ms): the server's, then the client's own."""

    queue_ms: float = 0.0          # server: arrival -> first scheduled
    prefill_ms: float = 0.0        # server: first scheduled -> prefill done
    ttft_ms: float = 0.0           # server: arrival -> first token
    e2e_ms: float = 0.0            # server: arrival -> last token
    client_ttft_ms: float = 0.0    # client: send -> first token received
    client_e2e_ms: float = 0.0     # client: send -> stream ended


@dataclass(frozen=True)
class Chunk:
    """One streamed message: new tokens since the previous one (and their text)."""

    token_ids: list
    text: str
    finished: bool
    finish_reason: str = ""
    worker_id: str = ""
    usage: Usage | None = None     # last chunk only
    timing: Timing | None = None   # last chunk only


@dataclass(frozen=True)
class Completion:
    """A finished request."""

    token_ids: list
    text: str
    finish_reason: str
    worker_id: str
    usage: Usage
    timing: Timing
    request_id: str = ""

    def to_dict(self) -> dict:
        """Plain dict (the shape ``kvmesh generate --json`` prints)."""
        d = asdict(self)
        d.pop("request_id")
        return d


def make_request(prompt: str | None = None, token_ids=None, max_tokens: int = 16, tenant: str = "",
                 temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, ignore_eos: bool = False,
                 request_id: str = "", return_text: bool = True, cache_salt: str = "") -> pb.GenerateRequest:
    """A ``kvmesh.v1.GenerateRequest``: ``prompt`` text or ``token_ids`` (one of them).

    ``cache_salt`` splits the caller's cache namespace further (``"shared:NAME"``: the
    shared namespace, for tenants allowed it); ``tenant`` is its older name, kept for
    existing callers (the tenant itself always comes from the API key or certificate).

    Raises:
        ValueError: both or neither of ``prompt`` and ``token_ids``; ``tenant`` and
            ``cache_salt`` both given and different; or a number the message cannot carry
            (``max_tokens`` outside 1..2**32-1, ``seed`` outside 0..2**64-1, a token id
            outside 0..2**32-1, a positive ``top_p`` that a 32-bit float holds as 0); the
            message names the argument.
    """
    if (prompt is None) == (token_ids is None):
        raise ValueError("give exactly one of prompt (text) and token_ids")
    if tenant and cache_salt and tenant != cache_salt:
        raise ValueError("tenant is the older name of cache_salt: give one of them")
    for name, value, top in (("max_tokens", max_tokens, 2 ** 32 - 1), ("seed", seed, 2 ** 64 - 1)):
        low = 1 if name == "max_tokens" else 0
        try:
            number = None if isinstance(value, bool) else operator.index(value)  # int, numpy ints, ...
        except TypeError:
            number = None
        if number is None or not low <= number <= top:
            raise ValueError(f"{name} must be an integer in {low}..{top}, got {value!r}")
    if isinstance(top_p, (int, float)) and top_p > 0 and as_float32(top_p) == 0.0:
        raise ValueError(f"top_p {top_p!r} is 0 as the wire's 32-bit float, which means off (every token): "
                         "give at least 1e-38, or 1 for off")
    req = pb.GenerateRequest(
        request_id=request_id,
        sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
                                   ignore_eos=ignore_eos),
        cache_salt=cache_salt or tenant, return_text=return_text)
    if token_ids is not None:
        try:
            req.token_ids.ids.extend(int(t) for t in token_ids)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"token_ids must be integers in 0..{2 ** 32 - 1}: {exc}") from None
    else:
        req.text = prompt
    return req


def _credentials(tls_ca: str | None, tls_cert: str | None, tls_key: str | None):
    """TLS channel credentials (None without ``tls_ca``); the API key travels as metadata.

    Raises:
        ValueError: a certificate without ``tls_ca``, half a key pair, or an unreadable file.
    """
    from kvmesh.services.security import channel_credentials

    return channel_credentials(tls_ca, None, tls_cert, tls_key)


class _Base:
    def __init__(self, target: str, *, api_key: str | None = None, tls_ca: str | None = None,
                 tls_cert: str | None = None, tls_key: str | None = None, timeout: float = DEFAULT_TIMEOUT_S,
                 retries: int = 3, backoff_s: float = 0.1, max_backoff_s: float = 2.0):
        if timeout <= 0 or retries < 0 or backoff_s < 0 or max_backoff_s < 0:
            raise ValueError("timeout must be > 0 seconds; retries, backoff_s and max_backoff_s >= 0")
        self.target = target
        self.timeout = float(timeout)
        self.retries = int(retries)
        self.backoff_s = float(backoff_s)
        self.max_backoff_s = float(max_backoff_s)
        key = api_key if api_key is not None else os.environ.get("KVMESH_API_KEY")
        from kvmesh.services.security import check_api_key

        check_api_key(key)
        self.metadata = (("authorization", f"Bearer {key}"),) if key else None
        env = os.environ.get
        self._creds = _credentials(tls_ca if tls_ca is not None else env("KVMESH_TLS_CA") or None,
                                   tls_cert if tls_cert is not None else env("KVMESH_TLS_CERT") or None,
                                   tls_key if tls_key is not None else env("KVMESH_TLS_KEY") or None)

    def _refuse_key_in_clear(self, channel) -> None:
        """An API key never goes over a plaintext channel this client makes itself."""
        if channel is None and self.metadata is not None and self._creds is None:
            raise ValueError("an API key (--api-key or KVMESH_API_KEY) needs TLS: pass --tls-ca (or set "
                             "KVMESH_TLS_CA; `kvmesh up`'s client.env sets both); without it the key would "
                             "cross the network in clear")

    def _backoff(self, attempt: int) -> float:
        return random.uniform(0.0, min(self.max_backoff_s, self.backoff_s * (2 ** attempt)))

    @staticmethod
    def _retryable(exc: grpc.RpcError) -> bool:
        code = exc.code() if hasattr(exc, "code") else None
        return code == grpc.StatusCode.UNAVAILABLE

    @staticmethod
    def _chunk(msg: pb.GenerateResponse, t0: float, first: float | None, now: float) -> Chunk:
        usage = timing = None
        if msg.finished:
            usage = Usage.from_proto(msg.usage)
            t = msg.timing
            timing = Timing(float(t.queue_ms), float(t.prefill_ms), float(t.ttft_ms), float(t.e2e_ms),
                            round(1000 * ((first or now) - t0), 3), round(1000 * (now - t0), 3))
        return Chunk(list(msg.token_ids), msg.text, msg.finished, msg.finish_reason, msg.worker_id, usage, timing)

    @staticmethod
    def _collect(chunks: list[Chunk], request_id: str) -> Completion:
        if not chunks or not chunks[-1].finished:
            raise _StreamError()
        last = chunks[-1]
        ids = [t for c in chunks for t in c.token_ids]
        worker = next((c.worker_id for c in reversed(chunks) if c.worker_id), "")
        return Completion(ids, "".join(c.text for c in chunks), last.finish_reason, worker, last.usage, last.timing,
                          request_id)


class _StreamError(grpc.RpcError):
    """The stream ended without its final message."""

    def code(self):
        return grpc.StatusCode.UNKNOWN

    def details(self):
        return "stream ended without a final message"

    def __str__(self):
        return self.details()


class KvmeshClient(_Base):
    """Blocking client (``grpc`` sync API). Thread-safe; close it (or use ``with``).

    Args:
        target: ``HOST:PORT`` of a router or worker.
        api_key: sent as ``authorization: Bearer KEY`` (default ``$KVMESH_API_KEY``).
        tls_ca, tls_cert, tls_key: PEM files (see the module doc).
        timeout: default deadline of each call (seconds).
        retries: retries of a call that failed with UNAVAILABLE before any token.
        backoff_s, max_backoff_s: first and largest backoff between retries (seconds).
        channel: use this channel instead of making one (it is not closed by `close`).

    Raises:
        ValueError: unreadable or inconsistent TLS files, an API key without TLS, or a bad number.
    """

    def __init__(self, target: str, *, channel: grpc.Channel | None = None, **kwargs):
        super().__init__(target, **kwargs)
        self._refuse_key_in_clear(channel)
        self._own = channel is None
        if channel is None:
            channel = (grpc.secure_channel(target, self._creds, options=_OPTIONS) if self._creds is not None
                       else grpc.insecure_channel(target, options=_OPTIONS))
        self.channel = channel
        self._stub = pb_grpc.WorkerStub(channel)

    def close(self) -> None:
        if self._own:
            self.channel.close()

    def __enter__(self) -> "KvmeshClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stream_request(self, request: pb.GenerateRequest, timeout: float | None = None) -> Iterator[Chunk]:
        """Stream a prepared ``GenerateRequest``; retries UNAVAILABLE before the first message."""
        deadline = time.monotonic() + (timeout or self.timeout)
        attempt = 0
        while True:
            t0 = time.perf_counter()
            first = None
            got_any = False
            call = self._stub.Generate(request, timeout=max(1e-3, deadline - time.monotonic()),
                                       metadata=self.metadata)
            try:
                for msg in call:
                    got_any = True
                    now = time.perf_counter()
                    if first is None and msg.token_ids:
                        first = now
                    yield self._chunk(msg, t0, first, now)
                return
            except grpc.RpcError as exc:
                if got_any or attempt >= self.retries or not self._retryable(exc):
                    raise with_hint(exc) from None
                pause = self._backoff(attempt)
                if time.monotonic() + pause >= deadline:
                    raise with_hint(exc) from None
                time.sleep(pause)
                attempt += 1
            finally:
                call.cancel()  # a caller that stops iterating early ends the RPC (the server aborts the request)

    def stream(self, prompt: str | None = None, token_ids=None, *, timeout: float | None = None,
               **sampling) -> Iterator[Chunk]:
        """Stream one request's `Chunk` s (keyword arguments as `make_request`)."""
        return self.stream_request(make_request(prompt, token_ids, **sampling), timeout)

    def generate(self, prompt: str | None = None, token_ids=None, *, timeout: float | None = None,
                 **sampling) -> Completion:
        """Run one request to the end; returns its `Completion` (keyword arguments as `make_request`)."""
        req = make_request(prompt, token_ids, **sampling)
        return self._collect(list(self.stream_request(req, timeout)), req.request_id)

    def tokenize(self, text: str, timeout: float | None = None) -> list[int]:
        """Token ids of ``text`` as the server tokenizes it."""
        try:
            return list(self._stub.Tokenize(pb.TokenizeRequest(text=text), timeout=timeout or self.timeout,
                                            metadata=self.metadata).ids)
        except grpc.RpcError as exc:
            raise with_hint(exc) from None


async def _tcp_reason(target: str, timeout: float, tls: bool = False) -> str | None:
    """Why a gRPC channel to ``target`` is not up, from one plain TCP connect (closed at
    once): "connection refused: ...", the OS error, or a hint about TLS when TCP connects;
    None when ``target`` is not HOST:PORT (a name resolver's URI, a unix socket).
    ``timeout``: seconds for the connect."""
    import contextlib

    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit() or "/" in host:
        return None
    try:
        _, writer = await within(asyncio.open_connection(host.strip("[]"), int(port)), timeout)
    except ConnectionRefusedError:
        return "connection refused: nothing listens on that port"
    except asyncio.TimeoutError:
        return f"a TCP connect got no answer within {timeout:g} s"
    except OSError as exc:
        return exc.strerror or str(exc)
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    if tls:
        return ("TCP connects but the TLS channel does not come up: is it a plain server, or one whose "
                "certificate --tls-ca did not sign?")
    return "TCP connects but the gRPC channel does not come up: a TLS server needs --tls-ca"


class AsyncKvmeshClient(_Base):
    """asyncio client (``grpc.aio``); same arguments as `KvmeshClient`. Use ``async with``."""

    def __init__(self, target: str, *, channel: grpc.aio.Channel | None = None, **kwargs):
        super().__init__(target, **kwargs)
        self._refuse_key_in_clear(channel)
        self._own = channel is None
        if channel is None:
            channel = (grpc.aio.secure_channel(target, self._creds, options=_OPTIONS) if self._creds is not None
                       else grpc.aio.insecure_channel(target, options=_OPTIONS))
        self.channel = channel
        self._stub = pb_grpc.WorkerStub(channel)

    async def close(self) -> None:
        if self._own:
            await self.channel.close()

    async def __aenter__(self) -> "AsyncKvmeshClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def wait_ready(self, timeout: float, on_wait=None, notice_after_s: float = 3.0) -> None:
        """Wait until the channel connects, for a server that may still be starting: a refused
        connection is retried until ``timeout`` (seconds) runs out. While waiting, a plain TCP
        connect to ``target`` (HOST:PORT) about once a second finds why the channel is not up
        (e.g. "connection refused"); ``on_wait(reason)``, if given, is called once with that
        reason when the channel is still down after ``notice_after_s`` seconds.

        Raises:
            TimeoutError: not connected within ``timeout`` seconds; the message gives the
                reason of the last attempt when one is known.
        """
        loop = asyncio.get_running_loop()
        start = loop.time()
        deadline = start + timeout
        ready = asyncio.ensure_future(self.channel.channel_ready())
        reason = None
        try:
            while True:
                left = deadline - loop.time()
                if left <= 0:
                    break
                done, _ = await asyncio.wait({ready}, timeout=min(1.0, left))
                if done:
                    ready.result()
                    return
                reason = await _tcp_reason(self.target, min(1.0, max(0.05, deadline - loop.time())),
                                           tls=self._creds is not None)
                if on_wait is not None and reason and loop.time() - start >= notice_after_s:
                    on_wait(reason)
                    on_wait = None
        finally:
            if not ready.done():
                ready.cancel()
        raise TimeoutError(f"cannot reach {self.target} within {timeout:g} s" + (f": {reason}" if reason else ""))

    def generate_call(self, request: pb.GenerateRequest, timeout: float | None = None):
        """The raw ``Generate`` call (an async iterator of ``GenerateResponse``; no retries),
        for callers that time each message themselves (the load harness)."""
        return self._stub.Generate(request, timeout=timeout or self.timeout, metadata=self.metadata)

    async def stream_request(self, request: pb.GenerateRequest, timeout: float | None = None) -> AsyncIterator[Chunk]:
        """Stream a prepared ``GenerateRequest``; retries UNAVAILABLE before the first message."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (timeout or self.timeout)
        attempt = 0
        while True:
            t0 = time.perf_counter()
            first = None
            got_any = False
            call = self._stub.Generate(request, timeout=max(1e-3, deadline - loop.time()), metadata=self.metadata)
            try:
                async for msg in call:
                    got_any = True
                    now = time.perf_counter()
                    if first is None and msg.token_ids:
                        first = now
                    yield self._chunk(msg, t0, first, now)
                return
            except grpc.RpcError as exc:
                if got_any or attempt >= self.retries or not self._retryable(exc):
                    raise with_hint(exc) from None
                pause = self._backoff(attempt)
                if loop.time() + pause >= deadline:
                    raise with_hint(exc) from None
                await asyncio.sleep(pause)
                attempt += 1
            finally:
                call.cancel()

    def stream(self, prompt: str | None = None, token_ids=None, *, timeout: float | None = None,
               **sampling) -> AsyncIterator[Chunk]:
        """Stream one request's `Chunk` s (keyword arguments as `make_request`)."""
        return self.stream_request(make_request(prompt, token_ids, **sampling), timeout)

    async def generate(self, prompt: str | None = None, token_ids=None, *, timeout: float | None = None,
                       **sampling) -> Completion:
        """Run one request to the end; returns its `Completion`."""
        req = make_request(prompt, token_ids, **sampling)
        return self._collect([c async for c in self.stream_request(req, timeout)], req.request_id)

    async def tokenize(self, text: str, timeout: float | None = None) -> list[int]:
        """Token ids of ``text`` as the server tokenizes it."""
        try:
            res = await self._stub.Tokenize(pb.TokenizeRequest(text=text), timeout=timeout or self.timeout,
                                            metadata=self.metadata)
        except grpc.RpcError as exc:
            raise with_hint(exc) from None
        return list(res.ids)
