"""The committed generated gRPC code matches proto/kvmesh.proto."""
from kvmesh.proto import generate


def test_generated_code_is_current():
    assert generate.is_current(), "proto/kvmesh_pb2*.py are stale: run `python -m proto.generate`"


def test_worker_and_router_share_generate_contract():
    from kvmesh.proto import kvmesh_pb2 as pb

    worker = pb.DESCRIPTOR.services_by_name["Worker"].methods_by_name["Generate"]
    router = pb.DESCRIPTOR.services_by_name["Router"].methods_by_name["Generate"]
    assert worker.input_type is router.input_type
    assert worker.output_type is router.output_type
    assert worker.server_streaming and router.server_streaming
