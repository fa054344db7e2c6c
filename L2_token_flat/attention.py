"""L2's attention step: write this step's K/V to the sequence's slots, gather its history by slot, attend.

The same as L1's except where K and V live. L1 wrote positions start.. of a contiguous cache and read
back a prefix; here ``meta.slot_mapping`` names the pool slot of each new token and ``meta.kv_indices``
the slots of positions 0..S-1, which are gathered into a contiguous (S, H_kv, D) copy. The attention
itself (``causal_attention``) does not change: paging is invisible to the math.

``ForwardMeta`` is what one forward call needs to know about where K/V go and come from.

Left out on purpose: several sequences in one call (L3), and reading the history without copying it
(L4 walks the blocks in place).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcourse.model import causal_attention

from .cache import KvPool


@dataclass
class ForwardMeta:
    """Where one forward call writes and reads K/V: one sequence, its whole prompt or one new token."""

    positions: torch.Tensor  # (T,) int64: position of each new token
    slot_mapping: torch.Tensor  # (T,) int64: slot each new token's K/V is WRITTEN to
    kv_indices: torch.Tensor  # (S,) int64: slots of positions 0 .. S-1, READ back for attention
    is_prefill: bool  # True: the prompt from position 0 (T = S); False: the newest token (T = 1)


def attention(
    pool: KvPool, meta: ForwardMeta, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:
    """q: (T, H, D), k/v: (T, H_kv, D) for the positions in ``meta.positions``. Returns (T, H, D)."""
    pool.set_kv(layer, meta.slot_mapping, k, v)
    k_all = pool.k[layer][meta.kv_indices]  # (S, H_kv, D): gathered slot by slot, a copy
    v_all = pool.v[layer][meta.kv_indices]  # (S, H_kv, D)
    start = 0 if meta.is_prefill else k_all.shape[0] - 1  # a decode token is the newest position
    return causal_attention(q, k_all, v_all, q_start=start)
