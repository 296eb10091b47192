"""Error of the compressed host-tier codecs on the built-in model, against the uncompressed cache.

For each prompt length and each of ``SEEDS`` random prompts ``P``, three engines (host
codec ``none``, ``fp8``, ``int4``) serve the same requests, each with every cached block
loaded through its codec (the prompt is run once, its blocks are moved to the host tier
with ``Engine.offload_device_cache``, then the measured request runs). ``T`` is the
``MAX_TOKENS``-token greedy continuation with the exact codec. Reported per codec and length:

* ``max_logit_diff``: largest ``|logit - exact logit|`` over the vocabulary and over the
  ``MAX_TOKENS`` teacher-forced positions (request ``P + T[:j]``, one token), i.e. with
  identical history in both runs;
* ``rel_logit_diff``: that difference over the exact logits' range (max - min);
* ``forced_agreement``: fraction of teacher-forced positions whose greedy token equals the
  exact one (the per-step agreement);
* ``free_agreement``: fraction of positions of a free-running greedy continuation equal to
  ``T`` (after a first disagreement the histories differ, so one early flip counts against
  every later position);
* ``median_top2_gap``: median gap between the exact logits' two largest values, for scale:
  a codec error near it flips tokens.

``python -m bench.codec_error --json`` prints one JSON object; without ``--json`` a
Markdown table (pasted into docs/TIERS.md). ``DOCUMENTED_MAX_LOGIT_DIFF`` holds the bound
the tests enforce (the measured maxima, rounded up with margin).
"""
from __future__ import annotations

import argparse
import json
import random
import sys

PROMPT_LENGTHS = (64, 256, 1024, 2048)
SEEDS = 4
MAX_TOKENS = 32
BLOCK_SIZE = 16

#: Largest first-token logit difference against the uncompressed cache that the tests
#: accept, per codec, for the built-in model (measured maxima in docs/TIERS.md, rounded up).
DOCUMENTED_MAX_LOGIT_DIFF = {"fp8": 0.1, "int4": 0.35}


def measure(lengths=PROMPT_LENGTHS, seeds: int = SEEDS, max_tokens: int = MAX_TOKENS,
            codecs=("fp8", "int4"), on_prompt=None) -> dict:
    """Run the study; returns ``{codec: {length: {metric: value}}}`` plus the settings used.
    ``on_prompt(length)`` is called after each prompt of ``length`` tokens (progress)."""
    import torch

    from kvmesh.cache_store.tier_store import TierConfig
    from kvmesh.workers.engine import Engine
    from kvmesh.workers.request import SamplingParams

    longest = max(lengths) + max_tokens
    num_blocks = 2 * (-(-longest // BLOCK_SIZE)) + 8
    host_bytes = 4 * num_blocks * 65536 + (1 << 20)
    engines = {name: Engine(num_blocks=num_blocks, block_size=BLOCK_SIZE, max_num_batched_tokens=2048,
                            tiers=TierConfig(host_bytes=host_bytes, host_codec=name, peer_bytes=0)).start()
               for name in ("none", *codecs)}

    def prime(engine, prompt):
        """Cache ``prompt`` from scratch (cold), so later requests load it from the host tier."""
        engine.clear_cache()
        engine.generate(prompt, SamplingParams(max_tokens=1))

    def via_host(engine, seq, n_tokens, min_host_tokens):
        """Move every cached block to the host tier, run ``seq``; returns (tokens, first logits row)."""
        engine.offload_device_cache()
        rows = []
        engine.logits_hook = lambda rid, row: rows.append(row)
        try:
            out = engine.generate(seq, SamplingParams(max_tokens=n_tokens, ignore_eos=True))
        finally:
            engine.logits_hook = None
        if out["usage"]["cached_tokens_by_tier"]["host"] < min_host_tokens:
            raise RuntimeError(f"expected >= {min_host_tokens} host-tier tokens, got {out['usage']}")
        return out["token_ids"], rows[0]

    result: dict = {"settings": {"model": "built-in", "block_size": BLOCK_SIZE, "max_tokens": max_tokens,
                                 "prompts_per_length": seeds, "lengths": list(lengths)}}
    try:
        for length in lengths:
            per = {c: {"diff": [], "rel": [], "forced": [], "free": []} for c in codecs}
            gaps = []
            for seed in range(seeds):
                rng = random.Random(1000 * length + seed)
                prompt = [rng.randrange(256) for _ in range(length)]
                cached = BLOCK_SIZE * ((length - 1) // BLOCK_SIZE)
                prime(engines["none"], prompt)
                ref_tokens, _ = via_host(engines["none"], prompt, max_tokens, cached)
                forced = {}
                for name, engine in engines.items():
                    prime(engine, prompt)
                    forced[name] = [via_host(engine, prompt + ref_tokens[:j], 1, cached)[1]
                                    for j in range(max_tokens)]
                for row in forced["none"]:
                    top = torch.topk(row, 2).values
                    gaps.append(float(top[0] - top[1]))
                for c in codecs:
                    diffs = [float((a - b).abs().max()) for a, b in zip(forced[c], forced["none"])]
                    spans = [float(b.max() - b.min()) for b in forced["none"]]
                    per[c]["diff"].append(max(diffs))
                    per[c]["rel"].append(max(d / s for d, s in zip(diffs, spans)))
                    per[c]["forced"].append(sum(int(a.argmax()) == int(b.argmax())
                                                for a, b in zip(forced[c], forced["none"])) / max_tokens)
                    prime(engines[c], prompt)
                    toks, _ = via_host(engines[c], prompt, max_tokens, cached)
                    per[c]["free"].append(sum(a == b for a, b in zip(toks, ref_tokens)) / max_tokens)
                if on_prompt is not None:
                    on_prompt(length)
            gaps.sort()
            for c in codecs:
                m = per[c]
                result.setdefault(c, {})[str(length)] = {
                    "max_logit_diff": round(max(m["diff"]), 4),
                    "rel_logit_diff": round(max(m["rel"]), 5),
                    "forced_agreement": round(sum(m["forced"]) / len(m["forced"]), 4),
                    "free_agreement": round(sum(m["free"]) / len(m["free"]), 4),
                    "median_top2_gap": round(gaps[len(gaps) // 2], 4),
                }
    finally:
        for e in engines.values():
            e.stop()
    return result


def to_markdown(result: dict) -> str:
    lines = ["| codec | prompt tokens | max logit diff | max diff / logit range | greedy agreement, "
             "teacher-forced | greedy agreement, free-running | median top-2 gap (exact) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for c in ("fp8", "int4"):
        for length, m in result.get(c, {}).items():
            lines.append(f"| {c} | {length} | {m['max_logit_diff']} | {m['rel_logit_diff']} | "
                         f"{m['forced_agreement']:.1%} | {m['free_agreement']:.1%} | {m['median_top2_gap']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvmesh.bench.codec_error", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--lengths", default=",".join(map(str, PROMPT_LENGTHS)),
                        help=f"comma-separated prompt lengths, tokens (default {','.join(map(str, PROMPT_LENGTHS))})")
    parser.add_argument("--seeds", type=int, default=SEEDS, help=f"prompts per length (default {SEEDS})")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    args = parser.parse_args(argv)
    try:
        lengths = tuple(int(x) for x in args.lengths.split(","))
    except ValueError:
        parser.error(f"--lengths {args.lengths!r} is not a comma-separated list of token counts")
    if not lengths or min(lengths) < 1 or args.seeds < 1:
        parser.error("--lengths must be >= 1 tokens each and --seeds >= 1")
    from kvmesh.bench.progress import StepProgress

    # one unit per prompt token: the work of a prompt grows with its length
    with StepProgress("bench.codec_error", sum(lengths) * args.seeds, enabled=not args.no_progress) as bar:
        result = measure(lengths, args.seeds, on_prompt=lambda n: bar.advance(n, step=f"{n}-token prompts"))
    print(json.dumps(result) if args.json else to_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
