"""``kvmesh bench --api openai``: the load harness against the OpenAI-compatible HTTP front.

`OpenAITarget.generate` has the shape of a gRPC ``unary_stream`` call, so the harness's
per-request code times it unchanged: it posts a ``kvmesh.v1.GenerateRequest`` as
``POST /v1/completions`` (token-id prompt, ``stream: true`` with usage, and the
``ignore_eos`` / ``return_token_ids`` / ``cache_salt`` extensions) and yields each
server-sent event as a ``GenerateResponse`` (token ids, and on the last one finish reason,
usage and timing from ``usage.kvmesh``). HTTP errors raise `HttpCallError`, a
``grpc.RpcError`` whose code is the matching gRPC status.
"""
from __future__ import annotations

import asyncio
import json

import aiohttp
import grpc

from kvmesh.proto import kvmesh_pb2 as pb

_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
          403: grpc.StatusCode.PERMISSION_DENIED, 404: grpc.StatusCode.NOT_FOUND,
          429: grpc.StatusCode.RESOURCE_EXHAUSTED, 503: grpc.StatusCode.UNAVAILABLE,
          504: grpc.StatusCode.DEADLINE_EXCEEDED}


class HttpCallError(grpc.RpcError):
    """An HTTP error answer, seen as a gRPC status."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self._code, self._message = code, message

    def code(self):
        return self._code

    def details(self):
        return self._message


def base_url(target: str, tls: bool = False) -> str:
    """``http://HOST:PORT/v1`` (``https`` when ``tls``) from a base URL or a bare ``HOST:PORT``."""
    url = target if "://" in target else f"{'https' if tls else 'http'}://{target}"
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def _error(status: int, body: str) -> HttpCallError:
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body[:200]
    return HttpCallError(_CODES.get(status, grpc.StatusCode.INTERNAL), f"HTTP {status}: {message}")


class _Call:
    def __init__(self, target: "OpenAITarget", req: pb.GenerateRequest, timeout: float | None):
        self._target, self._req, self._timeout = target, req, timeout
        self._task = None

    def cancel(self) -> None:
        pass  # leaving the iteration closes the HTTP response, which the server sees as a disconnect

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        r = self._req
        body = {"model": self._target.model, "prompt": list(r.token_ids.ids) if r.WhichOneof("prompt") == "token_ids"
                else r.text, "max_tokens": r.sampling.max_tokens, "temperature": r.sampling.temperature,
                "top_p": r.sampling.top_p or 1.0, "seed": r.sampling.seed, "ignore_eos": r.sampling.ignore_eos,
                "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
        if r.cache_salt:
            body["cache_salt"] = r.cache_salt
        timeout = aiohttp.ClientTimeout(total=self._timeout)
        async with self._target.session.post(f"{self._target.url}/completions", json=body, timeout=timeout) as resp:
            if resp.status != 200:
                raise _error(resp.status, await resp.text())
            finish = ""
            async for raw in resp.content:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                event = json.loads(data)
                if "error" in event:
                    raise _error(int({"rate_limit_error": 429, "service_unavailable": 503}.get(
                        event["error"].get("type"), 500)), json.dumps(event))
                for choice in event.get("choices") or ():
                    finish = choice.get("finish_reason") or finish
                    ids = choice.get("token_ids") or []
                    if ids:
                        yield pb.GenerateResponse(token_ids=ids)
                usage = event.get("usage")
                if usage:
                    ext = usage.get("kvmesh") or {}
                    t = ext.get("timing") or {}
                    yield pb.GenerateResponse(
                        finished=True, finish_reason=finish, worker_id=ext.get("worker_id", ""),
                        usage=pb.Usage(prompt_tokens=usage["prompt_tokens"],
                                       cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                                       cached_tokens_by_tier=ext.get("cached_tokens_by_tier") or {},
                                       computed_prefill_tokens=ext.get("computed_prefill_tokens", 0),
                                       completion_tokens=usage["completion_tokens"]),
                        timing=pb.Timing(**{k: float(t.get(k, 0.0)) for k in ("queue_ms", "prefill_ms", "ttft_ms",
                                                                               "e2e_ms")}))


class OpenAITarget:
    """An HTTP front to bench. Use ``async with``; `detect` before `generate`."""

    def __init__(self, target: str, api_key: str | None = None, tls_ca: str | None = None,
                 tls_cert: str | None = None, tls_key: str | None = None):
        """``target``: base URL or ``HOST:PORT`` (https when ``tls_ca`` is given); ``api_key``
        is sent as ``Authorization: Bearer KEY``; ``tls_ca`` (PEM path) verifies the server;
        ``tls_cert``/``tls_key`` present a client certificate.

        Raises:
            ValueError: an API key without TLS (it would cross the network in clear), an
                ``http://`` URL with TLS options, half a key pair, or an unreadable file.
        """
        self.url = base_url(target, tls=bool(tls_ca))
        self.model = ""
        https = self.url.startswith("https://")
        if (tls_ca or tls_cert or tls_key) and not https:
            raise ValueError(f"{target} is plain http: --tls-ca/--tls-cert/--tls-key need an https:// target")
        if api_key and not https:
            raise ValueError("an API key (--api-key or KVMESH_API_KEY) needs TLS: pass --tls-ca (or set "
                             "KVMESH_TLS_CA) and an https:// target; without it the key would cross the network "
                             "in clear")
        if bool(tls_cert) != bool(tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        from kvmesh.services.security import check_api_key

        check_api_key(api_key)
        ssl_context = None
        if https:
            import ssl

            flag = "--tls-ca"
            try:
                ssl_context = ssl.create_default_context(cafile=tls_ca) if tls_ca else ssl.create_default_context()
                if tls_cert:
                    flag = "--tls-cert/--tls-key"
                    ssl_context.load_cert_chain(tls_cert, tls_key)
            except (OSError, ssl.SSLError) as exc:
                what = tls_ca if flag == "--tls-ca" else f"{tls_cert}, {tls_key}"
                raise ValueError(f"{flag} {what}: cannot load it as PEM ({getattr(exc, 'reason', None) or exc})") \
                    from None
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.session = aiohttp.ClientSession(headers=headers,
                                             connector=aiohttp.TCPConnector(limit=0, ssl=ssl_context))

    async def __aenter__(self) -> "OpenAITarget":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.session.close()

    async def detect(self, connect_timeout_s: float = 30.0) -> dict:
        """The served model (``GET /v1/models``), as the harness's service info.

        Raises:
            ConnectionError: the front did not answer within ``connect_timeout_s``, or its
                certificate did not verify (at once: a retry cannot change that).
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + connect_timeout_s
        while True:
            try:
                return await self._models_once()
            except aiohttp.ClientConnectorCertificateError as exc:  # retrying cannot help
                raise ConnectionError(f"{self.url}: the server's certificate did not verify ({exc.certificate_error}); "
                                      "pass --tls-ca with the CA that signed it (the ca.pem of `kvmesh up`'s "
                                      "credentials)") from None
            except aiohttp.ContentTypeError as exc:  # an HTTP server, but not this API: retrying cannot help
                kind = (exc.headers or {}).get("Content-Type", "no content type")
                raise ConnectionError(f"{self.url}/models answered {kind}, not JSON: that is not an OpenAI-compatible "
                                      "front (a metrics port?); give the URL of the HTTP front (`kvmesh up` prints "
                                      "it; --http-port)") from None
            except aiohttp.ClientResponseError as exc:
                if "Bad status line" in str(exc.message) and "\\x00" in str(exc.message):  # an HTTP/2 frame
                    raise ConnectionError(f"{self.url} speaks gRPC (HTTP/2), not HTTP/1.1: give the URL of the HTTP "
                                          "front (`kvmesh up` prints it; --http-port), or drop --api openai to "
                                          "send gRPC to this port") from None
                if loop.time() > deadline:
                    raise ConnectionError(f"cannot reach {self.url} within {connect_timeout_s:g} s ({exc})") from None
                await asyncio.sleep(0.2)
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                if loop.time() > deadline:
                    raise ConnectionError(f"cannot reach {self.url} within {connect_timeout_s:g} s ({exc})") from None
                await asyncio.sleep(0.2)

    async def _models_once(self) -> dict:
        async with self.session.get(f"{self.url}/models", timeout=aiohttp.ClientTimeout(total=5)) as resp:
            if resp.status != 200:
                raise _error(resp.status, await resp.text())
            self.model = (await resp.json())["data"][0]["id"]
            return {"service": "openai", "policy": "", "worker_id": "", "vocab_size": 0, "max_model_len": 0}

    def generate(self, req: pb.GenerateRequest, timeout: float | None = None) -> _Call:
        return _Call(self, req, timeout)
