"""L2's KV storage: one token-flat pool per layer, read and written by slot.

Shape per layer: (num_slots, H_kv, D) with num_slots = num_blocks * block_size. Block b is the run of
slots b * block_size .. b * block_size + block_size - 1. A sequence owns a list of blocks (its block
table, ``sequence.py``), in position order, and the K/V of its token t live in

    slot = block_table[t // block_size] * block_size + t % block_size

so with block_size 4 and block table [2, 0], positions 0..5 live in slots 8, 9, 10, 11, 0, 1.

``KvPool`` is only the tensors: it knows nothing about who owns which slot (``allocator.py`` and the
sequences keep those books).

Left out on purpose (and the stage that adds it): the block axis (L3 shapes the pool
(num_blocks, block_size, H_kv, D), so that a block table indexes it directly), and copying a block
(L5, for clones).
"""

from __future__ import annotations

import torch


class KvPool:
    """Per-layer K and V slots, each (num_layers, num_slots, H_kv, D), fp32, zeroed, on ``device``."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int, device="cpu"):
        shape = (num_layers, num_slots, num_kv_heads, head_dim)  # (L, num_slots, H_kv, D)
        self.k = torch.zeros(shape, device=device)  # (L, num_slots, H_kv, D)
        self.v = torch.zeros_like(self.k)  # (L, num_slots, H_kv, D)

    def set_kv(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the K/V of T new tokens: token i goes to slot ``slot_mapping[i]`` of ``layer``.

        slot_mapping: (T,) int64; k, v: (T, H_kv, D). Example: slot_mapping [8, 9, 0] writes the three
        tokens to slots 8, 9 and 0, wherever those are in memory.
        """
        self.k[layer][slot_mapping] = k  # (T, H_kv, D) scattered into (num_slots, H_kv, D)
        self.v[layer][slot_mapping] = v

    @property
    def nbytes(self) -> int:
        """Bytes of the pool, whether or not they hold tokens."""
        return self.k.nbytes + self.v.nbytes
