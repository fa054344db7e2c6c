"""L6 attention and KV storage: ragged paged attention == dense attention on shuffled random pages."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from L6_tpu_jax.attention import decode_only_paged_attention, ragged_paged_attention
from L6_tpu_jax.kv_cache import copy_page, interleave_kv, update_kv

H, H_KV, D, PAGE = 4, 2, 8, 4


def random_batch(rng, context_lens, q_lens, num_pages=40, per_seq=6):
    """Sequences with random K/V on shuffled pages; returns kernel inputs and dense K/V per sequence."""
    order = rng.permutation(num_pages)
    kv_pages = np.zeros((num_pages, PAGE, 2 * H_KV, D), np.float32)
    page_indices = np.full((len(context_lens), per_seq), -1, np.int32)
    dense, used = [], 0
    for s, n in enumerate(context_lens):
        k = rng.standard_normal((n, H_KV, D)).astype(np.float32)
        v = rng.standard_normal((n, H_KV, D)).astype(np.float32)
        n_pages = -(-n // PAGE)
        page_indices[s, :n_pages] = order[used : used + n_pages]
        used += n_pages
        for p in range(n):
            kv_pages[page_indices[s, p // PAGE], p % PAGE] = np.asarray(
                interleave_kv(k[p : p + 1], v[p : p + 1])
            )[0]
        dense.append((k, v))
    kv_pages[kv_pages == 0] = 1e3  # stale garbage in unwritten rows must never be read
    q = rng.standard_normal((sum(q_lens) + 3, H, D)).astype(np.float32)  # 3 padding rows
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return q, kv_pages, page_indices, cu, dense


def dense_attention(q, k, v, context_len):
    """float64 softmax attention of the last len(q) positions of a sequence, causal, GQA."""
    n_q, g = q.shape[0], H // H_KV
    out = np.zeros((n_q, H, D))
    for i in range(n_q):
        pos = context_len - n_q + i
        for h in range(H):
            s = k[: pos + 1, h // g].astype(np.float64) @ q[i, h] * D**-0.5
            p = np.exp(s - s.max())
            out[i, h] = (p / p.sum()) @ v[: pos + 1, h // g]
    return out


@pytest.mark.parametrize("q_block, kv_pages_per_block", [(1, 2), (16, 16), (3, 1), (5, 4)])
def test_ragged_paged_attention_equals_dense(q_block, kv_pages_per_block):
    rng = np.random.default_rng(q_block * 100 + kv_pages_per_block)
    context_lens = [1, 9, 17, 24, 5]
    q_lens = [1, 9, 1, 7, 5]  # decode, whole prefill, decode across pages, a chunk mid-sequence, prefill
    q, kv_pages, page_indices, cu, dense = random_batch(rng, context_lens, q_lens)
    got = ragged_paged_attention(
        jnp.asarray(q),
        jnp.asarray(kv_pages),
        jnp.asarray(context_lens + [0] * 2, jnp.int32),
        jnp.asarray(np.pad(page_indices, ((0, 2), (0, 0)), constant_values=-1)),
        jnp.asarray(np.pad(cu, (0, 2), mode="edge")),
        jnp.asarray(len(context_lens), jnp.int32),
        q_block=q_block,
        kv_pages_per_block=kv_pages_per_block,
    )
    got = np.asarray(got)
    for s, (k, v) in enumerate(dense):
        expected = dense_attention(q[cu[s] : cu[s + 1]], k, v, context_lens[s])
        np.testing.assert_allclose(got[cu[s] : cu[s + 1]], expected, atol=2e-6, rtol=1e-5)
    assert (got[cu[-1] :] == 0).all()  # padding rows


@pytest.mark.parametrize("kv_pages_per_block", [1, 2, 16])
def test_decode_only_paged_attention_equals_dense(kv_pages_per_block):
    """The decode path (one query per sequence, sequences as a batch axis) against dense attention."""
    rng = np.random.default_rng(kv_pages_per_block)
    context_lens = [1, 9, 17, 24, 4]  # one key, mid-page, across pages, the longest, a full page
    q, kv_pages, page_indices, cu, dense = random_batch(
        rng, context_lens, [1] * len(context_lens)
    )  # 3 padding rows
    got = decode_only_paged_attention(
        jnp.asarray(q),
        jnp.asarray(kv_pages),
        jnp.asarray(context_lens + [24] * 3, jnp.int32),  # padding rows' lengths must not be used
        jnp.asarray(np.pad(page_indices, ((0, 3), (0, 0)), mode="edge")),  # nor their pages
        jnp.asarray(np.pad(cu, (0, 3), mode="edge")),
        jnp.asarray(len(context_lens), jnp.int32),
        kv_pages_per_block=kv_pages_per_block,
    )
    got = np.asarray(got)
    for s, (k, v) in enumerate(dense):
        np.testing.assert_allclose(
            got[s : s + 1], dense_attention(q[s : s + 1], k, v, context_lens[s]), atol=2e-6, rtol=1e-5
        )
    assert (got[len(context_lens) :] == 0).all()  # padding rows


def test_block_sizes_are_validated():
    with pytest.raises(ValueError, match="block sizes must be >= 1, got q_block=0"):
        ragged_paged_attention(
            jnp.zeros((1, H, D)), jnp.zeros((2, PAGE, 2 * H_KV, D)), None, None, None, None, q_block=0
        )


def test_update_kv_is_one_scatter_to_page_and_row():
    k = jnp.arange(3 * H_KV * D, dtype=jnp.float32).reshape(3, H_KV, D)
    v = -k
    pool = jnp.zeros((4, PAGE, 2 * H_KV, D))
    dests = jnp.array([2 * PAGE + 1, -1, 0 * PAGE + 3], jnp.int32)  # page 2 row 1, padding, page 0 row 3
    out = np.asarray(update_kv(pool, dests, k, v))
    np.testing.assert_array_equal(out[2, 1, 0::2], k[0])  # K heads at even rows
    np.testing.assert_array_equal(out[2, 1, 1::2], v[0])  # V heads at odd rows
    np.testing.assert_array_equal(out[0, 3, 0::2], k[2])
    assert np.count_nonzero(out) == np.count_nonzero(out[2, 1]) + np.count_nonzero(out[0, 3])
    jaxpr = str(jax.make_jaxpr(update_kv)(pool, dests, k, v))
    assert jaxpr.count(" scatter[") == 1 and "while" not in jaxpr  # one scatter op, no loop


def test_copy_page_copies_every_layer_and_skips_invalid():
    pool = jnp.arange(2 * 3 * PAGE * 2, dtype=jnp.float32).reshape(2, 3, PAGE, 2, 1)  # (L, P, ps, 2, D)
    out = np.asarray(copy_page(pool, jnp.int32(0), jnp.int32(2)))
    np.testing.assert_array_equal(out[:, 2], np.asarray(pool)[:, 0])
    np.testing.assert_array_equal(np.asarray(copy_page(pool, jnp.int32(-1), jnp.int32(-1))), np.asarray(pool))
