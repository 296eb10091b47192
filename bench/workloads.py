"""Workloads of the load harness: what each request sends.

A `Workload` is an ordered list of `WorkItem` s. An item either carries its whole prompt
(``parent`` None) or extends an earlier item: its prompt is the parent's prompt, then the
completion the parent actually received, then the item's own ``tokens`` (a multi-turn
chat turn). The harness builds such a prompt when the parent has finished
(`build_prompt`), so a turn is never sent before the turn it extends.

Three generators:

- `mooncake_workload`: a Mooncake FAST'25 trace (``bench.trace``); every trace block id
  becomes K pseudo-random tokens, timestamps are kept for trace-paced arrivals.
- `shared_prefix_workload`: the "generated shared prefix" workload of SGLang's
  ``bench_serving`` (``--dataset-name generated-shared-prefix``): ``num_groups`` random
  system prompts, each followed by ``prompts_per_group`` random questions, shuffled
  unless asked to keep group order.
- `multi_turn_workload`: ``num_conversations`` chats of ``num_turns`` turns; turn 0 is a
  system prompt shared by all conversations plus a first user message, every later turn
  appends the previous completion and a new user message.

Token ids are drawn from ``[0, vocab_size)``, so they are valid for any model whose
vocabulary has at least that many ids (the built-in model has 384).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from kvmesh.bench.trace import block_token_lengths, infinite_cache_hit_rate, load_mooncake, synthesize_tokens

#: Names of the workload generators.
WORKLOADS = ("mooncake", "shared-prefix", "multi-turn")


@dataclass
class WorkItem:
    """One request of a workload.

    Attributes:
        index: position in the workload, 0-based.
        tokens: the whole prompt when ``parent`` is None, else the new user tokens that
            follow the parent's prompt and completion.
        max_tokens: completion length to ask for (>= 1); decoding ignores EOS, so this
            is the completion length the target produces.
        parent: index of the item this one extends (an earlier turn), or None.
        timestamp_s: arrival time in the source trace, seconds (None: no trace).
        block_lengths: tokens of each trace block of the prompt, for the trace-block hit
            rate; None: the prompt is cut into ``tokens_per_block``-token blocks.
        group: shared-prefix group or conversation the item belongs to.
        turn: turn number within its conversation (0 for single-turn workloads).
    """

    index: int
    tokens: list[int]
    max_tokens: int
    parent: int | None = None
    timestamp_s: float | None = None
    block_lengths: list[int] | None = None
    group: int = 0
    turn: int = 0


@dataclass
class Workload:
    """An ordered list of requests plus what produced them.

    Attributes:
        name: generator name ("mooncake", "shared-prefix", "multi-turn").
        items: the requests, ``items[i].index == i``; a parent precedes its children.
        params: generator settings, written to result files.
        infinite_cache_hit_rate_blocks: block hit rate an unbounded cache would reach on
            this workload, where it can be known in advance (traces), else None.

    Raises:
        ValueError: items out of order or a parent that does not precede its child.
    """

    name: str
    items: list[WorkItem]
    params: dict = field(default_factory=dict)
    infinite_cache_hit_rate_blocks: float | None = None

    def __post_init__(self) -> None:
        for i, item in enumerate(self.items):
            if item.index != i:
                raise ValueError(f"workload item {i} has index {item.index}; items must be numbered in order")
            if item.parent is not None and not 0 <= item.parent < i:
                raise ValueError(f"workload item {i}: parent {item.parent} must be an earlier item")
            if item.max_tokens < 1:
                raise ValueError(f"workload item {i}: max_tokens must be >= 1, got {item.max_tokens}")
            if item.parent is None and not item.tokens:
                raise ValueError(f"workload item {i}: empty prompt")

    def __len__(self) -> int:
        return len(self.items)

    @property
    def timestamps_s(self) -> list[float | None]:
        return [it.timestamp_s for it in self.items]

    def head(self, n: int | None) -> "Workload":
        """The first ``n`` items (all when ``n`` is None); parents always come along."""
        if n is None or n >= len(self.items):
            return self
        if n < 0:
            raise ValueError(f"max_requests must be >= 0, got {n}")
        # The unbounded-cache figure was computed over all items; it no longer applies.
        return Workload(self.name, self.items[:n], dict(self.params, max_requests=n), None)


def build_prompt(item: WorkItem, history: Mapping[int, Sequence[int]]) -> list[int]:
    """The prompt to send for ``item``.

    ``history[i]`` is item i's prompt followed by the completion it received. A root item
    sends its own tokens; a later turn sends ``history[parent] + item.tokens``.

    Raises:
        KeyError: the parent has not finished (no history yet).
    """
    if item.parent is None:
        return list(item.tokens)
    if item.parent not in history:
        raise KeyError(f"item {item.index}: turn {item.parent} it extends has not finished")
    return list(history[item.parent]) + list(item.tokens)


def chunk_lengths(num_tokens: int, tokens_per_block: int) -> list[int]:
    """A prompt of ``num_tokens`` cut into blocks of ``tokens_per_block`` (the last may be short)."""
    if tokens_per_block < 1:
        raise ValueError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
    full, rest = divmod(max(0, num_tokens), tokens_per_block)
    return [tokens_per_block] * full + ([rest] if rest else [])


def _cap(n: int, max_output_tokens: int | None) -> int:
    return max(1, min(n, max_output_tokens) if max_output_tokens else n)


def _check_positive(**values) -> None:
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")


def _check_vocab(vocab_size: int) -> None:
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 2:
        raise ValueError(f"vocab_size must be an integer >= 2, got {vocab_size!r}")


def _random_tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(n)]


def mooncake_workload(path: str | Path, max_requests: int | None = None, tokens_per_block: int = 16,
                      max_output_tokens: int | None = None, vocab_size: int = 256, seed: int = 0) -> Workload:
    """Requests of a Mooncake JSON Lines trace, in file order.

    Each prompt is synthesized from the trace's block ids (`bench.trace.synthesize_tokens`,
    K = ``tokens_per_block`` tokens per 512-token block); the completion length is the
    trace's ``output_length`` capped at ``max_output_tokens``; timestamps (ms in the
    trace) become ``timestamp_s``.
    """
    if max_output_tokens is not None and max_output_tokens < 1:
        raise ValueError(f"max_output_tokens must be >= 1, got {max_output_tokens}")
    _check_vocab(vocab_size)
    reqs = load_mooncake(path, max_requests=max_requests)
    items = [WorkItem(index=i, tokens=synthesize_tokens(r, tokens_per_block, vocab_size=vocab_size, seed=seed),
                      max_tokens=_cap(r.output_length, max_output_tokens), timestamp_s=r.timestamp_ms / 1000.0,
                      block_lengths=block_token_lengths(r, tokens_per_block))
             for i, r in enumerate(reqs)]
    hits, total = infinite_cache_hit_rate(reqs)
    params = {"trace": Path(path).name, "tokens_per_block": tokens_per_block, "max_requests": max_requests,
              "max_output_tokens": max_output_tokens, "vocab_size": vocab_size}
    return Workload("mooncake", items, params, round(hits / total, 6) if total else 0.0)


def shared_prefix_workload(num_groups: int, prompts_per_group: int, system_prompt_len: int, question_len: int,
                           output_len: int, vocab_size: int = 256, seed: int = 0, shuffle: bool = True,
                           max_output_tokens: int | None = None) -> Workload:
    """SGLang-style generated shared prefix: groups of prompts that share a system prompt.

    Group g has one random system prompt of ``system_prompt_len`` tokens; each of its
    ``prompts_per_group`` requests is that system prompt followed by its own random
    question of ``question_len`` tokens, and asks for ``output_len`` tokens (capped at
    ``max_output_tokens``). The ``num_groups * prompts_per_group`` requests are shuffled
    with ``seed`` unless ``shuffle`` is False (then group by group). ``group`` records each
    request's group. Modelled on SGLang ``bench_serving``'s generated-shared-prefix
    dataset (flags ``--gsp-num-groups``, ``--gsp-prompts-per-group``,
    ``--gsp-system-prompt-len``, ``--gsp-question-len``, ``--gsp-output-len``).
    """
    _check_positive(num_groups=num_groups, prompts_per_group=prompts_per_group, question_len=question_len,
                    output_len=output_len)
    if isinstance(system_prompt_len, bool) or not isinstance(system_prompt_len, int) or system_prompt_len < 0:
        raise ValueError(f"system_prompt_len must be an integer >= 0, got {system_prompt_len!r}")
    _check_vocab(vocab_size)
    rng = random.Random(seed)
    systems = [_random_tokens(rng, system_prompt_len, vocab_size) for _ in range(num_groups)]
    pairs = [(g, systems[g] + _random_tokens(rng, question_len, vocab_size))
             for g in range(num_groups) for _ in range(prompts_per_group)]
    if shuffle:
        rng.shuffle(pairs)
    items = [WorkItem(index=i, tokens=prompt, max_tokens=_cap(output_len, max_output_tokens), group=g)
             for i, (g, prompt) in enumerate(pairs)]
    params = {"num_groups": num_groups, "prompts_per_group": prompts_per_group,
              "system_prompt_len": system_prompt_len, "question_len": question_len, "output_len": output_len,
              "shuffle": shuffle, "seed": seed, "vocab_size": vocab_size, "max_output_tokens": max_output_tokens}
    return Workload("shared-prefix", items, params)


def multi_turn_workload(num_conversations: int, num_turns: int, system_prompt_len: int, user_len: int,
                        output_len: int, vocab_size: int = 256, seed: int = 0,
                        max_output_tokens: int | None = None) -> Workload:
    """Multi-turn chats: each turn's prompt extends the previous turn's prompt and completion.

    Turn 0 of conversation c is a system prompt of ``system_prompt_len`` tokens (the same
    for every conversation) followed by ``user_len`` random user tokens. Turn t > 0 sends
    turn t-1's prompt, the completion turn t-1 received, then ``user_len`` new user
    tokens; so it can only start once turn t-1 has finished. Every turn asks for
    ``output_len`` tokens (capped at ``max_output_tokens``).

    Items are ordered turn by turn (turn 0 of every conversation, then turn 1, ...), so a
    closed loop interleaves the conversations. ``group`` is the conversation, ``turn``
    the turn number.
    """
    _check_positive(num_conversations=num_conversations, num_turns=num_turns, user_len=user_len,
                    output_len=output_len)
    if isinstance(system_prompt_len, bool) or not isinstance(system_prompt_len, int) or system_prompt_len < 0:
        raise ValueError(f"system_prompt_len must be an integer >= 0, got {system_prompt_len!r}")
    _check_vocab(vocab_size)
    rng = random.Random(seed)
    system = _random_tokens(rng, system_prompt_len, vocab_size)
    user = [[_random_tokens(rng, user_len, vocab_size) for _ in range(num_turns)] for _ in range(num_conversations)]
    items: list[WorkItem] = []
    for t in range(num_turns):
        for c in range(num_conversations):
            index = t * num_conversations + c
            parent = None if t == 0 else (t - 1) * num_conversations + c
            tokens = (system + user[c][0]) if t == 0 else user[c][t]
            items.append(WorkItem(index=index, tokens=tokens, max_tokens=_cap(output_len, max_output_tokens),
                                  parent=parent, group=c, turn=t))
    params = {"num_conversations": num_conversations, "num_turns": num_turns,
              "system_prompt_len": system_prompt_len, "user_len": user_len, "output_len": output_len,
              "seed": seed, "vocab_size": vocab_size, "max_output_tokens": max_output_tokens}
    return Workload("multi-turn", items, params)
