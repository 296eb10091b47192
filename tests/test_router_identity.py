"""The router's model identity: it reads the tokenizer files of --model, never the weights,
and sends text only to workers that publish the same tokenizer id in their lease; a lease
without one (an older worker) is compared by checkpoint id, which the router then hashes
once, off its event loop.

Unit tests of `model_identity.tokenizer_fingerprint`, `membership.Compatibility` and the
router's lazy checkpoint id, then real redis-server, worker and router processes on
loopback: a router whose weight file cannot be read serves text and token ids; one of
another tokenizer refuses text (gRPC, Tokenize, HTTP chat) and serves token ids; older
leases fall back to the checkpoint id."""
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
    assert "--model /m" in sel.text_reason and "token_ids" in sel.text_reason
    assert len([r for r in caplog.records if "text prompts refused" in r.getMessage()]) == 1  # once per change
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
    compat.router_model_id, compat.model_id_problem = None, "model.safetensors: no such file"
    sel = compat.select(old)
    assert not sel.needs_model_id and "no such file" in sel.text_reason and "older kvmesh" in sel.text_reason
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


def _http(port: int, path: str, body: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method="POST" if body is not None else "GET",
                                 data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
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
    with open(log_path) as fh:
        log_text = fh.read()
    assert "hashing the weight files" not in log_text and "could not hash" not in log_text, log_text
    assert os.path.islink(os.path.join(folder, "model.safetensors"))


def _worker_model_id(cluster) -> str:
    """The checkpoint id the worker serves (no compute tag: it computes in the checkpoint's dtype)."""
    import kvmesh.proto.kvmesh_pb2 as pb
    import kvmesh.proto.kvmesh_pb2_grpc as pb_grpc

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
    code, body = _http(http_port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
    assert body["error"]["code"] == "failed_precondition", (code, body)
    code, body = _http(http_port, "/v1/completions", {"prompt": ids, "max_tokens": 2, "temperature": 0})
    assert code == 200 and body["usage"]["completion_tokens"] == 2, body


def test_an_older_workers_lease_falls_back_to_the_checkpoint_id(cluster):
    """A lease without tokenizer_id (as an older worker writes) in a cluster of its own,
    naming the real worker: a router with the real checkpoint hashes its weights once, after
    start, and then serves text; one whose weights cannot be read serves token ids only."""
    import redis as redis_lib

    from kvmesh.services.client import KvmeshClient
    from kvmesh.workers.kv_publisher import WorkerLease, lease_key

    client = redis_lib.Redis.from_url(cluster["redis"].url)
    current = json.loads(client.get(lease_key("w0", "ident")))
    client.close()
    assert comparable_tokenizer_id(current["tokenizer_id"])
    info = {k: v for k, v in current.items() if k not in ("tokenizer_id", "worker_id", "address", "instance",
                                                           "load", "ts", "kv_seq", "kv_epoch")}
    old = WorkerLease(cluster["redis"].url, "old0", cluster["worker"], info, lambda: current.get("load") or {},
                      cluster="ident-old", ttl_s=10.0, interval_s=1.0)
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
            assert "older kvmesh" in err.value.details() and "model.safetensors" in err.value.details()
            out = r.generate(token_ids=ids, max_tokens=2, temperature=0.0, timeout=60)
            assert out.token_ids == direct.token_ids
        with open(bad_log) as fh:
            assert "could not hash the router's checkpoint" in fh.read()
    finally:
        old.close()
