"""Malformed-request fuzzing of a worker or router: status codes, hangs and memory.

Sends ``count`` malformed or hostile requests to one server and reports how each was
answered. Bodies come from four families, drawn with a seeded RNG:

* random bytes, and truncated or bit-flipped encodings of valid requests, sent raw to
  every RPC of kvmesh.v1.Worker (and kvmesh.v1.Router on a router), so the server's own
  protobuf parsing is exercised;
* well-formed GenerateRequests with bad values: empty prompts, out-of-range token ids,
  over-long prompts and texts, NaN / infinite / negative sampling values, ``max_tokens``
  0, invalid UTF-8 where a string is expected, junk ``prefix_location`` hints;
* FetchBlocks with hashes of the wrong size or too many of them;
* small valid requests (``max_tokens`` <= 2), so the server is also seen to keep serving.

A request passes when it gets any status other than ``UNKNOWN`` (an unhandled exception)
or ``DEADLINE_EXCEEDED`` (a hang, after ``deadline_s``) and the server process is alive
afterwards; ``INTERNAL`` is reported separately. Memory: the server's RSS (from
``/proc/PID/status``) after a warm-up pass is compared with its RSS after the run.

Secured clusters: pass ``credentials`` (``grpc.ssl_channel_credentials(...)``) and
``metadata`` (e.g. ``[("authorization", "Bearer KEY")]``); a ``PERMISSION_DENIED`` or
``UNAUTHENTICATED`` answer counts as handled.

Usage::

    python -m kvmesh.bench.fuzz --target 127.0.0.1:50051 --count 5000 --pid 1234
    python -m kvmesh.bench.fuzz --target ROUTER --router --count 2000 --tls-ca ca.pem --api-key KEY
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc

from kvmesh.proto import kvmesh_pb2 as pb

WORKER_METHODS = {  # method -> (streaming response?, request class)
    "/kvmesh.v1.Worker/Generate": (True, pb.GenerateRequest),
    "/kvmesh.v1.Worker/Tokenize": (False, pb.TokenizeRequest),
    "/kvmesh.v1.Worker/GetInfo": (False, pb.WorkerInfoRequest),
    "/kvmesh.v1.Worker/GetLoad": (False, pb.LoadRequest),
    "/kvmesh.v1.Worker/GetSnapshot": (False, pb.SnapshotRequest),
    "/kvmesh.v1.Worker/FetchBlocks": (True, pb.FetchBlocksRequest),
}
ROUTER_METHODS = {
    "/kvmesh.v1.Worker/Generate": (True, pb.GenerateRequest),
    "/kvmesh.v1.Worker/Tokenize": (False, pb.TokenizeRequest),
    "/kvmesh.v1.Router/Generate": (True, pb.GenerateRequest),
    "/kvmesh.v1.Router/Status": (False, pb.RouterStatusRequest),
}
#: Status codes that mean the server did not handle the request (a worker's own answer that a
#: request could not meet its deadline is counted as "SHED", not as a hang).
FAILING = ("UNKNOWN", "DEADLINE_EXCEEDED")
#: Codes a server with authentication on may answer instead of looking at the body.
AUTH_CODES = ("PERMISSION_DENIED", "UNAUTHENTICATED")


@dataclass
class FuzzReport:
    """Outcome of one run. ``codes``: answers by status name (``OK`` for a clean stream)."""

    target: str
    sent: int = 0
    seconds: float = 0.0
    codes: collections.Counter = field(default_factory=collections.Counter)
    examples: dict = field(default_factory=dict)   # status name -> (family, details) of one case
    rss_before_kib: int | None = None
    rss_after_kib: int | None = None
    alive: bool = True

    @property
    def unknown(self) -> int:
        return self.codes.get("UNKNOWN", 0)

    @property
    def hangs(self) -> int:
        return self.codes.get("DEADLINE_EXCEEDED", 0)

    @property
    def rss_growth(self) -> float | None:
        """RSS after / RSS before the run, minus 1 (None without a pid)."""
        if not self.rss_before_kib or self.rss_after_kib is None:
            return None
        return self.rss_after_kib / self.rss_before_kib - 1.0

    def to_dict(self) -> dict:
        return {"target": self.target, "sent": self.sent, "seconds": round(self.seconds, 2),
                "codes": dict(self.codes), "unknown": self.unknown, "hangs": self.hangs, "alive": self.alive,
                "rss_before_kib": self.rss_before_kib, "rss_after_kib": self.rss_after_kib,
                "rss_growth": None if self.rss_growth is None else round(self.rss_growth, 4),
                "examples": {k: list(v) for k, v in self.examples.items()}}


def rss_kib(pid: int) -> int | None:
    """Resident set size of ``pid`` in KiB (Linux ``/proc``), None if unreadable."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class Mutator:
    """Seeded generator of (family, method, body bytes) cases for one server kind."""

    def __init__(self, rng: random.Random, methods: dict, vocab: int = 512, max_len: int = 32768):
        self.rng = rng
        self.methods = methods
        self.vocab = vocab
        self.max_len = max_len
        self.generate_methods = [m for m in methods if m.endswith("/Generate")]

    def case(self) -> tuple[str, str, bytes]:
        r = self.rng.random()
        if r < 0.2:
            return self._raw_bytes()
        if r < 0.35:
            return self._mangled()
        if r < 0.8:
            return self._bad_values()
        if r < 0.9 and "/kvmesh.v1.Worker/FetchBlocks" in self.methods:
            return self._bad_fetch()
        return self._valid_small()

    # ------------------------------------------------------------- families
    def _raw_bytes(self) -> tuple[str, str, bytes]:
        n = self.rng.choice((0, 1, 2, 7, 64, 1000, 20000))
        return "raw", self.rng.choice(list(self.methods)), self.rng.randbytes(n)

    def _mangled(self) -> tuple[str, str, bytes]:
        method = self.rng.choice(self.generate_methods)
        data = bytearray(self._generate(valid=True).SerializeToString())
        how = self.rng.choice(("truncate", "flip", "append", "varint"))
        if how == "truncate" and len(data) > 1:
            data = data[:self.rng.randrange(1, len(data))]
        elif how == "flip":
            for _ in range(self.rng.randint(1, 8)):
                i = self.rng.randrange(len(data))
                data[i] ^= 1 << self.rng.randrange(8)
        elif how == "append":
            data += self.rng.randbytes(self.rng.randint(1, 32))
        else:  # a field tag followed by an unterminated varint
            data += bytes([0x08]) + b"\xff" * self.rng.randint(1, 12)
        return f"mangled-{how}", method, bytes(data)

    def _bad_values(self) -> tuple[str, str, bytes]:
        rng = self.rng
        req = self._generate(valid=True)
        kind = rng.choice(("empty", "token_range", "too_long_ids", "too_long_text", "sampling_nan",
                           "sampling_neg", "sampling_inf", "max_tokens_0", "bad_utf8", "prefix_junk",
                           "huge_salt", "no_prompt"))
        if kind == "empty":
            req.token_ids.ids[:] = []
        elif kind == "token_range":
            req.token_ids.ids.append(rng.choice((self.vocab, self.vocab + 1, 2**31, 2**32 - 1)))
        elif kind == "too_long_ids":
            req.token_ids.ids[:] = [1] * (self.max_len + rng.randint(0, 1000))
        elif kind == "too_long_text":
            req.text = "a" * (self.max_len * rng.choice((2, 20)))
        elif kind in ("sampling_nan", "sampling_neg", "sampling_inf"):
            value = {"sampling_nan": math.nan, "sampling_neg": -rng.random() * 10,
                     "sampling_inf": rng.choice((math.inf, -math.inf))}[kind]
            setattr(req.sampling, rng.choice(("temperature", "top_p")), value)
        elif kind == "max_tokens_0":
            req.sampling.max_tokens = 0
        elif kind == "bad_utf8":
            # a proto3 string field holding invalid UTF-8 cannot be built through the API
            data = req.SerializeToString() + b"\x2a\x03\xff\xfe\xfd"  # field 5 (cache_salt)
            return "bad-utf8", rng.choice(self.generate_methods), data
        elif kind == "prefix_junk":
            req.prefix_location.worker_id = rng.choice(("", "x", "w" * 300))
            req.prefix_location.address = rng.choice(("", "nowhere", "127.0.0.1:1", "::::", "a" * 500))
            req.prefix_location.num_blocks = rng.choice((0, 1, 2**32 - 1))
        elif kind == "huge_salt":
            req.cache_salt = "s" * rng.choice((1000, 100_000))
        elif kind == "no_prompt":
            req.ClearField("token_ids")
        return f"bad-{kind}", rng.choice(self.generate_methods), req.SerializeToString()

    def _bad_fetch(self) -> tuple[str, str, bytes]:
        rng = self.rng
        n = rng.choice((1, 3, 5000))
        size = rng.choice((0, 1, 15, 17, 16))
        hashes = [rng.randbytes(size) for _ in range(n)]
        return "bad-fetch", "/kvmesh.v1.Worker/FetchBlocks", pb.FetchBlocksRequest(block_hashes=hashes).SerializeToString()

    def _valid_small(self) -> tuple[str, str, bytes]:
        return "valid", self.rng.choice(self.generate_methods), self._generate(valid=True).SerializeToString()

    def _generate(self, valid: bool) -> pb.GenerateRequest:
        rng = self.rng
        req = pb.GenerateRequest(request_id=f"fuzz-{rng.randrange(1 << 30)}",
                                 sampling=pb.SamplingParams(max_tokens=rng.randint(1, 2),
                                                            temperature=rng.choice((0.0, 0.7)),
                                                            top_p=rng.choice((0.0, 0.9, 1.0)),
                                                            seed=rng.randrange(1 << 32)))
        if rng.random() < 0.5:
            req.token_ids.ids.extend(rng.randrange(self.vocab) for _ in range(rng.randint(1, 40)))
        else:
            req.text = "".join(rng.choice("abc xyz\u00e9\u4e2d") for _ in range(rng.randint(1, 60)))
        return req


def _call(channel: grpc.Channel, method: str, streaming: bool, body: bytes, deadline_s: float,
          metadata) -> str:
    ident = lambda b: b  # noqa: E731 - bytes go out as they are
    try:
        if streaming:
            call = channel.unary_stream(method, request_serializer=ident, response_deserializer=ident)
            for _ in call(body, timeout=deadline_s, metadata=metadata):
                pass
        else:
            call = channel.unary_unary(method, request_serializer=ident, response_deserializer=ident)
            call(body, timeout=deadline_s, metadata=metadata)
        return "OK"
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and (exc.details() or "").startswith(_SHED):
            return "SHED"  # the worker's prompt answer that the deadline could not be met: not a hang
        return exc.code().name


#: How a worker's DEADLINE_EXCEEDED for a request shed on its estimate begins
#: (`workers.scheduler.Scheduler`). One shed because its deadline passed while it waited
#: stays a hang here: it was queued that long.
_SHED = "shed before its prefill"


def run_fuzz(target: str, count: int, router: bool = False, seed: int = 0, pid: int | None = None,
             credentials: grpc.ChannelCredentials | None = None, metadata=None, deadline_s: float = 10.0,
             concurrency: int = 8, warmup: int = 500, vocab: int = 512, max_len: int = 32768,
             settle_s: float = 1.0) -> FuzzReport:
    """Send ``count`` fuzzed requests to ``target`` (after ``warmup`` unmeasured ones).

    Args:
        target: ``host:port`` of a worker, or of a router with ``router=True``.
        count: requests in the measured run.
        seed: RNG seed (the same seed sends the same bodies).
        pid: the server's process id, for the RSS comparison and the liveness check.
        credentials: channel credentials (TLS / mTLS) or None for plaintext.
        metadata: call metadata sent with every request, e.g. an API key header.
        deadline_s: per-request deadline (seconds); hitting it counts as a hang.
        concurrency: requests in flight at once.
        warmup: requests sent first and not counted, so that one-off allocations
            (channels, caches, the tokenizer) and the allocator's high-water mark from
            the largest bodies are in the RSS baseline. A router measured after 100
            requests grew 7% over the next 1,000 and then stayed within 1% for 3,000 more.
        vocab: the served model's vocabulary size (tokens), to craft out-of-range ids.
        max_len: the served model's context (tokens), to craft over-long prompts.
        settle_s: pause before the final RSS reading (seconds).

    Returns:
        a `FuzzReport`.
    """
    methods = ROUTER_METHODS if router else WORKER_METHODS
    mut = Mutator(random.Random(seed), methods, vocab=vocab, max_len=max_len)
    options = [("grpc.max_send_message_length", 256 << 20), ("grpc.max_receive_message_length", 256 << 20)]
    channel = (grpc.secure_channel(target, credentials, options=options) if credentials is not None
               else grpc.insecure_channel(target, options=options))
    report = FuzzReport(target=target)
    md = tuple(metadata or ())

    def one(case):
        family, method, body = case
        return family, method, _call(channel, method, methods[method][0], body, deadline_s, md)

    try:
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(one, [mut.case() for _ in range(warmup)]))
            time.sleep(settle_s)
            report.rss_before_kib = rss_kib(pid) if pid else None
            t0 = time.perf_counter()
            cases = (mut.case() for _ in range(count))
            for family, method, code in pool.map(one, cases):
                report.sent += 1
                report.codes[code] += 1
                report.examples.setdefault(code, (family, method))
            report.seconds = time.perf_counter() - t0
        time.sleep(settle_s)
        if pid:
            report.rss_after_kib = rss_kib(pid)
            report.alive = report.rss_after_kib is not None
    finally:
        channel.close()
    return report


def main(argv: list[str] | None = None) -> int:
    from kvmesh.services.security import add_client_args

    p = argparse.ArgumentParser(prog="python -m kvmesh.bench.fuzz", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="HOST:PORT of the worker or router")
    p.add_argument("--router", action="store_true", help="the target is a router (default: a worker)")
    p.add_argument("--count", type=int, default=5000, help="fuzzed requests to send (default 5000)")
    p.add_argument("--seed", type=int, default=0, help="RNG seed (default 0)")
    p.add_argument("--pid", type=int, default=None, help="server process id, for RSS and liveness (optional)")
    p.add_argument("--deadline-s", type=float, default=10.0, help="per-request deadline in seconds (default 10)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight (default 8)")
    add_client_args(p)  # --api-key, --tls-ca, --tls-cert, --tls-key, each defaulting to its KVMESH_* variable
    p.add_argument("--metadata", action="append", default=[], metavar="KEY=VALUE",
                   help="extra call metadata, repeatable")
    args = p.parse_args(argv)
    if args.api_key and not args.tls_ca:
        p.error("--api-key (or KVMESH_API_KEY) needs --tls-ca (or KVMESH_TLS_CA): without TLS the key would "
                "cross the network in clear")
    creds = None
    if args.tls_ca:
        def read(path):
            with open(path, "rb") as fh:
                return fh.read()
        creds = grpc.ssl_channel_credentials(read(args.tls_ca), read(args.tls_key) if args.tls_key else None,
                                             read(args.tls_cert) if args.tls_cert else None)
    md = [("authorization", f"Bearer {args.api_key}")] if args.api_key else []
    for item in args.metadata:
        key, sep, value = item.partition("=")
        if not sep:
            p.error(f"--metadata {item!r} is not KEY=VALUE")
        md.append((key.lower(), value))
    report = run_fuzz(args.target, args.count, router=args.router, seed=args.seed, pid=args.pid,
                      credentials=creds, metadata=md, deadline_s=args.deadline_s, concurrency=args.concurrency)
    print(json.dumps(report.to_dict(), indent=2))
    growth = report.rss_growth
    ok = report.unknown == 0 and report.hangs == 0 and report.alive and (growth is None or growth <= 0.10)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
