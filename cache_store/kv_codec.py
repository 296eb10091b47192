"""Codecs that turn KV blocks into byte payloads for the lower cache tiers.

A codec encodes a batch of blocks shaped like the device pool's rows,
``[n, num_layers, 2, num_kv_heads, block_size, head_dim]``, into a
``[n, payload_bytes]`` uint8 tensor, and decodes it back. Every block's
payload has the same size, so a tier can keep them in one fixed-size slab.
Codecs register by name (:func:`register_codec`) and tiers pick them with
:func:`make_codec`:

``none``
    The block's bytes as they are (the pool dtype, native byte order). Exact.
``fp8``
    FP8 E4M3 (the OCP 8-bit floating point format, ``torch.float8_e4m3fn``:
    largest finite value 448) with one float32 scale per block, layer, K/V and
    KV head: ``scale = amax(|x|) / 448`` over that head's ``block_size x
    head_dim`` values, ``q = fp8(x / scale)``. Payload: the scales
    (``layers * 2 * kv_heads`` float32) then the FP8 bytes (one per value).
``int4``
    Symmetric 4-bit integers with one float32 scale per group of
    ``group_size`` consecutive values along ``head_dim`` (32, or ``head_dim``
    when 32 does not divide it): ``scale = amax(|x|) / 7``,
    ``q = clamp(round(x / scale), -8, 7)``, stored as ``q + 8`` in a nibble,
    two per byte (even index in the low nibble). Payload: the scales (one
    float32 per group) then the packed nibbles (half a byte per value).

Compressed codecs are lossy; docs/TIERS.md gives the measured effect on the
built-in model's logits and greedy tokens. A zero group or head encodes with
scale 1 and decodes to exact zeros. Values are assumed finite.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import ClassVar

import torch

__all__ = ["KVCodec", "CODECS", "register_codec", "make_codec", "loss_rank", "codec_of_rank", "NoneCodec",
           "Fp8Codec", "Int4Codec"]

#: Registered codecs by name.
CODECS: dict[str, type["KVCodec"]] = {}


def register_codec(cls: type["KVCodec"]) -> type["KVCodec"]:
    """Class decorator: make ``cls`` available to :func:`make_codec` under ``cls.name``.

    Raises:
        ValueError: the name is missing or taken by another class.
    """
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"{cls.__name__} has no codec name")
    if CODECS.get(name, cls) is not cls:
        raise ValueError(f"codec name {name!r} already registered by {CODECS[name].__name__}")
    CODECS[name] = cls
    return cls


def loss_rank(name: str) -> int:
    """The registered codec ``name``'s ``loss_rank`` (0: exact).

    Raises:
        KeyError: unknown codec.
    """
    return CODECS[name].loss_rank


def codec_of_rank(rank: int) -> str:
    """The name of the codec with ``loss_rank`` ``rank``: what a block whose KV went
    through codecs up to that rank is labelled and stored as.

    Raises:
        KeyError: no codec has that rank.
    """
    for name, cls in CODECS.items():
        if cls.loss_rank == rank:
            return name
    raise KeyError(f"no codec has loss rank {rank}")


def make_codec(name: str, block_shape: tuple[int, ...], dtype: torch.dtype) -> "KVCodec":
    """A codec instance by registered name for blocks of ``block_shape`` and ``dtype``.

    Raises:
        ValueError: unknown name (the message lists the known ones), a block
            shape that is not ``(layers, 2, kv_heads, block_size, head_dim)``
            of positive ints, or a dtype the codec cannot encode.
    """
    cls = CODECS.get(name)
    if cls is None:
        raise ValueError(f"unknown KV codec {name!r}; known: {', '.join(sorted(CODECS))}")
    return cls(tuple(block_shape), dtype)


class KVCodec(ABC):
    """Encodes and decodes batches of KV blocks. Stateless after construction.

    Args:
        block_shape: ``(num_layers, 2, num_kv_heads, block_size, head_dim)``.
        dtype: the pool dtype the blocks come in and decode to.

    Attributes:
        payload_bytes: bytes of one encoded block.
        block_bytes: bytes of one block in the pool dtype.
        exact: True if ``decode(encode(x)) == x`` bit for bit.
        loss_rank: 0 for the exact codec; lossy codecs rank by their documented error
            (docs/TIERS.md): a block whose KV went through several codecs carries the
            highest rank among them (`codec_of_rank`; `TierStore._slot_record`).
    """

    name: ClassVar[str]
    exact: ClassVar[bool] = False
    loss_rank: ClassVar[int] = 0

    def __init__(self, block_shape: tuple[int, ...], dtype: torch.dtype):
        if len(block_shape) != 5 or block_shape[1] != 2 or any(
            not isinstance(d, int) or isinstance(d, bool) or d < 1 for d in block_shape
        ):
            raise ValueError(f"block shape must be (layers, 2, kv_heads, block_size, head_dim), got {block_shape}")
        self.block_shape = tuple(block_shape)
        self.dtype = dtype
        self.numel = math.prod(block_shape)
        self.block_bytes = self.numel * torch.empty((), dtype=dtype).element_size()
        self.payload_bytes = self._payload_bytes()

    @abstractmethod
    def _payload_bytes(self) -> int:
        """Bytes of one encoded block."""

    @abstractmethod
    def encode(self, blocks: torch.Tensor) -> torch.Tensor:
        """Encode ``blocks`` ``[n, *block_shape]`` (pool dtype, any device).

        Returns:
            ``[n, payload_bytes]`` uint8 on the same device (may share memory
            with ``blocks`` for the exact codec).

        Raises:
            ValueError: wrong shape or dtype.
        """

    @abstractmethod
    def decode(self, payload: torch.Tensor) -> torch.Tensor:
        """Decode ``payload`` ``[n, payload_bytes]`` uint8 to ``[n, *block_shape]`` in the pool dtype.

        Raises:
            ValueError: wrong shape or dtype.
        """

    # -- helpers for subclasses ------------------------------------------------
    def _check_blocks(self, blocks: torch.Tensor) -> int:
        if blocks.dim() != 6 or tuple(blocks.shape[1:]) != self.block_shape:
            raise ValueError(f"expected blocks [n, {', '.join(map(str, self.block_shape))}], "
                             f"got {tuple(blocks.shape)}")
        if blocks.dtype != self.dtype:
            raise ValueError(f"expected {self.dtype} blocks, got {blocks.dtype}")
        return blocks.shape[0]

    def _check_payload(self, payload: torch.Tensor) -> int:
        if payload.dtype != torch.uint8 or payload.dim() != 2 or payload.shape[1] != self.payload_bytes:
            raise ValueError(f"expected uint8 payload [n, {self.payload_bytes}], got {payload.dtype} "
                             f"{tuple(payload.shape)}")
        return payload.shape[0]


@register_codec
class NoneCodec(KVCodec):
    """The pool bytes unchanged: ``payload_bytes == block_bytes``."""

    name = "none"
    exact = True

    def _payload_bytes(self) -> int:
        return self.block_bytes

    def encode(self, blocks):
        n = self._check_blocks(blocks)
        return blocks.contiguous().view(torch.uint8).view(n, self.payload_bytes)

    def decode(self, payload):
        n = self._check_payload(payload)
        return payload.contiguous().view(self.dtype).view(n, *self.block_shape)


#: Largest finite value of FP8 E4M3 (``torch.finfo(torch.float8_e4m3fn).max``).
FP8_E4M3_MAX = 448.0


@register_codec
class Fp8Codec(KVCodec):
    """FP8 E4M3 values with a float32 scale per (layer, K/V, KV head) of each block."""

    name = "fp8"
    loss_rank = 1

    def _payload_bytes(self) -> int:
        layers, two, heads = self.block_shape[:3]
        self.num_scales = layers * two * heads
        return 4 * self.num_scales + self.numel

    def encode(self, blocks):
        n = self._check_blocks(blocks)
        x = blocks.float()
        amax = x.abs().amax(dim=(-2, -1), keepdim=True)             # [n, L, 2, H, 1, 1]
        scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
        q = (x / scale).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
        out = torch.empty((n, self.payload_bytes), dtype=torch.uint8, device=blocks.device)
        out[:, : 4 * self.num_scales] = scale.reshape(n, self.num_scales).view(torch.uint8)
        out[:, 4 * self.num_scales:] = q.reshape(n, self.numel).view(torch.uint8)
        return out

    def decode(self, payload):
        n = self._check_payload(payload)
        payload = payload.contiguous()
        scale = payload[:, : 4 * self.num_scales].view(torch.float32)
        layers, two, heads = self.block_shape[:3]
        scale = scale.reshape(n, layers, two, heads, 1, 1)
        q = payload[:, 4 * self.num_scales:].view(torch.float8_e4m3fn).reshape(n, *self.block_shape)
        return (q.float() * scale).to(self.dtype)


@register_codec
class Int4Codec(KVCodec):
    """Symmetric int4, two values per byte, a float32 scale per group along ``head_dim``."""

    name = "int4"
    loss_rank = 2
    #: Values per scale group along head_dim (when it divides head_dim).
    GROUP_SIZE = 32

    def _payload_bytes(self) -> int:
        d = self.block_shape[-1]
        self.group = self.GROUP_SIZE if d % self.GROUP_SIZE == 0 else d
        if (self.numel % 2) or (self.group % 2):
            raise ValueError("int4 packing needs an even head_dim")
        self.num_groups = self.numel // self.group
        return 4 * self.num_groups + self.numel // 2

    def encode(self, blocks):
        n = self._check_blocks(blocks)
        x = blocks.float().reshape(n, self.num_groups, self.group)
        amax = x.abs().amax(dim=-1, keepdim=True)
        scale = torch.where(amax > 0, amax / 7.0, torch.ones_like(amax))
        q = torch.round(x / scale).clamp_(-8, 7).to(torch.int16).add_(8).to(torch.uint8)
        q = q.reshape(n, self.numel // 2, 2)
        packed = q[..., 0] | (q[..., 1] << 4)
        out = torch.empty((n, self.payload_bytes), dtype=torch.uint8, device=blocks.device)
        out[:, : 4 * self.num_groups] = scale.reshape(n, self.num_groups).view(torch.uint8)
        out[:, 4 * self.num_groups:] = packed
        return out

    def decode(self, payload):
        n = self._check_payload(payload)
        payload = payload.contiguous()
        scale = payload[:, : 4 * self.num_groups].view(torch.float32).reshape(n, self.num_groups, 1)
        packed = payload[:, 4 * self.num_groups:]
        q = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(n, self.num_groups, self.group)
        x = (q.to(torch.float32) - 8.0) * scale
        return x.reshape(n, *self.block_shape).to(self.dtype)
