"""Flags a new user got wrong are usage errors (exit 2, one line naming the flag), found
before anything starts: a --disk-dir that cannot be a folder, a KV pool larger than the
memory there is, tiers smaller than one block, a busy router/HTTP port, a --cluster name
that cannot be part of a Redis key, an infinite --timeout, and an unreachable Ray cluster.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

KVMESH = os.path.join(os.path.dirname(sys.executable), "kvmesh")


def kvmesh(*args: str, timeout: float = 90, env: dict | None = None) -> subprocess.CompletedProcess:
    """The entry point as a process; a check that is missing shows as a timeout (the command
    starts serving) rather than a hang."""
    return subprocess.run([KVMESH, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def _usage_error(res: subprocess.CompletedProcess, *words: str) -> str:
    err = res.stderr
    assert res.returncode == 2, (res.returncode, err[-3000:])
    assert "Traceback" not in err and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    for word in words:
        assert word in err, (word, err)
    return err


@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def _closed_port() -> int:
    with socket.socket() as s:  # bound, never listening: a connect is refused
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ 1. --disk-dir


def _bad_disk_dirs(tmp_path) -> list[str]:
    file = tmp_path / "a-file"
    file.write_text("x")
    out = [str(file), str(file / "sub")]
    if os.path.isdir("/proc/self"):
        out.append("/proc/kvmesh-no-such-folder")  # root passes access(), mkdir still fails
    return out


def test_disk_dir_problem_names_the_flag(tmp_path):
    from kvmesh.services.cli_checks import disk_dir_problem

    msgs = [disk_dir_problem(p) for p in _bad_disk_dirs(tmp_path)]
    assert "exists and is not a folder" in msgs[0]
    assert all(m and m.startswith("--disk-dir ") and "cannot be created" in m for m in msgs[1:]), msgs
    assert disk_dir_problem(str(tmp_path / "new" / "deeper")) is None  # created later by the tier
    assert disk_dir_problem(str(tmp_path)) is None
    assert sorted(os.listdir(tmp_path)) == ["a-file"]  # the probes left nothing behind


def test_worker_with_a_disk_dir_that_is_a_file_exits_2(tmp_path):
    file = tmp_path / "existing-file"
    file.write_text("x")
    res = kvmesh("worker", "--port", "0", "--threads", "1", "--host-bytes", "1M", "--disk-dir", str(file),
                 "--disk-bytes", "1M")
    _usage_error(res, "--disk-dir", "not a folder")


def test_up_checks_the_disk_dir_before_starting_anything(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    bad = "/proc/x" if os.path.isdir("/proc/self") else str(tmp_path / "f" / "x")
    if not bad.startswith("/proc"):
        (tmp_path / "f").write_text("x")
    res = kvmesh("up", "--disk-dir", bad, "--host-bytes", "1M", "--disk-bytes", "1M", env={"TMPDIR": str(tmp)})
    _usage_error(res, "--disk-dir")
    assert "cluster up" not in res.stdout and os.listdir(tmp) == []  # no redis-server, worker or log folder


# ------------------------------------------------------------------ 2. KV pool larger than memory


def test_kv_block_bytes_is_what_the_engine_allocates():
    import dataclasses

    from kvmesh.services.cli_checks import kv_block_bytes
    from kvmesh.workers.config import ModelConfig
    from kvmesh.workers.model import allocate_kv_cache

    for cfg in (ModelConfig.tiny(), dataclasses.replace(ModelConfig.tiny(), dtype="bfloat16")):
        pool = allocate_kv_cache(cfg, 3, 5)
        assert kv_block_bytes(cfg, 5) * 3 == pool.numel() * pool.element_size()


@pytest.mark.parametrize("argv", [["--block-size", "100000"], ["--num-blocks", "100000000"]])
def test_worker_pool_larger_than_memory_exits_2_with_both_figures(argv):
    res = kvmesh("worker", "--port", "0", "--threads", "1", *argv)
    err = _usage_error(res, "--num-blocks", "--block-size", "available")
    assert "enforce fail" not in err and ("MemAvailable" in err or "memory.max" in err), err


def test_up_checks_the_pool_before_starting_anything(tmp_path):
    res = kvmesh("up", "--num-blocks", "100000000", env={"TMPDIR": str(tmp_path)})
    _usage_error(res, "--num-blocks", "x 2 workers", "available")
    assert "cluster up" not in res.stdout and os.listdir(tmp_path) == []


def test_up_counts_the_pool_of_every_worker(monkeypatch):
    from kvmesh.services import cli_checks
    from kvmesh.services.cli import build_parser
    from kvmesh.services.cluster_cli import _tier_flag_problem

    per_worker = cli_checks.kv_block_bytes(cli_checks.model_shape(None), 16) * 1000
    monkeypatch.setattr(cli_checks, "available_memory", lambda device: (per_worker * 2, "MemAvailable"))
    args = build_parser().parse_args(["up", "--workers", "2", "--num-blocks", "1000"])
    assert cli_checks.up_problem(args, _tier_flag_problem(args)) is None
    args = build_parser().parse_args(["up", "--workers", "3", "--num-blocks", "1000"])
    msg = cli_checks.up_problem(args, _tier_flag_problem(args))
    assert msg and "--num-blocks 1000" in msg and f"x 3 workers = {per_worker * 3:,} bytes" in msg, msg
    assert f"{per_worker * 2:,} bytes" in msg


def test_cuda_pool_is_checked_against_free_device_memory(monkeypatch):
    import argparse

    import subprocess

    import torch

    from kvmesh.services import cli_checks
    from kvmesh.workers.config import ModelConfig

    seen = []

    def nvidia_smi(cmd, **kw):  # 1 GiB free on GPU 0
        seen.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout="1024\n", stderr="")

    def no_context(*a, **k):
        raise AssertionError("the check opened a CUDA context (torch.cuda.mem_get_info)")

    monkeypatch.setattr(subprocess, "run", nvidia_smi)
    monkeypatch.setattr(torch.cuda, "mem_get_info", no_context)
    args = argparse.Namespace(device="cuda:0", block_size=16, num_blocks=1 << 15)  # 2 GiB of pool
    msg = cli_checks.kv_pool_problem(args, ModelConfig.tiny())
    assert msg and "--num-blocks 32768" in msg and f"{1 << 30:,} bytes" in msg and "free on cuda:0" in msg
    assert seen and seen[0][0] == "nvidia-smi" and seen[0][-2:] == ["-i", "0"]
    args.num_blocks = 1 << 13  # 512 MiB
    assert cli_checks.kv_pool_problem(args, ModelConfig.tiny()) is None


# ------------------------------------------------------------------ 3. tiers smaller than one block


def test_tier_minimum_is_exactly_one_block():
    import argparse

    import torch

    from kvmesh.cache_store.host_tier import HostTier
    from kvmesh.cache_store.kv_codec import make_codec
    from kvmesh.services.cli_checks import tier_block_bytes, tier_size_problem
    from kvmesh.workers.config import ModelConfig

    cfg = ModelConfig.tiny()
    shape = (cfg.num_hidden_layers, 2, cfg.num_key_value_heads, 16, cfg.head_dim)
    for codec in ("none", "fp8", "int4"):
        need = tier_block_bytes(cfg, 16, codec)
        assert HostTier(need, make_codec(codec, shape, torch.float32)).num_slots == 1
        args = argparse.Namespace(block_size=16, host_bytes=need - 1, host_codec=codec, peer_bytes=0)
        assert f"give at least {need}" in tier_size_problem(args, cfg)
        args.host_bytes = need
        assert tier_size_problem(args, cfg) is None
    need = tier_block_bytes(cfg, 16, "none")  # the staging area keeps exact KV
    args = argparse.Namespace(block_size=16, host_bytes=0, host_codec="none", peer_bytes=need - 1)
    assert "--peer-bytes" in tier_size_problem(args, cfg) and f"give at least {need}" in tier_size_problem(args, cfg)
    args.peer_bytes = need
    assert tier_size_problem(args, cfg) is None
    # the default staging size, too small for a large block: left to the engine (staging off,
    # with a warning) unless a remote tier needs it
    from kvmesh.cache_store.tier_config import DEFAULT_PEER_BYTES

    args = argparse.Namespace(block_size=32768, host_bytes=0, host_codec="none", peer_bytes=DEFAULT_PEER_BYTES)
    assert tier_block_bytes(cfg, 32768, "none") > DEFAULT_PEER_BYTES
    assert tier_size_problem(args, cfg) is None
    args.remote_bytes = 1 << 40
    assert "--peer-bytes" in tier_size_problem(args, cfg)


@pytest.mark.parametrize("argv, flag", [
    (["--host-bytes", "1"], "--host-bytes"),
    (["--host-bytes", "1M", "--disk-dir", "DIR", "--disk-bytes", "1"], "--disk-bytes"),
    (["--host-bytes", "1M", "--peer-bytes", "32K"], "--peer-bytes"),
])
def test_worker_tier_smaller_than_one_block_exits_2(tmp_path, argv, flag):
    argv = [str(tmp_path / "disk") if a == "DIR" else a for a in argv]
    res = kvmesh("worker", "--port", "0", "--threads", "1", *argv)
    _usage_error(res, flag, "at least")
    assert not (tmp_path / "disk").exists()


# ------------------------------------------------------------------ 4. busy ports


def test_router_on_a_busy_port_exits_2(busy_port):
    res = kvmesh("router", "--port", str(busy_port), "--redis-url", "redis://127.0.0.1:1/0")
    _usage_error(res, f"--port {busy_port}", "in use")


@pytest.mark.parametrize("flag", ["--http-port", "--metrics-port"])
def test_router_on_a_busy_http_or_metrics_port_exits_2(busy_port, flag):
    res = kvmesh("router", "--port", "0", flag, str(busy_port), "--redis-url", "redis://127.0.0.1:1/0")
    _usage_error(res, f"{flag} {busy_port}")


def test_worker_on_a_busy_http_port_exits_2_before_loading(busy_port):
    res = kvmesh("worker", "--port", "0", "--threads", "1", "--http-port", str(busy_port))
    _usage_error(res, f"--http-port {busy_port}", "in use")


@pytest.mark.parametrize("command", ["worker", "router"])
def test_a_key_of_another_certificate_exits_2_before_loading(tmp_path, command):
    """`--tls-key` of another certificate: one line naming the flags, before the worker loads
    its model (or the router connects to anything), not an SSL traceback once serving."""
    from kvmesh.services.credentials import generate_cluster_credentials

    c = generate_cluster_credentials(str(tmp_path / "run"))
    extra = ["--threads", "1"] if command == "worker" else ["--redis-url", "redis://127.0.0.1:1/0"]
    res = kvmesh(command, "--port", "0", *extra, "--tls-cert", c.cert, "--tls-key", c.client_key, "--tls-ca", c.ca)
    _usage_error(res, f"--tls-key {c.client_key} is not the private key of --tls-cert {c.cert}")


def test_a_bind_lost_after_the_check_still_names_the_flag():
    from kvmesh.services.cli_checks import bind_error_problem

    msg = bind_error_problem(RuntimeError("could not bind 127.0.0.1:5000: is another process using it?"), 5000)
    assert msg.startswith("--port 5000: could not bind")
    assert bind_error_problem(RuntimeError("something else"), 5000) is None


# ------------------------------------------------------------------ 5. --cluster


@pytest.mark.parametrize("command", [
    ["worker", "--port", "0"], ["router", "--port", "0", "--redis-url", "redis://127.0.0.1:1/0"], ["up"], ["ray"],
])
@pytest.mark.parametrize("name", ["", "a b*", "x" * 65, "a:b", "ü"])
def test_cluster_name_is_checked_by_every_command(capsys, command, name):
    from kvmesh.services.cli import build_parser

    with pytest.raises(SystemExit) as exit_:  # parsing only: an accepted name would start the command
        build_parser().parse_args([*command, "--cluster", name])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--cluster" in err and "A-Za-z" not in err and "letters, digits" in err, err


@pytest.mark.parametrize("name", ["g1.20261207", "a.kdeadbeef", "prod.ABCDEF01.x"])
def test_cluster_names_that_look_like_a_remote_namespace_are_refused(capsys, name):
    """The remote tier keys cluster C's records under C.TAG and C.kID (8 hex digits each): a
    cluster named like that would share key names with another's (and its collector's)."""
    from kvmesh.services.cli import build_parser

    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["worker", "--port", "0", "--cluster", name])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--cluster" in err and "8 hexadecimal digits" in err, err


@pytest.mark.parametrize("name", ["default", "t", "kvmesh-v1", "c1234-56789012", "tenants", "a.b_c-D9", "x" * 64,
                                  "kvmesh-20261207", "a.2026120", "a.202612070", "20261207.a"])
def test_cluster_names_in_use_are_accepted(name):
    from kvmesh.services.cli import build_parser

    parser = build_parser()
    for command in (["worker", "--port", "0"], ["router"], ["up"], ["ray"]):
        assert parser.parse_args([*command, "--cluster", name]).cluster == name


# ------------------------------------------------------------------ 6. --timeout inf


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "Infinity"])
def test_an_infinite_timeout_says_it_must_be_finite(capsys, value):
    from kvmesh.services.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--target", "127.0.0.1:5", "--prompt", "hi", f"--timeout={value}"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--timeout must be a finite number > 0" in err, err


# ------------------------------------------------------------------ 7. kvmesh ray, unreachable


def test_ray_with_an_unreachable_address_fails_fast():
    port = _closed_port()
    t0 = time.monotonic()
    res = kvmesh("ray", "--address", f"127.0.0.1:{port}", "--workers", "1", timeout=60,
                 env={"RAY_ADDRESS": "", "RAY_USAGE_STATS_ENABLED": "0"})
    took = time.monotonic() - t0
    assert res.returncode in (1, 2), res.stderr[-3000:]
    assert f"--address 127.0.0.1:{port}" in res.stderr and "could not reach the Ray cluster" in res.stderr
    assert "Traceback" not in res.stderr and took < 30, (took, res.stderr[-3000:])


def test_ray_address_problem(monkeypatch):
    from kvmesh.services.ray_cli import _host_port, ray_address_problem

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert _host_port("ray://head") == ("head", 10001) and _host_port("[::1]:6379") == ("::1", 6379)
    assert _host_port("nohost") is None and _host_port("h:99999") is None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert ray_address_problem(f"127.0.0.1:{s.getsockname()[1]}") is None  # reachable: ray.init's turn
    port = _closed_port()
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")  # what auto means to ray.init
    assert f"127.0.0.1:{port}" in ray_address_problem("auto")
    monkeypatch.delenv("RAY_ADDRESS")
    monkeypatch.setitem(sys.modules, "ray._private.services", None)  # a Ray without that private lookup
    assert ray_address_problem("auto") is None  # no pre-check: ray.init looks the cluster up itself


def test_up_restart_policy_backs_off_and_stops_a_crash_loop():
    """`kvmesh up --max-restarts N`: 1, 2, 4, ... s between restarts (capped), at most N per
    process within the window; a process dying more often is not restarted; 0 never, -1 always."""
    from kvmesh.services.launcher import RestartPolicy

    p = RestartPolicy(max_restarts=3, window_s=100.0, first_backoff_s=1.0, max_backoff_s=3.0)
    assert [p.next_delay("worker-0", t) for t in (0.0, 5.0, 10.0)] == [1.0, 2.0, 3.0]
    assert p.next_delay("worker-0", 20.0) is None            # a fourth death inside 100 s
    assert p.next_delay("worker-1", 20.0) == 1.0             # counted per process
    assert p.next_delay("worker-0", 104.0) == 3.0            # the first restart left the window: 3 again
    assert RestartPolicy(0).next_delay("router", 0.0) is None
    always = RestartPolicy(-1, max_backoff_s=30.0)
    assert [always.next_delay("w", float(t)) for t in range(8)][-1] == 30.0
    with pytest.raises(ValueError):
        RestartPolicy(-2)


def test_up_refuses_a_max_restarts_below_minus_one():
    import argparse

    from kvmesh.services.cli_checks import up_problem

    args = argparse.Namespace(workers=1, max_restarts=-3)
    assert "--max-restarts must be -1 (always), 0 (never) or more (got -3)" == up_problem(args)


def test_a_truncated_safetensors_file_is_a_one_line_error(tmp_path):
    """A checkpoint cut short in copying: `model_problem` names the file (header and sizes
    checked, no tensor read), and `kvmesh worker --model` exits 2 with that line instead of
    a traceback."""
    from kvmesh.services.cli_checks import model_problem
    from kvmesh.workers.config import ModelConfig
    from kvmesh.workers.loader import save_tiny_checkpoint

    model = save_tiny_checkpoint(str(tmp_path / "m"), ModelConfig.tiny())
    assert model_problem(model) is None
    path = next(p for p in (tmp_path / "m").iterdir() if p.suffix == ".safetensors")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    problem = model_problem(model)
    assert problem and path.name in problem and "not a readable safetensors file" in problem
    res = kvmesh("worker", "--port", "0", "--model", model, timeout=120)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "not a readable safetensors file" in res.stderr


def test_a_restarted_process_keeps_its_metrics_and_http_ports(tmp_path):
    """`kvmesh up` printed each process's /metrics URL and the HTTP front's: a worker or
    router it restarts is started on the same ports, so those URLs stay good."""
    from kvmesh.services.launcher import ClusterSpec, LocalCluster

    c = LocalCluster(ClusterSpec(num_workers=1, http_port=0, log_dir=str(tmp_path)))
    first = c.worker_cmd("worker-0", 1234)
    again = c.worker_cmd("worker-0", 1234)
    assert first == again and "--metrics-port" in first
    assert c._metrics_args("router") == c._metrics_args("router")


def test_http_and_metrics_port_minus_one_mean_off_as_for_up():
    """``kvmesh up --http-port -1`` turns the front off; the worker and router take -1 the same
    way instead of refusing it, and other negative ports are still refused."""
    import argparse

    from kvmesh.services.observability import server_ports

    args = argparse.Namespace(http_port=-1, metrics_port=0)
    assert server_ports(args) == {"metrics_port": 0} and args.http_port is None
    with pytest.raises(ValueError, match="--http-port must be a port"):
        server_ports(argparse.Namespace(http_port=-2, metrics_port=None))


def test_free_ports_come_from_outside_the_ephemeral_range():
    """A port picked for a child is bound a moment later; the kernel takes outgoing
    connections' local ports from its ephemeral range, so picks come from below it."""
    from kvmesh.services.procs import FREE_PORT_RANGE, _ephemeral_range, free_port

    eph_lo, eph_hi = _ephemeral_range()
    if eph_lo <= FREE_PORT_RANGE[0] and FREE_PORT_RANGE[1] <= eph_hi:
        pytest.skip(f"this machine's ephemeral range {eph_lo}-{eph_hi} covers the whole pick range")
    ports = [free_port() for _ in range(20)]
    assert all(FREE_PORT_RANGE[0] <= p <= FREE_PORT_RANGE[1] and not eph_lo <= p <= eph_hi for p in ports), ports
    with socket.socket() as s:  # and it is free
        s.bind(("127.0.0.1", ports[0]))


@pytest.mark.parametrize("argv,needle", [
    (["--host-codec", "fp8"], "--host-codec fp8 has no host tier"),
    (["--host-bytes", "4M", "--disk-codec", "int4"], "--disk-codec int4 has no disk tier"),
    (["--host-bytes", "4M", "--disk-write-mode", "back"], "--disk-write-mode back has no disk tier"),
    (["--host-bytes", "999999T", "--num-blocks", "16"], "of host memory, but"),
], ids=["host-codec", "disk-codec", "write-mode", "host-bytes-too-big"])
def test_tier_flags_that_would_do_nothing_or_cannot_be_allocated_exit_2(argv, needle, tmp_path):
    """Each was accepted: three started a worker without the tier the flag was for, and a
    host tier bigger than memory ended in a raw allocator error after the model loaded."""
    res = subprocess.run([sys.executable, "-m", "kvmesh.services.cli", "worker", "--port", "0", *argv],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert res.returncode == 2 and needle in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_up_prints_each_distinct_worker_warning_once(tmp_path):
    """`up` repeats what its workers warned about at start (e.g. a host tier too small to
    write to disk), once per message, instead of leaving it in the worker logs."""
    from kvmesh.services.cluster_cli import startup_warnings

    small = "kvmesh.worker: --host-bytes holds 16 blocks, fewer than the device pool's 128: ..."
    (tmp_path / "worker-0.log").write_text(f"2026-12-04 10:00:00,001 INFO kvmesh.worker: serving\n"
                                           f"2026-12-04 10:00:00,002 WARNING {small}\n")
    (tmp_path / "worker-1.log").write_text(f"2026-12-04 10:00:00,003 WARNING {small}\n"
                                           "2026-12-04 10:00:00,004 WARNING kvmesh.worker: context limited\n")
    assert startup_warnings(str(tmp_path), ["worker-0", "worker-1", "worker-2"]) == [
        f"worker-0: {small}", "worker-1: kvmesh.worker: context limited"]


def test_the_memory_check_counts_the_weights_in_the_dtype_they_are_computed_in(monkeypatch, tmp_path):
    """A bf16 checkpoint computed in float32 (`--compute-dtype auto` on a CPU) takes twice its
    files' size: the start-up check counts the weights so, beside the KV pool, and names
    --compute-dtype model, which keeps them at their size. Free memory is the fault injected."""
    import dataclasses

    from kvmesh.services import cli_checks
    from kvmesh.services.cli import build_parser
    from kvmesh.workers.config import ModelConfig
    from kvmesh.workers.loader import save_tiny_checkpoint

    model = save_tiny_checkpoint(str(tmp_path / "bf16"), dataclasses.replace(ModelConfig.tiny(), dtype="bfloat16"),
                                 seed=0)
    stored = sum(p.stat().st_size for p in (tmp_path / "bf16").glob("*.safetensors"))
    cfg = cli_checks.model_shape(model)
    pool = cli_checks.kv_block_bytes(cfg, 16) * 64

    def args(*extra):
        return build_parser().parse_args(["worker", "--port", "0", "--model", model, "--num-blocks", "64",
                                          "--block-size", "16", *extra])

    assert cli_checks.weight_bytes(args(), cfg)[0] == 2 * stored
    assert cli_checks.weight_bytes(args("--compute-dtype", "model"), cfg)[0] == stored
    # room for the pool and the bf16 weights, not for float32 ones
    monkeypatch.setattr(cli_checks, "available_memory", lambda device: (pool + stored + stored // 2, "MemAvailable"))
    msg = cli_checks.kv_pool_problem(args(), cfg)
    assert msg and f"the weights' {2 * stored:,} bytes" in msg and "--compute-dtype model" in msg, msg
    assert cli_checks.kv_pool_problem(args("--compute-dtype", "model"), cfg) is None
