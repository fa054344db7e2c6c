"""The parts of a Llama/Qwen3 decoder that have nothing to do with the KV cache.

Embedding, RMSNorm, RoPE, the q/k/v/o projections, the SwiGLU MLP, the final norm and the (tied or
untied) head live here, written once and shared by every stage. What a stage changes, where K and V
are stored and how attention reads them back, is passed in as the ``attend`` callback of
``Transformer.forward``::

    attend(layer, q, k, v) -> out      # q: (T, H, D), k/v: (T, H_kv, D) after RoPE; out: (T, H, D)

so each lesson directory holds only its cache and its attention, and ``diff`` between stages shows
exactly the idea being taught.

The forward takes a *flat* list of T tokens with their positions. For L1 that is one request's
prompt (prefill) or its one newest token (decode); from L3 on it is several requests packed together,
and ``attend`` knows from the stage's metadata which token belongs to which request.

Everything lives on one device, the one the weights are loaded to (``Transformer.from_dir(dir, device)``):
the forward makes no tensor of its own except on its inputs' device.

Left out on purpose: dropout, training, batch dimensions (tokens are always flat), and any dtype but
fp32. The arithmetic mirrors Hugging Face's (RMSNorm in fp32, rotate-half RoPE, ``F.linear``) so that
greedy outputs match ``transformers`` token for token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from kvcourse.config import ModelConfig

Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Scale each row to unit root-mean-square, then by ``weight`` (HF's LlamaRMSNorm).

    Example: ``rms_norm(tensor([[3., 4.]]), tensor([1., 1.]), 0.0)`` -> ``[[0.8485, 1.1314]]``
    (the row's RMS is sqrt((9 + 16) / 2) = 3.5355).
    """
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


def rope_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """Angular speed of each rotated pair: theta ** (-2i / head_dim) for i < head_dim / 2.

    Computed on the CPU, as HF computes it when it builds a model, whatever device runs the model: a
    GPU's ``pow`` may round the last bit differently. Example: ``rope_inv_freq(4, 100.0)`` -> ``[1.0, 0.1]``.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    return 1.0 / (theta**exponents)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables for the given positions, each (T, head_dim), halves repeated as HF does."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # (T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, D)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each head of ``x`` (T, H, D) by its token's angle (the rotate-half convention).

    Example: with D=2, angle pi/2 turns ``[1, 0]`` into ``[0, 1]``.
    """
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # (T, H, D)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def swiglu_mlp(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)): the Llama feed-forward block. x: (T, hidden)."""
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # (hidden,)
    q_proj: torch.Tensor  # (H * D, hidden)
    k_proj: torch.Tensor  # (H_kv * D, hidden)
    v_proj: torch.Tensor  # (H_kv * D, hidden)
    o_proj: torch.Tensor  # (hidden, H * D)
    post_norm: torch.Tensor  # (hidden,)
    gate_proj: torch.Tensor  # (inter, hidden)
    up_proj: torch.Tensor  # (inter, hidden)
    down_proj: torch.Tensor  # (hidden, inter)
    q_norm: torch.Tensor | None = None  # (D,) Qwen3 only
    k_norm: torch.Tensor | None = None  # (D,) Qwen3 only
    q_bias: torch.Tensor | None = None  # (H * D,) when attention_bias
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None


@dataclass
class Weights:
    embed: torch.Tensor  # (vocab, hidden)
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # (hidden,)
    lm_head: torch.Tensor  # (vocab, hidden); the embedding itself when tied


def load_weights(model_dir: str | Path, cfg: ModelConfig, device: torch.device | str = "cpu") -> Weights:
    """Read an HF Llama/Qwen3 checkpoint's ``*.safetensors`` files into ``Weights``, fp32, on ``device``."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {model_dir}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f, device=str(device)))
    state = {name: t.to(torch.float32) for name, t in state.items()}

    def take(name: str, required: bool = True) -> torch.Tensor | None:
        if name not in state:
            if required:
                raise KeyError(f"weight {name!r} missing from {model_dir}")
            return None
        return state[name]

    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        layers.append(
            LayerWeights(
                input_norm=take(p + "input_layernorm.weight"),
                q_proj=take(p + "self_attn.q_proj.weight"),
                k_proj=take(p + "self_attn.k_proj.weight"),
                v_proj=take(p + "self_attn.v_proj.weight"),
                o_proj=take(p + "self_attn.o_proj.weight"),
                post_norm=take(p + "post_attention_layernorm.weight"),
                gate_proj=take(p + "mlp.gate_proj.weight"),
                up_proj=take(p + "mlp.up_proj.weight"),
                down_proj=take(p + "mlp.down_proj.weight"),
                q_norm=take(p + "self_attn.q_norm.weight", required=cfg.qk_norm),
                k_norm=take(p + "self_attn.k_norm.weight", required=cfg.qk_norm),
                q_bias=take(p + "self_attn.q_proj.bias", required=cfg.attention_bias),
                k_bias=take(p + "self_attn.k_proj.bias", required=cfg.attention_bias),
                v_bias=take(p + "self_attn.v_proj.bias", required=cfg.attention_bias),
                o_bias=take(p + "self_attn.o_proj.bias", required=cfg.attention_bias),
            )
        )
    embed = take("model.embed_tokens.weight")
    head = embed if cfg.tie_word_embeddings else take("lm_head.weight")
    return Weights(embed=embed, layers=layers, final_norm=take("model.norm.weight"), lm_head=head)


class Transformer:
    """A decoder-only forward over a flat batch of tokens, with the KV cache left to ``attend``."""

    def __init__(self, cfg: ModelConfig, weights: Weights):
        self.cfg = cfg
        self.w = weights
        self.device = weights.embed.device
        self.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta).to(self.device)  # (D/2,)

    @classmethod
    def from_dir(cls, model_dir: str | Path, device: torch.device | str = "cpu") -> Transformer:
        cfg = ModelConfig.from_dir(model_dir)
        return cls(cfg, load_weights(model_dir, cfg, device))

    @torch.inference_mode()
    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        attend: Attend,
        logits_at: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run every layer over T flat tokens and return logits.

        token_ids, positions: (T,) int64. ``attend(layer, q, k, v)`` stores this step's K/V wherever the
        stage keeps them and returns attention over the history. ``logits_at`` picks the rows that need
        logits (for example the last token of each request); default: all T rows.
        Returns (len(logits_at) or T, vocab).
        """
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        n_tok = token_ids.shape[0]
        cos, sin = rope_cos_sin(positions, self.inv_freq)  # (T, D) each
        x = F.embedding(token_ids, self.w.embed)  # (T, hidden)
        for layer, lw in enumerate(self.w.layers):
            h = rms_norm(x, lw.input_norm, eps)  # (T, hidden)
            q = F.linear(h, lw.q_proj, lw.q_bias).view(n_tok, cfg.num_heads, cfg.head_dim)  # (T, H, D)
            k = F.linear(h, lw.k_proj, lw.k_bias).view(n_tok, cfg.num_kv_heads, cfg.head_dim)  # (T, H_kv, D)
            v = F.linear(h, lw.v_proj, lw.v_bias).view(n_tok, cfg.num_kv_heads, cfg.head_dim)  # (T, H_kv, D)
            if cfg.qk_norm:
                q = rms_norm(q, lw.q_norm, eps)
                k = rms_norm(k, lw.k_norm, eps)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            o = attend(layer, q, k, v)  # (T, H, D): the only stage-specific line
            x = x + F.linear(o.reshape(n_tok, -1), lw.o_proj, lw.o_bias)  # (T, hidden)
            h = rms_norm(x, lw.post_norm, eps)
            x = x + swiglu_mlp(h, lw.gate_proj, lw.up_proj, lw.down_proj)
        if logits_at is not None:
            x = x[logits_at]  # (N, hidden)
        return F.linear(rms_norm(x, self.w.final_norm, eps), self.w.lm_head)  # (N, vocab)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int) -> torch.Tensor:
    """Dense attention of T new queries over S cached keys, the new tokens being the last T of them.

    q: (T, H, D); k, v: (S, H_kv, D) with S = q_start + T. Query i sits at position q_start + i and
    sees keys 0..q_start + i. GQA: each group of H / H_kv query heads shares one K/V head.
    Returns (T, H, D). Uses the same ``scaled_dot_product_attention`` calls HF makes (``is_causal``
    for a prefill from position 0, no mask for a single decode token), so results match it bitwise.
    """
    n_q, n_k = q.shape[0], k.shape[0]
    qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # (1, H*, T|S, D)
    if n_q == 1 or q_start == 0:
        mask = None
        is_causal = n_q > 1
    else:
        q_pos = torch.arange(q_start, q_start + n_q, device=q.device)[:, None]  # (T, 1)
        mask = torch.arange(n_k, device=q.device)[None, :] <= q_pos  # (T, S) bool: True = may attend
        is_causal = False
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=is_causal, enable_gqa=True)
    return out[0].transpose(0, 1)  # (T, H, D)
