"""`kvmesh ray` on a real two-node Ray cluster on this machine (ray.cluster_utils.Cluster).

Both Ray nodes bind 127.0.0.1 (single-machine mode), so every kvmesh process binds and
advertises 127.0.0.1 too; the two nodes still have their own raylets, node ids and
resources. Covers: router and workers placed with the workers spread over both nodes,
trace requests served equal to a cold worker; SIGKILL of one worker actor's process makes
Ray restart the actor, the router drops the worker and takes it back, outputs still equal
a cold run; the `kvmesh ray` command prints a status line per actor and removes every
actor and the placement group when stopped. Bring-up and recovery times are printed.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest

# single-machine Ray: node addresses are 127.0.0.1 (read when ray is imported)
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from kvmesh.bench.trace import load_mooncake, synthesize_tokens  # noqa: E402
from kvmesh.proto import kvmesh_pb2 as pb  # noqa: E402
from kvmesh.proto import kvmesh_pb2_grpc as pb_grpc  # noqa: E402
from kvmesh.services.cli import build_parser, generate  # noqa: E402
from kvmesh.services.procs import python_cmd  # noqa: E402

pytestmark = pytest.mark.slow
SAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "data",
                      "mooncake_conversation_sample.jsonl")
WORKER_ARGS = ["--num-blocks", "256", "--block-size", "16", "--threads", "1", "--max-seqs", "4"]


@pytest.fixture(scope="module")
def ray_cluster():
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=2)
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def prompts() -> list[list[int]]:
    reqs = [r for r in load_mooncake(SAMPLE, max_requests=40) if r.num_blocks <= 8][:4]
    assert len(reqs) == 4
    ids = [synthesize_tokens(r, 16) for r in reqs]
    return ids + ids[:1]


def cold_outputs(address: str, batch: list[list[int]], creds) -> list[list[int]]:
    """Outputs of a worker called directly as a cluster peer (ClearCache is peer-only)."""
    from kvmesh.services.security import client_channel

    out = []
    with client_channel(address, tls_ca=creds.ca, tls_cert=creds.cert, tls_key=creds.key) as ch:
        stub = pb_grpc.WorkerStub(ch)
        for ids in batch:
            stub.ClearCache(pb.ClearCacheRequest(), timeout=10)
            res = generate(address, token_ids=ids, max_tokens=4, timeout=120, channel=ch)
            assert res["usage"]["cached_tokens"] == 0
            out.append(res["token_ids"])
    return out


def router_workers(address: str, tls) -> dict[str, str]:
    """The router's workers, asked as a peer (Router.Status details are for peers only)."""
    with tls.peer_sync_channel(address) as ch:
        st = pb_grpc.RouterStub(ch).Status(pb.RouterStatusRequest(), timeout=5)
    return {w.worker_id: w.address for w in st.workers}


def test_cli_does_not_import_ray():
    """`ray` is imported lazily: building the parser (every command) leaves it unloaded."""
    code = ("import sys; from kvmesh.services.cli import build_parser; build_parser(); "
            "from kvmesh.services import ray_cli; print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_spec_from_cli_args():
    from kvmesh.services.ray_cli import check_args
    from kvmesh.services.ray_cluster import RaySpec

    args = build_parser().parse_args(["ray", "--workers", "3", "--cpus-per-worker", "2", "--strategy", "pack",
                                      "--num-blocks", "64", "--host-bytes", "1M"])
    assert check_args(args) is None
    spec = RaySpec.from_args(args)
    assert spec.strategy == "PACK" and spec.bundle() == {"CPU": 2.0}
    assert spec.worker_args[spec.worker_args.index("--threads") + 1] == "2"
    assert spec.worker_args[spec.worker_args.index("--host-bytes") + 1] == str(1 << 20)
    bad = build_parser().parse_args(["ray", "--gpus-per-worker", "1"])
    assert "--device cuda" in check_args(bad)
    assert "--workers" in check_args(build_parser().parse_args(["ray", "--workers", "0"]))


def test_place_serve_kill_recover(ray_cluster, capsys, tmp_path):
    import ray

    from kvmesh.services.ray_cluster import RayPlacement, RaySpec, format_status

    spec = RaySpec(address=ray_cluster.address, workers=2, cpus_per_worker=1, router_port=0, cluster="raytest",
                   max_restarts=3, worker_args=WORKER_ARGS, ready_timeout=240, log_dir=str(tmp_path / "logs"))
    t0 = time.monotonic()
    placement = RayPlacement(spec).start()
    bring_up = time.monotonic() - t0
    pids = []
    try:
        infos = {i["name"]: i for i in placement.status()}
        pids = [i["pid"] for i in infos.values()]
        worker_nodes = {infos[w]["node_id"] for w in ("worker-0", "worker-1")}
        assert len(worker_nodes) == 2, f"SPREAD puts the two workers on both nodes: {infos}"
        head_id = next(n["NodeID"] for n in ray.nodes() if "node:__internal_head__" in n["Resources"])
        assert infos["router"]["node_id"] == head_id and infos["redis"]["node_id"] == head_id
        lines = format_status(list(infos.values()))
        assert len(lines) == 4 and all("node 127.0.0.1 (" in line for line in lines)
        assert infos["router"]["http"].startswith("https://127.0.0.1:") and all(
            infos[n]["metrics"].startswith("http://127.0.0.1:") for n in ("router", "worker-0", "worker-1"))

        # secure by default: plaintext and key-less clients are refused
        creds = placement.credentials
        assert creds is not None and placement.client_options()
        # the CA keys are gone once the certificates are issued; each actor holds its own copy
        # of what its process needs, on its node
        assert creds.ca_key == "" and sorted(os.listdir(creds.run_dir)) == [
            "api-keys", "ca.pem", "client-ca.pem", "client.env", "client.key", "client.pem", "metrics.token",
            "peer.key", "peer.pem", "record.key"]
        logs = tmp_path / "logs"
        assert sorted(p.name for p in logs.glob("*-credentials")) == [
            "redis-credentials", "router-credentials", "worker-0-credentials", "worker-1-credentials"]
        # the Redis password is in no process's argv (`ps` shows argv to every local user)
        password = placement.redis_url.split("@")[0].rpartition(":")[2]
        assert len(password) >= 16
        for name in ("redis", "router", "worker-0"):
            with open(f"/proc/{infos[name]['pid']}/cmdline", "rb") as f:
                assert password.encode() not in f.read(), name
        assert not any(p.name.startswith(("ca.key", "client-ca.key")) for p in logs.rglob("*"))
        with pytest.raises(grpc.RpcError):
            generate(placement.router_address, token_ids=[1, 2, 3], max_tokens=1, timeout=10)
        with pytest.raises(grpc.RpcError):
            generate(placement.router_address, token_ids=[1, 2, 3], max_tokens=1, timeout=10, tls_ca=creds.ca,
                     api_key=creds.api_key)   # the router has --client-ca: no certificate, no handshake
        opts = placement.client_options()

        batch = prompts()
        before = [generate(placement.router_address, token_ids=ids, max_tokens=4, timeout=120, **opts)
                  for ids in batch]
        assert before[-1]["usage"]["cached_tokens"] > 0, "the repeated prompt is served from the cache"

        # SIGKILL worker-0's actor process: its child drains and exits, Ray restarts the actor
        victim = infos["worker-0"]
        t1 = time.monotonic()
        os.kill(victim["actor_pid"], signal.SIGKILL)
        dropped = False
        deadline = time.monotonic() + 60
        while not dropped:
            assert time.monotonic() < deadline, "router never dropped the killed worker"
            dropped = router_workers(placement.router_address, placement.peer_tls).get("worker-0") != victim["address"]
            time.sleep(0.1)
        drop_s = time.monotonic() - t1
        placement.wait_registered(timeout=180)
        recovery = time.monotonic() - t1
        after = {i["name"]: i for i in placement.status()}
        assert after["worker-0"]["restarted"] and after["worker-0"]["actor_pid"] != victim["actor_pid"]
        # restarted without any CA key: the actor writes the files it was created with again
        assert (logs / "worker-0-credentials" / "peer.key").is_file()
        assert after["worker-0"]["state"] == "serving"
        assert router_workers(placement.router_address, placement.peer_tls)["worker-0"] == after["worker-0"]["address"]
        pids.append(after["worker-0"]["pid"])
        again = [generate(placement.router_address, token_ids=ids, max_tokens=4, timeout=120, **opts)
                 for ids in batch]
        # cold reference: worker-1 called directly, every tier emptied before each prompt
        cold = cold_outputs(after["worker-1"]["address"], batch, creds)
        assert [o["token_ids"] for o in before] == cold
        assert [o["token_ids"] for o in again] == cold
        # and the load harness against the Ray-placed router: the trace sample's first requests
        from kvmesh.bench.harness import main as bench_main

        rc = bench_main(["--target", placement.router_address, "--max-requests", "6", "--max-output-tokens", "2",
                         "--concurrency", "2", "--no-plots", "--no-progress", "--out", str(tmp_path / "bench"),
                         "--tls-ca", creds.ca, "--api-key", creds.api_key, "--tls-cert", creds.client_cert,
                         "--tls-key", creds.client_key])
        result = json.loads((tmp_path / "bench" / "result.json").read_text())
        assert rc == 0 and result["num_ok"] == 6 and result["num_errors"] == 0
        assert set(result["worker_share"]) <= {"worker-0", "worker-1"}
        with capsys.disabled():
            print(f"\n[ray] bring-up {bring_up:.1f} s (placement group, redis, router, 2 workers registered); "
                  f"worker-0 SIGKILL -> dropped by router {drop_s:.1f} s -> back and registered {recovery:.1f} s")
    finally:
        pg = placement.pg
        run_dir = os.path.dirname(placement.credentials.run_dir) if placement.credentials else None
        placement.stop()
    assert run_dir and not os.path.exists(run_dir), "the generated credentials are removed at stop"
    left = sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "logs").rglob("*")
                  if p.name.endswith("-credentials") or p.parent.name.endswith("-credentials"))
    assert not left, f"every actor deletes its credentials at stop: {left}"
    # nothing left: every child exited, the placement group is removed
    for pid in pids:
        deadline = time.monotonic() + 30
        while os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().split()[2] != "Z":
            assert time.monotonic() < deadline, f"process {pid} still running after stop"
            time.sleep(0.1)
    from ray.util import placement_group_table

    assert placement_group_table(pg)["state"] == "REMOVED"


def test_kvmesh_ray_command(ray_cluster, tmp_path, redis_server):
    """The CLI with an external Redis (--redis-url) and --run-dir (as the KubeRay overlay):
    status lines per actor, then SIGTERM removes actors and placement group, and every
    credential file the run wrote: the driver's in RUN/credentials and each actor's."""
    import ray
    from ray.util import placement_group_table

    status_file = tmp_path / "status"
    cmd = python_cmd("ray", "--address", ray_cluster.address, "--workers", "1", "--cpus-per-worker", "1",
                     "--router-port", "0", "--cluster", "raycli", "--status-interval", "1",
                     "--status-file", str(status_file), "--max-restarts", "1", "--redis-url", redis_server.url,
                     "--log-dir", str(tmp_path / "logs"), "--run-dir", str(tmp_path / "run"), *WORKER_ARGS)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(__file__))})
    creds = tmp_path / "run" / "credentials"
    try:
        deadline = time.monotonic() + 240
        while not status_file.exists():
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "kvmesh ray wrote no status"
            time.sleep(0.2)
        lines = status_file.read_text().splitlines()
        assert sorted(line.split()[0] for line in lines) == ["router", "worker-0"]
        assert all(" serving " in line and "node 127.0.0.1 (" in line and " metrics http://127.0.0.1:" in line
                   for line in lines)
        pgs = [p for p in placement_group_table().values() if p["name"] == "kvmesh-raycli"]
        assert len(pgs) == 1 and pgs[0]["state"] == "CREATED"
        # while serving: what clients need is there, the CA keys are not
        assert (creds / "client.env").is_file() and (creds / "client.key").is_file()
        assert not (creds / "ca.key").exists() and not (creds / "client-ca.key").exists()
        assert (tmp_path / "logs" / "worker-0-credentials" / "peer.key").is_file()
        assert (tmp_path / "logs" / "router-credentials" / "api-keys").is_file()
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert "actors and placement group removed" in out
    assert "clients: set -a; . " in out and "client.env" in out, "secure by default, says how to connect"
    assert "removed when this command stops" in out
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")
                  if p.is_file() and (p.parent == creds or p.parent.name.endswith("-credentials")))
    assert not left and not creds.exists(), f"credentials left after stop: {left}"
    assert (tmp_path / "run").is_dir(), "--run-dir itself is the operator's: it stays"
    from kvmesh.services.security import redact_url

    assert f"redis {redact_url(redis_server.url)}" in out and "kvmesh on Ray: router" in out
    password = redis_server.url.split("@")[0].rpartition(":")[2]
    assert not password or password not in out, "the Redis password is never printed"
    assert (tmp_path / "logs" / "worker-0.log").stat().st_size > 0
    pgs = [p for p in placement_group_table().values() if p["name"] == "kvmesh-raycli"]
    assert pgs and all(p["state"] == "REMOVED" for p in pgs)
    alive = [a for a in ray.util.state.list_actors(filters=[("state", "=", "ALIVE")])
             if "raycli" in (a.get("name") or "")] if hasattr(ray.util, "state") else []
    assert not alive


def test_interrupt_while_the_placement_waits_stops_at_once(ray_cluster, tmp_path):
    """SIGINT while the placement group cannot be placed (bundles larger than any node):
    `kvmesh ray` stops within seconds, not after --ready-timeout, exits 130 and leaves no
    placement group behind."""
    from ray.util import placement_group_table

    cmd = python_cmd("ray", "--address", ray_cluster.address, "--workers", "1", "--cpus-per-worker", "64",
                     "--router-port", "0", "--cluster", "raycancel", "--ready-timeout", "600", "--insecure",
                     "--log-dir", str(tmp_path / "logs"), *WORKER_ARGS)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(__file__))})
    try:
        deadline = time.monotonic() + 120
        while not [p for p in placement_group_table().values() if p["name"] == "kvmesh-raycancel"]:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "no placement group was asked for"
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)  # the ready timeout is 600 s
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, out
    assert "Traceback" not in out and "kvmesh on Ray: router" not in out
    pgs = [p for p in placement_group_table().values() if p["name"] == "kvmesh-raycancel"]
    assert pgs and all(p["state"] == "REMOVED" for p in pgs)


def test_secure_mode_refuses_a_ray_cluster_anyone_can_reach():
    """Ray without token authentication runs anyone's code, and `kvmesh ray` hands its actors
    the peer key, API keys and Redis password: refused unless every node is on loopback (as
    here, and as for `kvmesh up`) or Ray checks tokens."""
    from kvmesh.services.ray_cluster import _ray_auth_mode, ray_exposure_problem

    assert _ray_auth_mode() in ("disabled", "token")  # this Ray tells its mode
    assert ray_exposure_problem("disabled", ["127.0.0.1", "127.0.0.1"]) is None
    assert ray_exposure_problem("token", ["10.1.2.3"]) is None
    problem = ray_exposure_problem("disabled", ["127.0.0.1", "10.1.2.3"])
    assert "10.1.2.3" in problem and "RAY_AUTH_MODE=token" in problem and "--allow-unauthenticated-ray" in problem
    assert "10.1.2.3" in ray_exposure_problem(None, ["10.1.2.3"])
    args = build_parser().parse_args(["ray", "--address", "auto", "--allow-unauthenticated-ray"])
    assert args.allow_unauthenticated_ray


_ORPHAN = """
import os, subprocess, sys, time
from kvmesh.services.ray_cluster import stop_when_orphaned
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print(child.pid, flush=True)
def stop():
    child.terminate()
    child.wait()
    os._exit(3)
stop_when_orphaned(stop, interval_s=0.05)
time.sleep(120)
"""


def test_a_supervisor_whose_parent_dies_stops_its_child():
    """A Ray actor's process is a child of its node's raylet; when the raylet was killed the
    actor process lived on, reparented, and so did the kvmesh worker it had started (serving,
    its credentials on disk) after the driver reported everything stopped. `stop_when_orphaned`
    notices the new parent and stops the child. Here a plain process stands in for the
    raylet: it is SIGKILLed, and the grandchild it left must be gone soon after."""
    raylet = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; "
                               f"subprocess.Popen([sys.executable, '-c', {_ORPHAN!r}]).wait()"],
                              stdout=subprocess.PIPE, text=True, env=dict(os.environ))
    try:
        grandchild = int(raylet.stdout.readline())
        os.kill(grandchild, 0)  # alive while its supervisor's parent lives
        time.sleep(0.3)
        os.kill(grandchild, 0)
        raylet.kill()
        raylet.wait()
        deadline = time.monotonic() + 30
        while True:
            try:
                os.kill(grandchild, 0)
            except ProcessLookupError:
                break
            assert time.monotonic() < deadline, "the supervisor did not stop its child after its parent died"
            time.sleep(0.05)
    finally:
        raylet.kill()
