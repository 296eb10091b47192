"""A block whose KV went through a lossy codec is never passed on as exact.

A worker with a compressed host tier loads blocks back into its device pool decoded from
that codec. Whatever it then writes (disk, remote tier) or exports to peers must carry the
lossiest codec the KV went through, so that a worker that accepts only exact KV misses
those blocks and recomputes them (its outputs equal a cold run), while a worker that
accepts the codec still hits them within the documented error.
"""
from __future__ import annotations

from kvmesh.bench.codec_error import DOCUMENTED_MAX_LOGIT_DIFF
from kvmesh.cache_store.hashing import hash_blocks
from kvmesh.cache_store.tier_store import TierConfig
from kvmesh.workers.engine import Engine
from kvmesh.workers.request import SamplingParams
from tests.test_engine_tiers import max_diff, rand_prompt, run
from tests.test_remote_reuse import cold_engine as cold  # noqa: F401 - a fixture: an engine with no tiers

BS = 16
ONE = SamplingParams(max_tokens=1)


def cached_blocks(prompt) -> int:
    return (len(prompt) - 1) // BS


def engine(host_codec: str = "none", **tiers) -> Engine:
    return Engine(num_blocks=64, block_size=BS,
                  tiers=TierConfig(host_bytes=8 << 20, host_codec=host_codec, **tiers)).start()


def hashes(e: Engine, prompt) -> list[bytes]:
    return list(hash_blocks(prompt, BS, e.namespace().root_hash()).hashes[:cached_blocks(prompt)])


def test_remote_records_of_a_lossy_host_tier_are_labelled_lossy(redis_server, cold):
    prompt = rand_prompt(31, 129)
    ref, ref_logits = run(cold, prompt, ONE)
    remote = dict(remote_url=redis_server.url, remote_bytes=64 << 20, remote_cluster="t", peer_bytes=16 << 20)
    a = engine("int4", **remote)  # its remote codec is the default, exact
    exact_only, int4_ok = engine(**remote), engine("int4", **remote)
    try:
        run(a, prompt, ONE)
        a.offload_device_cache()
        assert a.tiers.flush(30) and a.tier_stats()["remote_blocks"] >= cached_blocks(prompt)

        out, logits = run(exact_only, prompt, ONE)
        assert out["usage"]["cached_tokens"] == 0  # int4 KV is a miss here
        assert out["token_ids"] == ref["token_ids"] and max_diff(logits, ref_logits) < 1e-4

        out, logits = run(int4_ok, prompt, ONE)
        assert out["usage"]["cached_tokens_by_tier"]["remote"] == BS * cached_blocks(prompt)
        assert 0 < max_diff(logits, ref_logits) <= DOCUMENTED_MAX_LOGIT_DIFF["int4"]
    finally:
        for e in (a, exact_only, int4_ok):
            e.stop()


def test_blocks_reloaded_from_a_lossy_tier_are_exported_and_written_lossy(tmp_path):
    prompt = rand_prompt(32, 129)
    a = engine("int4", disk_dir=str(tmp_path / "a"), disk_bytes=64 << 20)  # disk codec: exact
    try:
        run(a, prompt, ONE)
        assert {m.codec for m, _ in a.export_blocks(hashes(a, prompt))} == {"none"}  # computed: exact
        a.offload_device_cache()
        assert a.tiers.flush(30)
        assert {d.meta.codec for d in a.tiers.disk.entries.values()} == {"int4"}  # not transcoded to exact
        out, _ = run(a, prompt, ONE)
        assert out["usage"]["cached_tokens_by_tier"]["host"] == BS * cached_blocks(prompt)
        records = a.export_blocks(hashes(a, prompt))  # now on device, decoded from int4
        assert len(records) == cached_blocks(prompt) and {m.codec for m, _ in records} == {"int4"}
        a.offload_device_cache()
        assert {m.codec for m, _ in a.export_blocks(hashes(a, prompt))} == {"int4"}  # host copies too

        a.clear_cache()  # recomputed rows are exact again
        run(a, prompt, ONE)
        assert {m.codec for m, _ in a.export_blocks(hashes(a, prompt))} == {"none"}
    finally:
        a.stop()


def test_peer_staged_lossy_blocks_stay_lossy_on_the_fetcher(cold):
    """Blocks staged from int4 records and loaded into an int4-accepting pool keep the label
    when that worker offloads and exports them again (a second hop)."""
    prompt = rand_prompt(33, 129)
    ref, ref_logits = run(cold, prompt, ONE)
    a, b = engine("int4"), engine("int4", peer_bytes=16 << 20)
    try:
        run(a, prompt, ONE)
        a.offload_device_cache()
        records = a.export_blocks(hashes(a, prompt))
        assert {m.codec for m, _ in records} == {"int4"}
        assert b.tiers.stage(records) == len(records)
        out, logits = run(b, prompt, ONE)
        assert out["usage"]["cached_tokens_by_tier"]["peer"] == BS * cached_blocks(prompt)
        assert 0 < max_diff(logits, ref_logits) <= DOCUMENTED_MAX_LOGIT_DIFF["int4"]
        assert {m.codec for m, _ in b.export_blocks(hashes(b, prompt))} == {"int4"}
    finally:
        a.stop()
        b.stop()


def test_blocks_computed_over_lossy_context_are_exported_lossy():
    """The blocks a request computes after a prefix decoded from int4 depend on that KV: they
    are exported (to peers, the remote and disk tiers) as int4, so a worker that accepts only
    exact KV misses them as it misses the prefix (`accepted_codecs`)."""
    p = rand_prompt(33, 4 * BS)
    q = p + rand_prompt(34, 4 * BS + 1)
    a = engine("int4")
    try:
        run(a, p, ONE)
        a.offload_device_cache()
        out, _ = run(a, q, ONE)  # p's blocks from the int4 host tier, the rest computed over them
        assert out["usage"]["cached_tokens_by_tier"]["host"] == 4 * BS
        records = a.export_blocks(hashes(a, q))
        assert len(records) == cached_blocks(q) == 8 and {m.codec for m, _ in records} == {"int4"}
    finally:
        a.stop()
