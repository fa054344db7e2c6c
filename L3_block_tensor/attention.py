"""L3's attention step over a flat batch: write every new token's K/V by slot, then attend per sequence.

L2 ran one sequence per call and gathered its history slot by slot. Now the T new tokens of B
sequences come back to back, and ``meta.cu_q_lens`` says which rows belong to whom. Writing is the
same scatter by slot. Reading is per sequence: ``index_select`` its blocks by block table,
(n_blocks, block_size, H_kv, D) -> (n_blocks * block_size, H_kv, D), keep the first context_len rows,
and run the same ``causal_attention`` with the sequence's first new position as q_start (0 for a
prompt from the start, the cached length for a decode token or a later prefill chunk).

``ForwardMeta`` now describes ONE flat batch holding the new tokens of several sequences.

Left out on purpose: reading the blocks where they lie. The gather copies every sequence's history in
every layer at every step; L4 replaces it with a kernel that walks the block table in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcourse.model import causal_attention

from .allocator import blocks_needed
from .cache import KvPool


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
    pool: KvPool, meta: ForwardMeta, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:
    """q: (T, H, D), k/v: (T, H_kv, D) for the new tokens of every sequence, packed. Returns (T, H, D)."""
    pool.set_kv(layer, meta.slot_mapping, k, v)
    out = torch.empty_like(q)  # (T, H, D)
    # The loop needs the lengths as Python ints: on a GPU these two reads are trips back to the host, in
    # every layer of every step. L4's kernel takes the tensors as they are.
    cu_q_lens = meta.cu_q_lens.tolist()
    for i, context_len in enumerate(meta.context_lens.tolist()):
        q0, q1 = cu_q_lens[i], cu_q_lens[i + 1]
        table = meta.block_tables[i, : blocks_needed(context_len, pool.block_size)]  # (n_blocks,)
        k_all = pool.k[layer].index_select(0, table).flatten(0, 1)[:context_len]  # (S, H_kv, D): a copy
        v_all = pool.v[layer].index_select(0, table).flatten(0, 1)[:context_len]  # (S, H_kv, D)
        out[q0:q1] = causal_attention(q[q0:q1], k_all, v_all, q_start=context_len - (q1 - q0))
    return out
