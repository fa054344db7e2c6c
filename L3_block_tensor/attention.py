"""L3's attention step over a flat batch: write every new token's K/V by slot, then attend per request.

L2 ran one request per call and gathered its history slot by slot. Now the T new tokens of B requests
come back to back, and ``meta.cu_q_lens`` says which rows belong to whom. Writing is the same scatter
by slot. Reading is per request: ``index_select`` its blocks by block table, (n_blocks, block_size,
H_kv, D) -> (n_blocks * block_size, H_kv, D), keep the first context_len rows, and run the same
``causal_attention`` with the request's first new position as q_start (0 for a prompt from the start,
the cached length for a decode token or a later prefill chunk).

Left out on purpose: reading the blocks where they lie. The gather copies every request's history in
every layer at every step; L4 replaces it with a kernel that walks the block table in place (the
engine calls this function through ``Engine.attention`` so that it can be swapped).
"""

from __future__ import annotations

import torch

from kvcourse.model import causal_attention

from .cache import ForwardMeta, KvPool, blocks_needed


def attention(
    pool: KvPool, meta: ForwardMeta, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:
    """q: (T, H, D), k/v: (T, H_kv, D) for the new tokens of every request, packed. Returns (T, H, D)."""
    pool.set_kv(layer, meta.slot_mapping, k, v)
    out = torch.empty_like(q)  # (T, H, D)
    cu_q_lens = meta.cu_q_lens.tolist()
    for i, context_len in enumerate(meta.context_lens.tolist()):
        q0, q1 = cu_q_lens[i], cu_q_lens[i + 1]
        table = meta.block_tables[i, : blocks_needed(context_len, pool.block_size)]  # (n_blocks,)
        k_all = pool.k[layer].index_select(0, table).flatten(0, 1)[:context_len]  # (S, H_kv, D): a copy
        v_all = pool.v[layer].index_select(0, table).flatten(0, 1)[:context_len]  # (S, H_kv, D)
        out[q0:q1] = causal_attention(q[q0:q1], k_all, v_all, q_start=context_len - (q1 - q0))
    return out
