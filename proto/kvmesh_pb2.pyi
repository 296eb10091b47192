from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "seed", "ignore_eos", "max_tokens_up_to_context")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_UP_TO_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    ignore_eos: bool
    max_tokens_up_to_context: bool
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., max_tokens_up_to_context: _Optional[bool] = ...) -> None: ...

class PrefixLocation(_message.Message):
    __slots__ = ("worker_id", "address", "num_blocks")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    num_blocks: int
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "sampling", "cache_salt", "adapter_id", "prefix_location", "return_text", "tenant", "model_id", "caller_tenant")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_LOCATION_FIELD_NUMBER: _ClassVar[int]
    RETURN_TEXT_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    CALLER_TENANT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    sampling: SamplingParams
    cache_salt: str
    adapter_id: str
    prefix_location: PrefixLocation
    return_text: bool
    tenant: str
    model_id: str
    caller_tenant: str
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., adapter_id: _Optional[str] = ..., prefix_location: _Optional[_Union[PrefixLocation, _Mapping]] = ..., return_text: _Optional[bool] = ..., tenant: _Optional[str] = ..., model_id: _Optional[str] = ..., caller_tenant: _Optional[str] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "cached_tokens", "cached_tokens_by_tier", "computed_prefill_tokens", "completion_tokens", "lossy_cached_tokens")
    class CachedTokensByTierEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_BY_TIER_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOSSY_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    cached_tokens: int
    cached_tokens_by_tier: _containers.ScalarMap[str, int]
    computed_prefill_tokens: int
    completion_tokens: int
    lossy_cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., cached_tokens_by_tier: _Optional[_Mapping[str, int]] = ..., computed_prefill_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., lossy_cached_tokens: _Optional[int] = ...) -> None: ...

class Timing(_message.Message):
    __slots__ = ("queue_ms", "prefill_ms", "ttft_ms", "e2e_ms")
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    E2E_MS_FIELD_NUMBER: _ClassVar[int]
    queue_ms: float
    prefill_ms: float
    ttft_ms: float
    e2e_ms: float
    def __init__(self, queue_ms: _Optional[float] = ..., prefill_ms: _Optional[float] = ..., ttft_ms: _Optional[float] = ..., e2e_ms: _Optional[float] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finished", "finish_reason", "usage", "timing", "worker_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finished: bool
    finish_reason: str
    usage: Usage
    timing: Timing
    worker_id: str
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ..., worker_id: _Optional[str] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class WorkerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "model_id", "block_size", "num_blocks", "vocab_size", "max_model_len", "device")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    model_id: str
    block_size: int
    num_blocks: int
    vocab_size: int
    max_model_len: int
    device: str
    def __init__(self, worker_id: _Optional[str] = ..., model_id: _Optional[str] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., device: _Optional[str] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Load(_message.Message):
    __slots__ = ("running_requests", "waiting_requests", "queued_prefill_tokens", "free_blocks", "total_blocks", "tier_weights")
    class TierWeightsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIER_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    running_requests: int
    waiting_requests: int
    queued_prefill_tokens: int
    free_blocks: int
    total_blocks: int
    tier_weights: _containers.ScalarMap[str, float]
    def __init__(self, running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., queued_prefill_tokens: _Optional[int] = ..., free_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ..., tier_weights: _Optional[_Mapping[str, float]] = ...) -> None: ...

class SnapshotRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CachedBlock(_message.Message):
    __slots__ = ("block_hash", "parent_block_hash", "medium")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    block_hash: bytes
    parent_block_hash: bytes
    medium: str
    def __init__(self, block_hash: _Optional[bytes] = ..., parent_block_hash: _Optional[bytes] = ..., medium: _Optional[str] = ...) -> None: ...

class Snapshot(_message.Message):
    __slots__ = ("worker_id", "seq", "blocks", "block_size")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    seq: int
    blocks: _containers.RepeatedCompositeFieldContainer[CachedBlock]
    block_size: int
    def __init__(self, worker_id: _Optional[str] = ..., seq: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[CachedBlock, _Mapping]]] = ..., block_size: _Optional[int] = ...) -> None: ...

class ClearCacheRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClearCacheResponse(_message.Message):
    __slots__ = ("blocks_cleared",)
    BLOCKS_CLEARED_FIELD_NUMBER: _ClassVar[int]
    blocks_cleared: int
    def __init__(self, blocks_cleared: _Optional[int] = ...) -> None: ...

class FetchBlocksRequest(_message.Message):
    __slots__ = ("block_hashes", "kv_producer")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    KV_PRODUCER_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    kv_producer: str
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., kv_producer: _Optional[str] = ...) -> None: ...

class BlockData(_message.Message):
    __slots__ = ("block_hash", "parent_block_hash", "token_ids", "codec", "dtype", "shape", "checksum", "payload", "format_version")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    FORMAT_VERSION_FIELD_NUMBER: _ClassVar[int]
    block_hash: bytes
    parent_block_hash: bytes
    token_ids: bytes
    codec: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    checksum: int
    payload: bytes
    format_version: int
    def __init__(self, block_hash: _Optional[bytes] = ..., parent_block_hash: _Optional[bytes] = ..., token_ids: _Optional[bytes] = ..., codec: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., checksum: _Optional[int] = ..., payload: _Optional[bytes] = ..., format_version: _Optional[int] = ...) -> None: ...

class RouterStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "address", "load", "cached_blocks", "model_id", "block_size", "routed_around")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    ROUTED_AROUND_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    load: Load
    cached_blocks: int
    model_id: str
    block_size: int
    routed_around: str
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., load: _Optional[_Union[Load, _Mapping]] = ..., cached_blocks: _Optional[int] = ..., model_id: _Optional[str] = ..., block_size: _Optional[int] = ..., routed_around: _Optional[str] = ...) -> None: ...

class RouterStatus(_message.Message):
    __slots__ = ("policy", "workers", "indexed_blocks", "details_withheld")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    INDEXED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DETAILS_WITHHELD_FIELD_NUMBER: _ClassVar[int]
    policy: str
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    indexed_blocks: int
    details_withheld: bool
    def __init__(self, policy: _Optional[str] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., indexed_blocks: _Optional[int] = ..., details_withheld: _Optional[bool] = ...) -> None: ...
