"""TTFT of cold and prefix-hit prompts on the built-in model, measured side by side.

Used by `python -m bench.micro --json` (fields ``ttft_cold_ms``, ``ttft_hit_ms``,
``ttft_suffix_cold_ms``, ``ttft_hit_over_cold``). Each round measures all three cases
back to back with fresh random tokens, so machine noise hits them alike; the medians
over rounds are reported. TTFT is the engine's own arrival-to-first-token time (ms).
"""
from __future__ import annotations

import random
import statistics

PROMPT_TOKENS = 2048
CACHED_TOKENS = 1792


def bench_ttft(rounds: int = 5, seed: int = 0) -> dict:
    from kvmesh.workers.engine import Engine
    from kvmesh.workers.request import SamplingParams

    engine = Engine(num_blocks=(3 * PROMPT_TOKENS) // 16 + 64, block_size=16,
                    max_num_batched_tokens=PROMPT_TOKENS).start()
    rng = random.Random(seed)
    one = SamplingParams(max_tokens=1)

    def toks(n: int) -> list[int]:
        return [rng.randrange(256) for _ in range(n)]

    cold, hit, suffix = [], [], []
    try:
        engine.generate(toks(64), one)  # warm-up: first forward pays one-off allocation costs
        for _ in range(rounds):
            engine.clear_cache()
            cold.append(engine.generate(toks(PROMPT_TOKENS), one)["timing"]["ttft_ms"])
            engine.clear_cache()
            prefix = toks(CACHED_TOKENS)
            engine.generate(prefix + toks(PROMPT_TOKENS - CACHED_TOKENS), one)
            out = engine.generate(prefix + toks(PROMPT_TOKENS - CACHED_TOKENS), one)
            if out["usage"]["cached_tokens"] != CACHED_TOKENS:
                raise RuntimeError(f"expected {CACHED_TOKENS} cached tokens, got {out['usage']['cached_tokens']}")
            hit.append(out["timing"]["ttft_ms"])
            engine.clear_cache()
            suffix.append(engine.generate(toks(PROMPT_TOKENS - CACHED_TOKENS), one)["timing"]["ttft_ms"])
    finally:
        engine.stop()
    c, h, s = statistics.median(cold), statistics.median(hit), statistics.median(suffix)
    return {
        "ttft_cold_ms": round(c, 3),
        "ttft_hit_ms": round(h, 3),
        "ttft_suffix_cold_ms": round(s, 3),
        "ttft_hit_over_cold": round(h / c, 4),
    }


if __name__ == "__main__":
    import json

    print(json.dumps(bench_ttft()))
