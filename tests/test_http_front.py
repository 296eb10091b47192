"""The HTTP front's own edges in-process: authentication, error mapping, client disconnects.

The Generate behind the front is a stub here (it injects the faults: an abort, a stream
that never ends); the front's agreement with real worker and router processes is in
tests/test_observability_e2e.py.
"""
from __future__ import annotations

import asyncio
import json
import re

import aiohttp
import grpc
import pytest

from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.services.http_front import HttpFront
from kvmesh.workers.config import ModelConfig
from kvmesh.workers.tokenizer import load_tokenizer


def _final(text="ok"):
    return pb.GenerateResponse(token_ids=[111], text=text, finished=True, finish_reason="length",
                               usage=pb.Usage(prompt_tokens=3, cached_tokens=0, completion_tokens=1))


async def _serve(generate, **kw):
    front = HttpFront(generate, load_tokenizer(None, ModelConfig.tiny()), "m", **kw)
    port = await front.start("127.0.0.1", 0)
    return front, f"http://127.0.0.1:{port}/v1"


async def _serve_tls(generate, server_ctx, **kw):
    """An HTTPS front (``kw`` to `HttpFront`); returns it and its port."""
    front = HttpFront(generate, load_tokenizer(None, ModelConfig.tiny()), "m", **kw)
    return front, await front.start("127.0.0.1", 0, ssl_context=server_ctx)


def test_api_keys_map_to_tenants_and_refusals_are_401():
    seen = []

    async def generate(req, ctx):
        seen.append(req.cache_salt)
        yield _final()

    def authenticate(header):
        if header != "Bearer good":
            raise PermissionError("unknown API key")
        return "tenant-7"

    async def run():
        front, url = await _serve(generate, authenticate=authenticate)
        try:
            async with aiohttp.ClientSession() as s:
                r = await s.post(f"{url}/completions", json={"prompt": "abc", "max_tokens": 1},
                                 headers={"Authorization": "Bearer bad"})
                bad = (r.status, await r.json())
                r = await s.post(f"{url}/completions", json={"prompt": "abc", "max_tokens": 1,
                                                             "cache_salt": "spoofed"},
                                 headers={"Authorization": "Bearer good"})
                good = (r.status, await r.json())
                r = await s.get(f"{url}/models")
                models = r.status
        finally:
            await front.stop()
        return bad, good, models

    bad, good, models = asyncio.run(run())
    assert bad[0] == 401 and bad[1]["error"]["type"] == "authentication_error"
    assert "unknown API key" in bad[1]["error"]["message"]
    assert good[0] == 200 and good[1]["choices"][0]["text"] == "ok"
    assert seen == ["tenant-7"]  # the authenticated tenant, never the body's salt
    assert models == 401


def test_grpc_statuses_map_to_http_and_stream_errors_become_events():
    async def overloaded(req, ctx):
        await ctx.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue is full")
        yield  # pragma: no cover

    async def fails_midway(req, ctx):
        yield pb.GenerateResponse(token_ids=[104], text="h")
        await ctx.abort(grpc.StatusCode.INTERNAL, "model step failed")

    async def run():
        out = {}
        for name, gen in (("overloaded", overloaded), ("midway", fails_midway)):
            front, url = await _serve(gen)
            try:
                async with aiohttp.ClientSession() as s:
                    r = await s.post(f"{url}/completions", json={"prompt": "abc", "max_tokens": 2,
                                                                 "stream": name == "midway"})
                    out[name] = (r.status, await r.text())
            finally:
                await front.stop()
        return out

    out = asyncio.run(run())
    status, body = out["overloaded"]
    assert status == 429 and json.loads(body)["error"]["message"] == "queue is full"
    status, body = out["midway"]
    events = [line[6:] for line in body.splitlines() if line.startswith("data: ")]
    assert status == 200 and events[-1] == "[DONE]"
    assert json.loads(events[0])["choices"][0]["text"] == "h"
    assert json.loads(events[-2])["error"]["message"] == "model step failed"


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_client_disconnect_closes_the_generate_stream(stream):
    """A client that leaves ends the Generate call (the worker then aborts the request)."""
    closed = asyncio.Event

    async def run():
        done = closed()

        async def endless(req, ctx):
            try:
                while True:
                    yield pb.GenerateResponse(token_ids=[97], text="a")
                    await asyncio.sleep(0.01)
            finally:
                done.set()

        front, url = await _serve(endless)
        try:
            async with aiohttp.ClientSession() as s:
                if stream:
                    r = await s.post(f"{url}/completions", json={"prompt": "abc", "max_tokens": 10**6,
                                                                 "stream": True})
                    await r.content.readline()
                    r.close()
                else:  # the whole answer never comes: the client gives up
                    with pytest.raises(asyncio.TimeoutError):
                        await s.post(f"{url}/completions", json={"prompt": "abc", "max_tokens": 10**6},
                                     timeout=aiohttp.ClientTimeout(total=0.5))
            await asyncio.wait_for(done.wait(), 10)
            return done.is_set()
        finally:
            await front.stop()

    assert asyncio.run(run())


def _refused(path: str, body: dict | bytes, headers: dict | None = None, **kw) -> tuple[int, dict]:
    """POST ``body`` (a JSON object, or raw bytes, with ``headers``) to ``/v1/<path>`` on a
    front whose Generate must never be reached; ``kw`` goes to `HttpFront`."""
    async def never(req, ctx):  # pragma: no cover - a refused request never reaches Generate
        raise AssertionError("reached Generate")
        yield

    async def run():
        front, url = await _serve(never, **kw)
        try:
            async with aiohttp.ClientSession() as s:
                r = await (s.post(f"{url}/{path}", data=body,
                                  headers={"Content-Type": "application/json", **(headers or {})})
                           if isinstance(body, bytes) else s.post(f"{url}/{path}", json=body))
                return r.status, await r.json()
        finally:
            await front.stop()

    return asyncio.run(run())


@pytest.mark.parametrize("body,param", [
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "a", "temperature": -1}, "temperature"),
    ({"prompt": "a", "top_p": 0}, "top_p"),  # the wire reads 0 as "off": taken, it would sample from every token
    ({"prompt": "a", "top_p": 1.5}, "top_p"),
    ({"prompt": "a", "top_p": 1e-300}, "top_p"),  # the wire's 32-bit float holds it as 0, "off"
    ({"prompt": "a", "top_p": 10 ** 400}, "top_p"),  # once a 500: float() of it overflows
    ({"prompt": "a", "best_of": 2}, "best_of"),
    ({"prompt": "a", "best_of": True}, "best_of"),
    ({"prompt": "a", "n": 2}, "n"),
    ({"prompt": "a", "logprobs": 2}, "logprobs"),
    # values that are neutral for some fields are real values of others, or of the wrong type
    ({"prompt": "a", "logprobs": 0}, "logprobs"),  # legacy completions: 0 still asks for the sampled token's
    ({"prompt": "a", "stop": "none"}, "stop"),
    ({"prompt": "a", "stop": "auto"}, "stop"),
    ({"prompt": "a", "stop": 0}, "stop"),
    ({"prompt": "a", "suffix": "auto"}, "suffix"),
    ({"prompt": "a", "logit_bias": "none"}, "logit_bias"),
    ({"prompt": "a", "presence_penalty": False}, "presence_penalty"),
    ({"prompt": "a", "echo": 0}, "echo"),
    ({"prompt": "a", "n": True}, "n"),
    ({"prompt": [1, -3]}, "prompt"),
    ({"prompt": "a", "stream": "yes"}, "stream"),
    ({"prompt": "a", "return_token_ids": "no"}, "return_token_ids"),  # truthy: it once meant yes
    ({"prompt": "a", "return_token_ids": 1}, "return_token_ids"),
    ({"prompt": "a", "stream": True, "stream_options": {"include_usage": "no"}}, "stream_options.include_usage"),
    ({"prompt": "a", "stream": True, "stream_options": {"include_usage": 0}}, "stream_options.include_usage"),
    ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),  # not streamed
])
def test_bad_fields_are_400_naming_the_field(body, param):
    status, err = _refused("completions", body)
    assert status == 400 and err["error"]["param"] == param and param in err["error"]["message"]
    if param == "top_p":  # one range, whichever side is crossed
        assert "(0, 1]" in err["error"]["message"]


@pytest.mark.parametrize("path,body,param,says", [
    ("completions", b'{"prompt": "a", "max_tokens": 1' + b"0" * 400 + b"}", "max_tokens", "must be in"),
    ("completions", b'{"prompt": "a", "seed": ' + b"9" * 5000 + b"}", None, "not valid JSON"),
    ("completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None, "nested too deeply"),
    ("completions", {"prompt": "a", "stream": True, "stream_options": [1]}, "stream_options", "an object"),
    ("completions", {"prompt": "\ud800abc"}, "prompt", "lone surrogate"),
    ("completions", {"prompt": "a", "cache_salt": "\udfff"}, "cache_salt", "lone surrogate"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi \udc00"}]}, "messages", "lone surrogate"),
    ("completions", {"prompt": [5, -1]}, "prompt", "prompt[1] is -1"),
    ("completions", {"prompt": "a", "cache_salt": "s" * 1025}, "cache_salt", "at most 1024"),
], ids=["400-digit-int", "5000-digit-int", "deep-nesting", "stream-options-list", "surrogate-prompt",
        "surrogate-salt", "surrogate-chat", "negative-id", "long-salt"])
def test_odd_json_is_400_not_500(path, body, param, says):
    """Each of these once reached a Python error inside the front (OverflowError, the int digit
    limit's ValueError, RecursionError, AttributeError, UnicodeEncodeError in protobuf): a 500
    and a traceback in the log per request."""
    status, err = _refused(path, body)
    assert status == 400 and err["error"]["param"] == param and says in err["error"]["message"], err


@pytest.mark.parametrize("headers,says", [
    ({"Content-Type": "application/json; charset=bogus"}, "charset 'bogus' is not supported"),
    ({"Content-Encoding": "gzip"}, "Content-Encoding 'gzip'"),
    ({"Content-Encoding": "deflate"}, "Content-Encoding 'deflate'"),
], ids=["unknown-charset", "gzip-not-gzip", "deflate-not-deflate"])
def test_a_body_that_does_not_decode_as_its_headers_say_is_400(headers, says):
    """These once raised LookupError or aiohttp's payload errors inside the front: a 500
    and a traceback per request."""
    status, err = _refused("completions", b'{"prompt": "ab", "max_tokens": 2}', headers=headers)
    assert status == 400 and says in err["error"]["message"], err


def test_chat_max_tokens_and_max_completion_tokens_must_agree_when_both_are_sent():
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    status, err = _refused("chat/completions", {**chat, "max_completion_tokens": 2, "max_tokens": 5})
    assert status == 400 and err["error"]["param"] == "max_completion_tokens"
    assert "(2) and max_tokens (5) differ" in err["error"]["message"], err


def test_a_token_id_prompt_past_the_context_is_refused_before_its_ids_are_checked():
    status, err = _refused("completions", {"prompt": [1] * 2048, "max_tokens": 1}, max_model_len=2048)
    assert status == 400 and "at most 2047 tokens" in err["error"]["message"], err


def test_https_with_an_ssl_context(tmp_path):
    server_ctx, client_ctx = _self_signed(tmp_path)

    async def generate(req, ctx):
        yield _final("secure")

    async def run():
        front, port = await _serve_tls(generate, server_ctx)
        try:
            async with aiohttp.ClientSession() as s:
                r = await s.post(f"https://127.0.0.1:{port}/v1/completions", json={"prompt": "a"}, ssl=client_ctx)
                ok = (r.status, await r.json())
                with pytest.raises(aiohttp.ClientError):  # plain HTTP is not served on that port
                    await s.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "a"})
                return ok
        finally:
            await front.stop()

    status, body = asyncio.run(run())
    assert status == 200 and body["choices"][0]["text"] == "secure"


@pytest.mark.parametrize("path,body,unknown", [
    ("completions", {"prompt": "a", "max_token": 4}, ["max_token"]),  # a typo of max_tokens
    ("completions", {"prompt": "a", "top_k": 5, "frobnicate": True}, ["top_k", "frobnicate"]),
    ("completions", {"prompt": "a", "messages": []}, ["messages"]),  # chat's field on the completions route
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "prompt": "a"}, ["prompt"]),
])
def test_unknown_fields_are_400_naming_them_and_the_accepted_ones(path, body, unknown):
    status, err = _refused(path, body)
    message = err["error"]["message"]
    assert status == 400 and err["error"]["type"] == "invalid_request_error", err
    assert err["error"]["param"] == unknown[0]
    for name in unknown:
        assert repr(name) in message, message
    # the message lists what the route takes, so the caller can fix the request
    for name in ("max_tokens", "temperature", "stream_options", "cache_salt", "user"):
        assert name in message, message
    honoured = message.split(";", 1)[1].split("(", 1)[0]  # the route's own fields, not the other route's
    assert ("prompt" if path.startswith("chat") else "messages") not in honoured, message


def test_openai_client_fields_are_accepted():
    """Fields OpenAI clients send that change nothing kvmesh computes (end-user id, metadata,
    storage hints) or at their neutral values reach Generate; a chat-only option that would
    change the output is refused by name."""
    seen = []

    async def generate(req, ctx):
        seen.append(req)
        yield _final()

    completion = {"model": "m", "prompt": "abc", "max_tokens": 2, "temperature": 0, "top_p": 1, "seed": 3,
                  "n": 1, "stream": False, "stream_options": None, "user": "u-17", "logprobs": None,
                  "echo": False, "stop": None, "presence_penalty": 0, "frequency_penalty": 0, "best_of": 1,
                  "suffix": None, "logit_bias": None}
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 2,
            "user": "u-17", "metadata": {"team": "search"}, "store": False, "service_tier": "auto",
            "parallel_tool_calls": True, "prompt_cache_key": "k", "safety_identifier": "s", "logprobs": False,
            "top_logprobs": None, "modalities": ["text"], "tools": None, "response_format": {"type": "text"}}

    async def run():
        front, url = await _serve(generate)
        try:
            async with aiohttp.ClientSession() as s:
                out = []
                for path, body in (("completions", completion), ("chat/completions", chat),
                                   ("chat/completions", {**chat, "modalities": ["text", "audio"]})):
                    r = await s.post(f"{url}/{path}", json=body)
                    out.append((r.status, await r.json()))
                return out
        finally:
            await front.stop()

    (c_status, c_body), (h_status, h_body), (a_status, a_body) = asyncio.run(run())
    assert c_status == 200 and c_body["choices"][0]["text"] == "ok", c_body
    assert h_status == 200 and h_body["choices"][0]["message"]["content"] == "ok", h_body
    assert [r.sampling.max_tokens for r in seen] == [2, 2] and seen[0].sampling.seed == 3
    assert a_status == 400 and a_body["error"]["param"] == "modalities", a_body


def test_a_request_without_a_seed_gets_a_random_one():
    """The wire's seed has no "unset" (a worker seeds every sampled request with it), so a
    front that sent 0 for an absent seed made every sampled completion the same; OpenAI's
    and vLLM's differ per request. A given seed (0 too) is passed on as is."""
    seen = []

    async def generate(req, ctx):
        seen.append(req)
        yield _final()

    async def run():
        front, url = await _serve(generate)
        try:
            async with aiohttp.ClientSession() as s:
                for body in ({}, {}, {"seed": None}, {"seed": 0}, {"seed": 2**64 - 1}):
                    r = await s.post(f"{url}/completions", json={"prompt": "abc", "max_tokens": 2, **body})
                    assert r.status == 200, await r.text()
        finally:
            await front.stop()

    asyncio.run(run())
    drawn = [r.sampling.seed for r in seen[:3]]
    assert len(set(drawn)) == 3, drawn
    assert [r.sampling.seed for r in seen[3:]] == [0, 2**64 - 1]


def test_a_null_cache_salt_is_no_salt_and_a_non_string_one_is_400():
    """``"cache_salt": null`` is taken as absent, as ``"model": null`` is: the request reaches
    Generate with no salt (the same cache namespace as one without the field)."""
    seen = []

    async def generate(req, ctx):
        seen.append(req.cache_salt)
        yield _final()

    async def run():
        front, url = await _serve(generate)
        try:
            async with aiohttp.ClientSession() as s:
                out = []
                for path, body in (("completions", {"prompt": "abc", "max_tokens": 1, "cache_salt": None}),
                                   ("chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                         "max_tokens": 1, "cache_salt": None, "model": None}),
                                   ("completions", {"prompt": "abc", "max_tokens": 1}),
                                   ("completions", {"prompt": "abc", "max_tokens": 1, "cache_salt": "s1"})):
                    r = await s.post(f"{url}/{path}", json=body)
                    out.append((r.status, await r.json()))
                return out
        finally:
            await front.stop()

    out = asyncio.run(run())
    assert [status for status, _ in out] == [200, 200, 200, 200], out
    assert seen == ["", "", "", "s1"]
    for bad in (5, ["s"], {"s": 1}, False):
        status, err = _refused("completions", {"prompt": "a", "cache_salt": bad})
        assert status == 400 and err["error"]["param"] == "cache_salt", (bad, err)
        assert "must be a string" in err["error"]["message"], err


def test_the_bench_openai_target_is_accepted():
    """`kvmesh bench --api openai` (bench.openai_target) sends every kvmesh extension with
    a streamed completion; the front takes all of them."""
    from kvmesh.bench.openai_target import OpenAITarget

    seen = []

    async def generate(req, ctx):
        seen.append(req)
        yield pb.GenerateResponse(token_ids=[7, 8], text="ok", finished=True, finish_reason="length",
                                  usage=pb.Usage(prompt_tokens=3, completion_tokens=2))

    async def run():
        front, url = await _serve(generate)
        try:
            async with OpenAITarget(url) as target:
                await target.detect(5)
                req = pb.GenerateRequest(cache_salt="salty", sampling=pb.SamplingParams(
                    max_tokens=2, temperature=0.5, top_p=0.9, seed=11, ignore_eos=True))
                req.token_ids.ids.extend([1, 2, 3])
                return [m async for m in target.generate(req, timeout=10)]
        finally:
            await front.stop()

    msgs = asyncio.run(run())
    assert [t for m in msgs for t in m.token_ids] == [7, 8] and msgs[-1].finished
    assert len(seen) == 1 and seen[0].cache_salt == "salty" and seen[0].sampling.ignore_eos
    assert list(seen[0].token_ids.ids) == [1, 2, 3] and seen[0].sampling.seed == 11


def test_the_bench_openai_target_sends_its_key_over_https_only(tmp_path):
    """`kvmesh bench --api openai --api-key K --tls-ca CA` reaches an HTTPS front with the key
    (the tenant the front maps it to reaches Generate); a key without TLS, or TLS options with
    an http:// URL, is refused before anything is sent."""
    from kvmesh.bench.openai_target import OpenAITarget
    from kvmesh.services.credentials import generate_cluster_credentials
    from kvmesh.workers.tls import TlsConfig

    creds = generate_cluster_credentials(str(tmp_path / "run"))
    tls = TlsConfig.from_files(creds.cert, creds.key, creds.ca)
    seen = []

    async def generate(req, ctx):
        seen.append(req.cache_salt)
        yield _final()

    def authenticate(header):
        if header != f"Bearer {creds.api_key}":
            raise PermissionError("unknown API key")
        return "tenant-9"

    async def run():
        front = HttpFront(generate, load_tokenizer(None, ModelConfig.tiny()), "m", authenticate=authenticate)
        port = await front.start("127.0.0.1", 0, ssl_context=tls.server_ssl_context())
        try:
            async with OpenAITarget(f"https://127.0.0.1:{port}") as stranger:  # no --tls-ca: a certificate
                with pytest.raises(ConnectionError, match="pass --tls-ca"):     # error, not a timeout
                    await stranger.detect(30)
            async with OpenAITarget(f"127.0.0.1:{port}", api_key=creds.api_key, tls_ca=creds.ca) as target:
                assert target.url == f"https://127.0.0.1:{port}/v1"
                await target.detect(5)
                req = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=1))
                req.token_ids.ids.extend([1, 2, 3])
                return [m async for m in target.generate(req, timeout=10)]
        finally:
            await front.stop()

    msgs = asyncio.run(run())
    assert msgs[-1].finished and seen == ["tenant-9"]  # the tenant the key maps to
    for kwargs, match in (({"api_key": "k"}, "needs TLS"),
                          ({"api_key": "k", "tls_ca": creds.ca, "target": "http://127.0.0.1:1"}, "plain http"),
                          ({"tls_ca": creds.ca, "tls_cert": creds.client_cert}, "go together"),
                          ({"tls_ca": str(tmp_path / "missing.pem")}, "cannot load")):
        target = kwargs.pop("target", "127.0.0.1:1")

        async def make():
            OpenAITarget(target, **kwargs)

        with pytest.raises(ValueError, match=match):
            asyncio.run(make())


def test_a_front_with_api_keys_does_not_serve_metrics():
    """Counters that move with each request (cache hits, decisions) would tell a stranger or
    another tenant whether a prompt was cached: a front that takes API keys answers 404 on
    /metrics, with or without a key, and names --metrics-port; an open front serves them."""
    from prometheus_client import CollectorRegistry, Counter

    registry = CollectorRegistry()
    Counter("kvmesh_probe", "a counter", registry=registry).inc()

    async def generate(req, ctx):
        yield _final()

    def authenticate(header):
        if header != "Bearer good":
            raise PermissionError("unknown API key")
        return "tenant-1"

    async def run():
        out = []
        for kw in ({"authenticate": authenticate}, {"check_key": authenticate}, {}):
            front, url = await _serve(generate, registry=registry, **kw)
            try:
                async with aiohttp.ClientSession() as s:
                    for headers in ({}, {"Authorization": "Bearer good"}):
                        r = await s.get(url.removesuffix("/v1") + "/metrics", headers=headers)
                        out.append((r.status, await r.text()))
            finally:
                await front.stop()
        return out

    (a0, a1, c0, c1, open0, open1) = asyncio.run(run())
    for status, body in (a0, a1, c0, c1):
        assert status == 404 and "--metrics-port" in body and "kvmesh_probe" not in body
    assert open0[0] == open1[0] == 200 and "kvmesh_probe_total 1.0" in open0[1]


def test_a_body_larger_than_the_context_could_hold_is_refused_with_413():
    """Bodies are capped by what the context's longest text takes as JSON
    (`http_body_bytes_limit`): a larger prompt is refused before it is parsed, so one client
    cannot stall the front for seconds; a prompt within the cap is served, and a text of the
    context's whole text allowance, every byte JSON-escaped, is within the cap."""
    from kvmesh.workers.limits import MAX_TEXT_BYTES_PER_TOKEN

    seen = []

    async def generate(req, ctx):
        seen.append(len(req.token_ids.ids))
        yield _final()

    async def run():
        front, url = await _serve(generate, max_model_len=2048)
        try:
            async with aiohttp.ClientSession() as s:
                big = b'{"max_tokens": 1, "prompt": [' + b"1," * (front.max_body_bytes // 2) + b'1]}'
                r = await s.post(f"{url}/completions", data=big, headers={"Content-Type": "application/json"})
                refused = (r.status, await r.json())
                r = await s.post(f"{url}/completions", json={"max_tokens": 1, "prompt": [1] * 2000})
                return front.max_body_bytes, refused, r.status
        finally:
            await front.stop()

    cap, (status, body), ok = asyncio.run(run())
    from kvmesh.workers.limits import http_body_bytes_limit

    assert cap == http_body_bytes_limit(2048)
    for ctx in (2048, 32768, 131072):  # the longest text accepted, every byte escaped, still fits
        escaped = len(json.dumps({"max_tokens": 1, "prompt": "\x01" * (MAX_TEXT_BYTES_PER_TOKEN * ctx)}))
        assert escaped < http_body_bytes_limit(ctx) < escaped + (1 << 20)
    assert status == 413 and "shorten the prompt" in body["error"]["message"], body
    assert ok == 200 and seen == [2000]


# ------------------------------------------------------------------ connection limits
# Timeouts here are short and the assertions' margins wide (seconds against a fraction of
# one), so a busy machine slows the test down without failing it.

async def _closed_within(reader: asyncio.StreamReader, seconds: float) -> bytes | None:
    """What the server sent before closing the connection, or None if it was still open
    after ``seconds``."""
    got = b""
    try:
        async with asyncio.timeout(seconds):
            while chunk := await reader.read(4096):
                got += chunk
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return got


def test_a_client_that_stops_mid_headers_is_closed_after_the_header_timeout():
    async def never(req, ctx):  # pragma: no cover
        raise AssertionError("reached Generate")
        yield

    async def run():
        front, url = await _serve(never, header_timeout_s=0.5)
        port = front._serving.port
        try:
            r1, w1 = await asyncio.open_connection("127.0.0.1", port)
            w1.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
            r2, w2 = await asyncio.open_connection("127.0.0.1", port)  # sends nothing at all
            r3, w3 = await asyncio.open_connection("127.0.0.1", port)
            w3.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # one request, then idle on keep-alive
            first = await asyncio.wait_for(r3.readuntil(b'{"status": "ok"}'), 20)
            w3.write(b"GET /health HTTP/1.1\r\n")  # a second one that stops mid-headers
            out = [await _closed_within(r, 20.0) for r in (r1, r2, r3)]
            for w in (w1, w2, w3):
                w.close()
            return first, out, front._serving.gate.open
        finally:
            await front.stop()

    first, (partial, silent, kept_alive), still_open = asyncio.run(run())
    assert first.startswith(b"HTTP/1.1 200")
    assert partial is not None, "a partial request line and headers held the connection open"
    assert silent is not None, "a connection that sent nothing was kept open"
    assert kept_alive is not None, "a kept-alive connection stopping mid-headers was kept open"
    assert still_open == 0


def test_a_streamed_answer_longer_than_the_header_timeout_is_not_cut():
    async def slow(req, ctx):
        for _ in range(8):
            await asyncio.sleep(0.25)
            yield pb.GenerateResponse(token_ids=[97], text="a")
        yield _final("")

    async def run():
        front, url = await _serve(slow, header_timeout_s=0.3, body_timeout_s=0.3)
        try:
            async with aiohttp.ClientSession() as s:
                r = await s.post(f"{url}/completions", json={"prompt": "abc", "max_tokens": 9, "stream": True})
                streamed = (r.status, await r.text())
                r = await s.post(f"{url}/completions", json={"prompt": "abc", "max_tokens": 9})
                whole = (r.status, await r.json())
            return streamed, whole
        finally:
            await front.stop()

    (status, text), (status2, body) = asyncio.run(run())
    assert status == 200 and text.count('"text":"a"') == 8 and text.endswith("data: [DONE]\n\n"), text
    assert status2 == 200 and body["choices"][0]["text"] == "a" * 8


def test_a_body_that_does_not_arrive_is_408():
    async def never(req, ctx):  # pragma: no cover
        raise AssertionError("reached Generate")
        yield

    async def run():
        front, url = await _serve(never, body_timeout_s=0.5)
        try:
            r, w = await asyncio.open_connection("127.0.0.1", front._serving.port)
            w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 100\r\n\r\n{\"prompt\": ")
            # the answer, read as it arrives: the server then lingers (aiohttp reads and drops
            # what the client still sends for a while) before it closes
            got = await _answer(r)
            w.close()
            return got
        finally:
            await front.stop()

    head, body = asyncio.run(run())
    assert head.startswith(b"HTTP/1.1 408"), head
    # the unread rest of the body must not be taken for the next request on this connection
    assert re.search(rb"(?i)\r\nconnection: *close\r\n", head), head
    assert "not received within 0.5 s" in body["error"]["message"], body


async def _answer(reader: asyncio.StreamReader) -> tuple[bytes, dict]:
    """One HTTP response as it arrives (without waiting for the connection to close): its
    status line and headers, and its JSON body."""
    async with asyncio.timeout(20):
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(re.search(rb"(?i)\r\ncontent-length: *(\d+)", head).group(1))
        return head, json.loads(await reader.readexactly(length))


def test_a_declared_body_over_the_cap_is_refused_before_it_is_read():
    """A Content-Length over the body cap gets 413 at once, not after the front has read (or
    waited for) that many bytes, and the connection closes after the answer."""
    async def never(req, ctx):  # pragma: no cover
        raise AssertionError("reached Generate")
        yield

    async def run():
        front, url = await _serve(never, max_model_len=2048, body_timeout_s=60.0)
        try:
            r, w = await asyncio.open_connection("127.0.0.1", front._serving.port)
            w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n{\"prompt\": " % (front.max_body_bytes + 1))
            got = await _answer(r)  # within 20 s, far less than the body timeout
            w.close()
            return got
        finally:
            await front.stop()

    head, body = asyncio.run(run())
    assert head.startswith(b"HTTP/1.1 413"), head
    assert re.search(rb"(?i)\r\nconnection: *close\r\n", head), head
    assert "shorten the prompt" in body["error"]["message"], body


def test_expect_100_continue_is_refused_413_when_the_declared_body_is_over_the_cap():
    """A client that asks ``Expect: 100-continue`` for a body over the cap is answered 413
    in place of ``100 Continue``, so it never sends the body; one within the cap gets
    ``100 Continue`` and is served once it sends the body."""
    seen = []

    async def generate(req, ctx):
        seen.append(list(req.token_ids.ids))
        yield _final()

    async def run():
        front, url = await _serve(generate, max_model_len=2048)
        try:
            r, w = await asyncio.open_connection("127.0.0.1", front._serving.port)
            w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % (front.max_body_bytes + 1))
            refused = await _answer(r)
            w.close()
            body = b'{"prompt": [5, 6], "max_tokens": 1}'
            r, w = await asyncio.open_connection("127.0.0.1", front._serving.port)
            w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(body))
            async with asyncio.timeout(20):
                interim = await r.readuntil(b"\r\n\r\n")
            w.write(body)
            served = await _answer(r)
            w.close()
            return refused, interim, served
        finally:
            await front.stop()

    (head, body), interim, (ok_head, _) = asyncio.run(run())
    assert head.startswith(b"HTTP/1.1 413"), head
    assert re.search(rb"(?i)\r\nconnection: *close\r\n", head), head
    assert "shorten the prompt" in body["error"]["message"], body
    assert interim.startswith(b"HTTP/1.1 100"), interim
    assert ok_head.startswith(b"HTTP/1.1 200") and seen == [[5, 6]], (ok_head, seen)


def test_connections_over_the_cap_get_503_unread_and_health_answers_once_the_slow_ones_leave():
    async def never(req, ctx):  # pragma: no cover
        raise AssertionError("reached Generate")
        yield

    async def run():
        # the header timeout is far away: only the cap can turn the extra connections away
        front, url = await _serve(never, header_timeout_s=120.0, max_connections=3)
        gate = front._serving.gate
        try:
            slow = []
            for _ in range(3):
                r, w = await asyncio.open_connection("127.0.0.1", gate_port := front._serving.port)
                w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
                slow.append((r, w))
            async with asyncio.timeout(20):
                while gate.open < 3:
                    await asyncio.sleep(0.05)
            r, w = await asyncio.open_connection("127.0.0.1", gate_port)
            w.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            over = await _closed_within(r, 20.0)
            w.close()
            async with aiohttp.ClientSession() as s:
                async with s.get(url.removesuffix("/v1") + "/health") as resp:
                    busy = resp.status, await resp.json()
            for _, w in slow:
                w.close()
            async with asyncio.timeout(20):
                while gate.open:
                    await asyncio.sleep(0.05)
            async with aiohttp.ClientSession() as s:
                async with s.get(url.removesuffix("/v1") + "/health") as resp:
                    healthy = resp.status, await resp.json()
            return over, busy, healthy, gate.refused
        finally:
            await front.stop()

    over, busy, healthy, refused = asyncio.run(run())
    assert over is not None and over.startswith(b"HTTP/1.1 503"), over
    assert busy[0] == 503 and busy[1]["error"]["code"] == "too_many_connections"
    assert healthy == (200, {"status": "ok"})
    assert refused == 2


def test_accept_errors_for_want_of_descriptors_are_rate_limited(caplog):
    """asyncio reports a failed accept (EMFILE) through the loop's exception handler, with a
    traceback each time; under a connection flood that was thousands of lines a second."""
    import errno
    import logging

    from kvmesh.services.http_front import limit_resource_error_logs
    from kvmesh.workers.grpc_guard import LOG_BURST

    async def run():
        loop = asyncio.get_running_loop()
        limit_resource_error_logs(loop)
        limit_resource_error_logs(loop)  # once only
        for _ in range(500):
            loop.call_exception_handler({"message": "socket.accept() out of system resource",
                                         "exception": OSError(errno.EMFILE, "Too many open files")})
        loop.call_exception_handler({"message": "something else", "exception": ValueError("x")})

    with caplog.at_level(logging.WARNING):
        asyncio.run(run())
    emfile = [r for r in caplog.records if "Too many open files" in r.getMessage()]
    assert 1 <= len(emfile) <= LOG_BURST and not any(r.exc_info for r in emfile)
    assert any("something else" in r.getMessage() for r in caplog.records)  # the rest still reach asyncio's


def _self_signed(tmp_path):
    import ssl
    import subprocess

    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)
    return server_ctx, ssl.create_default_context(cafile=str(cert))


def test_a_tls_front_counts_connections_before_their_handshake(tmp_path):
    """Connections that never start TLS hold a counted slot (until the header timeout),
    so they cannot take descriptors past the cap; HTTPS works once they are gone."""
    server_ctx, client_ctx = _self_signed(tmp_path)

    async def generate(req, ctx):
        yield _final("secure")

    async def run():
        front, port = await _serve_tls(generate, server_ctx, header_timeout_s=120.0, max_connections=2)
        gate = front._serving.gate
        try:
            silent = [await asyncio.open_connection("127.0.0.1", port) for _ in range(5)]
            async with asyncio.timeout(20):
                while gate.open + gate.refused < 5:
                    await asyncio.sleep(0.05)
            counts = (gate.open, gate.refused)
            refused_closed = [await _closed_within(r, 20.0) for r, _ in silent[2:]]
            for _, w in silent:
                w.close()
            async with asyncio.timeout(20):
                while gate.open:
                    await asyncio.sleep(0.05)
            async with aiohttp.ClientSession() as s:
                r = await s.post(f"https://127.0.0.1:{port}/v1/completions", json={"prompt": "a"}, ssl=client_ctx)
                return counts, refused_closed, r.status, await r.json()
        finally:
            await front.stop()

    counts, refused_closed, status, body = asyncio.run(run())
    assert counts == (2, 3)
    assert all(c is not None for c in refused_closed)
    assert status == 200 and body["choices"][0]["text"] == "secure"


def test_a_tls_connection_over_the_cap_is_told_503_and_the_refusals_are_bounded(tmp_path):
    """Over the cap, an HTTPS client gets the same 503 and Retry-After as a plain one (it once
    saw only the connection close); handshakes for refusals are bounded, so a flood of them
    is closed unanswered instead of costing a handshake each."""
    server_ctx, client_ctx = _self_signed(tmp_path)

    async def never(req, ctx):  # pragma: no cover
        raise AssertionError("reached Generate")
        yield

    async def run():
        front, port = await _serve_tls(never, server_ctx, header_timeout_s=120.0, max_connections=1)
        gate = front._serving.gate
        try:
            holder = await asyncio.open_connection("127.0.0.1", port)  # takes the one slot
            async with asyncio.timeout(20):
                while gate.open < 1:
                    await asyncio.sleep(0.05)
            async with aiohttp.ClientSession() as s:
                async with s.get(f"https://127.0.0.1:{port}/health", ssl=client_ctx) as resp:
                    busy = resp.status, resp.headers.get("Retry-After"), await resp.json()
            # silent connections over the cap: refusal handshakes fill up, the rest close at once
            silent = [await asyncio.open_connection("127.0.0.1", port) for _ in range(gate.refusal_slots + 3)]
            async with asyncio.timeout(20):
                while gate.refused < 1 + len(silent):
                    await asyncio.sleep(0.05)
            refusing = gate.refusing
            unanswered = [await _closed_within(r, 2.0) for r, _ in silent[gate.refusal_slots:]]
            for _, w in [holder, *silent]:
                w.close()
            async with asyncio.timeout(20):
                while gate.open or gate.refusing:
                    await asyncio.sleep(0.05)
            return busy, refusing, gate.refusal_slots, unanswered
        finally:
            await front.stop()

    busy, refusing, slots, unanswered = asyncio.run(run())
    assert busy[0] == 503 and busy[1] == "1" and busy[2]["error"]["code"] == "too_many_connections"
    assert refusing == slots
    assert all(c == b"" for c in unanswered), unanswered


def test_a_tls_connection_that_never_shakes_hands_is_closed_at_the_header_timeout(tmp_path):
    server_ctx, _ = _self_signed(tmp_path)

    async def never(req, ctx):  # pragma: no cover
        raise AssertionError("reached Generate")
        yield

    async def run():
        front, port = await _serve_tls(never, server_ctx, header_timeout_s=0.5)
        gate = front._serving.gate
        try:
            r, w = await asyncio.open_connection("127.0.0.1", port)
            closed = await _closed_within(r, 20.0)
            w.close()
            async with asyncio.timeout(20):
                while gate.open:
                    await asyncio.sleep(0.05)
            return closed, gate.open
        finally:
            await front.stop()

    closed, still_open = asyncio.run(run())
    assert closed is not None and still_open == 0


@pytest.mark.parametrize("tls", [False, True], ids=["http", "https"])
def test_a_client_that_disconnects_cancels_its_request(tmp_path, tls):
    """A client gone before its (non-streamed) answer: the handler is cancelled, so the
    generation behind it stops instead of running to the end for nobody."""
    stopped = None
    server_ctx, client_ctx = _self_signed(tmp_path) if tls else (None, None)

    async def endless(req, ctx):
        try:
            while True:
                await asyncio.sleep(0.05)
                yield pb.GenerateResponse(token_ids=[97], text="a")
        finally:
            stopped.set()

    async def run():
        nonlocal stopped
        stopped = asyncio.Event()
        if tls:
            front, port = await _serve_tls(endless, server_ctx)
        else:
            front, _ = await _serve(endless)
            port = front._serving.port
        try:
            r, w = await asyncio.open_connection("127.0.0.1", port, ssl=client_ctx)
            body = b'{"prompt": "abc", "max_tokens": 100000}'
            w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            await w.drain()
            await asyncio.sleep(0.5)
            w.transport.abort()  # a reset, as a client killed mid-request
            async with asyncio.timeout(20):
                await stopped.wait()
            return True
        finally:
            await front.stop()

    assert asyncio.run(run())


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("first_after_s", [1.0, 0.05], ids=["before-first-token", "while-tokens-flow"])
def test_a_client_gone_is_noticed_even_when_its_cancellation_was_lost(stream, first_after_s):
    """The Generate behind the front swallows the cancellation the client's reset causes
    (as `asyncio.wait_for` can before Python 3.12, gh-86296): the next message it yields
    finds the client gone, and the front closes the call instead of waiting for its end."""
    swallowed = stopped = None

    async def deaf(req, ctx):
        try:
            wait = first_after_s  # the client resets at 0.5 s: before the first token, or while they flow
            while True:
                try:
                    await asyncio.sleep(wait)
                    wait = 0.05
                except asyncio.CancelledError:
                    if swallowed.is_set():
                        raise  # the front's own stop, after the test
                    swallowed.set()  # the fault: carry on once as if never cancelled
                yield pb.GenerateResponse(token_ids=[97], text="a")
        finally:
            stopped.set()

    async def run():
        nonlocal swallowed, stopped
        swallowed, stopped = asyncio.Event(), asyncio.Event()
        front, _ = await _serve(deaf)
        try:
            r, w = await asyncio.open_connection("127.0.0.1", front._serving.port)
            body = json.dumps({"prompt": "abc", "max_tokens": 100000, "stream": stream}).encode()
            w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            await w.drain()
            await asyncio.sleep(0.5)
            w.transport.abort()  # a reset
            async with asyncio.timeout(20):
                await stopped.wait()
            return swallowed.is_set()
        finally:
            await front.stop()

    assert asyncio.run(run()), "the fault was not injected: the handler's cancellation never reached Generate"


def test_a_chat_request_without_max_tokens_asks_for_the_rest_of_the_context():
    """Chat's default max_tokens is the rest of the context of the worker that serves it, which
    a router's front may not know: such a request says so (the worker lowers it to the room its
    context leaves); one that names max_tokens is held to it (and refused if it cannot fit)."""
    seen = []

    async def generate(req, ctx):
        seen.append((req.sampling.max_tokens, req.sampling.max_tokens_up_to_context))
        yield _final()

    async def run():
        front, url = await _serve(generate, max_model_len=1000)
        chat = {"messages": [{"role": "user", "content": "hi"}]}
        try:
            async with aiohttp.ClientSession() as s:
                for extra in ({}, {"max_tokens": None}, {"max_tokens": 7}, {"max_completion_tokens": 9},
                              {"max_completion_tokens": None, "max_tokens": 5}):
                    r = await s.post(f"{url}/chat/completions", json={**chat, **extra})
                    assert r.status == 200, await r.text()
                r = await s.post(f"{url}/completions", json={"prompt": "abc"})
                assert r.status == 200
        finally:
            await front.stop()

    asyncio.run(run())
    (first, up1), (second, up2), *rest = seen
    assert up1 and up2 and first == second and 900 < first < 1000  # context minus the rendered prompt
    # a null max_completion_tokens beside max_tokens once hid it (and the default was sent)
    assert rest == [(7, False), (9, False), (5, False), (16, False)]


def test_malformed_requests_cannot_flood_the_log_with_tracebacks(caplog):
    """aiohttp logs an ERROR with a traceback for each malformed request (here: a body that
    does not gunzip, which it re-raised after the 400, and a bad chunk size), before any key
    is checked; the front turns them into one line each, without a traceback, under a limit."""
    import logging

    from kvmesh.workers.grpc_guard import LOG_BURST

    async def never(req, ctx):  # pragma: no cover
        raise AssertionError("reached Generate")
        yield

    async def run():
        front, url = await _serve(never)
        port = front._serving.port
        statuses = []
        try:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
                for _ in range(15):
                    r = await s.post(f"{url}/completions", data=b"xx",
                                     headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
                    statuses.append(r.status)
                    await r.read()
            for _ in range(15):
                r, w = await asyncio.open_connection("127.0.0.1", port)
                w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n")
                statuses.append(int((await _closed_within(r, 20.0) or b"HTTP/1.1 0")[9:12]))
                w.close()
        finally:
            await front.stop()
        return statuses

    with caplog.at_level(logging.WARNING):
        statuses = asyncio.run(run())
    assert statuses == [400] * 30
    server = [r for r in caplog.records if r.name.startswith("aiohttp")]
    ours = [r for r in caplog.records if r.name == "kvmesh.services.http_front"]
    assert not server, [r.getMessage() for r in server]
    assert 1 <= len(ours) <= LOG_BURST and not any(r.exc_info for r in ours)
    assert all("\n" not in r.getMessage() and ("Can not decode content-encoding: gzip" in r.getMessage()
                                               or "chunk" in r.getMessage().lower()) for r in ours), \
        [r.getMessage() for r in ours]


def test_a_malformed_request_is_logged_without_its_bytes(caplog):
    """aiohttp quotes the bytes it could not parse (a chunk-size line that is in fact the
    prompt's JSON): the log line keeps the error's kind, never the tenant's text."""
    import logging

    async def never(req, ctx):  # pragma: no cover
        raise AssertionError("reached Generate")
        yield

    async def run():
        front, _ = await _serve(never)
        for f in logging.getLogger("aiohttp.server").filters:  # a window of its own (earlier tests)
            if hasattr(f, "client_errors"):
                f.client_errors.window_start = float("-inf")
        try:
            r, w = await asyncio.open_connection("127.0.0.1", front._serving.port)
            w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                    b'{"prompt": "TOPSECRET"}\r\n')
            status = int((await _closed_within(r, 20.0) or b"HTTP/1.1 0")[9:12])
            w.close()
        finally:
            await front.stop()
        return status

    with caplog.at_level(logging.WARNING):
        assert asyncio.run(run()) == 400
    ours = [r.getMessage() for r in caplog.records if r.name == "kvmesh.services.http_front"]
    assert any("chunk" in m.lower() and "<request bytes>" in m for m in ours), ours
    assert not any("TOPSECRET" in r.getMessage() for r in caplog.records)


def test_a_worker_refusing_max_tokens_over_its_context_names_the_field():
    """The front cannot check a request against a worker's context it does not know; the
    worker's refusal (`limits.check_completion_room`) comes back as a 400 naming max_tokens,
    as the refusals made in the front itself name their field."""
    from kvmesh.workers import limits
    from kvmesh.workers.request import InvalidRequest

    async def generate(req, ctx):
        try:
            limits.check_completion_room(3, req.sampling.max_tokens, 8)
        except InvalidRequest as exc:
            await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        yield _final()

    chat = {"messages": [{"role": "user", "content": "hi"}]}

    async def run():
        front, url = await _serve(generate)
        out = []
        try:
            async with aiohttp.ClientSession() as s:
                for path, body in (("completions", {"prompt": "abc", "max_tokens": 50}),
                                   ("chat/completions", {**chat, "max_completion_tokens": 50}),
                                   ("chat/completions", {**chat, "max_tokens": 50}),
                                   ("chat/completions", {**chat, "max_completion_tokens": 50, "stream": True})):
                    r = await s.post(f"{url}/{path}", json=body)
                    out.append((r.status, await r.json()))
        finally:
            await front.stop()
        return out

    (status, err), *chats = asyncio.run(run())
    assert status == 400 and err["error"]["param"] == "max_tokens", err
    assert "at most 5 tokens" in err["error"]["message"]
    # chat names the field its client sent, not the wire's name for it
    for (status, err), field in zip(chats, ("max_completion_tokens", "max_tokens", "max_completion_tokens")):
        assert status == 400 and err["error"]["param"] == field, err
        assert err["error"]["message"].startswith(f"{field} is 50 "), err


def test_a_refusal_of_text_for_another_tokenizer_is_400_and_the_fleets_states_are_503():
    """FAILED_PRECONDITION reaches a front only as a router's refusal of text (or a chat
    prompt) for workers of another tokenizer: a 400, which the client works around by sending
    token ids. No usable worker comes as UNAVAILABLE: a 503, as before."""
    refusals = {"tokenizer": (grpc.StatusCode.FAILED_PRECONDITION,
                              "the workers use another tokenizer: send token_ids"),
                "fleet": (grpc.StatusCode.UNAVAILABLE, "no live workers registered: start workers or retry")}

    def refusing(code, details):
        async def generate(req, ctx):
            await ctx.abort(code, details)
            yield  # pragma: no cover
        return generate

    async def run():
        out = {}
        for name, (code, details) in refusals.items():
            front, url = await _serve(refusing(code, details))
            try:
                async with aiohttp.ClientSession() as s:
                    for route, body in (("completions", {"prompt": "abc", "max_tokens": 1}),
                                        ("chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
                        r = await s.post(f"{url}/{route}", json=body)
                        out[name, route] = (r.status, await r.json())
            finally:
                await front.stop()
        return out

    out = asyncio.run(run())
    for route in ("completions", "chat/completions"):
        status, body = out["tokenizer", route]
        assert status == 400 and body["error"] == {
            "message": "the workers use another tokenizer: send token_ids", "type": "invalid_request_error",
            "param": None, "code": "failed_precondition"}, body
        status, body = out["fleet", route]
        assert status == 503 and body["error"]["type"] == "service_unavailable", body


def test_the_model_may_be_named_by_an_alias_and_chat_ids_say_they_come_from_text():
    """A front's ``model_aliases`` (a router sets them) name the served model as its id does;
    other names are 404. Generate is told which token ids this front made from text (a chat
    prompt) and which the client sent."""
    seen = []

    async def generate(req, ctx):
        seen.append((req.WhichOneof("prompt"), ctx.tokenized_from_text))
        yield _final()

    async def run():
        front, url = await _serve(generate)
        front.model_id, front.model_aliases = "m@123", frozenset({"m", "m@123+compute=float32"})
        out = {}
        try:
            async with aiohttp.ClientSession() as s:
                for name in ("m@123", "m", "m@123+compute=float32", "n", "m@124"):
                    r = await s.post(f"{url}/completions", json={"model": name, "prompt": "abc", "max_tokens": 1})
                    out[name] = (r.status, (await r.json()).get("model"))
                    r = await s.get(f"{url}/models/{name}")
                    out["GET " + name] = (r.status, (await r.json()).get("id"))
                r = await s.get(f"{url}/models")
                out["listed"] = [m["id"] for m in (await r.json())["data"]]
                del seen[:]
                await s.post(f"{url}/chat/completions", json={"model": "m", "messages": [
                    {"role": "user", "content": "hi"}]})
                await s.post(f"{url}/completions", json={"prompt": [104, 105], "max_tokens": 1})
                await s.post(f"{url}/completions", json={"prompt": "hi", "max_tokens": 1})
        finally:
            await front.stop()
        return out

    out = asyncio.run(run())
    for name in ("m@123", "m", "m@123+compute=float32"):
        assert out[name] == (200, "m@123") and out["GET " + name] == (200, "m@123"), (name, out)
    for name in ("n", "m@124"):
        assert out[name] == (404, None) and out["GET " + name] == (404, None), (name, out)
    assert out["listed"] == ["m@123"]
    assert seen == [("token_ids", True), ("token_ids", False), ("text", False)]


def test_a_full_checkpoint_id_named_by_model_is_sent_to_generate_and_a_folder_name_is_not():
    """In front of a router (``forward_model_id``), a ``model`` with "@" names one checkpoint:
    Generate gets it as ``model_id`` and refuses it if that checkpoint is no longer served
    when the request is routed; a name without "@", or no name, leaves ``model_id`` empty.
    A worker's front (the default) sends none."""
    seen = []

    async def generate(req, ctx):
        seen.append(req.model_id)
        yield _final()

    async def run():
        front, url = await _serve(generate)
        front.model_id, front.model_aliases = "m@123", frozenset({"m", "m@123+compute=float32"})
        try:
            async with aiohttp.ClientSession() as s:
                async def post(path, body):
                    r = await s.post(f"{url}/{path}", json=body)
                    assert r.status == 200, (body, r.status, await r.text())
                await post("completions", {"model": "m@123", "prompt": "abc", "max_tokens": 1})
                front.forward_model_id = True
                for name in ("m@123", "m@123+compute=float32", "m", "", None):
                    await post("completions", {"model": name, "prompt": [104, 105], "max_tokens": 1})
                await post("chat/completions", {"model": "m@123", "messages": [{"role": "user", "content": "hi"}],
                                                "max_tokens": 1})
        finally:
            await front.stop()

    asyncio.run(run())
    assert seen == ["", "m@123", "m@123+compute=float32", "", "", "", "m@123"]


@pytest.mark.parametrize("path,body,param,says", [
    ("completions", {"prompt": "a", "model": []}, "model", "model must be a string"),
    ("completions", {"prompt": "a", "model": {"id": "m"}}, "model", "model must be a string"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "model": 5}, "model", "must be a string"),
    ("completions", {"prompt": "a", "stream": True, "stream_options": []}, "stream_options", "must be an object"),
    ("completions", {"prompt": "a", "stream": True, "stream_options": {"foo": 1}}, "stream_options", "'foo'"),
    ("completions", {"prompt": "a", "stream": True, "stream_options": {"continuous_usage_stats": "false"}},
     "stream_options.continuous_usage_stats", "continuous_usage_stats"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi", "name": {"x": [1]}}]}, "messages",
     "messages[0].name must be a string"),
])
def test_fields_of_the_wrong_shape_are_400_naming_them(path, body, param, says):
    status, err = _refused(path, body)
    assert status == 400 and err["error"]["param"] == param, err
    assert says in err["error"]["message"], err


def test_the_early_context_check_quotes_what_the_workers_serve():
    """A router's front checks a token-id prompt against the longest context its live workers
    serve (their KV pools may hold less than the model's context), not the model's."""
    async def never(req, ctx):  # pragma: no cover - refused before Generate
        raise AssertionError("reached Generate")
        yield

    async def run():
        front, url = await _serve(never, max_model_len=32768)
        front.context_fn = lambda: 4096
        try:
            async with aiohttp.ClientSession() as s:
                r = await s.post(f"{url}/completions", json={"prompt": [1] * 5000, "max_tokens": 1})
                return r.status, await r.json()
        finally:
            await front.stop()

    status, err = asyncio.run(run())
    assert status == 400 and "context served here is 4096 tokens" in err["error"]["message"], err
    assert "at most 4095 tokens" in err["error"]["message"], err


def test_vllm_clients_continuous_usage_stats_is_accepted_and_usage_comes_last():
    """Clients written for vLLM send ``stream_options.continuous_usage_stats``; it is taken
    (usage still comes in the last chunk, with include_usage), not refused."""
    async def generate(req, ctx):
        yield _final("ok")

    async def run():
        front, url = await _serve(generate)
        try:
            async with aiohttp.ClientSession() as s:
                r = await s.post(f"{url}/completions", json={
                    "prompt": "a", "stream": True,
                    "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
                return r.status, await r.text()
        finally:
            await front.stop()

    status, text = asyncio.run(run())
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert status == 200 and events[-1] == "[DONE]", text
    assert '"usage"' in events[-2] and json.loads(events[-2])["choices"] == [], text
