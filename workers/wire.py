"""Translation between kvmesh.v1 protobuf messages and plain Python values.

Shared by the worker's servicer, the router and the CLI so the Generate contract is
spelled out once.
"""
from __future__ import annotations

import grpc

from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.workers.request import SamplingParams

#: gRPC status codes by the names the engine uses in `RequestOutput.error_code`.
STATUS_CODES = {
    "INVALID_ARGUMENT": grpc.StatusCode.INVALID_ARGUMENT,
    "RESOURCE_EXHAUSTED": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "UNAVAILABLE": grpc.StatusCode.UNAVAILABLE,
    "INTERNAL": grpc.StatusCode.INTERNAL,
    "DEADLINE_EXCEEDED": grpc.StatusCode.DEADLINE_EXCEEDED,
    "CANCELLED": grpc.StatusCode.CANCELLED,
}

DEFAULT_MAX_TOKENS = 16


def sampling_from_proto(msg: pb.GenerateRequest) -> SamplingParams:
    """SamplingParams of a request; an unset sampling message means greedy, 16 tokens.

    ``top_p`` 0 (proto3's default) means nucleus sampling off (1.0); a NaN or negative
    ``top_p`` is passed through for `Engine.validate` to reject.

    max_tokens 0 inside a *set* sampling message is kept (and later rejected as
    INVALID_ARGUMENT) so that a client's mistake is reported, not silently fixed.
    """
    if not msg.HasField("sampling"):
        return SamplingParams(max_tokens=DEFAULT_MAX_TOKENS)
    s = msg.sampling
    return SamplingParams(
        max_tokens=int(s.max_tokens),
        temperature=float(s.temperature),
        # 0 is proto3's "unset" (nucleus off); NaN and negatives are kept so that the
        # engine rejects them as INVALID_ARGUMENT like any other bad sampling value
        top_p=1.0 if s.top_p == 0 else float(s.top_p),
        seed=int(s.seed),
        ignore_eos=bool(s.ignore_eos),
    )


def sampling_to_proto(s: SamplingParams) -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p,
                             seed=s.seed, ignore_eos=s.ignore_eos)


def usage_to_proto(usage: dict) -> pb.Usage:
    return pb.Usage(
        prompt_tokens=usage["prompt_tokens"],
        cached_tokens=usage["cached_tokens"],
        cached_tokens_by_tier={k: int(v) for k, v in usage["cached_tokens_by_tier"].items()},
        lossy_cached_tokens=int(usage.get("lossy_cached_tokens", 0)),
        computed_prefill_tokens=usage["computed_prefill_tokens"],
        completion_tokens=usage["completion_tokens"],
    )


def usage_from_proto(u: pb.Usage, mediums: tuple[str, ...] = ("device", "host", "disk", "peer", "remote")) -> dict:
    by_tier = {m: 0 for m in mediums}
    by_tier.update({k: int(v) for k, v in u.cached_tokens_by_tier.items()})
    return {
        "prompt_tokens": u.prompt_tokens,
        "cached_tokens": u.cached_tokens,
        "cached_tokens_by_tier": by_tier,
        "lossy_cached_tokens": u.lossy_cached_tokens,
        "computed_prefill_tokens": u.computed_prefill_tokens,
        "completion_tokens": u.completion_tokens,
    }


def timing_to_proto(t: dict) -> pb.Timing:
    return pb.Timing(**{k: float(t[k]) for k in ("queue_ms", "prefill_ms", "ttft_ms", "e2e_ms")})


def timing_from_proto(t: pb.Timing) -> dict:
    return {"queue_ms": t.queue_ms, "prefill_ms": t.prefill_ms, "ttft_ms": t.ttft_ms, "e2e_ms": t.e2e_ms}


def forwarded_identity(request: pb.GenerateRequest) -> tuple[str, str, str]:
    """(caller's tenant, cache tenant, cache salt) a router forwarded in a peer's request
    (``caller_tenant`` is empty from an older router: the cache tenant stands in)."""
    return request.caller_tenant or request.tenant, request.tenant, request.cache_salt


def load_to_proto(load: dict) -> pb.Load:
    return pb.Load(**load)  # tier_weights: a dict fills the proto map


def load_from_proto(load: pb.Load) -> dict:
    return {
        "running_requests": load.running_requests,
        "waiting_requests": load.waiting_requests,
        "queued_prefill_tokens": load.queued_prefill_tokens,
        "free_blocks": load.free_blocks,
        "total_blocks": load.total_blocks,
        "tier_weights": dict(load.tier_weights),
    }
