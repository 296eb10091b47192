"""Regenerate the Python gRPC code for proto/kvmesh.proto.

The generated modules (``kvmesh_pb2.py``, ``kvmesh_pb2_grpc.py``, ``kvmesh_pb2.pyi``)
are committed so that installing kvmesh needs no protoc. Run this after editing the
.proto file::

    make proto                                   # rewrite the generated files
    python -m kvmesh.proto.generate              # the same, without make
    python -m kvmesh.proto.generate --check      # exit 1 if they are stale

It uses grpcio-tools (a test/dev dependency) and writes imports as
``from kvmesh.proto import kvmesh_pb2`` because the repository root is the import root.
"""
from __future__ import annotations

import argparse
import filecmp
import pathlib
import sys
import tempfile

PROTO_DIR = pathlib.Path(__file__).resolve().parent
GENERATED = ("kvmesh_pb2.py", "kvmesh_pb2_grpc.py", "kvmesh_pb2.pyi")


def generate(out_dir: pathlib.Path) -> None:
    """Run protoc on proto/kvmesh.proto, writing the generated modules into ``out_dir``.

    Raises:
        RuntimeError: protoc failed (its exit code is in the message).
    """
    import shutil

    from grpc_tools import protoc  # dev dependency, imported lazily

    with tempfile.TemporaryDirectory() as tmp:
        src = pathlib.Path(tmp) / "src"
        out = pathlib.Path(tmp) / "out"
        (src / "kvmesh" / "proto").mkdir(parents=True)
        out.mkdir()
        shutil.copyfile(PROTO_DIR / "kvmesh.proto", src / "kvmesh" / "proto" / "kvmesh.proto")
        args = [
            "grpc_tools.protoc",
            f"-I{src}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            str(src / "kvmesh" / "proto" / "kvmesh.proto"),
        ]
        rc = protoc.main(args)
        if rc != 0:
            raise RuntimeError(f"protoc exited with {rc}")
        out_dir.mkdir(parents=True, exist_ok=True)
        for name in GENERATED:
            shutil.copyfile(out / "kvmesh" / "proto" / name, out_dir / name)


def is_current() -> bool:
    """True when the committed generated files equal a fresh generation."""
    with tempfile.TemporaryDirectory() as tmp:
        generate(pathlib.Path(tmp))
        return all(
            (PROTO_DIR / name).exists()
            and filecmp.cmp(PROTO_DIR / name, pathlib.Path(tmp) / name, shallow=False)
            for name in GENERATED
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when generated code is stale")
    args = parser.parse_args(argv)
    if args.check:
        ok = is_current()
        print("generated code is current" if ok
              else "generated code is stale: run make proto (python -m kvmesh.proto.generate)")
        return 0 if ok else 1
    generate(PROTO_DIR)
    return 0


if __name__ == "__main__":
    sys.exit(main())
