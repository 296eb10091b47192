"""Per-tenant request and token budgets (`services.rate_limit`) against a real redis-server:
shared by every router of a cluster, separate per tenant and per cluster, nothing spent by a
refused request, an honest retry-after, and admission when Redis is gone."""
from __future__ import annotations

import asyncio
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.services.rate_limit import TenantRateLimit, parse_limit, retry_after


def run(coro):
    return asyncio.run(coro)


def test_budgets_are_parsed_or_refused_naming_the_flag():
    assert parse_limit("--x", "600/minute").amount == 600
    assert parse_limit("--x", " 5 / second ").get_expiry() == 1
    for bad in ("", "600", "0/minute", "-1/minute", "10/fortnight", "1.5/minute", "ten/minute", "10/minute;x"):
        with pytest.raises(ValueError, match="--x must look like N/second"):
            parse_limit("--x", bad)


def _admits(limit, cost, window, prev, cur, cur_end, t) -> bool:
    """The sliding-window counter's model at ``t`` seconds from now (no new requests): the
    previous window leaves the sliding window as the current one ends (``cur_end``), then
    the current count decays over one window."""
    if t < cur_end:
        count = prev * (cur_end - t) / window + cur
    else:
        count = cur * max(0.0, window - (t - cur_end)) / window
    return count <= limit - cost + 1e-9


@settings(max_examples=300, deadline=None)
@given(limit=st.integers(1, 1000), window=st.sampled_from([1.0, 60.0, 3600.0]), data=st.data())
def test_retry_after_is_the_first_moment_the_request_fits(limit, window, data):
    cost = data.draw(st.integers(1, limit))
    prev = data.draw(st.integers(0, 2 * limit))
    cur = data.draw(st.integers(0, limit))
    cur_end = data.draw(st.floats(0.001, window))
    wait = retry_after(limit, cost, window, prev, cur_end if prev else 0.0, cur, cur_end + window)
    assert 0.0 <= wait <= 2 * window
    assert _admits(limit, cost, window, prev, cur, cur_end, wait + 1e-6)
    if wait > 1e-3:
        assert not _admits(limit, cost, window, prev, cur, cur_end, wait - 1e-3)


def test_request_budget_is_shared_by_routers_and_kept_per_tenant_and_cluster(redis_server):
    async def main():
        a = TenantRateLimit(redis_server.url, "c1", requests="3/minute")
        b = TenantRateLimit(redis_server.url, "c1", requests="3/minute")  # another router replica
        other = TenantRateLimit(redis_server.url, "c2", requests="3/minute")
        try:
            assert [await r.check("t1", 10) for r in (a, b, a)] == [None, None, None]
            refused = await b.check("t1", 10)
            assert refused is not None
            message, wait = refused
            assert "tenant 't1'" in message and "--tenant-request-limit" in message and "3/minute" in message
            assert 1.0 <= wait <= 120.0 and f"retry in {int(-(-wait // 1))} s" in message
            assert await a.check("t2", 10) is None     # another tenant has its own budget
            assert await other.check("t1", 10) is None  # another cluster too
            assert a.refused["requests"] + b.refused["requests"] == 1
        finally:
            for r in (a, b, other):
                await r.close()
    run(main())


def test_token_budget_counts_prompt_tokens_and_a_refusal_spends_nothing(redis_server):
    async def main():
        r = TenantRateLimit(redis_server.url, "c", requests="3/minute", tokens="100/minute")
        try:
            assert await r.check("", 60) is None
            message, wait = await r.check("", 60)  # 120 tokens > 100: refused for tokens
            assert "this caller" in message and "--tenant-token-limit" in message and wait >= 1.0
            # the refused request spent no request: two more fit in the request budget
            assert await r.check("", 20) is None and await r.check("", 20) is None
            message, _ = await r.check("", 1)  # over both budgets now: counted as refused by each
            assert "--tenant-request-limit" in message or "--tenant-token-limit" in message
            message, wait = await r.check("big", 101)  # can never fit
            assert "larger than this tenant's whole token budget" in message and wait is None
            assert r.refused == {"requests": 1, "tokens": 3}
        finally:
            await r.close()
    run(main())


def test_an_unreachable_redis_admits_at_once_and_counts_it():
    from kvmesh.services.procs import free_port

    async def main():
        r = TenantRateLimit(f"redis://127.0.0.1:{free_port()}/0", "c", requests="1/minute")
        try:
            t0 = time.monotonic()
            assert [await r.check("t", 1) for _ in range(3)] == [None, None, None]
            assert time.monotonic() - t0 < 3 * (TenantRateLimit.TIMEOUT_S + 0.5)
            assert r.failed_open == 3
        finally:
            await r.close()
    run(main())


def test_no_budget_no_redis():
    r = TenantRateLimit("redis://127.0.0.1:1/0", "c")
    assert not r.enabled and r.storage is None
    assert run(r.check("t", 10**9)) is None


def test_a_redis_that_never_answers_costs_one_timeout_then_admits():
    import socket

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # accepts connections (the kernel does) and never answers a command

    async def main():
        r = TenantRateLimit(f"redis://127.0.0.1:{silent.getsockname()[1]}/0", "c", tokens="10/minute")
        try:
            t0 = time.monotonic()
            assert await r.check("t", 5) is None
            assert time.monotonic() - t0 < TenantRateLimit.TIMEOUT_S + 2.0
            assert r.failed_open == 1 and r.refused == {"requests": 0, "tokens": 0}
        finally:
            await r.close()
    try:
        run(main())
    finally:
        silent.close()


def test_router_flags_refuse_a_malformed_budget_and_the_vllm_backend(capsys):
    from kvmesh.services.cli import build_parser

    p = build_parser()
    args = p.parse_args(["router", "--port", "1", "--tenant-request-limit", "600/minute",
                         "--tenant-token-limit", "1000000/hour"])
    assert (args.tenant_request_limit, args.tenant_token_limit) == ("600/minute", "1000000/hour")
    with pytest.raises(SystemExit) as exc:
        p.parse_args(["router", "--port", "1", "--tenant-token-limit", "10/fortnight"])
    assert exc.value.code == 2 and "--tenant-token-limit must look like N/second" in capsys.readouterr().err
    args = p.parse_args(["router", "--backend", "vllm", "--http-port", "1", "--vllm-server",
                         "http://127.0.0.1:1,tcp://127.0.0.1:2", "--vllm-block-size", "16",
                         "--tenant-request-limit", "5/second"])
    with pytest.raises(SystemExit) as exc:
        args.func(args)
    assert exc.value.code == 2 and "--tenant-request-limit is not supported with --backend vllm" in \
        capsys.readouterr().err


def test_router_metrics_show_refusals_and_fail_open_admissions(redis_server):
    from tests.test_metrics import samples

    from kvmesh.services.metrics import RouterMetrics
    from kvmesh.services.policies import KVAwarePolicy

    class Sub:
        def live_workers(self):
            return {}

    class Index:
        def num_blocks(self):
            return 0

    class Router:
        policy_name, policy, subscriber, index = "kv_aware", KVAwarePolicy(), Sub(), Index()
        rate_limit = TenantRateLimit(redis_server.url, "m", requests="1/minute")

    async def main():
        for _ in range(3):
            await Router.rate_limit.check("t", 1)
        await Router.rate_limit.close()
    run(main())
    s = samples(RouterMetrics(Router()).registry)
    assert s[("kvmesh:router_rate_limited_total", (("budget", "requests"),))] == 2
    assert s[("kvmesh:router_rate_limited_total", (("budget", "tokens"),))] == 0
    assert s[("kvmesh:router_rate_limit_failed_open_total", ())] == 0


def test_up_passes_the_limits_to_its_router(monkeypatch, tmp_path):
    from kvmesh.services import launcher
    from kvmesh.services.cli import build_parser
    from kvmesh.services.cluster_cli import _spec_from_args

    spec = _spec_from_args(build_parser().parse_args(["up", "--insecure", "--tenant-request-limit", "5/second",
                                                      "--tenant-token-limit", "900/minute"]))
    assert spec.extra_router_args == ["--tenant-request-limit", "5/second", "--tenant-token-limit", "900/minute"]
    assert _spec_from_args(build_parser().parse_args(["up"])).extra_router_args == []
    seen = []
    monkeypatch.setattr(launcher, "spawn", lambda cmd, *a, **k: seen.append(cmd))
    spec.log_dir = str(tmp_path)
    cluster = launcher.LocalCluster(spec)
    cluster.cluster = "c"
    cluster.start_router(port=1, wait=False)
    cmd = seen[0]
    assert cmd[cmd.index("--tenant-request-limit") + 1] == "5/second"
    assert cmd[cmd.index("--tenant-token-limit") + 1] == "900/minute"


def test_requests_racing_each_other_are_admitted_only_while_there_is_room(redis_server):
    """50 checks at once for one tenant under 5/minute, from two router replicas: 5 admitted
    (the look alone would let every one through before any was counted)."""
    async def main():
        a = TenantRateLimit(redis_server.url, "race", requests="5/minute")
        b = TenantRateLimit(redis_server.url, "race", requests="5/minute")
        try:
            got = await asyncio.gather(*(r.check("t", 1) for r in [a, b] * 25))
            assert sum(g is None for g in got) == 5
            assert a.refused["requests"] + b.refused["requests"] == 45
        finally:
            await a.close()
            await b.close()
    run(main())


def test_equal_budgets_keep_their_own_counters_and_the_longest_wait_is_told(redis_server):
    async def main():
        r = TenantRateLimit(redis_server.url, "eq", requests="10/minute", tokens="10/minute")
        try:
            assert [await r.check("t", 1) for _ in range(10)] == [None] * 10  # 10 requests, 10 tokens
            message, _ = await r.check("t", 1)
            assert "--tenant-request-limit" in message or "--tenant-token-limit" in message
        finally:
            await r.close()
        r = TenantRateLimit(redis_server.url, "both", requests="2/second", tokens="30/minute")
        try:
            assert await r.check("t", 15) is None and await r.check("t", 15) is None
            message, wait = await r.check("t", 15)  # over both: told the tokens' wait, not 1-2 s
            assert "--tenant-token-limit" in message and wait > 5
        finally:
            await r.close()
    run(main())


def test_a_unix_socket_redis_url_works(tmp_path):
    import shutil
    import subprocess

    sock = str(tmp_path / "r.sock")
    proc = subprocess.Popen([shutil.which("redis-server"), "--port", "0", "--unixsocket", sock, "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while not (tmp_path / "r.sock").exists():
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)

        async def main():
            r = TenantRateLimit(f"unix://{sock}", "u", requests="1/minute")
            try:
                assert await r.check("t", 1) is None
                assert await r.check("t", 1) is not None and r.failed_open == 0
            finally:
                await r.close()
        run(main())
    finally:
        proc.terminate()
        proc.wait(10)
