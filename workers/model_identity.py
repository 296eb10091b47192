"""The identity of a model checkpoint: what goes into the cache namespace as ``model_id``.

Two processes may share KV blocks (and token ids) only if they run the same weights, in
the same dtype, under the same config and tokenizer. `checkpoint_fingerprint` hashes all
of that:

* ``config.json`` (architecture, ``torch_dtype``, RoPE, special token ids);
* every tokenizer file the worker reads (``tokenizer.json``, ``generation_config.json``)
  and the usual companions (``tokenizer_config.json``, ``special_tokens_map.json``,
  ``tokenizer.model``); a missing file is hashed as missing, so a folder without
  ``tokenizer.json`` (byte-tokenizer fallback) never matches one with it;
* every byte of every ``*.safetensors`` file, streamed in ``CHUNK_BYTES`` pieces through
  xxh3-128 (never the whole file in memory; ~10 GB/s, so a 16 GB checkpoint costs a
  couple of seconds of a cold page cache's read time).

A router never runs the model: what it must share with the workers is the tokenizer.
`tokenizer_fingerprint` hashes only what decides the token ids of a text or chat prompt
(``config.json``, the tokenizer files above and ``chat_template.jinja``), never a weight
file; workers publish it in their lease (``tokenizer_id``) next to ``model_id``, so a
router checks its tokenizer against theirs without reading the weights
(`services.membership`). ``model_id``, weights included, stays what names the KV cache.

Whole-file digests are cached in ``$KVMESH_CACHE_DIR`` (default ``~/.cache/kvmesh``)
``/weight-digests.json``, keyed by the file's real path, device, inode, size, mtime and
ctime (ns), so a restart reads no weight file twice for its identity. ctime is in the key
because mtime alone can be set back (``cp -p``, ``rsync -t``, ``os.utime``) over new
weights of the same size; the kernel sets ctime on every write and metadata change. A cache that cannot be read or written is
ignored (the digest is recomputed).
"""
from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import tempfile

import xxhash

log = logging.getLogger(__name__)

#: Bytes read per step when hashing a weight file.
CHUNK_BYTES = 16 << 20
#: Files besides the weights that decide KV contents or token ids, hashed in this order.
IDENTITY_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                  "special_tokens_map.json", "tokenizer.model")
#: Version of this recipe; a change gives every checkpoint a new id.
IDENTITY_VERSION = 2


#: Files whose bytes decide the token ids of a text or chat prompt, hashed in this order by
#: `tokenizer_fingerprint`: config.json (vocabulary size, BOS/EOS ids), the tokenizer files
#: of `IDENTITY_FILES` (generation_config.json: extra EOS ids; tokenizer_config.json: the
#: chat template, special tokens) and ``chat_template.jinja`` (the chat template when
#: tokenizer_config.json has none). Everything but the weights.
TOKENIZER_FILES = IDENTITY_FILES + ("chat_template.jinja",)
#: Version of the `tokenizer_fingerprint` recipe; a change gives every tokenizer a new id.
TOKENIZER_IDENTITY_VERSION = 1
#: How every tokenizer id of this recipe starts (`tokenizer_fingerprint`).
TOKENIZER_ID_PREFIX = f"tok-v{TOKENIZER_IDENTITY_VERSION}-"


def _cache_path() -> str:
    root = os.environ.get("KVMESH_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kvmesh")
    return os.path.join(root, "weight-digests.json")


def _load_cache() -> dict:
    try:
        with open(_cache_path(), encoding="utf-8") as fh:
            data = json.load(fh)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _save_cache(cache: dict) -> None:
    path = _cache_path()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".digests-")
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(cache, fh)
        os.replace(tmp, path)
    except OSError as exc:
        log.debug("weight digest cache not written (%s)", exc)


def file_digest(path: str, cache: dict | None = None) -> str:
    """xxh3-128 hex digest of a whole file, streamed; ``cache`` (see module doc) is read and
    updated in place when given.

    Raises:
        OSError: the file cannot be read.
    """
    real = os.path.realpath(path)
    st = os.stat(real)
    key = f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"
    if cache is not None:
        hit = cache.get(real)
        if isinstance(hit, dict) and hit.get("key") == key and isinstance(hit.get("digest"), str):
            return hit["digest"]
    h = xxhash.xxh3_128()
    with open(real, "rb") as fh:
        while True:
            chunk = fh.read(CHUNK_BYTES)
            if not chunk:
                break
            h.update(chunk)
    digest = h.hexdigest()
    if cache is not None:
        cache[real] = {"key": key, "digest": digest}
    return digest


def _hash_files(h, model_dir: str, names: tuple[str, ...]) -> None:
    """Feed each file of ``names`` in ``model_dir`` to ``h`` (name, length, bytes; a missing
    one as missing).

    Raises:
        OSError: config.json is missing, or a file cannot be read.
    """
    for name in names:
        path = os.path.join(model_dir, name)
        h.update(name.encode() + b"\0")
        if os.path.isfile(path):
            with open(path, "rb") as fh:
                data = fh.read()
            h.update(len(data).to_bytes(8, "little"))
            h.update(data)
        elif name == "config.json":
            raise OSError(f"{path}: config.json not found")
        else:
            h.update(b"<missing>")


def checkpoint_fingerprint(model_dir: str) -> str:
    """Content hash of a checkpoint directory: 12 hex chars of SHA-256 over the identity
    files and the whole-file digest of every ``*.safetensors`` file (module docstring).

    Raises:
        OSError: config.json or a weight file cannot be read.
    """
    h = hashlib.sha256(f"kvmesh-model-identity-v{IDENTITY_VERSION}".encode())
    _hash_files(h, model_dir, IDENTITY_FILES)
    cache = _load_cache()
    before = dict(cache)
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        h.update(os.path.basename(path).encode() + b"\0")
        h.update(os.path.getsize(path).to_bytes(8, "little"))
        h.update(file_digest(path, cache).encode())
    if cache != before:
        _save_cache(cache)
    return h.hexdigest()[:12]


class NoWeightFiles(OSError):
    """A folder holds no ``*.safetensors`` file: no worker loads it, so no worker names a
    checkpoint with its id (`checkpoint_model_id`)."""


def checkpoint_model_id(model_dir: str) -> str:
    """The id a worker loading ``model_dir`` names its checkpoint with:
    ``"<directory name>@<checkpoint_fingerprint>"`` (`workers.loader.read_config`'s
    ``model_id``). Reads every weight file whose digest is not cached: seconds to minutes.

    Raises:
        NoWeightFiles: ``model_dir`` holds no ``*.safetensors`` file (config and tokenizer
            files only): a fingerprint of those would match no worker's.
        OSError: config.json or a weight file cannot be read.
    """
    if not glob.glob(os.path.join(model_dir, "*.safetensors")):
        raise NoWeightFiles(f"{model_dir} holds no weight files (*.safetensors)")
    return f"{os.path.basename(os.path.normpath(model_dir))}@{checkpoint_fingerprint(model_dir)}"


def tokenizer_fingerprint(model_dir: str | None) -> str:
    """Identity of what turns a text or chat prompt into token ids for ``model_dir``.

    ``TOKENIZER_ID_PREFIX`` + 16 hex chars of SHA-256 over `TOKENIZER_FILES` (each file's
    name, length and bytes; a missing file hashed as missing, so a folder without
    ``tokenizer.json``, served by the byte-level tokenizer, never matches one with it). No
    weight file is read: a few small files, milliseconds. Two folders with equal ids give
    every text the same token ids, stop ids and chat rendering. For ``model_dir`` None (the
    built-in model and its byte-level tokenizer) the id names the built-in model instead.

    Raises:
        OSError: config.json is missing, or a tokenizer file cannot be read.
    """
    if model_dir is None:
        from kvmesh.workers.config import ModelConfig

        return f"{TOKENIZER_ID_PREFIX}builtin-{ModelConfig.tiny().model_id}"
    h = hashlib.sha256(f"kvmesh-tokenizer-identity-v{TOKENIZER_IDENTITY_VERSION}".encode())
    _hash_files(h, model_dir, TOKENIZER_FILES)
    return TOKENIZER_ID_PREFIX + h.hexdigest()[:16]


def comparable_tokenizer_id(value) -> bool:
    """Whether ``value`` (a lease's ``tokenizer_id``) was made by this `tokenizer_fingerprint`
    recipe, so that equal ids mean equal tokenizers and unequal ones different tokenizers.
    False for a missing field (a worker older than the field) or another recipe version."""
    return isinstance(value, str) and value.startswith(TOKENIZER_ID_PREFIX)


def config_without_weights(model_dir: str, model_id: str | None = None):
    """The `workers.config.ModelConfig` of a local HF directory from its config.json alone:
    no weight file is opened (`workers.loader.read_config` also hashes every weight file for
    the id). ``model_id`` defaults to the directory's name: not the id workers hash under.

    Raises:
        ValueError: config.json is missing, unreadable or unsupported (names the file).
    """
    from kvmesh.workers.config import ModelConfig

    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"{path}: config.json not found in model directory {model_dir!r}")
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot parse config.json ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: config.json must hold a JSON object")
    name = model_id if model_id is not None else os.path.basename(os.path.normpath(model_dir))
    try:
        return ModelConfig.from_hf_dict(data, model_id=name)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


#: Separator of the compute-dtype tag in a worker's KV model id (see `kv_model_id`).
COMPUTE_TAG = "+compute="


def kv_model_id(model_id: str, storage_dtype: str, compute_dtype: str) -> str:
    """The id a worker hashes its KV under: ``model_id``, tagged when it computes in another dtype.

    Activations computed in float32 from bfloat16 weights give K/V (even once rounded to the
    bfloat16 pool) that differ in low bits from a bfloat16 forward, so workers of the two
    kinds must not share blocks: ``"M+compute=float32"`` for a bfloat16 checkpoint computed
    in float32, ``"M"`` when compute and storage dtypes agree.
    """
    return model_id if compute_dtype == storage_dtype else f"{model_id}{COMPUTE_TAG}{compute_dtype}"


def base_model_id(kv_id: str) -> str:
    """`kv_model_id` without its compute tag: the checkpoint's own id."""
    return kv_id.split(COMPUTE_TAG, 1)[0]


def cpu_isa() -> str:
    """The widest matrix/vector instruction set this CPU offers torch's kernels: ``amx``,
    ``avx512bf16``, ``avx512``, ``avx2`` or ``base`` (Linux ``/proc/cpuinfo`` flags; ``base``
    elsewhere). Kernels for different sets sum in different orders."""
    flags = _cpu_flags()
    for flag, name in (("amx_bf16", "amx"), ("avx512_bf16", "avx512bf16"), ("avx512f", "avx512"), ("avx2", "avx2")):
        if flag in flags:
            return name
    return "base"


def kv_producer(device: str, attention: str, threads: int | None = None) -> str:
    """What computes this worker's KV, beyond its `kv_model_id`: device kind and instruction
    set (or CUDA compute capability), on a CPU torch's intra-op thread count, torch version
    and attention path.

    Workers that differ here run the same model in the same dtypes but through kernels that
    add in other orders, so their K/V differ in low bits: a prefix one of them computed would
    not give another exactly the output its own cold run gives. They may still serve one
    model behind one router, each from its own cache, but they exchange no KV (the remote
    tier is namespaced by `producer_tag`, and peer fetches need equal producers).

    On a CPU the thread count is part of it: torch's GEMMs (MKL in float32, oneDNN in
    bfloat16), which every CPU attention path uses for the projections and the MLP, split
    some shapes' sums across threads, so one prompt prefilled in chunks at 1 and at 2 threads
    gave K/V up to ~3e-6 apart in float32 (~3e-2 in bfloat16) on the built-in model. The C++
    attention kernel itself gives the same bits at any thread count. On CUDA the kernels run
    on the GPU and the CPU thread count is left out.

    Args:
        device: torch device string ("cpu", "cuda", "cuda:1").
        attention: the attention path (`workers.engine.Engine.describe`'s words).
        threads: intra-op threads the forward runs with (>= 1); default
            ``torch.get_num_threads()`` now, so compute the producer after ``--threads`` is
            applied (`services.cli.make_engine` sets it before it builds the engine). Ignored
            on CUDA.

    Raises:
        ValueError: ``threads`` is given and below 1.
    """
    import torch

    kind = torch.device(device).type
    if kind == "cuda":
        major, minor = torch.cuda.get_device_capability(torch.device(device))
        where = f"cuda sm{major}{minor}"
    else:
        n = torch.get_num_threads() if threads is None else int(threads)
        if n < 1:
            raise ValueError(f"threads must be >= 1, got {threads!r}")
        where = f"{kind} {cpu_isa()}, {n} thread{'' if n == 1 else 's'}"
    return f"{where}, torch {torch.__version__}, {attention}"


def producer_tag(producer: str) -> str:
    """A short key-safe tag of a `kv_producer` string (8 hex digits of its SHA-256)."""
    return hashlib.sha256(producer.encode()).hexdigest()[:8]


def _cpu_flags() -> set[str]:
    """The first ``flags`` line of Linux ``/proc/cpuinfo``; empty elsewhere."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            return next((set(line.split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX bf16 tiles (Linux ``/proc/cpuinfo`` flag ``amx_bf16``); False elsewhere."""
    return "amx_bf16" in _cpu_flags()


#: Shape of the probe GEMM ``[M, K] x [K, N]``: a 256-token chunk through a 1,024-wide layer.
PROBE_SHAPE = (256, 1024, 1024)
_probe_cache: dict[str, tuple[float, float]] = {}


def cpu_gemm_seconds(dtype: str) -> tuple[float, float]:
    """(seconds of one ``PROBE_SHAPE`` GEMM in ``dtype``, the same in float32) on this CPU,
    best of 5 interleaved runs each, with torch's current thread count; measured once per
    process and dtype (about 20-60 ms) on a short-lived thread (`cache_store.fresh_thread`).
    """
    if dtype not in _probe_cache:
        import time

        import torch

        from kvmesh.cache_store.fresh_thread import run_on_fresh_thread

        def probe() -> tuple[float, float]:
            m, k, n = PROBE_SHAPE
            gen = torch.Generator().manual_seed(0)
            xs = {d: torch.randn(m, k, generator=gen).to(getattr(torch, d)) for d in (dtype, "float32")}
            ws = {d: torch.randn(n, k, generator=gen).to(getattr(torch, d)) for d in (dtype, "float32")}
            best = {dtype: float("inf"), "float32": float("inf")}
            for _ in range(6):
                for d in (dtype, "float32"):
                    t = time.perf_counter()
                    torch.nn.functional.linear(xs[d], ws[d])
                    best[d] = min(best[d], time.perf_counter() - t)  # first round: warm-up, usually the max
            return best[dtype], best["float32"]

        _probe_cache[dtype] = run_on_fresh_thread(probe, name="kvmesh-gemm-probe")
    return _probe_cache[dtype]


def resolve_compute_dtype(requested: str, storage_dtype: str, device: str) -> str:
    """The dtype a worker's forward runs in, as a torch dtype name.

    ``"model"`` keeps the checkpoint's dtype; a dtype name is taken as is; ``"auto"`` keeps
    the checkpoint's dtype except for a bfloat16/float16 checkpoint on a CPU: then float32,
    the KV pool staying in the checkpoint's dtype. Why: a 16-bit GEMM (oneDNN on the CPU)
    rounds an output row differently with the number of rows in the call, so a prefix hit,
    which computes only the uncached suffix, did not always give the cold prefill's tokens:
    on a bf16 test checkpoint computing in bfloat16, 5 of 30 prompts' greedy outputs
    differed from the cold run's, and none in float32 (docs/ENGINE.md, "Compute dtype").
    ``"model"`` keeps the checkpoint's dtype: for a bf16 checkpoint 2-4x faster where bf16
    GEMMs are (CPUs with AMX or AVX512_BF16; `cpu_gemm_seconds` times both), slower
    elsewhere, for a deployment that accepts that a cached prefix may change an output. On CUDA ``auto`` keeps the checkpoint's dtype: float32 there
    would take twice the GPU memory and forgo the tensor cores' 16-bit speed, so the same
    caveat holds for a GPU worker.

    Raises:
        ValueError: ``requested`` is none of auto, model, float32, bfloat16, float16.
    """
    from kvmesh.workers.config import normalize_dtype_name

    if requested == "model":
        return storage_dtype
    if requested == "auto":
        if str(device).startswith("cpu") and storage_dtype in ("bfloat16", "float16"):
            return "float32"
        return storage_dtype
    try:
        name = normalize_dtype_name(requested)
    except ValueError:
        raise ValueError(f"compute dtype must be auto, model, float32, bfloat16 or float16, got {requested!r}") from None
    if name not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"compute dtype must be auto, model, float32, bfloat16 or float16, got {requested!r}")
    return name
