"""The `kvmesh` command line tells the truth: success means success, arguments are checked
before anything starts, a failing child's reason is shown, and Ctrl-C keeps finished work.

Every test runs the installed `kvmesh` entry point (or ``python -m kvmesh...``) as a
subprocess against real worker, router and redis-server processes on loopback.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

KVMESH = os.path.join(os.path.dirname(sys.executable), "kvmesh")
MAX_MODEL_LEN = 60  # the module worker's context: the multi-turn bench's third turns exceed it


def kvmesh(*args: str, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([KVMESH, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def _listening_port(log_path: str, proc, timeout: float = 120.0) -> int:
    """The port a server printed in its "listening on HOST:PORT" line."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(log_path, encoding="utf-8", errors="replace") as fh:
            m = re.search(r"listening on [\d.]+:(\d+)", fh.read())
        if m:
            return int(m.group(1))
        assert proc.poll() is None, open(log_path).read()
        time.sleep(0.1)
    raise AssertionError(f"no listening line in {log_path}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """redis-server, one registered worker started with ``--port 0``, one router."""
    from kvmesh.services.procs import RedisServer, free_port, python_cmd, spawn, stop_process, wait_healthy

    logs = tmp_path_factory.mktemp("logs")
    redis = RedisServer()
    procs = []
    try:
        wlog = str(logs / "w0.log")
        worker = spawn(python_cmd("worker", "--port", "0", "--worker-id", "w0", "--threads", "1", "--num-blocks", "64",
                                  "--max-model-len", str(MAX_MODEL_LEN), "--redis-url", redis.url, "--cluster", "t"),
                       wlog)
        procs.append(worker)
        worker_addr = f"127.0.0.1:{_listening_port(wlog, worker)}"
        wait_healthy(worker_addr, proc=worker)
        router_addr = f"127.0.0.1:{free_port()}"
        router = spawn(python_cmd("router", "--port", router_addr.rsplit(":", 1)[1], "--redis-url", redis.url,
                                  "--cluster", "t"), str(logs / "router.log"))
        procs.append(router)
        wait_healthy(router_addr, proc=router)
        yield {"redis": redis, "worker": worker_addr, "router": router_addr, "logs": logs}
    finally:
        for p in procs:
            stop_process(p)
        redis.stop()


# ---------------------------------------------------------------------------- arguments checked first


def _cuda_flag() -> str:
    import torch

    return "cuda:99" if torch.cuda.is_available() else "cuda"  # a device this machine lacks


@pytest.mark.parametrize("argv, flag", [
    (["--workers", "0"], "--workers"),
    (["--workers", "-1"], "--workers"),
    (["--policy", "bogus"], "--policy"),
    (["--model", "/nonexistent"], "--model"),
    (["--block-size", "0"], "--block-size"),
    (["--num-blocks", "0"], "--num-blocks"),
    (["--max-seqs", "0"], "--max-seqs"),
    (["--peer-fetch-max-s", "0"], "--peer-fetch-max-s"),
    (["--device", "CUDA"], "--device"),
    (["--port", "70001"], "--port"),
    (["--port", "-5"], "--port"),
    (["--disk-dir", "/tmp/kvmesh-nowhere"], "--disk-bytes"),
    (["--host-bytes", "64M", "--disk-bytes", "1G"], "--disk-dir"),  # no disk tier would be set up
    (["--redis-url", "redis://127.0.0.1:1/0"], "--redis-url"),
    (["--host-bytes", "999999T"], "--host-bytes"),  # more than memory: was an allocator error in each worker
    (["--host-codec", "int4"], "--host-codec"),  # no host tier: the flag did nothing
])
def test_up_rejects_bad_arguments_before_starting_anything(tmp_path, argv, flag):
    argv = [_cuda_flag() if a == "CUDA" else a for a in argv]
    res = kvmesh("up", *argv, env={"TMPDIR": str(tmp_path)})
    assert res.returncode == 2, res.stderr
    assert flag in res.stderr and "Traceback" not in res.stderr
    assert "cluster up" not in res.stdout
    assert os.listdir(tmp_path) == []  # no log folder, no redis-server folder: nothing started
    if flag == "--policy":
        assert "kv_aware" in res.stderr and "round_robin" in res.stderr  # the valid names


_CHECK_WITHOUT_TORCH = """
import sys
from kvmesh.services.cli import main
rc = main(sys.argv[1:])
print("torch imported" if "torch" in sys.modules else "torch not imported", rc)
"""


@pytest.mark.parametrize("argv", [
    ["up", "--workers", "0"],
    ["up", "--disk-dir", "/tmp/kvmesh-nowhere"],
    ["up", "--host-bytes", "64M", "--host-codec", "fp8", "--disk-bytes", "1G"],
    ["demo", "--policies", "bogus"],
])
def test_flag_checks_answer_without_importing_torch(argv):
    # torch's import alone takes seconds on a small machine; a wrong flag is told at once
    res = subprocess.run([sys.executable, "-c", _CHECK_WITHOUT_TORCH, *argv], capture_output=True, text=True,
                         timeout=60)
    assert "torch not imported 2" in res.stdout, (res.stdout, res.stderr[-2000:])
    assert "error: " in res.stderr


@pytest.mark.parametrize("argv, flag", [
    (["demo", "--workers", "0"], "--workers"),
    (["demo", "--policies", "bogus"], "--policies"),
    (["demo", "--max-requests", "-3"], "--max-requests"),
    (["demo", "--trace", "/nonexistent.jsonl"], "--trace"),
    (["bench", "--policies", "kv_aware", "--device", "CUDA"], "--device"),
    (["bench", "--policies", "kv_aware", "--model", "/nonexistent"], "--model"),
    (["router", "--port", "0", "--redis-url", "redis://127.0.0.1:1/0", "--policy", "bogus"], "--policy"),
])
def test_cluster_commands_check_flags_before_starting_a_cluster(tmp_path, argv, flag):
    argv = [_cuda_flag() if a == "CUDA" else a for a in argv]
    if argv[0] in ("bench", "demo"):
        argv += ["--out", str(tmp_path / "out")]
    res = kvmesh(*argv, env={"TMPDIR": str(tmp_path)})
    assert res.returncode == 2, res.stderr
    assert flag in res.stderr and "Traceback" not in res.stderr and "starting a cold cluster" not in res.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flag", ["--port", "--http-port"])
def test_up_on_a_busy_port_fails_with_the_bind_error(tmp_path, flag):
    """Either port `up` binds on request is checked before redis-server or a worker starts
    (a busy --http-port failed only once the router started, after the workers loaded)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        res = kvmesh("up", flag, str(port), env={"TMPDIR": str(tmp_path)})
    assert res.returncode == 2 and "cluster up" not in res.stdout
    assert res.stderr.startswith(f"error: {flag} {port}: ") and "in use" in res.stderr, res.stderr
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("argv", [["--port", "PORT", "--http-port", "PORT"], ["--http-port", "70000"],
                                  ["--http-port", "-2"]])
def test_up_refuses_an_http_port_it_cannot_serve_on_before_starting(tmp_path, argv):
    from kvmesh.services.procs import free_port

    port = str(free_port())
    res = kvmesh("up", *[port if a == "PORT" else a for a in argv], env={"TMPDIR": str(tmp_path)})
    assert res.returncode == 2 and "--http-port" in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert os.listdir(tmp_path) == []


def test_a_server_already_on_the_port_does_not_pass_for_the_child(cluster, tmp_path):
    """The port check and the child's bind race; the readiness wait must not take the other
    router's SERVING answer for the child's."""
    from kvmesh.services.procs import python_cmd, spawn, stop_process, wait_healthy

    port = cluster["router"].rsplit(":", 1)[1]
    proc = spawn(python_cmd("router", "--port", port, "--redis-url", cluster["redis"].url, "--cluster", "t"),
                 str(tmp_path / "second-router.log"))
    try:
        with pytest.raises(RuntimeError, match="could not bind"):  # the child's own last error line
            wait_healthy(cluster["router"], proc=proc, timeout=120)
    finally:
        stop_process(proc)


_INTERNAL_FIELDS = ("disk_dir", "disk_bytes", "remote_url", "max_fetch_s", "max_num_seqs")


def test_worker_errors_are_one_line_naming_the_flag(capsys):
    from kvmesh.services.cli import main

    cases = [  # the entry point as a process for the inputs
        (["--device", _cuda_flag()], "--device"),
        (["--disk-dir", "/tmp/kvmesh-nowhere"], "--disk-bytes"),
        (["--peer-fetch-max-s", "0"], "--peer-fetch-max-s"),
    ]
    for argv, flag in cases:
        res = kvmesh("worker", "--port", "0", "--threads", "1", *argv)
        assert res.returncode == 2, (argv, res.stderr)
        assert flag in res.stderr and "Traceback" not in res.stderr, (argv, res.stderr)
        assert len(res.stderr.strip().splitlines()) == 1, res.stderr
        assert not any(field in res.stderr for field in _INTERNAL_FIELDS), res.stderr
    res = kvmesh("worker", "--port", "70001")
    assert res.returncode == 2 and "--port" in res.stderr
    for argv, flag in [(["--host-bytes", "1M", "--remote-bytes", "1M"], "--redis-url"),
                       (["--max-seqs", "0"], "--max-seqs")]:  # the same code in this process
        assert main(["worker", "--port", "0", "--threads", "1", *argv]) == 2
        err = capsys.readouterr().err
        assert flag in err and not any(field in err for field in _INTERNAL_FIELDS), err
    for port in ("-5", "http"):
        with pytest.raises(SystemExit) as exit_:
            main(["worker", "--port", port])
        assert exit_.value.code == 2 and "--port" in capsys.readouterr().err


@pytest.mark.parametrize("argv,flag", [
    (["generate", "--target", "127.0.0.1:99999", "--prompt", "hi"], "--target"),  # not wrapped to 34463
    (["generate", "--target", "notahost", "--prompt", "hi"], "--target"),
    (["generate", "--target", "127.0.0.1:5", "--prompt", "hi", "--timeout", "0"], "--timeout"),
    (["status", "--target", "127.0.0.1:5", "--timeout", "0"], "--timeout"),  # was a DEADLINE_EXCEEDED RPC
    (["status", "--target", "127.0.0.1:5", "--timeout", "-3"], "--timeout"),
    (["status", "--target", "127.0.0.1:5", "--timeout", "nan"], "--timeout"),
    (["status", "--target", "127.0.0.1:5", "--timeout", "soon"], "--timeout"),
    (["generate", "--target", "127.0.0.1:5", "--prompt", "hi", "--max-tokens", "0"], "--max-tokens"),
    (["generate", "--target", "127.0.0.1:5", "--prompt", "hi", "--max-tokens", str(2**32)], "--max-tokens"),
    (["generate", "--target", "127.0.0.1:5", "--prompt", "hi", "--temperature", "-1"], "--temperature"),
    (["generate", "--target", "127.0.0.1:5", "--prompt", "hi", "--temperature", "nan"], "--temperature"),
    (["generate", "--target", "127.0.0.1:5", "--prompt", "hi", "--temperature", "1e308"], "--temperature"),  # inf as float32
    (["generate", "--target", "127.0.0.1:5", "--prompt", "hi", "--top-p", "0"], "--top-p"),  # the wire's "off"
    (["generate", "--target", "127.0.0.1:5", "--prompt", "hi", "--top-p", "1.5"], "--top-p"),
    (["generate", "--target", "127.0.0.1:5", "--prompt", "hi", "--top-p", "1e-300"], "--top-p"),  # 0 as float32
    (["generate", "--target", "127.0.0.1:5", "--prompt", "hi", "--seed", "-1"], "--seed"),
    (["generate", "--target", "127.0.0.1:5", "--token-ids", "1,,2"], "--token-ids"),  # was read as [1, 2]
    (["generate", "--target", "127.0.0.1:5", "--token-ids", "1,2,"], "--token-ids"),
    (["generate", "--target", "127.0.0.1:5", "--token-ids", "1,x"], "--token-ids"),
    (["generate", "--target", "127.0.0.1:5", "--token-ids", str(2**32)], "--token-ids"),
])
def test_client_flags_are_checked_before_dialing(capsys, argv, flag):
    """A bad ``--target``, ``--timeout`` or sampling flag is a usage error naming the flag, not
    a connection error to some other port, nor a gRPC status for a check made here."""
    from kvmesh.services.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and flag in err and "UNAVAILABLE" not in err, err
    assert "INVALID_ARGUMENT" not in err, err


def test_generate_credential_flags_are_a_usage_error(tmp_path, monkeypatch):
    """A client certificate without ``--tls-ca`` is told as a usage error, not as a gRPC
    status: nothing was sent."""
    for name in ("KVMESH_TLS_CA", "KVMESH_TLS_CERT", "KVMESH_TLS_KEY", "KVMESH_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    for argv, flag in [(["--tls-cert", str(tmp_path / "c.pem"), "--tls-key", str(tmp_path / "k.pem")], "--tls-ca"),
                       (["--tls-ca", str(tmp_path / "missing-ca.pem")], "--tls-ca")]:
        res = kvmesh("generate", "--target", "127.0.0.1:5", "--prompt", "hi", "--json", *argv)
        assert res.returncode == 2 and res.stderr.startswith("error: --"), res.stderr
        assert flag in res.stderr and "INVALID_ARGUMENT" not in res.stderr and res.stdout == "", res.stderr


def test_a_missing_file_is_one_line_naming_its_flag():
    res = kvmesh("sim", "--trace", "missing.jsonl", "--num-blocks", "100")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip() == "error: --trace missing.jsonl: No such file or directory"


def test_port_zero_registers_the_port_actually_bound(cluster):
    import redis

    from kvmesh.workers.kv_publisher import lease_key

    lease = json.loads(redis.Redis.from_url(cluster["redis"].url).get(lease_key("w0", "t")))
    assert lease["address"] == cluster["worker"] and not lease["address"].endswith(":0")
    from kvmesh.services.ops_cli import router_status

    deadline = time.monotonic() + 30
    while not router_status(cluster["router"])["workers"]:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert router_status(cluster["router"])["workers"][0]["address"] == cluster["worker"]


def _byte_fallback_checkpoint(directory) -> str:
    """A real HF-layout checkpoint whose config has Llama's BOS/EOS ids (1, 2) and no tokenizer.json."""
    import dataclasses

    from kvmesh.workers.config import ModelConfig
    from kvmesh.workers.loader import save_tiny_checkpoint

    cfg = dataclasses.replace(ModelConfig.tiny(), bos_token_id=1, eos_token_id=2)
    return save_tiny_checkpoint(str(directory), cfg)


def test_max_model_len_above_the_models_context_is_a_usage_error(tmp_path):
    """``--max-model-len`` past the model's max_position_embeddings was capped silently; the
    worker and ``up`` now refuse it before anything starts, naming the flag and the limit."""
    import dataclasses

    from kvmesh.workers.config import ModelConfig
    from kvmesh.workers.loader import save_tiny_checkpoint

    model = save_tiny_checkpoint(str(tmp_path / "m"), dataclasses.replace(ModelConfig.tiny(),
                                                                          max_position_embeddings=512))
    builtin = ModelConfig.tiny().max_position_embeddings
    for argv, limit in ((["worker", "--port", "0", "--threads", "1", "--model", model, "--max-model-len", "513"], 512),
                        (["up", "--model", model, "--max-model-len", "600"], 512),
                        (["worker", "--port", "0", "--threads", "1", "--max-model-len", str(builtin + 1)], builtin)):
        res = kvmesh(*argv, env={"TMPDIR": str(tmp_path)}, timeout=120)
        assert res.returncode == 2, (argv, res.stderr)
        assert "--max-model-len" in res.stderr and f"context of {limit} tokens" in res.stderr, res.stderr
        assert "Traceback" not in res.stderr and os.listdir(tmp_path) == ["m"]  # nothing started


def test_max_model_len_the_pool_cannot_hold_is_a_usage_error(tmp_path):
    """One request of --max-model-len tokens must fit the pool alone: a 4-block pool of
    16-token blocks holds 64 tokens, so 65 is refused before anything starts."""
    for cmd in (["worker", "--port", "0", "--threads", "1"], ["up"]):
        res = kvmesh(*cmd, "--num-blocks", "4", "--block-size", "16", "--max-model-len", "65",
                     env={"TMPDIR": str(tmp_path)}, timeout=120)
        assert res.returncode == 2, (cmd, res.stderr)
        assert "--num-blocks is 4" in res.stderr and "at least 5" in res.stderr, res.stderr
        assert "Traceback" not in res.stderr and os.listdir(tmp_path) == []


def test_model_without_tokenizer_json_says_what_is_missing(tmp_path, capsys):
    from kvmesh.services.cli import main

    model = _byte_fallback_checkpoint(tmp_path / "m")
    res = kvmesh("up", "--model", model, env={"TMPDIR": str(tmp_path)})
    assert res.returncode == 2, res.stderr
    assert "tokenizer.json" in res.stderr and "byte" in res.stderr and "[256," in res.stderr
    assert "Traceback" not in res.stderr and os.listdir(tmp_path) == ["m"]  # nothing started
    assert main(["worker", "--port", "0", "--threads", "1", "--model", model]) == 2  # the worker says the same
    err = capsys.readouterr().err
    assert "tokenizer.json" in err and "[256," in err


@pytest.mark.slow
def test_up_prints_a_failing_childs_last_error_line(tmp_path):
    """Weights that do not match config.json are only found when the worker loads them: the
    worker fails after start, and up shows its reason, not only a path. (A remote tier too
    small for one block record, the earlier example, is now refused before anything starts.)"""
    import glob

    import torch
    from safetensors.torch import save_file

    from kvmesh.workers.config import ModelConfig
    from kvmesh.workers.loader import save_tiny_checkpoint

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    res = kvmesh("up", "--workers", "1", "--threads", "1", "--host-bytes", "8M", "--remote-bytes", "32K",
                 env={"TMPDIR": str(tmp)}, timeout=180)
    assert res.returncode == 2 and res.stderr.startswith("error: --remote-bytes 32768 "), res.stderr
    assert "cannot hold one block record" in res.stderr and os.listdir(tmp) == []
    model = save_tiny_checkpoint(str(tmp_path / "m"), ModelConfig.tiny())
    for f in glob.glob(os.path.join(model, "*.safetensors")):
        os.remove(f)
    save_file({"unrelated": torch.zeros(2)}, os.path.join(model, "model.safetensors"))
    res = kvmesh("up", "--workers", "1", "--threads", "1", "--model", model, env={"TMPDIR": str(tmp)}, timeout=180)
    assert res.returncode == 1, res.stderr
    assert "does not match config.json" in res.stderr and "worker-0" in res.stderr
    assert "cluster up" not in res.stdout


# ---------------------------------------------------------------------------- flags reach the processes


_UP_WORKER_FLAG_VALUES = {  # a value other than the default for every worker flag `up --help` lists
    "--model": "MODEL", "--block-size": "32", "--num-blocks": "100", "--device": "cuda:1",
    "--max-batched-tokens": "512", "--max-seqs": "5", "--max-model-len": "40", "--max-waiting": "7",
    "--threads": "3", "--compute-dtype": "float32", "--long-prefill-token-threshold": "0",
    "--max-num-partial-prefills": "3", "--deadline-shed-factor": "1.5", "--host-bytes": "8M", "--host-codec": "fp8", "--disk-dir": "DISK",
    "--disk-bytes": "1G", "--disk-codec": "int4", "--disk-write-mode": "back", "--tier-load-policy": "cost", "--remote-bytes": "2M",
    "--remote-codec": "fp8", "--peer-bytes": "1M", "--peer-fetch": "always", "--peer-fetch-max-s": "0.5",
    "--remote-record-key-file": "KEYFILE",
}


def test_up_passes_every_worker_flag_it_accepts_to_its_workers(tmp_path):
    """Each worker flag `up` accepts reaches every worker's command line with its value
    (--compute-dtype, --max-waiting and the partial-prefill flags were parsed, then dropped)."""
    import argparse

    from kvmesh.services.cli import _add_engine_args, build_parser
    from kvmesh.services.cluster_cli import _spec_from_args
    from kvmesh.services.launcher import LocalCluster

    probe = argparse.ArgumentParser(add_help=False)
    _add_engine_args(probe)
    engine = probe._actions
    assert sorted(a.option_strings[0] for a in engine) == sorted(_UP_WORKER_FLAG_VALUES)  # a new flag needs a value
    paths = {"MODEL": str(tmp_path / "m"), "DISK": str(tmp_path / "d"), "KEYFILE": str(tmp_path / "record.key")}
    argv = [paths.get(v, v) for item in _UP_WORKER_FLAG_VALUES.items() for v in item]
    parser = build_parser()
    up = parser.parse_args(["up", *argv])
    spec = _spec_from_args(up)
    spec.log_dir = str(tmp_path / "logs")
    cluster = LocalCluster(spec)
    cluster.redis_url = "redis://127.0.0.1:1/0"
    cmd = cluster.worker_cmd("worker-0", 1234)
    worker = parser.parse_args(cmd[cmd.index("worker"):])
    for a in engine:
        expected = getattr(up, a.dest)
        assert expected != a.default, a.option_strings[0]
        if a.dest == "disk_dir":
            expected = os.path.join(expected, "worker-0")  # one folder per worker
        assert getattr(worker, a.dest) == expected, (a.option_strings[0], cmd)


@pytest.mark.slow
def test_up_workers_compute_in_the_dtype_up_was_given(tmp_path):
    """A real `up --compute-dtype`: the worker's start line names that dtype, not the checkpoint's."""
    up = subprocess.Popen([KVMESH, "up", "--insecure", "--workers", "1", "--threads", "1", "--num-blocks", "64",
                           "--http-port", "-1", "--compute-dtype", "bfloat16"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        while "cluster up" not in (line := up.stdout.readline()):
            assert line, up.stderr.read() if up.poll() is not None else line
        log_dir = re.search(r"logs in (\S+)", line).group(1)
        with open(os.path.join(log_dir, "worker-0.log"), encoding="utf-8") as fh:
            start = next(ln for ln in fh if ln.startswith("kvmesh worker worker-0:"))
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait()
    assert "float32 checkpoint computed in bfloat16" in start, start


# ---------------------------------------------------------------------------- success means success


def _children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as fh:
                out += [int(c) for c in fh.read().split()]
        except FileNotFoundError:  # a thread that ended meanwhile
            pass
    return out


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as fh:
        return fh.read().replace(b"\0", b" ").decode()


def _worker_pid(up_pid: int) -> int:
    return next(c for c in _children(up_pid) if " worker " in _cmdline(c))


def _read_until(stream, text: str, proc) -> str:
    """Lines of ``stream`` up to the first that holds ``text`` (fails if the stream ends)."""
    seen = []
    while text not in (line := stream.readline()):
        assert line, f"{text!r} never came; so far: {''.join(seen)}{proc.stderr.read() if proc.poll() else ''}"
        seen.append(line)
    return line


@pytest.mark.slow
def test_up_restarts_a_worker_that_dies_then_gives_up_on_a_crash_loop(tmp_path):
    """`kvmesh up --max-restarts 1`: a killed worker is started again on its port under its id,
    registers with the router and serves; killed a second time within the window it is not
    restarted, and up exits 1 saying why."""
    from kvmesh.services.client import KvmeshClient

    up = subprocess.Popen([KVMESH, "up", "--insecure", "--workers", "1", "--threads", "1", "--num-blocks", "64",
                           "--http-port", "-1", "--max-restarts", "1"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        _read_until(up.stdout, "cluster up", up)
        router = up.stdout.readline().strip()
        first = _worker_pid(up.pid)
        os.kill(first, signal.SIGKILL)
        warning = _read_until(up.stderr, "worker-0 was killed", up)
        assert "worker-0 was killed by SIGKILL" in warning and "restarting it in 1 s (restart 1 of 1)" in warning
        restarted = _read_until(up.stdout, "worker-0 restarted", up)
        second = int(re.search(r"pid (\d+)", restarted).group(1))
        assert second != first
        with KvmeshClient(router, timeout=120) as client:  # the router routes to it again
            deadline = time.monotonic() + 120
            while True:
                try:
                    out = client.generate(token_ids=list(range(1, 40)), max_tokens=2, ignore_eos=True)
                    break
                except Exception:  # noqa: BLE001 - UNAVAILABLE until the new worker registers
                    assert time.monotonic() < deadline, "the restarted worker never served"
                    time.sleep(0.5)
        assert out.usage.completion_tokens == 2 and out.worker_id == "worker-0"
        os.kill(_worker_pid(up.pid), signal.SIGKILL)
        _, err = up.communicate(timeout=60)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    assert up.returncode == 1
    assert "worker-0 was killed by SIGKILL" in err and "not restarted: 1 restarts within 600 s" in err, err


@pytest.mark.slow
def test_up_exits_non_zero_when_a_process_it_started_dies(tmp_path):
    """`--max-restarts 0`: up does not restart anything; a dead worker ends it with exit 1."""
    up = subprocess.Popen([KVMESH, "up", "--workers", "1", "--threads", "1", "--num-blocks", "64",
                           "--max-restarts", "0"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        line = up.stdout.readline()
        assert "cluster up" in line, up.stderr.read() if up.poll() is not None else line
        os.kill(_worker_pid(up.pid), signal.SIGKILL)
        _, err = up.communicate(timeout=60)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    assert up.returncode == 1
    assert "worker-0 was killed by SIGKILL" in err and "restarting" not in err


def _bench_multi_turn(target: str, out, *extra: str) -> subprocess.CompletedProcess:
    # 4 conversations x 3 turns; each third turn (72+ tokens) exceeds the worker's 60-token context
    return kvmesh("bench", "--target", target, "--workload", "multi-turn", "--mt-conversations", "4", "--mt-turns", "3",
                  "--mt-system-len", "16", "--mt-user-len", "16", "--mt-output-len", "4", "--no-progress",
                  "--out", str(out), *extra, timeout=300)


def test_bench_fails_when_requests_fail_unless_allowed(cluster, tmp_path):
    res = _bench_multi_turn(cluster["worker"], tmp_path / "strict", "--no-plots")
    result = json.loads((tmp_path / "strict" / "result.json").read_text())
    assert result["num_errors"] == 4 and result["num_ok"] == 8, result["errors"]
    assert res.returncode == 1
    assert "4 of 12 requests failed" in res.stderr and "INVALID_ARGUMENT" in res.stderr
    assert "errors by code" in res.stdout and "INVALID_ARGUMENT 4" in res.stdout  # the summary table
    assert "first error" in res.stdout and "prompt has" in res.stdout.split("first error", 1)[1][:200]  # the reason
    res = _bench_multi_turn(cluster["worker"], tmp_path / "lenient", "--no-plots", "--max-error-rate", "0.5")
    assert res.returncode == 0, res.stderr
    res = _bench_multi_turn(cluster["worker"], tmp_path / "bad", "--max-error-rate", "2")
    assert res.returncode == 2 and "--max-error-rate" in res.stderr


def test_bench_says_the_target_refused_the_connection(tmp_path, capsys):
    """Nothing on the port: bench keeps waiting (a cluster may still be starting), says so on
    stderr after a few seconds, and its error says the connection was refused, not only that
    the target could not be reached in time."""
    import asyncio

    from kvmesh.bench.harness import TargetUnreachable, run_bench
    from kvmesh.services.procs import free_port

    target = f"127.0.0.1:{free_port()}"
    with pytest.raises(TargetUnreachable) as err:
        asyncio.run(run_bench(target, None, tmp_path / "o", max_requests=1, progress=True, connect_timeout_s=4))
    assert str(err.value) == (f"cannot reach {target} within 4 s: connection refused: nothing listens on that port")
    assert f"bench: {target} not reachable yet: connection refused" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_bench_connects_to_a_server_that_starts_while_it_waits(tmp_path):
    """Refused connections are retried until the timeout: a worker that binds its port only
    after its model loads is still reached (bench started next to a starting cluster)."""
    import asyncio

    from kvmesh.services.client import AsyncKvmeshClient
    from kvmesh.services.procs import free_port, python_cmd, spawn, stop_process

    port = free_port()
    reasons: list[str] = []

    async def wait() -> None:
        async with AsyncKvmeshClient(f"127.0.0.1:{port}") as client:
            await client.wait_ready(120, on_wait=reasons.append, notice_after_s=0)

    worker = spawn(python_cmd("worker", "--port", str(port), "--threads", "1", "--num-blocks", "16"),
                   str(tmp_path / "w.log"))
    try:
        asyncio.run(wait())
    finally:
        stop_process(worker)
    assert reasons == ["connection refused: nothing listens on that port"]  # refused first, then reached


def test_ttft_plot_counts_failed_requests(tmp_path, monkeypatch):
    from kvmesh.bench import plots

    figs = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figs.append(fig) or path)
    ok = [{"ok": True, "ttft_ms": 10.0 + i} for i in range(3)]
    bad = [{"ok": False, "code": "UNAVAILABLE"}] * 2
    plots.ttft_cdf({"kv_aware": ok + bad, "round_robin": bad}, tmp_path / "t.png")
    texts = [t.get_text() for t in figs[0].axes[0].texts]
    assert any("kv_aware: 2 of 5 requests failed" in t and "round_robin: 2 of 2 requests failed" in t for t in texts)
    assert "2 failed" in figs[0].axes[0].get_legend().get_texts()[0].get_text()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_bench_writes_what_finished(cluster, tmp_path, sig):
    out = tmp_path / "run"
    bench = subprocess.Popen([KVMESH, "bench", "--target", cluster["worker"], "--workload", "shared-prefix",
                              "--gsp-num-groups", "2", "--gsp-prompts-per-group", "20", "--gsp-system-prompt-len", "16",
                              "--gsp-question-len", "8", "--gsp-output-len", "2", "--rate", "2", "--no-plots",
                              "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while "sending 40 requests" not in (line := bench.stderr.readline()):
            assert line, "bench ended before sending"
        time.sleep(2.0)  # ~4 requests released at 2/s; 40 take ~20 s
        bench.send_signal(sig)
        _, err = bench.communicate(timeout=60)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
    assert bench.returncode == 130, err
    result = json.loads((out / "result.json").read_text())
    assert result["partial"] is True and result["interrupted_by"] == sig.name
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert len(rows) == result["num_requests"] < 40
    assert result["num_requests"] + result["num_not_sent"] == 40
    assert all(r["ok"] or r.get("cancelled") for r in rows)  # nothing counted as failed
    assert "Partial run" in (out / "result.md").read_text()


def test_bench_started_with_sigint_ignored_still_stops_on_sigint(tmp_path):
    """A shell starts a background job (`kvmesh bench ... &`) with SIGINT ignored; `kill -INT`
    during the local cluster's start must still stop the run (exit 130) and its cluster."""
    out = tmp_path / "run"
    bench = subprocess.Popen([KVMESH, "bench", "--policies", "kv_aware", "--workers", "1", "--workload", "shared-prefix",
                              "--gsp-num-groups", "1", "--gsp-prompts-per-group", "2", "--gsp-system-prompt-len", "16",
                              "--gsp-question-len", "8", "--gsp-output-len", "2", "--no-plots", "--out", str(out)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        while "starting a cold cluster" not in (line := bench.stderr.readline()):
            assert line, "bench ended before starting its cluster"
        bench.send_signal(signal.SIGINT)
        _, err = bench.communicate(timeout=120)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
    assert bench.returncode == 130, err
    assert "interrupted" in err


# ---------------------------------------------------------------------------- say what it does


def test_every_flag_has_help_with_its_default():
    import argparse

    from kvmesh.services.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing = []
    for name, p in sub.choices.items():
        if name == "sim":  # its flags are documented with the simulator itself
            continue
        for a in p._actions:
            if isinstance(a, argparse._HelpAction):
                continue
            flag = f"{name} {a.option_strings[0] if a.option_strings else a.dest}"
            if not a.help:
                missing.append(f"{flag}: no help")
            elif (not a.required and a.default is not None and a.default is not False
                  and a.default != argparse.SUPPRESS and "default" not in a.help.lower()):
                missing.append(f"{flag}: default {a.default!r} not stated")
    assert not missing, "\n".join(missing)


def test_version():
    from importlib.metadata import version

    res = kvmesh("--version")
    assert res.returncode == 0 and res.stdout.strip() == f"kvmesh {version('kvmesh')}"


def test_kv_size_codec_counts_the_scales(capsys):
    from kvmesh.workers.config import resolve_model_shape

    cfg = resolve_model_shape("Llama-3-8B")
    numel = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * 16 * cfg.head_dim  # one 16-token block
    # docs/TIERS.md formats: int4 = 4-bit values + one fp32 scale per 32 values along head_dim;
    # fp8 = 1-byte values + one fp32 scale per (layer, K/V, KV head)
    expected = {"int4": numel // 2 + 4 * (numel // 32), "fp8": numel + 4 * cfg.num_hidden_layers * 2 *
                cfg.num_key_value_heads, "none": 2 * numel}
    from kvmesh.services.cli import main

    res = kvmesh("kv-size", "--model", "Llama-3-8B", "--tokens", "8192", "--codec", "int4", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["bytes_per_block"] == expected["int4"] and out["blocks"] == 512
    assert out["bytes"] == 512 * expected["int4"] and out["blocks_per_gib"] == (1 << 30) // expected["int4"]
    for codec, per_block in expected.items():  # the other codecs through the same code, in this process
        assert main(["kv-size", "--model", "Llama-3-8B", "--tokens", "8200", "--codec", codec, "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["bytes_per_block"] == per_block and out["blocks"] == 513  # a partial block is a whole one
    assert main(["kv-size", "--model", "Llama-3-8B", "--tokens", "8192", "--dtype", "int4", "--json"]) == 0
    raw = json.loads(capsys.readouterr().out)
    assert raw["bytes"] * 1.25 == 512 * expected["int4"]  # what the raw count left out
    assert main(["kv-size", "--model", "Llama-3-8B", "--tokens", "16", "--codec", "int4", "--dtype", "fp8"]) == 2
    assert "--dtype" in capsys.readouterr().err
    # --block-size only sizes a tier's blocks: without --codec it was ignored
    assert main(["kv-size", "--model", "Llama-3-8B", "--tokens", "16", "--block-size", "32"]) == 2
    assert "it needs --codec" in capsys.readouterr().err


def _kv_size(capsys, *argv: str) -> tuple[dict, str]:
    """kv-size in this process: (its --json object, its text output)."""
    from kvmesh.services.cli import main

    assert main(["kv-size", *argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert main(["kv-size", *argv]) == 0
    return out, capsys.readouterr().out


def _worker_pool_block_bytes(cfg, block_size: int = 16) -> int:
    """Bytes of one block of the KV pool a worker allocates for ``cfg`` (its own code)."""
    from kvmesh.workers.model import allocate_kv_cache

    pool = allocate_kv_cache(cfg, 1, block_size)
    return pool.numel() * pool.element_size()


@pytest.mark.parametrize("torch_dtype, expected", [("float32", "fp32"), ("bfloat16", "bf16"), ("float16", "fp16"),
                                                   (None, "fp32")])
def test_kv_size_counts_in_the_dtype_the_worker_pool_takes(tmp_path, monkeypatch, capsys, torch_dtype, expected):
    """Without --dtype, kv-size sizes a checkpoint in its config.json's torch_dtype (float32
    when it names none), the dtype of the pool the worker allocates, and says so."""
    import dataclasses

    from kvmesh.workers.config import ModelConfig
    from kvmesh.workers.loader import read_config

    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path / "cache"))
    model = tmp_path / "ckpt"
    model.mkdir()
    hf = dataclasses.replace(ModelConfig.tiny(), dtype=torch_dtype or "float32").to_hf_dict()
    if torch_dtype is None:
        del hf["torch_dtype"]
    (model / "config.json").write_text(json.dumps(hf))
    pool_block = _worker_pool_block_bytes(read_config(str(model)))  # what the worker would allocate

    out, text = _kv_size(capsys, "--model", str(model), "--tokens", "16")
    assert out["dtype"] == expected and out["dtype_source"] == "config.json"
    assert out["bytes"] == pool_block  # 16 tokens: one block of the worker's pool
    assert f" in {expected} = " in text and f"dtype {expected}: " in text
    assert ("names no torch_dtype" if torch_dtype is None else f"torch_dtype '{torch_dtype}'") in text

    out, text = _kv_size(capsys, "--model", str(model), "--tokens", "100", "--codec", "none")
    assert out["pool_bytes_per_block"] == out["bytes_per_block"] == pool_block and out["blocks"] == 7
    assert f"(pool {expected}: {pool_block:,})" in text


def test_kv_size_of_the_builtin_model_is_in_its_float32_pool(capsys):
    from kvmesh.workers.config import ModelConfig

    pool_block = _worker_pool_block_bytes(ModelConfig.tiny())
    out, text = _kv_size(capsys, "--model", "tiny", "--tokens", "100", "--codec", "fp8")
    assert out["dtype"] == "fp32" and out["dtype_source"] == "built-in model"
    assert out["pool_bytes_per_block"] == pool_block == 4 * 2 * 2 * 16 * 64 * 4
    assert f"(pool fp32: {pool_block:,})" in text and "dtype fp32: the built-in model's dtype" in text
    out, _ = _kv_size(capsys, "--model", "tiny", "--tokens", "16")
    assert out["dtype"] == "fp32" and out["bytes"] == pool_block


def test_kv_size_presets_and_an_explicit_dtype(capsys):
    """The named public models keep their published bf16; --dtype still overrides, and an
    explicit one prints as before (no dtype note)."""
    out, text = _kv_size(capsys, "--model", "Llama-3-8B", "--tokens", "16")
    assert out["dtype"] == "bf16" and out["dtype_source"] == "preset" and out["bytes"] == 2 * 32 * 8 * 128 * 2 * 16
    assert "dtype bf16: the dtype of meta-llama/Meta-Llama-3-8B's published weights" in text
    out, text = _kv_size(capsys, "--model", "Llama-3-8B", "--tokens", "16", "--dtype", "fp32")
    assert out["dtype"] == "fp32" and out["dtype_source"] == "--dtype" and out["bytes"] == 2 * 32 * 8 * 128 * 4 * 16
    assert " in fp32 = " in text and "dtype fp32:" not in text and len(text.splitlines()) == 1
    out, text = _kv_size(capsys, "--model", "tiny", "--tokens", "16", "--dtype", "bf16", "--codec", "none")
    assert out["dtype"] == "bf16" and out["pool_bytes_per_block"] == 4 * 2 * 2 * 16 * 64 * 2


def test_generate_streams_text_as_it_arrives(cluster):
    from kvmesh.services.cli import generate

    pieces: list[str] = []
    prompt = "stream these tokens"
    out = generate(cluster["worker"], prompt=prompt, max_tokens=8, ignore_eos=True, on_text=pieces.append)
    assert len(pieces) > 1 and "".join(pieces) == out["text"]  # one piece per step, not one at the end
    res = kvmesh("generate", "--target", cluster["worker"], "--prompt", prompt, "--max-tokens", "8", "--ignore-eos",
                 "--stream")
    assert res.returncode == 0, res.stderr
    assert res.stdout == out["text"] + "\n"
    both = kvmesh("generate", "--target", cluster["worker"], "--prompt", prompt, "--stream", "--json")
    assert both.returncode == 2


def test_status_prints_the_routers_view(cluster):
    from kvmesh.services.cli import generate

    prompt = list(range(1, 41))  # 40 tokens: two full 16-token blocks
    generate(cluster["router"], token_ids=prompt, max_tokens=1)
    deadline = time.monotonic() + 30
    while True:
        res = kvmesh("status", "--target", cluster["router"], "--json")
        assert res.returncode == 0, res.stderr
        status = json.loads(res.stdout)
        if status["indexed_blocks"] >= 2:
            break
        assert time.monotonic() < deadline, status
        time.sleep(0.3)
    (w,) = status["workers"]
    assert w["worker_id"] == "w0" and w["address"] == cluster["worker"] and w["total_blocks"] == 64
    assert w["cached_blocks"] >= 2
    text = kvmesh("status", "--target", cluster["router"])
    assert text.returncode == 0 and "w0" in text.stdout and "kv_aware" in text.stdout
    not_router = kvmesh("status", "--target", cluster["worker"])
    assert not_router.returncode == 1 and "not a kvmesh router" in not_router.stderr


def test_plots_keep_runs_that_share_a_label(tmp_path, monkeypatch):
    from kvmesh.bench import plots

    runs = []
    for name in ("a", "b"):
        d = tmp_path / name
        d.mkdir()
        (d / "result.json").write_text(json.dumps({"policy": "kv_aware"}))
        (d / "requests.jsonl").write_text(json.dumps({"ok": True, "ttft_ms": 1.0}) + "\n")
        runs.append(str(d))
    seen = {}
    monkeypatch.setattr(plots, "write_plots", lambda r, out: seen.update(r) or [])
    assert plots.main([str(tmp_path / "out"), *runs]) == 0
    assert len(seen) == 2 and all(k.startswith("kv_aware (") for k in seen)


def test_readme_first_generate_example_shows_reuse():
    """The first generate example's prompt spans more than one 16-token block (bytes + BOS),
    and the README runs it twice, so the second run reports cached tokens."""
    readme = open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "README.md"), encoding="utf-8").read()
    m = re.search(r'^P="([^"]+)"', readme, re.M)
    assert m and len(m.group(1).encode()) + 1 > 2 * 16
    assert len(re.findall(r'kvmesh generate --target \S+ --prompt "\$P"', readme)) >= 2


def test_readme_bf16_checkpoint_command_runs_and_makes_a_bf16_model(tmp_path):
    """The README's command that writes a bf16 checkpoint (save_tiny_checkpoint) runs as shown,
    the folder passes `kvmesh worker`'s --model check, loads as bfloat16, and the README's
    --model lines point at the folder it writes."""
    readme = open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "README.md"), encoding="utf-8").read()
    section = readme.split("#### A bf16 checkpoint", 1)
    assert len(section) == 2, "README lost its bf16 checkpoint section"
    block = section[1].split("```", 2)[1]
    m = re.search(r'^\.venv/bin/python -c "(.*?)"$', block, re.M | re.S)
    assert m and "save_tiny_checkpoint" in m.group(1), block
    res = subprocess.run(["bash", "-c", f'"$PY" -c "{m.group(1)}"'], cwd=tmp_path, capture_output=True, text=True,
                         env={**os.environ, "PY": sys.executable}, timeout=300)
    assert res.returncode == 0, res.stderr
    folder = re.search(r"save_tiny_checkpoint\('([^']+)'", m.group(1)).group(1)
    assert all(f"--model {folder}" in line for line in block.splitlines() if "--model" in line)
    model = str(tmp_path / folder)
    import torch

    from kvmesh.services.cli_checks import model_problem
    from kvmesh.workers.engine import Engine

    assert model_problem(model) is None
    engine = Engine(model_dir=model, num_blocks=8, compute_dtype="model")
    assert engine.config.dtype == "bfloat16" and next(engine.model.parameters()).dtype == torch.bfloat16
    assert engine.kv_model_id.startswith(f"{os.path.basename(folder)}@")


def test_readme_shows_how_to_call_the_https_front_of_a_secure_cluster():
    """`kvmesh up` is secure by default: its HTTP front is HTTPS under the cluster CA and needs
    the API key, so the README must show a newcomer both, not only the plain-HTTP snippet."""
    readme = open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "README.md"), encoding="utf-8").read()
    curls = [line for line in readme.splitlines() if line.startswith("curl ") and "https://" in line]
    assert any('--cacert "$KVMESH_TLS_CA"' in c and "Bearer $KVMESH_API_KEY" in c for c in curls), curls
    assert 'SSL_CERT_FILE="$KVMESH_TLS_CA"' in readme


def test_offline_benchmarks_show_progress_on_stderr():
    res = subprocess.run([sys.executable, "-m", "kvmesh.bench.codec_error", "--lengths", "20", "--seeds", "1",
                          "--json"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    json.loads(res.stdout)  # stdout keeps only the result
    assert "bench.codec_error" in res.stderr and "100%" in res.stderr


def test_generate_refuses_a_prompt_that_is_not_utf8():
    """Bytes that are not UTF-8 on the command line (PEP 383 surrogates) gave a bare codec error."""
    res = subprocess.run([KVMESH, "generate", "--target", "127.0.0.1:1", "--prompt", b"ab\xff\xfe"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "--prompt is not UTF-8 text (byte 0xff at character 2)" in res.stderr, res.stderr


def test_generate_refuses_an_empty_prompt_as_a_usage_error(capsys):
    """An empty --prompt reached the server and exited 1 with its INVALID_ARGUMENT; like every
    other bad flag it is now exit 2 before dialing (port 1: nothing listens)."""
    from kvmesh.services.cli import main

    assert main(["generate", "--target", "127.0.0.1:1", "--prompt", ""]) == 2
    assert "--prompt is empty" in capsys.readouterr().err


@pytest.mark.parametrize("argv,needle", [
    (["worker", "--port", "0", "--peer-fetch", "always", "--peer-bytes", "0"], "--peer-bytes > 0"),
    # over the model's context: that is the fix to name, not a bigger pool
    (["up", "--max-model-len", "100000"], "model's context"),
    (["worker", "--port", "0", "--max-model-len", "100000"], "model's context"),
])
def test_contradictory_or_impossible_worker_flags_say_what_to_fix(capsys, argv, needle):
    from kvmesh.services.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "--num-blocks" not in err, err


def test_up_against_a_redis_that_needs_a_password_says_so(capsys, redis_server):
    from kvmesh.services.cli import main

    no_password = f"redis://127.0.0.1:{redis_server.port}/0"
    assert main(["up", "--redis-url", no_password]) == 2
    err = capsys.readouterr().err
    assert "needs a password" in err and "redis://:PASSWORD@" in err and redis_server.password not in err, err


def test_up_refuses_a_cluster_name_whose_workers_are_live_in_that_redis(capsys, redis_server):
    """Two `up`s on one Redis with one --cluster would mix their workers (the second's
    registered into the first's namespace and were routed to): the second is refused
    before it starts anything. A worker whose lease expired does not count."""
    import redis

    from kvmesh.services.cli import main
    from kvmesh.services.cli_checks import live_workers_in
    from kvmesh.workers.kv_publisher import lease_key, workers_key

    r = redis.Redis.from_url(redis_server.url)
    try:
        r.sadd(workers_key("taken"), "worker-0", "worker-1")
        r.set(lease_key("worker-1", "taken"), "{}", ex=60)  # worker-0's lease expired
        assert live_workers_in(r, "taken") == ["worker-1"]
        assert live_workers_in(r, "free") == []
        assert main(["up", "--redis-url", redis_server.url, "--cluster", "taken"]) == 2
        err = capsys.readouterr().err
        assert "--cluster taken" in err and "worker-1" in err and "worker-0" not in err, err
        assert "another --cluster" in err and redis_server.password not in err, err
    finally:
        r.delete(workers_key("taken"), lease_key("worker-1", "taken"))


@pytest.mark.slow
def test_up_keeps_its_address_lines_on_stdout_and_warnings_on_stderr(tmp_path):
    """Scripts read `up`'s stdout lines after the summary (router address, HTTP base URL,
    metrics URLs); a worker's start-up warning (here: a context capped by a small
    --num-blocks) goes to stderr, not between them."""
    up = subprocess.Popen([KVMESH, "up", "--insecure", "--workers", "1", "--threads", "1", "--num-blocks", "4"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        _read_until(up.stdout, "cluster up", up)
        lines = [up.stdout.readline().strip() for _ in range(4)]  # address, HTTP URL, 2 metrics URLs
    finally:
        up.send_signal(signal.SIGINT)
        try:
            out, err = up.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait()
            raise
    assert re.fullmatch(r"127\.0\.0\.1:\d+", lines[0]), lines
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/v1", lines[1]), lines
    assert all(re.fullmatch(r"http://127\.0\.0\.1:\d+/metrics", ln) for ln in lines[2:]), lines
    assert "warning: worker-0: " in err and "context limited" in err, err
    assert "warning: worker-0" not in out, out
    assert up.returncode == 0, err


@pytest.mark.slow
def test_up_interrupted_while_starting_stops_at_once(tmp_path):
    """SIGINT while `up` waits for its workers: it stops what it started, prints no summary
    and exits 130 (as `kvmesh bench` interrupted), instead of finishing the start first."""
    up = subprocess.Popen([KVMESH, "up", "--insecure", "--workers", "2", "--threads", "1", "--num-blocks", "64"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, "TMPDIR": str(tmp_path)})
    children: set[int] = set()
    try:
        deadline = time.monotonic() + 120
        while not any(" worker " in _cmdline_or_empty(c) for c in children):  # the workers were spawned
            assert up.poll() is None, up.stderr.read()
            assert time.monotonic() < deadline, "up started no worker"
            children |= set(_children(up.pid))
            time.sleep(0.05)
        up.send_signal(signal.SIGINT)
        out, err = up.communicate(timeout=120)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    assert up.returncode == 130, (up.returncode, out, err)
    assert "cluster up" not in out and "127.0.0.1:" not in out, out
    assert "interrupted by SIGINT while starting" in err and "Traceback" not in err, err
    assert "kvmesh cluster stopped" in out
    left = [c for c in children if _alive(c)]
    assert not left, [_cmdline_or_empty(c) for c in left]


def _cmdline_or_empty(pid: int) -> str:
    try:
        return _cmdline(pid)
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a running (not zombie) process."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_the_stop_flag_is_set_by_a_signal_handler_while_waited_on():
    """`up` and `ray` stop on a flag their SIGINT/SIGTERM handler sets. `SignalEvent.wait`
    returns once a handler set it (a `threading.Event` can deadlock there: its `set` takes
    the lock the interrupted `wait` may be holding), and times out otherwise."""
    from kvmesh.services.procs import SignalEvent

    stop = SignalEvent()
    t0 = time.monotonic()
    assert stop.wait(0.2) is False and time.monotonic() - t0 >= 0.19
    previous = signal.signal(signal.SIGALRM, lambda *_: stop.set())
    try:
        for _ in range(20):  # signals landing at many points of the wait loop
            stop = SignalEvent()
            signal.setitimer(signal.ITIMER_REAL, 0.013)
            t0 = time.monotonic()
            assert stop.wait(10) is True and stop.is_set()
            assert time.monotonic() - t0 < 2.0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("extra,flag", [
    (["--metrics-port", "0"], "--metrics-port"),
    (["--metrics-token-file", "/dev/null"], "--metrics-token-file"),
    (["--max-inflight-per-tenant", "4"], "--max-inflight-per-tenant"),
    (["--max-concurrent-rpcs", "7"], "--max-concurrent-rpcs"),
    (["--reflection"], "--reflection"),
])
def test_the_vllm_router_mode_refuses_flags_it_would_ignore(capsys, extra, flag):
    """kvmesh's own router flags that the vLLM mode has no use for were accepted and
    ignored (a metrics port never opened, a per-tenant cap never applied); each is a usage
    error naming the flag and what to use instead."""
    from kvmesh.services.cli import build_parser

    p = build_parser()
    args = p.parse_args(["router", "--backend", "vllm", "--http-port", "1", "--vllm-server",
                         "http://127.0.0.1:1,tcp://127.0.0.1:2", "--vllm-block-size", "16", *extra])
    with pytest.raises(SystemExit) as exc:
        args.func(args)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"{flag} is not supported with --backend vllm (" in err, err
