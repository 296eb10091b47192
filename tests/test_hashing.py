import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import msgpack
import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.cache_store.hashing import (
    HASH_BYTES,
    HASH_FORMAT_VERSION,
    BlockHashes,
    Namespace,
    hash_block,
    hash_blocks,
    tokens_to_bytes,
)

REPO = Path(__file__).resolve().parents[1]


def _fixstr(s: str) -> bytes:
    b = s.encode()
    assert len(b) < 32
    return bytes([0xA0 | len(b)]) + b


def expected_root(model: str, salt: str = "", adapter: str = "", version: int = 1) -> bytes:
    """Root hash built by hand: msgpack fixarray(5) of fixstr/positive fixint, then XXH3-128."""
    assert 0 <= version < 128
    packed = (
        b"\x95"
        + _fixstr("kvmesh.block_hash")
        + bytes([version])
        + _fixstr(model)
        + _fixstr(salt)
        + _fixstr(adapter)
    )
    # canonical XXH3-128 digest is the 128-bit value, big-endian
    return xxhash.xxh3_128(packed).intdigest().to_bytes(16, "big")


def expected_chain(root: bytes, tokens: list[int], block_size: int) -> list[bytes]:
    out, parent = [], root
    for b in range(len(tokens) // block_size):
        chunk = tokens[b * block_size : (b + 1) * block_size]
        data = parent + struct.pack(f"<{block_size}I", *chunk)
        parent = xxhash.xxh3_128(data).intdigest().to_bytes(16, "big")
        out.append(parent)
    return out


GOLDEN_TOKENS = [0, 1, 2, 3, 255, 256, 65535, 65536, 2**31, 2**32 - 1, 7, 7, 7, 7, 7, 7] + list(range(100, 133))


def test_xxh3_128_digest_is_canonical_big_endian():
    # Published XXH3-128 test vector for empty input, seed 0 (xxHash sanity checks).
    assert xxhash.xxh3_128_digest(b"") == bytes.fromhex("99aa06d3014798d86001c324468d497f")


def test_hand_built_msgpack_matches_library():
    fields = ["kvmesh.block_hash", 1, "llama", "tenant-a", "lora-7"]
    hand = b"\x95" + _fixstr(fields[0]) + b"\x01" + _fixstr("llama") + _fixstr("tenant-a") + _fixstr("lora-7")
    assert msgpack.packb(fields) == hand


def test_constants():
    assert HASH_FORMAT_VERSION == 1
    assert HASH_BYTES == 16


def test_root_hash_golden():
    ns = Namespace("llama", cache_salt="tenant-a", adapter_id="lora-7")
    assert ns.root_hash() == expected_root("llama", "tenant-a", "lora-7")
    assert len(ns.root_hash()) == HASH_BYTES
    assert Namespace("m").root_hash() == expected_root("m")


def test_block_hashes_golden():
    root = Namespace("golden-model").root_hash()
    bh = hash_blocks(GOLDEN_TOKENS, 16, root)
    assert bh.hashes == expected_chain(expected_root("golden-model"), GOLDEN_TOKENS, 16)
    assert len(bh.hashes) == 3  # 49 tokens: 3 full blocks, 1-token tail
    assert all(len(h) == 16 for h in bh.hashes)


def test_hash_block_is_digest_of_concatenation():
    parent = bytes(range(16))
    tb = struct.pack("<4I", 1, 2, 3, 4)
    assert hash_block(parent, tb) == xxhash.xxh3_128(parent + tb).intdigest().to_bytes(16, "big")


_CHILD = """
import json, sys
from kvmesh.cache_store.hashing import Namespace, hash_blocks
toks = json.loads(sys.argv[1])
ns = Namespace("golden-model", cache_salt="s", adapter_id="a")
bh = hash_blocks(toks, 16, ns.root_hash())
print(json.dumps([ns.root_hash().hex()] + [h.hex() for h in bh.hashes]))
"""


def test_hashes_stable_across_processes_and_hash_seeds():
    root = expected_root("golden-model", "s", "a")
    expected = [root.hex()] + [h.hex() for h in expected_chain(root, GOLDEN_TOKENS, 16)]
    outputs = []
    for seed in ("0", "1", "4242"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        r = subprocess.run(
            [sys.executable, "-c", _CHILD, json.dumps(GOLDEN_TOKENS)],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        outputs.append(json.loads(r.stdout))
    for out in outputs:
        assert out == expected


def test_tokens_to_bytes_little_endian_u32():
    assert tokens_to_bytes([1, 2**32 - 1, 0x01020304]) == b"\x01\0\0\0\xff\xff\xff\xff\x04\x03\x02\x01"
    assert tokens_to_bytes([]) == b""
    assert tokens_to_bytes(np.array([1, 258], dtype=np.int64)) == b"\x01\0\0\0\x02\x01\0\0"
    assert tokens_to_bytes(np.array([5], dtype=np.uint8)) == b"\x05\0\0\0"
    assert tokens_to_bytes(np.array([], dtype=np.int64)) == b""
    assert tokens_to_bytes(range(3)) == struct.pack("<3I", 0, 1, 2)


@pytest.mark.parametrize(
    "bad",
    [[-1], [2**32], [0, 2**64], np.array([-1]), np.array([2**32]), np.array([2**40], dtype=np.uint64)],
)
def test_tokens_out_of_range_raise_value_error(bad):
    with pytest.raises(ValueError):
        tokens_to_bytes(bad)
    with pytest.raises(ValueError):
        hash_blocks(bad, 1, bytes(16))


@pytest.mark.parametrize("bad", [[1.5], ["a"], np.array([1.0]), np.array([True])])
def test_non_integer_tokens_raise_type_error(bad):
    with pytest.raises(TypeError):
        tokens_to_bytes(bad)


def test_two_dimensional_array_rejected():
    with pytest.raises(ValueError):
        tokens_to_bytes(np.zeros((2, 2), dtype=np.int64))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=80), st.integers(1, 9))
def test_list_and_array_inputs_agree_with_reference(tokens, block_size):
    root = bytes(range(16))
    a = hash_blocks(tokens, block_size, root)
    b = hash_blocks(np.array(tokens, dtype=np.uint64), block_size, root)
    assert a.hashes == b.hashes == expected_chain(root, tokens, block_size)
    assert a.token_bytes == b.token_bytes == struct.pack(f"<{len(tokens)}I", *tokens)


def test_partial_tail_kept_but_not_hashed():
    toks = list(range(37))
    bh = hash_blocks(toks, 16, Namespace("m").root_hash())
    assert isinstance(bh, BlockHashes)
    assert len(bh.hashes) == 2
    assert bh.block_size == 16
    assert bh.num_tokens == 37
    assert bh.token_bytes == struct.pack("<37I", *toks)
    assert bh.block_tokens(1) == struct.pack("<16I", *range(16, 32))
    with pytest.raises(IndexError):
        bh.block_tokens(2)
    with pytest.raises(IndexError):
        bh.block_tokens(-1)


def test_incremental_hashing_equals_one_shot():
    root = Namespace("m").root_hash()
    toks = list(range(1000, 1100))
    full = hash_blocks(toks, 8, root)
    first = hash_blocks(toks[:40], 8, root)
    rest = hash_blocks(toks[40:], 8, first.hashes[-1])
    assert first.hashes + rest.hashes == full.hashes


def test_chaining_makes_hash_depend_on_whole_prefix():
    root = Namespace("m").root_hash()
    shared = list(range(32))
    a = hash_blocks(shared + [1] * 16 + [9] * 16, 16, root)
    b = hash_blocks(shared + [2] * 16 + [9] * 16, 16, root)
    assert a.hashes[:2] == b.hashes[:2]
    assert a.hashes[2] != b.hashes[2]
    # identical last block, different history -> different hash
    assert a.hashes[3] != b.hashes[3]


def test_namespace_isolation():
    toks = list(range(64))
    spaces = [
        Namespace("m"),
        Namespace("m", cache_salt="tenant-1"),
        Namespace("m", cache_salt="tenant-2"),
        Namespace("m", adapter_id="lora"),
        Namespace("m2"),
        Namespace("m", version=2),
        # fields are length-delimited, so shifting text between them changes the root
        Namespace("m", cache_salt="x", adapter_id=""),
        Namespace("m", cache_salt="", adapter_id="x"),
    ]
    seen: set[bytes] = set()
    for ns in spaces:
        hs = hash_blocks(toks, 16, ns.root_hash()).hashes
        assert len(hs) == 4
        assert seen.isdisjoint(hs)
        seen.update(hs)
    assert len({ns.root_hash() for ns in spaces}) == len(spaces)


def test_namespace_validation_and_value_semantics():
    with pytest.raises(ValueError):
        Namespace("")
    with pytest.raises(TypeError):
        Namespace(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Namespace("m", version=-1)
    a, b = Namespace("m", "s"), Namespace("m", "s")
    assert a == b and hash(a) == hash(b) and a.root_hash() == b.root_hash()
    with pytest.raises(AttributeError):
        a.model_id = "other"  # type: ignore[misc]


def test_injected_hash_fn_is_used():
    calls = []

    def weak(parent: bytes, tb: bytes) -> bytes:
        calls.append((parent, tb))
        return tb[:4] * 4

    bh = hash_blocks(list(range(10)), 4, b"r" * 16, hash_fn=weak)
    assert bh.hashes == [struct.pack("<I", 0) * 4, struct.pack("<I", 4) * 4]
    assert calls[0] == (b"r" * 16, struct.pack("<4I", 0, 1, 2, 3))
    assert calls[1][0] == bh.hashes[0]


def test_bad_arguments():
    with pytest.raises(ValueError):
        hash_blocks([1, 2], 0, bytes(16))
    with pytest.raises(TypeError):
        hash_blocks([1, 2], 1, "root")  # type: ignore[arg-type]


def test_docs_describe_the_root_hash_as_computed():
    """The README's formula for the namespace root, taken as written (tag, version 1, seed 0,
    tenant as a sixth item), gives `Namespace.root_hash`: the root is computable from public
    ids, and neither the README nor docs/SECURITY.md may call the hashing seeded or keyed."""
    ns = Namespace(model_id="m@0123456789ab", cache_salt="s", adapter_id="a", tenant="acme")
    packed = msgpack.packb(["kvmesh.block_hash", 1, "m@0123456789ab", "s", "a", "acme"])
    assert xxhash.xxh3_128_digest(packed, seed=0) == ns.root_hash()
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert '`xxh3_128(msgpack(["kvmesh.block_hash", 1,' in readme
    for doc in ("README.md", "docs/SECURITY.md", "docs/ARCHITECTURE.md"):
        text = " ".join((REPO / doc).read_text(encoding="utf-8").split()).lower()
        assert "seeded xxh3" not in text and "keyed xxh3" not in text.replace("unkeyed xxh3", ""), doc
