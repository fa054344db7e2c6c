"""L6's KV storage: one page pool per layer, ``kv_pages[P, page_size, 2 * H_kv, D]``, K and V interleaved.

The engine keeps a tuple of L such pools, one per layer, and the model's ``attend`` callback replaces
layer l's entry with its updated pool. Within a token's row the heads alternate ``k0, v0, k1, v1, ...``
(Levanter's layout, and that of JAX's ``ragged_paged_attention`` kernel): one page read brings a head's
K and V together.

Why a tuple and not one (L, P, ...) array: XLA updates a buffer in place only when nothing else still
reads it. Layer l's attention reads its pool inside a loop; with every layer in one array, layer l+1's
write would land in a buffer that loop had open, so XLA copies the whole stack first, once per layer
per step, and a decode step costs more the bigger the pool (commit bd43f26 left that layout for this
one; chapter, section 5). With one array per layer, each write lands in a buffer nothing else reads.

The write is one vectorized scatter: every new token's (K, V) row goes to its flat destination
``page * page_size + slot`` (``PageBatchInfo.new_token_dests``) in a single ``.at[].set``. Levanter
(its February 2026 copy in marin-community/marin, ``kv_update_unified_prefix``) wrote tokens one at a
time in a ``fori_loop`` of ``dynamic_update_slice``s; the scatter is the same result with one op. INVALID destinations (padding tokens) are dropped.

In place only because the engine donates the pools. ``update_kv`` and ``copy_page`` return new arrays;
inside one jit'd call XLA writes them into the old buffers, but across the call the caller still holds
the old pools, so without donation every call would get fresh output buffers, copy the pools into
them, and hold two copies at its peak. ``Engine.__init__`` (and ``MeshEngine``) jit the prefill and
decode calls with ``donate_argnums=(2,)``, the pools' tuple: the outputs reuse the inputs' buffers,
and the caller's old arrays are deleted (using one again raises; chapter, section 5).

**Scanned layers** (``Engine(scan_layers=True)``, ``kvcourse/jax_model.py``): a scan hands each layer
its index as a traced number, which cannot pick an entry of a Python tuple. Then the tuple holds one
array, every layer's pages stacked, (L, P, page_size, 2 * H_kv, D), which the scan carries whole:
each layer views it flat, (L * P, ...), a reshape, no copy, and writes its pages in place at its own
offset (``attention.paged_attend``).

Left out on purpose: quantized KV.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def init_kv_pages(
    num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, stacked: bool = False
):
    """All-zero pools, one per layer: a tuple of L arrays (P, page_size, 2 * H_kv, D) fp32; ``stacked``:
    a tuple of one array (L, P, page_size, 2 * H_kv, D), for scanned layers."""
    shape = (num_pages, page_size, 2 * num_kv_heads, head_dim)
    if stacked:
        return (jnp.zeros((num_layers, *shape), jnp.float32),)
    return tuple(jnp.zeros(shape, jnp.float32) for _ in range(num_layers))


def interleave_kv(k: jax.Array, v: jax.Array) -> jax.Array:
    """(T, H_kv, D) K and V -> (T, 2 * H_kv, D) rows ``k0, v0, k1, v1, ...``.

    Example with H_kv=2, D=1: k = [[[1], [2]]], v = [[[5], [6]]] -> [[[1], [5], [2], [6]]].
    """
    n_tok, n_kv, d = k.shape
    return jnp.stack([k, v], axis=2).reshape(n_tok, 2 * n_kv, d)


def update_kv(kv_pages: jax.Array, dests: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Write each new token's K/V into one layer's pool, all tokens in one scatter.

    kv_pages: (P, page_size, 2 * H_kv, D); dests: (T,) flat destinations, INVALID = skip; k, v:
    (T, H_kv, D). Returns the updated pool.
    """
    n_pages, ps = kv_pages.shape[:2]
    flat = kv_pages.reshape(n_pages * ps, *kv_pages.shape[2:])  # (P * page_size, 2 * H_kv, D)
    where = jnp.where(dests >= 0, dests, n_pages * ps)  # (T,) INVALID -> out of range -> dropped
    return flat.at[where].set(interleave_kv(k, v), mode="drop").reshape(kv_pages.shape)


def copy_page(kv_pages: tuple[jax.Array, ...], src: jax.Array, dst: jax.Array) -> tuple[jax.Array, ...]:
    """Copy page ``src`` to page ``dst`` in every layer's pool (a clone's private last page); INVALID dst = no-op.

    kv_pages: a tuple of L pools (P, page_size, 2 * H_kv, D), or of one stacked (L, P, ...) pool.
    """
    if kv_pages[0].ndim == 5:  # stacked: the same page of every layer at once
        (pool,) = kv_pages
        to = jnp.where(dst >= 0, dst, pool.shape[1])  # INVALID -> out of range -> dropped
        return (pool.at[:, to].set(pool[:, jnp.maximum(src, 0)], mode="drop"),)
    n_pages = kv_pages[0].shape[0]
    to = jnp.where(dst >= 0, dst, n_pages)  # INVALID -> out of range -> dropped
    return tuple(pool.at[to].set(pool[jnp.maximum(src, 0)], mode="drop") for pool in kv_pages)
