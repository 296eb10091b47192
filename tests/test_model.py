"""Tests for workers.config, workers.model, workers.loader and workers.tokenizer."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tests._model_utils import Seq, greedy, step
from kvmesh.workers.config import KNOWN_SHAPES, ModelConfig, RopeScaling, kv_cache_bytes, resolve_model_shape
from kvmesh.workers.loader import load_model, save_tiny_checkpoint
from kvmesh.workers.model import AttentionMetadata, allocate_kv_cache, kv_cache_shape
from kvmesh.workers.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

transformers = pytest.importorskip("transformers")

BLOCK = 16
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def tiny():
    """(config, model) of the built-in tiny model, seed 0."""
    return load_model(None, seed=0)


def _prompt(n: int, seed: int, vocab: int = 256) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def _hf_reference(kind: str):
    """An HF causal LM of the given kind with random weights (incl. non-trivial norms and biases)."""
    common = dict(
        vocab_size=384,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        max_position_embeddings=256,
        bos_token_id=256,
        eos_token_id=257,
        attn_implementation="eager",
    )
    if kind == "llama":
        cfg = transformers.LlamaConfig(rope_theta=10000.0, **common)
        cls = transformers.LlamaForCausalLM
    elif kind == "llama3_rope":
        cfg = transformers.LlamaConfig(
            rope_theta=10000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
            **common,
        )
        cls = transformers.LlamaForCausalLM
    elif kind == "qwen2":
        common["num_hidden_layers"] = 3
        cfg = transformers.Qwen2Config(rope_theta=10000.0, tie_word_embeddings=True, **common)
        cls = transformers.Qwen2ForCausalLM
    elif kind == "mistral":
        cfg = transformers.MistralConfig(rope_theta=10000.0, sliding_window=12, **common)
        cls = transformers.MistralForCausalLM
    else:  # pragma: no cover
        raise AssertionError(kind)
    torch.manual_seed(1234)
    model = cls(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model


# --------------------------------------------------------------------------- HF reference


@pytest.mark.parametrize("kind", ["llama", "qwen2", "llama3_rope", "mistral"])
def test_prefill_matches_transformers(tmp_path, kind):
    hf = _hf_reference(kind)
    hf.save_pretrained(str(tmp_path), safe_serialization=True)
    cfg, model = load_model(str(tmp_path))
    assert cfg.architecture == ("qwen2" if kind == "qwen2" else "llama")
    assert cfg.attention_bias == (kind == "qwen2")
    assert cfg.tie_word_embeddings == (kind == "qwen2")
    assert (cfg.rope_scaling is not None) == (kind == "llama3_rope")
    assert cfg.sliding_window == (12 if kind == "mistral" else None)

    ids = _prompt(50, seed=7, vocab=cfg.vocab_size)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits[0].float()

    # 50 tokens need 4 blocks; scatter them over a larger cache in a shuffled order.
    table = [9, 2, 6, 4]
    kv = allocate_kv_cache(cfg, 12, BLOCK)
    (ours,) = step(model, kv, [Seq(ids, 0, table, all_logits=True)], BLOCK)
    assert ours.shape == (50, cfg.vocab_size) and ours.dtype == torch.float32
    diff = (ours - ref).abs().max().item()
    assert diff < 1e-4, f"{kind}: max |logit diff| = {diff}"
    # Blocks outside the table were never written.
    untouched = [b for b in range(12) if b not in table]
    assert torch.count_nonzero(kv[untouched]) == 0

    # Decoding one more token through the cache matches HF on the extended prompt.
    nxt = int(ref[-1].argmax())
    (dec,) = step(model, kv, [Seq([nxt], 50, table)], BLOCK)
    with torch.no_grad():
        ref2 = hf(input_ids=torch.tensor([ids + [nxt]])).logits[0, -1].float()
    assert (dec[0] - ref2).abs().max().item() < 1e-4


# --------------------------------------------------------------------------- paging semantics


def test_chunked_prefill_and_prefix_reuse_match_one_shot(tiny):
    cfg, model = tiny
    prompt = _prompt(45, seed=11)
    n_blocks = 4  # 45 prompt + 8 decoded tokens <= 64

    # One shot.
    kv_a = allocate_kv_cache(cfg, 16, BLOCK)
    table_a = [3, 7, 1, 12]
    (full,) = step(model, kv_a, [Seq(prompt, 0, table_a, all_logits=True)], BLOCK)

    # Three chunks with boundaries that do not line up with blocks.
    kv_b = allocate_kv_cache(cfg, 16, BLOCK)
    table_b = [10, 0, 15, 5]
    chunks = []
    for lo, hi in ((0, 13), (13, 30), (30, 45)):
        (c,) = step(model, kv_b, [Seq(prompt[lo:hi], lo, table_b, all_logits=True)], BLOCK)
        chunks.append(c)
    chunked = torch.cat(chunks)
    assert (chunked - full).abs().max().item() < 1e-4

    # Prefix reuse: sequence X computes the first two blocks, sequence Y shares them and
    # computes only the suffix into its own blocks.
    kv_c = allocate_kv_cache(cfg, 16, BLOCK)
    shared = [8, 2]
    step(model, kv_c, [Seq(prompt[:32], 0, shared)], BLOCK)
    table_y = shared + [11, 4]
    snapshot = kv_c.clone()
    (suffix,) = step(model, kv_c, [Seq(prompt[32:], 32, table_y, all_logits=True)], BLOCK)
    assert (suffix - full[32:]).abs().max().item() < 1e-4
    assert torch.equal(kv_c[shared], snapshot[shared]), "suffix step must not rewrite shared blocks"
    assert len(table_y) == n_blocks

    # Greedy continuation is identical on all three caches.
    toks_a = greedy(model, kv_a, full[-1], 45, table_a, BLOCK, 8)
    toks_b = greedy(model, kv_b, chunked[-1], 45, table_b, BLOCK, 8)
    toks_c = greedy(model, kv_c, suffix[-1], 45, table_y, BLOCK, 8)
    assert toks_a == toks_b == toks_c
    assert len(toks_a) == 8 and len(set(toks_a)) >= 3, f"degenerate continuation {toks_a}"


def test_suffix_step_reads_cached_prefix(tiny):
    """Negative control: corrupting a shared block changes the suffix logits."""
    cfg, model = tiny
    prompt = _prompt(40, seed=3)
    kv = allocate_kv_cache(cfg, 8, BLOCK)
    step(model, kv, [Seq(prompt[:32], 0, [0, 1])], BLOCK)
    (clean,) = step(model, kv, [Seq(prompt[32:], 32, [0, 1, 2])], BLOCK)
    kv[1].normal_()  # overwrite block 1 (positions 16..31) in every layer
    (dirty,) = step(model, kv, [Seq(prompt[32:], 32, [0, 1, 2])], BLOCK)
    assert (clean - dirty).abs().max().item() > 1e-3


def test_batched_step_equals_each_alone(tiny):
    cfg, model = tiny
    p1, p2 = _prompt(20, seed=21), _prompt(37, seed=22)

    alone = []
    for ids, table in ((p1, [4, 1]), (p2, [0, 6, 3])):
        kv = allocate_kv_cache(cfg, 8, BLOCK)
        (lg,) = step(model, kv, [Seq(ids, 0, table, all_logits=True)], BLOCK)
        alone.append(lg)

    kv = allocate_kv_cache(cfg, 8, BLOCK)
    b1, b2 = step(
        model, kv, [Seq(p1, 0, [4, 1], all_logits=True), Seq(p2, 0, [0, 6, 3], all_logits=True)], BLOCK
    )
    assert (b1 - alone[0]).abs().max().item() < 1e-5
    assert (b2 - alone[1]).abs().max().item() < 1e-5

    # Mixed step: a decode for sequence 1 and a prefill chunk for sequence 2 together,
    # against the same two steps run separately.
    d1, c2 = step(model, kv, [Seq([5], 20, [4, 1]), Seq(p1[:9], 37, [0, 6, 3], all_logits=True)], BLOCK)
    kv_s = allocate_kv_cache(cfg, 8, BLOCK)
    step(model, kv_s, [Seq(p1, 0, [4, 1])], BLOCK)
    step(model, kv_s, [Seq(p2, 0, [0, 6, 3])], BLOCK)
    (s1,) = step(model, kv_s, [Seq([5], 20, [4, 1])], BLOCK)
    (s2,) = step(model, kv_s, [Seq(p1[:9], 37, [0, 6, 3], all_logits=True)], BLOCK)
    assert (d1 - s1).abs().max().item() < 1e-5
    assert (c2 - s2).abs().max().item() < 1e-5


def test_kv_written_at_slot_mapping(tiny):
    cfg, model = tiny
    ids = _prompt(20, seed=5)
    kv = allocate_kv_cache(cfg, 6, BLOCK)
    step(model, kv, [Seq(ids, 0, [3, 1])], BLOCK)
    # Layer-0 V has no RoPE: it equals v_proj(input_layernorm(embed(ids))).
    layer0 = model.layers[0]
    with torch.inference_mode():
        h = layer0.input_layernorm(model.embed_tokens(torch.tensor(ids)))
        v = layer0.self_attn.v_proj(h).view(20, cfg.num_key_value_heads, cfg.head_dim)
    torch.testing.assert_close(kv[3, 0, 1].transpose(0, 1), v[:16])  # [block, kv_heads, off, D]
    torch.testing.assert_close(kv[1, 0, 1, :, :4].transpose(0, 1), v[16:])
    assert torch.count_nonzero(kv[1, :, :, :, 4:]) == 0  # rest of the last block untouched
    assert torch.count_nonzero(kv[[0, 2, 4, 5]]) == 0


def test_metadata_build_and_validation(tiny):
    meta = AttentionMetadata.build([3, 2], [15, 0], [[7, 2], [5]], 16)
    # seq0 positions 15,16,17 -> block 7 off 15, block 2 off 0, block 2 off 1; seq1 -> block 5 off 0,1
    assert meta.slot_mapping.tolist() == [7 * 16 + 15, 2 * 16, 2 * 16 + 1, 80, 81]
    assert meta.positions().tolist() == [15, 16, 17, 0, 1]
    assert meta.last_token_indices().tolist() == [2, 4]
    with pytest.raises(ValueError, match="block table has 1 blocks"):
        AttentionMetadata.build([3], [15], [[7]], 16)
    with pytest.raises(ValueError, match="query_len"):
        AttentionMetadata.build([0], [0], [[1]], 16)
    with pytest.raises(ValueError, match="one entry per sequence"):
        AttentionMetadata.build([1, 1], [0], [[1]], 16)

    cfg, model = tiny
    kv = allocate_kv_cache(cfg, 4, 8)  # block size disagrees with the metadata
    with pytest.raises(ValueError, match="kv_cache has shape"):
        model(torch.tensor([1, 2, 3]), torch.tensor([15, 16, 17]), AttentionMetadata.build([3], [15], [[0, 1]], 16), kv)
    kv = allocate_kv_cache(cfg, 4, 16)
    with pytest.raises(ValueError, match="token counts disagree"):
        model(torch.tensor([1, 2]), torch.tensor([0, 1]), AttentionMetadata.build([3], [0], [[0]], 16), kv)
    assert kv_cache_shape(cfg, 4, 16) == (4, 4, 2, 2, 16, 64)


# --------------------------------------------------------------------------- config / sizes


def test_kv_cache_bytes_llama3_8b():
    shape = KNOWN_SHAPES["Llama-3-8B"]
    # meta-llama/Meta-Llama-3-8B config.json: 32 layers, 8 KV heads, hidden 4096 / 32 heads = 128.
    assert (shape.num_hidden_layers, shape.num_key_value_heads, shape.head_dim) == (32, 8, 128)
    assert shape.max_position_embeddings == 8192
    expected = 2 * 32 * 8 * 128 * 2 * 8192
    assert expected == 1_073_741_824
    assert kv_cache_bytes(shape, 8192, dtype="bf16") == expected
    assert kv_cache_bytes(shape, 8192, batch=3, dtype="fp32") == 6 * expected
    assert kv_cache_bytes(shape, 8192, dtype="fp8") == expected // 2
    assert kv_cache_bytes(shape, 8192, dtype="int4") == expected // 4
    assert kv_cache_bytes(shape, 1, dtype="int4") == 2 * 32 * 8 * 128 // 2
    assert shape.kv_bytes_per_token("bf16") == 131072
    assert kv_cache_bytes(shape, 10**23, dtype="bf16") == 131072 * 10**23  # exact past float precision
    with pytest.raises(ValueError, match="unknown KV dtype"):
        kv_cache_bytes(shape, 1, dtype="fp6")


def test_known_shapes_and_resolve(tmp_path):
    assert KNOWN_SHAPES["Llama-3-70B"].num_hidden_layers == 80
    assert KNOWN_SHAPES["Llama-3.1-405B"].num_hidden_layers == 126
    assert KNOWN_SHAPES["Llama-3.1-405B"].max_position_embeddings == 131072
    assert KNOWN_SHAPES["Qwen2-7B"].num_key_value_heads == 4
    assert KNOWN_SHAPES["Mistral-7B"].sliding_window == 4096
    assert resolve_model_shape("tiny") == ModelConfig.tiny()
    assert resolve_model_shape("LLAMA-3-8b") is KNOWN_SHAPES["Llama-3-8B"]
    assert resolve_model_shape("meta-llama/meta-llama-3-70b") is KNOWN_SHAPES["Llama-3-70B"]
    save_tiny_checkpoint(str(tmp_path / "ck"))
    from_dir = resolve_model_shape(str(tmp_path / "ck"))
    assert from_dir.num_hidden_layers == 4 and from_dir.head_dim == 64
    with pytest.raises(ValueError) as err:
        resolve_model_shape("gpt-5")
    for name in ("tiny", "Llama-3-8B", "Qwen2-7B", "Mistral-7B"):
        assert name in str(err.value)


def test_from_hf_dict_fields():
    base = {
        "model_type": "llama",
        "vocab_size": 1000,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "eos_token_id": [7, 9],
        "bos_token_id": 1,
    }
    c = ModelConfig.from_hf_dict(base, "m")
    assert c.head_dim == 8 and c.num_key_value_heads == 8 and c.rope_theta == 10000.0
    assert c.eos_token_id == 7 and c.eos_token_ids == (7, 9)
    assert c.architecture == "llama" and not c.attention_bias and c.model_id == "m"

    old_style = dict(base, rope_theta=500000.0, rope_scaling={
        "type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    })
    c = ModelConfig.from_hf_dict(old_style, "m")
    assert c.rope_theta == 500000.0
    assert c.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)
    new_style = dict(base, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    assert ModelConfig.from_hf_dict(new_style, "m").rope_theta == 1e6
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        ModelConfig.from_hf_dict(dict(base, rope_scaling={"rope_type": "yarn", "factor": 4.0}), "m")

    qwen = ModelConfig.from_hf_dict(dict(base, model_type="qwen2", num_key_value_heads=2), "q")
    assert qwen.architecture == "qwen2" and qwen.attention_bias and qwen.num_key_value_heads == 2
    no_type = {k: v for k, v in base.items() if k != "model_type"}
    assert ModelConfig.from_hf_dict(dict(no_type, architectures=["MistralForCausalLM"]), "x").architecture == "llama"
    with pytest.raises(ValueError, match="'intermediate_size' is missing"):
        ModelConfig.from_hf_dict({k: v for k, v in base.items() if k != "intermediate_size"}, "m")
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        ModelConfig.from_hf_dict(dict(base, num_key_value_heads=3), "m")
    with pytest.raises(ValueError, match="hidden_act"):
        ModelConfig.from_hf_dict(dict(base, hidden_act="gelu"), "m")


def test_tiny_config_defaults():
    c = ModelConfig.tiny()
    assert (c.vocab_size, c.hidden_size, c.intermediate_size) == (384, 512, 1536)
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (4, 8, 2, 64)
    assert (c.bos_token_id, c.eos_token_id, c.eos_token_ids) == (256, 257, (257,))
    assert c.model_id == "kvmesh-tiny-llama-v2" and c.dtype == "float32"
    assert ModelConfig.from_hf_dict(c.to_hf_dict(), c.model_id) == c


# --------------------------------------------------------------------------- loader


def test_random_init_is_seeded(tiny):
    cfg, model = tiny
    _, again = load_model(None, seed=0)
    _, other = load_model(None, seed=1)
    sd, sd2, sd3 = model.state_dict(), again.state_dict(), other.state_dict()
    assert all(torch.equal(sd[k], sd2[k]) for k in sd)
    assert not torch.equal(sd["embed_tokens.weight"], sd3["embed_tokens.weight"])
    w = sd["layers.0.mlp.up_proj.weight"]  # [1536, 512]: N(0, 1/512)
    assert abs(w.std().item() - 512**-0.5) < 0.002 and abs(w.mean().item()) < 0.002
    w = sd["layers.0.mlp.down_proj.weight"]  # [512, 1536]: N(0, 1/1536)
    assert abs(w.std().item() - 1536**-0.5) < 0.002
    assert abs(sd["embed_tokens.weight"].std().item() - 1.0) < 0.02
    assert torch.equal(sd["norm.weight"], torch.ones(cfg.hidden_size))

    # Same weights in a fresh interpreter.
    code = (
        "import torch; from kvmesh.workers.loader import load_model; "
        "_, m = load_model(None, seed=0); "
        "print(repr(float(sum(p.double().sum() for p in m.parameters()))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True,
        env=dict(os.environ, PYTHONPATH=REPO_ROOT),
    ).stdout.strip()
    here = float(sum(p.double().sum() for p in model.parameters()))
    assert float(out) == here


def test_save_tiny_checkpoint_roundtrip_and_shards(tmp_path, tiny):
    cfg, model = tiny
    d = save_tiny_checkpoint(str(tmp_path / "tiny"), seed=0)
    cfg2, model2 = load_model(d)
    assert cfg2.model_id.startswith("tiny@") and len(cfg2.model_id) == len("tiny@") + 12
    ids = _prompt(30, seed=2)
    (a,) = step(model, allocate_kv_cache(cfg, 2, BLOCK), [Seq(ids, 0, [0, 1], all_logits=True)], BLOCK)
    (b,) = step(model2, allocate_kv_cache(cfg2, 2, BLOCK), [Seq(ids, 0, [1, 0], all_logits=True)], BLOCK)
    assert torch.equal(a, b)

    # Split into two shards.
    tensors = load_file(os.path.join(d, "model.safetensors"))
    names = sorted(tensors)
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text((tmp_path / "tiny" / "config.json").read_text())
    save_file({k: tensors[k] for k in names[::2]}, str(sharded / "model-00001-of-00002.safetensors"))
    save_file({k: tensors[k] for k in names[1::2]}, str(sharded / "model-00002-of-00002.safetensors"))
    cfg3, model3 = load_model(str(sharded))
    assert cfg3.model_id != cfg2.model_id  # different files, different cache namespace
    (c,) = step(model3, allocate_kv_cache(cfg3, 2, BLOCK), [Seq(ids, 0, [0, 1], all_logits=True)], BLOCK)
    assert torch.equal(a, c)

    # bf16 load runs and stays close to fp32.
    cfg4, model4 = load_model(d, dtype="bf16")
    assert cfg4.dtype == "bfloat16" and model4.lm_head.weight.dtype == torch.bfloat16
    (e,) = step(model4, allocate_kv_cache(cfg4, 2, BLOCK), [Seq(ids, 0, [0, 1], all_logits=True)], BLOCK)
    assert e.dtype == torch.float32
    assert (e - a).abs().max().item() < 0.05 * a.abs().max().item()
    assert (e.argmax(-1) == a.argmax(-1)).float().mean().item() >= 0.9


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu(tiny):
    cfg, model = tiny
    _, gpu = load_model(None, device="cuda", seed=0)
    ids = _prompt(40, seed=9)
    (cpu_logits,) = step(model, allocate_kv_cache(cfg, 4, BLOCK), [Seq(ids, 0, [2, 0, 3], all_logits=True)], BLOCK)
    kv = allocate_kv_cache(cfg, 4, BLOCK, device="cuda")
    meta = AttentionMetadata.build([40], [0], [[2, 0, 3]], BLOCK, device="cuda")
    with torch.inference_mode():
        out = gpu(torch.tensor(ids, device="cuda"), meta.positions(), meta, kv, torch.arange(40, device="cuda"))
    assert out.device.type == "cuda"
    assert (out.cpu() - cpu_logits).abs().max().item() < 1e-3


def _write_config(d, **overrides):
    cfg = ModelConfig.tiny().to_hf_dict()
    cfg.update(overrides)
    (d / "config.json").write_text(json.dumps(cfg))


def test_loader_errors(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"config\.json not found"):
        load_model(str(empty))

    bad_type = tmp_path / "gpt2"
    bad_type.mkdir()
    _write_config(bad_type, model_type="gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match=r"config\.json.*'model_type' is 'gpt2'.*llama, mistral, qwen2"):
        load_model(str(bad_type))

    missing_field = tmp_path / "nofield"
    missing_field.mkdir()
    cfg = ModelConfig.tiny().to_hf_dict()
    del cfg["num_hidden_layers"]
    (missing_field / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="'num_hidden_layers' is missing"):
        load_model(str(missing_field))

    no_weights = tmp_path / "noweights"
    no_weights.mkdir()
    _write_config(no_weights)
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_model(str(no_weights))

    d = save_tiny_checkpoint(str(tmp_path / "ck"))
    path = os.path.join(d, "model.safetensors")
    tensors = load_file(path)
    broken = dict(tensors)
    del broken["model.layers.2.mlp.up_proj.weight"]
    broken["model.layers.9.extra.weight"] = torch.zeros(2)
    save_file(broken, path)
    with pytest.raises(ValueError) as err:
        load_model(d)
    msg = str(err.value)
    assert "missing tensors: model.layers.2.mlp.up_proj.weight" in msg
    assert "unexpected tensors: model.layers.9.extra.weight" in msg

    reshaped = dict(tensors)
    reshaped["model.norm.weight"] = torch.ones(7)
    save_file(reshaped, path)
    with pytest.raises(ValueError, match=r"'norm.weight' has shape \(7,\), expected \(512,\)"):
        load_model(d)

    # every layer's MLP mis-shaped (an edited intermediate_size): a few named, the rest counted
    wide = {k: (torch.zeros(v.shape[0] + 1, *v.shape[1:]) if ".mlp." in k else v) for k, v in tensors.items()}
    save_file(wide, path)
    with pytest.raises(ValueError) as err:
        load_model(d)
    msg = str(err.value)
    n = sum(".mlp." in k for k in tensors)
    assert msg.count("has shape") == 4 and f"and {n - 4} more mis-shaped tensors" in msg, msg


# --------------------------------------------------------------------------- tokenizers


def test_byte_tokenizer():
    tok = ByteTokenizer()
    text = "héllo ✓ kv"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids + [256, 257, 300]) == text
    assert tok.decode([0xE2, 0x9C]) == "\ufffd"  # truncated UTF-8 sequence is replaced
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_ids) == (384, 256, (257,))
    with pytest.raises(ValueError):
        ByteTokenizer(vocab_size=384, eos=400)


def test_load_tokenizer_prefers_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"[UNK]": 0, "<eos>": 1, "hello": 2, "paged": 3, "cache": 4}
    raw = RawTokenizer(WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = Whitespace()
    raw.add_special_tokens(["<eos>"])
    raw.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 4]}))
    cfg = ModelConfig.from_hf_dict(dict(ModelConfig.tiny().to_hf_dict(), eos_token_id=1, bos_token_id=None), "t")

    tok = load_tokenizer(str(tmp_path), cfg)
    assert isinstance(tok, HFTokenizer)
    assert tok.encode("hello paged cache zzz") == [2, 3, 4, 0]
    assert tok.decode([2, 1, 3]) == "hello paged"
    assert tok.eos_token_ids == (1, 4) and tok.vocab_size == 5

    fallback = load_tokenizer(str(tmp_path / "nope"), ModelConfig.tiny())
    assert isinstance(fallback, ByteTokenizer) and fallback.eos_token_ids == (257,)
    assert isinstance(load_tokenizer(None, ModelConfig.tiny()), ByteTokenizer)


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_batched_greedy_decode_matches_transformers_token_for_token(tmp_path, kind):
    """Ragged prompts prefilled in one step, then decoded together (batched paged decode,
    padded block tables, sliding window for Mistral): every greedy token equals HF's in fp32."""
    hf = _hf_reference(kind)
    hf.save_pretrained(str(tmp_path), safe_serialization=True)
    cfg, model = load_model(str(tmp_path))
    prompts = [_prompt(n, seed=30 + n, vocab=cfg.vocab_size) for n in (23, 40, 9, 17)]
    steps = 8
    expected = []
    for ids in prompts:
        seq = list(ids)
        with torch.no_grad():
            for _ in range(steps):
                seq.append(int(hf(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
        expected.append(seq[len(ids):])

    kv = allocate_kv_cache(cfg, 32, BLOCK)
    tables = [[3, 9, 1], [0, 5, 12, 7], [30, 2], [8, 21]]
    logits = step(model, kv, [Seq(ids, 0, t) for ids, t in zip(prompts, tables)], BLOCK)
    got = [[int(lg[-1].argmax())] for lg in logits]
    for _ in range(steps - 1):
        seqs = [Seq([g[-1]], len(ids) + len(g) - 1, t) for ids, g, t in zip(prompts, got, tables)]
        for g, lg in zip(got, step(model, kv, seqs, BLOCK)):
            g.append(int(lg[-1].argmax()))
    assert got == expected


def test_packed_weights_follow_the_weights():
    """`PackedWeights` (oneDNN-prepacked bf16 linears of the fused forward) gives F.linear's
    products, with and without bias, and repacks when a weight is edited in place or
    replaced: a stale packed copy would silently compute with old weights."""
    from kvmesh.workers.model import PackedWeights, _can_pack

    if not _can_pack():
        pytest.skip("this torch has no oneDNN weight prepacking")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(37, 64, generator=g).bfloat16()
    w = torch.randn(96, 64, generator=g).bfloat16()
    b = torch.randn(96, generator=g).bfloat16()
    packs = PackedWeights()

    def close(a, ref):  # within one bf16 rounding of the reference
        return ((a.float() - ref.float()).abs() <= ref.float().abs() * 2.0 ** -7 + 1e-3).all()

    w2 = torch.randn(96, 64, generator=g).bfloat16()
    with torch.inference_mode():
        assert close(packs.linear("p", x, w), F.linear(x, w))
        assert close(packs.linear("pb", x, w, b), F.linear(x, w, b))
        w.mul_(-2)  # in place: the version counter moves
        assert close(packs.linear("p", x, w), F.linear(x, w))
        assert close(packs.linear("p", x, w2), F.linear(x, w2))  # another tensor in the slot
        w3 = torch.randn(96, 64, generator=g).bfloat16()  # an inference tensor: not packed, still right
        assert torch.equal(packs.linear("p", x, w3), F.linear(x, w3))
        assert torch.equal(packs.linear("p", x, w2, packed=False), F.linear(x, w2))  # the plain path
        xf = x.float()  # not bf16: plain F.linear
        assert torch.equal(packs.linear("f", xf, w.float()), F.linear(xf, w.float()))

    # a Parameter whose .data is replaced keeps its id and version; the held weight keeps the
    # new tensor from reusing the old address, so the key still changes
    param = torch.nn.Parameter(torch.randn(96, 64, generator=g).bfloat16(), requires_grad=False)
    for _ in range(6):
        with torch.inference_mode():
            assert close(packs.linear("param", x, param), F.linear(x, param))
        param.data = torch.randn(96, 64, generator=g).bfloat16()  # twice: the second may land
        param.data = torch.randn(96, 64, generator=g).bfloat16()  # where the packed one was
    # an edit through .data bypasses every version counter: seen after clear()
    with torch.inference_mode():
        before = packs.linear("param", x, param)
        param.data.copy_(torch.zeros(96, 64))
        packs.clear()
        after = packs.linear("param", x, param)
    assert before.abs().sum() > 0 and torch.equal(after, torch.zeros_like(after))


def test_a_saved_checkpoint_is_readable_as_any_new_file_is(tmp_path):
    """The weights get the umask's mode as config.json does, not safetensors' owner-only 0600."""
    import os
    import stat

    from kvmesh.workers.loader import save_tiny_checkpoint

    old = os.umask(0o022)
    try:
        save_tiny_checkpoint(str(tmp_path))
    finally:
        os.umask(old)
    modes = {name: stat.S_IMODE((tmp_path / name).stat().st_mode) for name in ("model.safetensors", "config.json")}
    assert modes == {"model.safetensors": 0o644, "config.json": 0o644}
