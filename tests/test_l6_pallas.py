"""L6 Pallas kernel, in TPU interpret mode on CPU: == dense attention == the JAX reference == HF.

No TPU here: every call runs under ``pltpu.force_tpu_interpret_mode()`` with ``interpret=False``, so it is
the context manager that makes the kernel run on CPU (the engine test relies on the kernel's default,
``interpret=None``, which picks interpret mode off-TPU).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from kvcourse.harness.reference import hf_greedy
from L6_tpu_jax import attention, pallas_attention
from L6_tpu_jax.engine import Engine
from L6_tpu_jax.kv_cache import interleave_kv

H_KV, D = 2, 8
CONTEXT_LENS = [1, 9, 17, 24, 5]
Q_LENS = [1, 9, 1, 7, 5]  # decode, whole prefill, decode across pages, a chunk mid-sequence, prefill


def random_batch(
    rng, g, page, context_lens=CONTEXT_LENS, q_lens=Q_LENS, num_pages=40, per_seq=7, d=D, pad_seqs=2
):
    """Random K/V on shuffled pages, 2 unused sequence slots and 3 padding query rows.

    Returns the kernel's arguments as a tuple and each sequence's dense (k, v).
    """
    order = rng.permutation(num_pages)
    kv_pages = np.full((num_pages, page, 2 * H_KV, d), 1e3, np.float32)  # stale garbage: never read
    page_indices = np.full((len(context_lens) + pad_seqs, per_seq), -1, np.int32)
    dense, used = [], 0
    for s, n in enumerate(context_lens):
        k, v = rng.standard_normal((2, n, H_KV, d)).astype(np.float32)  # (n, H_kv, D) each
        n_pages = -(-n // page)
        page_indices[s, :n_pages] = order[used : used + n_pages]
        used += n_pages
        rows = np.asarray(interleave_kv(jnp.asarray(k), jnp.asarray(v)))  # (n, 2 * H_kv, D)
        kv_pages[page_indices[s, np.arange(n) // page], np.arange(n) % page] = rows
        dense.append((k, v))
    q = rng.standard_normal((sum(q_lens) + 3, g * H_KV, d)).astype(np.float32)
    cu = np.concatenate([[0], np.cumsum(q_lens), [sum(q_lens)] * pad_seqs]).astype(np.int32)
    lens = np.array(context_lens + [0] * pad_seqs, np.int32)
    args = (q, kv_pages, lens, page_indices, cu, np.int32(len(context_lens)))
    return tuple(map(jnp.asarray, args)), dense


def dense_attention(q, k, v, context_len):
    """float64 causal softmax attention of the last len(q) positions of a sequence, GQA."""
    n_q, n_heads, d = q.shape
    g = n_heads // k.shape[1]
    out = np.zeros((n_q, n_heads, d))
    for i in range(n_q):
        pos = context_len - n_q + i
        for h in range(n_heads):
            s = k[: pos + 1, h // g].astype(np.float64) @ q[i, h] * d**-0.5
            p = np.exp(s - s.max())
            out[i, h] = (p / p.sum()) @ v[: pos + 1, h // g]
    return out


@pytest.mark.parametrize(
    "g, page, q_block, kv_pages_per_block",
    [(1, 4, 4, 2), (3, 4, 16, 16), (3, 16, 2, 1), (1, 16, 5, 3)],
)
def test_pallas_equals_dense_and_reference(g, page, q_block, kv_pages_per_block):
    rng = np.random.default_rng(10 * g + page)
    args, dense = random_batch(rng, g, page)
    blocks = dict(q_block=q_block, kv_pages_per_block=kv_pages_per_block)
    with pltpu.force_tpu_interpret_mode():
        got = np.asarray(pallas_attention.pallas_ragged_paged_attention(*args, **blocks, interpret=False))
    q, cu = np.asarray(args[0]), np.asarray(args[4])
    for s, (k, v) in enumerate(dense):
        expected = dense_attention(q[cu[s] : cu[s + 1]], k, v, CONTEXT_LENS[s])
        np.testing.assert_allclose(got[cu[s] : cu[s + 1]], expected, atol=2e-6, rtol=1e-5)
    assert (got[cu[-1] :] == 0).all()  # padding rows
    np.testing.assert_allclose(got, np.asarray(attention.ragged_paged_attention(*args, **blocks)), atol=2e-6)


def test_block_sizes_are_validated():
    with pytest.raises(ValueError, match="block sizes must be >= 1, got q_block=1, kv_pages_per_block=0"):
        pallas_attention.pallas_ragged_paged_attention(
            jnp.zeros((1, 2, D)), jnp.zeros((2, 4, 2, D)), *[None] * 4, q_block=1, kv_pages_per_block=0
        )


def test_cross_check_with_upstream_kernel():
    """Optional: jax's own ragged_paged_attention (wants head_dim 128 and 128-key KV blocks)."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention as upstream

    d = 128
    context_lens, q_lens = [3, 20], [1, 5]
    rng = np.random.default_rng(1)
    args, _ = random_batch(rng, 2, 16, context_lens, q_lens, num_pages=20, per_seq=8, d=d, pad_seqs=0)
    args = (*args[:5], args[5].reshape(1))  # upstream wants num_seqs of shape (1,)
    with pltpu.force_tpu_interpret_mode():
        try:  # both block sizes explicit: the tuned-size lookup needs a TPU
            theirs = np.asarray(
                upstream(*args, sm_scale=d**-0.5, num_kv_pages_per_block=8, num_queries_per_block=8)
            )
        except Exception as e:  # noqa: BLE001 - any failure of the interpreter is a reason to skip
            last = [line for line in str(e).splitlines() if line.strip()][-1:] or [repr(e)]
            pytest.skip(f"upstream kernel fails in TPU interpret mode here ({type(e).__name__}: {last[0]})")
        ours = np.asarray(
            pallas_attention.pallas_ragged_paged_attention(*args, q_block=8, kv_pages_per_block=8)
        )
    n = sum(q_lens)
    np.testing.assert_allclose(ours[:n], theirs[:n], atol=1e-5)


@pytest.mark.slow
def test_engine_with_pallas_equals_reference_and_hf(tiny_llama_dir):
    prompts, max_new = [[5, 17, 300, 42, 7], list(range(200, 211))], [4, 4]
    expected = [r.tokens for r in hf_greedy(tiny_llama_dir, prompts, max_new)]
    options = dict(
        page_size=4, max_num_seqs=2, max_rounds=4, max_model_len=32, q_block=16, kv_pages_per_block=2
    )
    reference = Engine(tiny_llama_dir, **options).generate(prompts, max_new)
    with pltpu.force_tpu_interpret_mode():
        got = Engine(tiny_llama_dir, attention="pallas", **options).generate(prompts, max_new)
    assert got == reference == expected
