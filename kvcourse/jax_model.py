"""The non-KV parts of a Llama/Qwen3 decoder in JAX: ``kvcourse/model.py`` ported for the L6 engine.

Same checkpoint, same arithmetic: embedding, RMSNorm in fp32, rotate-half RoPE, SwiGLU MLP, final
norm, tied or untied head, Qwen3's per-head q/k norms. The RoPE cos/sin tables are computed once, by
the torch model's own functions, for every position the model allows (XLA's cos/sin differ from
torch's in the last bit, and the difference reaches the logits through every layer). The KV cache is
the one thing that differs from the torch model, because JAX has no side effects: it is a value.
``forward`` hands the whole cache (every layer's) to the ``attend`` callback with the layer's index,
and ``attend`` returns the attention output *and* the updated cache::

    attend(kv, layer, q, k, v) -> (out, kv)   # q: (T, H, D), k/v: (T, H_kv, D) after RoPE; out: (T, H, D)

``kv`` is whatever the caller keeps (L6: a tuple of page pools, one per layer, or one pool holding every
layer's pages when the layers are scanned), or ``None`` for no cache.
``attend`` writes layer ``layer``'s new K/V, reads its history in place, and returns the cache with only
that layer's part changed.

The layers run one of two ways, chosen by the shape of ``Params.layers``:

- a tuple of per-layer weights (``load_params``): a Python loop, unrolled when ``jit`` traces it, so
  the program holds thirty copies of the layer and ``attend`` gets the layer's index as a Python int;
- one ``LayerParams`` whose every field is stacked along a leading layer axis (``stack_layers``): one
  ``jax.lax.scan`` over the stack, so the program holds one layer, run L times, and ``attend`` gets
  the index as a traced int32 scalar. Levanter does this by default (``LlamaConfig.scan_layers =
  True`` in ``src/levanter/models/llama.py``, commit 9263f81e, September 2025).

Same products in the same order, so the same bits (``tests/test_l6_scan.py`` compares the logits).
What each costs (``python -m bench.l6_compile``; L6 chapter, sections 5 and 13): the unrolled program
holds 271 dot products against the scan's 10, and XLA takes longer to compile it (on a GPU also to
autotune each product); in the scan each iteration slices its layer's weights out of the stack, and
XLA's CPU backend copies that slice before its matrix products, one more pass over the 538 MB of
weights per forward. A scanned cache has a trap of its own:
scanning over the cache as an input and stacking each layer's result as an output builds a new
cache every call, so the cache is the scan's carry instead (L6: one pool of every layer's pages).

Every matrix product passes ``precision=HIGHEST``. The default precision, in jax 0.10.2's words
(``jax.lax.Precision``), "On TPU: performs float32 computations in bfloat16" and on a GPU "uses
tensorfloat32 if available (e.g. on A100 and H100 GPUs)", either enough to flip greedy tokens; it "Has
no impact on CPU backends". With HIGHEST the products are fp32 everywhere.

Left out on purpose: sharding across devices, dtypes other than fp32, and training.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from kvcourse.config import ModelConfig

HIGHEST = jax.lax.Precision.HIGHEST

Attend = Callable[[Any, Any, jax.Array, jax.Array, jax.Array], tuple[jax.Array, Any]]  # layer: int or traced


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LayerParams:
    """One layer's weights. Linear weights are stored transposed, (in, out), so a projection is ``x @ w``."""

    input_norm: jax.Array  # (hidden,)
    q_proj: jax.Array  # (hidden, H * D)
    k_proj: jax.Array  # (hidden, H_kv * D)
    v_proj: jax.Array  # (hidden, H_kv * D)
    o_proj: jax.Array  # (H * D, hidden)
    post_norm: jax.Array  # (hidden,)
    gate_proj: jax.Array  # (hidden, inter)
    up_proj: jax.Array  # (hidden, inter)
    down_proj: jax.Array  # (inter, hidden)
    q_norm: jax.Array | None  # (D,) Qwen3 only
    k_norm: jax.Array | None  # (D,) Qwen3 only
    q_bias: jax.Array | None  # (H * D,) when attention_bias
    k_bias: jax.Array | None  # (H_kv * D,)
    v_bias: jax.Array | None  # (H_kv * D,)
    o_bias: jax.Array | None  # (hidden,)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Params:
    embed: jax.Array  # (vocab, hidden)
    layers: tuple[LayerParams, ...] | LayerParams  # one per layer, or stacked: each field (L, ...)
    final_norm: jax.Array  # (hidden,)
    lm_head: jax.Array  # (hidden, vocab); the embedding transposed when tied
    rope_cos: jax.Array  # (max_positions, D) cos of every position's angles, from the torch model
    rope_sin: jax.Array  # (max_positions, D)


def load_params(model_dir: str | Path, cfg: ModelConfig | None = None) -> tuple[ModelConfig, Params]:
    """Read an HF Llama/Qwen3 checkpoint into fp32 device arrays.

    The names and checks are ``kvcourse.model.load_weights``'s (one loader for both ports); this only
    transposes the linear weights.
    """
    import torch

    from kvcourse.model import load_weights, rope_cos_sin, rope_inv_freq

    cfg = cfg or ModelConfig.from_dir(model_dir)
    w = load_weights(model_dir, cfg)
    linears = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}

    def port(layer) -> LayerParams:  # same field names as kvcourse.model.LayerWeights
        return LayerParams(**{
            name: None if t is None else jnp.asarray(t.numpy().T if name in linears else t.numpy())
            for name, t in vars(layer).items()
        })  # fmt: skip

    cos, sin = rope_cos_sin(
        torch.arange(cfg.max_position_embeddings, device="cpu"),  # (T,) on the host, as the weights
        rope_inv_freq(cfg.head_dim, cfg.rope_theta),
    )
    params = Params(
        embed=jnp.asarray(w.embed.numpy()),
        layers=tuple(port(layer) for layer in w.layers),
        final_norm=jnp.asarray(w.final_norm.numpy()),
        lm_head=jnp.asarray(w.lm_head.numpy().T),
        rope_cos=jnp.asarray(cos.numpy()),
        rope_sin=jnp.asarray(sin.numpy()),
    )
    return cfg, params


def stack_layers(params: Params) -> Params:
    """The same weights with the layers stacked: one ``LayerParams`` whose fields are (L, ...), for the scan.

    Example: 30 layers' ``q_proj`` (576, 576) each -> one ``q_proj`` (30, 576, 576).
    """
    if isinstance(params.layers, LayerParams):
        return params
    return replace(params, layers=jax.tree.map(lambda *ws: jnp.stack(ws), *params.layers))


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Scale each row to unit root-mean-square, then by ``weight`` (HF's LlamaRMSNorm).

    Example: ``rms_norm([[3., 4.]], [1., 1.], 0.0)`` -> ``[[0.8485, 1.1314]]``.
    """
    variance = jnp.mean(x * x, axis=-1, keepdims=True)
    return weight * (x * jax.lax.rsqrt(variance + eps))


def linear(x: jax.Array, w: jax.Array, b: jax.Array | None = None) -> jax.Array:
    """x @ w (+ b) in full fp32. x: (T, in), w: (in, out) -> (T, out)."""
    y = jnp.matmul(x, w, precision=HIGHEST)
    return y if b is None else y + b


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate each head of ``x`` (T, H, D) by its token's angle (rotate-half).

    Example: with D=2, angle pi/2 turns ``[1, 0]`` into ``[0, 1]``.
    """
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)  # (T, H, D)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def swiglu_mlp(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array) -> jax.Array:
    """down(silu(gate(x)) * up(x)). x: (T, hidden) -> (T, hidden)."""
    return linear(jax.nn.silu(linear(x, gate)) * linear(x, up), down)


def forward(
    cfg: ModelConfig,
    params: Params,
    token_ids: jax.Array,
    positions: jax.Array,
    attend: Attend,
    kv_cache: Any = None,
    logits_at: jax.Array | None = None,
) -> tuple[jax.Array, Any]:
    """Run every layer over T flat tokens; return (logits, updated kv_cache).

    token_ids, positions: (T,) int32. ``kv_cache`` (or None) goes whole to ``attend`` with each layer's
    index (a Python int when ``params.layers`` is a tuple, a traced int32 scalar when it is stacked)
    and comes back updated. ``logits_at`` picks the rows that need logits (default: all T).
    Returns ((N, vocab), kv_cache).
    """
    eps, n_tok = cfg.rms_norm_eps, token_ids.shape[0]
    n_heads, n_kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    cos, sin = params.rope_cos[positions], params.rope_sin[positions]  # (T, D) each

    def one_layer(x, kv_cache, lw: LayerParams, i):
        h = rms_norm(x, lw.input_norm, eps)  # (T, hidden)
        q = linear(h, lw.q_proj, lw.q_bias).reshape(n_tok, n_heads, d)  # (T, H, D)
        k = linear(h, lw.k_proj, lw.k_bias).reshape(n_tok, n_kv, d)  # (T, H_kv, D)
        v = linear(h, lw.v_proj, lw.v_bias).reshape(n_tok, n_kv, d)  # (T, H_kv, D)
        if cfg.qk_norm:
            q = rms_norm(q, lw.q_norm, eps)
            k = rms_norm(k, lw.k_norm, eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o, kv_cache = attend(kv_cache, i, q, k, v)  # (T, H, D): the only stage-specific line
        x = x + linear(o.reshape(n_tok, n_heads * d), lw.o_proj, lw.o_bias)  # (T, hidden)
        h = rms_norm(x, lw.post_norm, eps)
        return x + swiglu_mlp(h, lw.gate_proj, lw.up_proj, lw.down_proj), kv_cache

    x = params.embed[token_ids]  # (T, hidden)
    if isinstance(params.layers, LayerParams):  # stacked: one layer compiled, run L times

        def scanned(carry, layer):
            lw, i = layer  # this layer's weights, sliced out of the stack by scan, and its index
            return one_layer(*carry, lw, i), None

        index = jnp.arange(cfg.num_layers, dtype=jnp.int32)  # (L,)
        (x, kv_cache), _ = jax.lax.scan(scanned, (x, kv_cache), (params.layers, index))
    else:
        for i, lw in enumerate(params.layers):  # unrolled while tracing: each layer reads its own weights
            x, kv_cache = one_layer(x, kv_cache, lw, i)
    if logits_at is not None:
        x = x[logits_at]  # (N, hidden)
    return linear(rms_norm(x, params.final_norm, eps), params.lm_head), kv_cache  # (N, vocab)


def causal_self_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Dense causal attention of T tokens over themselves (a whole prompt from position 0), with GQA.

    q: (T, H, D); k, v: (T, H_kv, D). Returns (T, H, D). The cache-free baseline every paged kernel
    is checked against.
    """
    n_tok, n_heads, d = q.shape
    n_kv = k.shape[1]
    qg = q.reshape(n_tok, n_kv, n_heads // n_kv, d)  # (T, H_kv, G, D)
    s = jnp.einsum("qhgd,khd->hgqk", qg, k, precision=HIGHEST) * d**-0.5  # (H_kv, G, T, T)
    mask = jnp.arange(n_tok)[None, :] <= jnp.arange(n_tok)[:, None]  # (T, T) key <= query
    p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
    o = jnp.einsum("hgqk,khd->qhgd", p, v, precision=HIGHEST)  # (T, H_kv, G, D)
    return o.reshape(n_tok, n_heads, d)
