"""L5's KV storage: L3's block pool, now with blocks shared by reference count.

Shape per layer: (num_blocks, block_size, H_kv, D), as in L3. What changes is who may hold a block:

- ``BlockManager`` replaces L3's ``BlockAllocator``. Every block has a ``ref_count`` (how many
  sequences hold it in their block table), and a full block also has a ``hash`` and its
  ``token_ids``. A block goes back to the free list when its count drops to 0, but keeps its hash
  and tokens there: until the block is handed out again, a later request with the same tokens can
  take it back (the prefix cache). Freed blocks go to the back of the free list and allocation takes
  from the front, so the cache forgets the least recently freed blocks first (LRU-like);
- ``block_hash``: a full block's key, chained from the key of the block before it, so it names the
  whole prefix up to the end of the block, not just the block's own tokens;
- ``match_prefix()``: at admission, the longest run of a request's leading full blocks already in
  the pool; the request shares them and its prefill skips their tokens;
- ``reserve()``: L3's, plus: it shares the blocks ``match_prefix`` found, and registers every block
  the coming step fills under its hash, at once, so that a second request with the same prefix
  admitted in the same step shares these blocks instead of computing duplicates;
- ``BlockManager.fork()``: n more sequences continuing one sequence (parallel sampling). Full blocks
  are shared; the last partial block is copied (``KvPool.copy_block``), so every write a sequence
  makes lands in a block only it holds;
- ``Request``: L3's, plus ``n`` (samples wanted), ``sampling`` and a ``generator`` per sequence, and
  ``sample_index`` (0 for the request itself, 1 .. n-1 for its forks, which share its request_id).

Unchanged from L3 and imported from there: ``blocks_needed``, ``OutOfBlocks``, ``Status``,
``FinishReason``, ``ForwardMeta`` and ``slots()``.

Left out on purpose: a doubly-linked free list (taking a cached block back out of the deque is
O(num_blocks) here; vLLM keeps an O(1) list), evicting only blocks nobody can hit any more, cache
salts that keep tenants apart, and copy-on-write at the first write instead of at fork time (see
``BlockManager.fork``).
"""

from __future__ import annotations

import hashlib
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from kvcourse.sampling import SamplingParams, make_generator
from L3_block_tensor.cache import (  # noqa: F401 (re-exported: L5 code imports them from here)
    FinishReason,
    ForwardMeta,
    OutOfBlocks,
    Status,
    blocks_needed,
    slots,
)
from L3_block_tensor.cache import KvPool as L3KvPool


def block_hash(prev_hash: int | None, token_ids: Sequence[int]) -> int:
    """The prefix-cache key of a full block: sha256 of the previous block's key and this block's
    tokens, cut to 64 bits. The same on every run and machine (Python's ``hash`` is not).

    Examples: ``block_hash(None, [1, 2]) -> 10878768257076693884`` (a first block: no previous
    key), ``block_hash(10878768257076693884, [3, 4]) -> 11438315679022258796``, while
    ``block_hash(None, [3, 4]) -> 3412362716378171258``: the same tokens after another prefix get
    another key, because a block's K/V depend on every token before it.
    """
    text = f"{prev_hash}|{','.join(map(str, token_ids))}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


@dataclass
class Block:
    """The books of one physical block."""

    block_id: int
    ref_count: int = 0  # block tables holding it; 0 = on the free list
    hash: int | None = None  # set once the block is full: its key in the prefix cache
    token_ids: tuple[int, ...] = ()  # the tokens it holds when full, to check a hash hit against


class BlockManager:
    """Blocks 0 .. num_blocks - 1 with reference counts, a free list and a prefix cache of full blocks.

    Example with 4 blocks of 2: ``m.alloc_blocks(2) -> [0, 1]`` (ref counts 1, 1); sharing block 0
    with a second sequence makes its count 2; ``m.free([0, 1])`` brings the counts to 1, 0: only
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

    def alloc_blocks(self, n: int, cached: Sequence[int] = ()) -> list[int]:
        """Take a reference on each ``cached`` block (prefix-cache hits), then ``n`` fresh blocks off the
        front of the free list; return them in that order.

        A cached block nobody holds sits on the free list: taking it back uses up a free block too.
        A fresh block forgets the hash and tokens it kept from its last owner. If the free list is
        too short for both, raise ``OutOfBlocks`` and change nothing.
        """
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        revived = sum(self.blocks[b].ref_count == 0 for b in cached)
        if n + revived > len(self.free_blocks):
            raise OutOfBlocks(needed=n + revived, free=len(self.free_blocks))
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

    def lookup(self, key: int, token_ids: Sequence[int]) -> int | None:
        """The cached block with this key, if it really holds ``token_ids`` (else None: a collision)."""
        b = self.hash_to_block.get(key)
        if b is None or self.blocks[b].token_ids != tuple(token_ids):
            return None
        return b

    def register(self, block_id: int, key: int, token_ids: Sequence[int]) -> None:
        """Record that block ``block_id`` is full with ``token_ids``, under ``key``. If another block
        holds the same tokens already (two sequences computed them), the newest wins the index."""
        block = self.blocks[block_id]
        block.hash, block.token_ids = key, tuple(token_ids)
        self.hash_to_block[key] = block_id

    def fork(self, block_table: list[int], num_tokens: int, n: int, pool: KvPool) -> list[list[int]]:
        """Block tables for n more sequences continuing one that holds ``num_tokens`` positions.

        Every full block is shared (ref_count + n); the last, partial block (if any) is copied, K and V
        of every layer, into a fresh block per child. Example, block_size 4, a 10-token sequence in
        blocks [3, 5, 8], each with ref_count 1, free list 0, 1, 2:

            fork([3, 5, 8], 10, 2, pool) -> [[3, 5, 0], [3, 5, 1]]
            ref counts: 3 -> 3, 5 -> 3, 8 -> 1 (the parent's own), 0 -> 1, 1 -> 1; free list 2

        Copy-on-write at fork time, not at the first write: only full blocks are ever shared, and a
        sequence only writes past its last token, i.e. into its partial block or a new one. So no
        write can hit a shared block and nothing needs a refcount check per write; the price is n
        block copies now, of at most one block each, even for a child that stops at once. Needs n
        free blocks when the sequence ends mid-block (none on a boundary); if fewer are free, raise
        ``OutOfBlocks`` and change nothing.
        """
        if len(block_table) != blocks_needed(num_tokens, self.block_size):
            raise ValueError(f"{len(block_table)} blocks do not hold exactly {num_tokens} tokens")
        full = num_tokens // self.block_size
        partial = block_table[full:]  # [] or [the last block]
        if n * len(partial) > len(self.free_blocks):
            raise OutOfBlocks(needed=n * len(partial), free=len(self.free_blocks))
        for b in block_table[:full]:
            self.blocks[b].ref_count += n
        tables = []
        for _ in range(n):
            copies = [self._take_free() for _ in partial]
            for src, dst in zip(partial, copies):
                pool.copy_block(src, dst)
            tables.append(block_table[:full] + copies)
        return tables

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


class KvPool(L3KvPool):
    """L3's pool, plus a block copy for forks."""

    def copy_block(self, src: int, dst: int) -> None:
        """Copy block ``src``'s K and V into block ``dst``, in every layer."""
        self.k[:, dst] = self.k[:, src]  # (L, block_size, H_kv, D)
        self.v[:, dst] = self.v[:, src]


@dataclass(eq=False)  # compared by identity: two samples of one request may hold equal fields
class Request:
    """One sequence through its life: waiting -> running (-> waiting again if preempted) -> finished.

    A request with n > 1 runs its prompt once; when the prefill ends, the scheduler forks it into n
    sequences: itself (sample 0) and n - 1 children (samples 1 .. n-1, same request_id).
    """

    request_id: int  # unique per request, handed out in submission order: the FIFO tie-break
    prompt_ids: list[int]
    max_new_tokens: int
    ignore_eos: bool = False
    priority: int = 0  # higher runs first
    n: int = 1  # samples wanted; a request with n > 1 is forked when its prefill ends
    sampling: SamplingParams = field(default_factory=SamplingParams)
    sample_index: int = 0  # 0: the request itself; 1 .. n-1: its forks
    generator: torch.Generator | None = None  # this sequence's random stream; default: seeded by sampling
    block_table: list[int] = field(default_factory=list)  # block ids, in position order; some shared
    num_computed_tokens: int = 0  # positions 0 .. num_computed_tokens - 1 have their K/V in the pool
    output_ids: list[int] = field(default_factory=list)  # generated tokens; the newest is not cached yet
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None

    def __post_init__(self):
        if self.generator is None:
            self.generator = make_generator(self.sampling.seed_of(self.sample_index))

    @property
    def all_ids(self) -> list[int]:
        """Prompt then generated tokens: everything a recompute after preemption has to run again."""
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_seqs(self) -> int:
        """Sequences this request takes in the running set: n until it forks, then 1 for each."""
        return self.n if not self.output_ids else 1

    def sort_key(self) -> tuple[int, int, int]:
        """Scheduling order: higher priority first, then first come, first served, then sample order."""
        return (-self.priority, self.request_id, self.sample_index)


def match_prefix(req: Request, manager: BlockManager) -> list[int]:
    """The cached blocks holding ``req``'s leading full blocks, as far as they match; takes nothing.

    Walks the request's tokens one full block at a time, chaining the keys, and stops at the first
    block that is not in the cache. It never matches the block holding the last token, i.e. at most
    (num_tokens - 1) // block_size blocks: that token must run (its logits give the next token), and
    running it must not write into a shared block. Example, block_size 4, a cached 9-token prompt
    in blocks [6, 2, 7]: the same 9 tokens match [6, 2] (8 tokens skipped, the 9th runs); the first
    5 of them plus another token match [6]; a prompt of exactly 8 of them matches [6] only.
    """
    bs = manager.block_size
    ids = req.all_ids
    hits: list[int] = []
    key = None
    for i in range((len(ids) - 1) // bs):
        tokens = ids[i * bs : (i + 1) * bs]
        key = block_hash(key, tokens)
        block = manager.lookup(key, tokens)
        if block is None:
            break
        hits.append(block)
    return hits


def reserve(req: Request, manager: BlockManager, target_len: int, cached: Sequence[int] = ()) -> None:
    """Grow ``req.block_table`` until positions 0 .. target_len - 1 have blocks, and register the
    blocks that positions up to target_len fill, under their chained hash.

    ``cached``: for a request that holds no blocks yet, the blocks ``match_prefix`` found; they are
    shared (ref_count + 1) instead of allocated. With block_size 4, a request ``a`` holding [0],
    another holding [1], and the free list 2, 3, ...:

        reserve(a, manager, 4) -> a.block_table [0]      (nothing allocated; block 0 is now full:
                                                          registered under block_hash(None, a's 4 tokens))
        reserve(a, manager, 6) -> a.block_table [0, 2]

    The step that computes those positions runs right after, and in every layer it writes all new
    K/V before attention reads any, so a request that shares a block registered in the same step
    reads it filled. If the free list is too short, ``OutOfBlocks`` is raised and nothing changes.
    """
    bs = manager.block_size
    missing = blocks_needed(target_len, bs) - len(req.block_table) - len(cached)
    if missing > 0 or cached:
        req.block_table.extend(manager.alloc_blocks(max(missing, 0), cached))
    for i in range(req.num_computed_tokens // bs, target_len // bs):  # blocks full at target_len
        block = req.block_table[i]
        if manager.blocks[block].hash is None:  # not yet registered (a prefix-cache hit already is)
            prev = manager.blocks[req.block_table[i - 1]].hash if i else None
            tokens = req.all_ids[i * bs : (i + 1) * bs]
            manager.register(block, block_hash(prev, tokens), tokens)
