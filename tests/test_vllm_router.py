"""`kvmesh router --backend vllm`: server specs and flag errors (no vLLM needed)."""
from __future__ import annotations

import pytest

from kvmesh.services.vllm_router import VllmServerSpec, parse_server_spec


def test_parse_server_spec_forms():
    assert parse_server_spec("a=http://h:8000/v1,tcp://h:5557") == VllmServerSpec("a", "http://h:8000",
                                                                                  "tcp://h:5557", None)
    assert parse_server_spec("http://h:8000/,tcp://h:5557,tcp://h:5558", 3) == VllmServerSpec(
        "vllm-3", "http://h:8000", "tcp://h:5557", "tcp://h:5558")


@pytest.mark.parametrize("text, word", [
    ("http://h:8000", "--vllm-server takes"),
    ("h:8000,tcp://h:1", "must start with http"),
    ("http://h:8000,h:5557", "ZMQ addresses"),
    ("a=http://h:8000,,tcp://h:1", "--vllm-server takes"),
    ("a=http://h:8000,tcp://*:5557", "bind side"),
    ("a=http://h:8000,tcp://0.0.0.0:5557", "bind side"),
    ("a=http://h:8000,tcp://[::]:5557", "bind side"),
    ("a=http://h:8000,tcp://h:5557,tcp://*:5558", "bind side"),
])
def test_parse_server_spec_errors_name_the_flag(text, word):
    with pytest.raises(ValueError, match=word):
        parse_server_spec(text)


@pytest.mark.parametrize("argv, word", [
    (["--backend", "vllm", "--http-port", "1", "--vllm-block-size", "16"], "needs at least one --vllm-server"),
    (["--backend", "vllm", "--http-port", "1", "--vllm-server", "http://h:1,tcp://h:2"], "--vllm-block-size"),
    (["--backend", "vllm", "--vllm-server", "http://h:1,tcp://h:2", "--vllm-block-size", "16"], "--http-port"),
    (["--backend", "vllm", "--http-port", "1", "--vllm-server", "http://h:1,tcp://h:2", "--vllm-block-size", "16",
      "--vllm-hash-algo", "xxhash"], "PYTHONHASHSEED"),
    (["--backend", "vllm", "--http-port", "1", "--vllm-server", "http://h:1,tcp://h:2", "--vllm-block-size", "16",
      "--vllm-version", "0.8.5"], "not supported"),
    (["--backend", "vllm", "--http-port", "1", "--vllm-server", "http://h:1,tcp://*:5557", "--vllm-block-size", "16"],
     "give the vLLM server's address"),
    (["--port", "1"], "--redis-url"),
])
def test_router_flag_errors(argv, word, capsys):
    from kvmesh.services.cli import build_parser

    args = build_parser().parse_args(["router", *argv])
    with pytest.raises(SystemExit) as exit_:
        args.func(args)
    assert exit_.value.code == 2
    assert word in capsys.readouterr().err


def test_model_listing_passes_the_callers_key_to_the_server():
    """A vLLM server started with --api-key lists its model only to a caller with the key;
    the router forwards the caller's Authorization header (as on completions). The server
    here is a stand-in that answers /v1/models as vLLM does with --api-key."""
    import asyncio

    import aiohttp
    from aiohttp import web

    from kvmesh.services.vllm_compat import VllmHashConfig
    from kvmesh.services.vllm_router import VllmRouter

    async def models(request):
        if request.headers.get("Authorization") != "Bearer k1":
            return web.json_response({"error": "Unauthorized"}, status=401)
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

    async def run():
        app = web.Application()
        app.router.add_get("/v1/models", models)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        router = VllmRouter([VllmServerSpec("a", f"http://127.0.0.1:{port}", "tcp://127.0.0.1:1")], VllmHashConfig())
        router.servers["a"].live = True
        router._session = aiohttp.ClientSession()
        front = web.AppRunner(router.app())
        await front.setup()
        fsite = web.TCPSite(front, "127.0.0.1", 0)
        await fsite.start()
        url = f"http://127.0.0.1:{front.addresses[0][1]}/v1/models"
        out = []
        try:
            async with aiohttp.ClientSession() as s:
                for key in (None, "k1"):
                    async with s.get(url, headers={"Authorization": f"Bearer {key}"} if key else {}) as r:
                        out.append((r.status, await r.json()))
        finally:
            await router._session.close()
            await front.cleanup()
            await runner.cleanup()
        return out

    (no_key, _), (with_key, body) = asyncio.run(run())
    assert no_key == 401
    assert with_key == 200 and body["data"][0]["id"] == "m"


@pytest.mark.parametrize("argv, word", [
    (["--host", "0.0.0.0"], "TLS is off"),
    (["--api-keys", "/nonexistent"], "--api-keys needs TLS"),
])
def test_the_vllm_mode_refuses_what_it_cannot_secure(argv, word, capsys):
    """A non-loopback bind without TLS, or API keys without TLS, exit 2 as for kvmesh's own
    router (the vLLM mode once served plain HTTP on any interface and dropped these flags)."""
    from kvmesh.services.cli import build_parser

    args = build_parser().parse_args(["router", "--backend", "vllm", "--http-port", "1", "--vllm-server",
                                      "http://h:1,tcp://h:2", "--vllm-block-size", "16", *argv])
    assert args.func(args) == 2
    assert word in capsys.readouterr().err


async def _stand_in_vllm(completions, metrics=None):
    """A stand-in vLLM server on a free loopback port: ``completions`` answers
    /v1/completions; /metrics (``metrics``, default an empty page) and /version answer what
    the router polls. Returns (runner, port); the caller cleans the runner up (handlers
    still running then are given 0.1 s)."""
    from aiohttp import web

    from kvmesh.services.vllm_compat import SUPPORTED_VERSIONS

    async def empty(request):
        return web.Response(text="")

    async def version(request):
        return web.json_response({"version": SUPPORTED_VERSIONS[-1]})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/metrics", metrics or empty)
    app.router.add_get("/version", version)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, runner.addresses[0][1]


def test_with_api_keys_the_tenant_comes_from_the_key_over_https(tmp_path):
    """`--backend vllm` with --api-keys and TLS: no key or a bad key gets 401 and reaches no
    server; with a key, vLLM gets the tenant's cache_salt (whatever salt the client sent,
    and two tenants' salts differ), not the caller's key; /metrics is not served and /health
    tells only the status. The vLLM server is a stand-in that records what it was sent."""
    import asyncio
    import json

    import aiohttp
    from aiohttp import web

    from kvmesh.services.auth import Authenticator
    from kvmesh.services.credentials import generate_cluster_credentials
    from kvmesh.services.vllm_compat import VllmHashConfig
    from kvmesh.services.vllm_router import VllmRouter
    from kvmesh.workers.tls import TlsConfig

    creds = generate_cluster_credentials(str(tmp_path / "run"))
    keys = tmp_path / "keys"
    keys.write_text("alice  key-alice-0123456789\nbob  key-bob-0123456789\n")
    seen = []

    async def completions(request):
        seen.append((await request.json(), request.headers.get("Authorization")))
        return web.json_response({"choices": [{"text": "ok"}]})

    async def run():
        runner, port = await _stand_in_vllm(completions)
        router = VllmRouter([VllmServerSpec("a", f"http://127.0.0.1:{port}", "tcp://127.0.0.1:1")], VllmHashConfig(),
                            auth=Authenticator.from_file(str(keys)))
        tls = TlsConfig.from_files(creds.cert, creds.key, creds.ca)
        fport = await router.start("127.0.0.1", 0, tls.server_ssl_context())
        await router.wait_live(60)
        url = f"https://127.0.0.1:{fport}"
        out = {}
        try:
            import ssl

            ctx = ssl.create_default_context(cafile=creds.ca)
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as s:
                body = {"prompt": [1, 2, 3], "max_tokens": 1, "cache_salt": "mine"}
                for name, key in (("none", None), ("bad", "nope"), ("alice", "key-alice-0123456789"), ("bob", "key-bob-0123456789")):
                    headers = {"Authorization": f"Bearer {key}"} if key else {}
                    async with s.post(url + "/v1/completions", json=body, headers=headers) as r:
                        out[name] = r.status
                for path in ("/metrics", "/health"):
                    async with s.get(url + path, headers={"Authorization": "Bearer key-alice-0123456789"}) as r:
                        out[path] = (r.status, await r.text())
        finally:
            await router.stop()
            await runner.cleanup()
        return out

    out = asyncio.run(run())
    assert out["none"] == out["bad"] == 401 and out["alice"] == out["bob"] == 200
    assert len(seen) == 2 and all(auth is None for _, auth in seen)  # the router's keys stay with the router
    salts = [body["cache_salt"] for body, _ in seen]
    assert salts[0] != salts[1] and all("mine" in s for s in salts)
    assert json.loads(salts[0])[1] == "alice" and json.loads(salts[1])[1] == "bob"
    assert out["/metrics"][0] == 404
    assert json.loads(out["/health"][1]).keys() == {"status"}


def test_bad_json_is_400_and_internal_fields_never_reach_vllm():
    """JSON nested 100,000 deep or an integer of 5,000 digits gets 400 with an OpenAI error
    body, as from kvmesh's HTTP front (it was a 500 with a traceback), and reaches no server;
    a valid body reaches vLLM without `kv_transfer_params` and the other `INTERNAL_FIELDS`,
    its other fields unchanged. The vLLM server is a stand-in that records what it was sent."""
    import asyncio

    import aiohttp
    from aiohttp import web

    from kvmesh.services.vllm_compat import VllmHashConfig
    from kvmesh.services.vllm_router import INTERNAL_FIELDS, VllmRouter

    seen = []

    async def completions(request):
        seen.append(await request.json())
        return web.json_response({"choices": [{"text": "ok"}]})

    async def run():
        runner, port = await _stand_in_vllm(completions)
        router = VllmRouter([VllmServerSpec("a", f"http://127.0.0.1:{port}", "tcp://127.0.0.1:1")], VllmHashConfig())
        fport = await router.start("127.0.0.1", 0)
        await router.wait_live(60)
        url = f"http://127.0.0.1:{fport}/v1/completions"
        out = {}
        bodies = {"deep": b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                  "digits": b'{"prompt": [1], "max_tokens": ' + b"9" * 5000 + b"}"}
        try:
            async with aiohttp.ClientSession() as s:
                for name, raw in bodies.items():
                    async with s.post(url, data=raw, headers={"Content-Type": "application/json"}) as r:
                        out[name] = (r.status, await r.json())
                body = {"prompt": [1, 2, 3], "max_tokens": 1, "temperature": 0, "cache_salt": "mine",
                        **{name: {"do_remote_prefill": True, "remote_host": "10.9.9.9"} for name in INTERNAL_FIELDS}}
                async with s.post(url, json=body) as r:
                    out["ok"] = r.status
        finally:
            await router.stop()
            await runner.cleanup()
        return out

    out = asyncio.run(run())
    for name in ("deep", "digits"):
        status, err = out[name]
        assert status == 400, (name, status, err)
        assert err["error"]["message"].startswith("request body is not valid JSON"), err
    assert out["ok"] == 200 and len(seen) == 1
    assert "kv_transfer_params" in INTERNAL_FIELDS
    assert seen[0] == {"prompt": [1, 2, 3], "max_tokens": 1, "temperature": 0, "cache_salt": "mine"}


def test_a_subscriber_that_stops_is_logged_once_and_shown_in_health(caplog):
    """When reading a server's KV events fails (here an endpoint ZMQ cannot connect to,
    which `parse_server_spec` refuses and so is given directly), the failure is logged once
    at ERROR and /health shows it in that server's ``error``; the server stays usable by
    load. The vLLM server is a stand-in."""
    import asyncio
    import logging
    import time

    import aiohttp
    from aiohttp import web

    from kvmesh.services.vllm_compat import VllmHashConfig
    from kvmesh.services.vllm_router import VllmRouter

    async def completions(request):
        return web.json_response({"choices": [{"text": "ok"}]})

    async def run():
        runner, port = await _stand_in_vllm(completions)
        router = VllmRouter([VllmServerSpec("a", f"http://127.0.0.1:{port}", "tcp://*:5557")], VllmHashConfig())
        fport = await router.start("127.0.0.1", 0)
        try:
            await router.wait_live(60)
            async with aiohttp.ClientSession() as s:
                deadline = time.monotonic() + 60
                while True:
                    async with s.get(f"http://127.0.0.1:{fport}/health") as r:
                        health = await r.json()
                    if health["servers"]["a"]["error"] or time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.1)
                await asyncio.sleep(router.poll_s * 3)  # later polls keep the error shown
                async with s.get(f"http://127.0.0.1:{fport}/health") as r:
                    later = await r.json()
        finally:
            await router.stop()
            await runner.cleanup()
        return health, later

    with caplog.at_level(logging.ERROR, logger="kvmesh.services.vllm_events"):
        health, later = asyncio.run(run())
    entry = health["servers"]["a"]
    assert "tcp://*:5557" in entry["error"] and "ZMQError" in entry["error"], entry
    assert entry["live"] is True and health["status"] == "ok"
    assert later["servers"]["a"]["error"] == entry["error"]
    errors = [r for r in caplog.records if r.levelno == logging.ERROR and "tcp://*:5557" in r.getMessage()]
    assert len(errors) == 1, [r.getMessage() for r in caplog.records]


def test_a_declared_body_over_the_cap_is_refused_at_once_and_the_connection_closes():
    """A Content-Length over `MAX_BODY_BYTES` gets an OpenAI-shaped 413 before the body is
    read (not after the 60 s body timeout) and ``Connection: close``: the unread rest of
    the body must not be taken for the next request on that connection."""
    import asyncio
    import json
    import re

    from aiohttp import web

    from kvmesh.services.vllm_compat import VllmHashConfig
    from kvmesh.services.vllm_router import MAX_BODY_BYTES, VllmRouter

    async def completions(request):  # pragma: no cover - never reached
        return web.json_response({})

    async def run():
        runner, port = await _stand_in_vllm(completions)
        router = VllmRouter([VllmServerSpec("a", f"http://127.0.0.1:{port}", "tcp://127.0.0.1:1")], VllmHashConfig())
        fport = await router.start("127.0.0.1", 0)
        try:
            answers = []
            for expect in (b"", b"Expect: 100-continue\r\n"):  # asked first or not: 413, no 100 Continue
                r, w = await asyncio.open_connection("127.0.0.1", fport)
                w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + expect +
                        b"Content-Length: %d\r\n\r\n" % (MAX_BODY_BYTES + 1) + (b"" if expect else b'{"prompt": '))
                async with asyncio.timeout(20):
                    head = await r.readuntil(b"\r\n\r\n")
                    length = int(re.search(rb"(?i)\r\ncontent-length: *(\d+)", head).group(1))
                    answers.append((head, json.loads(await r.readexactly(length))))
                w.close()
            return answers
        finally:
            await router.stop()
            await runner.cleanup()

    for head, body in asyncio.run(run()):
        assert head.startswith(b"HTTP/1.1 413"), head
        assert re.search(rb"(?i)\r\nconnection: *close\r\n", head), head
        assert body["error"]["code"] == 413 and "shorten the prompt" in body["error"]["message"], body


def test_a_server_that_stops_answering_has_its_requests_retried_or_cut(monkeypatch):
    """A vLLM server that freezes (SIGSTOP, a hung node) keeps its connections open and sends
    nothing; a request relayed there used to wait forever. Once the server's /metrics has
    gone unanswered for `UNRESPONSIVE_S`, a request that has received nothing is answered by
    another server, and one whose answer was under way is cut (the client sees an error, not
    a complete answer). Both servers are stand-ins; freezing one is the fault injected."""
    import asyncio

    import aiohttp
    from aiohttp import web

    from kvmesh.services import vllm_router
    from kvmesh.services.vllm_compat import VllmHashConfig
    from kvmesh.services.vllm_router import VllmRouter

    monkeypatch.setattr(vllm_router, "UNRESPONSIVE_S", 1.0)  # 10 s in service; the logic is the same

    async def stand_in(name: str, frozen: asyncio.Event):
        """A server whose every answer hangs while ``frozen`` (a streamed one after its first
        chunk), as a stopped process's would."""
        async def completions(request):
            body = await request.json()
            if frozen.is_set():
                if body.get("stream"):
                    resp = web.StreamResponse()
                    await resp.prepare(request)
                    await resp.write(b'data: {"choices": [{"text": "x"}]}\n\n')
                await asyncio.Event().wait()
            return web.json_response({"choices": [{"text": name}]})

        async def metrics(request):
            if frozen.is_set():
                await asyncio.Event().wait()
            return web.Response(text="")

        runner, port = await _stand_in_vllm(completions, metrics)
        return runner, VllmServerSpec(name, f"http://127.0.0.1:{port}", "tcp://127.0.0.1:1")

    async def run():
        frozen = asyncio.Event()
        (ra, a), (rb, b) = await stand_in("a", frozen), await stand_in("b", asyncio.Event())
        router = VllmRouter([a, b], VllmHashConfig(), policy="round_robin", poll_s=0.2)
        fport = await router.start("127.0.0.1", 0)
        await router.wait_live(30)
        url = f"http://127.0.0.1:{fport}/v1/completions"
        out = {}
        try:
            frozen.set()
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
                # round robin sends the first request to "a"
                async with s.post(url, json={"prompt": [1, 2, 3], "max_tokens": 1}) as r:
                    out["retried"] = (r.status, r.headers.get("x-kvmesh-worker"), await r.json())
                st = router.servers["a"]
                st.live, st.failing_since = True, None  # as if a poll had answered: the next one goes there
                router.policy = vllm_router.make_policy("round_robin")
                try:
                    async with s.post(url, json={"prompt": [1, 2, 3], "max_tokens": 1, "stream": True}) as r:
                        out["cut_worker"] = r.headers.get("x-kvmesh-worker")
                        await r.read()
                    out["cut"] = "completed"
                except aiohttp.ClientPayloadError as exc:
                    out["cut"] = type(exc).__name__
        finally:
            frozen.clear()
            await router.stop()
            await ra.cleanup()
            await rb.cleanup()
        return out

    out = asyncio.run(run())
    status, worker, body = out["retried"]
    assert status == 200 and worker == "b" and body["choices"][0]["text"] == "b", out
    assert out["cut_worker"] == "a" and out["cut"] == "ClientPayloadError", out


def test_more_relays_than_a_connection_pool_neither_wait_nor_starve_the_polls(monkeypatch):
    """110 streamed answers at once from two healthy servers all complete. With the polls and
    the relays on one aiohttp session (its pool: 100 connections), the 101st request waited
    for a free connection, and so did the /metrics polls: they timed out, the servers
    counted as frozen, and every relay to them was cut."""
    import asyncio

    import aiohttp
    from aiohttp import web

    from kvmesh.services import vllm_router
    from kvmesh.services.vllm_compat import VllmHashConfig
    from kvmesh.services.vllm_router import VllmRouter

    monkeypatch.setattr(vllm_router, "UNRESPONSIVE_S", 1.0)
    monkeypatch.setattr(vllm_router, "POLL_TIMEOUT_S", 0.5)
    streams = 110

    async def completions(request):  # a healthy server, answering slowly
        await request.json()
        resp = web.StreamResponse()
        await resp.prepare(request)
        for _ in range(6):  # longer than a poll's timeout and the freeze limit together
            await asyncio.sleep(1.0)
            await resp.write(b'data: {"choices": [{"text": "x"}]}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def run():
        servers = [await _stand_in_vllm(completions) for _ in range(2)]
        router = VllmRouter([VllmServerSpec(n, f"http://127.0.0.1:{port}", "tcp://127.0.0.1:1")
                             for n, (_, port) in zip("ab", servers)], VllmHashConfig(), poll_s=0.2)
        fport = await router.start("127.0.0.1", 0)
        await router.wait_live(30)
        url = f"http://127.0.0.1:{fport}/v1/completions"

        async def one(s, i):
            try:
                async with s.post(url, json={"prompt": [i % 200 + 1], "max_tokens": 3, "stream": True}) as r:
                    body = await r.read()
                    return "complete" if r.status == 200 and body.endswith(b"[DONE]\n\n") else f"HTTP {r.status}"
            except aiohttp.ClientError as exc:
                return type(exc).__name__

        try:
            conn = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=60)) as s:
                return await asyncio.gather(*[one(s, i) for i in range(streams)])
        finally:
            await router.stop()
            for runner, _ in servers:
                await runner.cleanup()

    outcomes = asyncio.run(run())
    assert outcomes == ["complete"] * streams, {o: outcomes.count(o) for o in set(outcomes)}


def test_a_taken_http_port_is_a_one_line_error_and_nothing_is_left_running(capsys):
    """`kvmesh router --backend vllm` on a port another process holds exits 2 naming
    --http-port (it ended in a traceback), and `VllmRouter.start` leaves no client session,
    poller or subscriber running when it fails."""
    import asyncio
    import socket

    from kvmesh.services.cli import build_parser
    from kvmesh.services.vllm_compat import VllmHashConfig
    from kvmesh.services.vllm_router import VllmRouter

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        args = build_parser().parse_args(["router", "--backend", "vllm", "--http-port", str(port), "--vllm-server",
                                          "a=http://127.0.0.1:1,tcp://127.0.0.1:2", "--vllm-block-size", "16"])
        rc = args.func(args)
        err = capsys.readouterr().err

        async def start_on_a_taken_port():
            router = VllmRouter([VllmServerSpec("a", "http://127.0.0.1:1", "tcp://127.0.0.1:2")], VllmHashConfig())
            with pytest.raises(OSError):
                await router.start("127.0.0.1", port)
            return router

        router = asyncio.run(start_on_a_taken_port())
    finally:
        holder.close()
    assert rc == 2 and f"--http-port {port}" in err and "Traceback" not in err, err
    assert router._session.closed and router._poll_session.closed and router._poller.cancelled()
