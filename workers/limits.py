"""Size limits of a Generate request, derived from the served model's context length.

A prompt can never be longer than the model's context (``max_model_len`` tokens), so
both the gRPC message cap and the cheap checks made before tokenizing, hashing or
forwarding follow from it:

* ``token_ids``: at most ``max_model_len - 1`` ids (one position is left for the first
  generated token, as `Engine.validate` requires);
* ``text``: at most ``MAX_TEXT_BYTES_PER_TOKEN`` UTF-8 bytes per token of context. Real
  tokenizers average 3-5 bytes per token on text and code; 16 leaves room for long
  whitespace and byte-fallback runs while refusing a 64 MiB body before it is tokenized;
* the whole message: the larger of the longest text and the longest token-id prompt
  (``MAX_TOKEN_ID_BYTES`` per id) plus ``MESSAGE_SLACK_BYTES`` for the other fields
  (`request_bytes_limit`); a worker also takes the largest FetchBlocks request
  (`fetch_request_bytes_limit`). gRPC refuses a bigger body with RESOURCE_EXHAUSTED before
  reading it.

Both the worker (from its own engine) and the router (from the workers' leases) call
`check_prompt_size`, which raises `InvalidRequest` (gRPC INVALID_ARGUMENT).
"""
from __future__ import annotations

import struct

from kvmesh.workers.request import InvalidRequest

#: Text bytes allowed per token of context (bytes/token); see the module docstring.
MAX_TEXT_BYTES_PER_TOKEN = 16
#: Room for the request's other fields, bytes: ``request_id`` (256 characters),
#: ``cache_salt`` and ``adapter_id`` (1,024 each), at most 4 UTF-8 bytes per character, is
#: 9 KiB; the model id, tenant, sampling and prefix hint are short.
MESSAGE_SLACK_BYTES = 64 * 1024
#: Most bytes one token id takes in a request: a uint32 as a protobuf varint.
MAX_TOKEN_ID_BYTES = 5
#: Context (tokens) whose token-id prompts a router without ``--model`` takes: it cannot
#: know its workers' context when it starts (128K tokens of ids = 640 KiB); for longer
#: contexts give it ``--model``.
ROUTER_TOKEN_ID_CONTEXT = 128 * 1024


def as_float32(value: float) -> float:
    """``value`` as the wire's 32-bit ``float`` fields hold it (IEEE 754 binary32, round to
    nearest): a positive number under about 1.4e-45 becomes 0."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


def resolve_max_model_len(requested: int | None, model_limit: int) -> int:
    """The context limit (tokens) a worker runs with: ``requested``, or ``model_limit`` when
    ``requested`` is None or 0.

    Args:
        requested: the asked-for limit (``--max-model-len``), tokens.
        model_limit: the model's ``max_position_embeddings``, tokens.

    Raises:
        ValueError: ``requested`` is negative, or above ``model_limit`` (the model has no
            position past it, so a long request would fail mid-prefill; as vLLM does, this
            is refused at start, not capped). The message names ``max_model_len`` (which
            the CLI prints as ``--max-model-len``) and the model's limit.
    """
    if not requested:
        return int(model_limit)
    if requested < 0:
        raise ValueError(f"max_model_len must be >= 1 tokens (got {requested})")
    if requested > model_limit:
        raise ValueError(f"max_model_len {requested} is more than the model's context of {model_limit} tokens "
                         f"(its max_position_embeddings): pass at most {model_limit}, or leave max_model_len out "
                         f"to use {model_limit}")
    return int(requested)


def fit_max_model_len_to_pool(max_model_len: int, requested: int | None, num_blocks: int,
                              block_size: int) -> int:
    """The context limit (tokens) once the KV pool is counted: a request of ``max_model_len``
    tokens needs ``ceil(max_model_len / block_size)`` blocks, and one request alone must always
    fit the pool, else it could only ever be refused (a retry elsewhere would not help it, and
    it would be no use to queue it).

    As vLLM does at start (its engine refuses a ``max_model_len`` whose KV does not fit the
    cache), an explicit ``requested`` limit the pool cannot hold is an error; the model's
    default limit is lowered to what the pool holds, ``num_blocks * block_size`` tokens, so
    that a small pool on a long-context model still starts (`Engine.pool_capped` says so).

    Args:
        max_model_len: the limit from `resolve_max_model_len`, tokens.
        requested: what was asked for (``--max-model-len``), or None / 0 for the default.
        num_blocks: blocks in the device pool (``--num-blocks``).
        block_size: tokens per block (``--block-size``).

    Raises:
        ValueError: ``requested`` needs more blocks than ``num_blocks``; the message names
            ``max_model_len`` and ``num_blocks`` (printed as ``--max-model-len`` and
            ``--num-blocks``) and the figures that would fit.
    """
    pool_tokens = int(num_blocks) * int(block_size)
    if max_model_len <= pool_tokens:
        return int(max_model_len)
    if requested:
        need = -(-int(max_model_len) // int(block_size))
        raise ValueError(f"max_model_len {max_model_len} needs {need} KV blocks of {block_size} tokens for one request "
                         f"alone, but num_blocks is {num_blocks} ({pool_tokens} tokens): raise num_blocks to at "
                         f"least {need} or lower max_model_len to at most {pool_tokens}")
    return pool_tokens


def request_bytes_limit(max_model_len: int, token_id_context: int = 0) -> int:
    """Largest Generate or Tokenize request (bytes) a server for a ``max_model_len``-token
    model accepts: the longest accepted text (``MAX_TEXT_BYTES_PER_TOKEN`` per token) or
    token-id prompt (``MAX_TOKEN_ID_BYTES`` per token, for ``max(max_model_len,
    token_id_context)`` tokens), whichever is longer, plus ``MESSAGE_SLACK_BYTES``.
    Pure."""
    ids = MAX_TOKEN_ID_BYTES * max(int(max_model_len), int(token_id_context))
    return max(MAX_TEXT_BYTES_PER_TOKEN * int(max_model_len), ids) + MESSAGE_SLACK_BYTES


#: Room for a FetchBlocksRequest's ``kv_producer`` (device, torch version and attention path:
#: under 200 bytes), bytes.
FETCH_SLACK_BYTES = 4 * 1024


def fetch_request_bytes_limit(max_blocks: int, hash_bytes: int) -> int:
    """Largest FetchBlocksRequest (bytes): ``max_blocks`` hashes of ``hash_bytes`` bytes, each
    with its 2 bytes of field tag and length, plus ``FETCH_SLACK_BYTES`` (the KV producer).
    Pure."""
    return int(max_blocks) * (int(hash_bytes) + 2) + FETCH_SLACK_BYTES


#: Most bytes of JSON one byte of UTF-8 text can take: a ``\\u00XX`` escape (RFC 8259, section 7).
JSON_ESCAPE_BYTES = 6


def http_body_bytes_limit(max_model_len: int) -> int:
    """Largest HTTP request body (bytes) an OpenAI-compatible front for a ``max_model_len``-token
    model reads: the longest accepted text (``MAX_TEXT_BYTES_PER_TOKEN`` per token) with every
    byte JSON-escaped, plus ``MESSAGE_SLACK_BYTES``, and at least 1 MiB. A token-id array of the
    whole context (at most 11 bytes per id) fits well below it; anything larger is refused
    before it is parsed, so that no body costs the server's event loop more than parsing
    about ``96 * max_model_len`` bytes."""
    text = MAX_TEXT_BYTES_PER_TOKEN * int(max_model_len)
    return max(1 << 20, JSON_ESCAPE_BYTES * text + MESSAGE_SLACK_BYTES)


def check_prompt_size(request, max_model_len: int, where: str = "the model", why: str = "") -> None:
    """Refuse a GenerateRequest whose prompt cannot fit ``max_model_len`` tokens, cheaply.

    Looks only at the count of ``token_ids`` or the UTF-8 length of ``text`` (O(1) for
    both), so it runs before tokenizing or hashing. A text that passes may still tokenize
    to too many tokens; the token count is checked again after tokenizing.

    ``where`` names whose context it is ("the model"); ``why``, if given, follows the limit
    in the message (" (what its KV pool of 64 blocks holds)"). Also checks the lengths of
    ``request_id``, ``cache_salt`` and ``adapter_id`` (each message names the field).

    Raises:
        InvalidRequest: the prompt is over the limit (the message says by how much), or
            one of those fields is over its cap.
    """
    kind = request.WhichOneof("prompt")
    if kind == "token_ids":
        n = len(request.token_ids.ids)
        if n >= max_model_len:
            raise InvalidRequest(
                f"prompt has {n} tokens but {where}'s context is {max_model_len} tokens{why}: "
                f"shorten it to at most {max_model_len - 1} tokens")
    elif kind == "text":
        check_text_size(request.text, max_model_len, where, "prompt text", why)
    check_request_id(request.request_id)
    check_cache_salt(request.cache_salt)
    check_adapter_id(request.adapter_id)


#: Longest ``request_id`` accepted (characters); it is echoed in every streamed message.
MAX_REQUEST_ID_CHARS = 256
#: Longest ``cache_salt`` accepted (characters). A salt only needs to be unguessable (vLLM's
#: docs suggest 256 bits); it is hashed into every request's namespace root.
MAX_CACHE_SALT_CHARS = 1024
#: Longest ``adapter_id`` accepted (characters): an adapter's name, hashed into every
#: request's namespace root as the salt is, so capped the same way.
MAX_ADAPTER_ID_CHARS = 1024


def _check_chars(value: str, name: str, cap: int, hint: str) -> None:
    if len(value) > cap:
        raise InvalidRequest(f"{name} has {len(value)} characters; at most {cap} are accepted ({hint})")


def check_request_id(request_id: str) -> None:
    """Refuse a ``request_id`` over `MAX_REQUEST_ID_CHARS` characters.

    Raises:
        InvalidRequest: too long.
    """
    _check_chars(request_id, "request_id", MAX_REQUEST_ID_CHARS, "or leave it empty for one the server makes")


def check_cache_salt(cache_salt: str) -> None:
    """Refuse a ``cache_salt`` over `MAX_CACHE_SALT_CHARS` characters.

    Raises:
        InvalidRequest: too long.
    """
    _check_chars(cache_salt, "cache_salt", MAX_CACHE_SALT_CHARS, "a random 43-character string holds 256 bits")


def check_adapter_id(adapter_id: str) -> None:
    """Refuse an ``adapter_id`` over `MAX_ADAPTER_ID_CHARS` characters.

    Raises:
        InvalidRequest: too long.
    """
    _check_chars(adapter_id, "adapter_id", MAX_ADAPTER_ID_CHARS, "it names a LoRA adapter")


def check_text_size(text: str, max_model_len: int, where: str = "the model", what: str = "text",
                    why: str = "") -> None:
    """Refuse a text over ``MAX_TEXT_BYTES_PER_TOKEN * max_model_len`` UTF-8 bytes, before
    tokenizing it (a prompt or a Tokenize request).

    Raises:
        InvalidRequest: too long (the message gives the limit).
    """
    cap = MAX_TEXT_BYTES_PER_TOKEN * max_model_len
    n = len(text.encode("utf-8", "surrogatepass")) if len(text) * 4 > cap else 0
    if n > cap:
        raise InvalidRequest(
            f"{what} has {n} bytes; {where}'s context is {max_model_len} tokens{why}, so at most {cap} bytes "
            f"of text ({MAX_TEXT_BYTES_PER_TOKEN} per token) are accepted: shorten it")


def check_token_count(num_tokens: int, max_model_len: int, where: str = "the model") -> None:
    """Refuse a tokenized prompt of ``max_model_len`` tokens or more.

    Raises:
        InvalidRequest: too many tokens.
    """
    if num_tokens >= max_model_len:
        raise InvalidRequest(
            f"prompt has {num_tokens} tokens but {where}'s context is {max_model_len} tokens: "
            f"shorten it to at most {max_model_len - 1} tokens")


def check_completion_room(num_tokens: int, max_tokens: int, max_model_len: int, where: str = "the model",
                          why: str = "") -> None:
    """Refuse a prompt of ``num_tokens`` tokens whose ``max_tokens`` would run past the
    context: prompt plus completion must fit in ``max_model_len`` tokens. vLLM's OpenAI server
    refuses such a request with a 400 as well, rather than cutting the completion short.

    Raises:
        InvalidRequest: ``num_tokens + max_tokens > max_model_len``; the message gives the
            largest ``max_tokens`` that fits.
    """
    if num_tokens + max_tokens > max_model_len:
        room = max_model_len - num_tokens
        raise InvalidRequest(
            f"max_tokens is {max_tokens} but the prompt has {num_tokens} tokens and {where}'s context is "
            f"{max_model_len} tokens{why}: ask for at most {room} tokens, or shorten the prompt")
