"""The C hashing loop and the pure-Python loop give identical bytes."""
import random
import subprocess
import sys

import numpy as np
import pytest
import xxhash

from kvmesh.cache_store import hashing


def test_extension_is_built():
    # scripts/setup.sh installs libxxhash-dev so the extension builds; without it hashing
    # still works (pure Python) but misses the benchmark target, which this flags.
    assert hashing._chainhash is not None, "cache_store._chainhash not built: install libxxhash-dev, reinstall"


@pytest.mark.parametrize("n,bs,parent_len", [(0, 16, 16), (15, 16, 16), (16, 16, 16), (1000, 16, 16),
                                             (999, 7, 16), (64, 1, 16), (100, 32, 3), (33, 16, 0)])
def test_native_equals_pure_python(n, bs, parent_len):
    rng = random.Random(n * 31 + bs)
    ids = [rng.randrange(2**32) for _ in range(n)]
    parent = bytes(rng.randrange(256) for _ in range(parent_len))
    native = hashing._chainhash.chain_hash(hashing._chainhash.pack_u32(ids), bs, parent)
    # independent reference: xxhash directly, block by block
    tb = np.asarray(ids, dtype="<u4").tobytes()
    expected, h = [], parent
    for i in range(n // bs):
        h = xxhash.xxh3_128_digest(h + tb[i * bs * 4:(i + 1) * bs * 4])
        expected.append(h)
    assert native == expected
    assert hashing._chainhash.pack_u32(ids) == tb


def test_native_and_fallback_agree_through_public_api():
    code = ("import random; from kvmesh.cache_store.hashing import hash_blocks, NATIVE_HASHING; "
            "r = random.Random(5); ids = [r.randrange(50000) for _ in range(5000)]; "
            "print(NATIVE_HASHING, hash_blocks(ids, 16, b'\\x00' * 16).hashes[-1].hex())")
    out = {}
    for env in ({}, {"KVMESH_PURE_PYTHON_HASH": "1"}):
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={**__import__("os").environ, **env})
        flag, digest = res.stdout.split()
        out[flag] = digest
    assert set(out) == {"True", "False"}
    assert out["True"] == out["False"]


@pytest.mark.parametrize("bad,exc", [([1, -1], ValueError), ([2**32], ValueError), ([1, "x"], TypeError),
                                     ([1.5], TypeError)])
def test_native_pack_rejects_bad_ids(bad, exc):
    with pytest.raises(exc):
        hashing.tokens_to_bytes(bad)
