"""Who holds which block: the free list of block ids, one for the whole pool.

A block is ``block_size`` consecutive token positions of the pool. The allocator knows only ids: it
hands them out and takes them back, and never touches a tensor (``cache.py`` holds those).

- ``blocks_needed``: how many blocks hold n tokens;
- ``OutOfBlocksError``: the free list is too short; the allocator is left exactly as it was;
- ``BlockAllocator``: the free list, with a ``check_invariants()`` that the tests run after every step,
  and ``grow()``, which adds blocks to the pool's books when the engine grows the pool.

Left out on purpose (and the stage that adds it): sharing a block between sequences (L5 gives every
block a reference count, and keeps full blocks findable by their tokens: the prefix cache).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` positions: ceil(num_tokens / block_size).

    Examples with block_size 16: 1 -> 1, 16 -> 1, 17 -> 2, 0 -> 0.
    """
    return -(-num_tokens // block_size)


class OutOfBlocksError(RuntimeError):
    """The free list is shorter than an allocation needs. The allocator is left exactly as it was."""

    def __init__(self, needed: int, free: int):
        super().__init__(f"out of KV blocks: need {needed}, only {free} free")
        self.needed = needed
        self.free = free


class BlockAllocator:
    """The free list of block ids 0 .. num_blocks - 1, shared by every sequence.

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

    @property
    def num_used(self) -> int:
        """Blocks held by a sequence."""
        return self.num_blocks - len(self.free_blocks)

    def grow(self, n: int) -> None:
        """Add ``n`` new blocks, ids num_blocks .. num_blocks + n - 1, at the back of the free list.

        Example: ``a = BlockAllocator(4, block_size=16)``; ``a.grow(2)`` -> 6 blocks, free list
        [0, 1, 2, 3, 4, 5].
        """
        self.free_blocks.extend(range(self.num_blocks, self.num_blocks + n))
        self.num_blocks += n

    def alloc_blocks(self, n: int) -> list[int]:
        """Take ``n`` blocks off the front of the free list; if fewer are free, raise ``OutOfBlocksError``
        and take none."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self.free_blocks):
            raise OutOfBlocksError(needed=n, free=len(self.free_blocks))
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
        handed out; free + handed out = every block (nothing leaked). Given ``owners`` (the block table
        of every live sequence): no block has two owners, and together they hold exactly the blocks
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
            assert set(held) == self.owned, f"sequences hold {sorted(held)}, handed out {sorted(self.owned)}"
