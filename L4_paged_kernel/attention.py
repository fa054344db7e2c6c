"""L4's attention step: write the new K/V by slot (as in L3), then let a kernel read the blocks in place.

L3 looped over the sequences of the batch and gathered each one's history into a fresh contiguous
copy (``index_select`` + ``flatten``) before calling dense attention. That loop is gone: one call
hands the kernel the whole flat batch with the block tables, context lengths and query offsets, and
the kernel walks every sequence's blocks where they lie in the pool.

``ForwardMeta`` is L3's, unchanged: it already says everything a kernel needs.

``kernel`` is ``paged_attention`` (``paged_attention.py``), the readable reference, unless the engine
passes one of its fast paths (``fast/``: split-KV, the C++ and Triton kernels), which take the same
arguments. Whichever it is, it reads the pool and the step's metadata on their device.

Left out on purpose: choosing a kernel per batch shape (a GPU engine picks a decode or a prefill
kernel).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cache import KvPool
from .paged_attention import paged_attention


@dataclass
class ForwardMeta:
    """Where one forward call over a flat batch writes and reads K/V.

    The batch holds the new tokens of B sequences back to back: sequence i owns rows cu_q_lens[i] ..
    cu_q_lens[i + 1] - 1, which are the last of its context_lens[i] positions. Example: the first
    3-token chunk of a new prompt and one decode token of a sequence with 20 cached positions:
    positions [0, 1, 2, 20], cu_q_lens [0, 3, 4], context_lens [3, 21], logits_at [3] (the chunk
    does not end its prompt, so it needs no logits).
    """

    positions: torch.Tensor  # (T,) int64: position of each new token within its sequence
    slot_mapping: torch.Tensor  # (T,) int64: slot each new token's K/V is WRITTEN to
    block_tables: torch.Tensor  # (B, max_blocks) int64: each sequence's blocks, padded with -1
    context_lens: torch.Tensor  # (B,) int64: positions each sequence attends over, new ones included
    cu_q_lens: torch.Tensor  # (B + 1,) int64: offsets of each sequence's rows in the batch
    logits_at: torch.Tensor  # (N,) int64: rows whose next token is wanted (a sequence's last known token)


def attention(
    pool: KvPool,
    meta: ForwardMeta,
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kernel=paged_attention,
) -> torch.Tensor:
    """q: (T, H, D), k/v: (T, H_kv, D) for the new tokens of every sequence, packed. Returns (T, H, D)."""
    pool.set_kv(layer, meta.slot_mapping, k, v)
    return kernel(
        q,
        pool.k[layer],  # (num_blocks, block_size, H_kv, D): the pool itself, not a copy
        pool.v[layer],
        meta.block_tables,  # (B, max_blocks)
        meta.context_lens,  # (B,)
        meta.cu_q_lens,  # (B + 1,)
    )
