"""The router's model identity: it reads the tokenizer files of --model, never the weights,
and sends text only to workers that publish the same tokenizer id in their lease; a lease
without one (an older worker) is compared by checkpoint id, which the router then hashes
once, off its event loop.

Unit tests of `model_identity.tokenizer_fingerprint`, `membership.Compatibility` and the
router's lazy checkpoint id; the router in-process behind its HTTP front, with stand-in
workers and leases the test sets (chat ids checked on the fleet they are routed in, every
name of the served model and no other, a request naming a checkpoint never answered by
another, a router folder without weights, the wait's deadline and its end at shutdown, HTTP
statuses of the fleet's states, the failed hash's back-off); then real redis-server, worker and router processes on
loopback: a router whose weight file cannot be read serves text and token ids; one of
another tokenizer refuses text (gRPC, Tokenize, HTTP chat) and serves token ids; older
leases fall back to the checkpoint id, and chat and Tokenize wait for it as text does; a
router stopped while a request waits for its hash reports NOT_SERVING and stops in seconds."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import shutil
import time
import urllib.error
import urllib.request

import grpc
import pytest

from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.proto import kvmesh_pb2_grpc as pb_grpc
from kvmesh.services.membership import Compatibility
from kvmesh.workers import model_identity
from kvmesh.workers.loader import read_config, save_tiny_checkpoint
from kvmesh.workers.model_identity import (TOKENIZER_FILES, checkpoint_model_id, comparable_tokenizer_id,
                                           config_without_weights, tokenizer_fingerprint)

VOCAB = 384  # the built-in model's vocabulary, which the tiny checkpoints keep


def _write_tokenizer(folder: str, shift: int = 0) -> None:
    """A word-level tokenizer.json: word ``t{i}`` is id ``(i + shift) % VOCAB`` (0 is [UNK])."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"[UNK]": 0}
    vocab.update({f"t{i}": (i + shift) % (VOCAB - 1) + 1 for i in range(1, VOCAB)})
    raw = RawTokenizer(WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = Whitespace()
    raw.save(os.path.join(folder, "tokenizer.json"))


def _checkpoint(folder: str) -> str:
    save_tiny_checkpoint(folder, seed=0)
    _write_tokenizer(folder)
    return folder


def _tokenizer_only_copy(src: str, dst: str) -> str:
    """``src``'s config and tokenizer files in ``dst``, and in place of its weights a
    ``model.safetensors`` whose every open or stat fails (a link to nowhere)."""
    os.makedirs(dst)
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))
    os.symlink(os.path.join(dst, "no-such-file"), os.path.join(dst, "model.safetensors"))
    return dst


def _weightless_copy(src: str, dst: str) -> str:
    """``src``'s config and tokenizer files in ``dst``, and no weight file at all."""
    os.makedirs(dst)
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))
    return dst


@pytest.fixture()
def ckpt(tmp_path, monkeypatch):
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path / "cache"))
    return _checkpoint(str(tmp_path / "served"))


# ------------------------------------------------------------------ tokenizer identity
def test_tokenizer_id_covers_every_tokenizer_file_and_no_weight(ckpt, tmp_path, monkeypatch):
    base = tokenizer_fingerprint(ckpt)
    assert comparable_tokenizer_id(base) and base == tokenizer_fingerprint(ckpt)
    # the weights do not count, and are never opened
    real_open = open

    def no_weight_reads(path, *a, **kw):
        assert not str(path).endswith(".safetensors"), "weights read"
        return real_open(path, *a, **kw)
    copy = _tokenizer_only_copy(ckpt, str(tmp_path / "copy"))
    with monkeypatch.context() as patched:
        patched.setattr("builtins.open", no_weight_reads)
        assert tokenizer_fingerprint(copy) == base
        cfg = config_without_weights(copy)
    assert cfg == dataclasses.replace(read_config(ckpt), model_id="copy")
    # each file that decides token ids, stop ids or the chat rendering counts, present or not
    seen = {base}
    for name in TOKENIZER_FILES:
        path = os.path.join(copy, name)
        before = open(path, "rb").read() if os.path.isfile(path) else None
        with open(path, "ab") as fh:
            fh.write(b" ")
        changed = tokenizer_fingerprint(copy)
        assert changed not in seen, name
        seen.add(changed)
        if before is None:
            os.remove(path)
        else:
            with open(path, "wb") as fh:
                fh.write(before)
        assert tokenizer_fingerprint(copy) == base, name
    os.remove(os.path.join(copy, "config.json"))
    with pytest.raises(OSError, match="config.json"):
        tokenizer_fingerprint(copy)
    # the built-in model's byte tokenizer has an id of its own
    builtin = tokenizer_fingerprint(None)
    assert comparable_tokenizer_id(builtin) and builtin != base and "kvmesh-tiny" in builtin
    assert not comparable_tokenizer_id(None) and not comparable_tokenizer_id("tok-v0-abc") \
        and not comparable_tokenizer_id(7)


def test_checkpoint_model_id_is_the_workers_model_id(ckpt):
    assert checkpoint_model_id(ckpt) == read_config(ckpt).model_id
    assert checkpoint_model_id(ckpt + "/").startswith("served@")


# ------------------------------------------------------------------ selection
TOK, OTHER_TOK = "tok-v1-aaaa", "tok-v1-bbbb"


def lease(model="a@1", tok=TOK, bs=16):
    out = {"model_id": model, "block_size": bs, "address": "x:1"}
    if tok is not None:
        out["tokenizer_id"] = tok
    return out


def router_compat() -> Compatibility:
    compat = Compatibility(None, TOK, own_model=True, router_name="--model /m")
    compat.model_id_pending = True
    return compat


def test_workers_of_the_routers_tokenizer_need_no_checkpoint_id():
    """Another folder name, other weights: equal tokenizer ids are enough for text."""
    sel = router_compat().select({"w1": lease("served@1"), "w2": lease("served@1")})
    assert set(sel.workers) == {"w1", "w2"} and sel.model_id == "served@1"
    assert sel.text_reason == "" and not sel.needs_model_id


def test_another_tokenizer_gets_token_ids_only(caplog):
    compat = router_compat()
    with caplog.at_level(logging.ERROR, logger="kvmesh.services.membership"):
        sel = compat.select({"w1": lease("x@1", OTHER_TOK), "w2": lease("x@1", OTHER_TOK)})
        compat.select({"w1": lease("x@1", OTHER_TOK), "w2": lease("x@1", OTHER_TOK)})
    assert set(sel.workers) == {"w1", "w2"} and sel.model_id == "x@1" and not sel.needs_model_id
    assert "--model" in sel.text_reason and "token_ids" in sel.text_reason
    assert "/m" not in sel.text_reason  # the router's path is for its log, not for clients
    refused = [r.getMessage() for r in caplog.records if "text prompts refused" in r.getMessage()]
    assert len(refused) == 1 and "--model /m" in refused[0]  # once per change
    # workers of the router's tokenizer come first, whatever the majority serves
    sel = compat.select({"w1": lease("x@1", OTHER_TOK), "w2": lease("x@1", OTHER_TOK), "w3": lease("a@1")})
    assert set(sel.workers) == {"w3"} and sel.text_reason == ""
    assert "'x@1'" in compat.reason("w1") and "--model" in compat.reason("w1")


def test_an_older_lease_is_compared_by_checkpoint_id():
    compat = router_compat()
    old = {"w1": lease("served@1", tok=None)}
    sel = compat.select(old)
    assert sel.needs_model_id and set(sel.workers) == {"w1"}  # token ids may go meanwhile
    assert "still hashing" in sel.text_reason
    compat.router_model_id, compat.model_id_pending = "served@1", False
    sel = compat.select(old)
    assert not sel.needs_model_id and sel.text_reason == ""
    compat.router_model_id = "served@2"  # another checkpoint: its tokenizer is not known to match
    sel = compat.select(old)
    assert set(sel.workers) == {"w1"} and "--model" in sel.text_reason
    # the id could not be computed: older workers get token ids only, and the reason says why
    compat.router_model_id, compat.model_id_problem = None, "No such file or directory: '/m/model.safetensors'"
    sel = compat.select(old)
    assert not sel.needs_model_id and "older kvmesh" in sel.text_reason and "token_ids" in sel.text_reason
    assert "router's log" in sel.text_reason
    assert "/m" not in sel.text_reason and "No such file" not in sel.text_reason  # for the log only
    # another recipe version of the tokenizer id counts as none
    assert compat.speaks(lease("served@1", tok="tok-v9-aaaa")) is None
    # an older lease of a model id that a current lease vouches for shares its tokenizer
    compat.model_id_pending = True
    sel = compat.select({"w1": lease("served@1", tok=None), "w2": lease("served@1")})
    assert set(sel.workers) == {"w1", "w2"} and sel.text_reason == "" and not sel.needs_model_id


def test_several_checkpoints_of_the_routers_tokenizer_pick_the_routers_own():
    """Two checkpoints share the router's tokenizer: the router's own checkpoint decides, as
    when it hashed its weights at start; until its id is known, the majority serves."""
    compat = router_compat()
    live = {"w1": lease("new@2"), "w2": lease("new@2"), "w3": lease("own@1")}
    sel = compat.select(live)
    assert sel.needs_model_id and sel.model_id == "new@2"
    compat.router_model_id, compat.model_id_pending = "own@1", False
    sel = compat.select(live)
    assert set(sel.workers) == {"w3"} and sel.model_id == "own@1" and sel.text_reason == ""
    assert "another checkpoint of the same tokenizer" in compat.reason("w1")


def test_a_router_without_model_follows_the_majority_and_names_its_own_tokenizer():
    tiny = model_identity.tokenizer_fingerprint(None)
    compat = Compatibility("kvmesh-tiny-llama-v2", tiny, own_model=False, router_name="the built-in model")
    sel = compat.select({"w1": lease("kvmesh-tiny-llama-v2", tiny), "w2": lease("kvmesh-tiny-llama-v2", None)})
    assert set(sel.workers) == {"w1", "w2"} and sel.text_reason == ""
    sel = compat.select({"w1": lease("x@1", OTHER_TOK), "w2": lease("x@1", OTHER_TOK),
                         "w3": lease("kvmesh-tiny-llama-v2", tiny)})
    assert set(sel.workers) == {"w1", "w2"} and "the built-in model" in sel.text_reason


# ------------------------------------------------------------------ the lazy checkpoint id
def test_checkpoint_id_is_computed_once_off_the_loop_and_retried_after_a_failure(ckpt, tmp_path, monkeypatch):
    from kvmesh.services import router as router_mod

    calls, results = [], []
    real = router_mod.checkpoint_model_id

    def slow(model_dir):
        calls.append(model_dir)
        time.sleep(0.3)
        return real(model_dir)
    monkeypatch.setattr(router_mod, "checkpoint_model_id", slow)

    async def main():
        lazy = router_mod._CheckpointId(ckpt, lambda value, problem: results.append((value, problem)))
        assert lazy.pending()
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1
        ticker = asyncio.get_running_loop().create_task(tick())
        first, second = lazy.start(), lazy.start()
        assert first is second  # one computation for every caller
        values = await asyncio.gather(first, second)
        ticker.cancel()
        assert ticks >= 5  # the loop ran while the weights were hashed
        assert lazy.start() is None and not lazy.pending()
        return values, lazy
    values, lazy = asyncio.run(main())
    assert values == [read_config(ckpt).model_id] * 2 and len(calls) == 1
    assert results == [(values[0], "")]

    broken = _tokenizer_only_copy(ckpt, str(tmp_path / "broken"))

    async def failing():
        lazy = router_mod._CheckpointId(broken, lambda value, problem: results.append((value, problem)))
        assert await lazy.start() is None
        assert lazy.problem and not lazy.pending() and lazy.start() is None  # not again at once
        lazy._failed_at -= lazy.RETRY_S
        assert lazy.pending()  # but after RETRY_S
        retry = lazy.start()
        assert retry is not None and await retry is None
    asyncio.run(failing())
    assert len(results) == 3 and results[1][0] is None and "model.safetensors" in results[1][1]


def test_a_folder_without_weight_files_has_no_checkpoint_id(ckpt, tmp_path):
    """Config and tokenizer files alone would hash to an id no worker has: it fails instead."""
    bare = _weightless_copy(ckpt, str(tmp_path / "bare"))
    with pytest.raises(model_identity.NoWeightFiles, match="no weight files"):
        checkpoint_model_id(bare)
    assert tokenizer_fingerprint(bare) == tokenizer_fingerprint(ckpt)  # the router still starts on it


# ------------------------------------------------------------------ the router in-process
class _Leases:
    """Stands in for the router's `IndexSubscriber`: the live leases, set by the test."""

    def __init__(self, live: dict):
        self.live, self.live_version = dict(live), 0

    def live_workers(self) -> dict:
        return dict(self.live)

    def set(self, live: dict) -> None:
        self.live, self.live_version = dict(live), self.live_version + 1


class _StandIn(pb_grpc.WorkerServicer):
    """A worker stand-in (gRPC on loopback, in the test's event loop): records each Generate
    and answers one token, or refuses with ``refuse`` as a worker of another model does."""

    def __init__(self, worker_id: str, refuse: str = ""):
        self.worker_id, self.refuse = worker_id, refuse
        self.requests: list = []
        self.server, self.address = None, ""

    async def Generate(self, request, context):
        self.requests.append(request)
        if self.refuse:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, self.refuse)
        yield pb.GenerateResponse(token_ids=[5], text="x", finished=True, finish_reason="length",
                                  worker_id=self.worker_id,
                                  usage=pb.Usage(prompt_tokens=len(request.token_ids.ids), completion_tokens=1))

    async def start(self) -> "_StandIn":
        self.server = grpc.aio.server()
        pb_grpc.add_WorkerServicer_to_server(self, self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        await self.server.start()
        return self

    def lease(self, model: str, tok) -> dict:
        return dict(lease(model, tok), address=self.address)

    async def stop(self) -> None:
        await self.server.stop(None)


def _router(model_dir: str, live: dict):
    from kvmesh.services.cluster_index import ClusterIndex
    from kvmesh.services.router import RouterServicer

    return RouterServicer(ClusterIndex(), _Leases(live), model_dir=model_dir, seed=0)


async def _front(router, generate=None, tokenizer=None):
    """An HTTP front on a free port, in front of ``router`` (or ``generate``), as the router
    process starts it; returns (front, base URL)."""
    from kvmesh.services.http_front import HttpFront

    front = HttpFront(generate or router.Generate, tokenizer or router.tokenizer, router.config.model_id,
                      model_dir=router.model_dir, max_model_len=router.config.max_position_embeddings)
    router.http_fronts = [front]
    port = await front.start("127.0.0.1", 0)
    return front, f"http://127.0.0.1:{port}/v1"


async def _post(url: str, body: dict) -> tuple[int, dict]:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=120)) as resp:
            return resp.status, await resp.json()


async def _get(url: str) -> tuple[int, dict]:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=60)) as resp:
            return resp.status, await resp.json()


class _SwapsOnEncode:
    """A tokenizer that runs ``swap`` (the fleet changes) each time it has encoded."""

    def __init__(self, tokenizer, swap):
        self._tok, self._swap = tokenizer, swap

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def encode(self, text, **kwargs):
        ids = self._tok.encode(text, **kwargs)
        self._swap()
        return ids


def test_chat_ids_are_checked_on_the_fleet_they_are_routed_in(ckpt):
    """The last worker of the router's tokenizer leaves between the chat prompt's tokenization
    and its Generate: the router's ids are refused as text would be (400), never sent to the
    worker of another tokenizer; token ids a client sends still go there."""
    async def main():
        same, other = await _StandIn("same").start(), await _StandIn("other").start()
        router = _router(ckpt, {})
        mine = router.tokenizer_id
        router.subscriber.set({"same": same.lease("served@1", mine)})
        after = {"other": other.lease("x@1", OTHER_TOK)}
        front, url = await _front(router, tokenizer=_SwapsOnEncode(router.tokenizer,
                                                                   lambda: router.subscriber.set(after)))
        try:
            assert router.text_refusal() == ""  # the fleet as the chat request starts
            ids = router.tokenizer.encode("t5 t6 t7")
            chat = await _post(f"{url}/chat/completions", CHAT)
            router.subscriber.set(after)
            by_ids = await _post(f"{url}/completions", {"prompt": ids, "max_tokens": 1})
            text = await _post(f"{url}/completions", {"prompt": "t5 t6 t7", "max_tokens": 1})
        finally:
            await front.stop()
            await router.close()
            await same.stop()
            await other.stop()
        return chat, by_ids, text, ids, same.requests, other.requests
    chat, by_ids, text, ids, to_same, to_other = asyncio.run(main())
    code, body = chat
    assert code == 400 and body["error"]["code"] == "failed_precondition", chat
    assert body["error"]["message"] == text[1]["error"]["message"]  # the refusal text gets
    assert "--model" in body["error"]["message"] and "token_ids" in body["error"]["message"]
    assert by_ids[0] == 200 and by_ids[1]["usage"]["kvmesh"]["worker_id"] == "other", by_ids
    assert to_same == [] and [list(r.token_ids.ids) for r in to_other] == [ids]  # the client's ids only


def test_the_http_front_answers_to_every_name_of_the_served_model(ckpt):
    """Before the leases are read the front lists the router's folder name; after, the
    workers' checkpoint id. A client that used either, or the compute-tagged id the workers
    publish, or the workers' name before "@", reaches the same model; another name is 404."""
    async def generate(req, ctx):
        yield pb.GenerateResponse(token_ids=[5], text="x", finished=True, finish_reason="length",
                                  usage=pb.Usage(prompt_tokens=1, completion_tokens=1))

    async def main():
        router = _router(ckpt, {})
        tagged = "other-name@abc+compute=float32"
        router.subscriber.set({"w1": dict(lease(tagged, router.tokenizer_id))})
        front, url = await _front(router, generate=generate)
        out = {}
        try:
            def body(model):
                return {"model": model, "prompt": "t1", "max_tokens": 1}
            out["listed before"] = await _get(f"{url}/models")
            out["folder before"] = await _post(f"{url}/completions", body("served"))
            router._fleet()  # what a request or the fleet follower does once the leases are read
            out["listed after"] = await _get(f"{url}/models")
            for name in ("served", "other-name", "other-name@abc", tagged):
                out[name] = await _post(f"{url}/completions", body(name))
                out["GET " + name] = await _get(f"{url}/models/{name}")
            for name in ("elsewhere", "other-name@abd", "served@abc"):
                out[name] = await _post(f"{url}/completions", body(name))
        finally:
            await front.stop()
            await router.close()
        return out
    out = asyncio.run(main())
    assert [m["id"] for m in out["listed before"][1]["data"]] == ["served"]
    assert out["folder before"][0] == 200 and out["folder before"][1]["model"] == "served"
    assert [m["id"] for m in out["listed after"][1]["data"]] == ["other-name@abc"]
    for name in ("served", "other-name", "other-name@abc", "other-name@abc+compute=float32"):
        assert out[name][0] == 200 and out[name][1]["model"] == "other-name@abc", (name, out[name])
        assert out["GET " + name] == (200, dict(out["GET " + name][1], id="other-name@abc")), out["GET " + name]
    for name in ("elsewhere", "other-name@abd", "served@abc"):
        assert out[name][0] == 404 and out[name][1]["error"]["code"] == "model_not_found", (name, out[name])


def test_a_router_without_weights_tells_text_for_older_workers_why_and_what_to_do(ckpt, tmp_path, caplog):
    """Workers that publish no tokenizer id, a router folder of config and tokenizer files only
    (identical to the workers'): text is refused saying that the folder has no weights to
    compare with, not that the tokenizers differ; token ids are served."""
    async def main():
        worker = await _StandIn("old").start()
        router = _router(_weightless_copy(ckpt, str(tmp_path / "bare")),
                         {"old": worker.lease(read_config(ckpt).model_id, None)})
        front, url = await _front(router)
        try:
            out = {"chat": await _post(f"{url}/chat/completions", CHAT),
                   "text": await _post(f"{url}/completions", {"prompt": "t5 t6", "max_tokens": 1}),
                   "ids": await _post(f"{url}/completions", {"prompt": [5, 6], "max_tokens": 1})}
        finally:
            await front.stop()
            await router.close()
            await worker.stop()
        return out
    with caplog.at_level(logging.ERROR):
        out = asyncio.run(main())
    for name in ("chat", "text"):
        code, body = out[name]
        message = body["error"]["message"]
        assert code == 400 and body["error"]["code"] == "failed_precondition", (name, out[name])
        assert "no weight files" in message and "upgrade those workers" in message and \
            "full checkpoint" in message and "token_ids" in message, message
        assert "tokenizer files differ" not in message and "still hashing" not in message, message
    assert out["ids"][0] == 200, out["ids"]
    assert "holds no weight files" in caplog.text


def test_a_wait_for_the_checkpoint_id_ends_at_the_requests_deadline(ckpt, monkeypatch):
    """While the router hashes its checkpoint for an older lease, chat (as text) waits, and
    no longer than the request's deadline: then 504, and token ids are served meanwhile."""
    release = _held_hash(monkeypatch)

    async def main():
        worker = await _StandIn("old").start()
        router = _router(ckpt, {"old": worker.lease(read_config(ckpt).model_id, None)})
        front, url = await _front(router)
        front.timeout_s = 1.0
        try:
            chat = await _post(f"{url}/chat/completions", CHAT)
            ids = await _post(f"{url}/completions", {"prompt": [5, 6], "max_tokens": 1})
            release.set()
            await asyncio.wait_for(asyncio.shield(router.checkpoint_id.start() or asyncio.sleep(0)), 60)
            front.timeout_s = 60.0
            after = await _post(f"{url}/chat/completions", CHAT)
        finally:
            release.set()
            await front.stop()
            await router.close()
            await worker.stop()
        return chat, ids, after, worker.requests
    chat, ids, after, sent = asyncio.run(main())
    assert chat[0] == 504 and "hashed its checkpoint" in chat[1]["error"]["message"], chat
    assert ids[0] == 200 and after[0] == 200, (ids, after)
    assert len(sent) == 2  # the token ids, then the chat prompt once the ids compare equal


def test_no_usable_worker_is_unavailable_and_a_stale_lease_is_routed_around(ckpt):
    """The fleet's states are 503s, not the client's fault: no worker of the router's model
    to dial, and a worker that refuses the model its lease names (it restarted with another
    --model and its lease is not renewed yet), which the router routes around."""
    async def main():
        stale = await _StandIn("stale", refuse="request is for model 'served@1' but worker stale serves "
                                               "'new@2': send model_id 'new@2' or leave it empty").start()
        good = await _StandIn("good").start()
        router = _router(ckpt, {})
        mine = router.tokenizer_id
        front, url = await _front(router)
        body = {"prompt": [5, 6], "max_tokens": 1}
        out = {}
        try:
            router.subscriber.set({"far": {k: v for k, v in lease("served@1", mine).items() if k != "address"}})
            out["no address"] = await _post(f"{url}/completions", body)
            router.subscriber.set({"stale": stale.lease("served@1", mine)})
            out["stale alone"] = await _post(f"{url}/completions", body)
            router.subscriber.set({"stale": stale.lease("served@1", mine), "good": good.lease("served@1", mine)})
            for i in range(4):
                out[f"both {i}"] = await _post(f"{url}/completions", body)
        finally:
            await front.stop()
            await router.close()
            await stale.stop()
            await good.stop()
        return out
    out = asyncio.run(main())
    code, body = out["no address"]
    assert code == 503 and body["error"]["code"] == "unavailable", out["no address"]
    code, body = out["stale alone"]
    assert code == 503 and "no longer serves the model its lease names" in body["error"]["message"], out
    for i in range(4):
        code, body = out[f"both {i}"]
        assert code == 200 and body["usage"]["kvmesh"]["worker_id"] == "good", (i, out[f"both {i}"])


def _held_hash(monkeypatch):
    """Makes the router's checkpoint hash wait until the returned event is set."""
    import threading

    from kvmesh.services import router as router_mod

    release = threading.Event()
    real = router_mod.checkpoint_model_id

    def slow(model_dir):
        release.wait(120)
        return real(model_dir)
    monkeypatch.setattr(router_mod, "checkpoint_model_id", slow)
    return release


def test_a_request_naming_a_checkpoint_is_never_answered_by_another(ckpt, monkeypatch):
    """Workers of two checkpoints of the router's tokenizer, the router's id not known yet: the
    majority's checkpoint is served meanwhile. A request naming it by its full id waits for the
    router's id like any other; when the fleet then flips to the router's own checkpoint, the
    request is refused 404, not answered by the other checkpoint. Naming the router's own
    checkpoint, or no model, is served."""
    release = _held_hash(monkeypatch)

    async def main():
        own_id = read_config(ckpt).model_id
        majority = own_id.partition("@")[0] + "@9d51ac0ccd1d"
        a, b, own = (await _StandIn("a").start(), await _StandIn("b").start(), await _StandIn("own").start())
        router = _router(ckpt, {})
        mine = router.tokenizer_id
        router.subscriber.set({"a": a.lease(majority, mine), "b": b.lease(majority, mine),
                               "own": own.lease(own_id, mine)})
        front, url = await _front(router)
        out = {}
        try:
            router._fleet()  # the leases are read: the majority's checkpoint is listed meanwhile
            out["listed"] = await _get(f"{url}/models")
            waiting = asyncio.get_running_loop().create_task(
                _post(f"{url}/completions", {"model": majority, "prompt": [5, 6], "max_tokens": 1}))
            await asyncio.sleep(0.5)
            release.set()
            out["majority"] = await asyncio.wait_for(waiting, 60)
            out["own"] = await _post(f"{url}/completions", {"model": own_id, "prompt": [5, 6], "max_tokens": 1})
            out["any"] = await _post(f"{url}/completions", {"prompt": [5, 6], "max_tokens": 1})
        finally:
            release.set()
            await front.stop()
            await router.close()
            for w in (a, b, own):
                await w.stop()
        return out, majority, own_id, a.requests + b.requests, own.requests
    out, majority, own_id, to_majority, to_own = asyncio.run(main())
    assert [m["id"] for m in out["listed"][1]["data"]] == [majority], out["listed"]
    code, body = out["majority"]
    assert code == 404 and majority in body["error"]["message"], out["majority"]
    assert to_majority == []
    assert out["own"][0] == 200 and out["any"][0] == 200, out
    assert [r.model_id for r in to_own] == [own_id, own_id]  # what the router hashes and forwards under


def test_the_http_front_answers_only_to_names_of_the_model_it_serves(ckpt):
    """No worker shares the router's tokenizer: the router's folder name is not the served
    model, so the front answers 404 to it (text would be refused, and token ids would be
    served by another model). A checkpoint's name before "@" names it only while no other
    live checkpoint has that name."""
    async def main():
        x1, x2 = await _StandIn("x1").start(), await _StandIn("x2").start()
        router = _router(ckpt, {"x1": x1.lease("x@1", OTHER_TOK)})
        front, url = await _front(router)
        out = {}
        ids = {"prompt": [5, 6], "max_tokens": 1}
        try:
            router._fleet()
            out["folder"] = await _post(f"{url}/completions", dict(ids, model="served"))
            out["GET folder"] = await _get(f"{url}/models/served")
            out["x"] = await _post(f"{url}/completions", dict(ids, model="x"))
            out["x@1"] = await _post(f"{url}/completions", dict(ids, model="x@1"))
            # two checkpoints named x: "x" would name either
            router.subscriber.set({"x1": x1.lease("x@1", OTHER_TOK), "x1b": x1.lease("x@1", OTHER_TOK),
                                   "x2": x2.lease("x@2", OTHER_TOK)})
            router._fleet()
            out["x of two"] = await _post(f"{url}/completions", dict(ids, model="x"))
            out["GET x of two"] = await _get(f"{url}/models/x")
            out["x@1 of two"] = await _post(f"{url}/completions", dict(ids, model="x@1"))
        finally:
            await front.stop()
            await router.close()
            await x1.stop()
            await x2.stop()
        return out
    out = asyncio.run(main())
    for name in ("folder", "GET folder", "x of two", "GET x of two"):
        assert out[name][0] == 404, (name, out[name])
    for name in ("x", "x@1", "x@1 of two"):
        assert out[name][0] == 200 and out[name][1]["model"] == "x@1", (name, out[name])


def test_a_failed_hash_is_retried_ever_later_and_logged_at_each_step(ckpt, tmp_path, caplog):
    """Each attempt reads every weight file: after a failure the wait before the next doubles
    from RETRY_S up to MAX_RETRY_S, and only the first failure and each longer wait are
    errors in the log; a success ends it."""
    from kvmesh.services import router as router_mod

    broken = _tokenizer_only_copy(ckpt, str(tmp_path / "broken"))

    async def main():
        lazy = router_mod._CheckpointId(broken, lambda value, problem: None)
        waits = []
        for _ in range(9):
            assert lazy.pending()
            assert await lazy.start() is None
            waits.append(lazy.retry_s)
            lazy._failed_at -= lazy.retry_s - 1
            assert not lazy.pending() and lazy.start() is None  # not a second sooner
            lazy._failed_at -= 1
        return waits
    with caplog.at_level(logging.WARNING, logger="kvmesh.services.router"):
        waits = asyncio.run(main())
    assert waits == [60, 120, 240, 480, 960, 1920, 3600, 3600, 3600], waits
    levels = [r.levelno for r in caplog.records if "could not hash" in r.getMessage()]
    assert levels == [logging.ERROR] * 7 + [logging.WARNING] * 2, levels

    async def recovers():
        lazy = router_mod._CheckpointId(broken, lambda value, problem: None)
        await lazy.start()
        lazy._failed_at -= lazy.retry_s
        os.remove(os.path.join(broken, "model.safetensors"))
        shutil.copy(os.path.join(ckpt, "model.safetensors"), os.path.join(broken, "model.safetensors"))
        value = await lazy.start()
        return value, lazy
    value, lazy = asyncio.run(recovers())
    assert value and lazy.retry_s == 0 and not lazy.pending() and lazy.start() is None


def test_a_request_waiting_for_the_checkpoint_id_ends_at_once_when_the_router_stops(ckpt, monkeypatch):
    """A shutdown while a chat request waits for the router's checkpoint hash: the wait ends
    UNAVAILABLE (503) at once, so the HTTP front stops in a moment, not after its handlers'
    minute; token ids were served meanwhile."""
    release = _held_hash(monkeypatch)

    async def main():
        worker = await _StandIn("old").start()
        router = _router(ckpt, {"old": worker.lease(read_config(ckpt).model_id, None)})
        front, url = await _front(router)
        try:
            waiting = asyncio.get_running_loop().create_task(_post(f"{url}/chat/completions", CHAT))
            ids = await _post(f"{url}/completions", {"prompt": [5, 6], "max_tokens": 1})
            await asyncio.sleep(0.3)
            began = time.monotonic()
            router.begin_shutdown()
            chat = await asyncio.wait_for(waiting, 30)
            await front.stop()
            took = time.monotonic() - began
        finally:
            release.set()
            await front.stop()
            await router.close()
            await worker.stop()
        return ids, chat, took
    ids, chat, took = asyncio.run(main())
    assert ids[0] == 200, ids
    assert chat[0] == 503 and "shutting down" in chat[1]["error"]["message"], chat
    assert took < 20, took


# ------------------------------------------------------------------ real processes
@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """redis-server and one worker on a tiny checkpoint with a tokenizer.json (cluster
    ``ident``); yields a dict of what the tests need."""
    from kvmesh.services.procs import RedisServer, free_port, python_cmd, spawn, stop_process, wait_healthy

    tmp = tmp_path_factory.mktemp("ident")
    env = {"KVMESH_CACHE_DIR": str(tmp / "worker-cache")}
    served = _checkpoint(str(tmp / "served"))
    redis = RedisServer()
    procs = []
    try:
        port = free_port()
        waddr = f"127.0.0.1:{port}"
        procs.append(spawn(python_cmd("worker", "--port", str(port), "--worker-id", "w0", "--threads", "1",
                                      "--model", served, "--num-blocks", "128", "--compute-dtype", "model",
                                      "--redis-url", redis.url, "--cluster", "ident"), str(tmp / "w0.log"), env=env))
        wait_healthy(waddr, proc=procs[-1], timeout=180)
        yield {"tmp": tmp, "served": served, "redis": redis, "worker": waddr, "procs": procs}
    finally:
        for p in procs:
            stop_process(p)
        redis.stop()


def _start_router(cluster, name: str, model_dir: str, cluster_name: str = "ident", http: bool = False):
    """A router process on ``model_dir`` with an empty digest cache; returns (address, http
    port or None, log path)."""
    from kvmesh.services.procs import free_port, python_cmd, spawn, wait_healthy

    port = free_port()
    args = ["--log-level", "info", "router", "--port", str(port), "--model", model_dir,
            "--redis-url", cluster["redis"].url, "--cluster", cluster_name]
    http_port = None
    if http:
        http_port = free_port()
        args += ["--http-port", str(http_port)]
    log_path = str(cluster["tmp"] / f"{name}.log")
    cluster["procs"].append(spawn(python_cmd(*args), log_path,
                                  env={"KVMESH_CACHE_DIR": str(cluster["tmp"] / f"{name}-cache")}))
    address = f"127.0.0.1:{port}"
    wait_healthy(address, proc=cluster["procs"][-1], timeout=120)
    return address, http_port, log_path


def _wait_routed(address: str, worker_id: str, timeout: float = 60.0) -> dict:
    """The router's status once it routes to ``worker_id``."""
    from kvmesh.services.ops_cli import router_status

    deadline = time.monotonic() + timeout
    while True:
        status = router_status(address)
        row = next((w for w in status["workers"] if w["worker_id"] == worker_id), None)
        if row is not None and not row.get("routed_around"):
            return status
        assert time.monotonic() < deadline, status
        time.sleep(0.2)


def _http(port: int, path: str, body: dict | None = None, timeout: float = 60.0) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method="POST" if body is not None else "GET",
                                 data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


PROMPT = " ".join(f"t{(7 * i) % 300 + 1}" for i in range(40))  # 40 words: 40 ids, two full blocks
CHAT = {"messages": [{"role": "user", "content": "t5 t6 t7"}], "max_tokens": 2, "temperature": 0}


def test_a_router_without_readable_weights_serves_text_and_token_ids(cluster):
    """The router's --model folder holds config.json and tokenizer.json under another name,
    and a weight file that cannot even be opened: it starts, never reads the weights, and
    routes text (gRPC and HTTP chat) and token ids to the worker, with the worker's own
    token ids; its HTTP front names the workers' model."""
    from kvmesh.services.client import KvmeshClient

    folder = _tokenizer_only_copy(cluster["served"], str(cluster["tmp"] / "tokenizer-only"))
    t0 = time.monotonic()
    raddr, http_port, log_path = _start_router(cluster, "r-tok", folder, http=True)
    print(f"router healthy {time.monotonic() - t0:.1f} s after spawn")
    _wait_routed(raddr, "w0")
    with KvmeshClient(cluster["worker"]) as w, KvmeshClient(raddr, retries=5, backoff_s=0.2) as r:
        expected_ids = w.tokenize(PROMPT)
        assert r.tokenize(PROMPT) == expected_ids and len(expected_ids) == 40
        direct = w.generate(PROMPT, max_tokens=3, temperature=0.0, timeout=60)
        text = r.generate(PROMPT, max_tokens=3, temperature=0.0, timeout=60)
        ids = r.generate(token_ids=expected_ids, max_tokens=3, temperature=0.0, timeout=60)
    assert text.worker_id == ids.worker_id == "w0"
    assert text.token_ids == ids.token_ids == direct.token_ids
    assert text.usage.prompt_tokens == 40 and ids.usage.cached_tokens >= 32  # the same blocks: same namespace
    code, models = _http(http_port, "/v1/models")
    served_id = _worker_model_id(cluster)
    assert served_id.startswith("served@")  # not the router's folder name
    assert code == 200 and [m["id"] for m in models["data"]] == [served_id], models
    code, body = _http(http_port, "/v1/chat/completions", dict(CHAT, model=served_id))
    assert code == 200, body
    assert body["model"] == served_id and body["usage"]["completion_tokens"] == 2
    # the name the front served before it read the leases (the router's folder), and the
    # workers' name before "@", stay names of the same model; another is still unknown
    for name in ("tokenizer-only", "served"):
        code, body = _http(http_port, "/v1/chat/completions", dict(CHAT, model=name))
        assert code == 200 and body["model"] == served_id, (name, code, body)
    code, body = _http(http_port, "/v1/chat/completions", dict(CHAT, model="served@000000000000"))
    assert code == 404 and body["error"]["code"] == "model_not_found", body
    with open(log_path) as fh:
        log_text = fh.read()
    assert "hashing the weight files" not in log_text and "could not hash" not in log_text, log_text
    assert os.path.islink(os.path.join(folder, "model.safetensors"))


def _worker_model_id(cluster) -> str:
    """The checkpoint id the worker serves (no compute tag: it computes in the checkpoint's dtype)."""
    with grpc.insecure_channel(cluster["worker"]) as ch:
        return pb_grpc.WorkerStub(ch).GetInfo(pb.WorkerInfoRequest(), timeout=10).model_id


def test_a_router_of_another_tokenizer_refuses_text_and_serves_token_ids(cluster):
    from kvmesh.services.client import KvmeshClient

    folder = _tokenizer_only_copy(cluster["served"], str(cluster["tmp"] / "other-tokenizer"))
    _write_tokenizer(folder, shift=1)  # every word another id
    raddr, http_port, _ = _start_router(cluster, "r-other", folder, http=True)
    _wait_routed(raddr, "w0")  # token ids still go there
    with KvmeshClient(cluster["worker"]) as w, KvmeshClient(raddr, retries=5, backoff_s=0.2) as r:
        ids = w.tokenize(PROMPT)
        with pytest.raises(grpc.RpcError) as err:
            r.generate(PROMPT, max_tokens=2, temperature=0.0, timeout=60)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "--model" in err.value.details() and "token_ids" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            r.tokenize(PROMPT)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        out = r.generate(token_ids=ids, max_tokens=2, temperature=0.0, timeout=60)
        assert out.worker_id == "w0" and out.usage.completion_tokens == 2
    # a chat prompt reaches the router as token ids of its own tokenizer: refused before that
    code, body = _http(http_port, "/v1/chat/completions", CHAT)
    assert body["error"]["code"] == "failed_precondition" and "--model" in body["error"]["message"], (code, body)
    assert code == 400 and body["error"]["type"] == "invalid_request_error"  # the client can send token ids
    code, body = _http(http_port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
    assert code == 400 and body["error"]["code"] == "failed_precondition", (code, body)
    code, body = _http(http_port, "/v1/completions", {"prompt": ids, "max_tokens": 2, "temperature": 0})
    assert code == 200 and body["usage"]["completion_tokens"] == 2, body


def _older_worker_lease(cluster, cluster_name: str):
    """A lease without tokenizer_id (as an older worker writes) naming the real worker w0, in
    cluster ``cluster_name``; returns the `WorkerLease` (close it) and w0's own lease."""
    import redis as redis_lib

    from kvmesh.workers.kv_publisher import WorkerLease, lease_key

    client = redis_lib.Redis.from_url(cluster["redis"].url)
    current = json.loads(client.get(lease_key("w0", "ident")))
    client.close()
    info = {k: v for k, v in current.items() if k not in ("tokenizer_id", "worker_id", "address", "instance",
                                                           "load", "ts", "kv_seq", "kv_epoch")}
    old = WorkerLease(cluster["redis"].url, "old0", cluster["worker"], info, lambda: current.get("load") or {},
                      cluster=cluster_name, ttl_s=10.0, interval_s=1.0)
    return old, current


def _count_checkpoint_waits(monkeypatch, router_mod) -> list:
    """Patch the router's wait for its checkpoint id to count its callers (one entry each)."""
    waits = []
    real_wait = router_mod.RouterServicer._wait_checkpoint_id

    async def counted_wait(self, *args, **kwargs):
        waits.append(1)
        return await real_wait(self, *args, **kwargs)
    monkeypatch.setattr(router_mod.RouterServicer, "_wait_checkpoint_id", counted_wait)
    return waits


def _router_thread(cluster, router_mod, port: int, http_port: int, cluster_name: str):
    """A thread that serves a router in this process as ``kvmesh router`` does (not started);
    ``state`` gets its ``loop`` and ``stop`` event once it runs, and ``error`` if it raised."""
    import threading

    state: dict = {}

    def serve():
        async def main():
            state["loop"], state["stop"] = asyncio.get_running_loop(), asyncio.Event()
            await router_mod.serve_router(port, cluster["redis"].url, model_dir=cluster["served"],
                                          cluster=cluster_name, stop=state["stop"], http_port=http_port)
        try:
            asyncio.run(main())
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            state["error"] = exc
    return threading.Thread(target=serve, name="router", daemon=True), state


def test_an_older_workers_lease_falls_back_to_the_checkpoint_id(cluster):
    """A lease without tokenizer_id (as an older worker writes) in a cluster of its own,
    naming the real worker: a router with the real checkpoint hashes its weights once, after
    start, and then serves text; one whose weights cannot be read serves token ids only."""
    from kvmesh.services.client import KvmeshClient

    old, current = _older_worker_lease(cluster, "ident-old")
    assert comparable_tokenizer_id(current["tokenizer_id"])
    try:
        good, _, good_log = _start_router(cluster, "r-old-good", cluster["served"], cluster_name="ident-old")
        broken = _tokenizer_only_copy(cluster["served"], str(cluster["tmp"] / "old-broken"))
        bad, _, bad_log = _start_router(cluster, "r-old-bad", broken, cluster_name="ident-old")
        for address in (good, bad):
            _wait_routed(address, "old0")
        with KvmeshClient(cluster["worker"]) as w:
            ids = w.tokenize(PROMPT)
            direct = w.generate(PROMPT, max_tokens=2, temperature=0.0, timeout=60)
        with KvmeshClient(good, retries=5, backoff_s=0.2) as r:
            out = r.generate(PROMPT, max_tokens=2, temperature=0.0, timeout=120)
            assert out.token_ids == direct.token_ids  # the stream names the process: w0
            assert r.generate(PROMPT, max_tokens=2, temperature=0.0, timeout=60).token_ids == direct.token_ids
        with open(good_log) as fh:
            text = fh.read()
        assert text.count("hashing the weight files") == 1 and f"router's checkpoint id: {current['model_id']}" \
            in text, text
        with KvmeshClient(bad, retries=5, backoff_s=0.2) as r:
            with pytest.raises(grpc.RpcError) as err:
                r.generate(PROMPT, max_tokens=2, temperature=0.0, timeout=120)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            details = err.value.details()
            assert "older kvmesh" in details and "router's log" in details and "token_ids" in details, details
            assert "model.safetensors" not in details and broken not in details, details  # the log has them
            out = r.generate(token_ids=ids, max_tokens=2, temperature=0.0, timeout=60)
            assert out.token_ids == direct.token_ids
        with open(bad_log) as fh:
            text = fh.read()
        assert "could not hash the router's checkpoint" in text and "model.safetensors" in text, text
    finally:
        old.close()


def test_chat_and_tokenize_wait_for_the_routers_checkpoint_id_as_text_does(cluster, monkeypatch):
    """An older worker's lease (no tokenizer id) and a router whose checkpoint takes long to
    hash: HTTP chat, gRPC Tokenize and text Generate all wait for its id (none is refused
    meanwhile), and are answered once it is known. The router runs in this process, serving
    as ``kvmesh router`` does, so that its hashing can be held until every request waits."""
    import threading

    from kvmesh.services import router as router_mod
    from kvmesh.services.client import KvmeshClient
    from kvmesh.services.procs import free_port, wait_healthy

    monkeypatch.setenv("KVMESH_CACHE_DIR", str(cluster["tmp"] / "in-process-cache"))
    release, hashing = threading.Event(), threading.Event()
    real_id = router_mod.checkpoint_model_id

    def slow_id(model_dir):
        hashing.set()
        release.wait(600)
        return real_id(model_dir)
    monkeypatch.setattr(router_mod, "checkpoint_model_id", slow_id)
    waits = _count_checkpoint_waits(monkeypatch, router_mod)
    old, current = _older_worker_lease(cluster, "ident-slow")
    port, http_port = free_port(), free_port()
    raddr = f"127.0.0.1:{port}"
    server, state = _router_thread(cluster, router_mod, port, http_port, "ident-slow")
    results: dict = {}

    def call(name, fn):
        try:
            results[name] = fn()
        except Exception as exc:  # noqa: BLE001 - reported by the test
            results[name] = exc

    def tokenize():
        with KvmeshClient(raddr) as r:
            return r.tokenize(PROMPT, timeout=300)

    def text():
        with KvmeshClient(raddr) as r:
            return r.generate(PROMPT, max_tokens=2, temperature=0.0, timeout=300)
    try:
        server.start()
        wait_healthy(raddr, timeout=120)
        _wait_routed(raddr, "old0")  # token ids may go there while the id is unknown
        with KvmeshClient(cluster["worker"]) as w:
            expected_ids = w.tokenize(PROMPT)
            direct = w.generate(PROMPT, max_tokens=2, temperature=0.0, timeout=60)
        callers = [threading.Thread(target=call, args=(name, fn), daemon=True) for name, fn in (
            ("chat", lambda: _http(http_port, "/v1/chat/completions", CHAT, timeout=300)),
            ("tokenize", tokenize), ("text", text))]
        for t in callers:
            t.start()
        deadline = time.monotonic() + 120
        while len(waits) < 3 and not results and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not results and len(waits) == 3, (results, len(waits))  # all three wait; none was refused
        assert hashing.is_set()
        release.set()
        for t in callers:
            t.join(300)
        code, body = results["chat"]
        assert code == 200 and body["usage"]["completion_tokens"] == 2, results["chat"]
        assert body["model"] == current["model_id"] and body["usage"]["kvmesh"]["worker_id"] == "w0"
        assert results["tokenize"] == expected_ids
        assert results["text"].token_ids == direct.token_ids
        assert "error" not in state, state
    finally:
        release.set()
        if "loop" in state:
            state["loop"].call_soon_threadsafe(state["stop"].set)
        server.join(60)
        old.close()


def test_a_router_told_to_stop_while_a_request_waits_for_its_hash_stops_in_seconds(cluster, monkeypatch):
    """SIGTERM's path (``serve_router``'s stop) while an HTTP chat request waits for the
    router's checkpoint hash: health reports NOT_SERVING before the HTTP front stops, the
    request ends 503 at once, and the router returns within seconds, not after the front's
    minute of waiting for its handlers."""
    import threading

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvmesh.services import http_front as front_mod
    from kvmesh.services import router as router_mod
    from kvmesh.services.procs import free_port, wait_healthy

    monkeypatch.setenv("KVMESH_CACHE_DIR", str(cluster["tmp"] / "stop-cache"))
    release = threading.Event()
    real_id = router_mod.checkpoint_model_id

    def held_id(model_dir):
        release.wait(600)
        return real_id(model_dir)
    monkeypatch.setattr(router_mod, "checkpoint_model_id", held_id)
    waits = _count_checkpoint_waits(monkeypatch, router_mod)
    port, http_port = free_port(), free_port()
    raddr = f"127.0.0.1:{port}"
    health_at_front_stop = []
    real_stop = front_mod.HttpFront.stop

    async def observed_stop(self):
        if not health_at_front_stop:
            async with grpc.aio.insecure_channel(raddr) as ch:
                resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""),
                                                                  timeout=10)
            health_at_front_stop.append(resp.status)
        return await real_stop(self)
    monkeypatch.setattr(front_mod.HttpFront, "stop", observed_stop)

    old, _ = _older_worker_lease(cluster, "ident-stop")
    server, state = _router_thread(cluster, router_mod, port, http_port, "ident-stop")
    results: dict = {}

    def chat():
        try:
            results["chat"] = _http(http_port, "/v1/chat/completions", CHAT, timeout=300)
        except Exception as exc:  # noqa: BLE001 - reported by the test
            results["chat"] = exc
    caller = threading.Thread(target=chat, daemon=True)
    try:
        server.start()
        wait_healthy(raddr, timeout=120)
        _wait_routed(raddr, "old0")
        caller.start()
        deadline = time.monotonic() + 120
        while not waits and not results and time.monotonic() < deadline:
            time.sleep(0.05)
        assert waits and not results, results
        began = time.monotonic()
        state["loop"].call_soon_threadsafe(state["stop"].set)
        server.join(40)
        took = time.monotonic() - began
        assert not server.is_alive(), "the router did not stop within 40 s"
        caller.join(30)
        assert took < 20, took
        assert health_at_front_stop == [health_pb2.HealthCheckResponse.NOT_SERVING], health_at_front_stop
        code, body = results["chat"]
        assert code == 503 and "shutting down" in body["error"]["message"], results["chat"]
        assert "error" not in state, state
    finally:
        release.set()
        if "loop" in state and server.is_alive():
            state["loop"].call_soon_threadsafe(state["stop"].set)
        server.join(60)
        old.close()
