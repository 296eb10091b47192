"""The committed generated gRPC code matches proto/kvmesh.proto."""
import pathlib
import re

from kvmesh.proto import generate

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_generated_code_is_current():
    assert generate.is_current(), "proto/kvmesh_pb2*.py are stale: run `make proto` (python -m kvmesh.proto.generate)"


def test_regeneration_command_named_in_the_proto_is_the_makefiles():
    """The .proto header and generate.py's docstring name the module `make proto` runs
    (``kvmesh.proto.generate``, importable from any directory), not another spelling."""
    recipe = re.search(r"^proto:.*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M)
    assert recipe, "Makefile has no proto target"
    made = set(re.findall(r"python -m ([\w.]+)", recipe.group(1)))
    assert made == {"kvmesh.proto.generate"}
    header = "".join(line for line in (ROOT / "proto" / "kvmesh.proto").read_text().splitlines(keepends=True)
                     if line.startswith("//"))
    for where, text in (("proto/kvmesh.proto", header), ("proto/generate.py", generate.__doc__)):
        named = set(re.findall(r"python -m ([\w.]+)", text))
        assert named and named <= made, f"{where} names {sorted(named)}; `make proto` runs {sorted(made)}"


def test_worker_and_router_share_generate_contract():
    from kvmesh.proto import kvmesh_pb2 as pb

    worker = pb.DESCRIPTOR.services_by_name["Worker"].methods_by_name["Generate"]
    router = pb.DESCRIPTOR.services_by_name["Router"].methods_by_name["Generate"]
    assert worker.input_type is router.input_type
    assert worker.output_type is router.output_type
    assert worker.server_streaming and router.server_streaming
