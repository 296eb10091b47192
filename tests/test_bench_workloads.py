"""bench.workloads: shared-prefix groups, multi-turn chats, Mooncake trace items."""
from __future__ import annotations

import json
from collections import defaultdict

import pytest

from kvmesh.bench.trace import DEFAULT_SAMPLE, load_mooncake, synthesize_tokens
from kvmesh.bench.workloads import (
    WorkItem,
    Workload,
    build_prompt,
    chunk_lengths,
    mooncake_workload,
    multi_turn_workload,
    shared_prefix_workload,
)


def _common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def test_shared_prefix_groups_share_exactly_their_system_prompt():
    w = shared_prefix_workload(num_groups=5, prompts_per_group=4, system_prompt_len=40, question_len=12,
                               output_len=7, vocab_size=384, seed=3)
    assert w.name == "shared-prefix" and len(w) == 20
    by_group = defaultdict(list)
    for it in w.items:
        assert len(it.tokens) == 52 and it.max_tokens == 7 and it.parent is None
        assert all(0 <= t < 384 for t in it.tokens)
        by_group[it.group].append(it.tokens)
    assert sorted(by_group) == [0, 1, 2, 3, 4] and all(len(v) == 4 for v in by_group.values())
    for prompts in by_group.values():
        system = prompts[0][:40]
        assert all(p[:40] == system for p in prompts)
        # The questions differ, so the shared part is the system prompt (a random token may
        # match by chance, hence "less than a few").
        assert all(_common_prefix(a, b) < 44 for i, a in enumerate(prompts) for b in prompts[i + 1:])
    systems = [v[0][:40] for v in by_group.values()]
    assert all(_common_prefix(a, b) < 4 for i, a in enumerate(systems) for b in systems[i + 1:])


def test_shared_prefix_shuffle_order_and_seed():
    kwargs = dict(num_groups=4, prompts_per_group=5, system_prompt_len=8, question_len=4, output_len=2)
    ordered = shared_prefix_workload(**kwargs, shuffle=False)
    assert [it.group for it in ordered.items] == [g for g in range(4) for _ in range(5)]
    shuffled = shared_prefix_workload(**kwargs, seed=1)
    assert sorted(it.group for it in shuffled.items) == sorted(it.group for it in ordered.items)
    assert [it.group for it in shuffled.items] != [it.group for it in ordered.items]
    again = shared_prefix_workload(**kwargs, seed=1)
    assert [it.tokens for it in again.items] == [it.tokens for it in shuffled.items]
    assert shared_prefix_workload(**kwargs, max_output_tokens=1).items[0].max_tokens == 1
    with pytest.raises(ValueError, match="num_groups must be"):
        shared_prefix_workload(0, 1, 1, 1, 1)
    with pytest.raises(ValueError, match="system_prompt_len must be"):
        shared_prefix_workload(1, 1, -1, 1, 1)
    with pytest.raises(ValueError, match="vocab_size"):
        shared_prefix_workload(1, 1, 1, 1, 1, vocab_size=1)


def test_multi_turn_items_and_prompts_extend_previous_turn():
    w = multi_turn_workload(num_conversations=3, num_turns=4, system_prompt_len=10, user_len=5, output_len=2, seed=9)
    assert len(w) == 12
    # Turn-major order, each later turn points at the same conversation's previous turn.
    assert [(it.turn, it.group) for it in w.items] == [(t, c) for t in range(4) for c in range(3)]
    for it in w.items:
        if it.turn == 0:
            assert it.parent is None and len(it.tokens) == 15
        else:
            parent = w.items[it.parent]
            assert parent.group == it.group and parent.turn == it.turn - 1 and len(it.tokens) == 5
    roots = [it for it in w.items if it.turn == 0]
    assert all(r.tokens[:10] == roots[0].tokens[:10] for r in roots)  # shared system prompt

    # Build every prompt the way the harness does, with made-up completions.
    history: dict[int, list[int]] = {}
    prompts: dict[int, list[int]] = {}
    for it in w.items:
        prompts[it.index] = build_prompt(it, history)
        completion = [100 + it.index, 200 + it.index]
        history[it.index] = prompts[it.index] + completion
    for it in w.items:
        if it.parent is None:
            assert prompts[it.index] == it.tokens
        else:
            p = it.parent
            assert prompts[it.index] == prompts[p] + [100 + p, 200 + p] + it.tokens
            assert len(prompts[it.index]) == len(prompts[p]) + 2 + 5
    with pytest.raises(KeyError, match="has not finished"):
        build_prompt(w.items[3], {})


def test_mooncake_workload_matches_trace_synthesis(tmp_path):
    w = mooncake_workload(DEFAULT_SAMPLE, max_requests=6, tokens_per_block=8, max_output_tokens=3)
    reqs = load_mooncake(DEFAULT_SAMPLE, max_requests=6)
    assert len(w) == 6 and w.name == "mooncake" and w.params["trace"] == DEFAULT_SAMPLE.name
    for it, r in zip(w.items, reqs):
        assert it.tokens == synthesize_tokens(r, 8)
        assert it.max_tokens == min(r.output_length, 3)
        assert it.timestamp_s == r.timestamp_ms / 1000.0
        assert sum(it.block_lengths) == len(it.tokens) and len(it.block_lengths) == len(r.hash_ids)
    assert w.infinite_cache_hit_rate_blocks is not None
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"timestamp": 0}) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match="missing field"):
        mooncake_workload(bad)


def test_workload_validation_head_and_chunks():
    items = [WorkItem(0, [1, 2], 1), WorkItem(1, [3], 1, parent=0), WorkItem(2, [4], 2, parent=1)]
    w = Workload("x", items, {"a": 1}, 0.5)
    assert len(w.head(2)) == 2 and w.head(2).params["max_requests"] == 2 and w.head(None) is w
    assert w.head(2).infinite_cache_hit_rate_blocks is None
    with pytest.raises(ValueError, match="must be an earlier item"):
        Workload("x", [WorkItem(0, [1], 1, parent=0)])
    with pytest.raises(ValueError, match="numbered in order"):
        Workload("x", [WorkItem(1, [1], 1)])
    with pytest.raises(ValueError, match="max_tokens"):
        Workload("x", [WorkItem(0, [1], 0)])
    with pytest.raises(ValueError, match="empty prompt"):
        Workload("x", [WorkItem(0, [], 1)])
    assert chunk_lengths(35, 16) == [16, 16, 3]
    assert chunk_lengths(32, 16) == [16, 16]
    assert chunk_lengths(0, 16) == []
