"""bench.trace: Mooncake loader, token synthesis, infinite-cache hit rate, bundled sample."""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvmesh.bench.trace import (
    DEFAULT_SAMPLE,
    TraceRequest,
    block_token_lengths,
    infinite_cache_hit_rate,
    load_mooncake,
    synthesize_tokens,
    synthesized_length,
)

ROOT = Path(__file__).resolve().parents[1]


def _line(ts=0, inp=1074, out=10, ids=(0, 1, 2)) -> str:
    return json.dumps({"timestamp": ts, "input_length": inp, "output_length": out, "hash_ids": list(ids)})


def _write(tmp_path: Path, lines: list[str]) -> Path:
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return p


def _req(ids, inp=None) -> TraceRequest:
    ids = tuple(ids)
    return TraceRequest(timestamp_ms=0, input_length=inp if inp is not None else 512 * len(ids),
                        output_length=1, hash_ids=ids)


# ---------------------------------------------------------------------------- loader


def test_load_valid_and_max_requests(tmp_path):
    p = _write(tmp_path, [_line(0), "", _line(5, 512, 3, [0]), _line(9, 513, 4, [0, 7])])
    reqs = load_mooncake(p)
    assert [r.timestamp_ms for r in reqs] == [0, 5, 9]
    assert reqs[1] == TraceRequest(5, 512, 3, (0,))
    assert len(load_mooncake(p, max_requests=2)) == 2
    assert load_mooncake(p, max_requests=0) == []


@pytest.mark.parametrize("bad, pattern", [
    ('{"timestamp": 0, "input_length": 10', r"line 2: not valid JSON"),
    ('[1, 2, 3]', r"line 2: expected a JSON object"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 1}', r"line 2: missing field\(s\) hash_ids"),
    (_line(inp=1074, ids=[0, 1]), r"line 2: len\(hash_ids\) is 2 but input_length 1074 needs .* = 3 blocks"),
    (_line(inp=512, ids=[0, 1]), r"line 2: len\(hash_ids\) is 2"),
    (_line(inp=0, ids=[]), r"line 2: input_length must be >= 1"),
    (_line(ts=-1), r"line 2: timestamp must be a non-negative integer"),
    (_line(out=1.5), r"line 2: output_length must be a non-negative integer"),
    (_line(inp=True, ids=[0]), r"line 2: input_length must be a non-negative integer"),
    (_line(ids=[0, "a", 2]), r"line 2: hash_ids must be a list of non-negative integers"),
    (_line(ids=[0, -1, 2]), r"line 2: hash_ids must be a list"),
])
def test_load_errors_name_the_line(tmp_path, bad, pattern):
    p = _write(tmp_path, [_line(), bad, _line()])
    with pytest.raises(ValueError, match=pattern) as info:
        load_mooncake(p)
    assert "t.jsonl" in str(info.value)


def test_load_stops_before_a_bad_line_past_max_requests(tmp_path):
    p = _write(tmp_path, [_line(), _line(), "garbage"])
    assert len(load_mooncake(p, max_requests=2)) == 2


def test_a_truncated_or_corrupt_gzip_trace_is_a_value_error_not_an_eof_error(tmp_path):
    import gzip

    whole = gzip.compress(("\n".join(_line(ts=i) for i in range(400)) + "\n").encode())
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ValueError, match=r"cut\.jsonl\.gz: the gzip file is truncated"):
        load_mooncake(cut)
    bad = tmp_path / "bad.jsonl.gz"
    bad.write_bytes(b"not gzip at all")
    with pytest.raises(ValueError, match=r"bad\.jsonl\.gz: not a valid gzip file"):
        load_mooncake(bad)
    corrupt = tmp_path / "corrupt.jsonl.gz"
    corrupt.write_bytes(whole[:20] + bytes(b ^ 0xFF for b in whole[20:60]) + whole[60:])
    with pytest.raises(ValueError, match=r"corrupt\.jsonl\.gz: not a valid gzip file"):
        load_mooncake(corrupt)
    plain = tmp_path / "gz-without-suffix.jsonl"
    plain.write_bytes(whole)
    with pytest.raises(ValueError, match=r"not UTF-8 text.*must end in \.gz"):
        load_mooncake(plain)


def test_the_demo_names_its_trace_flag_for_a_truncated_trace_before_any_cluster(tmp_path, monkeypatch):
    import gzip

    from kvmesh.bench import demo
    from kvmesh.services import launcher

    monkeypatch.setattr(launcher, "LocalCluster", lambda *a, **k: pytest.fail("started a cluster"))
    whole = gzip.compress(("\n".join(_line(ts=i) for i in range(400)) + "\n").encode())
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ValueError, match=rf"^--trace {re.escape(str(cut))}: .*truncated"):
        demo.run_demo(trace=str(cut), out_dir=str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------- synthesis


def test_tail_length_rule():
    # 1074 = 512 + 512 + 50: the tail keeps ceil(16 * 50 / 512) = 2 tokens.
    r = _req([0, 1, 2], inp=1074)
    assert block_token_lengths(r, 16) == [16, 16, 2]
    assert len(synthesize_tokens(r, 16)) == 34 == synthesized_length(r, 16)
    assert block_token_lengths(_req([0], inp=512), 16) == [16]
    assert block_token_lengths(_req([0], inp=1), 16) == [1]
    assert block_token_lengths(_req([0, 1], inp=513), 16) == [16, 1]
    assert block_token_lengths(_req([0, 1], inp=512 + 256), 32) == [32, 16]
    assert block_token_lengths(_req([0, 1], inp=512 + 257), 32) == [32, 17]
    with pytest.raises(ValueError):
        block_token_lengths(r, 0)


def test_tail_is_a_prefix_of_the_full_block_run():
    full = synthesize_tokens(_req([3, 4]), 16)
    partial = synthesize_tokens(_req([3, 4], inp=512 + 100), 16)  # ceil(16*100/512) = 4
    assert partial == full[:16 + 4]


def test_shared_hash_ids_give_identical_prefixes():
    a = synthesize_tokens(_req([0, 11, 12, 13]), 16)
    b = synthesize_tokens(_req([0, 11, 12, 99, 100], inp=512 * 4 + 7), 16)
    assert a[:48] == b[:48]
    assert a[48:64] != b[48:64]


def test_different_hash_ids_give_different_tokens():
    runs = {tuple(synthesize_tokens(_req([h]), 16)) for h in range(2000)}
    assert len(runs) == 2000
    # Same ids, different seed: different tokens.
    assert synthesize_tokens(_req([5]), 16, seed=1) != synthesize_tokens(_req([5]), 16, seed=0)


def test_tokens_lie_in_vocab():
    toks = synthesize_tokens(_req(range(50)), 16, vocab_size=7)
    assert len(toks) == 800
    assert min(toks) >= 0 and max(toks) < 7
    assert len(set(toks)) == 7
    toks = synthesize_tokens(_req(range(50)), 16)
    assert min(toks) >= 0 and max(toks) < 256


_SNIPPET = ("from kvmesh.bench.trace import TraceRequest, synthesize_tokens;"
            "r = TraceRequest(0, 1074, 1, (0, 24860, 24861));"
            "print(','.join(map(str, synthesize_tokens(r, 16, vocab_size=256, seed=3))))")


def test_synthesis_is_deterministic_across_processes():
    here = synthesize_tokens(_req([0, 24860, 24861], inp=1074), 16, vocab_size=256, seed=3)
    outs = []
    for hash_seed in ("0", "1", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=hash_seed)
        proc = subprocess.run([sys.executable, "-c", _SNIPPET], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=60, check=True)
        outs.append([int(x) for x in proc.stdout.strip().split(",")])
    assert outs[0] == outs[1] == outs[2] == here
    assert len(here) == 34


# ---------------------------------------------------------------------------- hit rate


def test_infinite_cache_hit_rate_by_hand():
    reqs = [
        _req([1, 2, 3]),        # 0 of 3: cache is empty
        _req([1, 2, 4, 5]),     # 1, 2 seen: 2 of 4
        _req([6]),              # 0 of 1
        _req([1, 2, 4, 7]),     # 1, 2, 4 seen: 3 of 4
        _req([1, 2, 3]),        # all seen: 3 of 3
    ]
    # hits 0 + 2 + 0 + 3 + 3 = 8, blocks 3 + 4 + 1 + 4 + 3 = 15
    assert infinite_cache_hit_rate(reqs) == (8, 15)
    assert infinite_cache_hit_rate([]) == (0, 0)


# ---------------------------------------------------------------------------- bundled sample


def test_default_sample_is_bundled_and_valid():
    assert DEFAULT_SAMPLE.is_file()
    assert DEFAULT_SAMPLE.parent == ROOT / "bench" / "data"
    reqs = load_mooncake(DEFAULT_SAMPLE)
    assert len(reqs) == 400
    hits, total = infinite_cache_hit_rate(reqs)
    assert (hits, total) == (2077, 11292)
    assert sum(synthesized_length(r, 16) for r in reqs) == 177832


def test_default_sample_sha256_matches_readme():
    readme = (DEFAULT_SAMPLE.parent / "README.md").read_text(encoding="utf-8")
    m = re.search(r"sha256 \| `([0-9a-f]{64})`", readme)
    assert m, "bench/data/README.md must state the sample's sha256"
    assert hashlib.sha256(DEFAULT_SAMPLE.read_bytes()).hexdigest() == m.group(1)
