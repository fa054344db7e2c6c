"""The KV storage from L3 on: a block-tensor pool per layer, indexed by block tables; clones add a copy.

Shape per layer: (num_blocks, block_size, H_kv, D), the same bytes as L2's (num_slots, H_kv, D) with
the block axis made explicit, so that a sequence's block table indexes the pool directly:
``pool.k[layer][block_table]`` is that sequence's blocks, in position order. Slot s, the flat index
L2 used, is row s % block_size of block s // block_size; writes still go by slot, through a flat
(num_blocks * block_size, H_kv, D) view of the same memory.

``KvPool`` is only the tensors: it knows nothing about who owns which block (``allocator.py`` and the
sequences keep those books).

``grow`` adds blocks at the end of the block axis, between runs: the engine grows a pool left to its
default size when a ``generate`` call brings more requests than it holds at once.

``copy_block`` is new: a cloned sample gets its own copy of the parent's last, partial block
(``BlockAllocator.clone`` says which blocks to copy).

Left out on purpose: copying a clone's block lazily, at the first write into it (copy-on-write).
"""

from __future__ import annotations

import torch


class KvPool:
    """Per-layer K and V blocks, each (num_layers, num_blocks, block_size, H_kv, D), fp32, zeroed, on
    ``device``."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        device="cpu",
    ):
        self.block_size = block_size
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)  # (L, N, B, H_kv, D)
        self.k = torch.zeros(shape, device=device)  # (L, N, B, H_kv, D)
        self.v = torch.zeros_like(self.k)  # (L, N, B, H_kv, D)

    def set_kv(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the K/V of T new tokens: token i goes to slot ``slot_mapping[i]`` of ``layer``.

        slot_mapping: (T,) int64; k, v: (T, H_kv, D). Slot s is row s % block_size of block
        s // block_size: with block_size 4, slot 9 is row 1 of block 2.
        """
        self.k[layer].view(-1, *k.shape[1:])[slot_mapping] = k  # into a (N * B, H_kv, D) view, no copy
        self.v[layer].view(-1, *v.shape[1:])[slot_mapping] = v

    def grow(self, num_blocks: int) -> None:
        """Append n = ``num_blocks`` zeroed blocks (ids N .. N + n - 1) to every layer's K and V.

        The blocks that were there keep their ids and contents. The tensors are new (the old ones are
        copied), so call it only when no step is running.
        """
        extra = self.k.new_zeros(self.k.shape[0], num_blocks, *self.k.shape[2:])  # (L, n, B, H_kv, D)
        self.k = torch.cat([self.k, extra], dim=1)  # (L, N + n, B, H_kv, D), on the same device
        self.v = torch.cat([self.v, extra], dim=1)

    def copy_block(self, src: int, dst: int) -> None:
        """Copy block ``src``'s K and V into block ``dst``, in every layer."""
        self.k[:, dst] = self.k[:, src]  # (L, block_size, H_kv, D)
        self.v[:, dst] = self.v[:, src]

    @property
    def nbytes(self) -> int:
        """Bytes of the pool, whether or not they hold tokens."""
        return self.k.nbytes + self.v.nbytes
