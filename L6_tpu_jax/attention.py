"""L6's attention: write the new K/V into the page pool, then ragged paged attention reads it in place.

``ragged_paged_attention`` is the JAX reference: the algorithm of L4's ``paged_attention.py`` with
static shapes, so it compiles once. Three nested ``fori_loop``s walk the batch's sequences (ragged:
each brings its own number of new queries and its own KV length), each sequence's queries in blocks of
``q_block`` rows, and its pages in blocks of ``kv_pages_per_block`` pages, keeping the online-softmax
state (m, l, acc) per query row::

    for each sequence s, each block of q_block queries, each block of kv_pages_per_block pages:
        s_j = q . K_j * scale, masked to keys <= the query's position (causal) and < context_len
        m_new = max(m, max(s_j));  l = l * exp(m - m_new) + sum(exp(s_j - m_new))
        acc = acc * exp(m - m_new) + exp(s_j - m_new) . V_j;  m = m_new
    out = acc / l

Mixed prefill and decode in one batch is just ragged q lengths: a sequence's new queries are the last
q_len of its context_len tokens (``context_lens``: KV positions each sequence attends over, its new ones
included; L4's name, Levanter's ``kv_lens``). Block sizes decide how much work each loop step does.
Levanter's reference (September 2025 to February 2026) ran 1 query x 2 pages per step and was 3.07x
slower per round (2.29x end to end) than at 16 x 16, its default since (quoted from its refactor notes,
February 2026, a TPU v5p-16; chapter, section 7); they change only the summation order, never which
keys a query sees.

``decode_only_paged_attention`` is the decode fast path: the same result for a batch of one query per
sequence, with the sequences as a batch axis instead of a loop (decode rounds use it with
``attention="reference"``); ``ragged_paged_attention`` stays the one readable reference.
``pallas_attention.py`` is the same algorithm as a Pallas TPU kernel (run on CPU in TPU interpret mode
here).

Left out on purpose: sliding windows, soft-capping, quantized KV, and sharding heads across devices.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvcourse.jax_model import HIGHEST

from .kv_cache import update_kv
from .page_table import INVALID, PageBatchInfo, cdiv


def check_block_sizes(**sizes: int) -> None:
    """Raise ValueError naming every block size unless all are >= 1.

    Example: ``check_block_sizes(q_block=0, kv_pages_per_block=16)`` raises
    ``block sizes must be >= 1, got q_block=0, kv_pages_per_block=16``.
    """
    if min(sizes.values()) < 1:
        raise ValueError("block sizes must be >= 1, got " + ", ".join(f"{k}={v}" for k, v in sizes.items()))


def pad_to_kv_blocks(page_indices: jax.Array, kv_pages_per_block: int) -> jax.Array:
    """Pad each row of a page table with INVALID to a whole number of KV blocks.

    Example: pages per row 5, kv_pages_per_block 2 -> 6 columns, the last one INVALID.
    """
    per_seq = page_indices.shape[1]
    pad = cdiv(per_seq, kv_pages_per_block) * kv_pages_per_block - per_seq
    return jnp.pad(page_indices, ((0, 0), (0, pad)), constant_values=INVALID)


def empty_softmax_state(rows: tuple[int, ...], d: int):
    """(m, l, acc) before any key: m = -inf, l = 0 of shape ``rows``; acc = 0 of shape rows + (d,)."""
    return jnp.full(rows, -jnp.inf), jnp.zeros(rows), jnp.zeros((*rows, d))


def online_softmax_update(m, l, acc, sc, v, pv: str):
    """Fold one KV block's masked scores ``sc`` (..., keys) and values ``v`` into (m, l, acc).

    L4's update in JAX; ``pv`` is the einsum of the block's probabilities with its values. Rows with
    nothing visible yet keep m = -inf and exponentiate against 0 (exp(-inf - -inf) would be NaN).
    """
    m_new = jnp.maximum(m, sc.max(axis=-1))  # running max
    base = jnp.where(jnp.isinf(m_new), 0.0, m_new)  # rows with nothing visible yet stay at 0
    p = jnp.exp(sc - base[..., None])  # masked entries are 0
    alpha = jnp.exp(m - base)  # rescales what was accumulated under the old max
    return m_new, alpha * l + p.sum(axis=-1), alpha[..., None] * acc + jnp.einsum(pv, p, v, precision=HIGHEST)


def ragged_paged_attention(
    q: jax.Array,
    kv_pages: jax.Array,
    context_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    q_block: int = 16,
    kv_pages_per_block: int = 16,
    scale: float | None = None,
) -> jax.Array:
    """Attention of a flat batch of new tokens over their sequences' pages, read in place.

    q: (T, H, D), sequence i's queries at rows cu_q_lens[i]:cu_q_lens[i + 1]; kv_pages: (P, page_size,
    2 * H_kv, D), K/V interleaved, already holding the new tokens; context_lens: (S,) KV length of each
    sequence, new tokens included; page_indices: (S, pages_per_seq), INVALID past the end;
    cu_q_lens: (S + 1,); num_seqs: () valid sequences. Rows past cu_q_lens[num_seqs] come back 0.
    Returns (T, H, D).

    Example, page_size 4: a prefill of 3 new tokens on a fresh sequence and a decode of 1 token whose
    sequence holds 6: context_lens [3, 6], page_indices [[5, -1], [0, 2]], cu_q_lens [0, 3, 4]. Query 0
    sees key 0 of page 5, query 2 keys 0..2; query 3 sees all of page 0 and keys 0..1 of page 2.
    """
    check_block_sizes(q_block=q_block, kv_pages_per_block=kv_pages_per_block)
    n_tok, n_heads, d = q.shape
    ps, n_kv = kv_pages.shape[1], kv_pages.shape[2] // 2
    g = n_heads // n_kv
    scale = d**-0.5 if scale is None else scale
    span = kv_pages_per_block * ps  # keys per KV block
    pages = pad_to_kv_blocks(page_indices, kv_pages_per_block)  # (S, whole KV blocks)
    q_pad = jnp.pad(q, ((0, q_block), (0, 0), (0, 0)))  # (T + q_block, H, D): a block never runs off the end

    def one_seq(s, out):
        q0, q_len, context_len = cu_q_lens[s], cu_q_lens[s + 1] - cu_q_lens[s], context_lens[s]

        def one_q_block(b, out):
            start = q0 + b * q_block
            qs = jax.lax.dynamic_slice_in_dim(q_pad, start, q_block).reshape(
                q_block, n_kv, g, d
            )  # (QB, H_kv, G, D)
            i = b * q_block + jnp.arange(q_block)  # (QB,) query index within the sequence
            q_pos = context_len - q_len + i  # (QB,) absolute positions
            # the block's last query; later keys are all masked
            newest = context_len - q_len + jnp.minimum((b + 1) * q_block, q_len) - 1

            def one_kv_block(j, carry):
                m, l, acc = carry
                blk = jax.lax.dynamic_slice_in_dim(pages[s], j * kv_pages_per_block, kv_pages_per_block)
                kv = kv_pages[jnp.maximum(blk, 0)].reshape(span, 2 * n_kv, d)  # (span, 2 * H_kv, D) in place
                k, v = kv[:, 0::2], kv[:, 1::2]  # (span, H_kv, D) each
                sc = jnp.einsum("qhgd,khd->hgqk", qs, k, precision=HIGHEST) * scale  # (H_kv, G, QB, span)
                k_pos = j * span + jnp.arange(span)  # (span,)
                visible = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < context_len)  # (QB, span)
                sc = jnp.where(visible, sc, -jnp.inf)
                return online_softmax_update(m, l, acc, sc, v, "hgqk,khd->hgqd")

            init = empty_softmax_state((n_kv, g, q_block), d)
            m, l, acc = jax.lax.fori_loop(0, cdiv(newest + 1, span), one_kv_block, init)
            o = acc / jnp.where(l == 0, 1.0, l)[..., None]  # (H_kv, G, QB, D)
            o = o.transpose(2, 0, 1, 3).reshape(q_block, n_heads, d)  # (QB, H, D)
            old = jax.lax.dynamic_slice_in_dim(out, start, q_block)
            o = jnp.where((i < q_len)[:, None, None], o, old)  # rows past this sequence are not ours
            return jax.lax.dynamic_update_slice_in_dim(out, o, start, 0)

        return jax.lax.fori_loop(0, cdiv(q_len, q_block), one_q_block, out)

    out = jax.lax.fori_loop(0, num_seqs, one_seq, jnp.zeros_like(q_pad))
    return out[:n_tok]


def decode_only_paged_attention(
    q: jax.Array,
    kv_pages: jax.Array,
    context_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    kv_pages_per_block: int = 16,
    scale: float | None = None,
) -> jax.Array:
    """The decode fast path: ``ragged_paged_attention`` for a batch where every sequence brings exactly
    one query. ``ragged_paged_attention`` stays the one readable reference; this is the same result,
    computed faster for decode-only batches (the engine's decode rounds).

    Same arguments and result, with row i of q being sequence i's query (cu_q_lens = 0, 1, 2, ...;
    it is not read). With one query per sequence the loop over sequences becomes a batch axis: one
    ``fori_loop`` walks KV blocks, and each step gathers block j of *every* sequence's pages at once,
    (T, kv_pages_per_block, page_size, 2 * H_kv, D), which is what the Pallas grid's parallel sequence
    axis does on a TPU. The loop runs to the longest sequence's last block; shorter ones are masked.
    A query at position context_len - 1 sees every key < context_len, so the causal mask is the length mask.

    Example, page_size 4, one block of 2 pages: context_lens [6, 1], page_indices [[0, 2], [5, -1]]
    -> one step reads pages 0, 2 (6 keys visible) for row 0 and page 5 (1 key) for row 1.
    """
    check_block_sizes(kv_pages_per_block=kv_pages_per_block)
    n_tok, n_heads, d = q.shape
    ps, n_kv = kv_pages.shape[1], kv_pages.shape[2] // 2
    g = n_heads // n_kv
    scale = d**-0.5 if scale is None else scale
    span = kv_pages_per_block * ps  # keys per KV block
    pages = pad_to_kv_blocks(page_indices[:n_tok], kv_pages_per_block)  # (T, whole KV blocks)
    live = jnp.arange(n_tok) < num_seqs  # (T,) rows that are sequences
    context_len = jnp.where(live, context_lens[:n_tok], 0)  # (T,)
    qs = q.reshape(n_tok, n_kv, g, d)  # (T, H_kv, G, D)

    def one_kv_block(j, carry):
        m, l, acc = carry
        blk = jax.lax.dynamic_slice_in_dim(
            pages, j * kv_pages_per_block, kv_pages_per_block, axis=1
        )  # (T, N)
        kv = kv_pages[jnp.maximum(blk, 0)].reshape(n_tok, span, 2 * n_kv, d)  # (T, span, 2 * H_kv, D)
        k, v = kv[:, :, 0::2], kv[:, :, 1::2]  # (T, span, H_kv, D) each
        sc = jnp.einsum("thgd,tkhd->thgk", qs, k, precision=HIGHEST) * scale  # (T, H_kv, G, span)
        visible = j * span + jnp.arange(span)[None, :] < context_len[:, None]  # (T, span)
        sc = jnp.where(visible[:, None, None, :], sc, -jnp.inf)
        return online_softmax_update(m, l, acc, sc, v, "thgk,tkhd->thgd")

    init = empty_softmax_state((n_tok, n_kv, g), d)
    m, l, acc = jax.lax.fori_loop(0, cdiv(jnp.max(context_len), span), one_kv_block, init)
    out = acc / jnp.where(l == 0, 1.0, l)[..., None]  # (T, H_kv, G, D); padding rows stay 0
    return out.reshape(n_tok, n_heads, d)


def paged_attend(info: PageBatchInfo, kernel=ragged_paged_attention):
    """The model's ``attend`` callback for one forward call: store this layer's new K/V, then attend.

    Returns ``attend(kv_pages, layer, q, k, v) -> (out, kv_pages)`` for ``kvcourse.jax_model.forward``.
    Layers unrolled (``layer`` a Python int): kv_pages is the tuple of every layer's pool, and only
    entry ``layer`` changes. Layers scanned (``layer`` the scan's traced index, which cannot pick a
    tuple entry): kv_pages is a tuple of one pool of every layer's pages, (L, P, page_size, 2 * H_kv,
    D), viewed flat, (L * P, ...), where layer l's page p is page ``l * P + p``; the batch's destinations
    and page table are shifted by ``l * P``, so the write and the kernels are the same.

    Example, P = 128, scanned: layer 2's view of page 5 is page 261 of the flat pool; INVALID stays INVALID.
    """

    def attend(kv_pages, layer, q, k, v):
        if isinstance(layer, int):
            pool = update_kv(kv_pages[layer], info.new_token_dests, k, v)  # one scatter for all new tokens
            out = kernel(q, pool, info.seq_lens, info.page_indices, info.cu_q_lens, info.num_seqs)
            return out, kv_pages[:layer] + (pool,) + kv_pages[layer + 1 :]
        (stacked,) = kv_pages  # (L, P, page_size, 2 * H_kv, D)
        first = layer * stacked.shape[1]  # this layer's page 0 in the flat pool
        dests = jnp.where(info.new_token_dests >= 0, info.new_token_dests + first * stacked.shape[2], INVALID)
        pages = jnp.where(info.page_indices >= 0, info.page_indices + first, INVALID)  # (S, pages_per_seq)
        pool = update_kv(stacked.reshape(-1, *stacked.shape[2:]), dests, k, v)  # (L * P, ...): a view
        out = kernel(q, pool, info.seq_lens, pages, info.cu_q_lens, info.num_seqs)
        return out, (pool.reshape(stacked.shape),)

    return attend


def reference_kernel(q_block: int = 16, kv_pages_per_block: int = 16):
    """``ragged_paged_attention`` with these block sizes, ready for ``paged_attend``."""
    return functools.partial(ragged_paged_attention, q_block=q_block, kv_pages_per_block=kv_pages_per_block)


def reference_decode_kernel(kv_pages_per_block: int = 16):
    """``decode_only_paged_attention`` with this block size, ready for ``paged_attend`` in decode rounds."""
    return functools.partial(decode_only_paged_attention, kv_pages_per_block=kv_pages_per_block)
