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
