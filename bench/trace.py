"""Mooncake-format request traces: loading, token synthesis and the infinite-cache bound.

A Mooncake trace line looks like::

    {"timestamp": 393000, "input_length": 1074, "output_length": 83, "hash_ids": [0, 24860, 24861]}

``hash_ids`` are *prefix* hashes of 512-token blocks: equal ids at the same place mean the
two prompts are identical up to and including that block. The trace carries no text, so
`synthesize_tokens` turns every block id into a deterministic run of ``K`` pseudo-random
token ids. Two synthesized prompts then share exactly the token prefixes that the trace
says the original prompts shared, scaled down by ``TRACE_BLOCK_TOKENS / K``.

Nothing here reads outside ``bench/data`` unless a caller passes another path.
"""
from __future__ import annotations

import gzip
import json
import math
import struct
import zlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Sequence

import xxhash

#: Tokens per block in the Mooncake traces.
TRACE_BLOCK_TOKENS = 512

#: The trace sample shipped with the package (see bench/data/README.md).
DEFAULT_SAMPLE = Path(__file__).resolve().parent / "data" / "mooncake_conversation_sample.jsonl"

_MASK64 = (1 << 64) - 1
_REQUIRED = ("timestamp", "input_length", "output_length", "hash_ids")


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace.

    Attributes:
        timestamp_ms: arrival time in milliseconds from the start of the trace.
        input_length: prompt length of the original request, tokens.
        output_length: completion length of the original request, tokens.
        hash_ids: prefix block hashes, one per 512-token block (the last may be partial).
    """

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    @property
    def num_blocks(self) -> int:
        return len(self.hash_ids)

    @property
    def tail_tokens(self) -> int:
        """Original tokens in the last (possibly partial) block."""
        return self.input_length - TRACE_BLOCK_TOKENS * (len(self.hash_ids) - 1)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_line(text: str, where: str = "<line>") -> TraceRequest:
    """Parse and validate one JSON line; raises ValueError starting with ``where``."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    missing = [k for k in _REQUIRED if k not in obj]
    if missing:
        raise ValueError(f"{where}: missing field(s) {', '.join(missing)}")
    for key in ("timestamp", "input_length", "output_length"):
        if not _is_int(obj[key]) or obj[key] < 0:
            raise ValueError(f"{where}: {key} must be a non-negative integer, got {obj[key]!r}")
    if obj["input_length"] < 1:
        raise ValueError(f"{where}: input_length must be >= 1, got {obj['input_length']}")
    hash_ids = obj["hash_ids"]
    if not isinstance(hash_ids, list) or not all(_is_int(h) and h >= 0 for h in hash_ids):
        raise ValueError(f"{where}: hash_ids must be a list of non-negative integers")
    expected = math.ceil(obj["input_length"] / TRACE_BLOCK_TOKENS)
    if len(hash_ids) != expected:
        raise ValueError(f"{where}: len(hash_ids) is {len(hash_ids)} but input_length {obj['input_length']} "
                         f"needs ceil({obj['input_length']}/{TRACE_BLOCK_TOKENS}) = {expected} blocks")
    return TraceRequest(timestamp_ms=obj["timestamp"], input_length=obj["input_length"],
                        output_length=obj["output_length"], hash_ids=tuple(hash_ids))


def load_mooncake(path: str | Path, max_requests: int | None = None) -> list[TraceRequest]:
    """Read a Mooncake JSON Lines trace, in file order.

    Blank lines are skipped. ``max_requests`` keeps only the first N requests. A path
    ending in ``.gz`` is read through gzip.

    Raises:
        ValueError: a malformed line, naming the file and its 1-based line number; a
            truncated or corrupt .gz file; bytes that are not UTF-8 text.
        OSError: the file cannot be read.
    """
    if max_requests is not None and max_requests < 0:
        raise ValueError(f"max_requests must be >= 0, got {max_requests}")
    path = Path(path)
    out: list[TraceRequest] = []
    gz = path.suffix == ".gz"
    opener = gzip.open if gz else open  # a .gz file is read decompressed
    lineno = 0
    try:
        with opener(path, "rt", encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, start=1):
                if max_requests is not None and len(out) >= max_requests:
                    break
                if not line.strip():
                    continue
                out.append(parse_line(line, where=f"{path.name}:line {lineno}"))
    except EOFError:  # gzip: the stream stops before its end marker
        raise ValueError(f"{path.name}: the gzip file is truncated (it ends after line {lineno}); "
                         "download or copy it again") from None
    except (gzip.BadGzipFile, zlib.error) as exc:
        raise ValueError(f"{path.name}: not a valid gzip file ({exc}); a path ending in .gz must be "
                         "gzip-compressed JSON Lines") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path.name}: not UTF-8 text ({exc.reason}) after line {lineno}"
                         + ("" if gz else "; a compressed trace must end in .gz")) from None
    return out


def block_token_lengths(req: TraceRequest, tokens_per_block: int) -> list[int]:
    """Synthesized length of each trace block: K for full blocks, the tail proportional.

    The tail block keeps ``ceil(K * tail_tokens / 512)`` tokens, so a prompt of 1,074 tokens
    (blocks of 512, 512, 50) becomes 16 + 16 + 2 tokens at K = 16.
    """
    if tokens_per_block < 1:
        raise ValueError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
    n = len(req.hash_ids)
    tail = math.ceil(tokens_per_block * req.tail_tokens / TRACE_BLOCK_TOKENS)
    return [tokens_per_block] * (n - 1) + [tail]


def synthesized_length(req: TraceRequest, tokens_per_block: int) -> int:
    """Prompt length that `synthesize_tokens` produces for ``req``."""
    return sum(block_token_lengths(req, tokens_per_block))


@lru_cache(maxsize=1 << 16)
def _block_run(hash_id: int, tokens_per_block: int, vocab_size: int, seed: int) -> tuple[int, ...]:
    # One 64-bit xxh64 value per token position, keyed by (seed, hash_id, position). The
    # result depends on nothing else: not on the process, PYTHONHASHSEED or the platform.
    out = []
    for j in range(tokens_per_block):
        key = struct.pack("<QQQ", seed & _MASK64, hash_id & _MASK64, j)
        out.append(xxhash.xxh64_intdigest(key) % vocab_size)
    return tuple(out)


def block_tokens(hash_id: int, tokens_per_block: int, vocab_size: int = 256, seed: int = 0) -> list[int]:
    """The K-token run that stands for one trace block id."""
    if tokens_per_block < 1:
        raise ValueError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    return list(_block_run(int(hash_id), int(tokens_per_block), int(vocab_size), int(seed)))


def synthesize_tokens(req: TraceRequest, tokens_per_block: int, vocab_size: int = 256, seed: int = 0) -> list[int]:
    """Deterministic token ids for ``req``: one run of K tokens in [0, vocab_size) per block id.

    Each run depends only on (seed, hash_id), so requests that share leading hash ids share
    the same leading tokens. The tail block is cut to its proportional length (see
    `block_token_lengths`).
    """
    lengths = block_token_lengths(req, tokens_per_block)
    tokens: list[int] = []
    for hash_id, length in zip(req.hash_ids, lengths):
        tokens.extend(block_tokens(hash_id, tokens_per_block, vocab_size, seed)[:length])
    return tokens


def infinite_cache_hit_rate(reqs: Iterable[TraceRequest]) -> tuple[int, int]:
    """Block hits of an unbounded prefix cache that starts empty, replaying ``reqs`` in order.

    A block reference hits when the same hash id appeared in any earlier request (ids are
    prefix hashes, so this is a prefix match). Returns ``(hit_blocks, total_blocks)``.
    """
    seen: set[int] = set()
    hits = total = 0
    for req in reqs:
        for h in req.hash_ids:
            total += 1
            if h in seen:
                hits += 1
        seen.update(req.hash_ids)
    return hits, total


def trace_summary(reqs: Sequence[TraceRequest], tokens_per_block: int = 16) -> dict:
    """Size and reuse figures of a trace, for reports and the data README."""
    hits, total = infinite_cache_hit_rate(reqs)
    return {
        "num_requests": len(reqs),
        "input_tokens": sum(r.input_length for r in reqs),
        "output_tokens": sum(r.output_length for r in reqs),
        "trace_blocks": total,
        "infinite_cache_hit_blocks": hits,
        "infinite_cache_hit_rate_blocks": (hits / total) if total else 0.0,
        "tokens_per_block": tokens_per_block,
        "synthesized_input_tokens": sum(synthesized_length(r, tokens_per_block) for r in reqs),
    }


if __name__ == "__main__":  # pragma: no cover - convenience
    import sys

    p = sys.argv[1] if len(sys.argv) > 1 else DEFAULT_SAMPLE
    k = int(sys.argv[2]) if len(sys.argv) > 2 else 16
    print(json.dumps(trace_summary(load_mooncake(p), k), indent=2))
