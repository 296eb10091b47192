"""The C++ attention kernel against torch's SDPA path, side by side in one process.

``python -m kvmesh.bench.attn_kernel [--rounds N] [--threads N] [--json]``

Model: the issue-12 shape (`bench.peer_engine.model_config`: 8 layers, hidden 512, 8 query
heads / 2 KV heads, head_dim 64) computing in float32 and in bfloat16 (``--compute-dtypes``)
over a bfloat16 pool, block size 32, random weights and random cached K/V. Scenarios:

* per layer, layer 0's whole attention sub-layer (`PagedAttention.forward`: q/k/v
  projection, RoPE, K/V write, attention, output projection), which is what a step runs per
  layer: cold prefill of 512 / 2,048 / 8,191 tokens; decode of 16 sequences with 530-560
  tokens of context; mixed = 15 such decodes + a 256-token chunk after 256 cached tokens;
* the whole model's forward step: cold prefill of 512 and 2,048 tokens.

Each round runs the kernel and the torch path back to back (alternating which goes first),
so machine noise hits both alike. Reported per scenario: median wall-clock ms of each
(``kernel_ms``, ``torch_ms``) and ``ratio`` = median over rounds of kernel / torch (below 1:
the kernel is faster); the same for CPU time of the process, all threads
(``kernel_cpu_ms``, ``torch_cpu_ms``, ``cpu_ratio``), which a shared machine disturbs less.
On a CPU where the kernel's AMX path is active, the bfloat16 run also pairs that path with
the AVX512_BF16 pair path it replaces (``set_amx(False)``) per layer scenario:
``layer_amx_vs_pairs`` (``amx_ms``, ``pairs_ms``, ``ratio`` = AMX / pairs).
Exits with status 2 if the kernel is not available.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import torch


def _meta(query_lens, context_lens, block_size, rng):
    from kvmesh.workers.model import AttentionMetadata

    free = list(range(1, 4096))
    rng.shuffle(free)
    tables = []
    for q, c in zip(query_lens, context_lens):
        tables.append([free.pop() for _ in range(-(-(q + c) // block_size))])
    return AttentionMetadata.build(query_lens, context_lens, tables, block_size)


def _scenarios(rng):
    dec_ctx = [rng.randrange(530, 561) for _ in range(16)]
    return {
        "prefill_512": ([512], [0]),
        "prefill_2048": ([2048], [0]),
        "prefill_8191": ([8191], [0]),
        "decode_16x544": ([1] * 16, dec_ctx),
        "mixed_15dec_256after256": ([1] * 15 + [256], dec_ctx[:15] + [256]),
    }


def _paired(fns: dict, rounds: int) -> dict:
    """Run the two entries of ``fns`` (first: the one measured, second: the reference;
    ``kernel`` and ``torch`` by default) alternately; medians and the paired ratio first /
    second, keyed ``<name>_ms``, ``ratio``, ``<name>_cpu_ms``, ``cpu_ratio``."""
    first, second = fns
    wall = {first: [], second: []}
    cpu = {first: [], second: []}
    for fn in fns.values():
        fn()  # warm-up
    for r in range(rounds):
        order = (first, second) if r % 2 == 0 else (second, first)
        for name in order:
            c0, t0 = time.process_time(), time.perf_counter()
            fns[name]()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)

    def ratio(d):
        return round(statistics.median(k / t for k, t in zip(d[first], d[second])), 3)

    return {
        f"{first}_ms": round(statistics.median(wall[first]) * 1e3, 2),
        f"{second}_ms": round(statistics.median(wall[second]) * 1e3, 2),
        "ratio": ratio(wall),
        f"{first}_cpu_ms": round(statistics.median(cpu[first]) * 1e3, 2),
        f"{second}_cpu_ms": round(statistics.median(cpu[second]) * 1e3, 2),
        "cpu_ratio": ratio(cpu),
    }


def _with_amx(on: bool, fn):
    """``fn`` run with the kernel's AMX path allowed (on) or not."""
    def call():
        torch.ops.kvmesh.set_amx(on)
        try:
            return fn()
        finally:
            torch.ops.kvmesh.set_amx(True)
    return call


def run(rounds: int = 5, block_size: int = 32, seed: int = 0, compute_dtype: str = "bfloat16") -> dict:
    """All scenarios with the model in ``compute_dtype`` over a bfloat16 pool; see the module doc."""
    from kvmesh.bench.peer_engine import model_config
    from kvmesh.workers import attn_kernel
    from kvmesh.workers.loader import init_random_weights
    from kvmesh.workers.model import DecoderModel, allocate_kv_cache

    if attn_kernel.get() is None:
        raise RuntimeError(f"attention kernel unavailable: {attn_kernel.status()}")
    if compute_dtype not in ("float32", "bfloat16"):
        raise RuntimeError(f"the kernel computes in float32 or bfloat16, not {compute_dtype}")
    cfg = model_config("bfloat16")
    model = DecoderModel(cfg)
    init_random_weights(model, seed=seed)
    model.to(getattr(torch, compute_dtype)).eval()
    act = getattr(torch, compute_dtype)
    kv = allocate_kv_cache(cfg, 4096, block_size, dtype=torch.bfloat16)
    kv.normal_(generator=torch.Generator().manual_seed(seed))
    rng = random.Random(seed)
    attn = model.layers[0].self_attn
    out: dict = {"threads": torch.get_num_threads(), "rounds": rounds, "block_size": block_size,
                 "compute_dtype": compute_dtype, "pool_dtype": "bfloat16", "layer": {}, "model_step": {}}
    # on an AMX CPU, bf16: the kernel's tile path against its AVX512_BF16 pair path as well
    amx = act == torch.bfloat16 and torch.ops.kvmesh.amx_active()
    if amx:
        out["layer_amx_vs_pairs"] = {}
    with torch.inference_mode():
        for name, (q_lens, ctx) in _scenarios(rng).items():
            meta = _meta(q_lens, ctx, block_size, rng)
            x = torch.randn(meta.num_tokens, cfg.hidden_size, dtype=act)
            cos, sin = model._rope(meta.positions(), x.dtype)
            slots = meta.slot_mapping
            blocks, offsets = slots // block_size, slots % block_size
            plans = {b: model._plan(meta, x.device, kv.dtype, backend=b) for b in ("kernel", "torch")}
            fns = {b: (lambda p=p: attn(x, cos, sin, kv, 0, blocks, offsets, p, block_size)) for b, p in plans.items()}
            n_rounds = rounds if "8191" not in name else max(3, rounds // 2)
            out["layer"][name] = _paired(fns, n_rounds)
            print(f"{compute_dtype} layer {name}: {out['layer'][name]}", file=sys.stderr)
            if amx:
                both = {"amx": _with_amx(True, fns["kernel"]), "pairs": _with_amx(False, fns["kernel"])}
                out["layer_amx_vs_pairs"][name] = _paired(both, n_rounds)
                print(f"{compute_dtype} layer {name} AMX vs pairs: {out['layer_amx_vs_pairs'][name]}", file=sys.stderr)
        for n in (512, 2048):
            meta = _meta([n], [0], block_size, rng)
            ids = torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(n))
            pos = meta.positions()

            def step(backend, meta=meta, ids=ids, pos=pos):
                model.attention_backend = backend
                try:
                    return model(ids, pos, meta, kv)
                finally:
                    model.attention_backend = "auto"

            out["model_step"][f"prefill_{n}"] = _paired({b: (lambda b=b: step(b)) for b in ("kernel", "torch")}, rounds)
            print(f"{compute_dtype} model step prefill_{n}: {out['model_step'][f'prefill_{n}']}", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--compute-dtypes", default="float32,bfloat16",
                    help="model dtypes to run, comma-separated (the pool is bfloat16; float32 over a bf16 pool "
                         "is what a worker runs on CPUs without AMX)")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout, keyed by compute dtype")
    ap.epilog = ("ratio: the first path's time over the second's, the median of the rounds' paired ratios "
                 "(below 1: the first is faster; not always the ratio of the two medians)")
    args = ap.parse_args(argv)
    dtypes = args.compute_dtypes.split(",")
    bad = [d for d in dtypes if d not in ("float32", "bfloat16")]
    if bad:
        ap.error(f"--compute-dtypes: the kernel computes in float32 or bfloat16, not {', '.join(bad)}")
    if args.rounds < 1 or args.block_size < 1 or args.threads < 0:
        ap.error("--rounds and --block-size must be >= 1, --threads >= 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    res = {}
    try:
        for dt in dtypes:
            res[dt] = run(args.rounds, args.block_size, compute_dtype=dt)
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(res))
        return 0
    for dt, one in res.items():
        for group in ("layer", "model_step", "layer_amx_vs_pairs"):
            for name, r in one.get(group, {}).items():
                a, b = ("amx", "pairs") if group == "layer_amx_vs_pairs" else ("kernel", "torch")
                print(f"{dt:8s} {group:10s} {name:24s} wall: {a} {r[a + '_ms']:8.2f} ms  {b} "
                      f"{r[b + '_ms']:8.2f} ms  ratio {r['ratio']:.3f} | CPU: {a} {r[a + '_cpu_ms']:8.2f} ms  "
                      f"{b} {r[b + '_cpu_ms']:8.2f} ms  ratio {r['cpu_ratio']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
