import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.cache_store.events import (
    MEDIUMS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
    encode_batch,
)

H = [bytes([i]) * 16 for i in range(8)]


def sample_batch() -> EventBatch:
    return EventBatch(
        worker_id="worker-3",
        seq=41,
        ts=1700000000.25,
        events=[
            BlockStored([H[1], H[2]], None, list(range(8)), 4),
            BlockStored([H[3]], H[2], [2**32 - 1, 0, 5, 6], 4, medium="host"),
            BlockRemoved([H[1]], medium="disk"),
            AllBlocksCleared(),
        ],
    )


def test_round_trip():
    batch = sample_batch()
    out = decode_batch(encode_batch(batch))
    assert out == batch
    assert isinstance(out.events[0], BlockStored) and out.events[0].parent_block_hash is None
    assert out.events[1].medium == "host"


def test_wire_format_is_tagged_arrays():
    raw = msgpack.unpackb(encode_batch(sample_batch()), raw=False)
    assert raw[:4] == ["EventBatch", "worker-3", 41, 1700000000.25]
    assert raw[4][0] == ["BlockStored", [H[1], H[2]], None, list(range(8)), 4, "device"]
    assert raw[4][1][0] == "BlockStored" and raw[4][1][2] == H[2]
    assert raw[4][2] == ["BlockRemoved", [H[1]], "disk"]
    assert raw[4][3] == ["AllBlocksCleared"]


def test_decode_accepts_hand_written_bytes():
    data = msgpack.packb(["EventBatch", "w", 0, 1, [["BlockRemoved", [H[0]], "peer"]]], use_bin_type=True)
    out = decode_batch(data)
    assert out == EventBatch("w", 0, 1.0, [BlockRemoved([H[0]], "peer")])
    assert isinstance(out.ts, float)


def test_events_use_slots():
    for ev in (BlockStored([H[0]], None, [1], 1), BlockRemoved([H[0]]), AllBlocksCleared(), EventBatch("w", 0, 0.0, [])):
        assert not hasattr(ev, "__dict__")
    assert MEDIUMS == ("device", "host", "disk", "peer", "remote")


def _pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


GOOD_STORED = ["BlockStored", [H[0]], None, [1, 2], 2, "device"]

MALFORMED = [
    b"",
    b"\xc1",  # reserved byte
    b"\x95\xa1",  # truncated
    _pack(["EventBatch", "w", 0, 0.0, []]) + b"\x00",  # trailing data
    _pack({"worker_id": "w"}),
    _pack(["Batch", "w", 0, 0.0, []]),
    _pack(["EventBatch", "w", 0, 0.0]),
    _pack(["EventBatch", "", 0, 0.0, []]),
    _pack(["EventBatch", 5, 0, 0.0, []]),
    _pack(["EventBatch", "w", -1, 0.0, []]),
    _pack(["EventBatch", "w", True, 0.0, []]),
    _pack(["EventBatch", "w", 0, "now", []]),
    _pack(["EventBatch", "w", 0, float("nan"), []]),
    _pack(["EventBatch", "w", 0, 0.0, {}]),
    _pack(["EventBatch", "w", 0, 0.0, [["Unknown"]]]),
    _pack(["EventBatch", "w", 0, 0.0, [[]]]),
    _pack(["EventBatch", "w", 0, 0.0, ["BlockStored"]]),
    _pack(["EventBatch", "w", 0, 0.0, [GOOD_STORED[:-1]]]),
    _pack(["EventBatch", "w", 0, 0.0, [["BlockStored", [b"short"], None, [1, 2], 2, "device"]]]),
    _pack(["EventBatch", "w", 0, 0.0, [["BlockStored", [], None, [], 2, "device"]]]),
    _pack(["EventBatch", "w", 0, 0.0, [["BlockStored", [H[0]], b"x", [1, 2], 2, "device"]]]),
    _pack(["EventBatch", "w", 0, 0.0, [["BlockStored", [H[0]], None, [1, 2, 3], 2, "device"]]]),
    _pack(["EventBatch", "w", 0, 0.0, [["BlockStored", [H[0]], None, [1, -2], 2, "device"]]]),
    _pack(["EventBatch", "w", 0, 0.0, [["BlockStored", [H[0]], None, [1, 2**32], 2, "device"]]]),
    _pack(["EventBatch", "w", 0, 0.0, [["BlockStored", [H[0]], None, [1, True], 2, "device"]]]),
    _pack(["EventBatch", "w", 0, 0.0, [["BlockStored", [H[0]], None, [1, 2], 0, "device"]]]),
    _pack(["EventBatch", "w", 0, 0.0, [["BlockStored", [H[0]], None, [1, 2], 2, "gpu"]]]),
    _pack(["EventBatch", "w", 0, 0.0, [["BlockStored", ["a" * 16], None, [1, 2], 2, "device"]]]),
    _pack(["EventBatch", "w", 0, 0.0, [["BlockRemoved", [H[0]]]]]),
    _pack(["EventBatch", "w", 0, 0.0, [["BlockRemoved", H[0], "device"]]]),
    _pack(["EventBatch", "w", 0, 0.0, [["AllBlocksCleared", 1]]]),
]


@pytest.mark.parametrize("data", MALFORMED)
def test_malformed_input_raises_value_error(data):
    with pytest.raises(ValueError):
        decode_batch(data)


def test_reference_batch_for_malformed_cases_is_valid():
    # the malformed cases above are small edits of this one, which decodes
    decode_batch(_pack(["EventBatch", "w", 0, 0.0, [GOOD_STORED]]))


def test_non_bytes_input_raises_value_error():
    with pytest.raises(ValueError):
        decode_batch("EventBatch")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "batch",
    [
        EventBatch("w", 0, 0.0, [BlockStored([b"x"], None, [1], 1)]),
        EventBatch("w", 0, 0.0, [BlockStored([H[0]], None, [1], 2)]),
        EventBatch("w", 0, 0.0, [BlockRemoved([H[0]], medium="ram")]),
        EventBatch("w", 0, 0.0, ["not an event"]),
        EventBatch("w", -3, 0.0, []),
    ],
)
def test_encode_rejects_invalid(batch):
    with pytest.raises(ValueError):
        encode_batch(batch)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64))
def test_arbitrary_bytes_decode_or_value_error(data):
    try:
        out = decode_batch(data)
    except ValueError:
        return
    assert isinstance(out, EventBatch)


hashes = st.binary(min_size=16, max_size=16)
mediums = st.sampled_from(MEDIUMS)


@st.composite
def stored(draw):
    n = draw(st.integers(1, 3))
    bs = draw(st.integers(1, 4))
    return BlockStored(
        draw(st.lists(hashes, min_size=n, max_size=n)),
        draw(st.none() | hashes),
        draw(st.lists(st.integers(0, 2**32 - 1), min_size=n * bs, max_size=n * bs)),
        bs,
        draw(mediums),
    )


events = st.one_of(
    stored(),
    st.builds(BlockRemoved, st.lists(hashes, min_size=1, max_size=3), mediums),
    st.just(AllBlocksCleared()),
)


@settings(max_examples=100, deadline=None)
@given(
    st.text(min_size=1, max_size=10),
    st.integers(0, 2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.lists(events, max_size=5),
)
def test_round_trip_property(worker, seq, ts, evs):
    batch = EventBatch(worker, seq, ts, evs)
    assert decode_batch(encode_batch(batch)) == batch
