"""Who holds which block, now with sharing: reference counts, and full blocks findable by their tokens.

L4's allocator handed each block to one sequence. Here a block may sit in several block tables at
once (a prefix two requests have in common), so:

- ``Block`` keeps the books of one block: ``ref_count`` (how many block tables hold it) and, once
  it is full, its prefix-cache ``hash`` and ``token_ids``;
- ``BlockAllocator.free`` drops one reference; a block returns to the free list only when its count
  reaches 0, and it keeps its hash and tokens there: until it is handed out again, a later request
  with the same tokens can take it back (``alloc_blocks(n, cached=...)``). Freed blocks go to the back
  of the free list and allocation takes from the front, so the cache forgets the least recently
  freed blocks first (LRU-like);
- ``lookup`` / ``register``: the prefix-cache index, key -> block (``prefix_cache.py`` makes the keys);
- ``grow``: more blocks, when the engine grows the pool (L3's, with a ``Block`` for each new id).

``clone``: block tables for n sequences (samples, beams) that continue one sequence, its full blocks
shared and a fresh block each in place of its partial last block (whose K/V the caller copies);
``clone_needs`` says how many free blocks that takes.

``blocks_needed`` and ``OutOfBlocksError`` are L4's, unchanged.

Left out on purpose: a doubly linked free list (taking a cached block back out of the deque is
O(num_blocks) here; vLLM V1's ``FreeKVCacheBlockQueue`` in ``vllm/v1/core/kv_cache_utils.py`` removes
one in O(1)), evicting only blocks nobody can hit any more, and cache salts that keep tenants apart.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable
from collections.abc import Sequence as Ids
from dataclasses import dataclass


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


@dataclass
class Block:
    """The books of one physical block."""

    block_id: int
    ref_count: int = 0  # block tables holding it; 0 = on the free list
    hash: int | None = None  # set once the block is full: its key in the prefix cache
    token_ids: tuple[int, ...] = ()  # the tokens it holds when full, to check a hash hit against


class BlockAllocator:
    """Blocks 0 .. num_blocks - 1 with reference counts, a free list and a prefix-cache index.

    Example with 4 blocks of 2: ``a.alloc_blocks(2) -> [0, 1]`` (ref counts 1, 1); sharing block 0
    with a second sequence makes its count 2; ``a.free([0, 1])`` brings the counts to 1, 0: only
    block 1 goes back to the free list (behind 2 and 3), keeping its hash if it had one.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_blocks: deque[int] = deque(range(num_blocks))  # ref_count 0; the front goes first
        self.hash_to_block: dict[int, int] = {}  # prefix-cache index: key -> a full block holding it

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used(self) -> int:
        """Blocks held by at least one sequence."""
        return self.num_blocks - len(self.free_blocks)

    @property
    def num_shared(self) -> int:
        """Blocks held by more than one sequence."""
        return sum(b.ref_count > 1 for b in self.blocks)

    def grow(self, n: int) -> None:
        """Add ``n`` new blocks, ids num_blocks .. num_blocks + n - 1, at the back of the free list.

        Example: ``a = BlockAllocator(4, block_size=16)``; ``a.grow(2)`` -> 6 blocks, free list
        [0, 1, 2, 3, 4, 5].
        """
        self.blocks += [Block(i) for i in range(self.num_blocks, self.num_blocks + n)]
        self.free_blocks.extend(range(self.num_blocks, self.num_blocks + n))
        self.num_blocks += n

    def alloc_blocks(self, n: int, cached: Ids[int] = ()) -> list[int]:
        """Take a reference on each ``cached`` block (prefix-cache hits), then ``n`` fresh blocks off the
        front of the free list; return them in that order.

        A cached block nobody holds sits on the free list: taking it back uses up a free block too.
        A fresh block forgets the hash and tokens it kept from its last owner. If the free list is
        too short for both, raise ``OutOfBlocksError`` and change nothing.
        """
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        revived = sum(self.blocks[b].ref_count == 0 for b in cached)
        if n + revived > len(self.free_blocks):
            raise OutOfBlocksError(needed=n + revived, free=len(self.free_blocks))
        for b in cached:
            if self.blocks[b].ref_count == 0:
                self.free_blocks.remove(b)
            self.blocks[b].ref_count += 1
        return list(cached) + [self._take_free() for _ in range(n)]

    def _take_free(self) -> int:
        """Hand out the block at the front of the free list, dropping what it cached."""
        block = self.blocks[self.free_blocks.popleft()]
        if block.hash is not None and self.hash_to_block.get(block.hash) == block.block_id:
            del self.hash_to_block[block.hash]
        block.hash, block.token_ids, block.ref_count = None, (), 1
        return block.block_id

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block of a block table; a block nobody holds goes back to the free
        list, keeping its hash and tokens (a later identical prefix can still hit it).

        The table is freed tail first: its last block lands nearest the front of the free list and is
        forgotten before the blocks leading to it (a block is useless to the cache without them).
        Example: table [4, 7, 9], all counts 1, free list [0] -> free list [0, 9, 7, 4].
        Every id is checked before anything changes: an id outside the pool, a block nobody holds or
        an id given twice (a double free) raises ValueError naming it, and nothing is freed.
        """
        seen = set()
        for b in blocks:
            if b not in range(self.num_blocks):
                raise ValueError(f"block {b!r} is not in this pool (ids 0..{self.num_blocks - 1})")
            if self.blocks[b].ref_count == 0 or b in seen:
                raise ValueError(f"block {b} is already free (double free)")
            seen.add(b)
        for b in reversed(blocks):
            self.blocks[b].ref_count -= 1
            if self.blocks[b].ref_count == 0:
                self.free_blocks.append(b)

    def lookup(self, key: int, token_ids: Ids[int]) -> int | None:
        """The cached block with this key, if it really holds ``token_ids`` (else None: a collision)."""
        b = self.hash_to_block.get(key)
        if b is None or self.blocks[b].token_ids != tuple(token_ids):
            return None
        return b

    def register(self, block_id: int, key: int, token_ids: Ids[int]) -> None:
        """Record that block ``block_id`` is full with ``token_ids``, under ``key``. If another block
        holds the same tokens already (two sequences computed them), the newest wins the index."""
        block = self.blocks[block_id]
        block.hash, block.token_ids = key, tuple(token_ids)
        self.hash_to_block[key] = block_id

    def clone(
        self, block_table: list[int], num_tokens: int, n: int
    ) -> tuple[list[list[int]], list[tuple[int, int]]]:
        """Block tables for n more sequences continuing one that holds ``num_tokens`` positions, and the
        block copies the caller must make: ``(tables, [(src, dst), ...])``.

        Every full block is shared (ref_count + n); the last, partial block (if any) gets a fresh block
        per child, into which the caller copies its K/V. Example, block_size 4, a 10-token sequence in
        blocks [3, 5, 8], each with ref_count 1, free list 0, 1, 2:

            clone([3, 5, 8], 10, 2) -> ([[3, 5, 0], [3, 5, 1]], [(8, 0), (8, 1)])
            ref counts: 3 -> 3, 5 -> 3, 8 -> 1 (the parent's own), 0 -> 1, 1 -> 1; free list 2

        This is an eager copy at clone time, not copy-on-write (vLLM v0's block manager, removed with
        the rest of V0 in v0.11.0, shared the partial block too at ``fork`` and copied it at the first
        write into it; vLLM V1 has no fork). Copying now is simpler and safe: only full blocks are
        ever shared, and a sequence only writes past its last token, i.e. into its partial block or
        a new one, so no write can hit a shared block and nothing checks a refcount per write. The
        price is n block copies now, even for a child that stops at once. Needs n free blocks when
        the sequence ends mid-block (none on a boundary); if fewer are free, raise
        ``OutOfBlocksError`` and change nothing.
        """
        if len(block_table) != blocks_needed(num_tokens, self.block_size):
            raise ValueError(f"{len(block_table)} blocks do not hold exactly {num_tokens} tokens")
        full = num_tokens // self.block_size
        partial = block_table[full:]  # [] or [the last block]
        if n * len(partial) > len(self.free_blocks):
            raise OutOfBlocksError(needed=n * len(partial), free=len(self.free_blocks))
        for b in block_table[:full]:
            self.blocks[b].ref_count += n
        tables, copies = [], []
        for _ in range(n):
            fresh = [self._take_free() for _ in partial]
            copies += zip(partial, fresh, strict=True)
            tables.append(block_table[:full] + fresh)
        return tables, copies

    def clone_needs(self, num_tokens: int, n: int) -> int:
        """Free blocks ``clone`` takes for n children of a sequence holding ``num_tokens`` positions: a
        copy of the partial last block each, none on a block boundary. Example, block_size 4:
        ``clone_needs(10, 2) -> 2``, ``clone_needs(8, 2) -> 0``."""
        return n * (num_tokens % self.block_size > 0)

    def check_invariants(self, owners: Iterable[Iterable[int]] | None = None) -> None:
        """Raise AssertionError unless the books balance.

        Always: counts are never negative; the free list holds each block with count 0 exactly once
        and nothing else; only full blocks (with a hash and block_size tokens) are shared; the cache
        index points at blocks holding its keys. Given ``owners`` (the block table of every live
        sequence): no table holds a block twice, and each block's count is the number of tables
        holding it, so with no live sequences every block is free (nothing leaked).
        """
        free = set(self.free_blocks)
        assert len(free) == len(self.free_blocks), f"an id is twice in the free list {list(self.free_blocks)}"
        assert free <= set(range(self.num_blocks)), f"free list holds ids outside the pool: {sorted(free)}"
        for b in self.blocks:
            assert b.ref_count >= 0, f"block {b.block_id} has ref_count {b.ref_count}"
            assert (b.ref_count == 0) == (b.block_id in free), (
                f"block {b.block_id}: ref_count {b.ref_count}, {'' if b.block_id in free else 'not '}on the free list"
            )
            assert (b.hash is None) == (len(b.token_ids) == 0), f"block {b.block_id}: hash without tokens"
            assert b.hash is None or len(b.token_ids) == self.block_size, f"block {b.block_id} is not full"
            assert b.ref_count <= 1 or b.hash is not None, f"partial block {b.block_id} is shared"
        for key, b in self.hash_to_block.items():
            assert self.blocks[b].hash == key, f"cache index points {key} at block {b}, which holds another"
        if owners is not None:
            tables = [list(t) for t in owners]
            assert all(len(set(t)) == len(t) for t in tables), f"a table holds a block twice: {tables}"
            held = Counter(b for t in tables for b in t)
            for b in self.blocks:
                assert held[b.block_id] == b.ref_count, (
                    f"block {b.block_id}: ref_count {b.ref_count}, held by {held[b.block_id]} tables"
                )
