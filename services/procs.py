"""Starting and stopping the local processes of a kvmesh cluster.

Used by `kvmesh up`, `kvmesh demo` and the end-to-end tests: a private redis-server on a
free loopback port, worker and router processes, and a readiness wait on the standard
gRPC health service.
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


#: Ports `free_port` picks from: below Linux's default ephemeral range (32768-60999), from
#: which the kernel takes the local port of every outgoing connection. A port picked here is
#: bound by a child process a moment later; picked from the ephemeral range (``bind(0)``),
#: it was sometimes taken in between by a connection to Redis or a peer ("Address already in
#: use" from a freshly started worker on a busy machine).
FREE_PORT_RANGE = (20000, 32767)


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split()[:2])
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago, outside the kernel's ephemeral
    range where possible (`FREE_PORT_RANGE`), else any free one."""
    import random

    lo, hi = FREE_PORT_RANGE
    eph_lo, eph_hi = _ephemeral_range()
    for _ in range(50):
        port = random.randint(lo, hi)
        if eph_lo <= port <= eph_hi:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class RedisServer:
    """A private, non-persistent redis-server on loopback that requires a password.

    The password is generated here and written, with the rest of the configuration, to a
    0600 file in the server's own temporary directory (never on a command line, where
    ``ps`` would show it). ``url`` carries it: ``redis://:PASSWORD@127.0.0.1:PORT/0``.

    Raises:
        RuntimeError: redis-server is not on PATH (install Debian's redis-server; the
            README's set-up does) or did not answer within ``timeout`` seconds.
    """

    def __init__(self, port: int | None = None, timeout: float = 10.0, password: str | None = None):
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server not found on PATH: run `make setup` (installs Debian's redis-server) "
                               "or pass --redis-url")
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="kvmesh-redis-")
        self.password = password or secrets.token_hex(24)  # a caller may fix it to know the URL in advance
        conf = os.path.join(self.dir, "redis.conf")
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f'port {self.port}\nbind 127.0.0.1\nsave ""\nappendonly no\ndir {self.dir}\n'
                    f"protected-mode yes\nloglevel warning\nrequirepass {self.password}\n")
        self.proc = subprocess.Popen(_with_parent_death_signal([exe, conf]),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"redis://:{self.password}@127.0.0.1:{self.port}/0"
        deadline = time.monotonic() + timeout
        import redis

        while True:
            try:
                redis.Redis.from_url(self.url, socket_timeout=0.5).ping()
                break
            except redis.exceptions.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server on port {self.port} did not start") from None
                time.sleep(0.05)

    def stop(self) -> None:
        stop_process(self.proc)
        shutil.rmtree(self.dir, ignore_errors=True)


def python_cmd(*args: str) -> list[str]:
    """Command line running the kvmesh CLI with this interpreter."""
    return [sys.executable, "-m", "kvmesh.services.cli", *args]


def _with_parent_death_signal(cmd: list[str]) -> list[str]:
    """``cmd`` prefixed so the child gets SIGTERM when its parent dies (Linux).

    Uses util-linux's ``setpriv --pdeathsig TERM`` (prctl PR_SET_PDEATHSIG, kept across
    exec), so a cluster whose launcher is SIGKILLed or loses its terminal leaves nothing
    behind. A ``preexec_fn`` would do the same in-process but can deadlock a
    multi-threaded parent between fork and exec. Without setpriv the command is unchanged.
    """
    setpriv = shutil.which("setpriv") if sys.platform.startswith("linux") else None
    return [setpriv, "--pdeathsig", "TERM", "--", *cmd] if setpriv else list(cmd)


def spawn(cmd: list[str], log_path: str | None = None, env: dict | None = None) -> subprocess.Popen:
    """Start a child process in its own process group, output to ``log_path``.

    The child gets SIGTERM if this process dies (Linux), whatever the cause. Linux ties
    that signal to the spawning *thread*: call this from a thread that lives as long as
    the child should (the main thread in kvmesh).
    """
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL
    log_offset = out.tell() if log_path else 0  # this child's output starts here (the log is appended to)
    full_env = dict(os.environ)
    repo_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    full_env["PYTHONPATH"] = repo_root + os.pathsep + full_env.get("PYTHONPATH", "")
    full_env.update(env or {})
    proc = subprocess.Popen(_with_parent_death_signal(cmd), stdout=out, stderr=subprocess.STDOUT, env=full_env,
                            start_new_session=True)
    proc.log_path = log_path  # named in errors about this process
    proc.log_offset = log_offset
    return proc


class SignalEvent:
    """A stop flag a signal handler may set: ``set``, ``is_set`` and ``wait`` as
    `threading.Event`'s.

    `threading.Event.set` takes the event's internal lock, a plain `threading.Lock`. A
    handler runs in the main thread between two bytecodes, so when the signal lands while
    the main thread itself holds that lock (inside `Event.wait`, as it wakes from a timed
    wait), the handler's ``set`` waits for a lock its own thread holds: the process hangs
    and never stops. Here ``set`` only stores a flag, and ``wait`` polls it every
    `POLL_S` seconds with `time.sleep`, which holds no lock.
    """

    #: Seconds between looks at the flag while waiting.
    POLL_S = 0.05

    def __init__(self) -> None:
        self._flag = False

    def set(self) -> None:
        self._flag = True

    def is_set(self) -> bool:
        return self._flag

    def wait(self, timeout: float | None = None) -> bool:
        """Until set or ``timeout`` seconds (None: no limit); returns whether it is set."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._flag:
            left = self.POLL_S if deadline is None else min(self.POLL_S, deadline - time.monotonic())
            if left <= 0:
                break
            time.sleep(left)
        return self._flag


class StartCancelled(Exception):
    """Starting processes was called off (``cancel`` was set: SIGINT/SIGTERM during start-up)."""


def wait_healthy(address: str, timeout: float = 120.0, proc: subprocess.Popen | None = None, tls=None,
                 cancel: threading.Event | None = None) -> None:
    """Block until the gRPC health service at ``address`` answers SERVING (over mutual TLS
    with ``tls``, a `kvmesh.workers.tls.TlsConfig`).

    With ``proc`` logging to a file, also waits for its "listening on" line, so a server
    already on that port does not pass for the child.

    Raises:
        RuntimeError: ``proc`` exited first (the message has its last error line), or
            ``timeout`` seconds passed.
        StartCancelled: ``cancel`` was set meanwhile (checked first: a child that an
            interrupt reached too has not failed on its own).
    """
    deadline = time.monotonic() + timeout
    with (tls.peer_sync_channel(address) if tls is not None else grpc.insecure_channel(address)) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while True:
            if cancel is not None and cancel.is_set():
                raise StartCancelled(f"stopped waiting for {address}")
            if proc is not None and proc.poll() is not None:
                from kvmesh.services.cli_checks import exited_message

                raise RuntimeError(exited_message(f"process for {address}", proc, " before serving"))
            try:
                resp = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                # SERVING may come from another process on a busy port: the child must also
                # have said it is listening (its bind succeeded)
                if resp.status == health_pb2.HealthCheckResponse.SERVING and _said_listening(proc):
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{address} not healthy after {timeout:.0f} s")
            time.sleep(0.1)


def _said_listening(proc: subprocess.Popen | None) -> bool:
    """Whether ``proc``'s log has the "listening on" line kvmesh servers print after binding
    (True when there is no process or log to ask)."""
    log = getattr(proc, "log_path", None)
    if not log:
        return True
    try:
        with open(log, "rb") as fh:
            fh.seek(getattr(proc, "log_offset", 0))
            return b" listening on " in fh.read()
    except OSError:
        return True


def stop_process(proc: subprocess.Popen | None, timeout: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after ``timeout`` seconds; never raises for a dead process."""
    if proc is None or proc.poll() is not None:
        return
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout)
    except ProcessLookupError:
        pass
