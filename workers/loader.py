"""Build a `DecoderModel`: seeded random weights for the built-in tiny model, or an HF
safetensors checkpoint directory (Llama, Mistral, Qwen2)."""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re

import torch

from kvmesh.workers import model_identity
from kvmesh.workers.config import ModelConfig, normalize_dtype_name
from kvmesh.workers.model import DecoderModel

__all__ = ["load_model", "save_tiny_checkpoint", "init_random_weights", "checkpoint_fingerprint"]

EMBED_INIT_STD = 1.0
"""Standard deviation of the random-init embedding (as PyTorch's ``nn.Embedding`` default)."""

_IGNORED_TENSORS = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")


def _resolve_dtype(dtype: str | torch.dtype | None, default: str) -> str:
    return normalize_dtype_name(dtype if dtype is not None else default)


def init_random_weights(model: DecoderModel, seed: int) -> None:
    """Fill ``model`` in place with seeded random weights.

    Embedding ~ N(0, 1); every projection weight ``[out, in]`` (q/k/v/o, gate/up/down,
    LM head) ~ N(0, 1/in) (LeCun normal: LeCun et al. 1998, "Efficient BackProp"), so each
    sub-layer output has roughly unit scale and attention is sharp enough for the next token
    to depend on the context (with a flat N(0, 0.02) init greedy decoding of the tiny model
    collapses into repeating one token). Biases 0, RMSNorm weights 1.

    Values are drawn in float32 on the CPU from ``torch.Generator().manual_seed(seed)`` in
    ``named_parameters()`` order and then cast, so they are identical across processes,
    devices and dtypes (up to the final cast).
    """
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                std = EMBED_INIT_STD if name == "embed_tokens.weight" else param.shape[1] ** -0.5
                values = torch.empty(param.shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
                param.copy_(values)


def _random_model(config: ModelConfig, device: str | torch.device, seed: int) -> DecoderModel:
    with torch.device("meta"):
        model = DecoderModel(config)
    model.to_empty(device=device)
    model.tie_weights()
    init_random_weights(model, seed)
    return model.requires_grad_(False).eval()


def checkpoint_fingerprint(model_dir: str) -> str:
    """Short content hash of a checkpoint directory, used to namespace its KV cache: config,
    tokenizer files and every byte of every weight file (`model_identity.checkpoint_fingerprint`).
    Returns 12 hex chars."""
    return model_identity.checkpoint_fingerprint(model_dir)


def read_config(model_dir: str) -> ModelConfig:
    """The `ModelConfig` of a local HF directory, without loading weights.

    ``model_id`` is ``"<dir name>@<checkpoint_fingerprint>"``, the id workers hash under
    (config.json is checked first, `model_identity.config_without_weights`, then every weight
    file is hashed).

    Raises:
        ValueError: config.json is missing, unreadable or unsupported (names the file).
    """
    cfg = model_identity.config_without_weights(model_dir)
    return dataclasses.replace(cfg, model_id=f"{cfg.model_id}@{checkpoint_fingerprint(model_dir)}")


def _read_tensors(model_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"{model_dir}: no *.safetensors weight files found")
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        for name, tensor in load_file(path, device="cpu").items():
            if name in tensors:
                raise ValueError(f"{path}: tensor {name!r} also appears in another shard")
            tensors[name] = tensor
    return tensors


def _map_tensors(
    config: ModelConfig, model: DecoderModel, raw: dict[str, torch.Tensor], model_dir: str
) -> dict[str, torch.Tensor]:
    """Map HF tensor names to `DecoderModel` names and check names and shapes."""
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    mapped: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    for hf_name, tensor in raw.items():
        if _IGNORED_TENSORS.match(hf_name):
            continue
        name = hf_name[len("model."):] if hf_name.startswith("model.") else hf_name
        if name not in expected:
            unexpected.append(hf_name)
            continue
        mapped[name] = tensor
    if config.tie_word_embeddings and "embed_tokens.weight" in mapped:
        # Tied checkpoints usually omit lm_head; when present the embedding wins.
        mapped["lm_head.weight"] = mapped["embed_tokens.weight"]
    missing = sorted(n if n == "lm_head.weight" else "model." + n for n in expected if n not in mapped)
    problems = []
    if missing:
        problems.append(f"missing tensors: {_first(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {_first(sorted(unexpected))}")
    shapes = [f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {expected[name]}"
              for name, tensor in mapped.items() if tuple(tensor.shape) != expected[name]]
    if shapes:
        problems.append(_first(shapes, "; ", "mis-shaped tensors"))
    if problems:
        raise ValueError(f"{model_dir}: checkpoint does not match config.json; " + "; ".join(problems))
    return mapped


#: Items of one kind a load error names before it counts the rest.
_NAMED_ITEMS = 4


def _first(items: list[str], sep: str = ", ", what: str = "") -> str:
    """The first `_NAMED_ITEMS` of ``items`` and a count of the rest ("and N more WHAT"): an
    edited config.json can mis-shape every tensor, and a line per tensor hides the cause."""
    head = sep.join(items[:_NAMED_ITEMS])
    rest = len(items) - _NAMED_ITEMS
    return head + (f"{sep}and {rest} more {what}".rstrip() if rest > 0 else "")


def load_model(
    model_dir: str | None,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    seed: int = 0,
) -> tuple[ModelConfig, DecoderModel]:
    """Load a model for inference (returned in eval mode).

    Args:
        model_dir: None for `ModelConfig.tiny` with seeded random weights
            (`init_random_weights`); otherwise an HF checkpoint directory with config.json
            and one or more ``*.safetensors`` files (sharded checkpoints are merged).
        device: where the weights go.
        dtype: "float32" / "bfloat16" / "float16" (aliases and ``torch.dtype`` accepted);
            default the config's dtype (``torch_dtype`` in config.json).
        seed: random-init seed (only with ``model_dir=None``).

    HF names map as ``model.X -> X`` and ``lm_head.weight -> lm_head.weight``; when
    ``tie_word_embeddings`` is set the LM head shares ``model.embed_tokens.weight``.
    For a directory, ``config.model_id`` is ``"<dir name>@<checkpoint_fingerprint>"`` so KV
    caches of different checkpoints never share a namespace.

    Returns:
        ``(config, model)`` with the model in eval mode and ``requires_grad`` off;
        ``config.dtype`` is the dtype actually loaded.

    Raises:
        ValueError: config.json missing or unparsable, a field missing or unsupported
            (model_type other than llama / mistral / qwen2, ...), no safetensors files,
            or missing / unexpected / mis-shaped tensors (the message lists them), or an
            unsupported ``dtype``.
    """
    if model_dir is None:
        config = ModelConfig.tiny()
        config = dataclasses.replace(config, dtype=_resolve_dtype(dtype, config.dtype))
        return config, _random_model(config, device, seed)

    model_dir = os.fspath(model_dir)
    if not os.path.isdir(model_dir):
        raise ValueError(f"{model_dir}: model directory not found")
    config = read_config(model_dir)
    config = dataclasses.replace(config, dtype=_resolve_dtype(dtype, config.dtype))
    with torch.device("meta"):
        model = DecoderModel(config)
    raw = _read_tensors(model_dir)
    mapped = _map_tensors(config, model, raw, model_dir)
    target = getattr(torch, config.dtype)
    converted = {name: t.to(device=device, dtype=target) for name, t in mapped.items()}
    model.load_state_dict(converted, strict=True, assign=True)
    model.tie_weights()
    return config, model.requires_grad_(False).eval()


def _umask() -> int:
    """This process's file-creation mask, read without changing it (Linux: /proc/self/status;
    elsewhere os.umask set and restored, which other threads could briefly see)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def save_tiny_checkpoint(directory: str, config: ModelConfig | None = None, seed: int = 0) -> str:
    """Write an HF-layout checkpoint (config.json + model.safetensors) with seeded random weights.

    ``config`` defaults to `ModelConfig.tiny`; weights come from `init_random_weights` with
    ``seed`` and are stored in ``config.dtype`` under HF names (``lm_head.weight`` omitted when
    tied). Loading the directory with `load_model` reproduces ``load_model(None, seed=seed)``
    for the tiny config. Returns ``directory``.
    """
    from safetensors.torch import save_file

    config = config or ModelConfig.tiny()
    os.makedirs(directory, exist_ok=True)
    model = _random_model(config, "cpu", seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            if config.tie_word_embeddings:
                continue
            hf_name = name
        else:
            hf_name = "model." + name
        tensors[hf_name] = tensor.detach().clone().contiguous()
    weights = os.path.join(directory, "model.safetensors")
    save_file(tensors, weights, metadata={"format": "pt"})
    # safetensors writes the file owner-only (0600); give it the mode any new file gets under
    # the umask, as config.json does, so that a server running as another user can read it
    os.chmod(weights, 0o666 & ~_umask())
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as fh:
        json.dump(config.to_hf_dict(), fh, indent=2, sort_keys=True)
        fh.write("\n")
    return directory
