"""A sequence as the L2 engine tracks it, and ``allocate_slots()``, which grows its blocks as it grows.

``Sequence`` is one request's token stream: its prompt, its generated tokens, the blocks that hold
its K/V (``block_table``) and the slot of every position it holds (``slot_indices``).

Left out on purpose (and the stage that adds it): a life cycle and scheduling fields (L3: waiting,
running, finished), and ``slot_indices`` itself (L3 keeps only the block table and computes slots).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .allocator import BlockAllocator, blocks_needed


@dataclass
class Sequence:
    """One request's token stream as the L2 engine tracks it."""

    prompt_ids: list[int]
    block_table: list[int] = field(default_factory=list)  # owned block ids, in position order
    slot_indices: list[int] = field(default_factory=list)  # slot of every position it holds
    num_computed_tokens: int = 0  # positions 0 .. num_computed_tokens - 1 have their K/V in the pool
    output_ids: list[int] = field(default_factory=list)  # generated tokens; the newest is not cached yet


def allocate_slots(seq: Sequence, allocator: BlockAllocator, target_len: int) -> None:
    """Grow ``seq.block_table`` and ``seq.slot_indices`` until positions 0 .. target_len - 1 have slots.

    A block is allocated only when a position falls past the last one. With block_size 4, a sequence
    ``a`` holding blocks [0], another holding [1], and the free list 2, 3, ...:

        allocate_slots(a, allocator, 4) -> a.block_table [0]      (4 positions fit in one block; nothing allocated)
        allocate_slots(a, allocator, 6) -> a.block_table [0, 2]   a.slot_indices [0, 1, 2, 3, 8, 9, 10, 11]

    If the free list is too short, ``OutOfBlocksError`` is raised and ``seq`` is left as it was.
    """
    block_size = allocator.block_size
    missing = blocks_needed(target_len, block_size) - len(seq.block_table)
    if missing > 0:
        new = allocator.alloc_blocks(missing)
        seq.block_table.extend(new)
        for b in new:
            seq.slot_indices.extend(range(b * block_size, (b + 1) * block_size))
