"""The L5 notebook's exercise checkers: the learner's sharing pieces against this stage's own code.

- ``check_fork_table``: a fork's block tables and reference counts, against ``BlockAllocator.fork``
  (``allocator.py``);
- ``check_free``: giving back a block table, one reference per block and tail first, against
  ``BlockAllocator.free``, on allocators that forks and prefix-cache hits have left with shared blocks;
- ``check_block_hashes``: the chained keys of a token list's full blocks, against the keys ``reserve``
  (``sequence.py``, through ``prefix_cache.register_full_blocks``) registers in a ``BlockAllocator``;
- ``check_match_prefix``: the cached blocks a new prompt may share, against ``prefix_cache.match_prefix``
  on allocators that earlier requests have filled, freed and partly handed out again.

The allocator states are built with this stage's own calls (``alloc_blocks``, ``free``, ``fork``,
``reserve`` after ``match_prefix``), the way the scheduler makes them.

The grading contract (see ``kvcourse/grading.py``): each checker runs fixed, seeded cases and prints
one deterministic line per case (``ok``, ``WRONG — what differs``, or ``raised`` and the exception),
then ``k/n passed``. The reference notebook stores those lines as the check cell's output and
``make grade`` compares them. The references are the stage's own code, never a copy kept here.

Left out on purpose: partial credit and hints; the fork is graded on its bookkeeping only (the caller
copies the partial block's K/V with ``KvPool.copy_block``), with enough free blocks for every case;
``check_free`` frees only blocks that are held (refusing a bad id or a double free is L2's exercise, and
L5's ``free`` does it the same way).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvcourse.grading import Case, run_cases

from . import prefix_cache
from .allocator import BlockAllocator, blocks_needed
from .prefix_cache import block_hash, register_full_blocks
from .sequence import Sequence, reserve


def _tokens(seed: int, n: int) -> list[int]:
    """``n`` seeded token ids in 3 .. 49151 (the same on every run)."""
    return torch.randint(3, 49152, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _admit(allocator: BlockAllocator, token_ids: list[int]) -> list[int]:
    """A new request's block table, as the scheduler admits it with the prefix cache on: it shares the
    blocks ``match_prefix`` finds, takes fresh blocks for the rest and registers every full block.

    Example, block_size 4, an empty pool: a 10-token prompt gets [0, 1, 2], blocks 0 and 1 registered;
    a second prompt with the same first 8 tokens then gets [0, 1, 3, ...] (ref counts of 0 and 1 go to 2).
    """
    seq = Sequence(0, list(token_ids), 1)
    reserve(seq, allocator, len(token_ids), prefix_cache.match_prefix(seq.prompt_ids, allocator))
    return seq.block_table


def _books(allocator: BlockAllocator):
    """Everything an allocator knows: per block (ref_count, hash, tokens), the free list, the index."""
    blocks = [(b.ref_count, b.hash, b.token_ids) for b in allocator.blocks]
    return blocks, list(allocator.free_blocks), dict(allocator.hash_to_block)


def _fork_setup(block_size: int, num_tokens: int, shared_first: bool):
    """A ``BlockAllocator`` holding one sequence of ``num_tokens`` positions, and its block table.

    Blocks 0 and 2 belong to another sequence and block 1 was freed, so the table does not start at 0
    and the free list does not run in order. With ``shared_first`` the table's first (full) block is also
    held by a second sequence (a prefix-cache hit): its ref_count is 2 before the fork.
    """
    allocator = BlockAllocator(64, block_size)
    allocator.alloc_blocks(3)  # [0, 1, 2]: another sequence
    allocator.free([1])  # free list 3, 4, ..., 63, 1
    table = allocator.alloc_blocks(blocks_needed(num_tokens, block_size))
    if shared_first:
        allocator.alloc_blocks(0, cached=table[:1])
    return allocator, table


def check_fork_table(fork_table: Callable) -> None:
    """Grade ``fork_table(parent_table, num_tokens, block_size, n, ref_counts, alloc) -> n block tables``
    against ``BlockAllocator.fork``.

    ``parent_table`` holds the parent's ``num_tokens`` positions; ``ref_counts`` is a dict
    {block id: ref_count} of every block in use, to update in place; ``alloc()`` hands out one fresh
    block id and sets its count to 1 in ``ref_counts``. Every full block is shared by the n children
    (its count + n); a partial last block gets a fresh block per child (the caller copies its K/V there
    with ``KvPool.copy_block``). Example, block_size 4, parent [3, 5, 8] holding 10 tokens, n = 2, fresh blocks 0, 1:
    -> [[3, 5, 0], [3, 5, 1]]; counts 3 -> 3, 5 -> 3, 8 -> 1, 0 -> 1, 1 -> 1.
    """

    def case(
        block_size: int, num_tokens: int, n: int, shared_first: bool = False
    ) -> Callable[[], str | None]:
        def run() -> str | None:
            ref, table = _fork_setup(block_size, num_tokens, shared_first)
            expected, _ = ref.fork(list(table), num_tokens, n)  # (tables, block copies)
            want_counts = {b.block_id: b.ref_count for b in ref.blocks if b.ref_count}

            mine, _ = _fork_setup(block_size, num_tokens, shared_first)
            counts = {b.block_id: b.ref_count for b in mine.blocks if b.ref_count}

            def alloc() -> int:
                block = mine._take_free()  # the front of the free list, as the reference takes
                counts[block] = 1
                return block

            got = fork_table(list(table), num_tokens, block_size, n, counts, alloc)
            if not isinstance(got, list | tuple) or not all(isinstance(t, list | tuple) for t in got):
                return f"returned {got!r}, expected a list of {n} block table(s)"
            got = [[int(b) for b in t] for t in got]
            if got != expected:
                return f"block tables {got}, expected {expected}"
            if counts != want_counts:
                diff = {
                    b: (counts.get(b, 0), want_counts.get(b, 0))
                    for b in sorted(set(counts) | set(want_counts))
                }
                wrong = ", ".join(f"block {b}: {c} (expected {w})" for b, (c, w) in diff.items() if c != w)
                return f"ref counts wrong: {wrong}"
            return None

        return run

    run_cases(
        [
            Case("block_size 4, 10 tokens (partial last block), n = 2", case(4, 10, 2)),
            Case("block_size 4, 8 tokens (last block exactly full), n = 3: nothing copied", case(4, 8, 3)),
            Case("block_size 4, 3 tokens (only a partial block), n = 1", case(4, 3, 1)),
            Case("block_size 1: every block is full, n = 4", case(1, 5, 4)),
            Case("block_size 16, 37 tokens, n = 4", case(16, 37, 4)),
            Case("block_size 16, 32 tokens (exactly full), n = 2", case(16, 32, 2)),
            Case(
                "block_size 4, 9 tokens, first block already shared (ref_count 2), n = 3", case(4, 9, 3, True)
            ),
        ]
    )


def _books_problem(mine: BlockAllocator, ref: BlockAllocator, after: str) -> str | None:
    """None if both allocators keep the same books, else the first thing that differs, in words.

    Example: ``'after free([3, 5, 0]) (child 1): free list [2, 4, 6, 7, 0, 5, 3], expected [2, 4, 6, 7, 0]'``.
    """
    wrong = [(m.block_id, m.ref_count, r.ref_count) for m, r in zip(mine.blocks, ref.blocks, strict=True)]
    wrong = [f"block {b}: {c} (expected {w})" for b, c, w in wrong if c != w]
    if wrong:
        return f"after {after}: ref counts wrong: {', '.join(wrong)}"
    if list(mine.free_blocks) != list(ref.free_blocks):
        return f"after {after}: free list {list(mine.free_blocks)}, expected {list(ref.free_blocks)}"
    for m, r in zip(mine.blocks, ref.blocks, strict=True):
        if (m.hash, m.token_ids) != (r.hash, r.token_ids):
            lost = "lost its prefix-cache key" if m.hash is None else "holds another key or other tokens"
            return f"after {after}: block {m.block_id} {lost} (a freed block keeps both until it is reused)"
    if mine.hash_to_block != ref.hash_to_block:
        return (
            f"after {after}: the prefix-cache index points at blocks {sorted(mine.hash_to_block.values())}, "
            f"expected {sorted(ref.hash_to_block.values())}"
        )
    return None


def check_free(free: Callable) -> None:
    """Grade ``free(self, blocks)``, a ``BlockAllocator`` method, against ``BlockAllocator.free``.

    Each case builds two allocators with the same calls of this stage (sequences admitted through the
    prefix cache, forks), then gives back their block tables one by one: ``free(yours, table)`` on one,
    the stage's ``free`` on the other. After every step the ref counts, the free list, each block's
    hash and tokens and the prefix-cache index must match. Example, the notebook's fork: parent
    [3, 5, 8], children [3, 5, 0] and [3, 5, 1], free list [2, 4, 6, 7]; freeing child 1 brings blocks
    3 and 5 to count 2 and gives back block 0 alone: [2, 4, 6, 7, 0]; then the parent gives back 8,
    then child 2 gives back 1, 5, 3, tail first: [2, 4, 6, 7, 0, 8, 1, 5, 3], blocks 5 and 3 still
    registered.
    """

    def case(
        num_blocks: int, block_size: int, build: Callable, steps: list[tuple]
    ) -> Callable[[], str | None]:
        def run() -> str | None:
            ref, mine = BlockAllocator(num_blocks, block_size), BlockAllocator(num_blocks, block_size)
            tables = build(ref)
            build(mine)  # the same calls: the same books
            for step in steps:
                if step[0] == "free":
                    table = list(tables[step[1]])
                    after = f"free({table}) ({step[1]})"
                    ref.free(list(table))
                    free(mine, list(table))
                else:  # ("admit", name, tokens): a new request, through the stage's own code on both
                    after = f"admitting {step[1]}"
                    tables[step[1]] = _admit(ref, step[2])
                    _admit(mine, step[2])
                problem = _books_problem(mine, ref, after)
                if problem:
                    return problem
            return None

        return run

    def one_owner(a: BlockAllocator) -> dict[str, list[int]]:
        a.alloc_blocks(10)
        a.free([0])  # the free list is [0]; every other block has one holder
        return {"A": [4, 7, 9], "the others": [1, 2, 3, 5, 6, 8]}

    def forked(a: BlockAllocator) -> dict[str, list[int]]:  # the notebook's fork by hand
        a.alloc_blocks(9)
        a.free([7, 6, 4, 2, 1, 0])  # free list 0, 1, 2, 4, 6, 7
        register_full_blocks(a, [3, 5, 8], list(range(100, 110)), 0, 10)  # blocks 3, 5 full
        (first, second), _ = a.fork([3, 5, 8], 10, 2)
        return {"parent": [3, 5, 8], "child 1": first, "child 2": second}

    prompt = _tokens(11, 10)
    other = prompt[:8] + _tokens(12, 5)  # shares blocks 0 and 1 of prompt through the prefix cache

    def prefix_hit(a: BlockAllocator) -> dict[str, list[int]]:
        return {"A": _admit(a, prompt), "B": _admit(a, other)}

    again = _tokens(13, 13)

    def clones(a: BlockAllocator) -> dict[str, list[int]]:  # block_size 1: every block is full
        parent = _admit(a, [5, 6, 7, 8, 9])
        (child,), _ = a.fork(parent, 5, 1)
        return {"parent": parent, "child": child}

    system = _tokens(14, 32)
    users = [system + _tokens(15 + i, k) for i, k in enumerate((5, 20, 9, 12))]

    def three(a: BlockAllocator) -> dict[str, list[int]]:
        return {f"R{i + 1}": _admit(a, users[i]) for i in range(3)}

    run_cases(
        [
            Case(
                "one holder per block: [4, 7, 9] goes back tail first, behind block 0",
                case(10, 4, one_owner, [("free", "A"), ("free", "the others")]),
            ),
            Case(
                "a fork: blocks 3 and 5 are in three tables and go back with the last",
                case(9, 4, forked, [("free", "child 1"), ("free", "parent"), ("free", "child 2")]),
            ),
            Case(
                "a prefix-cache hit: the shared prefix outlives the request that filled it",
                case(16, 4, prefix_hit, [("free", "A"), ("free", "B")]),
            ),
            Case(
                "freed blocks keep their keys: the same 13 tokens come back and hit them",
                case(
                    8,
                    4,
                    lambda a: {"A": _admit(a, again)},
                    [("free", "A"), ("admit", "A again", again), ("free", "A again")],
                ),
            ),
            Case(
                "block_size 1, a fork of 5 tokens: nothing goes back until the child is freed",
                case(8, 1, clones, [("free", "parent"), ("free", "child")]),
            ),
            Case(
                "block_size 16: requests sharing a 32-token system prompt, freed out of order",
                case(
                    16,
                    16,
                    three,
                    [
                        ("free", "R2"),
                        ("free", "R1"),
                        ("admit", "R4", users[3]),
                        ("free", "R3"),
                        ("free", "R4"),
                    ],
                ),
            ),
        ]
    )


def check_block_hashes(block_hashes: Callable) -> None:
    """Grade ``block_hashes(token_ids, block_size) -> keys of the full blocks`` against the keys
    ``reserve`` registers in the ``BlockAllocator`` for a sequence of those tokens.

    Block i (tokens i*block_size .. (i+1)*block_size - 1) is keyed ``block_hash(key of block i - 1,
    its tokens)``, the first block with ``None`` before it; a partial last block has no key yet.
    Example, block_size 2: [1, 2, 3, 4, 5] -> [block_hash(None, [1, 2]), block_hash(that, [3, 4])].
    """

    def case(token_ids: list[int], block_size: int) -> Callable[[], str | None]:
        def run() -> str | None:
            allocator = BlockAllocator(64, block_size)
            seq = Sequence(0, list(token_ids), 1)
            reserve(seq, allocator, len(token_ids))  # registers every block full at len(token_ids)
            full = seq.block_table[: len(token_ids) // block_size]
            expected = [allocator.blocks[b].hash for b in full]
            got = block_hashes(list(token_ids), block_size)
            if not isinstance(got, list | tuple):
                return f"returned {got!r}, expected a list of {len(expected)} keys"
            if len(got) != len(expected):
                return f"{len(got)} keys, expected {len(expected)} (one per full block)"
            bad = next((i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b), None)
            return None if bad is None else f"the key of block {bad} differs (blocks before it agree)"

        return run

    system = _tokens(5, 32)
    run_cases(
        [
            Case(
                "block_size 2, [1, 2, 3, 4, 5]: 2 full blocks, the tail [5] has no key",
                case([1, 2, 3, 4, 5], 2),
            ),
            Case("block_size 4, 8 tokens: both blocks full", case(list(range(10, 18)), 4)),
            Case("block_size 4, 3 tokens: no full block, no key", case([7, 8, 9], 4)),
            Case("block_size 1: every token is a block", case([5, 5, 5, 6], 1)),
            Case(
                "block_size 4, the same 4 tokens twice: the second key is chained", case([1, 2, 3, 4] * 2, 4)
            ),
            Case(
                "block_size 16, a 32-token system prompt + 5 tokens", case(system + [11, 12, 13, 14, 15], 16)
            ),
        ]
    )


def check_match_prefix(match_prefix: Callable) -> None:
    """Grade ``match_prefix(token_ids, allocator) -> block ids`` against ``prefix_cache.match_prefix``.

    Each case builds a ``BlockAllocator`` with this stage's calls (earlier requests admitted, freed,
    some blocks handed out again), then asks both functions about one prompt. The learner's answer must
    equal the stage's, and the allocator must be left exactly as it was: matching only looks, the
    caller takes the blocks. Example, block_size 4, a cached 9-token prompt in blocks [6, 2, 7]: the
    same 9 tokens -> [6, 2] (8 tokens skipped, the 9th runs); a prompt of exactly its first 8 tokens ->
    [6] (block 2 holds the last token, which must run); its first 4 tokens twice, then one more -> [6]
    (the repeat follows another prefix, so its chained key is another).
    """

    def case(
        num_blocks: int, block_size: int, build: Callable, token_ids: list[int]
    ) -> Callable[[], str | None]:
        def run() -> str | None:
            allocator = BlockAllocator(num_blocks, block_size)
            build(allocator)
            expected = prefix_cache.match_prefix(list(token_ids), allocator)
            before = _books(allocator)
            got = match_prefix(list(token_ids), allocator)
            if _books(allocator) != before:
                return (
                    "the allocator changed: match_prefix only looks (the caller takes the blocks it returns)"
                )
            if not isinstance(got, list | tuple):
                return f"returned {got!r}, expected the list of block ids {expected}"
            got = [int(b) for b in got]
            return None if got == expected else f"matched blocks {got}, expected {expected}"

        return run

    prompt = _tokens(21, 9)
    stranger = _tokens(22, 5)  # tokens no cached block holds

    def cached_nine(a: BlockAllocator) -> None:  # the docstring's example: the prompt in [6, 2, 7]
        a.alloc_blocks(8)
        a.free([7, 2, 6])  # free list 6, 2, 7
        _admit(a, prompt)

    long = _tokens(23, 13)

    def head_reused(a: BlockAllocator) -> None:
        table = _admit(a, long)  # [0, 1, 2, 3], blocks 0 .. 2 registered
        a.free(table[:1])  # block 0 first, then the rest: free list 4 .. 7, 0, 3, 2, 1
        a.free(table[1:])
        a.alloc_blocks(5)  # 4 .. 7 and 0: block 0 is handed out again and forgets its key

    def collision(a: BlockAllocator) -> None:  # a 64-bit key collision, forced
        (block,) = a.alloc_blocks(1)
        a.register(block, block_hash(None, prompt[:4]), stranger[:4])

    system = _tokens(24, 48)

    def system_freed(a: BlockAllocator) -> None:
        a.free(_admit(a, system + _tokens(25, 10)))  # finished: its blocks wait on the free list

    run_cases(
        [
            Case(
                "the cached 9 tokens again: blocks [6, 2], the 9th token runs",
                case(8, 4, cached_nine, prompt),
            ),
            Case("its first 5 tokens, then another: [6]", case(8, 4, cached_nine, prompt[:5] + stranger[:1])),
            Case(
                "exactly its first 8 tokens: block 2 holds the last token, only [6]",
                case(8, 4, cached_nine, prompt[:8]),
            ),
            Case(
                "a 4-token prompt: its only block holds the last token, nothing",
                case(8, 4, cached_nine, prompt[:4]),
            ),
            Case(
                "its first block twice, then one more: the repeat follows another prefix, a miss",
                case(8, 4, cached_nine, prompt[:4] * 2 + stranger[:1]),
            ),
            Case(
                "block 0 was handed out again, blocks 1 and 2 are still cached: stop at the first miss",
                case(8, 4, head_reused, long),
            ),
            Case(
                "a key in the index whose block holds other tokens (a collision): a miss",
                case(8, 4, collision, prompt),
            ),
            Case(
                "block_size 16: a finished request's 48-token system prompt, a new user part: 3 blocks",
                case(16, 16, system_freed, system + _tokens(26, 20)),
            ),
            Case(
                "block_size 1, the cached 6 tokens again: every block but the last token's",
                case(8, 1, lambda a: _admit(a, [5, 6, 7, 8, 9, 10]), [5, 6, 7, 8, 9, 10]),
            ),
        ]
    )
