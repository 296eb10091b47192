"""Checks the `kvmesh` command line runs before it starts anything, and how it reports a child.

Every check returns a message that names the flag the user typed (``--port``, ``--model``)
or None; the caller prints ``error: MESSAGE`` and exits with status 2 (a usage error),
before any redis-server, worker or router process exists. `last_error_line` pulls the
reason out of a child's log when a process still fails after starting.
"""
from __future__ import annotations

import argparse
import os
import re
import socket
import stat
from pathlib import Path

#: Library field names that appear in messages, and the flag a user types for each.
FLAG_OF_FIELD = {
    "host_bytes": "--host-bytes", "host_codec": "--host-codec", "disk_dir": "--disk-dir",
    "disk_bytes": "--disk-bytes", "disk_codec": "--disk-codec", "write_mode": "--disk-write-mode",
    "peer_bytes": "--peer-bytes", "remote_bytes": "--remote-bytes", "remote_codec": "--remote-codec",
    "remote_url": "--redis-url", "max_fetch_s": "--peer-fetch-max-s", "max_num_seqs": "--max-seqs",
    "max_num_batched_tokens": "--max-batched-tokens", "num_blocks": "--num-blocks", "block_size": "--block-size",
    "max_model_len": "--max-model-len", "load_policy": "--tier-load-policy",
}
_FIELD_RE = re.compile(r"(?<![\w-])(" + "|".join(sorted(FLAG_OF_FIELD, key=len, reverse=True)) + r")(?![\w-])")


def with_flag_names(message: str) -> str:
    """``message`` with library field names (``disk_dir``) replaced by their flags (``--disk-dir``)."""
    return _FIELD_RE.sub(lambda m: FLAG_OF_FIELD[m.group(1)], str(message))


def port_number(text: str) -> int:
    """argparse type of a ``--port``: an int in 0..65535 (0 = any free port).

    Raises:
        argparse.ArgumentTypeError: not an int in that range.
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (1-65535, or 0 for a free one)") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is outside 1-65535 (0 picks a free port)")
    return value


def host_port(text: str) -> str:
    """argparse type of a ``--target``: ``HOST:PORT`` (``[v6]:PORT`` for IPv6) with a port in
    1..65535; returned as given.

    Raises:
        argparse.ArgumentTypeError: no host, no port, or a port outside that range.
    """
    if "://" in text:  # grpc would fail later with "Misformatted domain name"
        raise argparse.ArgumentTypeError(f"{text!r} is a URL; the gRPC API takes HOST:PORT (e.g. 127.0.0.1:50051), "
                                         "and --tls-ca turns TLS on")
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT with a port in 1-65535 (e.g. 127.0.0.1:50051)")
    return text


def _positive(kind: type, flag: str):
    """argparse type: an int >= 1 (``kind`` int) or a finite number > 0 (float); the error
    names ``flag``."""
    noun = "an integer >= 1" if kind is int else "a number > 0"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be {noun} (got {text!r})") from None
        if kind is float and not abs(value) < float("inf"):  # inf, -inf, nan
            raise argparse.ArgumentTypeError(f"{flag} must be a finite number > 0 (got {text})")
        if not 0 < value < float("inf"):
            raise argparse.ArgumentTypeError(f"{flag} must be {'>= 1' if kind is int else '> 0'} (got {value})")
        return value
    return parse


def positive_int(flag: str):
    """argparse type: an int >= 1; anything else raises ``argparse.ArgumentTypeError``
    naming ``flag`` (argparse exits 2 with it)."""
    return _positive(int, flag)


def positive_float(flag: str):
    """argparse type: a finite number > 0 (e.g. a ``--timeout`` in seconds); anything else
    (0, negative, NaN, inf, not a number) raises ``argparse.ArgumentTypeError`` naming
    ``flag`` (argparse exits 2 with it)."""
    return _positive(float, flag)


#: What a ``--cluster`` name may be: it becomes part of every Redis key of the cluster.
CLUSTER_NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")


def cluster_name(text: str) -> str:
    """argparse type of ``--cluster``: 1-64 letters, digits, ``.``, ``_`` or ``-`` (the name
    is part of the cluster's Redis keys).

    Raises:
        argparse.ArgumentTypeError: an empty name, another character, or over 64 characters.
    """
    if not CLUSTER_NAME_RE.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a cluster name: use 1-64 letters, digits, '.', '_' or '-' "
                                         "(it becomes part of the cluster's Redis keys), e.g. kvmesh-v1")
    if any(_NAMESPACE_PART.fullmatch(part) for part in text.split(".")[1:]):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a cluster name: a part after a '.' may not be 8 hexadecimal digits (or k and 8): "
            "the remote tier names its namespaces CLUSTER.TAG and CLUSTER.kID that way, so this cluster's keys "
            "would be taken for another cluster's (e.g. use kvmesh-20261207 rather than kvmesh.20261207)")
    return text


#: A ``.``-separated part that the remote tier appends to a cluster's name: a KV producer tag
#: or a record-key id (`cache_store.tier_store._connect_remote`).
_NAMESPACE_PART = re.compile(r"k?[0-9a-fA-F]{8}")


def port_in_use(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be bound right now (e.g. "Address already in use"), or None.

    Binds a throw-away socket with SO_REUSEADDR, as a gRPC server does, so a port left in
    TIME_WAIT counts as free.
    """
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host.strip("[]") or "0.0.0.0", port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def busy_port_problem(host: str, port: int, flag: str = "--port") -> str | None:
    """A message naming ``flag`` (e.g. ``--http-port``) when ``host:port`` cannot be bound
    now, else None."""
    reason = port_in_use(host, port)
    if reason:
        return (f"{flag} {port}: could not bind {host}:{port} ({reason}); pick another port, "
                f"or pass {flag} 0 for a free one")
    return None


def server_ports_problem(host: str, args: argparse.Namespace, grpc_flag: str | None = "--port") -> str | None:
    """A message naming the flag when a port a `worker` or `router` binds on ``host`` is
    taken: ``args.port`` (``grpc_flag``; None: not checked here), ``--http-port`` and
    ``--metrics-port`` (None = off, 0 = a free one: neither is checked), or when two of them
    name the same port. None when every port can be bound now."""
    bind = host if host not in ("", "::", "[::]") else "0.0.0.0"
    ports = [(grpc_flag, getattr(args, "port", None))] if grpc_flag else []
    ports += [("--http-port", getattr(args, "http_port", None)),
              ("--metrics-port", getattr(args, "metrics_port", None))]
    seen: dict[int, str] = {}
    for flag, port in ports:
        if not port or not 0 < port < 65536:  # off, a free one, or out of range (checked where it is parsed)
            continue
        if port in seen:
            return f"{flag} {port} is the {seen[port]} too; give each server its own port (0: a free one)"
        seen[port] = flag
        problem = busy_port_problem(bind, port, flag)
        if problem:
            return problem
    return None


def can_create_in(folder: str | os.PathLike) -> str | None:
    """Why a file cannot be created in the existing folder ``folder``, or None. Creates and
    removes a temporary file there: ``access()`` says yes to root even where the kernel then
    refuses (``/proc``, read-only mounts)."""
    import tempfile

    try:
        fd, probe = tempfile.mkstemp(prefix=".kvmesh-probe-", dir=folder)
    except OSError as exc:
        return exc.strerror or str(exc)
    os.close(fd)
    try:
        os.unlink(probe)
    except OSError:
        pass
    return None


def others_can_write(folder: str, flag: str = "--disk-dir") -> str | None:
    """Why ``folder`` cannot hold a disk tier's segments because every user may delete or
    replace files in it (`cache_store.disk_tier.others_may_write`), or None. Segment files
    owned by another user are never loaded in any case."""
    from kvmesh.cache_store.disk_tier import others_may_write

    try:
        mode = os.stat(folder).st_mode
    except OSError:
        return None
    if others_may_write(mode):
        return (f"{flag} {folder}: every user of this machine may write the folder (mode "
                f"{stat.S_IMODE(mode):04o}); run `chmod o-w {folder}` (or `chmod +t`) or name a folder of "
                "this user's own (it is created 0700 if missing)")
    return None


def disk_dir_problem(path: str | None, flag: str = "--disk-dir") -> str | None:
    """Why the disk tier cannot use folder ``path`` (an existing file, a path under a file,
    a parent that refuses new folders, a folder that refuses new files), or None (also for
    None). Probes by creating, then removing, a temporary file or folder: ``access()`` says
    yes to root even where the kernel then refuses (``/proc``)."""
    import tempfile

    if not path:
        return None
    full = os.path.abspath(path)
    if os.path.exists(full):
        if not os.path.isdir(full):
            return f"{flag} {path}: exists and is not a folder; name a folder (it is created if missing)"
        reason = can_create_in(full)
        if reason:
            return f"{flag} {path}: the folder is not writable ({reason}); name a folder this user can write"
        return others_can_write(full, flag)
    parent = os.path.dirname(full)
    while not os.path.exists(parent):  # the nearest existing ancestor: the one makedirs starts from
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"{flag} {path}: cannot be created, {parent} is a file, not a folder"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".kvmesh-probe-", dir=parent))
    except OSError as exc:
        return (f"{flag} {path}: cannot be created: making a folder in {parent} fails ({exc.strerror or exc}); "
                "name a folder this user can create")
    return None


#: Bytes per element of the dtypes a KV pool can have (`workers.config.SUPPORTED_DTYPES`).
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def model_shape(model: str | None):
    """The `ModelConfig` the worker will load for ``--model`` (None: the built-in one);
    call after `model_problem` found nothing. Imports torch for a folder (`loader`)."""
    if model is None:
        from kvmesh.workers.config import ModelConfig

        return ModelConfig.tiny()
    from kvmesh.workers.loader import read_config

    return read_config(model)


def kv_block_bytes(cfg, block_size: int) -> int:
    """Bytes one block takes in the worker's KV pool, as `workers.model.allocate_kv_cache`
    allocates it: layers x 2 (K, V) x kv heads x block_size x head_dim x bytes of the
    checkpoint's dtype (the pool keeps it whatever the compute dtype)."""
    return (cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * block_size * cfg.head_dim
            * _DTYPE_BYTES[cfg.dtype])


def available_memory(device: str) -> tuple[int, str] | None:
    """(bytes free for a new allocation on ``device``, where that figure comes from), or None
    when unknown. CPU: ``MemAvailable`` of /proc/meminfo, lowered to the cgroup's
    ``memory.max`` minus its working set (``memory.current`` less ``inactive_file``) when that
    is smaller; CUDA: ``nvidia-smi``'s free memory (no CUDA context is opened here)."""
    if str(device).startswith("cuda"):
        # nvidia-smi, not torch.cuda.mem_get_info: that would open a CUDA context in this
        # process (hundreds of MiB, for as long as `kvmesh up` supervises its workers)
        import subprocess

        index = str(device).partition(":")[2] or "0"
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits",
                                  "-i", index], capture_output=True, text=True, timeout=10)
            free_mib = int(out.stdout.strip().splitlines()[0])
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            return None
        return free_mib * 2**20, f"free on {device}, from nvidia-smi"
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            avail = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    where = "MemAvailable"
    try:
        with open("/sys/fs/cgroup/memory.max", encoding="ascii") as fh:
            limit = fh.read().strip()
        with open("/sys/fs/cgroup/memory.current", encoding="ascii") as fh:
            used = int(fh.read().strip())
        try:  # page cache the kernel can drop does not count, as in the kubelet's working set
            with open("/sys/fs/cgroup/memory.stat", encoding="ascii") as fh:
                used -= next(int(line.split()[1]) for line in fh if line.startswith("inactive_file "))
        except (OSError, StopIteration, ValueError, IndexError):
            pass
        if limit != "max" and int(limit) - used < avail:
            avail, where = max(0, int(limit) - used), "left under this cgroup's memory.max"
    except (OSError, ValueError):
        pass
    return avail, where


def _gib(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def weight_bytes(args: argparse.Namespace, cfg) -> tuple[int, str]:
    """(bytes one worker's weights take in ``args.device`` memory, how they were counted):
    the size of ``--model``'s ``*.safetensors`` files, scaled to the dtype the forward runs in
    (`--compute-dtype`, `workers.model_identity.resolve_compute_dtype`: a bf16 checkpoint
    computed in float32 takes twice its files' size); (0, "") for the built-in model (a few
    MB)."""
    model = getattr(args, "model", None)
    if not model:
        return 0, ""
    from kvmesh.workers.model_identity import resolve_compute_dtype

    stored = sum(p.stat().st_size for p in Path(model).glob("*.safetensors"))
    compute = resolve_compute_dtype(getattr(args, "compute_dtype", "auto"), cfg.dtype, args.device)
    scaled = stored * _DTYPE_BYTES.get(compute, 4) // _DTYPE_BYTES.get(cfg.dtype, 4)
    how = f"{_gib(stored)} of weight files" + (
        f" ({cfg.dtype} computed in {compute}: x{_DTYPE_BYTES[compute] / _DTYPE_BYTES[cfg.dtype]:g}; "
        "--compute-dtype model keeps the checkpoint's dtype)" if scaled != stored else "")
    return scaled, how


def kv_pool_problem(args: argparse.Namespace, cfg, workers: int = 1) -> str | None:
    """A message naming ``--num-blocks`` and ``--block-size`` when the KV pool and the weights
    (`weight_bytes`) of ``workers`` workers (``cfg``: the model's `ModelConfig`) need more
    memory than ``args.device`` has free now, with the figures; else None."""
    per_worker = kv_block_bytes(cfg, args.block_size) * args.num_blocks
    weights, how = weight_bytes(args, cfg)
    need = (per_worker + weights) * workers
    free = available_memory(args.device)
    if free is None or need <= free[0]:
        return None
    each = f" per worker x {workers} workers = {need:,} bytes ({_gib(need)})" if workers > 1 else ""
    besides = f" besides the weights' {weights:,} bytes ({how})" if weights else ""
    return (f"--num-blocks {args.num_blocks} x --block-size {args.block_size}: the KV pool needs {per_worker:,} bytes "
            f"({_gib(per_worker)}){besides}{each} of {args.device} memory ({cfg.num_hidden_layers} layers x 2 x "
            f"{cfg.num_key_value_heads} kv heads x {cfg.head_dim} head_dim x {_DTYPE_BYTES[cfg.dtype]} bytes "
            f"({cfg.dtype}) per token), but {free[0]:,} bytes ({_gib(free[0])}) are available ({free[1]}); "
            "lower --num-blocks or --block-size" + (", or give the worker more memory" if weights else ""))


def tier_block_bytes(cfg, block_size: int, codec: str) -> int:
    """Bytes one block takes in a host tier with ``codec`` (its payload, scales included);
    torch is imported only for a codec other than ``none``."""
    pool = kv_block_bytes(cfg, block_size)
    if codec == "none":
        return pool
    import torch

    from kvmesh.cache_store.kv_codec import make_codec

    shape = (cfg.num_hidden_layers, 2, cfg.num_key_value_heads, block_size, cfg.head_dim)
    return int(make_codec(codec, shape, getattr(torch, cfg.dtype)).payload_bytes)


def unused_tier_flag_problem(args: argparse.Namespace) -> str | None:
    """A message when a tier flag is set but its tier is off, so the flag would do nothing:
    ``--host-codec`` without ``--host-bytes``, ``--disk-codec`` or ``--disk-write-mode back``
    without ``--disk-dir``; None otherwise (as ``--disk-bytes`` without ``--disk-dir`` is)."""
    if getattr(args, "host_codec", "none") != "none" and not getattr(args, "host_bytes", 0):
        return f"--host-codec {args.host_codec} has no host tier to encode: add --host-bytes SIZE (e.g. 4G)"
    if not getattr(args, "disk_dir", None):
        if getattr(args, "disk_codec", "none") != "none":
            return f"--disk-codec {args.disk_codec} has no disk tier to encode: add --disk-dir DIR"
        if getattr(args, "disk_write_mode", "through") != "through":
            return f"--disk-write-mode {args.disk_write_mode} has no disk tier to write: add --disk-dir DIR"
    return None


def host_memory_problem(args: argparse.Namespace, cfg, workers: int = 1) -> str | None:
    """A message naming ``--host-bytes`` and ``--peer-bytes`` when the host memory they take
    (with the KV pool, on a CPU device) for ``workers`` workers is more than is available now;
    both are allocated at start, so a typo (``999T``) would otherwise end in an allocator error."""
    host = int(getattr(args, "host_bytes", 0) or 0)
    peer = int(getattr(args, "peer_bytes", 0) or 0) if host else 0  # staging exists beside a host tier
    pool = kv_block_bytes(cfg, args.block_size) * args.num_blocks if str(args.device).startswith("cpu") else 0
    need = (host + peer + pool) * workers
    free = available_memory("cpu")
    if not host or free is None or need <= free[0]:
        return None
    each = f" per worker x {workers} workers" if workers > 1 else ""
    return (f"--host-bytes {host:,}{f' + --peer-bytes {peer:,}' if peer else ''}"
            f"{f' + the KV pool {pool:,}' if pool else ''} bytes{each} = {need:,} bytes ({_gib(need)}) of host "
            f"memory, but {free[0]:,} bytes ({_gib(free[0])}) are available ({free[1]}); lower --host-bytes")


def tier_size_problem(args: argparse.Namespace, cfg) -> str | None:
    """A message naming ``--host-bytes``, ``--peer-bytes``, ``--disk-bytes`` or
    ``--remote-bytes`` when it is set (> 0) but cannot hold one block of the model ``cfg``
    in its codec: a host tier or staging area of 0 slots, a disk tier whose one-block
    segment is over its capacity, a remote tier smaller than one record. None otherwise."""
    host = getattr(args, "host_bytes", 0) or 0
    if host > 0:
        need = tier_block_bytes(cfg, args.block_size, args.host_codec)
        if host < need:
            return (f"--host-bytes {host} cannot hold one block: a block of {args.block_size} tokens takes {need:,} "
                    f"bytes with --host-codec {args.host_codec}; give at least {need} (e.g. {_size_hint(need)})")
    peer = getattr(args, "peer_bytes", 0) or 0
    # the staging area keeps exact KV: remote reads, disk prefetches, peer fetches
    from kvmesh.cache_store.tier_config import staging_must_fit

    if staging_must_fit(peer, getattr(args, "remote_bytes", 0) or 0):
        need = tier_block_bytes(cfg, args.block_size, "none")
        if peer < need:
            return (f"--peer-bytes {peer} cannot hold one block: a block of {args.block_size} tokens takes {need:,} "
                    f"bytes in the staging area, which the remote tier, disk prefetches and peer fetches read "
                    f"into; give at least {need} (e.g. {_size_hint(need)}), or 0 to turn staging off")
    disk = getattr(args, "disk_bytes", 0) or 0
    remote = getattr(args, "remote_bytes", 0) or 0
    if not (disk > 0 and getattr(args, "disk_dir", None)) and not remote > 0:
        return None
    from kvmesh.cache_store.block_record import HEADER_BYTES  # imports torch

    if disk > 0 and getattr(args, "disk_dir", None):
        from kvmesh.cache_store.disk_tier import SEGMENT_HEADER_BYTES

        need = (SEGMENT_HEADER_BYTES + HEADER_BYTES + 4 * args.block_size
                + tier_block_bytes(cfg, args.block_size, args.disk_codec))
        if disk < need:
            return (f"--disk-bytes {disk} cannot hold one block: a segment with one block of {args.block_size} tokens "
                    f"takes {need:,} bytes with --disk-codec {args.disk_codec}; give at least {need} "
                    f"(e.g. {_size_hint(need)})")
    if remote > 0:  # as `cache_store.tier_store.TierStore` checks it, once the engine is built
        need = HEADER_BYTES + 4 * args.block_size + tier_block_bytes(cfg, args.block_size, args.remote_codec)
        if remote < need:
            return (f"--remote-bytes {remote} cannot hold one block record: one of {args.block_size} tokens takes "
                    f"{need:,} bytes with --remote-codec {args.remote_codec}; give at least {need} "
                    f"(e.g. {_size_hint(need)})")
    return None


def _size_hint(n: int) -> str:
    """``n`` bytes rounded up to a whole K, M or G as the size flags take it."""
    for unit, size in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= size:
            return f"{-(-n // size)}{unit}"
    return str(n)


def worker_resource_problem(args: argparse.Namespace, workers: int = 1) -> str | None:
    """The checks of a worker's resources made before it starts (or `up` starts ``workers``
    of them): ``--disk-dir`` usable, the KV pool within the device's free memory,
    ``--host-bytes`` / ``--disk-bytes`` / ``--remote-bytes`` at least one block. Call after
    the flag, model and device checks passed."""
    problem = disk_dir_problem(getattr(args, "disk_dir", None))
    if problem:
        return problem
    try:
        cfg = model_shape(args.model)
    except ValueError as exc:
        return f"--model: {exc}"
    try:
        return (unused_tier_flag_problem(args) or kv_pool_problem(args, cfg, workers)
                or host_memory_problem(args, cfg, workers) or tier_size_problem(args, cfg))
    except ValueError as exc:  # a codec that cannot encode this model's blocks
        return with_flag_names(exc)


def bind_error_problem(exc: BaseException, port: int, flag: str = "--port") -> str | None:
    """A server's own bind failure (a port taken between the check and the bind) as a
    message naming the flag, or None when ``exc`` is not one. `GrpcHost.start` says "could
    not bind HOST:PORT: ..."; the HTTP and metrics servers already name their flag."""
    text = str(exc)
    if text.startswith("could not bind"):
        return f"{flag} {port}: {text}; pick another port, or pass {flag} 0 for a free one"
    if text.startswith(("--http-port ", "--metrics-port ")) and "could not bind" in text:
        return text
    return None


def run_server(coro, port: int) -> int:
    """``asyncio.run(coro)`` for a server listening on ``--port`` ``port``: 0 when it ends;
    2, with `bind_error_problem`'s message on stderr, when a port was taken between the
    check and the bind. Any other error propagates."""
    import asyncio
    import sys

    try:
        asyncio.run(coro)
    except RuntimeError as exc:
        problem = bind_error_problem(exc, port)
        if problem is None:
            raise
        print(f"error: {problem}", file=sys.stderr)
        return 2
    return 0


def device_problem(device: str) -> str | None:
    """What keeps torch from using ``--device`` here, or None (imports torch unless "cpu")."""
    if device == "cpu":
        return None
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        return f"--device {device!r} is not a torch device (use cpu, cuda or cuda:N)"
    if dev.type == "cpu":
        return None
    if dev.type != "cuda":
        return f"--device {device!r}: kvmesh workers run on cpu or cuda"
    if torch.version.cuda is None:
        return (f"--device {device}: this torch build ({torch.__version__}) has no CUDA support; "
                "use --device cpu or install a CUDA build of torch")
    if not torch.cuda.is_available():
        return f"--device {device}: no CUDA device is visible (check the driver and CUDA_VISIBLE_DEVICES)"
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        return f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) visible"
    return None


def safetensors_problem(path: str) -> str | None:
    """Why ``path`` is not a readable safetensors file (truncated, corrupt header, not one at
    all), or None. Opens it as `safetensors.safe_open` does: header and sizes only."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            f.keys()
    except Exception as exc:  # noqa: BLE001 - SafetensorError, OSError: any means unusable
        return (f"{os.path.basename(path)} is not a readable safetensors file ({str(exc).strip() or type(exc).__name__}); "
                "copy the checkpoint again")
    return None


def model_problem(model: str | None, max_model_len: int | None = None) -> str | None:
    """What is wrong with a ``--model`` folder (missing, no config.json, no weights, no usable
    tokenizer), or with a ``--max-model-len`` (tokens) above the model's context
    (``max_position_embeddings``), or None. ``model`` None is the built-in model. Reads
    config.json and the tokenizer, and every weight file once to name the model
    (`workers.model_identity.checkpoint_fingerprint`, whose digests are cached between starts)."""
    from kvmesh.workers.limits import resolve_max_model_len

    if model is None:
        from kvmesh.workers.config import ModelConfig

        try:
            resolve_max_model_len(max_model_len, ModelConfig.tiny().max_position_embeddings)
        except ValueError as exc:
            return with_flag_names(exc)
        return None
    import glob

    if not os.path.isdir(model):
        what = "a file, not a directory" if os.path.isfile(model) else "no such directory"
        return f"--model {model}: {what} (a local Hugging Face folder with config.json and *.safetensors)"
    from kvmesh.workers.loader import read_config
    from kvmesh.workers.tokenizer import load_tokenizer

    try:
        cfg = read_config(model)
        files = sorted(glob.glob(os.path.join(model, "*.safetensors")))
        if not files:
            return f"--model {model}: no *.safetensors weight files in the folder"
        for path in files:  # the header and its offsets against the file's size; no tensor is read
            problem = safetensors_problem(path)
            if problem:
                return f"--model {model}: {problem}"
        load_tokenizer(model, cfg)
    except ValueError as exc:
        return f"--model: {exc}"
    try:
        resolve_max_model_len(max_model_len, cfg.max_position_embeddings)
    except ValueError as exc:
        return f"{with_flag_names(exc)} (--model {model})"
    return None


def policy_names() -> list[str]:
    """Routing policy names a router accepts."""
    from kvmesh.services.policies import POLICIES

    return sorted(POLICIES)


def policy_problem(policy: str) -> str | None:
    names = policy_names()
    if policy not in names:
        return f"--policy {policy!r} is not a routing policy; choose one of: {', '.join(names)}"
    return None


def engine_flag_problem(args: argparse.Namespace) -> str | None:
    """Range checks of the worker engine flags (`services.cli._add_engine_args`) and the
    peer-fetch flags, in flag names; None when they are fine."""
    for dest in ("block_size", "num_blocks", "max_batched_tokens", "max_seqs"):
        value = getattr(args, dest, None)
        if value is not None and value < 1:
            return f"--{dest.replace('_', '-')} must be >= 1 (got {value})"
    if getattr(args, "max_model_len", None) is not None and args.max_model_len < 1:
        return f"--max-model-len must be >= 1 tokens (got {args.max_model_len})"
    if getattr(args, "threads", 0) is not None and getattr(args, "threads", 0) < 0:
        return f"--threads must be >= 0 (got {args.threads})"
    fetch_s = getattr(args, "peer_fetch_max_s", None)
    if fetch_s is not None and not fetch_s > 0:
        return f"--peer-fetch-max-s must be > 0 seconds (got {fetch_s})"
    if getattr(args, "peer_fetch", None) == "always" and getattr(args, "peer_bytes", None) == 0:
        return ("--peer-fetch always needs --peer-bytes > 0: fetched blocks wait in that staging memory, and "
                "--peer-bytes 0 turns peer fetch off; give both or neither")
    return None


def pool_fit_problem(args: argparse.Namespace) -> str | None:
    """An explicit ``--max-model-len`` whose one request would not fit ``--num-blocks`` of
    ``--block-size`` (`limits.fit_max_model_len_to_pool`), in flag names; None when it fits.
    Call after `model_problem`, so that a limit above the model's own context is reported as
    that first (raising --num-blocks would not help it)."""
    if getattr(args, "max_model_len", None) and getattr(args, "num_blocks", None) and getattr(args, "block_size", None):
        from kvmesh.workers.limits import fit_max_model_len_to_pool

        try:
            fit_max_model_len_to_pool(args.max_model_len, args.max_model_len, args.num_blocks, args.block_size)
        except ValueError as exc:
            return with_flag_names(exc)
    return None


def first_problem(*checks) -> str | None:
    """The first non-None result of ``checks`` (callables), evaluated in order."""
    for check in checks:
        problem = check()
        if problem:
            return problem
    return None


_ERROR_LINE = re.compile(r"^(error: |[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b)")


def last_error_line(log_path: str | None, max_bytes: int = 65536) -> str | None:
    """The last line of a child's log that states an error (``error: ...`` or the final
    ``SomeError: ...`` line of a traceback), else its last non-blank line; None when the log
    is missing or empty. Reads at most the last ``max_bytes`` bytes."""
    if not log_path:
        return None
    try:
        with open(log_path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - max_bytes))
            text = fh.read().decode("utf-8", errors="replace")
    except OSError:
        return None
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if _ERROR_LINE.match(line):
            return line
    return lines[-1] if lines else None


def exited_message(name: str, proc, when: str = "") -> str:
    """One line about a child that exited: its name, exit code (``when``: e.g. " before
    serving"), last error line and log path."""
    import signal

    log = getattr(proc, "log_path", None)
    line = last_error_line(log)
    if line and not _ERROR_LINE.match(line) and not proc.returncode > 0:
        line = None  # a killed process's last line is not its reason
    if proc.returncode is not None and proc.returncode < 0:
        try:
            text = f"{name} was killed by {signal.Signals(-proc.returncode).name}{when}"
        except ValueError:
            text = f"{name} was killed by signal {-proc.returncode}{when}"
    else:
        text = f"{name} exited with code {proc.returncode}{when}"
    if line:
        text += f": {line.removeprefix('error: ')}"
    if log:
        text += f" (log: {log})"
    return text


def live_workers_in(client, cluster: str) -> list[str]:
    """Ids of the workers of ``cluster`` whose lease is live in the Redis ``client`` talks
    to (sorted), from the cluster's worker set and their lease keys (`workers.kv_publisher`)."""
    from kvmesh.workers.kv_publisher import lease_key, workers_key

    ids = sorted(m.decode() if isinstance(m, bytes) else str(m) for m in client.smembers(workers_key(cluster)))
    if not ids:
        return []
    return [w for w, lease in zip(ids, client.mget([lease_key(w, cluster) for w in ids])) if lease is not None]


def up_problem(args: argparse.Namespace, tier_problem: str | None = None) -> str | None:
    """Everything `kvmesh up` can check before it starts Redis or any process: worker count,
    routing policy, engine and tier flags (``tier_problem``: the tier check's message),
    model folder, device, the workers' resources (`worker_resource_problem`: ``--disk-dir``
    usable, tier sizes of at least one block, every worker's KV pool within free memory),
    whether ``--port`` and ``--http-port`` (the router's HTTP front; -1 =
    off) are valid, distinct and free on 127.0.0.1, and whether ``--redis-url`` answers.
    Returns the first problem."""
    def workers():
        if args.workers < 1:
            return f"--workers must be >= 1 (got {args.workers}): a cluster needs a worker to serve requests"
        restarts = getattr(args, "max_restarts", 0)
        if restarts < -1:
            return f"--max-restarts must be -1 (always), 0 (never) or more (got {restarts})"
        return None

    def port():
        return busy_port_problem("127.0.0.1", args.port) if args.port else None

    def http_port():
        http = getattr(args, "http_port", -1)
        if not -1 <= http < 65536:
            return f"--http-port must be a port in [0, 65535], or -1 for no HTTP front (got {http})"
        if http <= 0:
            return None
        if http == args.port:
            return f"--http-port {http} is the router's --port too; give the HTTP front another port (0: a free one)"
        return busy_port_problem("127.0.0.1", http, "--http-port")

    def redis_reachable():
        if not args.redis_url:
            return None
        import redis

        cluster = getattr(args, "cluster", None) or "default"
        try:
            client = redis.Redis.from_url(args.redis_url, socket_timeout=3.0, socket_connect_timeout=3.0)
            client.ping()
            live = live_workers_in(client, cluster)
        except redis.exceptions.RedisError as exc:
            from kvmesh.services.security import redact_url

            text, url = str(exc), redact_url(args.redis_url)
            if isinstance(exc, redis.exceptions.AuthenticationError) or "authenticat" in text.lower() \
                    or "NOAUTH" in text:
                return (f"--redis-url {url}: that Redis needs a password, or another one ({text}); give it in the URL, "
                        "redis://:PASSWORD@HOST:PORT/DB, preferably through KVMESH_REDIS_URL to keep it out of ps")
            return (f"--redis-url {url}: cannot reach it ({exc}); leave --redis-url out to start "
                    "a private one")
        if live:
            return (f"--cluster {cluster}: that Redis already holds live leases of {len(live)} worker(s) under this "
                    f"name ({', '.join(live[:5])}{', ...' if len(live) > 5 else ''}): another cluster is using it; "
                    "give this one another --cluster, or stop that one first")
        return None

    return first_problem(workers, lambda: policy_problem(args.policy), lambda: engine_flag_problem(args),
                         lambda: with_flag_names(tier_problem) if tier_problem else None,
                         lambda: model_problem(args.model, getattr(args, "max_model_len", None)),
                         lambda: pool_fit_problem(args),
                         lambda: device_problem(args.device),
                         lambda: worker_resource_problem(args, args.workers), port, http_port,
                         redis_reachable)


def demo_problem(args: argparse.Namespace) -> str | None:
    """Checks of `kvmesh demo`'s flags before any cluster starts; the first problem or None."""
    for dest in ("workers", "tokens_per_block", "max_output_tokens", "concurrency", "num_blocks"):
        value = getattr(args, dest, None)
        if value is not None and value < 1:
            return f"--{dest.replace('_', '-')} must be >= 1 (got {value})"
    if args.max_requests is not None and args.max_requests < 1:
        return f"--max-requests must be >= 1 (got {args.max_requests})"
    names = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not names:
        return "--policies names no routing policy"
    for name in names:
        problem = policy_problem(name)
        if problem:
            return problem.replace("--policy", "--policies", 1)
    if args.trace is not None and not os.path.isfile(args.trace):
        return f"--trace {args.trace}: no such file (a Mooncake-format JSONL trace)"
    return None


def os_error_message(args: argparse.Namespace, exc: OSError) -> str:
    """One line for a file error, naming the flag whose value is the file when there is one
    (``--trace missing.jsonl: No such file or directory``)."""
    name = os.fspath(exc.filename) if exc.filename is not None else None
    flag = next((f"--{dest.replace('_', '-')}" for dest, value in vars(args).items()
                 if name is not None and isinstance(value, str) and value == name), None)
    reason = exc.strerror or str(exc)
    if flag:
        return f"{flag} {name}: {reason}"
    return f"{name}: {reason}" if name else reason
