"""Shared fixtures: real processes on loopback (redis-server, workers, routers)."""
from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


@pytest.fixture()
def redis_server():
    """A private redis-server on a free loopback port (never the system one)."""
    from kvmesh.services.procs import RedisServer

    server = RedisServer()
    yield server
    server.stop()


@pytest.fixture()
def spawn_worker(tmp_path):
    """Factory: start a `kvmesh worker` process on a free port; stopped at teardown."""
    from kvmesh.services.procs import free_port, python_cmd, spawn, stop_process, wait_healthy

    procs = []

    def start(*extra: str, port: int | None = None, worker_id: str | None = None):
        port = port or free_port()
        wid = worker_id or f"w{port}"
        cmd = python_cmd("worker", "--port", str(port), "--worker-id", wid, "--threads", "1", *extra)
        proc = spawn(cmd, str(tmp_path / f"{wid}.log"))
        procs.append(proc)
        address = f"127.0.0.1:{port}"
        wait_healthy(address, proc=proc, timeout=120)
        return address, proc

    yield start
    for p in procs:
        stop_process(p)


def pytest_configure(config):
    """``KVMESH_TEST_DEVICE`` naming a device torch cannot use stops the run (tests/_device.py)."""
    from tests._device import DEVICE

    if DEVICE != "cpu":
        import torch

        try:
            torch.zeros(1, device=DEVICE)
        except (RuntimeError, AssertionError) as exc:
            raise pytest.UsageError(f"KVMESH_TEST_DEVICE={DEVICE!r} is not usable here: {exc}") from None
