"""The rendered `cpu` overlay's exact command lines, run as local processes.

Every container of the overlay (Redis, both router replicas, both worker replicas) is
started with the command line the kubelet would give it, changed only where a pod and a
laptop differ: downward-API values (pod IP -> 127.0.0.1, pod name kept), wildcard binds
-> 127.0.0.1, Service DNS names -> 127.0.0.1, each container port -> a free port, writable
mount paths -> temporary folders. Readiness is the manifest's own gRPC probe (same
service name). Then trace-sample requests go through both routers, and every output
equals the same prompt recomputed on a worker whose every tier was emptied first.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.bench.trace import load_mooncake, synthesize_tokens
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.proto import kvmesh_pb2_grpc as pb_grpc
from kvmesh.services.cli import generate
from kvmesh.services.procs import free_port, python_cmd, spawn, stop_process
from tests._k8s import container_argv, container_env, find, render

pytestmark = pytest.mark.slow
SAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "data",
                      "mooncake_conversation_sample.jsonl")


def wait_probe(address: str, service: str, proc, timeout: float = 120.0) -> None:
    """What the kubelet's gRPC readiness probe does: Health/Check(service) == SERVING."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while True:
            assert proc.poll() is None, f"process for {address} exited ({proc.returncode}); log {proc.log_path}"
            try:
                if stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            assert time.monotonic() < deadline, f"{address} ({service}) not ready after {timeout} s"
            time.sleep(0.2)


def localize(argv: list[str], ports: dict[int, int], paths: dict[str, str]) -> list[str]:
    """The pod's command line for a local process (see the module docstring)."""
    out = []
    for a in argv:
        if a == "0.0.0.0":
            a = "127.0.0.1"
        if a.isdigit() and int(a) in ports:
            a = str(ports[int(a)])
        host, sep, port = a.rpartition(":")
        if sep and port.isdigit() and int(port) in ports and host.replace(".", "").isdigit():
            a = f"{host}:{ports[int(port)]}"
        out.append(paths.get(a, a))
    return out


class Pod:
    def __init__(self, name: str, template: dict, objs: list[dict], service_map: dict[str, str], tmp, ip: str):
        self.name = name
        (c,) = template["spec"]["containers"]
        self.container = c
        self.ports = {p["containerPort"]: free_port() for p in c.get("ports", [])}
        env = container_env(c, objs, {"status.podIP": ip, "metadata.name": name})
        # Service DNS names -> loopback, Service ports -> the local port of the pod behind them
        for svc, local in service_map.items():
            env = {k: v.replace(svc, local) for k, v in env.items()}
        self.env = env
        paths = {}
        for m in c.get("volumeMounts", []):
            if not m.get("readOnly"):
                paths[m["mountPath"]] = str(tmp / name / m["name"])
                os.makedirs(paths[m["mountPath"]], exist_ok=True)
        self.argv = localize(container_argv(c, env), self.ports, paths)
        self.tmp = tmp
        self.proc = None

    def start(self):
        exe, *rest = self.argv
        if exe == "kvmesh":
            cmd = python_cmd(*rest)
        else:
            assert shutil.which(exe), f"{exe} not on PATH"
            cmd = [shutil.which(exe), *rest]
        env = {k: v for k, v in self.env.items()}
        env["HOME"] = str(self.tmp / self.name / "home")
        self.proc = spawn(cmd, str(self.tmp / f"{self.name}.log"), env=env)
        return self

    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.ports[self.container['readinessProbe']['grpc']['port']]}"

    def wait_ready(self):
        probe = self.container["readinessProbe"]
        if "grpc" in probe:
            wait_probe(self.grpc_address(), probe["grpc"]["service"], self.proc)
        else:
            port = self.ports[next(p["containerPort"] for p in self.container["ports"]
                                   if p["name"] == probe["tcpSocket"]["port"])]
            import socket

            deadline = time.monotonic() + 30
            while True:
                assert self.proc.poll() is None, f"{self.name} exited; log {self.proc.log_path}"
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    return
                except OSError:
                    assert time.monotonic() < deadline, f"{self.name} not ready"
                    time.sleep(0.1)


def pods_of(objs, kind: str, name: str) -> list[tuple[str, dict]]:
    w = find(objs, kind, name)[0]
    n = w["spec"].get("replicas", 1)
    if kind == "StatefulSet":
        return [(f"{name}-{i}", w["spec"]["template"]) for i in range(n)]
    return [(f"{name}-pod{i}", w["spec"]["template"]) for i in range(n)]


@pytest.fixture(scope="module")
def cpu_cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("k8s-cpu")
    objs = render("cpu")
    started: list[Pod] = []
    try:
        (redis_name, redis_tpl), = pods_of(objs, "StatefulSet", "kvmesh-redis")
        redis = Pod(redis_name, redis_tpl, objs, {}, tmp, "127.0.0.1")
        svc_port = find(objs, "Service", "kvmesh-redis")[0]["spec"]["ports"][0]["port"]
        redis_local = redis.ports[svc_port]
        started.append(redis.start())
        redis.wait_ready()
        # every env value naming the Service host:port points at the local Redis
        service_map = {f"kvmesh-redis:{svc_port}": f"127.0.0.1:{redis_local}"}
        workers = [Pod(n, t, objs, service_map, tmp, "127.0.0.1")
                   for n, t in pods_of(objs, "StatefulSet", "kvmesh-worker")]
        routers = [Pod(n, t, objs, service_map, tmp, "127.0.0.1")
                   for n, t in pods_of(objs, "Deployment", "kvmesh-router")]
        for p in workers + routers:
            started.append(p.start())
        for p in workers + routers:
            p.wait_ready()
        yield {"objs": objs, "redis": redis, "workers": workers, "routers": routers}
    finally:
        for p in reversed(started):   # SIGTERM to all (the kubelet's order), then wait for each
            if p.proc.poll() is None:
                p.proc.send_signal(signal.SIGTERM)
        for p in reversed(started):
            try:
                p.proc.wait(timeout=30)   # well inside terminationGracePeriodSeconds
            except subprocess.TimeoutExpired:
                stop_process(p.proc)
            assert p.proc.returncode == 0, f"{p.name} did not drain cleanly on SIGTERM (log {p.proc.log_path})"


def router_sees(address: str) -> set[str]:
    with grpc.insecure_channel(address) as ch:
        return {w.worker_id for w in pb_grpc.RouterStub(ch).Status(pb.RouterStatusRequest(), timeout=5).workers}


def test_command_lines_were_localized_only(cpu_cluster):
    """The processes run the manifest's arguments: same flags, only addresses/ports/paths changed."""
    w = cpu_cluster["workers"][0]
    argv = w.argv
    assert argv[argv.index("--worker-id") + 1] == "kvmesh-worker-0"
    assert argv[argv.index("--advertise") + 1] == f"127.0.0.1:{w.ports[50051]}"
    assert "--redis-url" in argv and argv[argv.index("--redis-url") + 1].startswith("redis://:kvmesh-dev-only@127.0.0.1:")
    assert "--requirepass" in cpu_cluster["redis"].argv


def test_trace_through_both_routers_equals_cold(cpu_cluster):
    workers = {p.name for p in cpu_cluster["workers"]}
    routers = [p.grpc_address() for p in cpu_cluster["routers"]]
    deadline = time.monotonic() + 30
    while not all(router_sees(r) >= workers for r in routers):
        assert time.monotonic() < deadline, f"routers see {[router_sees(r) for r in routers]}, want {workers}"
        time.sleep(0.2)

    reqs = [r for r in load_mooncake(SAMPLE, max_requests=40) if r.num_blocks <= 12][:5]
    assert len(reqs) == 5
    prompts = [synthesize_tokens(r, 16) for r in reqs]
    prompts += prompts[:2]   # repeats: served from the cache the first pass left
    served = []
    for i, ids in enumerate(prompts):
        served.append(generate(routers[i % 2], token_ids=ids, max_tokens=4, timeout=120))
    assert {o["worker_id"] for o in served} <= workers
    assert sum(o["usage"]["cached_tokens"] for o in served[-2:]) > 0, "repeated prompts reuse cached blocks"

    # cold reference: one of the cluster's workers, called directly with every tier emptied first
    cold_addr = cpu_cluster["workers"][1].grpc_address()
    with grpc.insecure_channel(cold_addr) as ch:
        stub = pb_grpc.WorkerStub(ch)
        for ids, out in zip(prompts, served):
            stub.ClearCache(pb.ClearCacheRequest(), timeout=10)
            cold = generate(cold_addr, token_ids=ids, max_tokens=4, timeout=120, channel=ch)
            assert cold["usage"]["cached_tokens"] == 0
            assert out["token_ids"] == cold["token_ids"], "a cached or routed output differs from a cold run"
