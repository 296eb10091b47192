"""The optional C++ CPU paged-attention kernel (``workers/paged_attention.cpp``): build and load.

The kernel is one torch operator, ``torch.ops.kvmesh.paged_attention``, that attends every
sequence of a step (decodes, cold prefills, chunks after cached context) in one call per
layer, reading K/V straight from the paged pool (see the source's header and docs/ENGINE.md).

It is built once at set-up time (``python -m kvmesh.workers.attn_kernel --build``, run by
scripts/setup.sh) into ``<sys.prefix>/kvmesh-ext/paged_attention`` with
``torch.utils.cpp_extension`` (``-O3 -march=native -ffp-contract=off -fopenmp``: no multiply-add
fused but those the source asks for, which the bit-identity of cold and cached rows relies
on), and loaded lazily by `get` on first use. Nothing is compiled at run time. `get` returns
``None`` (and `status` says why) when:

* ``KVMESH_ATTN=torch`` is set (forces torch's SDPA path);
* the library was not built (no compiler at set-up, a failed build), or was built from
  another source, for another torch, or on a CPU with instruction-set extensions this one
  lacks (``-march=native`` code could fault here);
* loading it raises anything.

`workers.model.PagedAttention` then runs torch's scaled_dot_product_attention as before.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import torch

__all__ = ["build", "build_dir", "describe_path", "get", "status", "supports"]

_NAME = "kvmesh_paged_attention"
_SOURCE = Path(__file__).with_name("paged_attention.cpp")
# -fopenmp: at::parallel_for is inline OpenMP code, serial without it; the library then uses
# the libgomp.so.1 torch has already loaded (same soname), so there is one thread pool
_CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"]
_LDFLAGS = ["-fopenmp"]

_loaded = False
_op = None
_status = "not loaded yet"


def build_dir() -> Path:
    """Where the built library and its stamp live: ``$KVMESH_EXT_DIR`` or ``<sys.prefix>/kvmesh-ext/paged_attention``."""
    base = os.environ.get("KVMESH_EXT_DIR")
    return Path(base) if base else Path(sys.prefix) / "kvmesh-ext" / "paged_attention"


#: /proc/cpuinfo flags that name instruction-set extensions ``-march=native`` may use; the
#: others (``hypervisor``, ``tsc_known_freq``, ...) say nothing about what code can run.
_ISA_PREFIXES = ("avx", "sse", "ssse", "fma", "f16c", "bmi", "amx", "popcnt", "abm", "lzcnt", "movbe", "adx",
                 "gfni", "vaes", "vpclmulqdq", "pclmulqdq", "sha", "aes", "cx16", "xsave", "rdrand", "rdseed",
                 "clflushopt", "clwb", "prefetchw", "serialize", "movdir", "waitpkg", "cldemote", "ptwrite")


def _isa_flags(flags) -> list[str]:
    """The instruction-set flags among ``flags`` (see `_ISA_PREFIXES`), sorted."""
    return sorted({f for f in flags if f.startswith(_ISA_PREFIXES)})


def _cpu_flags() -> list[str]:
    """The CPU's instruction-set flags from /proc/cpuinfo (empty where it is not readable)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return _isa_flags(line.split(":", 1)[1].split())
    except OSError:
        pass
    return []


def _stamp() -> dict:
    """What a built library must match to be loaded: source hash, torch version, flags."""
    return {
        "source_sha256": hashlib.sha256(_SOURCE.read_bytes()).hexdigest(),
        "torch": torch.__version__,
        "cflags": _CFLAGS,
    }


def build(verbose: bool = False) -> Path:
    """Compile the kernel into `build_dir` and write its stamp; returns the library path.

    Raises whatever ``torch.utils.cpp_extension.load`` raises when the compiler or ninja is
    missing or compilation fails.
    """
    from torch.utils import cpp_extension

    out = build_dir()
    out.mkdir(parents=True, exist_ok=True)
    bindir = os.path.dirname(sys.executable)  # the virtualenv's ninja, when PATH lacks it
    os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    cpp_extension.load(name=_NAME, sources=[str(_SOURCE)], extra_cflags=_CFLAGS, extra_ldflags=_LDFLAGS, build_directory=str(out),
                       is_python_module=False, verbose=verbose)
    lib = out / f"{_NAME}.so"
    stamp = dict(_stamp(), cpu_flags=_cpu_flags())
    (out / "stamp.json").write_text(json.dumps(stamp))
    return lib


def _load() -> tuple[object | None, str]:
    if os.environ.get("KVMESH_ATTN", "").lower() == "torch":
        return None, "disabled by KVMESH_ATTN=torch"
    out = build_dir()
    lib = out / f"{_NAME}.so"
    try:
        stamp = json.loads((out / "stamp.json").read_text())
    except (OSError, ValueError):
        return None, f"not built ({out}); scripts/setup.sh builds it"
    want = _stamp()
    for key in ("source_sha256", "torch", "cflags"):
        if stamp.get(key) != want[key]:
            what = {"source_sha256": "source (workers/paged_attention.cpp changed)", "torch": "torch version",
                    "cflags": "set of compiler flags"}[key]
            return None, (f"built for another {what}; rebuild with `python -m kvmesh.workers.attn_kernel --build` "
                          f"(or rerun scripts/setup.sh)")
    missing = set(_isa_flags(stamp.get("cpu_flags", []))) - set(_cpu_flags())
    if missing:
        return None, f"built on a CPU with extensions this one lacks: {' '.join(sorted(missing)[:5])}"
    try:
        torch.ops.load_library(str(lib))
        return torch.ops.kvmesh.paged_attention, f"loaded {lib} ({_steps()})"
    except Exception as exc:  # noqa: BLE001 - any load failure means: run torch's path
        return None, f"load failed: {exc}"


def _isa() -> str:
    ops = torch.ops.kvmesh
    return "AVX-512" if ops.built_with_avx512() else "AVX2+FMA" if ops.built_with_avx2() else "portable"


def _steps() -> str:
    """The instruction-set steps the loaded library can run here, most specific first."""
    ops = torch.ops.kvmesh
    names = []
    if hasattr(ops, "amx_active") and ops.amx_active():
        names.append("AMX tiles for bf16")
    if ops.built_with_avx512_bf16():
        names.append("AVX512_BF16 pairs")
    names.append(_isa())
    return ", ".join(names)


def describe_path(dtype: torch.dtype, pool_dtype: torch.dtype, head_dim: int, block_size: int) -> str:
    """The attention path a CPU engine with these dtypes and shapes takes, in a few words:
    the kernel's steps for them (AMX tiles, AVX512_BF16 pairs, or fp32 vector code), or
    torch's SDPA and why."""
    if get() is None:
        return f"torch SDPA ({status()})"
    if not supports(torch.device("cpu"), dtype, pool_dtype):
        return f"torch SDPA (the C++ kernel serves float32/bfloat16 only, not {str(dtype).replace('torch.', '')})"
    ops = torch.ops.kvmesh
    bf16 = dtype == torch.bfloat16 and pool_dtype == torch.bfloat16 and head_dim % 2 == 0
    if bf16 and ops.amx_serves(head_dim, block_size):
        steps = "AMX tiles"
    elif bf16 and ops.built_with_avx512_bf16():
        steps = "AVX512_BF16 pairs"
    else:
        steps = f"fp32 {_isa()}"
    return f"C++ kernel ({steps})"


def get():
    """The ``torch.ops.kvmesh.paged_attention`` operator, or ``None`` if unavailable (see `status`)."""
    global _loaded, _op, _status
    if not _loaded:
        _op, _status = _load()
        _loaded = True
    return _op


def status() -> str:
    """One line: whether the kernel is in use, and if not, why."""
    get()
    return _status


def supports(device: torch.device, dtype: torch.dtype, pool_dtype: torch.dtype) -> bool:
    """Whether the kernel can serve a step on ``device`` with activations/pool of these dtypes."""
    ok = (torch.float32, torch.bfloat16)
    return device.type == "cpu" and dtype in ok and pool_dtype in ok and get() is not None


def _main(argv: list[str]) -> int:
    if argv[:1] == ["--build"]:
        try:
            lib = build(verbose="-v" in argv)
        except Exception as exc:  # noqa: BLE001 - reported in one line, set-up goes on
            msg = str(exc).strip().splitlines()
            print(f"attention kernel not built ({msg[-1] if msg else type(exc).__name__}); "
                  "torch's attention is used", file=sys.stderr)
            return 1
        print(f"attention kernel built: {lib}", file=sys.stderr)
        return 0
    print(status())
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
