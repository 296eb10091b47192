"""Helpers for driving `workers.model.DecoderModel` in tests."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvmesh.workers.model import AttentionMetadata, DecoderModel


@dataclass
class Seq:
    """One sequence's slice of a step: new token ids, cached context length, block table."""

    ids: list[int]
    context_len: int
    block_table: list[int]
    all_logits: bool = field(default=False)


def step(model: DecoderModel, kv_cache: torch.Tensor, seqs: list[Seq], block_size: int) -> list[torch.Tensor]:
    """Run one forward over ``seqs`` flattened into one batch.

    Returns per sequence its logits: ``[q_len, V]`` when ``all_logits`` else ``[1, V]`` (last token).
    """
    meta = AttentionMetadata.build(
        [len(s.ids) for s in seqs],
        [s.context_len for s in seqs],
        [s.block_table for s in seqs],
        block_size,
    )
    rows: list[int] = []
    counts: list[int] = []
    start = 0
    for s in seqs:
        if s.all_logits:
            rows.extend(range(start, start + len(s.ids)))
            counts.append(len(s.ids))
        else:
            rows.append(start + len(s.ids) - 1)
            counts.append(1)
        start += len(s.ids)
    input_ids = torch.tensor([t for s in seqs for t in s.ids], dtype=torch.int64)
    with torch.inference_mode():
        logits = model(input_ids, meta.positions(), meta, kv_cache, torch.tensor(rows, dtype=torch.int64))
    return list(torch.split(logits, counts))


def greedy(
    model: DecoderModel,
    kv_cache: torch.Tensor,
    last_logits: torch.Tensor,
    context_len: int,
    block_table: list[int],
    block_size: int,
    steps: int,
) -> list[int]:
    """Greedy-decode ``steps`` tokens one at a time, starting from the logits of the last prompt token."""
    out: list[int] = []
    logits = last_logits.reshape(-1)
    pos = context_len
    for _ in range(steps):
        tok = int(torch.argmax(logits))
        out.append(tok)
        (logits,) = step(model, kv_cache, [Seq([tok], pos, block_table)], block_size)
        logits = logits.reshape(-1)
        pos += 1
    return out


def needs_kernel_mark():
    """pytest mark for tests of the C++ attention kernel: skipped, with the reason, where it
    is not built (no C++ compiler at set-up), unless ``KVMESH_REQUIRE_KERNEL=1`` (as CI sets
    it): then they run, and fail, so that a broken build cannot pass as skipped tests."""
    import os

    import pytest

    from kvmesh.workers import attn_kernel

    missing = attn_kernel.get() is None and os.environ.get("KVMESH_REQUIRE_KERNEL") != "1"
    return pytest.mark.skipif(missing, reason=attn_kernel.status())
