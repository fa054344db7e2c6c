"""L4's attention step: write the new K/V by slot (as in L3), then let a kernel read the blocks in place.

The diff from ``L3_block_tensor/attention.py`` is the lesson: the per-request loop that gathered each
history into a fresh contiguous copy (``index_select`` + ``flatten``) and called dense attention is
gone. One call hands the kernel the whole flat batch with the block tables, context lengths and query
offsets, and the kernel walks every sequence's blocks where they lie in the pool.

``kernel`` is ``paged_attention`` (PyTorch, the readable reference) or ``triton_paged_attention`` (the
same algorithm as a Triton program; on this CPU-only machine it runs in Triton's interpreter).
"""

from __future__ import annotations

import torch

from L3_block_tensor.cache import ForwardMeta, KvPool

from .paged_attention import paged_attention


def attention(
    pool: KvPool,
    meta: ForwardMeta,
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    kernel=paged_attention,
    num_splits: int = 1,
) -> torch.Tensor:
    """q: (T, H, D), k/v: (T, H_kv, D) for the new tokens of every request, packed. Returns (T, H, D)."""
    pool.set_kv(layer, meta.slot_mapping, k, v)
    return kernel(
        q,
        pool.k[layer],  # (num_blocks, block_size, H_kv, D): the pool itself, not a copy
        pool.v[layer],
        meta.block_tables,  # (B, max_blocks)
        meta.context_lens,  # (B,)
        meta.cu_q_lens,  # (B + 1,)
        num_splits=num_splits,
    )
