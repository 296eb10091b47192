"""Model configuration for the kvmesh worker: shapes, RoPE parameters and KV-cache sizing.

`ModelConfig` describes one Llama-family decoder (Llama, Mistral, Qwen2). It can be built
from a Hugging Face ``config.json`` (`ModelConfig.from_hf_dict`), taken from the built-in
tiny default (`ModelConfig.tiny`), or looked up for a few public models (`KNOWN_SHAPES`).

`kv_cache_bytes` gives the memory a KV cache needs, which the ``kv-size`` command prints.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
"""Values allowed in `ModelConfig.architecture`."""

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
"""HF ``model_type`` values `ModelConfig.from_hf_dict` accepts (Mistral runs as ``llama``)."""

SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
"""torch dtype names allowed in `ModelConfig.dtype`."""

_DTYPE_ALIASES = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}

# Bits per stored KV element, by the names kv_cache_bytes accepts.
_KV_BITS = {
    "fp32": 32,
    "float32": 32,
    "bf16": 16,
    "bfloat16": 16,
    "fp16": 16,
    "float16": 16,
    "fp8": 8,
    "fp8_e4m3": 8,
    "fp8_e5m2": 8,
    "int8": 8,
    "int4": 4,
}


def normalize_dtype_name(name: Any) -> str:
    """Return the canonical torch dtype name ("float32", "bfloat16", "float16").

    Accepts a string alias ("fp32", "bf16", "fp16", "half", ...) or a ``torch.dtype``.

    Raises:
        ValueError: the dtype is not one of the supported ones.
    """
    text = str(name)
    if text.startswith("torch."):
        text = text[len("torch."):]
    canonical = _DTYPE_ALIASES.get(text.lower())
    if canonical is None:
        raise ValueError(
            f"unsupported dtype {name!r}; expected one of {', '.join(SUPPORTED_DTYPES)}"
        )
    return canonical


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 RoPE frequency scaling (``rope_type: "llama3"`` in HF configs).

    Source: Meta Llama 3.1 reference implementation (``apply_scaling``): wavelengths
    longer than ``original_max_position_embeddings / low_freq_factor`` are divided by
    ``factor``, those shorter than ``original_max_position_embeddings / high_freq_factor``
    are kept, and the band in between is linearly interpolated in ``1/wavelength``.
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int
    rope_type: str = "llama3"


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder.

    Attributes:
        architecture: "llama" (Llama, Mistral) or "qwen2" (Llama plus q/k/v biases).
        vocab_size: rows of the embedding and of the LM head.
        hidden_size: residual stream width H.
        intermediate_size: SwiGLU inner width (Shazeer 2020).
        num_hidden_layers: decoder layers L.
        num_attention_heads: query heads.
        num_key_value_heads: key/value heads (GQA: Ainslie et al. 2023); divides the query heads.
        head_dim: per-head width D (q/k/v projections are heads x D wide).
        rms_norm_eps: epsilon of RMSNorm (Zhang & Sennrich 2019).
        rope_theta: RoPE base (Su et al. 2021).
        max_position_embeddings: longest context the model supports, in tokens.
        tie_word_embeddings: the LM head reuses the embedding matrix.
        attention_bias: q/k/v projections have biases (True for Qwen2).
        bos_token_id: beginning-of-sequence id, or None.
        eos_token_id: the first end-of-sequence id, or None.
        model_id: identifier used for the cache namespace (KV from different models never mixes).
        dtype: torch dtype name of the weights and activations.
        eos_token_ids: every end-of-sequence id (HF configs may list several).
        rope_scaling: Llama 3 frequency scaling, or None for plain RoPE.
        sliding_window: attention span in tokens (Mistral v0.1), or None for full attention.

    Raises:
        ValueError: from ``__post_init__`` when fields are inconsistent (unknown architecture
            or dtype, kv heads not dividing query heads, non-positive sizes).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_id: int | None
    model_id: str
    dtype: str = "float32"
    eos_token_ids: tuple[int, ...] = field(default=())
    rope_scaling: RopeScaling | None = None
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"expected one of {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive or None, got {self.sliding_window}")
        object.__setattr__(self, "dtype", normalize_dtype_name(self.dtype))
        ids = tuple(int(i) for i in self.eos_token_ids)
        if not ids and self.eos_token_id is not None:
            ids = (int(self.eos_token_id),)
        if self.eos_token_id is None and ids:
            object.__setattr__(self, "eos_token_id", ids[0])
        object.__setattr__(self, "eos_token_ids", ids)

    # ------------------------------------------------------------------ derived sizes
    @property
    def num_queries_per_kv(self) -> int:
        """Query heads sharing one KV head (GQA group size)."""
        return self.num_attention_heads // self.num_key_value_heads

    def kv_bytes_per_token(self, dtype: str = "bf16") -> float:
        """KV-cache bytes one token occupies across all layers (see `kv_cache_bytes`; int4 gives halves)."""
        return kv_cache_bytes(self, 2, 1, dtype) / 2

    # ------------------------------------------------------------------ constructors
    @classmethod
    def tiny(cls) -> "ModelConfig":
        """The built-in default model: a 4-layer GQA Llama over the 384-id byte vocabulary.

        Ids 0..255 are UTF-8 bytes, 256 is BOS and 257 is EOS (see `workers.tokenizer.ByteTokenizer`).
        Hidden size 512 (8 query heads x 64, 2 KV heads, SwiGLU 1536) keeps the projections,
        not attention, the larger part of a 2,048-token prefill, as in real models; about
        13M parameters, 16 KiB of KV per token-block row (4 layers x 2 x 2 heads x 64 x fp32).
        """
        return cls(
            architecture="llama",
            vocab_size=384,
            hidden_size=512,
            intermediate_size=1536,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=64,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            max_position_embeddings=32768,
            tie_word_embeddings=False,
            attention_bias=False,
            bos_token_id=256,
            eos_token_id=257,
            model_id="kvmesh-tiny-llama-v2",
            dtype="float32",
        )

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any], model_id: str) -> "ModelConfig":
        """Build a config from the fields of a Hugging Face ``config.json``.

        Read fields: ``model_type`` (else inferred from ``architectures``), ``vocab_size``,
        ``hidden_size``, ``intermediate_size``, ``num_hidden_layers``, ``num_attention_heads``,
        ``num_key_value_heads`` (default: the attention heads), ``head_dim`` (default:
        hidden / heads), ``rms_norm_eps`` (default 1e-6), ``rope_theta`` (top level or inside
        ``rope_parameters``; default 10000), ``rope_scaling`` / ``rope_parameters`` (only the
        "default" and "llama3" RoPE types), ``max_position_embeddings`` (default 2048),
        ``tie_word_embeddings`` (default False), ``attention_bias`` (forced True for qwen2),
        ``bos_token_id``, ``eos_token_id`` (int or list; the first entry becomes
        ``eos_token_id``, all of them ``eos_token_ids``), ``sliding_window`` (Mistral only),
        ``torch_dtype`` / ``dtype`` (default float32).

        Raises:
            ValueError: a required field is missing or has the wrong type, or the model uses
                something this decoder does not implement (model_type other than llama,
                mistral, qwen2; non-SiLU activation; MLP biases; unsupported RoPE scaling;
                Qwen2 sliding-window layers). The message names the field.
        """
        model_type = d.get("model_type")
        if model_type is None:
            archs = d.get("architectures") or []
            for arch in archs:
                low = str(arch).lower()
                for candidate in SUPPORTED_MODEL_TYPES:
                    if low.startswith(candidate):
                        model_type = candidate
                        break
                if model_type is not None:
                    break
        if model_type is None:
            raise ValueError("field 'model_type' is missing (and 'architectures' names no supported model)")
        model_type = str(model_type).lower()
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"field 'model_type' is {model_type!r}; supported model types: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )

        def required_int(name: str) -> int:
            if name not in d or d[name] is None:
                raise ValueError(f"field {name!r} is missing")
            value = d[name]
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"field {name!r} must be an integer, got {value!r}")
            return value

        def optional_int(name: str, default: int | None) -> int | None:
            value = d.get(name)
            if value is None:
                return default
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"field {name!r} must be an integer, got {value!r}")
            return value

        hidden = required_int("hidden_size")
        heads = required_int("num_attention_heads")
        kv_heads = optional_int("num_key_value_heads", heads)
        if hidden % heads != 0 and d.get("head_dim") is None:
            raise ValueError("field 'head_dim' is missing and hidden_size is not a multiple of num_attention_heads")
        head_dim = optional_int("head_dim", hidden // heads)

        act = d.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"field 'hidden_act' is {act!r}; only 'silu' (SwiGLU) is supported")
        if d.get("mlp_bias"):
            raise ValueError("field 'mlp_bias' is true; MLP biases are not supported")

        rope_theta, rope_scaling = _read_rope(d)

        sliding_window: int | None = None
        if model_type == "mistral":
            sliding_window = optional_int("sliding_window", None)
        elif model_type == "qwen2" and d.get("use_sliding_window"):
            raise ValueError("field 'use_sliding_window' is true; Qwen2 sliding-window layers are not supported")

        eos_raw = d.get("eos_token_id")
        if eos_raw is None:
            eos_ids: tuple[int, ...] = ()
        elif isinstance(eos_raw, (list, tuple)):
            eos_ids = tuple(int(x) for x in eos_raw)
        else:
            eos_ids = (int(eos_raw),)

        dtype_raw = d.get("torch_dtype") or d.get("dtype") or "float32"
        try:
            dtype = normalize_dtype_name(dtype_raw)
        except ValueError:
            raise ValueError(
                f"field 'torch_dtype' is {dtype_raw!r}; expected one of {', '.join(SUPPORTED_DTYPES)}"
            ) from None

        return cls(
            architecture="qwen2" if model_type == "qwen2" else "llama",
            vocab_size=required_int("vocab_size"),
            hidden_size=hidden,
            intermediate_size=required_int("intermediate_size"),
            num_hidden_layers=required_int("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=optional_int("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=True if model_type == "qwen2" else bool(d.get("attention_bias", False)),
            bos_token_id=optional_int("bos_token_id", None),
            eos_token_id=eos_ids[0] if eos_ids else None,
            model_id=model_id,
            dtype=dtype,
            eos_token_ids=eos_ids,
            rope_scaling=rope_scaling,
            sliding_window=sliding_window,
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """Return an HF-style ``config.json`` dict that `from_hf_dict` reads back to this config.

        ``model_id`` is not part of the dict (it comes from where the checkpoint lives).
        """
        model_type = "qwen2" if self.architecture == "qwen2" else ("mistral" if self.sliding_window else "llama")
        arch_name = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
        out: dict[str, Any] = {
            "architectures": [arch_name[model_type]],
            "model_type": model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_id,
            "torch_dtype": self.dtype,
        }
        if self.rope_scaling is not None:
            out["rope_scaling"] = {
                "rope_type": self.rope_scaling.rope_type,
                "factor": self.rope_scaling.factor,
                "low_freq_factor": self.rope_scaling.low_freq_factor,
                "high_freq_factor": self.rope_scaling.high_freq_factor,
                "original_max_position_embeddings": self.rope_scaling.original_max_position_embeddings,
            }
        if model_type == "mistral":
            out["sliding_window"] = self.sliding_window
        return out


def _read_rope(d: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """Read the RoPE base and scaling from either the pre-v5 (``rope_theta`` + ``rope_scaling``)
    or the v5 (``rope_parameters``) HF layout.

    Raises:
        ValueError: a RoPE type other than "default" or "llama3".
    """
    params = d.get("rope_parameters")
    if not isinstance(params, Mapping):
        params = {}
    theta = d.get("rope_theta")
    if theta is None:
        theta = params.get("rope_theta", 10000.0)
    scaling = d.get("rope_scaling")
    if not isinstance(scaling, Mapping):
        scaling = params
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if rope_type in (None, "default"):
        return float(theta), None
    if rope_type != "llama3":
        raise ValueError(
            f"field 'rope_scaling' has rope_type {rope_type!r}; supported: 'default', 'llama3'"
        )
    try:
        return float(theta), RopeScaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        )
    except KeyError as exc:
        raise ValueError(f"field 'rope_scaling' lacks {exc.args[0]!r} for rope_type 'llama3'") from None


def _known(
    model_id: str,
    *,
    vocab: int,
    hidden: int,
    inter: int,
    layers: int,
    heads: int,
    kv_heads: int,
    max_pos: int,
    theta: float,
    eps: float,
    bos: int,
    eos: int,
    architecture: str = "llama",
    scaling: RopeScaling | None = None,
    window: int | None = None,
) -> ModelConfig:
    return ModelConfig(
        architecture=architecture,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        rms_norm_eps=eps,
        rope_theta=theta,
        max_position_embeddings=max_pos,
        tie_word_embeddings=False,
        attention_bias=architecture == "qwen2",
        bos_token_id=bos,
        eos_token_id=eos,
        model_id=model_id,
        dtype="bfloat16",
        rope_scaling=scaling,
        sliding_window=window,
    )


KNOWN_SHAPES: dict[str, ModelConfig] = {
    # huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json
    "Llama-3-8B": _known(
        "meta-llama/Meta-Llama-3-8B", vocab=128256, hidden=4096, inter=14336, layers=32,
        heads=32, kv_heads=8, max_pos=8192, theta=500000.0, eps=1e-5, bos=128000, eos=128001,
    ),
    # huggingface.co/meta-llama/Meta-Llama-3-70B/blob/main/config.json
    "Llama-3-70B": _known(
        "meta-llama/Meta-Llama-3-70B", vocab=128256, hidden=8192, inter=28672, layers=80,
        heads=64, kv_heads=8, max_pos=8192, theta=500000.0, eps=1e-5, bos=128000, eos=128001,
    ),
    # huggingface.co/meta-llama/Llama-3.1-405B/blob/main/config.json
    "Llama-3.1-405B": _known(
        "meta-llama/Llama-3.1-405B", vocab=128256, hidden=16384, inter=53248, layers=126,
        heads=128, kv_heads=8, max_pos=131072, theta=500000.0, eps=1e-5, bos=128000, eos=128001,
        scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                            original_max_position_embeddings=8192),
    ),
    # huggingface.co/Qwen/Qwen2-7B/blob/main/config.json (the -Instruct variant lists 32768 positions)
    "Qwen2-7B": _known(
        "Qwen/Qwen2-7B", vocab=152064, hidden=3584, inter=18944, layers=28, heads=28,
        kv_heads=4, max_pos=131072, theta=1000000.0, eps=1e-6, bos=151643, eos=151643,
        architecture="qwen2",
    ),
    # huggingface.co/mistralai/Mistral-7B-v0.1/blob/main/config.json
    "Mistral-7B": _known(
        "mistralai/Mistral-7B-v0.1", vocab=32000, hidden=4096, inter=14336, layers=32,
        heads=32, kv_heads=8, max_pos=32768, theta=10000.0, eps=1e-5, bos=1, eos=2,
        window=4096,
    ),
}
"""Published shapes of a few public models (weights in bf16), keyed by display name.

Layers, KV heads, head_dim (= hidden / heads) and context length come from each model's
``config.json`` on the Hugging Face Hub (the file cited above each entry).
"""


def resolve_model_shape(name_or_dir: str) -> ModelConfig:
    """Resolve what the ``kv-size`` command was given into a `ModelConfig`.

    Accepts "tiny" (the built-in model), a `KNOWN_SHAPES` key or its Hub id
    (case-insensitive, e.g. "llama-3-8b" or "meta-llama/Meta-Llama-3-8B"), or a directory
    holding a ``config.json``.

    Raises:
        ValueError: none of the above; the message lists the known names. Also raised when
            the directory's config.json is unreadable or unsupported (see `ModelConfig.from_hf_dict`).
    """
    text = str(name_or_dir).strip()
    if text.lower() == "tiny":
        return ModelConfig.tiny()
    for key, cfg in KNOWN_SHAPES.items():
        if text.lower() in (key.lower(), cfg.model_id.lower()):
            return cfg
    if os.path.isdir(text):
        from kvmesh.workers.model_identity import config_without_weights

        return config_without_weights(text)
    names = ", ".join(["tiny", *KNOWN_SHAPES])
    raise ValueError(f"unknown model {text!r}; known names: {names}; or pass a directory with config.json")


def kv_cache_bytes(cfg: ModelConfig, tokens: int, batch: int = 1, dtype: str = "bf16") -> int:
    """Bytes of KV cache for ``batch`` sequences of ``tokens`` tokens each.

    bytes = 2 (K and V) x layers x kv_heads x head_dim x bytes_per_element x tokens x batch,
    with bytes per element fp32 4, bf16/fp16 2, fp8/int8 1, int4 0.5. Quantization scales and
    zero points are excluded, as is block-granularity rounding (a paged cache holds whole
    blocks; see PagedAttention: Kwon et al. SOSP 2023). The int4 result is rounded up to a
    whole byte.

    Raises:
        ValueError: unknown ``dtype`` or negative ``tokens`` / ``batch``.
    """
    bits = _KV_BITS.get(str(dtype).lower())
    if bits is None:
        raise ValueError(f"unknown KV dtype {dtype!r}; expected one of {', '.join(_KV_BITS)}")
    if tokens < 0 or batch < 0:
        raise ValueError(f"tokens and batch must be >= 0, got tokens={tokens} batch={batch}")
    elements = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * int(tokens) * int(batch)
    return -(-elements * bits // 8)  # exact for any size (float division rounds past 2**53)
