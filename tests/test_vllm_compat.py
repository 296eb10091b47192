"""vLLM block hashing reproduced by `services.vllm_compat`, checked against vLLM itself.

The cross-check runs vLLM's own hashing functions (``vllm.v1.core.kv_cache_utils``)
in the separate vLLM virtualenv that ``scripts/setup.sh`` makes, in fresh processes with
and without ``PYTHONHASHSEED``, and compares every digest and event key.
"""
from __future__ import annotations

import json
import os
import random
import subprocess

import pytest

from kvmesh.bench.vllm_peer import vllm_python, vllm_ready
from kvmesh.services.vllm_compat import (HASH_ALGOS, SUPPORTED_VERSIONS, UnsupportedVllm, VllmHashConfig,
                                         VllmHasher, check_version, event_key)

VLLM_PY = vllm_python()

# Runs inside vLLM's virtualenv: vLLM's own functions, the way its engine core calls them.
_VLLM_SCRIPT = r"""
import json, os, sys
from vllm import __version__
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils as u
cases = json.load(sys.stdin)
out = {"version": __version__, "results": []}
for c in cases:
    # vLLM reads PYTHONHASHSEED when it derives NONE_HASH (init_none_hash)
    if c["seed"] is None:
        os.environ.pop("PYTHONHASHSEED", None)
    else:
        os.environ["PYTHONHASHSEED"] = c["seed"]
    fn = get_hash_fn_by_name(c["algo"])
    u.init_none_hash(fn)
    parent = None
    digests = []
    bs = c["block_size"]
    toks = c["tokens"]
    for i in range(len(toks) // bs):
        keys = []
        if c.get("lora"):
            keys.append(("lora", c["lora"][0], c["lora"][1]))
        if i == 0 and c.get("salt"):
            keys.append(("cache_salt", c["salt"]))
        parent = u.hash_block_tokens(fn, parent, toks[i * bs:(i + 1) * bs], tuple(keys) if keys else None)
        digests.append(parent)
    out["results"].append({"digests": [d.hex() for d in digests],
                           "ints": [u.maybe_convert_block_hash(d) for d in digests]})
print(json.dumps(out))
"""


def _cases():
    rng = random.Random(7)
    cases = []
    for seed in (None, "1234"):
        # xxhash without PYTHONHASHSEED is seeded at random per process: refused, not compared
        for algo in HASH_ALGOS if seed is not None else ("sha256", "sha256_cbor"):
            for bs in (16, 32):
                toks = [rng.randrange(0, 50000) for _ in range(bs * 4 + 5)]
                base = {"algo": algo, "block_size": bs, "seed": seed}
                cases.append({**base, "tokens": toks})
                cases.append({**base, "tokens": toks, "salt": "tenant-a"})
                cases.append({**base, "tokens": toks[:bs * 2], "lora": ["ad", "/m/ad"]})
    return cases


def _run_vllm(cases) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    env["VLLM_LOGGING_LEVEL"] = "ERROR"
    proc = subprocess.run([str(VLLM_PY), "-c", _VLLM_SCRIPT], input=json.dumps(cases), capture_output=True,
                          text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


needs_vllm = pytest.mark.skipif(not vllm_ready(),
                                reason=f"no vLLM virtualenv at {VLLM_PY.parent.parent} (scripts/setup.sh makes it)")


@needs_vllm
@pytest.mark.slow
def test_hashes_equal_vllm_own_functions():
    cases = _cases()
    got = _run_vllm(cases)
    assert check_version(got["version"]) in SUPPORTED_VERSIONS
    assert len(got["results"]) == len(cases) == 36
    for case, res in zip(cases, got["results"]):
        hasher = VllmHasher(VllmHashConfig(version=got["version"], block_size=case["block_size"],
                                           hash_algo=case["algo"], hash_seed=case["seed"]))
        lora = tuple(case["lora"]) if case.get("lora") else None
        ours = hasher.block_hashes(case["tokens"], cache_salt=case.get("salt"), lora=lora)
        assert [d.hex() for d in ours] == res["digests"], (case["algo"], case["seed"])
        assert len(ours) == len(case["tokens"]) // case["block_size"]
        # the default event form (64-bit ints) maps to the same index keys
        assert [event_key(i) for i in res["ints"]] == [hasher.digest_key(d) for d in ours]


def test_none_hash_seed_follows_pythonhashseed():
    a = VllmHasher(VllmHashConfig(block_size=4))
    b = VllmHasher(VllmHashConfig(block_size=4, hash_seed="1"))
    toks = list(range(8))
    assert a.block_hashes(toks) != b.block_hashes(toks)
    assert a.block_hashes(toks) == VllmHasher(VllmHashConfig(block_size=4, hash_seed=None)).block_hashes(toks)
    assert len(a.none_hash) == 32
    assert len(VllmHasher(VllmHashConfig(block_size=4, hash_algo="xxhash", hash_seed="1")).none_hash) == 16


def test_chain_salt_and_partial_blocks():
    h = VllmHasher(VllmHashConfig(block_size=4))
    toks = list(range(10))
    full = h.block_hashes(toks)
    assert len(full) == 2                          # the trailing 2 tokens are not hashed
    assert h.block_hashes(toks[:8]) == full
    assert h.block_hashes(toks[:4]) == full[:1]    # a prefix shares its leading hashes
    salted = h.block_hashes(toks, cache_salt="t")
    assert salted[0] != full[0] and salted[1] != full[1]   # the salt on block 0 changes the whole chain
    other = h.block_hashes([99] + toks[1:])
    assert other[0] != full[0] and other[1] != full[1]
    assert h.keys(toks) == [d[-8:] for d in full]
    assert VllmHasher(VllmHashConfig(block_size=4, int_block_hashes=False)).keys(toks) == full


@pytest.mark.parametrize("kwargs, word", [
    ({"version": "0.9.2"}, "not supported"),
    ({"hash_algo": "md5"}, "--vllm-hash-algo"),
    ({"hash_algo": "xxhash"}, "PYTHONHASHSEED"),
    ({"block_size": 0}, "--vllm-block-size"),
])
def test_unsupported_settings_are_refused(kwargs, word):
    with pytest.raises(UnsupportedVllm, match=word):
        VllmHashConfig(**kwargs)


def test_event_key_forms():
    d = bytes(range(32))
    assert event_key(int.from_bytes(d, "big") & ((1 << 64) - 1)) == d[-8:]
    assert event_key(d) == d
    for bad in (-1, 1 << 64, "ab", None, True):
        with pytest.raises(ValueError):
            event_key(bad)
