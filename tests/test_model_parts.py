"""The shared, non-KV model parts against Hugging Face's own modules, and weight loading."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from kvcourse.config import ModelConfig
from kvcourse.harness.reference import load_hf_model
from kvcourse.model import Transformer, apply_rope, causal_attention, rms_norm, rope_cos_sin, rope_inv_freq


def test_rms_norm_equals_hf():
    torch.manual_seed(0)
    hf = LlamaRMSNorm(64, eps=1e-5)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(64))
    x = torch.randn(7, 64) * 3
    assert torch.equal(rms_norm(x, hf.weight.detach(), 1e-5), hf(x).detach())


def test_rms_norm_docstring_example():
    out = rms_norm(torch.tensor([[3.0, 4.0]]), torch.tensor([1.0, 1.0]), 0.0)
    assert torch.allclose(out, torch.tensor([[0.8485, 1.1314]]), atol=1e-4)


@pytest.mark.parametrize("theta", [10000.0, 100000.0])
def test_rope_equals_hf(theta):
    cfg = LlamaConfig(hidden_size=576, num_attention_heads=9, head_dim=64, rope_theta=theta)
    hf = LlamaRotaryEmbedding(cfg)
    positions = torch.tensor([0, 1, 5, 17, 300, 2047])
    torch.manual_seed(1)
    q = torch.randn(len(positions), 9, 64)  # (T, H, D)
    k = torch.randn(len(positions), 3, 64)  # (T, H_kv, D)
    cos_hf, sin_hf = hf(q[None], positions[None])  # (1, T, D)
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos_hf, sin_hf)

    inv_freq = rope_inv_freq(64, theta)
    assert torch.equal(inv_freq, hf.inv_freq)
    cos, sin = rope_cos_sin(positions, inv_freq)
    assert torch.equal(cos, cos_hf[0]) and torch.equal(sin, sin_hf[0])
    assert torch.equal(apply_rope(q, cos, sin), q_hf[0].transpose(0, 1))
    assert torch.equal(apply_rope(k, cos, sin), k_hf[0].transpose(0, 1))


def test_rope_quarter_turn():
    cos, sin = rope_cos_sin(torch.tensor([1]), torch.tensor([torch.pi / 2]))
    out = apply_rope(torch.tensor([[[1.0, 0.0]]]), cos, sin)
    assert torch.allclose(out, torch.tensor([[[0.0, 1.0]]]), atol=1e-6)


def test_causal_attention_prefix_matches_masked_reference():
    """A chunk that starts at position 3 sees exactly keys 0..3+i (GQA: 4 query heads over 2 KV heads)."""
    torch.manual_seed(2)
    q, k, v = torch.randn(5, 4, 8), torch.randn(8, 2, 8), torch.randn(8, 2, 8)
    out = causal_attention(q, k, v, q_start=3)
    for i in range(5):
        for h in range(4):
            keys, vals = k[: 3 + i + 1, h // 2], v[: 3 + i + 1, h // 2]
            w = torch.softmax(keys @ q[i, h] / 8**0.5, dim=0)
            assert torch.allclose(out[i, h], w @ vals, atol=1e-5)


def _full_logits(model: Transformer, ids: list[int]) -> torch.Tensor:
    """Logits of every position with no cache: attention over the whole sequence at once."""
    return model.forward(
        torch.tensor(ids), torch.arange(len(ids)), lambda layer, q, k, v: causal_attention(q, k, v, 0)
    )


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen3_dir", "model_dir"])
def test_weights_load_and_forward_matches_hf(fixture, request):
    """Our forward over loaded weights gives HF's logits (Llama and Qwen3 naming, tied and untied heads)."""
    model_dir = request.getfixturevalue(fixture)
    ours = Transformer.from_dir(model_dir)
    hf = load_hf_model(model_dir)
    torch.manual_seed(3)
    ids = torch.randint(0, ours.cfg.vocab_size, (40,)).tolist()
    with torch.inference_mode():
        theirs = hf(torch.tensor([ids])).logits[0]
    mine = _full_logits(ours, ids)
    assert mine.shape == theirs.shape
    assert torch.equal(mine.argmax(-1), theirs.argmax(-1))
    assert (mine - theirs).abs().max().item() < 1e-4


def test_qwen3_config_has_qk_norm(tiny_qwen3_dir, tiny_llama_dir):
    assert ModelConfig.from_dir(tiny_qwen3_dir).qk_norm
    assert not ModelConfig.from_dir(tiny_llama_dir).qk_norm


def test_default_model_config(model_dir):
    cfg = ModelConfig.from_dir(model_dir)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert cfg.hidden_size == 576 and cfg.tie_word_embeddings and cfg.eos_token_ids == (2,)
    assert cfg.rope_theta == 100000.0
    assert cfg.kv_bytes_per_token() == 46080


def test_missing_weight_is_named(tiny_qwen3_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    for f in tiny_qwen3_dir.iterdir():
        if f.suffix != ".safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    state = load_file(tiny_qwen3_dir / "model.safetensors")
    del state["model.layers.1.self_attn.k_norm.weight"]
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(KeyError, match="model.layers.1.self_attn.k_norm.weight"):
        Transformer.from_dir(tmp_path)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "mistral"}, "model_type 'mistral' is not supported"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}, "rope_type 'llama3'"),
    ],
)
def test_unsupported_configs_are_refused(tiny_llama_dir, tmp_path, change, message):
    raw = json.loads((tiny_llama_dir / "config.json").read_text())
    raw.pop("rope_scaling", None)
    raw.update(change)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dir(tmp_path)
