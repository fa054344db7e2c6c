"""L6's KV storage: every layer's pages in one array, ``kv_pages[L, P, page_size, 2 * H_kv, D]``, K and V
interleaved.

Within a token's row the heads alternate ``k0, v0, k1, v1, ...`` (Levanter's layout): one page read
brings a head's K and V together. The model runs its layers as one ``scan`` (``kvcourse/jax_model.py``)
and carries the cache through it, so a layer's ``attend`` gets its index as a traced number and cannot
pick its pool out of a Python tuple. The engine hands the model a flat view instead, ``(L * P,
page_size, 2 * H_kv, D)`` (a reshape, no copy), in which layer l's page p is page ``l * P + p``, and
``attention.paged_attend`` shifts each layer's page table by ``l * P``: the kernels see one pool.

In place or copied: XLA writes a buffer in place only when it can prove nothing else needs the old
value, and otherwise copies the whole buffer first, silently. The cache as the scan's input and output
(each layer's slice in, the updated slices stacked out) builds a new cache every call; a carry kept as
(L, P, ...) and viewed flat inside each layer was copied at every layer (chapter, section 4,
measured). As the scan's carry, in the shape the kernels read, it is one buffer that each layer
writes and hands on: a batch-1 decode step costs the same with 128 pages as with 2,048.

The write is one vectorized scatter: every new token's (K, V) row goes to its flat destination
``page * page_size + slot`` (``PageBatchInfo.new_token_dests``) in a single ``.at[].set``. Levanter
first wrote tokens one at a time in a ``fori_loop`` of ``dynamic_update_slice``s; the scatter is the
same result with one op. INVALID destinations (padding tokens) are dropped.

Left out on purpose: quantized KV, and donation/aliasing tricks beyond what ``jit`` does by itself.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def init_kv_pages(num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int):
    """All-zero pages for every layer: one (L, P, page_size, 2 * H_kv, D) fp32 array."""
    return jnp.zeros((num_layers, num_pages, page_size, 2 * num_kv_heads, head_dim), jnp.float32)


def interleave_kv(k: jax.Array, v: jax.Array) -> jax.Array:
    """(T, H_kv, D) K and V -> (T, 2 * H_kv, D) rows ``k0, v0, k1, v1, ...``.

    Example with H_kv=2, D=1: k = [[[1], [2]]], v = [[[5], [6]]] -> [[[1], [5], [2], [6]]].
    """
    n_tok, n_kv, d = k.shape
    return jnp.stack([k, v], axis=2).reshape(n_tok, 2 * n_kv, d)


def update_kv(kv_pages: jax.Array, dests: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Write each new token's K/V into a pool, all tokens in one scatter.

    kv_pages: (P, page_size, 2 * H_kv, D); dests: (T,) flat destinations, INVALID = skip; k, v:
    (T, H_kv, D). Returns the updated pool.
    """
    n_pages, ps = kv_pages.shape[:2]
    flat = kv_pages.reshape(n_pages * ps, *kv_pages.shape[2:])  # (P * page_size, 2 * H_kv, D)
    where = jnp.where(dests >= 0, dests, n_pages * ps)  # (T,) INVALID -> out of range -> dropped
    return flat.at[where].set(interleave_kv(k, v), mode="drop").reshape(kv_pages.shape)


def copy_page(kv_pages: jax.Array, src: jax.Array, dst: jax.Array) -> jax.Array:
    """Copy page ``src`` to page ``dst`` in every layer (a clone's private last page); INVALID dst = no-op.

    kv_pages: (L, P, page_size, 2 * H_kv, D).
    """
    n_pages = kv_pages.shape[1]
    to = jnp.where(dst >= 0, dst, n_pages)  # INVALID -> out of range -> dropped
    return kv_pages.at[:, to].set(kv_pages[:, jnp.maximum(src, 0)], mode="drop")
