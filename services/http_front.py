"""An OpenAI-compatible HTTP front (aiohttp) for the router or a single worker.

Routes:

* ``POST /v1/completions`` and ``POST /v1/chat/completions``, with ``"stream": true``
  answered as server-sent events (``data: {chunk}`` lines, then ``data: [DONE]``), as
  OpenAI's API does.
* ``GET /v1/models`` (the one model served) and ``GET /v1/models/{id}``, ``GET /health``,
  ``GET /metrics`` (the process's Prometheus registry).

Each request becomes a ``kvmesh.v1.GenerateRequest`` and goes through the same code the
gRPC front runs (the router's or worker's ``Generate``), called with a small
`_HttpContext` in place of the gRPC servicer context; its ``abort`` raises `GrpcAbort`,
which maps once to an HTTP status and OpenAI's error body
``{"error": {"message", "type", "param", "code"}}`` (`HTTP_STATUS`).

Usage follows OpenAI's prompt-caching fields: ``usage.prompt_tokens_details.cached_tokens``
is the number of prompt tokens served from the cache; kvmesh's own split sits in the
extension object ``usage.kvmesh`` (``cached_tokens_by_tier``, ``computed_prefill_tokens``,
``worker_id``, ``timing`` in ms).

Chat prompts are rendered with the model's chat template (`services.chat_template`) and
tokenized here without adding special tokens again, and Generate is told so
(`_HttpContext.tokenized_from_text`: a router checks them as text); completions send the
prompt text (or token ids) as is, so a completion is token for token what the gRPC API
returns for the same prompt.

Authentication: the request's ``Authorization`` header is handed to Generate as the
``authorization`` gRPC metadata (`_HttpContext.invocation_metadata`), so a Generate that
resolves tenants from credentials treats an HTTP request exactly as a gRPC one with the
same key (an UNAUTHENTICATED abort answers 401, PERMISSION_DENIED 403). Independently, an
injected callable ``authenticate(authorization_header) -> tenant`` (header value or None)
can check keys at the front: anything it raises answers 401 before Generate runs, and
its tenant becomes the request's cache salt. Without it the body's optional
``cache_salt`` extension is passed on as the gRPC field would be (``null``, as absent: no
salt).

Request fields kvmesh honours: ``model`` (must name the served model when given: its id
or one of the front's ``model_aliases``; in front of a router a full checkpoint id, with
``@``, is also sent as Generate's ``model_id``, so the router refuses it if it no longer
serves that checkpoint when the request is routed),
``prompt`` / ``messages``, ``max_tokens`` (``max_completion_tokens`` for chat; default 16
for completions, the rest of the context for chat, as in vLLM), ``temperature`` (default 1),
``top_p``, ``seed`` (absent: a random one per request), ``stream``,
``stream_options.include_usage``, ``n`` (only 1), and the extensions ``ignore_eos``, ``return_token_ids`` (each choice then carries ``token_ids``)
and ``cache_salt``. OpenAI fields that do not change the output (``user``, ``metadata``,
``store``, ...; `IGNORED`) are accepted and ignored. Anything that would change the output
and is not supported (``stop``, ``logprobs``, ``n`` > 1, penalties, tools, ``echo``...;
`UNSUPPORTED`) is refused with a 400 naming the field, never silently ignored, and so is a
field that is neither (a typo, another server's extension): the 400 names it and lists
the fields the route accepts (`accepted_fields`).

Connection limits (`serve_app`, also used by the vLLM router's front): a client has
``header_timeout_s`` seconds (default `DEFAULT_HEADER_TIMEOUT_S`) to send a request's line
and headers, from connecting or from the end of its previous response on a kept-alive
connection (aiohttp's ``keepalive_timeout``); a slower or idle one is closed. A request's
body must arrive within ``body_timeout_s`` (`DEFAULT_BODY_TIMEOUT_S`, else 408). Neither
limit applies once the handler answers, so a long streamed completion is never cut. At
most ``max_connections`` connections are open at once (`default_max_connections`); one
past the cap is answered 503 and closed without being read (over TLS after a handshake,
a few at a time: `ConnectionGate`). Accept errors for want of file
descriptors or memory (EMFILE...), and aiohttp's own errors about malformed requests (one
line each, without a traceback), are logged at most ``LOG_BURST`` times a window.
"""
from __future__ import annotations

import asyncio
import contextlib
import errno
import inspect
import json
import logging
import math
import re
import secrets
import time
import uuid
from typing import AsyncIterator, Awaitable, Callable

import grpc
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.services.aio import within
from kvmesh.services.chat_template import ChatTemplate, ChatTemplateError
from kvmesh.workers.grpc_guard import LogLimiter, clip, open_file_share
from kvmesh.workers.limits import MAX_CACHE_SALT_CHARS, as_float32

log = logging.getLogger(__name__)

#: gRPC status -> (HTTP status, OpenAI error type). FAILED_PRECONDITION is a 400: what
#: reaches a front with it is a router's refusal of text (or a chat prompt) for workers of
#: another tokenizer, which the client can work around by sending token ids; the fleet's own
#: states (no usable worker) come as UNAVAILABLE, a 503.
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}
#: Default deadline of one HTTP request (seconds), as the CLI's gRPC default.
DEFAULT_TIMEOUT_S = 600.0
#: Seconds a client has to send a request's line and headers (from connecting, or from the
#: end of the previous response on a kept-alive connection) before it is closed.
DEFAULT_HEADER_TIMEOUT_S = 15.0
#: Seconds to read a request's body once its headers arrived (408 after).
DEFAULT_BODY_TIMEOUT_S = 60.0
#: Deadline (seconds) of the TLS handshake that precedes a 503 to a connection over the cap.
REFUSAL_HANDSHAKE_TIMEOUT_S = 5.0

#: Most connections a front keeps open at once (lowered to a quarter of the process's
#: open-file limit when that is smaller; see `default_max_connections`).
DEFAULT_MAX_CONNECTIONS = 1024
#: context (tokens) assumed when the front is not told the model's
DEFAULT_CONTEXT_TOKENS = 4096
#: Request fields refused because kvmesh would otherwise silently ignore them.
UNSUPPORTED = ("stop", "logprobs", "top_logprobs", "echo", "best_of", "suffix", "logit_bias", "presence_penalty",
               "frequency_penalty", "tools", "tool_choice", "functions", "function_call", "response_format",
               "stop_token_ids", "min_tokens")
#: Per unsupported field, the values that ask for what kvmesh does anyway (OpenAI's defaults,
#: which clients send unasked); null is neutral for every field. Anything else is refused. A
#: value matches only with the same JSON type: ``false`` is not ``0``, ``true`` is not ``1``.
#: ``logprobs`` is a count on the legacy completions route, where 0 still asks for the sampled
#: token's logprob (so only null is neutral there), and a boolean on chat.
_NEUTRAL_FOR = {
    "stop": ([],), "logprobs": (False,), "top_logprobs": (0,), "echo": (False,), "best_of": (1,),
    "suffix": ("",), "logit_bias": ({},), "presence_penalty": (0,), "frequency_penalty": (0,), "tools": ([],),
    "tool_choice": ("none", "auto"), "functions": ([],), "function_call": ("none", "auto"),
    "response_format": ({"type": "text"},), "stop_token_ids": ([],), "min_tokens": (0,),
    "modalities": (["text"],), "web_search_options": ({},), "reasoning_effort": ("none",),
}


def _neutral(name: str, value, route: str) -> bool:
    """Whether ``value`` of the unsupported field ``name`` asks for nothing kvmesh does not do."""
    if value is None:
        return True
    if name == "logprobs" and route == "completions":
        return False
    return any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in _NEUTRAL_FOR.get(name, ()))
#: Request fields each route honours (OpenAI's, then kvmesh's extensions).
HONOURED = {
    "completions": ("model", "prompt", "max_tokens", "temperature", "top_p", "seed", "n", "stream",
                    "stream_options", "ignore_eos", "return_token_ids", "cache_salt"),
    "chat": ("model", "messages", "max_completion_tokens", "max_tokens", "temperature", "top_p", "seed", "n",
             "stream", "stream_options", "ignore_eos", "return_token_ids", "cache_salt"),
}
#: OpenAI request fields accepted and ignored: they do not change the output (end-user ids,
#: storage and billing hints, tool-call parallelism without tools, which are refused).
IGNORED = ("user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier",
           "parallel_tool_calls")
#: OpenAI's chat-only fields that change the output and that kvmesh does not implement
#: (refused like `UNSUPPORTED` unless neutral).
UNSUPPORTED_CHAT = ("modalities", "audio", "prediction", "reasoning_effort", "verbosity", "web_search_options")


def accepted_fields(route: str) -> tuple[str, ...]:
    """Every top-level request field ``route`` ("completions" or "chat") takes without a 400
    for being unknown: honoured, ignored, and unsupported ones (refused unless neutral)."""
    return HONOURED[route] + IGNORED + UNSUPPORTED + (UNSUPPORTED_CHAT if route == "chat" else ())

#: Fields of ``stream_options`` accepted: ``include_usage`` is honoured; ``include_obfuscation``
#: (OpenAI's padding of chunks) and vLLM's ``continuous_usage_stats`` (a boolean: usage comes in
#: the last chunk only, with ``include_usage``) are ignored.
STREAM_OPTIONS = ("include_usage", "include_obfuscation", "continuous_usage_stats")
Authenticator = Callable[[str | None], "str | Awaitable[str]"]


class GrpcAbort(Exception):
    """Raised by `_HttpContext.abort`: the request ends with this gRPC status."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing_metadata: tuple = ()):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.trailing_metadata = trailing_metadata


async def read_json_object(request: web.Request, timeout_s: float | None = DEFAULT_BODY_TIMEOUT_S) -> dict:
    """The request body parsed as a JSON object, read within ``timeout_s`` seconds (None: no
    limit).

    Raises:
        web.HTTPRequestTimeout: the body did not arrive in time (a 408).
        web.HTTPRequestEntityTooLarge: the body is, or its Content-Length says it is, over
            the application's ``client_max_size`` (a 413; a declared size is refused before
            the body is read).
        ValueError: the body is not a JSON object; the message (safe to send back, as a
            400) says why: invalid JSON or UTF-8, a charset Python does not know, a body
            that does not decode as its Content-Encoding says, an integer past Python's
            digit limit (4,300 digits), nesting too deep for the parser, or another JSON
            value.
    """
    declared, most = request.content_length, request.client_max_size
    if declared is not None and most and declared > most:  # refused before a byte of it is read
        raise web.HTTPRequestEntityTooLarge(max_size=most, actual_size=declared)
    try:
        body = json.loads(await within(request.text(), timeout_s))
    except asyncio.TimeoutError:
        raise web.HTTPRequestTimeout(reason=f"request body not received within {timeout_s:g} s") from None
    except LookupError:  # Content-Type names a charset Python does not know
        raise ValueError(f"request body's charset {clip(str(request.charset), 40)!r} is not supported: send UTF-8 "
                         "(Content-Type: application/json)") from None
    except (web.RequestPayloadError, HttpProcessingError) as exc:  # e.g. Content-Encoding gzip on a plain body
        raise ValueError(f"request body could not be read as sent (Content-Encoding "
                         f"{clip(request.headers.get('Content-Encoding', 'none'), 40)!r}): "
                         f"{clip(str(exc.__cause__ or exc), 120)}; send it plain or correctly encoded") from None
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        # ValueError covers JSONDecodeError and an integer past Python's digit limit;
        # RecursionError, arrays nested thousands deep
        why = "nested too deeply" if isinstance(exc, RecursionError) else clip(str(exc), 120)
        raise ValueError(f"request body is not valid JSON ({why})") from None
    if not isinstance(body, dict):
        raise ValueError("request body must be a JSON object")
    return body


def default_max_connections() -> int:
    """`DEFAULT_MAX_CONNECTIONS`, or a quarter of the process's open-file limit when that is
    lower: the front's connections never take the descriptors the gRPC port needs
    (`grpc_guard.open_file_share`)."""
    return open_file_share(DEFAULT_MAX_CONNECTIONS)


_BUSY_BODY = json.dumps({"error": {"message": "too many open connections to this server; retry later",
                                   "type": "service_unavailable", "param": None, "code": "too_many_connections"}})
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
         b"Retry-After: 1\r\nContent-Length: %d\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY.encode()))


class _GuardedConnection(asyncio.Protocol):
    """One connection in front of aiohttp's handler (`ConnectionGate`): refused when the
    gate is full, else passed on, and closed if its first request's headers have not
    arrived within the header timeout.

    The gate counts a connection from its TCP accept, before any TLS handshake: with a TLS
    front the listener is plain TCP and an admitted connection is upgraded here
    (``loop.start_tls``), so a client that connects and never shakes hands holds a slot
    (until the header timeout), not an uncounted descriptor."""

    def __init__(self, gate: "ConnectionGate", handler: asyncio.Protocol):
        self.gate, self.handler = gate, handler
        self.transport: asyncio.BaseTransport | None = None
        self.admitted = False   # counted in gate.open
        self.attached = False   # aiohttp's handler has the connection
        self.timer: asyncio.TimerHandle | None = None
        self._early: list[bytes] = []  # decrypted bytes that came before the handler was attached
        self._early_eof = False

    def connection_made(self, transport) -> None:
        self.transport = transport
        gate = self.gate
        if gate.open >= gate.max_connections:
            gate.refused += 1
            if gate.ssl_context is None:
                transport.write(_BUSY)
            elif gate.refusing < gate.refusal_slots:
                # a TLS client cannot read a plaintext answer: shake hands (a few at a time, on a
                # short deadline) to tell it 503; past those few it only sees the connection close
                gate.refusing += 1
                gate.handshakes.add(asyncio.get_running_loop().create_task(self._refuse_over_tls(transport)))
                return
            transport.close()
            return
        gate.open += 1
        self.admitted = True
        loop = asyncio.get_running_loop()
        self.timer = loop.call_later(gate.header_timeout_s, self._headers_late)  # handshake included
        if gate.ssl_context is None:
            self._attach(transport)
        else:
            gate.handshakes.add(loop.create_task(self._start_tls(transport)))

    async def _start_tls(self, raw) -> None:
        try:
            tls = await asyncio.get_running_loop().start_tls(
                raw, self, self.gate.ssl_context, server_side=True,
                ssl_handshake_timeout=self.gate.header_timeout_s)
        except (OSError, asyncio.TimeoutError, ConnectionError, asyncio.CancelledError):
            raw.close()  # a failed, timed-out or abandoned handshake: nothing reached aiohttp
            self._release()
            return
        finally:
            self.gate.handshakes.discard(asyncio.current_task())
        if not self.admitted or tls is None:  # closed during the handshake (the header timer, a reset)
            (tls or raw).close()
            self._release()
            return
        self.transport = tls
        self._attach(tls)

    async def _refuse_over_tls(self, raw) -> None:
        """Answer a connection over the cap `_BUSY` after a TLS handshake, then close it."""
        tls = None
        try:
            tls = await asyncio.get_running_loop().start_tls(
                raw, self, self.gate.ssl_context, server_side=True,
                ssl_handshake_timeout=min(self.gate.header_timeout_s, REFUSAL_HANDSHAKE_TIMEOUT_S))
            if tls is not None:
                tls.write(_BUSY)
        except (OSError, asyncio.TimeoutError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            (tls or raw).close()
            self.gate.refusing -= 1
            self.gate.handshakes.discard(asyncio.current_task())

    def _attach(self, transport) -> None:
        self.attached = True
        self.gate.waiting[self.handler] = self
        self.handler.connection_made(transport)
        early, self._early = self._early, []
        for chunk in early:
            self.handler.data_received(chunk)
        if self._early_eof:
            self.handler.eof_received()

    def _release(self) -> bool:
        """Uncount an admitted connection (once); True if this call did."""
        if not self.admitted:
            return False
        self.admitted = False
        self.gate.open -= 1
        self.gate.waiting.pop(self.handler, None)
        self.first_request()
        return True

    def first_request(self) -> None:
        """The first request's headers arrived: the deadline is aiohttp's from now on."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _headers_late(self) -> None:
        self.timer = None
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc) -> None:
        self._release()
        self.transport = None
        if self.attached:
            self.attached = False
            self.handler.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.attached:
            self.handler.data_received(data)
        elif self.admitted:  # TLS: the first records can arrive before `_start_tls` resumes
            self._early.append(data)

    def eof_received(self):
        if self.attached:
            return self.handler.eof_received()
        self._early_eof = True
        return None

    def pause_writing(self) -> None:
        if self.attached:
            self.handler.pause_writing()

    def resume_writing(self) -> None:
        if self.attached:
            self.handler.resume_writing()


class ConnectionGate:
    """The protocol factory of an HTTP front: aiohttp's `web.Server` behind a cap on open
    connections and a deadline for the first request's headers.

    aiohttp's ``keepalive_timeout`` (set by `serve_app` to the same value) closes a
    connection idle between requests; this gate adds the deadline from connecting to the
    first request's headers (aiohttp releases before 3.14 start that timer only after a
    response) and the cap: a connection past ``max_connections`` is answered 503 and
    closed, and never reaches aiohttp. Over TLS that answer needs a handshake: at most
    ``refusal_slots`` of them run at once (1/16 of the cap, 4-64), each on a deadline of
    `REFUSAL_HANDSHAKE_TIMEOUT_S`; connections past those are closed unanswered.
    """

    def __init__(self, server: web.Server, header_timeout_s: float, max_connections: int, ssl_context=None):
        self.server = server
        self.header_timeout_s = header_timeout_s
        self.max_connections = max_connections
        #: TLS of the front (None: plain HTTP); connections are upgraded after the gate admits them
        self.ssl_context = ssl_context
        #: handshakes in progress (tasks), kept referenced until they end
        self.handshakes: set[asyncio.Task] = set()
        self.open = 0
        self.refused = 0
        #: TLS handshakes at most in progress to answer connections over the cap 503 (beyond
        #: them an over-cap TLS connection is closed unanswered), and how many are
        self.refusal_slots = max(4, min(64, max_connections // 16))
        self.refusing = 0
        # aiohttp handler -> its connection, until the first request's headers arrive
        self.waiting: dict[asyncio.Protocol, _GuardedConnection] = {}
        make_request = server.request_factory

        def request_factory(message, payload, protocol, writer, task):
            conn = self.waiting.pop(protocol, None)
            if conn is not None:
                conn.first_request()
            return make_request(message, payload, protocol, writer, task)

        server.request_factory = request_factory

    def __call__(self) -> asyncio.Protocol:
        return _GuardedConnection(self, self.server())


#: errnos of an accept that failed for want of descriptors or memory
_RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class _ResourceErrorLog:
    """An event-loop exception handler that writes errors for want of file descriptors or
    memory (asyncio's "socket.accept() out of system resource") through a `LogLimiter`, one
    line each without a traceback, and hands everything else to the handler before it."""

    def __init__(self, previous):
        self.previous = previous
        self.limiter = LogLimiter(log, "accept errors")

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in _RESOURCE_ERRNOS:
            self.limiter.warn("%s: %s (the process is out of file descriptors or memory; raise `ulimit -n` or "
                              "lower the connection cap)", context.get("message", "I/O error"), exc)
            return
        if self.previous is not None:
            self.previous(loop, context)
        else:
            loop.default_exception_handler(context)


def limit_resource_error_logs(loop: asyncio.AbstractEventLoop) -> None:
    """Install `_ResourceErrorLog` on ``loop`` (once)."""
    current = loop.get_exception_handler()
    if not isinstance(current, _ResourceErrorLog):
        loop.set_exception_handler(_ResourceErrorLog(current))


#: Bytes of the request that aiohttp quotes in a parse error (``b'...'``: a chunk-size line
#: may be a prompt's JSON); the log keeps the error's kind, not the tenant's text.
_REQUEST_BYTES = re.compile(r"""\bb'(?:[^'\\]|\\.)*'?|\bb"(?:[^"\\]|\\.)*"?""")


class _ServerLogLimit(logging.Filter):
    """A filter on aiohttp's server logger, which writes an ERROR with a traceback for every
    malformed request (a bad chunk size, a body that does not decode as its Content-Encoding
    says, an oversized header...), before any authentication: anyone who reaches the port
    could fill the log. Client errors (`HttpProcessingError`, ``RequestPayloadError``, a
    reset connection) become one WARNING line without a traceback or the request bytes
    aiohttp quotes; anything else keeps its traceback; both go through a
    `LogLimiter` (at most ``LOG_BURST`` lines a window, the rest counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.client_errors = LogLimiter(log, "malformed HTTP requests")
        self.other_errors = LogLimiter(log, "HTTP server errors")

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, (HttpProcessingError, web.RequestPayloadError, ConnectionError)):
            self.client_errors.warn("%s: %s: %s", record.getMessage(), type(exc).__name__,
                                    clip(" ".join(_REQUEST_BYTES.sub("<request bytes>", str(exc)).split())))
        else:
            self.other_errors.error("%s", record.getMessage(), exc_info=record.exc_info)
        return False


def limit_server_error_logs() -> None:
    """Install `_ServerLogLimit` on aiohttp's server logger (once per process)."""
    server_log = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, _ServerLogLimit) for f in server_log.filters):
        server_log.addFilter(_ServerLogLimit())


class HttpServing:
    """An aiohttp application served by `serve_app`; ``port`` is the bound port."""

    def __init__(self, runner: web.AppRunner, server: asyncio.AbstractServer, gate: ConnectionGate):
        self.runner, self.server, self.gate = runner, server, gate
        self.port = int(server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        self.server.close()
        for task in list(self.gate.handshakes):
            task.cancel()
        await self.runner.cleanup()


async def serve_app(app: web.Application, host: str, port: int, ssl_context=None, *,
                    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S, max_connections: int | None = None,
                    **runner_kwargs) -> HttpServing:
    """Serve ``app`` on host:port (0 = a free port) with the limits the module docstring
    describes: ``header_timeout_s`` for a request's line and headers (and a TLS handshake),
    at most ``max_connections`` open connections (None: `default_max_connections`).
    ``runner_kwargs`` go to ``web.AppRunner``.

    Raises:
        OSError: the port could not be bound.
    """
    # handler_cancellation: a client that disconnects cancels its handler, so a worker stops
    # generating (and a tenant's slot is freed) for an answer nobody will read
    runner_kwargs.setdefault("handler_cancellation", True)
    runner = web.AppRunner(app, keepalive_timeout=header_timeout_s, **runner_kwargs)
    await runner.setup()
    assert runner.server is not None
    gate = ConnectionGate(runner.server, header_timeout_s, max_connections or default_max_connections(),
                          ssl_context)
    loop = asyncio.get_running_loop()
    limit_resource_error_logs(loop)
    limit_server_error_logs()
    try:
        # plain TCP even for TLS: the gate counts (and refuses) a connection before its
        # handshake, then upgrades it (`_GuardedConnection._start_tls`)
        server = await loop.create_server(gate, host, port)
    except OSError:
        await runner.cleanup()
        raise
    return HttpServing(runner, server, gate)


def expect_within(limit_bytes: int, refusal: Callable[[], web.StreamResponse]):
    """An aiohttp ``expect_handler`` for POST routes: a request whose ``Expect:
    100-continue`` comes with a Content-Length over ``limit_bytes`` is answered ``refusal()``
    (the route's handler does not run) and the connection closes, instead of ``100
    Continue``, so the client never sends the body (RFC 9110, section 10.1.1); otherwise as
    aiohttp's default (HTTP/1.1: ``100 Continue``, another expectation 417; HTTP/1.0: the
    header is ignored). The refusal comes before credentials are checked: a 413 tells a
    caller without them nothing about the service."""
    async def expect(request: web.Request) -> web.StreamResponse | None:
        declared = request.content_length
        if declared is not None and declared > limit_bytes:
            resp = refusal()
            resp.force_close()
            return resp
        if request.version < (1, 1):
            return None
        if request.headers.get("Expect", "").lower() != "100-continue":
            raise web.HTTPExpectationFailed(text=f"unknown Expect: {clip(request.headers.get('Expect', ''), 60)}")
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the answer's own bytes start after it
        return None
    return expect


def too_large(max_body_bytes: int) -> "HttpError":
    """The 413 of a body over ``max_body_bytes``."""
    return HttpError(413, f"request body over {max_body_bytes:,} bytes: more than the model's context could hold; "
                          "shorten the prompt")


class HttpError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    @classmethod
    def from_abort(cls, exc: GrpcAbort, max_tokens_field: str = "max_tokens") -> "HttpError":
        """The HTTP error for a gRPC refusal; a refusal of ``max_tokens`` names
        ``max_tokens_field``, the field the client sent (chat's ``max_completion_tokens``)."""
        status, type_ = HTTP_STATUS.get(exc.code, (500, "server_error"))
        # a rate limit's "retry-after" (seconds) becomes the Retry-After header (RFC 9110, 10.2.3)
        retry = next((v for k, v in exc.trailing_metadata if k == "retry-after" and str(v).isdigit()), None)
        details = exc.details or exc.code.name
        # the engine's one refusal about a request field that the front cannot check (it does
        # not know the context): name it, as every refusal made here does
        param = None
        if exc.code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("max_tokens "):
            param = max_tokens_field
            details = max_tokens_field + details[len("max_tokens"):]
        return cls(status, details, type_, param=param, code=exc.code.name.lower(),
                   headers={"Retry-After": str(retry)} if retry is not None else None)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status, headers=self.headers)


class _HttpContext:
    """The part of ``grpc.aio.ServicerContext`` that the Generate code paths use.

    ``tokenized_from_text``: the request's token ids are this front's tokenization of text
    (a chat prompt), not ids the client sent; a router checks them as text against the
    tokenizer of the workers it routes to (`services.router`)."""

    def __init__(self, timeout_s: float, metadata: tuple = (), tokenized_from_text: bool = False):
        self._deadline = time.monotonic() + timeout_s
        self._metadata = metadata
        self._trailing: tuple = ()
        self.tokenized_from_text = tokenized_from_text

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise GrpcAbort(code, details, self._trailing)

    def set_trailing_metadata(self, metadata: tuple) -> None:
        self._trailing = tuple(metadata)

    def time_remaining(self) -> float:
        return max(0.0, self._deadline - time.monotonic())

    def invocation_metadata(self) -> tuple:
        return self._metadata

    def peer(self) -> str:
        return "http"

    def auth_context(self) -> dict:
        return {}

    def cancelled(self) -> bool:
        return False

    def done(self) -> bool:
        return False


def _error_middleware(max_body_bytes: int = 0):
    # a request that finds a bug may come again and again: its traceback is logged, not every time
    failures = LogLimiter(log, "failed HTTP requests")

    @web.middleware
    async def middleware(request, handler):
        try:
            return await handler(request)
        except HttpError as exc:
            return exc.response()
        except GrpcAbort as exc:
            return HttpError.from_abort(exc).response()
        except web.HTTPException as exc:  # 404 / 405 from the router: OpenAI's error body too
            if exc.status < 400:
                raise
            if exc.status == 413:
                resp = too_large(max_body_bytes).response()
            else:
                resp = HttpError(exc.status, f"{request.method} {request.path}: {exc.reason}",
                                 "not_found_error" if exc.status == 404 else "invalid_request_error").response()
            if exc.status in (408, 413):
                # the body was not read to its end: what the client still sends would be read
                # as the next request on this connection, so it closes after the answer
                resp.force_close()
            return resp
        except ConnectionError:  # the client went away (reset mid-body, closed before the answer): its choice
            log.debug("HTTP %s %s: client disconnected", request.method, clip(request.path, 200))
            raise
        except Exception:  # noqa: BLE001 - one failed request never takes the front down
            failures.exception("HTTP %s %s failed", request.method, clip(request.path, 200))
            return HttpError(500, "internal error; see the server log", "server_error").response()
    return middleware


def _number(body: dict, name: str, default, lo: float | None = None, hi: float | None = None, integer=False):
    value = body.get(name, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            integer and isinstance(value, float) and not value.is_integer()):
        raise HttpError(400, f"{name} must be {'an integer' if integer else 'a number'} (got {clip(repr(value), 60)})",
                        param=name)
    # an int is compared as an int: a 400-digit one has no float (OverflowError)
    if (isinstance(value, float) and not math.isfinite(value)) or (lo is not None and value < lo) or (
            hi is not None and value > hi):
        rng = f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        raise HttpError(400, f"{name} must be in {rng} (got {clip(repr(value), 60)})", param=name)
    return int(value) if integer else float(value)


def _seed(body: dict) -> int:
    """``seed`` in [0, 2**64); absent or null, a random one, so that sampled completions
    differ between requests as OpenAI's and vLLM's do (the wire's seed has no "unset": a
    worker seeds every sampled request's generator with it). Raises `HttpError` 400."""
    if body.get("seed") is None:
        return secrets.randbits(64)
    return _number(body, "seed", 0, lo=0, hi=2**64 - 1, integer=True)


def _top_p(body: dict) -> float:
    """``top_p`` in (0, 1] (as vLLM's ``SamplingParams``). 0 is refused rather than taken: the
    wire format reads a top_p of 0 as 1 (nucleus sampling off), the opposite of what a client
    asking for 0 means; so is a positive value under float32's smallest (about 1.4e-45), which
    the wire's 32-bit float holds as 0. Raises `HttpError` 400."""
    why = (f"top_p must be in (0, 1] (got {clip(repr(body.get('top_p')), 60)}): 1 keeps every token, a small "
           "value such as 0.01 keeps only the likeliest; for greedy decoding send temperature 0")
    try:
        value = _number(body, "top_p", 1.0, lo=0.0, hi=1.0)
    except HttpError as exc:
        if "must be in" in exc.message:
            raise HttpError(400, why, param="top_p") from None
        raise  # not a number
    if as_float32(value) == 0.0:  # 0, or so small that the wire's 32-bit float holds it as 0
        raise HttpError(400, why, param="top_p")
    return value


def _flag(body: dict, name: str, param: str | None = None) -> bool:
    """A JSON boolean field (absent or null: false). Anything else ("no", 0, 1) is refused
    rather than read by truthiness. Raises `HttpError` 400 naming ``param`` (default ``name``)."""
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise HttpError(400, f"{param or name} must be true or false (got {clip(repr(value), 60)})",
                        param=param or name)
    return value


def _utf8(text: str, name: str) -> str:
    """``text`` if it encodes as UTF-8; JSON's ``\\ud800`` escapes decode to lone surrogates,
    which no tokenizer or protobuf string takes. Raises `HttpError` 400 naming ``name``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise HttpError(400, f"{name} holds a lone surrogate (\\u{ord(exc.object[exc.start]):04x} at character "
                             f"{exc.start}), which is not valid Unicode text: send UTF-16 surrogates in pairs",
                        param=name) from None
    return text


class HttpFront:
    """The HTTP front of one process.

    Args:
        generate: ``async generator (GenerateRequest, context) -> GenerateResponse`` (the
            router's or worker's ``Generate``).
        tokenizer: the process's tokenizer (chat prompts are tokenized here).
        model_id: the served model's id (``/v1/models``, the ``model`` field); requests may
            also name it by one of ``model_aliases`` (empty here; a router sets them).
        model_dir: where the chat template is read from (None: the built-in model).
        registry: Prometheus registry served at ``/metrics`` (None: 404 there).
        authenticate: ``Authorization`` header -> tenant; raising answers 401. None
            allows anonymous requests.
        check_key: ``Authorization`` header -> anything, raising for a refused key; when
            ``authenticate`` is None and Generate checks keys itself (the router's and
            worker's fronts: their gRPC gate resolves tenants from the forwarded header),
            every route that answers about the model (``/v1/models``, the model check of
            completions) asks for a key first. None: those routes are open when
            ``authenticate`` is None.
        max_model_len: context limit (tokens), for chat's default ``max_tokens``.
        timeout_s: deadline of each request (seconds).
        header_timeout_s: seconds a client has to send a request's headers (and to send
            the next request on a kept-alive connection) before it is closed.
        body_timeout_s: seconds to read a request's body (408 after).
        max_connections: most open connections (None: `default_max_connections`); one more
            is answered 503 and closed unread.
    """

    def __init__(self, generate, tokenizer, model_id: str, model_dir: str | None = None, registry=None,
                 authenticate: Authenticator | None = None, max_model_len: int | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, check_key: Authenticator | None = None,
                 header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S, body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
                 max_connections: int | None = None):
        self.generate = generate
        self.tokenizer = tokenizer
        self.model_id = model_id
        #: other names that ``model`` may give the served model (a router sets them: its
        #: folder's name, the workers' id with or without compute tag)
        self.model_aliases: frozenset[str] = frozenset()
        #: a ``model`` that is a full checkpoint id (with "@") goes into Generate's ``model_id``,
        #: so a router that no longer routes to that checkpoint when the request is routed (its
        #: fleet changed while the request waited) refuses it NOT_FOUND instead of answering
        #: with another model (a router sets this; a worker's front checks ``model`` alone)
        self.forward_model_id = False
        #: the process's metrics port takes a bearer token (`--metrics-token-file`): this front,
        #: which cannot ask for it, does not serve them either
        self.metrics_private = False
        self.chat_template = ChatTemplate.for_model(model_dir)
        self.registry = registry
        self.authenticate = authenticate
        self.check_key = check_key
        self.max_model_len = max_model_len
        #: returns the longest context a live worker serves (tokens): a router sets it, as
        #: its workers' KV pools may hold less than the model's context; None: ``max_model_len``
        self.context_fn: Callable[[], int] | None = None
        self.timeout_s = timeout_s
        self.header_timeout_s = header_timeout_s
        self.body_timeout_s = body_timeout_s
        self.max_connections = max_connections
        self.created = int(time.time())
        self._serving: HttpServing | None = None
        # bodies capped by what the longest prompt takes as JSON (`workers.limits.http_body_bytes_limit`):
        # a body past it is refused (413) before it is read, let alone parsed
        from kvmesh.workers.limits import http_body_bytes_limit

        self.max_body_bytes = http_body_bytes_limit(max_model_len or DEFAULT_CONTEXT_TOKENS)
        self.app = web.Application(middlewares=[_error_middleware(self.max_body_bytes)],
                                   client_max_size=self.max_body_bytes)
        expect = expect_within(self.max_body_bytes, lambda: too_large(self.max_body_bytes).response())
        self.app.add_routes([
            web.post("/v1/completions", self.completions, expect_handler=expect),
            web.post("/v1/chat/completions", self.chat_completions, expect_handler=expect),
            web.get("/v1/models", self.models),
            web.get("/v1/models/{model}", self.model),
            web.get("/health", self.health),
            web.get("/metrics", self.metrics),
        ])

    async def start(self, host: str, port: int, ssl_context=None) -> int:
        """Serve on host:port (0 = a free port); returns the bound port.

        ``ssl_context`` (an ``ssl.SSLContext``) serves HTTPS instead of plain HTTP.

        Raises:
            RuntimeError: the port could not be bound (names ``--http-port``).
        """
        # handler_cancellation: a client that leaves cancels its handler, which ends the
        # Generate call, so the worker aborts the request instead of computing it for nobody
        try:
            self._serving = await serve_app(self.app, host, port, ssl_context, header_timeout_s=self.header_timeout_s,
                                            max_connections=self.max_connections, access_log=None,
                                            handle_signals=False, handler_cancellation=True)
        except OSError as exc:
            raise RuntimeError(f"--http-port {port}: could not bind {host}:{port} ({exc}); pick a free port") from None
        bound = self._serving.port
        print(f"kvmesh HTTP front on {'https' if ssl_context else 'http'}://{host}:{bound}/v1", flush=True)
        return int(bound)

    async def stop(self) -> None:
        if self._serving is not None:
            await self._serving.stop()
            self._serving = None

    # ------------------------------------------------------------ plain routes
    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def models(self, request: web.Request) -> web.Response:
        await self._tenant(request)
        await self._check_key(request)
        return web.json_response({"object": "list", "data": [
            {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "kvmesh"}]})

    async def model(self, request: web.Request) -> web.Response:
        await self._tenant(request)
        await self._check_key(request)
        name = request.match_info["model"]
        if name != self.model_id and name not in self.model_aliases:
            raise HttpError(404, f"model {name!r} is not served here; see GET /v1/models", "not_found_error",
                            param="model", code="model_not_found")
        return web.json_response({"id": self.model_id, "object": "model", "created": self.created,
                                  "owned_by": "kvmesh"})

    async def metrics(self, request: web.Request) -> web.Response:
        """Prometheus text, on an open front only. With API keys the front faces tenants, and
        counters such as cache hits per decision would tell one tenant (or a stranger, since
        Prometheus sends no key) whether another's prompt was cached: those fronts answer 404,
        and operators scrape ``--metrics-port`` (a port for Prometheus alone; see
        docs/SECURITY.md)."""
        if self.authenticate is not None or self.check_key is not None:
            raise HttpError(404, "this front requires API keys and does not serve /metrics (they would reveal "
                                 "other tenants' cache hits); scrape the process's --metrics-port", "not_found_error")
        if self.metrics_private:
            raise HttpError(404, "this process's metrics are for bearers of its --metrics-token-file token; scrape "
                                 "its --metrics-port with it", "not_found_error")
        if self.registry is None:
            raise HttpError(404, "metrics are not recorded by this process", "not_found_error")
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    # ---------------------------------------------------------------- helpers
    async def _tenant(self, request: web.Request) -> str | None:
        """The authenticated tenant, None when anonymous requests are allowed."""
        if self.authenticate is None:
            return None
        return str(await self._call_auth(self.authenticate, request) or "")

    async def _check_key(self, request: web.Request) -> None:
        """With ``check_key`` (and no ``authenticate``): 401 unless the request holds a valid
        key; run before anything that answers about the model (a 404 naming the served model
        would tell a stranger what the 401 on ``/v1/models`` hides)."""
        if self.authenticate is None and self.check_key is not None:
            try:
                await self._call_auth(self.check_key, request)
            except HttpError:
                raise HttpError(401, "invalid or missing API key: send the header `Authorization: Bearer KEY`",
                                "authentication_error", code="invalid_api_key") from None

    @staticmethod
    async def _call_auth(check: Authenticator, request: web.Request):
        try:
            out = check(request.headers.get("Authorization"))
            if inspect.isawaitable(out):
                out = await out
        except Exception as exc:  # noqa: BLE001 - whatever the authenticator raises means "no"
            raise HttpError(401, str(exc) or "invalid or missing API key: send Authorization: Bearer KEY",
                            "authentication_error", code="invalid_api_key") from None
        return out

    def _context(self) -> int:
        """Context limit (tokens) that requests are checked against here."""
        live = self.context_fn() if self.context_fn is not None else None
        return live or self.max_model_len or DEFAULT_CONTEXT_TOKENS

    async def _body(self, request: web.Request, route: str) -> dict:
        """The request's JSON object after the checks every generating route shares; ``route``
        is "completions" or "chat" (`accepted_fields`). Raises `HttpError` (400, 401, 404)."""
        await self._check_key(request)
        try:
            body = await read_json_object(request, self.body_timeout_s)
        except ValueError as exc:
            raise HttpError(400, str(exc)) from None
        accepted = accepted_fields(route)
        unknown = [name for name in body if name not in accepted]
        if unknown:  # names come from the caller: the first few, each cut short
            names = ", ".join(repr(clip(n, 60)) for n in unknown[:5]) + (
                f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
            raise HttpError(400, f"unknown field{'s' if len(unknown) > 1 else ''} {names} in the request body of "
                                 f"{request.path}; it accepts {', '.join(HONOURED[route])} (and ignores "
                                 f"{', '.join(IGNORED)})", param=clip(unknown[0], 60))
        for name in UNSUPPORTED_CHAT if route == "chat" else ():
            if not _neutral(name, body.get(name), route):
                raise HttpError(400, f"{name} is not supported by kvmesh; remove it from the request", param=name)
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise HttpError(400, f"model must be a string (got {type(model).__name__}): the id GET /v1/models lists",
                            param="model")
        if model not in (None, "", self.model_id) and model not in self.model_aliases:
            raise HttpError(404, f"model {model!r} is not served here; this server serves {self.model_id!r} "
                                 f"(see GET /v1/models)", "not_found_error", param="model", code="model_not_found")
        for name in UNSUPPORTED:
            if not _neutral(name, body.get(name), route):
                raise HttpError(400, f"{name} is not supported by kvmesh; remove it from the request", param=name)
        n = body.get("n", 1)
        if n is not None and (isinstance(n, bool) or n != 1):
            raise HttpError(400, f"n must be 1 (got {n!r}): send separate requests for several completions",
                            param="n")
        return body

    def _request(self, body: dict, tenant: str | None, max_tokens_field: str, default_max: int) -> pb.GenerateRequest:
        if max_tokens_field != "max_tokens" and body.get(max_tokens_field) is not None \
                and body.get("max_tokens") is not None and body[max_tokens_field] != body["max_tokens"]:
            raise HttpError(400, f"{max_tokens_field} ({clip(repr(body[max_tokens_field]), 20)}) and max_tokens "
                                 f"({clip(repr(body['max_tokens']), 20)}) differ: send one of them",
                            param=max_tokens_field)
        max_tokens = body.get(max_tokens_field)
        if max_tokens is None:  # absent or null: the other name, if sent
            max_tokens = body.get("max_tokens")
        max_tokens = _number({max_tokens_field: max_tokens}, max_tokens_field, default_max, lo=1, hi=2**32 - 1,
                             integer=True)
        salt = body.get("cache_salt") if tenant is None else tenant
        if salt is None:  # absent or null: no salt
            salt = ""
        if not isinstance(salt, str):
            raise HttpError(400, "cache_salt must be a string", param="cache_salt")
        _utf8(salt, "cache_salt")
        if len(salt) > MAX_CACHE_SALT_CHARS:
            raise HttpError(400, f"cache_salt has {len(salt)} characters; at most {MAX_CACHE_SALT_CHARS} are accepted",
                            param="cache_salt")
        ignore_eos = body.get("ignore_eos", False)
        if not isinstance(ignore_eos, bool):
            raise HttpError(400, "ignore_eos must be true or false", param="ignore_eos")
        return pb.GenerateRequest(
            request_id=f"http-{uuid.uuid4().hex}",
            sampling=pb.SamplingParams(
                max_tokens=max_tokens,
                temperature=_number(body, "temperature", 1.0, lo=0.0, hi=2.0),
                top_p=_top_p(body),
                seed=_seed(body),
                ignore_eos=ignore_eos),
            cache_salt=salt, return_text=True, model_id=self._model_id(body))

    def _model_id(self, body: dict) -> str:
        """Generate's ``model_id`` for a (validated) body: its ``model`` when that names one
        checkpoint (``name@hash``) and `forward_model_id` is on, else "" (whatever is served;
        a folder name may name a newer checkpoint tomorrow, and is only checked here)."""
        model = body.get("model")
        if self.forward_model_id and isinstance(model, str) and "@" in model:
            return model
        return ""

    async def _run(self, req: pb.GenerateRequest, authorization: str | None,
                   from_text: bool = False) -> AsyncIterator[pb.GenerateResponse]:
        # the header travels as gRPC metadata too, so a check inside Generate sees the same key
        ctx = _HttpContext(self.timeout_s, (("authorization", authorization),) if authorization else (),
                           tokenized_from_text=from_text)
        agen = self.generate(req, ctx)
        try:
            async for msg in agen:
                yield msg
        except grpc.aio.AioRpcError as exc:  # a path that lets a downstream error escape
            raise GrpcAbort(exc.code(), exc.details() or exc.code().name) from None
        finally:
            await agen.aclose()  # the client left early: the worker aborts the request

    @staticmethod
    def _usage(final: pb.GenerateResponse | None) -> dict:
        if final is None:
            return {}
        u, t = final.usage, final.timing
        return {
            "prompt_tokens": u.prompt_tokens,
            "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
            "kvmesh": {
                "cached_tokens_by_tier": dict(u.cached_tokens_by_tier),
                "lossy_cached_tokens": u.lossy_cached_tokens,
                "computed_prefill_tokens": u.computed_prefill_tokens,
                "worker_id": final.worker_id,
                "timing": {"queue_ms": t.queue_ms, "prefill_ms": t.prefill_ms, "ttft_ms": t.ttft_ms,
                           "e2e_ms": t.e2e_ms},
            },
        }

    # ------------------------------------------------------------ completions
    async def completions(self, request: web.Request) -> web.StreamResponse:
        tenant = await self._tenant(request)
        body = await self._body(request, "completions")
        req = self._request(body, tenant, "max_tokens", 16)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        context = self._context()
        if isinstance(prompt, list) and len(prompt) >= context and self.max_model_len:
            # before looking at each id: a body of millions of ids costs the event loop nothing more
            raise HttpError(400, f"prompt has {len(prompt)} tokens but the context served here is {context} tokens: "
                                 f"shorten it to at most {context - 1} tokens", param="prompt")
        if isinstance(prompt, str) and prompt:
            req.text = _utf8(prompt, "prompt")
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                         and 0 <= t < 2**32 for t in prompt):
            req.token_ids.ids.extend(prompt)
        else:
            bad = next(((i, t) for i, t in enumerate(prompt) if not (isinstance(t, int) and not isinstance(t, bool)
                                                                      and 0 <= t < 2**32)), None) \
                if isinstance(prompt, list) and prompt and all(not isinstance(t, (str, list)) for t in prompt) else None
            if bad is not None:
                raise HttpError(400, f"prompt[{bad[0]}] is {clip(repr(bad[1]), 40)}: token ids are integers in "
                                     f"[0, 2^32)", param="prompt")
            raise HttpError(400, "prompt must be a non-empty string or a non-empty array of token ids "
                                 "(one prompt per request)", param="prompt")
        return await self._answer(request, body, req, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        tenant = await self._tenant(request)
        body = await self._body(request, "chat")
        try:
            text = self.chat_template.render(body.get("messages"), add_generation_prompt=True)
        except ChatTemplateError as exc:
            raise HttpError(400, str(exc), param="messages") from None
        ids = ChatTemplate.encode(self.tokenizer, _utf8(text, "messages"))
        if not ids:
            raise HttpError(400, "the rendered chat prompt is empty", param="messages")
        default_max = max(1, self._context() - len(ids))
        req = self._request(body, tenant, "max_completion_tokens", min(default_max, 2**32 - 1))
        if body.get("max_completion_tokens") is None and body.get("max_tokens") is None:
            # the default is the rest of the context of whichever worker serves it, which
            # this front may not know (a router's workers can run shorter contexts)
            req.sampling.max_tokens_up_to_context = True
        req.token_ids.ids.extend(ids)
        try:
            return await self._answer(request, body, req, chat=True)
        except GrpcAbort as exc:  # refused before any answer: name the field this client sent
            sent = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
            raise HttpError.from_abort(exc, sent) from None

    async def _answer(self, request: web.Request, body: dict, req: pb.GenerateRequest,
                      chat: bool) -> web.StreamResponse:
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise HttpError(400, "stream must be true or false", param="stream")
        if not stream and body.get("stream_options") is not None:  # as vLLM and OpenAI refuse it
            raise HttpError(400, "stream_options is only for streamed answers: set \"stream\": true or drop it",
                            param="stream_options")
        return_ids = _flag(body, "return_token_ids")
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        obj = "chat.completion" if chat else "text_completion"
        created = int(time.time())
        if not stream:
            text, ids, final = [], [], None
            async with contextlib.aclosing(self._run(req, request.headers.get("Authorization"), chat)) as messages:
                async for msg in messages:
                    if request.transport is None:
                        # the client left but the cancellation that says so was lost on the way
                        # (see services.aio): the next message notices, and aclosing aborts the call
                        raise ConnectionResetError("the HTTP client went away")
                    text.append(msg.text)
                    ids.extend(msg.token_ids)
                    if msg.finished:
                        final = msg
            if final is None:
                raise HttpError(502, "the stream ended without a final message", "server_error")
            choice: dict = {"index": 0, "finish_reason": final.finish_reason}
            if chat:
                choice["message"] = {"role": "assistant", "content": "".join(text)}
            else:
                choice.update(text="".join(text), logprobs=None)
            if return_ids:
                choice["token_ids"] = ids
            return web.json_response({"id": rid, "object": obj, "created": created, "model": self.model_id,
                                      "choices": [choice], "usage": self._usage(final)})
        options = body.get("stream_options")
        options = {} if options is None else options
        if not isinstance(options, dict):
            raise HttpError(400, "stream_options must be an object such as {\"include_usage\": true}, or null",
                            param="stream_options")
        unknown = [k for k in options if k not in STREAM_OPTIONS]
        if unknown:
            raise HttpError(400, f"unknown field {clip(repr(unknown[0]), 60)} in stream_options; it accepts "
                                 f"include_usage (and ignores include_obfuscation and continuous_usage_stats)",
                            param="stream_options")
        # vLLM's per-chunk usage: clients written for vLLM send it; usage comes in the last chunk
        _flag(options, "continuous_usage_stats", "stream_options.continuous_usage_stats")
        include_usage = _flag(options, "include_usage", "stream_options.include_usage")
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"
        # aclosing: however the answer ends (a client gone before or after the headers, an
        # error event), the Generate call is closed now, not when a cycle collector gets to it
        async with contextlib.aclosing(self._run(req, request.headers.get("Authorization"), chat)) as gen:
            # the first message decides the status: an error before any token is a plain HTTP error
            try:
                first = await gen.__anext__()
            except StopAsyncIteration:
                raise HttpError(502, "the stream ended without a final message", "server_error") from None
            if request.transport is None:  # gone while it waited, its cancellation lost (services.aio)
                raise ConnectionResetError("the HTTP client went away")
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await resp.prepare(request)

            async def send(payload: dict) -> None:
                await resp.write(b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n")

            def chunk(delta_text: str, ids: list[int], finish: str | None, first_chunk: bool = False) -> dict:
                c: dict = {"index": 0, "finish_reason": finish}
                if chat:
                    delta = {"role": "assistant", "content": delta_text} if first_chunk else {"content": delta_text}
                    c["delta"] = delta
                else:
                    c.update(text=delta_text, logprobs=None)
                if return_ids:
                    c["token_ids"] = ids
                return {"id": rid, "object": chunk_obj, "created": created, "model": self.model_id, "choices": [c]}

            try:
                msg, first_chunk, final = first, True, None
                while True:
                    if msg.finished:
                        final = msg
                    if msg.token_ids or msg.text or msg.finished or first_chunk:
                        await send(chunk(msg.text, list(msg.token_ids), msg.finish_reason if msg.finished else None,
                                         first_chunk))
                        first_chunk = False
                    try:
                        msg = await gen.__anext__()
                    except StopAsyncIteration:
                        break
                if include_usage and final is not None:
                    await send({"id": rid, "object": chunk_obj, "created": created, "model": self.model_id,
                                "choices": [], "usage": self._usage(final)})
            except (GrpcAbort, HttpError) as exc:  # after the headers: the error travels as an SSE event
                err = HttpError.from_abort(exc) if isinstance(exc, GrpcAbort) else exc
                await send(err.body())
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
