"""bench.harness.drive (arrival schedules, turn sequencing, time bound) and run_workload against
in-process fake services that inject faults: a worker that rejects long prompts, one that hangs."""
from __future__ import annotations

import asyncio
import json
import time

import grpc
import pytest

from kvmesh.bench.arrivals import ArrivalSpec
from kvmesh.bench.harness import drive, run_workload
from kvmesh.bench.workloads import WorkItem, Workload, multi_turn_workload
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.proto import kvmesh_pb2_grpc as pb_grpc


def _items(n, parents=None):
    parents = parents or {}
    return [WorkItem(index=i, tokens=[1], max_tokens=1, parent=parents.get(i)) for i in range(n)]


class _Log:
    """A send function that sleeps, records when each item started and ended, and can fail some.

    ``virtual``: times are read from the running loop's clock (for `_run_virtual`, whose
    clock starts at 0), else from ``time.perf_counter`` since the log was made."""

    def __init__(self, duration=0.02, fail=(), virtual=False):
        self.duration, self.fail = duration, set(fail)
        self.start: dict[int, float] = {}
        self.end: dict[int, float] = {}
        self.active = self.max_active = 0
        self.clock = (lambda: asyncio.get_running_loop().time()) if virtual else time.perf_counter
        self.t0 = 0.0 if virtual else time.perf_counter()

    async def __call__(self, item):
        self.start[item.index] = self.clock() - self.t0
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            await asyncio.sleep(self.duration)
        finally:
            self.active -= 1
            self.end[item.index] = self.clock() - self.t0
        ok = item.index not in self.fail
        return {"index": item.index, "ok": ok, "code": "OK" if ok else "INTERNAL"}


class _VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock (from 0) moves only when the loop would otherwise sleep, and
    then straight to its next timer. Timers fire exactly when due and in order, so what
    `drive` does at which moment of its schedule does not depend on how busy the machine is
    (no real I/O: with nothing ready and no timer left, it would wait forever, and fails)."""

    def __init__(self):
        super().__init__()
        self._virtual_now = 0.0
        real_select = self._selector.select

        def select(timeout=None):
            events = real_select(0)
            if not events and timeout is None:
                raise AssertionError("the loop has nothing left to wait for: it would hang")
            if not events and timeout > 0:
                self._virtual_now += timeout
            return events

        self._selector.select = select

    def time(self) -> float:
        return self._virtual_now


def _run_virtual(coro):
    """``coro``'s result on a `_VirtualTimeLoop`."""
    loop = _VirtualTimeLoop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


def test_closed_loop_keeps_the_cap_and_workload_order():
    log = _Log()
    records, not_sent = asyncio.run(drive(_items(10), log, cap=3))
    assert not_sent == 0 and sorted(r["index"] for r in records) == list(range(10))
    assert log.max_active == 3
    assert sorted(log.start, key=log.start.get) == list(range(10))


def test_open_loop_releases_at_the_offsets():
    log = _Log(duration=0.0, virtual=True)
    offsets = [0.0, 0.3, 0.1, 0.5]
    _run_virtual(drive(_items(4), log, offsets=offsets))
    for i, off in enumerate(offsets):
        # Never early, never late: on the loop's own clock, which a busy machine cannot
        # stretch, each item is sent at its offset.
        assert log.start[i] == pytest.approx(off, abs=1e-9), (i, log.start[i])
    # Without a cap everything released goes at once, whatever is in flight.
    slow = _Log(duration=0.2)
    asyncio.run(drive(_items(6), slow, offsets=[0.0] * 6))
    assert slow.max_active == 6
    capped = _Log(duration=0.05)
    asyncio.run(drive(_items(6), capped, offsets=[0.0] * 6, cap=2))
    assert capped.max_active == 2


@pytest.mark.parametrize("open_loop", [False, True])
def test_a_turn_waits_for_the_turn_it_extends(open_loop):
    # 0 -> 2 -> 4 and 1 -> 3: a chain per conversation.
    items = _items(5, parents={2: 0, 3: 1, 4: 2})
    log = _Log(duration=0.03)
    offsets = [0.0] * 5 if open_loop else None
    records, _ = asyncio.run(drive(items, log, offsets=offsets, cap=None if open_loop else 4))
    assert len(records) == 5
    for child, parent in ((2, 0), (3, 1), (4, 2)):
        assert log.start[child] >= log.end[parent]
    assert log.max_active == 2  # at most one turn per conversation in flight


def test_failed_turn_skips_the_rest_of_its_conversation():
    items = _items(6, parents={2: 0, 3: 1, 4: 2})
    seen = []
    log = _Log(duration=0.0, fail={0})
    records, not_sent = asyncio.run(drive(items, log, cap=2, on_record=lambda r, sent: seen.append((r["index"], sent))))
    by_index = {r["index"]: r for r in records}
    assert by_index[0]["code"] == "INTERNAL"
    assert by_index[2]["code"] == "PARENT_FAILED" and by_index[4]["code"] == "PARENT_FAILED"
    assert by_index[3]["ok"] and by_index[5]["ok"]
    assert 2 not in log.start and 4 not in log.start
    assert (2, False) in seen and (3, True) in seen
    assert not_sent == 0


def test_time_bound_stops_sending_and_cancels_at_the_grace_deadline():
    """On the loop's own clock (`_VirtualTimeLoop`: a busy machine cannot stretch it): items
    released before the bound are sent at their offsets, none after it, and what is in
    flight is cancelled at the grace deadline, not when the sends would end (30 s)."""
    log = _Log(duration=30.0, virtual=True)  # never finishes on its own

    async def run():
        out = await drive(_items(40), log, offsets=[0.1 * i for i in range(40)], stop_after_s=0.45, grace_s=0.2)
        return out, asyncio.get_running_loop().time()

    (records, not_sent), returned_at = _run_virtual(run())
    sent = len(log.start)
    assert sent == 5 and not_sent == 35   # released at 0, 0.1, ..., 0.4 s; nothing after 0.45 s
    assert all(log.start[i] == pytest.approx(0.1 * i, abs=1e-9) for i in range(sent)), log.start
    assert len(records) == sent and all(r["cancelled"] and r["code"] == "CANCELLED" for r in records)
    # cancelled at 0.45 + 0.2 s, and drive returned then
    assert all(log.end[i] == pytest.approx(0.65, abs=1e-9) for i in range(sent)), log.end
    assert returned_at == pytest.approx(0.65, abs=1e-9)


def test_drive_rejects_bad_arguments():
    with pytest.raises(ValueError, match="offsets"):
        asyncio.run(drive(_items(2), _Log(), offsets=[0.0]))
    with pytest.raises(ValueError, match="cap"):
        asyncio.run(drive(_items(2), _Log(), cap=0))


# ---------------------------------------------------------------------------- fake services (faults)


class _RecordingWorker(pb_grpc.WorkerServicer):
    """Streams one message per token; rejects prompts over ``max_len`` (the injected fault)."""

    def __init__(self, max_len=10_000, hang_s=0.0):
        self.max_len, self.hang_s = max_len, hang_s
        self.prompts: dict[str, list[int]] = {}
        self.cancelled = 0

    async def Generate(self, request, context):
        ids = list(request.token_ids.ids)
        self.prompts[request.request_id] = ids
        if len(ids) > self.max_len:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"prompt of {len(ids)} tokens is too long")
        try:
            await asyncio.sleep(self.hang_s)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        n = request.sampling.max_tokens
        for i in range(n):
            await asyncio.sleep(0.003)
            last = i == n - 1
            msg = pb.GenerateResponse(request_id=request.request_id, token_ids=[len(ids) % 50 + i],
                                      worker_id="fake", finished=last)
            if last:
                msg.finish_reason = "length"
                msg.usage.CopyFrom(pb.Usage(prompt_tokens=len(ids), cached_tokens=0, computed_prefill_tokens=len(ids),
                                            completion_tokens=n))
            yield msg

    async def GetInfo(self, request, context):
        return pb.WorkerInfo(worker_id="fake", vocab_size=384, max_model_len=self.max_len)


def _run(servicer, workload, out, **kwargs):
    async def go():
        server = grpc.aio.server()
        pb_grpc.add_WorkerServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            return await run_workload(f"127.0.0.1:{port}", workload, out, progress=False, **kwargs)
        finally:
            await server.stop(None)

    return asyncio.run(go())


def test_multi_turn_prompts_carry_the_completion_received(tmp_path):
    w = multi_turn_workload(num_conversations=2, num_turns=4, system_prompt_len=6, user_len=3, output_len=3, seed=1)
    # Turn prompts grow 9, 15, 21, 27 tokens: turn 3 (27 > 24) is rejected by the worker.
    worker = _RecordingWorker(max_len=24)
    result, records = _run(worker, w, tmp_path / "o", arrival=ArrivalSpec("poisson", rate=200.0), warmup_requests=1)
    by_index = {r["index"]: r for r in records}
    prompts = {int(k.rsplit("-", 1)[1]): v for k, v in worker.prompts.items()}
    for it in w.items:
        if it.parent is None or it.index not in prompts:
            continue
        parent_prompt = prompts[it.parent]
        completion = [len(parent_prompt) % 50 + i for i in range(3)]
        assert prompts[it.index] == parent_prompt + completion + it.tokens
    assert [by_index[i]["code"] for i in (6, 7)] == ["INVALID_ARGUMENT", "INVALID_ARGUMENT"]
    assert by_index[0]["warmup"] and "warmup" not in by_index[1]
    assert result["warmup_requests"] == 1 and result["num_requests"] == 7 and result["num_errors"] == 2
    # ITL: one gap per streamed message after the first.
    assert all(len(r["itl_ms"]) == 2 for r in records if r["ok"])
    assert result["itl_ms"]["p50"] is not None and result["tpot_ms"]["p50"] is not None
    rows = [json.loads(x) for x in (tmp_path / "o" / "requests.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and rows[0]["warmup"] is True


def test_parent_rejected_means_later_turns_are_not_sent(tmp_path):
    w = multi_turn_workload(num_conversations=1, num_turns=3, system_prompt_len=20, user_len=3, output_len=2)
    worker = _RecordingWorker(max_len=10)   # even turn 0 (23 tokens) is too long
    result, records = _run(worker, w, tmp_path / "o")
    assert [r["code"] for r in records] == ["INVALID_ARGUMENT", "PARENT_FAILED", "PARENT_FAILED"]
    assert len(worker.prompts) == 1 and result["error_codes"] == {"INVALID_ARGUMENT": 1, "PARENT_FAILED": 2}


def test_hanging_server_is_cancelled_at_the_grace_deadline(tmp_path):
    items = [WorkItem(index=i, tokens=[1, 2, 3], max_tokens=2) for i in range(8)]
    worker = _RecordingWorker(hang_s=60.0)
    result, records = _run(worker, Workload("hang", items), tmp_path / "o", arrival=ArrivalSpec("closed", concurrency=2),
                           duration_s=0.3, grace_s=0.2)
    # cancelled, not waited for: the server would have answered (OK) only after 60 s
    assert result["num_cancelled"] == 2 and result["num_not_sent"] == 6 and result["num_errors"] == 0
    assert result["num_ok"] == 0 and all(r["code"] == "CANCELLED" for r in records)
    # and not before the grace deadline (0.3 + 0.2 s; the exact moment is checked on a
    # virtual clock in test_time_bound_stops_sending_and_cancels_at_the_grace_deadline)
    assert result["duration_s"] >= 0.5 - 0.01, result["duration_s"]
