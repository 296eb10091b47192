"""A generation request as the engine sees it: tokens, block table, progress, timing.

One `Request` per Generate call. The engine thread owns and mutates it; other threads
only read the immutable fields (ids, sampling) and receive `RequestOutput`s.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Callable

from typing import TYPE_CHECKING

from kvmesh.cache_store.hashing import Namespace, hash_block, hash_blocks, tokens_to_bytes

if TYPE_CHECKING:  # the CLI imports this module for SamplingParams without loading torch
    import torch


class InvalidRequest(ValueError):
    """The request can never be served as sent (maps to gRPC INVALID_ARGUMENT)."""


class Overloaded(RuntimeError):
    """The worker cannot take the request now or ever with its pool (RESOURCE_EXHAUSTED)."""


#: Default ``--deadline-shed-factor`` (`workers.scheduler.Scheduler`): a request is shed
#: before its prefill when this fraction of its estimated time to first token is already
#: more than its deadline leaves, i.e. when it would miss even at four times the fastest
#: recent prefill rate. It is the floor: a caller's factor is raised while its admitted
#: requests miss their deadlines (`workers.scheduler.DeadlinePressure`).
DEFAULT_DEADLINE_SHED_FACTOR = 0.25


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


def generator_seed(seed: int) -> int:
    """The 32-bit seed a request's sampler is seeded with, from its 64-bit ``seed``. torch's
    CPU generator (a Mersenne Twister) keeps only the low 32 bits of a seed, so seeds that
    differed above bit 32 gave the same samples. Seeds under 2**32 are kept as they are;
    larger ones are mixed by SplitMix64's finalizer (Steele, Lea and Flood, "Fast Splittable
    Pseudorandom Number Generators", OOPSLA 2014) and the low 32 bits taken, so that seeds
    with the same low or high half, or the same halves swapped, do not meet."""
    if seed < 1 << 32:
        return seed
    z = seed & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0xFFFFFFFF


@dataclass(frozen=True)
class SamplingParams:
    """Decoding settings of one request.

    Attributes:
        max_tokens: completion length cap in tokens (>= 1).
        temperature: 0 for greedy (argmax); > 0 divides the logits before sampling.
        top_p: nucleus sampling mass (Holtzman et al. 2020, "The Curious Case of Neural
            Text Degeneration"); values <= 0 or >= 1 disable it.
        seed: seed of the request's own torch.Generator, so a seeded request gives the
            same tokens whichever other requests share its batch; 0 to 2**64 - 1, brought
            to the generator's 32 bits by `generator_seed`.
        ignore_eos: keep decoding past EOS until max_tokens.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    ignore_eos: bool = False


@dataclass
class RequestOutput:
    """What the engine reports after a step for one request.

    ``new_token_ids`` are the tokens generated since the previous output. On the last
    output ``finished`` is True and ``usage``/``timing`` are filled; ``error`` is set
    (with ``error_code`` naming a gRPC status) when the request failed instead.
    """

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str = ""
    usage: dict | None = None
    timing: dict | None = None
    error: str = ""
    error_code: str = ""


@dataclass(eq=False)
class Request:
    """Engine-side state of one request.

    Token bookkeeping (all counts in tokens):
        ``token_ids`` = prompt + generated so far.
        ``num_computed`` tokens have their KV in ``block_table``'s blocks.
        ``num_cached`` prompt tokens were served from the prefix cache when the request
        was first admitted to run (-1 before); a request passed over while waiting locks
        nothing, and one preempted and run again keeps its first figures (as vLLM reports).
        ``block_hashes`` hold the chained hash of every full block of ``token_ids`` whose
        tokens are known (prompt blocks at arrival, generated blocks as they fill).
    """

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    namespace: Namespace
    block_size: int
    on_output: Callable[[RequestOutput], None]
    arrival: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_committed_blocks: int = 0
    num_cached: int = -1
    cached_by_tier: dict = field(default_factory=dict)
    #: cached tokens whose KV came, now or earlier, from a lossy codec (int4, fp8)
    num_lossy_cached: int = 0
    #: the loss rank (`kv_codec.loss_rank`) of the KV this request's new rows are computed on:
    #: the lossiest of its cached prefix rows, so KV computed over lossy context is marked so
    context_loss: int = 0
    #: the loss rank of the KV its first schedule used (the context it computed its new rows
    #: over): a preempted request is scheduled again on KV at most that lossy
    allowed_loss: int = 0
    #: the loss rank of each block its first schedule reused: scheduled again, it reuses each
    #: block only as lossy as it was then (exact where it was exact), so `num_lossy_cached`
    #: stays true of its output
    cached_loss: bytes = b""
    #: ``(num_cached, cached_by_tier, cached_loss)`` of the latest cache match while the
    #: request has not run yet; made its usage when it is admitted (`Scheduler.schedule`)
    pending_usage: tuple | None = None
    #: block index -> medium of blocks that an attempt passed over loaded from a lower tier
    #: into the device pool, so the admitted attempt reports them by that medium
    loaded_from: dict = field(default_factory=dict)
    status: RequestStatus = RequestStatus.WAITING
    generator: torch.Generator | None = None
    first_scheduled: float | None = None
    prefill_done: float | None = None
    first_token: float | None = None
    num_preemptions: int = 0
    #: held back at least once so that another tenant keeps its share of the device pool
    #: (`workers.scheduler.Scheduler`)
    held_for_share: bool = False
    num_emitted: int = 0
    #: when the caller stops waiting (``time.monotonic()`` seconds; None: never): the
    #: scheduler sheds a request that cannot reach its first token by then before computing
    #: its prompt (`workers.scheduler.Scheduler`, ``deadline_shed_factor``)
    deadline: float | None = None
    #: who sent it (the server's caller identity, "" when unknown): what deadline shedding's
    #: pressure is kept per (`workers.scheduler.DeadlinePressure`); the cache tenant is
    #: ``namespace.tenant``, shared by every caller of a shared salt
    caller: str = ""

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_ids)
        hashed = hash_blocks(self.token_ids, self.block_size, self.namespace.root_hash())
        self.block_hashes = list(hashed.hashes)
        #: little-endian uint32 token ids of the full blocks, block after block
        self.token_bytes = bytearray(hashed.token_bytes[:len(hashed.hashes) * self.block_size * 4])
        if self.sampling.temperature > 0:
            import torch

            self.generator = torch.Generator().manual_seed(generator_seed(int(self.sampling.seed)))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_ids):]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def block_token_bytes(self, i: int) -> bytes:
        """Token ids of full block i as little-endian uint32 bytes."""
        step = self.block_size * 4
        return bytes(self.token_bytes[i * step:(i + 1) * step])

    def append_token(self, token_id: int) -> None:
        """Add a generated token; hash the block it completes, if any."""
        self.token_ids.append(token_id)
        n_full = len(self.token_ids) // self.block_size
        while len(self.block_hashes) < n_full:
            i = len(self.block_hashes)
            data = tokens_to_bytes(self.token_ids[i * self.block_size:(i + 1) * self.block_size])
            parent = self.block_hashes[-1] if self.block_hashes else self.namespace.root_hash()
            self.block_hashes.append(hash_block(parent, data))
            self.token_bytes += data
