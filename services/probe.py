"""A gRPC health probe over mutual TLS, for Kubernetes exec probes.

The kubelet's native gRPC probe speaks plaintext only, so it cannot check a kvmesh port
that runs TLS (every port of a secure cluster). The manifests in ``k8s/`` run, inside
the container::

    python -m kvmesh.services.probe --target 127.0.0.1:50051 --service kvmesh.v1.Worker \\
        --tls-ca /etc/kvmesh/tls/ca.crt --tls-cert /etc/kvmesh/tls/tls.crt --tls-key /etc/kvmesh/tls/tls.key

It calls the standard ``grpc.health.v1.Health/Check`` (the service names the servers
register: ``kvmesh.v1.Worker``, ``kvmesh.v1.Router``) and exits 0 when the answer is
SERVING, 1 otherwise (NOT_SERVING while a server drains, unreachable, or a refused
handshake), printing why on stderr. With TLS it presents the pod's own certificate
(workers require a client certificate) and verifies the server against the cluster CA
under the peer name ``kvmesh-peer`` (`kvmesh.workers.tls.PEER_SERVER_NAME`), so the
certificate need not name 127.0.0.1. Without ``--tls-ca`` it probes in plaintext.

Only ``grpc`` and the health stubs are imported (no model code): a probe costs one
interpreter start and one RPC.
"""
from __future__ import annotations

import argparse
import sys

from kvmesh.services.cli_checks import host_port  # stdlib only: keeps this light

#: Name every kvmesh server certificate carries (kept equal to
#: `kvmesh.workers.tls.PEER_SERVER_NAME`; not imported, to keep the probe light).
PEER_SERVER_NAME = "kvmesh-peer"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvmesh.services.probe",
                                description="gRPC health check of a kvmesh worker or router (exit 0 = SERVING)")
    p.add_argument("--target", required=True, type=host_port, help="HOST:PORT of the gRPC port (in a pod: 127.0.0.1:PORT)")
    p.add_argument("--service", default="", help="health service name (kvmesh.v1.Worker, kvmesh.v1.Router)")
    p.add_argument("--tls-ca", default=None, metavar="PATH", help="cluster CA (PEM); turns TLS on")
    p.add_argument("--tls-cert", default=None, metavar="PATH", help="certificate presented to the server (PEM)")
    p.add_argument("--tls-key", default=None, metavar="PATH", help="private key of --tls-cert (PEM)")
    p.add_argument("--server-name", default=PEER_SERVER_NAME,
                   help=f"name the server certificate is verified against (default {PEER_SERVER_NAME})")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds for the RPC (default 3)")
    return p


def check(target: str, service: str = "", tls_ca: str | None = None, tls_cert: str | None = None,
          tls_key: str | None = None, server_name: str = PEER_SERVER_NAME, timeout: float = 3.0) -> str:
    """The health status name of ``service`` at ``target`` (``SERVING``, ``NOT_SERVING``...).

    Raises:
        ValueError: unreadable certificate files, or only one of ``tls_cert``/``tls_key``.
        grpc.RpcError: the call failed (unreachable, handshake refused, deadline).
    """
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    if bool(tls_cert) != bool(tls_key):
        raise ValueError("give both --tls-cert and --tls-key, or neither")
    if tls_ca:
        try:
            read = lambda path: open(path, "rb").read() if path else None  # noqa: E731
            creds = grpc.ssl_channel_credentials(read(tls_ca), read(tls_key), read(tls_cert))
        except OSError as exc:
            raise ValueError(f"cannot read {exc.filename}: {exc.strerror} (--tls-ca / --tls-cert / --tls-key)") \
                from None
        channel = grpc.secure_channel(target, creds, options=[("grpc.ssl_target_name_override", server_name)])
    else:
        channel = grpc.insecure_channel(target)
    with channel:
        resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                          timeout=timeout)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        status = check(args.target, args.service, args.tls_ca, args.tls_cert, args.tls_key, args.server_name,
                       args.timeout)
    except ValueError as exc:
        print(f"probe: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # grpc.RpcError: unreachable, refused handshake, deadline
        code = getattr(exc, "code", lambda: None)()
        print(f"probe: {args.target} ({args.service or 'overall'}): {code} {getattr(exc, 'details', lambda: exc)()}",
              file=sys.stderr)
        return 1
    if status != "SERVING":
        print(f"probe: {args.target} ({args.service or 'overall'}) is {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
