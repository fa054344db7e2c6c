"""L2's KV storage: one token-flat pool per layer, handed out to requests in fixed-size blocks.

Shape per layer: (num_slots, H_kv, D) with num_slots = num_blocks * block_size. Block b is the run of
slots b * block_size .. b * block_size + block_size - 1. A request owns a list of blocks, in position
order, and the K/V of its token t live in

    slot = blocks[t // block_size] * block_size + t % block_size

so with block_size 4 and blocks [2, 0], positions 0..5 live in slots 8, 9, 10, 11, 0, 1.

- ``KvPool``: the tensors; it knows nothing about who owns which slot;
- ``BlockAllocator``: the free list of block ids, one for the whole pool;
- ``Request``: a request's tokens, its blocks and the slot of every position it has reserved;
- ``ForwardMeta``: what one forward call needs: where to write the new K/V, where to read history;
- ``reserve()``: grow a request's blocks as the request grows.

Left out on purpose (and the stage that adds it):
- the engine still runs one request at a time (L3 runs many at once, which is where paging pays off);
- reading the history gathers every slot one by one (``kv_indices``), a copy per layer and step (L3
  gathers whole blocks through a block table; L4 reads the blocks where they lie);
- a request keeps one slot per position; L3 keeps only the block table and computes slots from it;
- blocks are never shared between requests (L5 adds refcounts and a prefix cache).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` positions: ceil(num_tokens / block_size).

    Examples with block_size 16: 1 -> 1, 16 -> 1, 17 -> 2, 0 -> 0.
    """
    return -(-num_tokens // block_size)


class OutOfBlocks(RuntimeError):
    """The free list is shorter than an allocation needs. The allocator is left exactly as it was."""

    def __init__(self, needed: int, free: int):
        super().__init__(f"out of KV blocks: need {needed}, only {free} free")
        self.needed = needed
        self.free = free


class BlockAllocator:
    """The free list of block ids 0 .. num_blocks - 1, shared by every request.

    Example: ``a = BlockAllocator(4, block_size=16)``; ``a.alloc_blocks(3) -> [0, 1, 2]``;
    ``a.free([1])``; ``a.alloc_blocks(2) -> [3, 1]`` (a freed block goes to the back of the list).
    """

    def __init__(self, num_blocks: int, block_size: int):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.owned: set[int] = set()  # handed out and not freed yet

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def alloc_blocks(self, n: int) -> list[int]:
        """Take ``n`` blocks off the front of the free list; if fewer are free, raise ``OutOfBlocks``
        and take none."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self.free_blocks):
            raise OutOfBlocks(needed=n, free=len(self.free_blocks))
        blocks = [self.free_blocks.popleft() for _ in range(n)]
        self.owned.update(blocks)
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Put ``blocks`` back at the end of the free list.

        Every id is checked before anything changes: an id outside the pool or a block that is not
        handed out (a double free) raises ValueError naming it, and nothing is freed.
        """
        seen = set()
        for b in blocks:
            if b not in range(self.num_blocks):
                raise ValueError(f"block {b!r} is not in this pool (ids 0..{self.num_blocks - 1})")
            if b not in self.owned or b in seen:
                raise ValueError(f"block {b} is already free (double free)")
            seen.add(b)
        self.owned.difference_update(blocks)
        self.free_blocks.extend(blocks)

    def check_invariants(self, owners: Iterable[Iterable[int]] | None = None) -> None:
        """Raise AssertionError unless the books balance.

        Always: the free list holds no id twice and only ids of this pool; no block is both free and
        handed out; free + handed out = every block (nothing leaked). Given ``owners`` (the block list
        of every live request): no block has two owners, and together they hold exactly the blocks
        handed out.
        """
        every = set(range(self.num_blocks))
        free = set(self.free_blocks)
        assert len(free) == len(self.free_blocks), f"an id is twice in the free list {list(self.free_blocks)}"
        assert free <= every, f"free list holds ids outside the pool: {sorted(free - every)}"
        assert not free & self.owned, f"blocks both free and owned: {sorted(free & self.owned)}"
        assert free | self.owned == every, f"blocks leaked: {sorted(every - free - self.owned)}"
        if owners is not None:
            held = [b for blocks in owners for b in blocks]
            assert len(held) == len(set(held)), f"a block has two owners: {sorted(held)}"
            assert set(held) == self.owned, f"requests hold {sorted(held)}, handed out {sorted(self.owned)}"


class KvPool:
    """Per-layer K and V slots, each (num_layers, num_slots, H_kv, D), fp32, zero-initialised.

    It knows nothing about which slots belong to whom: the allocator and the requests keep those books.
    """

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int):
        self.k = torch.zeros(num_layers, num_slots, num_kv_heads, head_dim)  # (L, num_slots, H_kv, D)
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
        """Bytes reserved, whether or not they hold tokens."""
        return self.k.nbytes + self.v.nbytes


@dataclass
class Request:
    """One request as the L2 engine tracks it."""

    prompt_ids: list[int]
    blocks: list[int] = field(default_factory=list)  # owned block ids, in position order
    slot_indices: list[int] = field(default_factory=list)  # slot of every reserved position
    cur_len: int = 0  # positions 0 .. cur_len - 1 have their K/V in the pool
    output_ids: list[int] = field(default_factory=list)  # generated tokens; the newest is not cached yet


@dataclass
class ForwardMeta:
    """Where one forward call writes and reads K/V: one request, its whole prompt or one new token."""

    positions: torch.Tensor  # (T,) int64: position of each new token
    slot_mapping: torch.Tensor  # (T,) int64: slot each new token's K/V is WRITTEN to
    kv_indices: torch.Tensor  # (S,) int64: slots of positions 0 .. S-1, READ back for attention
    is_prefill: bool  # True: the prompt from position 0 (T = S); False: the newest token (T = 1)


def reserve(req: Request, alloc: BlockAllocator, target_len: int) -> None:
    """Grow ``req.blocks`` and ``req.slot_indices`` until positions 0 .. target_len - 1 have slots.

    A block is allocated only when a position falls past the last one. With block_size 4, a request
    ``a`` holding blocks [0], another holding [1], and the free list 2, 3, ...:

        reserve(a, alloc, 4) -> a.blocks [0]      (4 positions fit in one block; nothing allocated)
        reserve(a, alloc, 6) -> a.blocks [0, 2]   a.slot_indices [0, 1, 2, 3, 8, 9, 10, 11]

    If the free list is too short, ``OutOfBlocks`` is raised and ``req`` is left as it was.
    """
    missing = blocks_needed(target_len, alloc.block_size) - len(req.blocks)
    if missing > 0:
        new = alloc.alloc_blocks(missing)
        req.blocks.extend(new)
        for b in new:
            req.slot_indices.extend(range(b * alloc.block_size, (b + 1) * alloc.block_size))
