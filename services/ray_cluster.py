"""A kvmesh cluster placed on an existing Ray cluster (`kvmesh ray`).

Each kvmesh process is supervised by one Ray actor that runs the real `kvmesh worker` /
`kvmesh router` command line as a child process on the actor's node, bound to that
node's IP and advertising it:

- workers: one actor per bundle of a placement group (``{"CPU": c, "GPU": g}`` per worker,
  SPREAD across nodes by default, PACK on request); a worker holding a GPU sees only its
  own (Ray sets ``CUDA_VISIBLE_DEVICES`` for the actor, the child inherits it);
- the router, and Redis when no ``--redis-url`` is given: on the head node (Ray's
  ``node:__internal_head__`` resource), reserving no Ray CPUs;
- an actor whose child exits, or whose own process dies, is restarted by Ray
  (``max_restarts``); the new actor starts the same command line with the same worker
  id, so the worker rejoins and the router takes it back once its lease appears;
- `RayPlacement.stop` stops every child (SIGTERM: the servers' graceful drain), kills
  the actors and removes the placement group. Actors and the placement group belong to
  the driver's Ray job, so Ray removes them even if the driver is killed;
- secure by default, as `kvmesh up`: the driver generates the cluster's credentials
  (`kvmesh.services.credentials`; the certificate also names every Ray node's IP) in its
  run directory and deletes the two CA keys as soon as the certificates are issued (nothing
  is issued later: a restarted actor gets the same files), ships the files each process
  needs to its actor (written 0600 on that node), and starts every process with
  ``--tls-cert/--tls-key/--tls-ca/--client-ca/--api-keys/--metrics-token-file``; the Redis URL with its password
  reaches the processes in ``KVMESH_REDIS_URL``, never in argv. `RayPlacement.stop` deletes
  the driver's credentials and every actor its own copy. ``insecure`` turns all of it off;
- every worker and the router serve Prometheus metrics on a free port of their node (to
  bearers of the run directory's ``credentials/metrics.token`` when secure), and the router
  its HTTP front; `format_status` prints their URLs.

``ray`` is imported only here, so other kvmesh commands never load it.
"""
from __future__ import annotations

import argparse
import os
import secrets
import shutil
import tempfile
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

#: Ray's custom resource present only on the head node.
HEAD_RESOURCE = "node:__internal_head__"


@dataclass
class RaySpec:
    """What `kvmesh ray` places. Sizes as in `kvmesh worker`; times in seconds."""

    address: str = "auto"
    workers: int = 2
    gpus_per_worker: float = 0.0
    cpus_per_worker: float = 1.0
    strategy: str = "SPREAD"
    router_port: int = 50050
    worker_port: int = 0
    redis_url: str | None = None
    cluster: str = "default"
    policy: str = "kv_aware"
    model: str | None = None
    max_restarts: int = -1
    status_interval: float = 10.0
    status_file: str | None = None
    ready_timeout: float = 600.0
    worker_args: list[str] = field(default_factory=list)   # engine and tier flags of `kvmesh worker`
    disk_dir: str | None = None                            # each worker gets DISK_DIR/<worker id>
    log_level: str = "WARNING"
    log_dir: str | None = None                             # on every node; default $TMPDIR/kvmesh-ray-logs
    insecure: bool = False                                 # no TLS, no API keys (development only)
    allow_unauthenticated_ray: bool = False                # run secure mode on a Ray without token auth
    run_dir: str | None = None                             # driver's credentials; default a new temp dir
    cert_dns: list[str] = field(default_factory=list)      # more DNS names clients dial the router by

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "RaySpec":
        from kvmesh.services.cli import engine_worker_args

        # torch threads: the worker's CPU bundle unless --threads says otherwise
        engine = ["--threads", str(args.threads or max(1, int(args.cpus_per_worker))),
                  *engine_worker_args(args, skip=("model", "disk_dir", "threads"))]
        return cls(address=args.address, workers=args.workers, gpus_per_worker=args.gpus_per_worker,
                   cpus_per_worker=args.cpus_per_worker, strategy=args.strategy, router_port=args.router_port,
                   worker_port=args.worker_port, redis_url=args.redis_url, cluster=args.cluster,
                   policy=args.policy, model=args.model, max_restarts=args.max_restarts,
                   status_interval=args.status_interval, status_file=args.status_file,
                   ready_timeout=args.ready_timeout, worker_args=engine, disk_dir=args.disk_dir,
                   log_level=args.log_level, log_dir=args.log_dir, insecure=getattr(args, "insecure", False),
                   allow_unauthenticated_ray=getattr(args, "allow_unauthenticated_ray", False),
                   run_dir=getattr(args, "run_dir", None), cert_dns=list(getattr(args, "cert_dns", None) or []))

    def bundle(self) -> dict[str, float]:
        """One worker's placement-group bundle."""
        b = {}
        if self.cpus_per_worker:
            b["CPU"] = float(self.cpus_per_worker)
        if self.gpus_per_worker:
            b["GPU"] = float(self.gpus_per_worker)
        return b


def stop_when_orphaned(stop: Callable[[], None], interval_s: float = 1.0) -> threading.Thread:
    """Call ``stop()`` once this process's parent changes (it died and the process was handed
    to init or a subreaper), from a daemon thread polling ``os.getppid()`` every
    ``interval_s`` seconds; returns the thread.

    A Ray actor's process is a child of its node's raylet. When the raylet dies, Ray kills
    neither the actor nor what the actor started: a worker kept serving, and its credentials
    stayed on disk, after the driver had reported everything stopped. Linux's
    ``PR_SET_PDEATHSIG`` would cover this, but Ray starts the actor's process, not kvmesh."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        stop()

    t = threading.Thread(target=watch, name="kvmesh-orphan-watch", daemon=True)
    t.start()
    return t


class ProcessSupervisor:
    """Body of the Ray actor class: runs one kvmesh (or redis-server) process on its node.

    ``role`` is ``worker``, ``router`` or ``redis``; ``cmd_args`` is the command line, where
    ``{ip}``, ``{port}``, ``{metrics_port}``, ``{http_port}`` (free ports of this node) and
    ``{creds}`` (the folder ``files`` are written to, mode 0700, files 0600) are replaced.
    ``env``: extra environment of the child (``KVMESH_REDIS_URL``). The child is started in
    ``__init__`` (so a restarted actor starts it again, writing ``files`` again); a watcher
    thread ends the actor's process when the child exits unexpectedly, which is what makes
    Ray restart the actor; another stops the child and ends the actor's process when the
    node's raylet dies (`stop_when_orphaned`). The ``{creds}`` folder exists only while the
    child runs: it is deleted when the child does not become ready, when it exits
    unexpectedly (before the actor's process ends), when the raylet dies and by `stop`.

    Raises:
        RuntimeError: from ``__init__``, the child did not become ready in ``ready_timeout``.
    """

    def __init__(self, role: str, name: str, cmd_kind: str, cmd_args: list[str], port: int,
                 ready_timeout: float, log_dir: str | None = None, env: dict | None = None,
                 files: dict[str, bytes] | None = None):
        import ray

        from kvmesh.services.procs import free_port, spawn, wait_healthy

        self.role, self.name = role, name
        self.metrics_port = self.http_port = None
        self.creds_dir: str | None = None   # the folder `_write_files` made, until `_remove_files`
        self.tls = bool(files)
        ctx = ray.get_runtime_context()
        self.node_id = ctx.get_node_id()
        self.node_ip = ray.util.get_node_ip_address()
        self.restarted = bool(ctx.was_current_actor_reconstructed)
        self.port = port or free_port(self.node_ip)
        self.address = f"{self.node_ip}:{self.port}"
        self.log_dir = log_dir or os.path.join(os.environ.get("TMPDIR", "/tmp"), "kvmesh-ray-logs")
        os.makedirs(self.log_dir, exist_ok=True)
        self.log_path = os.path.join(self.log_dir, f"{name}.log")
        if cmd_kind == "redis":
            import shutil

            exe = shutil.which("redis-server")
            if exe is None:
                raise RuntimeError("redis-server not found on the head node: install it (scripts/setup.sh) "
                                   "or pass --redis-url")
            self.workdir = os.path.join(self.log_dir, f"{name}-data")
            os.makedirs(self.workdir, exist_ok=True)
            # a config file among ``files`` (the password: never in argv, where `ps` shows it)
            # comes first; the options after it add to it
            creds = self._write_files(files)
            conf = [os.path.join(creds, name) for name in sorted(files or ()) if name.endswith(".conf")]
            cmd = [exe, *conf, "--port", str(self.port), "--bind", self.node_ip, *cmd_args, "--save", "",
                   "--appendonly", "no", "--dir", self.workdir]
        else:
            from kvmesh.services.procs import python_cmd

            subs = {"{ip}": self.node_ip, "{port}": str(self.port)}
            if any("{metrics_port}" in a for a in cmd_args):
                self.metrics_port = free_port(self.node_ip)
                subs["{metrics_port}"] = str(self.metrics_port)
            if any("{http_port}" in a for a in cmd_args):
                self.http_port = free_port(self.node_ip)
                subs["{http_port}"] = str(self.http_port)
            creds = subs["{creds}"] = self._write_files(files) or ""

            def sub(a: str) -> str:
                for k, v in subs.items():
                    a = a.replace(k, v)
                return a

            cmd = python_cmd(*[sub(a) for a in cmd_args])
        self.stopping = False
        try:
            self.proc = spawn(cmd, self.log_path, env=env)
        except BaseException:
            self._remove_files()
            raise
        try:
            if cmd_kind == "redis":
                self._wait_tcp(ready_timeout)
            else:
                tls = None
                if files:
                    from kvmesh.workers.tls import TlsConfig

                    tls = TlsConfig.from_files(os.path.join(creds, "peer.pem"), os.path.join(creds, "peer.key"),
                                               os.path.join(creds, "ca.pem"))
                wait_healthy(self.address, timeout=ready_timeout, proc=self.proc, tls=tls)
        except BaseException:
            self.stopping = True
            from kvmesh.services.procs import stop_process

            stop_process(self.proc)
            self._remove_files()
            raise
        threading.Thread(target=self._watch, daemon=True).start()
        stop_when_orphaned(self._orphaned)

    def _write_files(self, files: dict[str, bytes] | None) -> str | None:
        """Write ``files`` into LOG_DIR/NAME-credentials (0700; files 0600); its path, also
        kept in ``creds_dir`` for `_remove_files`."""
        if not files:
            return None
        from kvmesh.services.credentials import _write  # 0600 whatever was there, never through a symlink

        folder = self.creds_dir = os.path.join(self.log_dir, f"{self.name}-credentials")
        try:
            os.makedirs(folder, mode=0o700, exist_ok=True)
            os.chmod(folder, 0o700)
            for fname, data in files.items():
                _write(os.path.join(folder, fname), data, private=True)
        except BaseException:   # no partial set left behind
            self._remove_files()
            raise
        return folder

    def _remove_files(self) -> None:
        """Delete the folder `_write_files` made, with everything in it (keys, api-keys); a
        no-op when there is none or it is gone already."""
        folder, self.creds_dir = self.creds_dir, None
        if folder:
            shutil.rmtree(folder, ignore_errors=True)

    def _wait_tcp(self, timeout: float) -> None:
        import socket

        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with code {self.proc.returncode}; log {self.log_path}")
            try:
                socket.create_connection((self.node_ip, self.port), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.name} not listening on {self.address} after {timeout} s") from None
                time.sleep(0.1)

    def _watch(self) -> None:
        self.proc.wait()
        if not self.stopping:   # crashed or killed: let Ray restart this actor, which writes the files again
            self._remove_files()
            os._exit(1)

    def _orphaned(self) -> None:
        """The raylet that started this actor is gone (`stop_when_orphaned`): stop the child as
        `stop` does and end this process; nobody is left to restart it here."""
        print(f"kvmesh on Ray: {self.name}: the node's raylet is gone; stopping the {self.role}", file=sys.stderr,
              flush=True)
        try:
            self.stop()
        finally:
            os._exit(1)

    def info(self) -> dict:
        """Where this process runs: role, name, node id and IP, address, pids, restarted."""
        out = {"role": self.role, "name": self.name, "node_id": self.node_id, "node_ip": self.node_ip,
               "address": self.address, "pid": self.proc.pid, "actor_pid": os.getpid(),
               "alive": self.proc.poll() is None, "restarted": self.restarted, "log": self.log_path}
        if self.metrics_port:
            out["metrics"] = f"http://{self.node_ip}:{self.metrics_port}/metrics"
        if self.http_port:
            out["http"] = f"{'https' if self.tls else 'http'}://{self.node_ip}:{self.http_port}/v1"
        return out

    def stop(self) -> int | None:
        """SIGTERM the child (the servers drain gracefully), wait, then delete its credentials
        folder; returns the child's exit code."""
        from kvmesh.services.procs import stop_process

        self.stopping = True
        try:
            stop_process(self.proc, timeout=30)
        finally:
            self._remove_files()
        return self.proc.returncode


def _router_sees(address: str, tls=None) -> dict[str, str]:
    """{worker id: address} the router lists (``tls``: the driver's peer `TlsConfig`;
    Router.Status details are for peers only)."""
    import grpc

    from kvmesh.proto import kvmesh_pb2 as pb
    from kvmesh.proto import kvmesh_pb2_grpc as pb_grpc

    with (tls.peer_sync_channel(address) if tls is not None else grpc.insecure_channel(address)) as ch:
        status = pb_grpc.RouterStub(ch).Status(pb.RouterStatusRequest(), timeout=5)
    return {w.worker_id: w.address for w in status.workers}


class RayPlacement:
    """Places, watches and removes one kvmesh cluster on a connected Ray cluster.

    Attributes:
        router_address: ``NODE_IP:PORT`` of the router once `start` returned.
        redis_url: the cluster's Redis URL (started on the head node unless given).
        workers: {worker id: actor handle}.

    Raises:
        RuntimeError: from `start`, the placement group or an actor did not come up within
            ``ready_timeout`` (the message names what is missing, e.g. GPUs).
    """

    def __init__(self, spec: RaySpec):
        import ray

        self.spec = spec
        self.ray = ray
        self.Actor = ray.remote(ProcessSupervisor)
        self.pg = None
        self.redis = None
        self.router = None
        self.workers: dict[str, object] = {}
        self.redis_url = spec.redis_url
        self.router_address = ""
        self.credentials = None    # `kvmesh.services.credentials.ClusterCredentials` unless insecure
        self.peer_tls = None
        self._files: dict[str, bytes] | None = None
        self._own_run_dir: str | None = None
        self._written: list[str] = []   # the driver's credential files, deleted by `stop`

    #: CA keys `generate_cluster_credentials` writes, deleted once the certificates are issued.
    CA_KEY_FILES = ("ca.key", "client-ca.key")

    @classmethod
    def _credential_paths(cls, c) -> list[str]:
        """Every file `generate_cluster_credentials` wrote for ``c`` (a `ClusterCredentials`)."""
        import dataclasses

        paths = [getattr(c, f.name) for f in dataclasses.fields(c) if f.name not in ("run_dir", "api_key")]
        paths += [os.path.join(c.run_dir, name) for name in cls.CA_KEY_FILES]
        return list(dict.fromkeys(p for p in paths if p))

    def _remove_credentials(self) -> None:
        """Delete the driver's credential files and their folder (RUN_DIR/credentials, when
        nothing else is in it), or the whole temporary run directory when no ``run_dir`` was
        given. Idempotent."""
        written, self._written = self._written, []
        for path in written:
            try:
                os.unlink(path)
            except OSError:   # gone already; or not deletable: the others still go
                pass
        if written:
            try:
                os.rmdir(os.path.dirname(written[0]))
            except OSError:   # something else is in it, or it is gone
                pass
        if self._own_run_dir:
            shutil.rmtree(self._own_run_dir, ignore_errors=True)
            self._own_run_dir = None

    def _options(self, **kw):
        return self.Actor.options(max_restarts=self.spec.max_restarts, **kw)

    def worker_cmd(self, worker_id: str) -> list[str]:
        s = self.spec
        cmd = ["--log-level", s.log_level, "worker", "--host", "{ip}", "--port", "{port}",
               "--advertise", "{ip}:{port}", "--worker-id", worker_id, "--metrics-port", "{metrics_port}",
               "--cluster", s.cluster, *self._security_args(worker=True), *s.worker_args]
        if s.model:
            cmd += ["--model", s.model]
        if s.disk_dir:
            cmd += ["--disk-dir", os.path.join(s.disk_dir, worker_id)]
        return cmd

    def _security_args(self, worker: bool = False) -> list[str]:
        if self._files is None:
            return ["--insecure"]
        return ["--tls-cert", "{creds}/peer.pem", "--tls-key", "{creds}/peer.key", "--tls-ca", "{creds}/ca.pem",
                "--client-ca", "{creds}/client-ca.pem", "--api-keys", "{creds}/api-keys",
                "--metrics-token-file", "{creds}/metrics.token",
                *(["--remote-record-key-file", "{creds}/record.key"] if worker else [])]

    def _make_credentials(self) -> None:
        """Generate the cluster's credentials in RUN_DIR/credentials (certificate naming every
        live Ray node's IP), then delete the CA keys (``ca.key``, ``client-ca.key``).

        Nothing is issued after this: a restarted actor starts with the files it was created
        with, and the set of workers is fixed for the run, so the CA keys would only let
        whoever reads the driver's disk mint peers and clients. ``credentials.ca_key`` is ""
        afterwards. `stop` deletes the rest (`_remove_credentials`).

        Raises:
            OSError: the credentials cannot be written or the CA keys deleted.
        """
        import dataclasses

        from kvmesh.services.credentials import generate_cluster_credentials
        from kvmesh.workers.tls import TlsConfig

        run_dir = self.spec.run_dir
        if run_dir is None:
            run_dir = self._own_run_dir = tempfile.mkdtemp(prefix="kvmesh-ray-")
        ips = tuple(sorted({n["NodeManagerAddress"] for n in self.ray.nodes() if n.get("Alive")}))
        c = generate_cluster_credentials(os.path.join(run_dir, "credentials"), dns=tuple(self.spec.cert_dns),
                                         ips=ips)
        self._written = self._credential_paths(c)
        for path in self.CA_KEY_FILES:
            os.unlink(os.path.join(c.run_dir, path))
        c = self.credentials = dataclasses.replace(c, ca_key="")
        self._files = {}
        for name, path in (("peer.pem", c.cert), ("peer.key", c.key), ("ca.pem", c.ca),
                           ("client-ca.pem", c.client_ca), ("api-keys", c.api_keys), ("record.key", c.record_key),
                           ("metrics.token", c.metrics_token)):
            with open(path, "rb") as f:
                self._files[name] = f.read()
        self.peer_tls = TlsConfig.from_files(c.cert, c.key, c.ca, c.client_ca)

    #: Seconds between looks at ``cancel`` while `start` waits on Ray (1 s while the placement
    #: group is pending: `PlacementGroup.wait` takes whole seconds).
    CANCEL_POLL_S = 0.5

    def _cancelled(self, cancel: threading.Event | None) -> None:
        if cancel is not None and cancel.is_set():
            from kvmesh.services.procs import StartCancelled

            raise StartCancelled("start-up interrupted")

    def _get(self, ref, timeout: float, cancel: threading.Event | None, what: str):
        """``ray.get(ref)`` within ``timeout`` seconds, looking at ``cancel`` every
        `CANCEL_POLL_S` seconds; a timeout or a failed actor is a RuntimeError naming ``what``."""
        deadline = time.monotonic() + timeout
        while True:
            self._cancelled(cancel)
            left = deadline - time.monotonic()
            ready, _ = self.ray.wait([ref], timeout=max(0.0, min(self.CANCEL_POLL_S, left)))
            if ready:
                try:
                    return self.ray.get(ref)
                except self.ray.exceptions.RayError as exc:
                    raise RuntimeError(f"{what} did not start: {exc}") from None
            if left <= 0:
                raise RuntimeError(f"{what} not serving after {timeout:.0f} s")

    def start(self, cancel: threading.Event | None = None) -> "RayPlacement":
        """Place Redis (unless given), the workers and the router, and wait until the router
        lists every worker. Everything placed is removed again on any error.

        Raises:
            RuntimeError: not placed or not serving within ``ready_timeout`` seconds.
            StartCancelled: ``cancel`` was set meanwhile (SIGINT/SIGTERM while starting);
                it is looked at every `CANCEL_POLL_S` seconds of every wait.
        """
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        s = self.spec
        ray = self.ray
        deadline = time.monotonic() + s.ready_timeout
        try:
            if not s.insecure:
                self._make_credentials()
            self.pg = placement_group([s.bundle()] * s.workers, strategy=s.strategy, name=f"kvmesh-{s.cluster}")
            # Ray takes whole seconds here (0.5 would be 0: a busy loop of GCS calls)
            while not self.pg.wait(timeout_seconds=1):
                self._cancelled(cancel)
                if time.monotonic() >= deadline:
                    raise RuntimeError(f"placement group of {s.workers} x {s.bundle()} ({s.strategy}) not placed "
                                       f"after {s.ready_timeout:.0f} s; cluster resources: "
                                       f"{ray.cluster_resources()}")
            head = {"resources": {HEAD_RESOURCE: 0.001}, "num_cpus": 0}
            if self.redis_url is None:
                password = secrets.token_urlsafe(18)
                self.redis = self._options(name=f"kvmesh-{s.cluster}-redis", **head).remote(
                    "redis", "redis", "redis", ["--protected-mode", "yes"], 0, s.ready_timeout, s.log_dir,
                    files={"redis.conf": f"requirepass {password}\n".encode()})
                info = self._get(self.redis.info.remote(), s.ready_timeout, cancel, "redis-server")
                self.redis_url = f"redis://:{password}@{info['address']}/0"
            env = {"KVMESH_REDIS_URL": self.redis_url}   # the password stays out of every argv
            for i in range(s.workers):
                wid = f"worker-{i}"
                self.workers[wid] = self._options(
                    name=f"kvmesh-{s.cluster}-{wid}", num_cpus=s.cpus_per_worker, num_gpus=s.gpus_per_worker,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i),
                ).remote("worker", wid, "kvmesh", self.worker_cmd(wid), s.worker_port, s.ready_timeout, s.log_dir,
                         env, self._files)
            router_cmd = ["--log-level", s.log_level, "router", "--host", "{ip}", "--port", "{port}",
                          "--cluster", s.cluster, "--policy", s.policy, "--metrics-port", "{metrics_port}",
                          "--http-port", "{http_port}", *self._security_args()]
            if s.model:
                router_cmd += ["--model", s.model]
            self.router = self._options(name=f"kvmesh-{s.cluster}-router", **head).remote(
                "router", "router", "kvmesh", router_cmd, s.router_port, s.ready_timeout, s.log_dir, env, self._files)
            router = self._get(self.router.info.remote(), max(1.0, deadline - time.monotonic()), cancel, "router")
            self.router_address = router["address"]
            self.wait_registered(timeout=max(1.0, deadline - time.monotonic()), cancel=cancel)
        except BaseException:
            self.stop()
            raise
        return self

    def status(self, timeout: float = 10.0) -> list[dict]:
        """One `ProcessSupervisor.info` per actor; an actor that does not answer in time
        (restarting, or its node gone) is reported with ``"state": "unavailable"``."""
        actors = [a for a in (self.redis, self.router) if a is not None] + list(self.workers.values())
        names = (["redis"] if self.redis is not None else []) + (["router"] if self.router is not None else []) \
            + list(self.workers)
        refs = [a.info.remote() for a in actors]
        out = []
        deadline = time.monotonic() + timeout
        for name, ref in zip(names, refs):
            try:
                info = self.ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
                info["state"] = "serving" if info["alive"] else "exited"
            except Exception as exc:   # GetTimeoutError, RayActorError while restarting
                info = {"role": "worker" if name.startswith("worker") else name, "name": name,
                        "state": "unavailable", "error": type(exc).__name__}
            out.append(info)
        return out

    def wait_registered(self, timeout: float = 60.0, cancel: threading.Event | None = None) -> dict[str, str]:
        """Wait until the router lists every worker at the address its actor reports.

        Raises:
            RuntimeError: not within ``timeout`` seconds.
            StartCancelled: ``cancel`` was set meanwhile.
        """
        deadline = time.monotonic() + timeout
        while True:
            self._cancelled(cancel)
            # short looks, so that ``cancel`` is seen while a worker actor is still starting
            look = min(2.0, max(0.5, deadline - time.monotonic()))
            want = {i["name"]: i["address"] for i in self.status(timeout=look)
                    if i["role"] == "worker" and i.get("state") == "serving"}
            try:
                seen = _router_sees(self.router_address, self.peer_tls)
            except Exception:
                seen = {}
            if len(want) == len(self.workers) and all(seen.get(w) == a for w, a in want.items()):
                return seen
            if time.monotonic() > deadline:
                raise RuntimeError(f"router at {self.router_address} sees {seen}, expected {want}")
            time.sleep(0.2)  # ``cancel`` is looked at on the next turn

    def stop(self) -> None:
        """Stop every child gracefully (each actor deletes its copy of the credentials), kill
        the actors, remove the placement group, delete the driver's credentials. Idempotent."""
        actors = list(self.workers.values()) + [a for a in (self.router, self.redis) if a is not None]
        refs = [a.stop.remote() for a in actors]
        try:
            self.ray.wait(refs, num_returns=len(refs), timeout=60)
        except Exception:
            pass
        for a in actors:
            try:
                self.ray.kill(a, no_restart=True)
            except Exception:
                pass
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self.pg)
            except Exception:
                pass
        self.workers.clear()
        self.router = self.redis = self.pg = None
        self._remove_credentials()

    def client_options(self) -> dict:
        """Keyword arguments of `kvmesh.services.cli.generate` / `client_channel` for a client of
        the router (TLS, client certificate and API key); empty when insecure."""
        return self.credentials.client_options() if self.credentials is not None else {}


def format_status(infos: list[dict]) -> list[str]:
    """One line per actor: name, state, node (IP and short id), address."""
    lines = []
    for i in infos:
        node = f"node {i['node_ip']} ({i['node_id'][:8]})" if "node_id" in i else "node ?"
        extra = " restarted" if i.get("restarted") else ""
        urls = "".join(f"  {k} {i[k]}" for k in ("metrics", "http") if i.get(k))
        lines.append(f"{i['name']:<10} {i['state']:<11} {node}  {i.get('address', '-')}{urls}{extra}")
    return lines


def ray_exposure_problem(auth_mode: str | None, node_ips: list[str]) -> str | None:
    """Why a secure kvmesh should not be placed on this Ray cluster, or None.

    Anyone who can reach a Ray cluster without token authentication can run code in it (Ray's
    own warning), and so read what `kvmesh ray` hands its actors: the cluster's peer key and
    certificate, the API key file and the Redis URL with its password. That is peer access to
    every tenant's cache. A cluster whose nodes all listen on loopback is reachable from this
    machine only, as `kvmesh up` is.

    Args:
        auth_mode: Ray's authentication mode in this driver ("token", "disabled", or None
            when this Ray version does not say).
        node_ips: the live nodes' addresses.
    """
    from kvmesh.services.security import is_loopback

    if auth_mode == "token":
        return None
    exposed = sorted({ip for ip in node_ips if not is_loopback(ip)})
    if not exposed:
        return None
    mode = f"RAY_AUTH_MODE is {auth_mode!r}" if auth_mode else "this Ray version does not report its authentication"
    return (f"the Ray cluster has no token authentication ({mode}) and its nodes listen on {', '.join(exposed[:4])}: "
            "anyone who can reach them can run code in it and read the peer key, API keys and Redis password "
            "kvmesh gives its actors. Start Ray with RAY_AUTH_MODE=token (docs/SECURITY.md, 'Ray'), or pass "
            "--allow-unauthenticated-ray if only trusted machines can reach its ports")


def _ray_auth_mode() -> str | None:
    """This driver's Ray authentication mode ("token", "disabled"), None if Ray does not tell."""
    try:  # a private module: guarded, as its place may change between Ray releases
        from ray._raylet import AuthenticationMode, get_authentication_mode
    except ImportError:
        return None
    mode = get_authentication_mode()
    return "token" if mode == AuthenticationMode.TOKEN else "disabled" if mode == AuthenticationMode.DISABLED \
        else str(mode)


def run_until_stopped(spec: RaySpec) -> int:
    """`kvmesh ray`: connect, place, print status lines until SIGINT/SIGTERM, remove."""
    import ray

    from kvmesh.services.security import redact_url

    t0 = time.monotonic()
    try:
        ray.init(address=spec.address, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        print(f"error: could not connect to the Ray cluster at --address {spec.address}: {exc}", file=sys.stderr)
        return 1
    if not spec.insecure:
        exposure = ray_exposure_problem(_ray_auth_mode(), [n.get("NodeManagerAddress", "") for n in ray.nodes()
                                                           if n.get("Alive")])
        if exposure and not spec.allow_unauthenticated_ray:
            ray.shutdown()
            print(f"error: {exposure}", file=sys.stderr)
            return 2
        if exposure:
            print(f"WARNING: --allow-unauthenticated-ray: {exposure}", file=sys.stderr, flush=True)
    from kvmesh.services.procs import SignalEvent, StartCancelled

    stop = SignalEvent()  # set by the signal handler: a threading.Event could deadlock there
    # after ray.init, which installs its own SIGTERM handler (one that aborts the process)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    placement = RayPlacement(spec)
    try:
        placement.start(cancel=stop)
        print(f"kvmesh on Ray: router {placement.router_address} (policy {spec.policy}), {spec.workers} workers "
              f"({spec.strategy}), redis {redact_url(placement.redis_url)}; up in {time.monotonic() - t0:.1f} s",
              flush=True)
        if placement.credentials is not None:
            print(f"clients: set -a; . {placement.credentials.client_env}; set +a   (TLS, client certificate and "
                  f"API key; removed when this command stops)", flush=True)
        else:
            print("WARNING: kvmesh ray --insecure: security is OFF (no TLS, no API keys)", flush=True)
        print(placement.router_address, flush=True)
        while not stop.is_set():
            lines = format_status(placement.status())
            print("\n".join(lines), flush=True)
            if spec.status_file:
                tmp = spec.status_file + ".tmp"
                with open(tmp, "w") as f:
                    f.write("\n".join(lines) + "\n")
                os.replace(tmp, spec.status_file)
            stop.wait(spec.status_interval)
    except StartCancelled:  # as `kvmesh up` interrupted while starting: 130, whichever signal
        return 130
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        placement.stop()
        ray.shutdown()
        print("kvmesh on Ray stopped: actors and placement group removed", flush=True)
    return 0
