"""A local kvmesh cluster: redis-server, N worker processes and one router process.

`LocalCluster` is what `kvmesh up`, `kvmesh demo` and the end-to-end tests use. Each
process is a real `kvmesh` CLI child on loopback; stopping the cluster sends SIGTERM to
every child (SIGKILL after a grace period) and removes the private redis-server.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field

import grpc

from kvmesh.services.procs import (RedisServer, StartCancelled, free_port, python_cmd, spawn, stop_process,
                                   wait_healthy)

#: Seconds a stopped cluster's workers get, together, to drain (--drain-timeout-s 5), stop
#: their engines and flush their tiers (at most ~20 s with a disk tier) before SIGKILL.
WORKER_STOP_S = 30.0

log = logging.getLogger("kvmesh.up")


@dataclass
class ClusterSpec:
    """What to start. Worker options are passed through to `kvmesh worker`."""

    num_workers: int = 2
    router_port: int = 0                 # 0 = a free port
    redis_url: str | None = None         # None = start a private redis-server
    policy: str = "kv_aware"
    model: str | None = None
    block_size: int = 16
    num_blocks: int = 4096
    threads_per_worker: int = 0          # 0 = cores // workers (at least 1)
    max_batched_tokens: int = 1024
    cluster: str = ""                    # Redis key namespace; "" = unique per cluster
    extra_worker_args: list[str] = field(default_factory=list)
    extra_router_args: list[str] = field(default_factory=list)  # e.g. ["--tenant-request-limit", "600/minute"]
    log_dir: str | None = None
    disk_dir: str | None = None          # each worker gets --disk-dir DISK_DIR/<worker id>
    metrics: bool = True                 # every process serves /metrics on a free port
    http_port: int | None = None         # router's OpenAI HTTP front: None = off, 0 = a free port
    secure: bool = False                 # mTLS + API keys with credentials generated in run_dir
    run_dir: str | None = None           # where secure credentials go (default LOG_DIR/credentials)


class RestartPolicy:
    """When `kvmesh up` restarts a worker or router that died: after 1, 2, 4, ... seconds
    (at most ``max_backoff_s``), up to ``max_restarts`` times per process within any
    ``window_s`` seconds. A process that dies more often is crash-looping and is not
    restarted again (`next_delay` returns None). ``max_restarts`` 0: never restart; -1:
    always (Kubernetes' ``restartPolicy: Always`` backs off the same way, 10 s to 5 min).

    Raises:
        ValueError: ``max_restarts`` < -1, or a non-positive window or backoff.
    """

    def __init__(self, max_restarts: int = 5, window_s: float = 600.0, first_backoff_s: float = 1.0,
                 max_backoff_s: float = 30.0):
        if max_restarts < -1:
            raise ValueError(f"max_restarts must be -1 (always), 0 (never) or more, got {max_restarts}")
        if not (window_s > 0 and 0 < first_backoff_s <= max_backoff_s):
            raise ValueError("window_s and the backoffs must be > 0, first_backoff_s <= max_backoff_s")
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.first_backoff_s = first_backoff_s
        self.max_backoff_s = max_backoff_s
        self._restarts: dict[str, list[float]] = {}

    def next_delay(self, name: str, now: float) -> float | None:
        """Seconds to wait before restarting ``name``, which died at ``now`` (monotonic
        seconds), or None when it must not be restarted. Records the restart."""
        if self.max_restarts == 0:
            return None
        recent = [t for t in self._restarts.get(name, []) if now - t < self.window_s]
        if self.max_restarts > 0 and len(recent) >= self.max_restarts:
            return None
        recent.append(now)
        self._restarts[name] = recent
        return min(self.max_backoff_s, self.first_backoff_s * 2 ** (len(recent) - 1))

    def count(self, name: str) -> int:
        """Restarts of ``name`` in the current window (as of its last `next_delay`)."""
        return len(self._restarts.get(name, []))


class LocalCluster:
    """Starts and stops the processes of a `ClusterSpec`.

    Attributes:
        router_address: "127.0.0.1:PORT" of the router once started.
        workers: {worker_id: (address, Popen)}.

    Raises:
        RuntimeError: a process failed to start or to become healthy.
    """

    def __init__(self, spec: ClusterSpec):
        self.spec = spec
        self.redis: RedisServer | None = None
        self.redis_url = spec.redis_url
        self.cluster = spec.cluster or f"c{os.getpid()}-{int(time.time() * 1000) % 10**8}"
        self.log_dir = spec.log_dir or tempfile.mkdtemp(prefix="kvmesh-logs-")
        self._own_log_dir = spec.log_dir is None
        os.makedirs(self.log_dir, exist_ok=True)
        self.workers: dict[str, tuple[str, object]] = {}
        self.router_proc = None
        self.router_address = ""
        #: {process name ("router", worker id): "http://127.0.0.1:PORT/metrics"}
        self.metrics_urls: dict[str, str] = {}
        self._ports: dict[str, int] = {}  # metrics and HTTP ports picked, kept when a process restarts
        #: "http://127.0.0.1:PORT/v1" of the router's HTTP front, "" when off
        self.http_url = ""
        self.credentials = None   # services.credentials.ClusterCredentials when spec.secure
        self.tls = None           # workers.tls.TlsConfig of the cluster's processes when spec.secure
        self._cancel: threading.Event | None = None  # set while `start` runs with one

    def _secure_args(self, worker: bool = False) -> list[str]:
        """Redis URL (when it has no password) and security flags of a worker or router."""
        from urllib.parse import urlparse

        out = [] if urlparse(self.redis_url).password else ["--redis-url", self.redis_url]
        if self.credentials is None:
            return out
        return out + (self.credentials.worker_args() if worker else self.credentials.server_args())

    def _env(self) -> dict:
        """A Redis URL with a password goes in the environment, not on the command line."""
        return {"KVMESH_REDIS_URL": self.redis_url}

    def child_env(self) -> dict:
        """Extra environment a process started from `worker_cmd` needs: a Redis URL with a
        password is not on that command line, so a worker spawned without this runs alone."""
        return self._env()

    def client_options(self) -> dict:
        """``tls_ca``, ``api_key`` and client certificate a client of this cluster needs ({} when not secure);
        keyword arguments of `kvmesh.services.cli.generate` and `security.client_channel`."""
        return self.credentials.client_options() if self.credentials else {}

    def peer_channel(self, address: str):
        """A blocking channel to one of the cluster's processes, as a peer (mTLS when secure)."""
        import grpc

        return self.tls.peer_sync_channel(address) if self.tls else grpc.insecure_channel(address)

    def worker_cmd(self, worker_id: str, port: int) -> list[str]:
        s = self.spec
        threads = s.threads_per_worker or max(1, (os.cpu_count() or 1) // max(1, s.num_workers))
        cmd = python_cmd("worker", "--port", str(port), "--worker-id", worker_id, *self._secure_args(worker=True),
                         "--cluster", self.cluster, "--block-size", str(s.block_size),
                         "--num-blocks", str(s.num_blocks), "--threads", str(threads),
                         "--max-batched-tokens", str(s.max_batched_tokens),
                         # a short drain, well inside WORKER_STOP_S, leaving the rest for the
                         # engine stop and the tiers' flush
                         "--drain-timeout-s", "5", *s.extra_worker_args)
        if s.model:
            cmd += ["--model", s.model]
        if s.disk_dir:
            cmd += ["--disk-dir", os.path.join(s.disk_dir, worker_id)]
        return cmd + self._metrics_args(worker_id)

    def _metrics_args(self, name: str) -> list[str]:
        if not self.spec.metrics:
            return []
        port = self._kept_port(f"metrics:{name}")
        self.metrics_urls[name] = f"http://127.0.0.1:{port}/metrics"
        c = self.credentials
        token = ["--metrics-token-file", c.metrics_token] if c is not None and c.metrics_token else []
        return ["--metrics-port", str(port), *token]

    @property
    def metrics_token(self) -> str | None:
        """The bearer token the metrics ports of a secure cluster ask for (None: none)."""
        c = self.credentials
        if c is None or not c.metrics_token:
            return None
        from kvmesh.services.metrics import read_metrics_token

        return read_metrics_token(c.metrics_token)

    def _kept_port(self, key: str) -> int:
        """A free port for ``key`` (e.g. "metrics:worker-0"), the same one on every restart."""
        if key not in self._ports:
            self._ports[key] = free_port()
        return self._ports[key]

    def start_worker(self, worker_id: str, port: int | None = None, wait: bool = True) -> str:
        """Start (or restart) one worker; returns its address (once healthy, if ``wait``)."""
        port = port or free_port()
        proc = spawn(self.worker_cmd(worker_id, port), os.path.join(self.log_dir, f"{worker_id}.log"), env=self._env())
        address = f"127.0.0.1:{port}"
        self.workers[worker_id] = (address, proc)
        if wait:
            wait_healthy(address, proc=proc, tls=self.tls, cancel=self._cancel)
        return address

    def start_router(self, port: int | None = None, wait: bool = True) -> str:
        """Start (or restart) the router; returns its address (once healthy, if ``wait``)."""
        s = self.spec
        port = port or s.router_port or free_port()
        cmd = python_cmd("router", "--port", str(port), *self._secure_args(), "--policy", s.policy,
                         "--cluster", self.cluster)
        if s.model:
            cmd += ["--model", s.model]
        cmd += [*s.extra_router_args, *self._metrics_args("router")]
        if s.http_port is not None:
            http = s.http_port or self._kept_port("http")
            cmd += ["--http-port", str(http)]
            self.http_url = f"{'https' if s.secure else 'http'}://127.0.0.1:{http}/v1"
        self.router_proc = spawn(cmd, os.path.join(self.log_dir, "router.log"), env=self._env())
        self.router_address = f"127.0.0.1:{port}"
        if wait:
            wait_healthy(self.router_address, proc=self.router_proc, tls=self.tls, cancel=self._cancel)
        return self.router_address

    def _check_cancel(self) -> None:
        if self._cancel is not None and self._cancel.is_set():
            raise StartCancelled("start-up interrupted")

    def start(self, cancel: threading.Event | None = None) -> "LocalCluster":
        """Start Redis (unless given), the workers and the router, and wait until the router
        lists every worker.

        Args:
            cancel: set (e.g. from a signal handler) to call the start-up off: it is checked
                between process starts and while waiting for health, and what was started
                is stopped.

        Raises:
            RuntimeError: a process failed to start or to become healthy.
            StartCancelled: ``cancel`` was set before the cluster was up.
        """
        self._cancel = cancel
        try:
            if self.redis_url is None:
                self.redis = RedisServer()
                self.redis_url = self.redis.url
            if self.spec.secure and self.credentials is None:
                from kvmesh.services import credentials as creds

                if self.spec.run_dir is None:
                    # credentials generated for one run are deleted at its end; those of a run
                    # killed with SIGKILL (no clean-up) go now, so no CA key outlives its cluster
                    stale = creds.remove_stale_credentials(tempfile.gettempdir())
                    if stale:
                        log.info("removed the credentials of %d cluster(s) that were killed: %s", len(stale),
                                 ", ".join(stale))
                run_dir = self.spec.run_dir or os.path.join(self.log_dir, "credentials")
                if self.spec.run_dir is None:  # marked before any key is written
                    os.makedirs(run_dir, mode=0o700, exist_ok=True)
                    creds.mark_owner(run_dir)
                self.credentials = creds.generate_cluster_credentials(run_dir)
            if self.credentials is not None and self.tls is None:
                from kvmesh.workers.tls import TlsConfig

                c = self.credentials
                self.tls = TlsConfig.from_files(c.cert, c.key, c.ca, c.client_ca)
            for i in range(self.spec.num_workers):  # start together, then wait for each
                self._check_cancel()
                self.start_worker(f"worker-{i}", wait=False)
            for address, proc in self.workers.values():
                wait_healthy(address, proc=proc, tls=self.tls, cancel=cancel)
            self._check_cancel()
            self.start_router()
            self.wait_registered()
        except BaseException:
            self.stop()
            raise
        finally:
            self._cancel = None
        return self

    def wait_registered(self, timeout: float = 30.0) -> None:
        """Wait until the router lists every worker as live."""
        from kvmesh.proto import kvmesh_pb2 as pb
        from kvmesh.proto import kvmesh_pb2_grpc as pb_grpc

        deadline = time.monotonic() + timeout
        with self.peer_channel(self.router_address) as ch:
            stub = pb_grpc.RouterStub(ch)
            while True:
                self._check_cancel()
                try:
                    status = stub.Status(pb.RouterStatusRequest(), timeout=5.0)
                except grpc.RpcError as exc:  # a Ctrl-C reaches the router too; or it died
                    self._check_cancel()
                    if self.router_proc is not None and self.router_proc.poll() is not None:
                        raise RuntimeError(f"the router exited (code {self.router_proc.returncode}) before every "
                                           f"worker registered; see {os.path.join(self.log_dir, 'router.log')}") \
                            from None
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"the router did not answer Status: {exc.code().name}") from None
                    time.sleep(0.2)
                    continue
                live = {w.worker_id for w in status.workers}
                alive = {wid for wid, (_, p) in self.workers.items() if p.poll() is None}
                if alive <= live:
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"router sees workers {sorted(live)}, expected {sorted(alive)}")
                time.sleep(0.2)

    def exited(self) -> list[tuple[str, object]]:
        """(name, Popen) of each started process that has exited: "router", "redis-server"
        (when this cluster started it) and worker ids, in that order."""
        procs = [("router", self.router_proc)]
        if self.redis is not None:
            procs.append(("redis-server", self.redis.proc))
        procs += [(wid, proc) for wid, (_, proc) in self.workers.items()]
        return [(name, proc) for name, proc in procs if proc is not None and proc.poll() is not None]

    def kill_worker(self, worker_id: str) -> None:
        """SIGKILL one worker (fault injection)."""
        _, proc = self.workers[worker_id]
        proc.kill()
        proc.wait(timeout=10)

    def restart(self, name: str) -> object:
        """Start again a worker or the router that has exited, on the same port and with the
        same worker id, without waiting for it (`kvmesh up`'s supervision). Returns the new
        Popen.

        Raises:
            ValueError: ``name`` is not a worker id or "router" (redis-server is not restarted:
                the index and the leases it held are gone).
            RuntimeError: it is still running.
        """
        if name == "router":
            if self.router_proc is not None and self.router_proc.poll() is None:
                raise RuntimeError("the router is still running")
            self.start_router(int(self.router_address.rsplit(":", 1)[1]), wait=False)
            return self.router_proc
        if name not in self.workers:
            raise ValueError(f"{name!r} is neither a worker of this cluster nor the router")
        address, proc = self.workers[name]
        if proc.poll() is None:
            raise RuntimeError(f"{name} is still running")
        self.start_worker(name, int(address.rsplit(":", 1)[1]), wait=False)
        return self.workers[name][1]

    def restart_router(self) -> str:
        port = int(self.router_address.rsplit(":", 1)[1])
        stop_process(self.router_proc)
        return self.start_router(port)

    def stop(self) -> None:
        """Stop the router and the workers (each drains first), then redis-server, and
        delete the credentials generated for this run. The clean-up runs even when the
        processes' stop is interrupted (Ctrl-C while waiting on them): the processes left
        are killed, so no secret and no Redis configuration outlives the cluster."""
        try:
            self._stop_processes()
        finally:
            for proc in [self.router_proc, *(p for _, p in self.workers.values())]:
                if proc is not None and proc.poll() is None:
                    try:
                        proc.kill()
                    except ProcessLookupError:
                        pass
            self._clean_up()

    def _stop_processes(self) -> None:
        stop_process(self.router_proc)
        # every worker drains at once (one SIGTERM each: a second one would cut the drain),
        # then each gets what is left of WORKER_STOP_S before SIGKILL
        procs = [proc for _, proc in self.workers.values() if proc is not None and proc.poll() is None]
        for proc in procs:
            try:
                proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + WORKER_STOP_S
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)

    def _clean_up(self) -> None:
        if self.redis is not None:
            self.redis.stop()
            self.redis = None
        if self.credentials is not None and self.spec.run_dir is None:  # generated for this run only
            import shutil

            shutil.rmtree(self.credentials.run_dir, ignore_errors=True)
            self.credentials = None
        if self._own_log_dir:  # a temporary log folder nobody wrote to is not worth keeping
            try:
                os.rmdir(self.log_dir)
            except OSError:
                pass

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
