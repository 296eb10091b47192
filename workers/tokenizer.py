"""Tokenizers for the worker: a byte-level tokenizer for the built-in tiny model and a wrapper
around the ``tokenizers`` library for HF ``tokenizer.json`` files."""

from __future__ import annotations

import json
import os
from typing import Protocol, Sequence, runtime_checkable

from kvmesh.workers.config import ModelConfig

__all__ = ["Tokenizer", "ByteTokenizer", "HFTokenizer", "load_tokenizer"]


@runtime_checkable
class Tokenizer(Protocol):
    """What the worker needs from a tokenizer.

    ``encode`` adds the special tokens the tokenizer itself prescribes for a prompt (e.g. BOS
    from a Llama tokenizer.json's post-processor; none for the byte tokenizer).
    """

    vocab_size: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 byte tokenizer: byte ``b`` is id ``b`` (0..255); ids >= 256 are special.

    Args:
        vocab_size: model vocabulary (>= 258; ids above 255 other than BOS/EOS are unused).
        bos: beginning-of-sequence id (default 256).
        eos: end-of-sequence id (default 257).

    Raises:
        ValueError: ``bos``/``eos`` not in ``[256, vocab_size)`` or ``vocab_size`` < 258.
    """

    def __init__(self, vocab_size: int = 384, bos: int | None = 256, eos: int | None = 257) -> None:
        if vocab_size < 258:
            raise ValueError(f"vocab_size must be >= 258 for a byte tokenizer, got {vocab_size}")
        for label, value in (("bos", bos), ("eos", eos)):
            if value is not None and not 256 <= value < vocab_size:
                raise ValueError(f"{label} id {value} must be in [256, {vocab_size})")
        self.vocab_size = vocab_size
        self.bos_token_id = bos
        self.eos_token_ids: tuple[int, ...] = (eos,) if eos is not None else ()

    def encode(self, text: str) -> list[int]:
        """UTF-8 bytes of ``text`` as ids 0..255."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """Bytes for ids 0..255 (others skipped), decoded as UTF-8 with ``errors="replace"``."""
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` loaded with ``tokenizers.Tokenizer.from_file``.

    Args:
        path: the tokenizer.json file, or a directory that holds one.
        bos_token_id: BOS id (usually from the model config).
        eos_token_ids: EOS ids (usually from the model config).

    Raises:
        ValueError: no tokenizer.json at ``path`` or it cannot be parsed.
    """

    def __init__(
        self,
        path: str,
        bos_token_id: int | None = None,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        from tokenizers import Tokenizer as _HF

        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise ValueError(f"{file}: tokenizer.json not found")
        try:
            self._tok = _HF.from_file(file)
        except Exception as exc:  # the Rust side raises a plain Exception
            raise ValueError(f"{file}: cannot load tokenizer ({exc})") from None
        self.path = file
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(int(i) for i in eos_token_ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt ``text``, with the special tokens (e.g. BOS) that the
        tokenizer.json's post-processor adds to a single sequence, as HF pipelines do
        (unless ``add_special_tokens`` is False: a rendered chat template has its own)."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, skipping special tokens."""
        return self._tok.decode(list(ids), skip_special_tokens=True)


def _generation_eos(model_dir: str) -> tuple[int, ...]:
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return ()
    try:
        with open(path, encoding="utf-8") as fh:
            raw = json.load(fh).get("eos_token_id")
    except (OSError, json.JSONDecodeError, AttributeError):
        return ()
    if raw is None:
        return ()
    return tuple(int(i) for i in raw) if isinstance(raw, list) else (int(raw),)


def load_tokenizer(model_dir: str | None, config: ModelConfig) -> Tokenizer:
    """The tokenizer for a model.

    ``model_dir/tokenizer.json`` when present (`HFTokenizer`, with BOS from ``config`` and EOS
    ids from ``config.eos_token_ids`` plus any extra ones in generation_config.json), else a
    `ByteTokenizer` with the config's vocabulary size and BOS/EOS ids.

    Raises:
        ValueError: from `HFTokenizer` (unusable file), or no tokenizer.json while the config's
            ids do not fit the byte tokenizer (the message says what is missing).
    """
    if model_dir is not None and os.path.isfile(os.path.join(model_dir, "tokenizer.json")):
        eos = list(config.eos_token_ids)
        eos += [i for i in _generation_eos(model_dir) if i not in eos]
        return HFTokenizer(model_dir, bos_token_id=config.bos_token_id, eos_token_ids=eos)
    try:
        return ByteTokenizer(config.vocab_size, bos=config.bos_token_id, eos=config.eos_token_id)
    except ValueError as exc:
        if model_dir is None:
            raise
        raise ValueError(
            f"{model_dir}: no tokenizer.json, and the byte-level fallback tokenizer does not fit this model "
            f"({exc}). Copy the model's tokenizer.json into the folder; the fallback only serves checkpoints "
            f"whose config.json has vocab_size >= 258 and bos/eos ids in [256, vocab_size)") from None
