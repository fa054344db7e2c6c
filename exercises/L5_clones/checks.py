"""The L5 notebook's exercise checkers: the learner's sharing pieces against this stage's own code.

- ``check_clone_table``: a clone's block tables and reference counts, against ``BlockAllocator.clone``
  (``allocator.py``);
- ``check_free``: giving back a block table, one reference per block and tail first, against
  ``BlockAllocator.free``, on allocators that clones and prefix-cache hits have left with shared blocks;
- ``check_block_hashes``: the chained keys of a token list's full blocks, against the keys ``allocate_slots``
  (``sequence.py``, through ``prefix_cache.register_full_blocks``) registers in a ``BlockAllocator``;
- ``check_match_prefix``: the cached blocks a new prompt may share, against ``prefix_cache.match_prefix``
  on allocators that earlier requests have filled, freed and partly handed out again;
- ``check_fork_beams``: a beam search's block tables re-pointed after a step (dropped beams give their
  blocks back, survivors share or clone their parent's), step after step, against the beam-search
  wing's ``beams.fork`` (``beams/fork.py``): ``BlockAllocator.free`` for each dropped beam, then
  ``BlockAllocator.clone`` for each further survivor of a beam.

The allocator states are built with this stage's own calls (``alloc_blocks``, ``free``, ``clone``,
``allocate_slots`` after ``match_prefix``), the way the scheduler makes them.

The grading contract (see ``kvcourse/grading/cases.py``): each checker runs fixed, seeded cases and prints
one deterministic line per case (``ok``, ``WRONG — what differs``, or ``raised`` and the exception),
then ``k/n passed``. The reference notebook stores those lines as the check cell's output and
``make grade`` compares them. The references are the stage's own code, never a copy kept here.

The hidden cases (``HIDDEN``, at the end; ``kvcourse/grading/hidden.py``) run the learner's function on cases
drawn per grading run: runs of admissions, clones, frees and matches on pools of every block size.
They are judged in the grader's process against the independent answers of ``key/L5_clones/answers.py``.

Left out on purpose: partial credit and hints; the clone is graded on its bookkeeping only (the caller
copies the partial block's K/V with ``KvPool.copy_block``), with enough free blocks for every case;
``check_free`` frees only blocks that are held (refusing a bad id or a double free is L2's exercise, and
L5's ``free`` does it the same way).
"""

from __future__ import annotations

import copy
import hashlib
import types
from collections.abc import Callable

import torch

from kvcourse.grading.cases import Case, describe, named_mistake, outcome, run_cases
from kvcourse.grading.hidden import Hidden, unrevealed
from kvcourse.grading.mutations import catch_cases, catch_hidden, version
from L5_clones import prefix_cache
from L5_clones.allocator import BlockAllocator, blocks_needed
from L5_clones.beams import fork
from L5_clones.prefix_cache import block_hash, register_full_blocks
from L5_clones.sequence import Sequence, allocate_slots


def _tokens(seed: int, n: int) -> list[int]:
    """``n`` seeded token ids in 3 .. 49151 (the same on every run)."""
    return torch.randint(3, 49152, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _admit(allocator: BlockAllocator, token_ids: list[int], match=prefix_cache.match_prefix) -> list[int]:
    """A new request's block table, as the scheduler admits it with the prefix cache on: it shares the
    blocks ``match`` (the stage's ``match_prefix`` unless told) finds, takes fresh blocks for the rest
    and registers every full block.

    Example, block_size 4, an empty pool: a 10-token prompt gets [0, 1, 2], blocks 0 and 1 registered;
    a second prompt with the same first 8 tokens then gets [0, 1, 3, ...] (ref counts of 0 and 1 go to 2).
    """
    seq = Sequence(0, list(token_ids), 1)
    allocate_slots(seq, allocator, len(token_ids), match(seq.prompt_ids, allocator))
    return seq.block_table


def _books(allocator: BlockAllocator):
    """Everything an allocator knows: per block (ref_count, hash, tokens), the free list, the index."""
    blocks = [(b.ref_count, b.hash, b.token_ids) for b in allocator.blocks]
    return blocks, list(allocator.free_blocks), dict(allocator.hash_to_block)


ALLOCATOR = "L5_clones.allocator:BlockAllocator"


def _mutant(target: str, bug: str):
    """The stage's ``target`` with one bug of the course's mutation list put in (``kvcourse/grading/mutations.py``):
    what a known mistake gives, to name it in a case's line."""
    return version(target, bug)


def _clone_setup(block_size: int, num_tokens: int, shared_first: bool, cls=BlockAllocator):
    """A ``BlockAllocator`` (or ``cls``) holding one sequence of ``num_tokens`` positions, and its block table.

    Blocks 0 and 2 belong to another sequence and block 1 was freed, so the table does not start at 0
    and the free list does not run in order. With ``shared_first`` the table's first (full) block is also
    held by a second sequence (a prefix-cache hit): its ref_count is 2 before the clone.
    """
    allocator = cls(64, block_size)
    allocator.alloc_blocks(3)  # [0, 1, 2]: another sequence
    allocator.free([1])  # free list 3, 4, ..., 63, 1
    table = allocator.alloc_blocks(blocks_needed(num_tokens, block_size))
    if shared_first:
        allocator.alloc_blocks(0, cached=table[:1])
    return allocator, table


def check_clone_table(clone_table: Callable) -> None:
    """Grade ``clone_table(parent_table, num_tokens, block_size, n, ref_counts, alloc) -> n block tables``
    against ``BlockAllocator.clone``.

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
            ref, table = _clone_setup(block_size, num_tokens, shared_first)
            expected, _ = ref.clone(list(table), num_tokens, n)  # (tables, block copies)
            want_counts = {b.block_id: b.ref_count for b in ref.blocks if b.ref_count}

            mine, _ = _clone_setup(block_size, num_tokens, shared_first)
            counts = {b.block_id: b.ref_count for b in mine.blocks if b.ref_count}

            def alloc() -> int:
                block = mine._take_free()  # the front of the free list, as the reference takes
                counts[block] = 1
                return block

            got = clone_table(list(table), num_tokens, block_size, n, counts, alloc)
            if not isinstance(got, list | tuple) or not all(isinstance(t, list | tuple) for t in got):
                return f"returned {got!r}, expected a list of {n} block table(s)"
            got = [[int(b) for b in t] for t in got]
            problem = None
            if got != expected:
                problem = f"block tables {got}, expected {expected}"
            elif counts != want_counts:
                diff = {
                    b: (counts.get(b, 0), want_counts.get(b, 0))
                    for b in sorted(set(counts) | set(want_counts))
                }
                wrong = ", ".join(f"block {b}: {c} (expected {w})" for b, (c, w) in diff.items() if c != w)
                problem = f"ref counts wrong: {wrong}"

            def mistake(cls=BlockAllocator, tokens=num_tokens):
                a, parent = _clone_setup(block_size, num_tokens, shared_first, cls)
                tables, _ = cls.clone(a, list(parent), tokens, n)
                return tables, {b.block_id: b.ref_count for b in a.blocks if b.ref_count}

            mistakes = {
                f"the partial last block is shared, not copied: a child would write into {table[-1]}": lambda: (
                    mistake(_mutant(ALLOCATOR, "L5 clone shares the partial block instead of copying it"))
                ),
                "each full block gains 1 reference, not n: n children are n more holders": lambda: mistake(
                    _mutant(ALLOCATOR, "L5 clone takes one reference on a shared block for all its children")
                ),
                "off by one: the last block is copied although the parent ends on a block boundary": (
                    lambda: mistake(tokens=num_tokens - 1)
                ),
            }
            return named_mistake(problem, (got, {b: c for b, c in counts.items() if c}), mistakes)

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


def _free_mistakes(before: BlockAllocator, table: list[int]) -> dict[str, Callable]:
    """What known mistakes of ``free`` leave when ``table`` is given back to ``before`` (a copy each)."""

    def freed(bug: str):
        a = copy.deepcopy(before)
        _mutant(ALLOCATOR, bug).free(a, list(table))
        return _books(a)

    return {
        "a shared block is freed at once: it goes back only when its last holder lets go": lambda: freed(
            "L5 free lets go of a shared block when its first owner finishes"
        ),
        "the table goes back head first: walk it from its last block": lambda: freed(
            "L5 free hands a block table back head first"
        ),
    }


def check_free(free: Callable) -> None:
    """Grade ``free(self, blocks)``, a ``BlockAllocator`` method, against ``BlockAllocator.free``.

    Each case builds two allocators with the same calls of this stage (sequences admitted through the
    prefix cache, clones), then gives back their block tables one by one: ``free(yours, table)`` on one,
    the stage's ``free`` on the other. After every step the ref counts, the free list, each block's
    hash and tokens and the prefix-cache index must match. Example, the notebook's clone: parent
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
                before = copy.deepcopy(ref)
                if step[0] == "free":
                    table = list(tables[step[1]])
                    after = f"free({table}) ({step[1]})"
                    ref.free(list(table))
                    free(mine, list(table))
                else:  # ("admit", name, tokens): a new request, through the stage's own code on both
                    after, table = f"admitting {step[1]}", []
                    tables[step[1]] = _admit(ref, step[2])
                    _admit(mine, step[2])
                problem = _books_problem(mine, ref, after)
                if problem:
                    return named_mistake(problem, _books(mine), _free_mistakes(before, table))
            return None

        return run

    def one_owner(a: BlockAllocator) -> dict[str, list[int]]:
        a.alloc_blocks(10)
        a.free([0])  # the free list is [0]; every other block has one holder
        return {"A": [4, 7, 9], "the others": [1, 2, 3, 5, 6, 8]}

    def cloned(a: BlockAllocator) -> dict[str, list[int]]:  # the notebook's clone by hand
        a.alloc_blocks(9)
        a.free([7, 6, 4, 2, 1, 0])  # free list 0, 1, 2, 4, 6, 7
        register_full_blocks(a, [3, 5, 8], list(range(100, 110)), 0, 10)  # blocks 3, 5 full
        (first, second), _ = a.clone([3, 5, 8], 10, 2)
        return {"parent": [3, 5, 8], "child 1": first, "child 2": second}

    prompt = _tokens(11, 10)
    other = prompt[:8] + _tokens(12, 5)  # shares blocks 0 and 1 of prompt through the prefix cache

    def prefix_hit(a: BlockAllocator) -> dict[str, list[int]]:
        return {"A": _admit(a, prompt), "B": _admit(a, other)}

    again = _tokens(13, 13)

    def clones(a: BlockAllocator) -> dict[str, list[int]]:  # block_size 1: every block is full
        parent = _admit(a, [5, 6, 7, 8, 9])
        (child,), _ = a.clone(parent, 5, 1)
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
                "a clone: blocks 3 and 5 are in three tables and go back with the last",
                case(9, 4, cloned, [("free", "child 1"), ("free", "parent"), ("free", "child 2")]),
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
                "block_size 1, a clone of 5 tokens: nothing goes back until the child is freed",
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
    ``allocate_slots`` registers in the ``BlockAllocator`` for a sequence of those tokens.

    Block i (tokens i*block_size .. (i+1)*block_size - 1) is keyed ``block_hash(key of block i - 1,
    its tokens)``, the first block with ``None`` before it; a partial last block has no key yet.
    Example, block_size 2: [1, 2, 3, 4, 5] -> [block_hash(None, [1, 2]), block_hash(that, [3, 4])].
    """

    def case(token_ids: list[int], block_size: int) -> Callable[[], str | None]:
        def run() -> str | None:
            allocator = BlockAllocator(64, block_size)
            seq = Sequence(0, list(token_ids), 1)
            allocate_slots(seq, allocator, len(token_ids))  # registers every block full at len(token_ids)
            full = seq.block_table[: len(token_ids) // block_size]
            expected = [allocator.blocks[b].hash for b in full]
            got = block_hashes(list(token_ids), block_size)
            if not isinstance(got, list | tuple):
                return f"returned {got!r}, expected a list of {len(expected)} keys"
            if len(got) != len(expected):
                problem = f"{len(got)} keys, expected {len(expected)} (one per full block)"
            else:
                bad = next((i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b), None)
                problem = None if bad is None else f"the key of block {bad} differs (blocks before it agree)"

            def unchained() -> list[int]:
                a = BlockAllocator(64, block_size)
                table = a.alloc_blocks(len(full))
                bug = "L5 blocks are registered under unchained keys"
                _mutant("L5_clones.prefix_cache:register_full_blocks", bug)(
                    a, table, list(token_ids), 0, len(full) * block_size
                )
                return [a.blocks[b].hash for b in table]

            def with_tail() -> list[int]:
                tail = token_ids[len(full) * block_size :]
                if not tail:
                    raise ValueError("no partial block")
                return expected + [block_hash(expected[-1] if expected else None, tail)]

            return named_mistake(
                problem,
                list(got),
                {
                    "the keys do not chain: block i's key must take block i - 1's key": unchained,
                    "the partial last block got a key: more tokens will land in it": with_tail,
                },
            )

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
            problem = None if got == expected else f"matched blocks {got}, expected {expected}"

            def stage_with(bug: str) -> list[int]:
                return _mutant("L5_clones.prefix_cache:match_prefix", bug)(list(token_ids), allocator)

            def trusting_the_key() -> list[int]:
                a = copy.deepcopy(allocator)
                bug = "L5 a key hit is taken without checking the block's tokens"
                a.lookup = types.MethodType(_mutant(ALLOCATOR, bug).lookup, a)
                return prefix_cache.match_prefix(list(token_ids), a)

            mistakes = {
                "the block holding the last token was matched: that token must run": lambda: stage_with(
                    "L5 match_prefix takes the block of the last token"
                ),
                "the keys do not chain: a block can only hit after the same prefix": lambda: stage_with(
                    "L5 match_prefix looks blocks up under unchained keys"
                ),
                "a key hit was taken without comparing the block's tokens: a collision is a miss": (
                    trusting_the_key
                ),
            }
            return named_mistake(problem, got, mistakes)

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


def _stage_fork(
    allocator: BlockAllocator, tables: list[list[int]], num_tokens: int, survivors, cls=BlockAllocator
) -> list:
    """The stage's re-pointing, ``beams.fork``, on ``allocator`` (the copies it names left out): every
    beam no survivor continues is freed, then, in survivor order, a beam's first survivor keeps its
    table and each further one gets a ``clone``. ``cls`` gives ``free`` and ``clone`` (a mutant: a
    known mistake)."""
    allocator.__class__ = cls
    return fork(allocator, [list(t) for t in tables], num_tokens, list(survivors))[0]


def _fork_mistakes(before: BlockAllocator, tables, num_tokens: int, survivors) -> dict[str, Callable]:
    """What known mistakes of a beam step give (tables, counts) from the books ``before`` it (a copy each)."""

    def forked(bug: str | None = None, keep_dropped: bool = False):
        a = copy.deepcopy(before)
        cls = _mutant(ALLOCATOR, bug) if bug else BlockAllocator
        if keep_dropped:  # a free that does nothing
            cls = type("KeepsDropped", (BlockAllocator,), {"free": lambda self, blocks: None})
        new = _stage_fork(a, tables, num_tokens, survivors, cls)
        return new, {b.block_id: b.ref_count for b in a.blocks if b.ref_count}

    return {
        "a dropped beam keeps its blocks: each must lose one reference": lambda: forked(keep_dropped=True),
        "a dropped beam frees shared blocks outright: a block goes back only when its last holder lets go": (
            lambda: forked("L5 free lets go of a shared block when its first owner finishes")
        ),
        "a further survivor shares the beam's partial block: only full blocks may be shared": lambda: forked(
            "L5 clone shares the partial block instead of copying it"
        ),
    }


def check_fork_beams(fork_beams: Callable) -> None:
    """Grade ``fork_beams(tables, num_tokens, block_size, survivors, ref_counts, alloc) -> new tables``
    against the stage's re-pointing, step after step of a beam search.

    ``tables[j]`` is live beam j's block table, holding ``num_tokens`` positions (every beam of a group
    holds as many); survivor i of the step continues beam ``survivors[i]``; ``ref_counts`` is a dict
    {block id: ref_count} of every block in use, to update in place; ``alloc()`` hands out one fresh
    block id and sets its count to 1. A beam no survivor continues is dropped: each of its blocks loses
    a reference (a block nobody holds any more is free: count 0, or removed from the dict). The first
    survivor of a beam takes that beam's table as it is; each further survivor of it gets a clone (its
    full blocks shared, its partial last block a fresh block). Drops first, then the survivors in order.
    Between steps the checker runs each beam's new token: a table that needs one more block gets it.
    """

    def case(
        block_size: int, prompt: int, steps: list[list[int]], shared_first: bool = False
    ) -> Callable[[], str | None]:
        def run() -> str | None:
            ref = BlockAllocator(64, block_size)
            ref.alloc_blocks(3)  # [0, 1, 2]: another request
            ref.free([1])  # free list 3, 4, ..., 63, 1
            tables, num_tokens = [ref.alloc_blocks(blocks_needed(prompt, block_size))], prompt
            if shared_first:  # a prefix-cache hit: another request holds the first block too
                ref.alloc_blocks(0, cached=tables[0][:1])
            for number, survivors in enumerate(steps, 1):
                counts = {b.block_id: b.ref_count for b in ref.blocks if b.ref_count}
                fresh = list(ref.free_blocks)  # the front of the free list, as the stage takes it

                def alloc(counts=counts, fresh=fresh) -> int:
                    counts[fresh[0]] = 1
                    return fresh.pop(0)

                call = f"step {number}: fork_beams({tables}, {num_tokens}, {block_size}, {survivors})"
                got = fork_beams(
                    [list(t) for t in tables], num_tokens, block_size, list(survivors), counts, alloc
                )
                before, old = copy.deepcopy(ref), tables
                tables = _stage_fork(ref, tables, num_tokens, survivors)
                if not isinstance(got, list | tuple) or not all(isinstance(t, list | tuple) for t in got):
                    return f"{call} returned {got!r}, expected a list of {len(survivors)} block table(s)"
                got = [[int(b) for b in t] for t in got]
                want = {b.block_id: b.ref_count for b in ref.blocks if b.ref_count}
                counts = {b: c for b, c in counts.items() if c}
                problem = None
                if got != tables:
                    problem = f"{call} returned {got}, expected {tables}"
                elif counts != want:
                    wrong = ", ".join(
                        f"block {b}: {counts.get(b, 0)} (expected {want.get(b, 0)})"
                        for b in sorted(set(counts) | set(want))
                        if counts.get(b, 0) != want.get(b, 0)
                    )
                    problem = f"{call}: ref counts wrong: {wrong}"
                if problem:
                    return named_mistake(
                        problem, (got, counts), _fork_mistakes(before, old, num_tokens, survivors)
                    )
                num_tokens += 1  # each beam runs its new token
                for t in tables:
                    t += ref.alloc_blocks(blocks_needed(num_tokens, block_size) - len(t))
            return None

        return run

    run_cases(
        [
            Case(
                "block_size 4, 10-token prompt, width 3: one beam forks into three", case(4, 10, [[0, 0, 0]])
            ),
            Case("prompt ends on a block boundary: nothing copied", case(4, 8, [[0, 0]])),
            Case("a dropped beam gives back its own block", case(4, 10, [[0, 0, 0], [0, 0, 2]])),
            Case("the first survivor of a beam keeps its table", case(4, 10, [[0, 0, 0], [1, 0, 1]])),
            Case("every survivor continues one beam", case(4, 6, [[0, 0, 0], [2, 2, 2], [1, 0, 2]])),
            Case("block_size 1: every block is full", case(1, 5, [[0, 0], [1, 1], [0, 1]])),
            Case(
                "a prefix-cache hit: the first block is held by another request",
                case(4, 9, [[0, 0, 0], [0, 2, 2], [1, 1, 0]], True),
            ),
            Case(
                "eight steps of width 3 across block boundaries",
                case(
                    4,
                    9,
                    [[0, 0, 0], [0, 1, 2], [0, 0, 1], [2, 1, 2], [1, 1, 1], [0, 2, 0], [1, 0, 2], [2, 2, 1]],
                ),
            ),
        ]
    )


# ---- L5.6 (beyond the stage): hits of an LRU prefix cache on a trace ----

_S = [1, 2, 3, 4, 5, 6, 7, 8]  # a system prompt of two blocks of 4
LRU_CASES = [  # (name, prompts, block_size, capacity)
    (
        "block_size 4, room for 8 blocks: three requests share an 8-token system prompt",
        [[*_S, 21, 22, 23], [*_S, 31, 32, 33, 34, 35], [*_S, 41]],
        4,
        8,
    ),
    (
        "the same three requests, room for no block",
        [[*_S, 21, 22, 23], [*_S, 31, 32, 33, 34, 35], [*_S, 41]],
        4,
        0,
    ),
    ("the same 8 tokens twice", [_S, _S], 4, 8),
    ("a block's 4 tokens again, after another prefix", [[1, 2, 3, 4, 5], [1, 2, 3, 4, 1, 2, 3, 4, 9]], 4, 8),
    ("block_size 2, room for 2 blocks, a 7-token prompt twice", [[1, 2, 3, 4, 5, 6, 7]] * 2, 2, 2),
    (
        "block_size 2, room for 3 blocks, two prompts taking turns",
        [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [1, 2, 3, 4, 5], [6, 7, 8, 9, 10]],
        2,
        3,
    ),
    (
        "block_size 1, room for 4 blocks",
        [[5, 6, 7, 8, 9], [5, 6, 7, 1], [5, 6, 7, 8, 2], [5, 9], [5, 6, 7, 8, 9, 10]],
        1,
        4,
    ),
    ("block_size 0 raises ValueError", [[1, 2, 3]], 0, 4),
    ("capacity -1 raises ValueError", [[1, 2, 3]], 2, -1),
    ("an empty prompt raises ValueError", [[1, 2, 3], []], 2, 4),
]
# What these cases must return, and what three known mistakes return on them. Literal data, computed
# once from the answer key (which does not ship with the course); tests/test_exercises_l5_beyond.py
# checks that both still hold. "ValueError": the call must raise ValueError.
LRU_EXPECTED = [
    [0, 2, 2],
    [0, 0, 0],
    [0, 1],
    [0, 1],
    [0, 2],
    [0, 0, 1, 1],
    [0, 3, 3, 1, 3],
    *["ValueError"] * 3,
]
LRU_MISTAKES = {
    "a block was named by its own tokens, not by the whole prefix it ends": (
        [[0, 2, 2], [0, 0, 0], [0, 1], [0, 2], [0, 2], [0, 0, 1, 1], [0, 3, 3, 1, 3], *["ValueError"] * 3]
    ),
    "the block holding a prompt's last token was counted: that token must run, so it is never a hit": (
        [[0, 2, 2], [0, 0, 0], [0, 2], [0, 1], [0, 2], [0, 0, 1, 1], [0, 3, 3, 1, 3], *["ValueError"] * 3]
    ),
    "a request's blocks were used head first: its first block must end most recently used": (
        [[0, 2, 2], [0, 0, 0], [0, 1], [0, 1], [0, 0], [0, 0, 0, 0], [0, 0, 3, 0, 1], *["ValueError"] * 3]
    ),
}


def check_lru_hits(lru_hits: Callable) -> None:
    """Grade ``lru_hits(prompts, block_size, capacity) -> hits per request`` on fixed traces."""

    def case(k: int) -> Callable[[], str | None]:
        _, prompts, block_size, capacity = LRU_CASES[k]

        def run() -> str | None:
            kind, got = outcome(lru_hits, [list(p) for p in prompts], block_size, capacity)
            want = LRU_EXPECTED[k]
            if want == "ValueError":
                if kind == "raised" and isinstance(got, ValueError):
                    return None
                return f"{describe((kind, got))}, expected ValueError"
            if kind == "raised":
                return f"raised {type(got).__name__}: {got}"
            if not isinstance(got, list | tuple) or [int(h) for h in got] != want:
                problem = f"returned {got!r}, expected {want}"
                return named_mistake(
                    problem, list(got) if isinstance(got, list | tuple) else got,
                    {rule: (lambda values=values: values[k]) for rule, values in LRU_MISTAKES.items()},
                )  # fmt: skip
            return None

        return run

    run_cases([Case(name, case(k)) for k, (name, *_) in enumerate(LRU_CASES)])


# ---- L5.7 (beyond the stage): blocks held when every request stays ----


def _held_by_stage(prompts: list[list[int]], block_size: int, match=prefix_cache.match_prefix) -> list[int]:
    """Blocks in use after each prompt is admitted through the prefix cache, nothing given back: this
    stage's own ``match_prefix`` and ``allocate_slots`` on a pool large enough for all of them unshared."""
    allocator = BlockAllocator(max(1, sum(blocks_needed(len(p), block_size) for p in prompts)), block_size)
    held = []
    for prompt in prompts:
        _admit(allocator, prompt, match)
        held.append(allocator.num_used)
    return held


HELD_CASES = [  # (name, prompts, block_size); a None prompt list: the case must raise ValueError
    (
        "block_size 4: three requests share an 8-token system prompt",
        [[*_S, 21, 22, 23], [*_S, 31], [*_S, 41, 42]],
        4,
    ),
    ("the same 8 tokens twice", [_S, _S], 4),
    ("an earlier prompt's second block of tokens, at the start of a prompt", [[*_S, 9], [5, 6, 7, 8, 9]], 4),
    (
        "a prompt agrees longest with an earlier request, not the one just before",
        [list(range(10, 22)), [10, 11, 12, 13, 30, 31, 32, 33, 34], list(range(10, 18)) + [40, 41, 42]],
        4,
    ),
    (
        "an earlier prompt with a partial block",
        [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]],
        4,
    ),
    ("block_size 1", [[5, 6, 7], [5, 6, 7], [5, 6, 8, 9], [6]], 1),
    (
        "block_size 16, a 48-token system prompt",
        [_tokens(31, 48) + _tokens(32 + i, 5 + 7 * i) for i in range(4)],
        16,
    ),
    ("block_size 0 raises ValueError", [[1, 2, 3]], 0),
    ("an empty prompt raises ValueError", [[1, 2, 3], []], 4),
]


def check_blocks_held(blocks_held: Callable) -> None:
    """Grade ``blocks_held(prompts, block_size) -> blocks in use after each admission`` against this
    stage admitting the prompts through its prefix cache, one after another, none finishing."""

    def case(prompts: list[list[int]], block_size: int) -> Callable[[], str | None]:
        def run() -> str | None:
            kind, got = outcome(blocks_held, [list(p) for p in prompts], block_size)
            if block_size < 1 or not all(prompts):
                if kind == "raised" and isinstance(got, ValueError):
                    return None
                return f"{describe((kind, got))}, expected ValueError"
            if kind == "raised":
                return f"raised {type(got).__name__}: {got}"
            want = _held_by_stage(prompts, block_size)
            if isinstance(got, list | tuple) and [int(h) for h in got] == want:
                return None
            last = "L5 match_prefix takes the block of the last token"
            mistakes = {
                "the block holding a prompt's last token was shared: that token must run": lambda: (
                    _held_by_stage(prompts, block_size, _mutant("L5_clones.prefix_cache:match_prefix", last))
                ),
                "nothing was shared: a new prompt shares the leading full blocks an earlier one holds": (
                    lambda: _held_by_stage(prompts, block_size, lambda tokens, allocator: [])
                ),
            }
            got = list(got) if isinstance(got, list | tuple) else got
            return named_mistake(f"returned {got!r}, expected {want}", got, mistakes)

        return run

    run_cases([Case(name, case(prompts, bs)) for name, prompts, bs in HELD_CASES])


# ---- L5.8 (catch the bug): a test of the allocator's books ----

CATCH_SHOWN = [
    "L5 clone takes one reference on a shared block for all its children",
    "L5 free hands a block table back head first",
]
CATCH_ALL = [
    *CATCH_SHOWN,
    "L5 clone shares the partial block instead of copying it",
    "L5 free lets go of a shared block when its first owner finishes",
    "L5 allocator forgets that revived cache hits use up free blocks",
    "L5 clone copies for the children it can, then runs out",
]


def check_catch_allocator(test: Callable) -> None:
    """Run the learner's ``test(BlockAllocator)`` on this stage's allocator (it must pass) and on two
    versions with a bug of the course's mutation list put in (it must fail each). The hidden cases
    hand it every bug of ``CATCH_ALL``."""
    run_cases(catch_cases(test, ALLOCATOR, CATCH_SHOWN, "the allocator"))


# ---- L5.9 (predict): a fork, frees and prefix hits ----

PREDICT_A = list(range(11, 21))  # 10 tokens
PREDICT_D = PREDICT_A[:8] + [31, 32, 33, 34, 35]  # 13 tokens: A's first two blocks, then its own
PREDICT_E = PREDICT_A[:4] + [41, 42]  # 6 tokens: A's first block, then its own


PREDICT_KEYS = ["D's block table", "E's block table", "ref counts", "free list"]


def _predict_run() -> dict:
    """The notebook's operations on this stage's allocator: what the learner must predict."""
    allocator = BlockAllocator(num_blocks=8, block_size=4)
    a = _admit(allocator, PREDICT_A)
    (b, c), _ = allocator.clone(a, 10, 2)
    allocator.free(a)
    allocator.free(b)
    allocator.free(c)
    d = _admit(allocator, PREDICT_D)
    e = _admit(allocator, PREDICT_E)
    return {
        "D's block table": d,
        "E's block table": e,
        "ref counts": [block.ref_count for block in allocator.blocks],
        "free list": list(allocator.free_blocks),
    }


def check_predict(predict: Callable) -> None:
    """Compare ``predict()`` (a dict) with what the operations give on this stage, key by key, without
    showing the right values: how many entries differ, or that the number of entries is wrong."""
    real = _predict_run()

    def case(key: str) -> Callable[[], str | None]:
        def run() -> str | None:
            got = predict()
            if not isinstance(got, dict) or key not in got:
                return f"predict() returned no {key!r} key"
            mine, want = got[key], real[key]
            if not isinstance(mine, list | tuple):
                return f"{key} is a {type(mine).__name__}, not a list"
            if len(mine) != len(want):
                return f"{key} has the wrong number of entries"
            wrong = sum(m != w for m, w in zip(mine, want, strict=True))
            return None if wrong == 0 else f"{wrong} of {len(want)} entries differ"

        return run

    run_cases([Case(key, case(key)) for key in real])


# Hidden cases (kvcourse/grading/hidden.py): drawn per grading run, observed here in the learner's kernel,
# judged in the grader's process against the independent answers of key/L5_clones/answers.py.

BLOCK_SIZES = (1, 2, 3, 4, 5, 7, 16)  # 1 (every block full) and odd sizes next to the usual ones


def draw_clone(rng) -> list[dict]:
    """Parents of up to 6 blocks with scattered ids and every block size, ending mid-block, exactly on
    a boundary, or holding only a partial block; full blocks already shared (ref_count 2 or 3), other
    blocks in use that the clone must leave alone, n = 1 .. 5; fresh ids from a shuffled free list."""
    kinds = ["partial", "full", "only partial", "partial", "full", "partial", "partial", "full"]
    cases = []
    for kind, block_size in zip(kinds, [*rng.sample(BLOCK_SIZES, len(BLOCK_SIZES)), 4], strict=True):
        kind = "full" if block_size == 1 else kind  # with block_size 1 every block is full
        full = 0 if kind == "only partial" else rng.randint(1, 5)
        tail = 0 if kind == "full" else rng.randint(1, block_size - 1)
        ids = rng.sample(range(48), 48)
        parent = ids[: full + (tail > 0)]
        others = ids[len(parent) : len(parent) + rng.randint(0, 3)]
        counts = [[b, rng.choice([1, 1, 2, 3])] for b in parent[:full]] + [[b, 1] for b in parent[full:]]
        counts += [[b, rng.randint(1, 3)] for b in others]
        n = rng.randint(1, 5)
        fresh = ids[len(parent) + len(others) :][: 2 * n]  # twice what a clone takes
        cases.append(
            {"block_size": block_size, "num_tokens": full * block_size + tail, "parent": parent,
             "ref_counts": counts, "n": n, "fresh": fresh}
        )  # fmt: skip
    return cases


def observe_clone(fn, case) -> list[dict]:
    """``fn`` clones the parent once; what it returns, every ref count after, and how often it called
    ``alloc()`` (which hands out the case's fresh ids in order)."""
    counts = {b: c for b, c in case["ref_counts"]}
    fresh, taken = list(case["fresh"]), []

    def alloc() -> int:
        if not fresh:
            raise RuntimeError(f"alloc() called more than {len(case['fresh'])} times")
        taken.append(fresh.pop(0))
        counts[taken[-1]] = 1
        return taken[-1]

    call = (
        f"clone_table({case['parent']}, num_tokens={case['num_tokens']}, "
        f"block_size={case['block_size']}, n={case['n']})"
    )
    got = fn(list(case["parent"]), case["num_tokens"], case["block_size"], case["n"], counts, alloc)
    return [{"call": call, "returned": got, "ref_counts": dict(counts), "alloc() calls": len(taken)}]


def describe_clone(case: dict) -> str:
    shared = {b: c for b, c in case["ref_counts"]}
    return (
        f"block_size {case['block_size']}, parent {case['parent']} holding {case['num_tokens']} tokens, "
        f"n = {case['n']}, ref counts {shared}"
    )


def _prompt(rng, bases: list[list[int]], vocab: list[int], block_size: int) -> list[int]:
    """A prompt that often shares whole leading blocks with one of ``bases`` (a hit), sometimes only
    part of a block or nothing, then a tail of its own; never empty."""
    base = rng.choice(bases)
    cut = rng.choice([len(base), len(base) // block_size * block_size, rng.randint(0, len(base))])
    tokens = base[:cut] + [rng.choice(vocab) for _ in range(rng.randint(0, 2 * block_size))]
    return tokens or [rng.choice(vocab)]


def _pool_blocks(ops: list[list], needs: list[int], rng) -> int:
    """The pool for a run of ops: what every allocation could take at most, and 0 .. 3 to spare.
    Each ``drain`` op leaves exactly what the allocations after it could take."""
    for k, op in enumerate(ops):
        if op[0] == "drain":
            op[2] = sum(needs[k + 1 :])
    return max(1, sum(needs) + rng.randint(0, 3))


def draw_free(rng) -> list[dict]:
    """Runs of a scheduler's calls on one pool: requests admitted through the prefix cache (their
    prompts share whole blocks, and with 2 or 3 token ids equal blocks follow different prefixes),
    clones of 1 .. 3 children, another user taking every free block but what later calls need (which
    hands freed blocks out again, oldest first), and block tables given back in any order, shared or
    not; every block size."""
    cases = []
    for block_size in [*rng.sample(BLOCK_SIZES, len(BLOCK_SIZES)), rng.choice([1, 4])]:
        vocab = list(range(3, 3 + rng.choice([2, 3, 50])))
        bases = [[rng.choice(vocab) for _ in range(rng.randint(1, 4 * block_size))] for _ in range(2)]
        live, ops, needs, count = {}, [], [], 0  # live: name -> tokens held (None: not a sequence)
        for _ in range(rng.randint(5, 10)):
            kind = rng.choices(["admit", "clone", "free", "drain"], [4, 2, 4, 1])[0] if live else "admit"
            seqs = [name for name, n in live.items() if n is not None]
            if kind == "admit" or (kind == "clone" and not seqs):
                name, tokens = f"R{count}", _prompt(rng, bases, vocab, block_size)
                ops.append(["admit", name, tokens])
                live[name], need = len(tokens), blocks_needed(len(tokens), block_size)
            elif kind == "clone":
                parent = rng.choice(seqs)
                children = [f"C{count}.{k}" for k in range(1, rng.randint(2, 4))]
                ops.append(["clone", parent, live[parent], children])
                live.update({c: live[parent] for c in children})
                need = len(children) * (live[parent] % block_size > 0)
            elif kind == "free":
                name = rng.choice(sorted(live))
                ops.append(["free", name])
                del live[name]
                need = 0
            else:
                name = f"X{count}"
                ops.append(["drain", name, 0])  # its count is set by _pool_blocks
                live[name], need = None, 0
            count += 1
            needs.append(need)
        for name in rng.sample(sorted(live), rng.randint(0, len(live))):  # some finish at the end
            ops.append(["free", name])
            needs.append(0)
        num_blocks = _pool_blocks(ops, needs, rng)
        cases.append({"block_size": block_size, "num_blocks": num_blocks, "ops": ops})
    return cases


def _books_json(allocator: BlockAllocator) -> dict:
    """An allocator's books as JSON: ref counts, free list, the blocks keeping a key, the blocks the
    index points at, and a digest of every block's key and tokens and of the index."""
    books = [(b.hash, b.token_ids) for b in allocator.blocks], sorted(allocator.hash_to_block.items())
    return {
        "ref_counts": [b.ref_count for b in allocator.blocks],
        "free": list(allocator.free_blocks),
        "keyed": [b.block_id for b in allocator.blocks if b.hash is not None],
        "index": sorted(allocator.hash_to_block.values()),
        "keys": hashlib.sha256(repr(books).encode()).hexdigest()[:16],
    }


def observe_free(fn, case) -> list[dict]:
    """Run a case's calls on a ``BlockAllocator`` with ``fn`` as its ``free`` (every table given back
    goes through it); after each, the table the call made (if any) and the allocator's books."""
    allocator = type("YourFree", (BlockAllocator,), {"free": fn})(case["num_blocks"], case["block_size"])
    tables, steps = {}, []
    for op in case["ops"]:
        if op[0] == "admit":
            call, made = f"admitting {op[1]} ({len(op[2])} tokens)", _admit(allocator, op[2])
            tables[op[1]] = made
        elif op[0] == "clone":
            call = f"cloning {op[1]} ({op[2]} tokens) into {', '.join(op[3]) or 'nothing new'}"
            made, _ = allocator.clone(list(tables[op[1]]), op[2], len(op[3]))
            tables.update(zip(op[3], made, strict=True))
        elif op[0] == "drain":
            call = f"{op[1]} takes every free block but {op[2]}"
            made = tables[op[1]] = allocator.alloc_blocks(max(0, allocator.num_free - op[2]))
        else:
            table = tables.pop(op[1])
            call, made = f"free({table}) ({op[1]})", None
            allocator.free(list(table))
        steps.append({"call": call, "table": made, **_books_json(allocator)})
    return steps


def describe_ops(case: dict) -> str:
    words = {
        "admit": lambda op: f"admit {op[1]} ({len(op[2])} tokens)",
        "clone": lambda op: f"clone {op[1]} x{len(op[3])}",
        "drain": lambda op: f"{op[1]} takes all but {op[2]}",
        "free": lambda op: f"free {op[1]}",
        "free_split": lambda op: f"free {op[1]}, its first {op[2]} blocks first",
        "match": lambda op: f"match {len(op[1])} tokens",
        "collide": lambda op: "a forced key collision",
    }
    steps = ", ".join(words[op[0]](op) for op in case["ops"])
    return f"block_size {case['block_size']}, {case['num_blocks']} blocks: {steps}"


def draw_block_hashes(rng) -> list[dict]:
    """Token lists for every block size: empty, shorter than one block, exact multiples, a block
    repeated (its copies must get different keys), a tail left over, ids up to 49151."""
    kinds = ["empty", "short", "exact", "repeated", "tail", "tail", "repeated", "exact", "tail"]
    sizes = [*rng.sample(BLOCK_SIZES, len(BLOCK_SIZES)), rng.choice([2, 4]), rng.choice([1, 3])]
    cases = []
    for kind, block_size in zip(kinds, sizes, strict=False):
        high = rng.choice([9, 49151])
        if kind == "repeated":
            block = [rng.randint(0, high) for _ in range(block_size)]
            tokens = block * rng.randint(2, 4) + block[: rng.randint(0, block_size - 1)]
        else:
            blocks = {"empty": 0, "short": 0, "exact": rng.randint(1, 5), "tail": rng.randint(0, 5)}[kind]
            tail = rng.randint(1, block_size - 1) if kind in ("short", "tail") and block_size > 1 else 0
            tokens = [rng.randint(0, high) for _ in range(blocks * block_size + tail)]
        cases.append({"block_size": block_size, "tokens": tokens})
    return cases


def observe_block_hashes(fn, case) -> list[dict]:
    call = f"block_hashes({len(case['tokens'])} tokens, block_size={case['block_size']})"
    return [{"call": call, "returned": fn(list(case["tokens"]), case["block_size"])}]


def describe_block_hashes(case: dict) -> str:
    tokens = case["tokens"]
    shown = f"{tokens[:8]}"[:-1] + (", ...]" if len(tokens) > 8 else "]")
    return f"block_size {case['block_size']}, {len(tokens)} tokens {shown}"


def draw_match_prefix(rng) -> list[dict]:
    """Runs of calls on one pool: requests admitted through the learner's ``match_prefix``, finished
    (tables given back whole, or head first so that a request's first block is handed out before the
    rest), another user taking every free block but what later calls need, a forced key collision, and
    prompts to match: the cached ones again, cut on a block boundary, one token past it, with a block
    repeated, with one token changed, strangers; every block size."""
    cases = []
    for block_size in [*rng.sample(BLOCK_SIZES, len(BLOCK_SIZES)), rng.choice([1, 4])]:
        vocab = list(range(3, 3 + rng.choice([2, 3, 50])))
        bases = [[rng.choice(vocab) for _ in range(rng.randint(1, 4 * block_size))] for _ in range(2)]
        seen, live, ops, needs = [], {}, [], []
        for count in range(rng.randint(6, 11)):
            kind = rng.choices(["admit", "match", "free", "drain", "collide"], [3, 4, 2, 1, 1])[0]
            if kind in ("match", "collide") and not seen or kind == "free" and not live:
                kind = "admit"
            if kind == "admit":
                tokens = _prompt(rng, bases + seen, vocab, block_size)
                live[f"R{count}"] = tokens
                seen.append(tokens)
                op, need = ["admit", f"R{count}", tokens], blocks_needed(len(tokens), block_size)
            elif kind == "match":
                op, need = ["match", _query(rng, rng.choice(seen), vocab, block_size)], 0
            elif kind == "free":
                name = rng.choice(sorted(live))
                blocks = blocks_needed(len(live.pop(name)), block_size)
                split = blocks > 1 and rng.random() < 0.5
                op, need = (["free_split", name, rng.randint(1, blocks - 1)] if split else ["free", name]), 0
            elif kind == "drain":
                op, need = ["drain", f"X{count}", 0], 0  # its count is set by _pool_blocks
            else:  # a block holding other tokens under the key of a seen prompt's first block ...
                prompt = rng.choice(seen)
                if len(prompt) < block_size:
                    continue
                ops.append(_collision(prompt, block_size))
                needs.append(1)
                op, need = ["match", prompt], 0  # ... and that prompt, whose other blocks may still hit
            ops.append(op)
            needs.append(need)
        longest = max(seen, key=len)
        if len(cases) % 2 and len(longest) > 2 * block_size:  # a miss at block 0, then blocks that hit
            ops += [_collision(longest, block_size), ["match", longest]]
            needs += [1, 0]
        else:
            ops.append(["match", _query(rng, rng.choice(seen), vocab, block_size)])
            needs.append(0)
        num_blocks = _pool_blocks(ops, needs, rng)
        cases.append({"block_size": block_size, "num_blocks": num_blocks, "ops": ops})
    return cases


def _collision(prompt: list[int], block_size: int) -> list:
    """The op that registers a fresh block under the key of ``prompt``'s first block, holding other
    tokens (each id + 1): a 64-bit key collision, forced."""
    return ["collide", prompt[:block_size], [t + 1 for t in prompt[:block_size]]]


def _query(rng, prompt: list[int], vocab: list[int], block_size: int) -> list[int]:
    """A prompt to match against one already seen: the same, cut on a block boundary (the last token's
    block must not match), one token past a boundary, a stranger's tail, its first block twice, or one
    token changed; never empty."""
    full = len(prompt) // block_size
    k = rng.randint(1, full) if full else 0
    stranger = [rng.choice(vocab) + 50 for _ in range(rng.randint(1, block_size + 1))]
    pick = rng.choice(["same", "boundary", "past", "stranger", "twice", "changed"])
    tokens = {
        "same": prompt,
        "boundary": prompt[: k * block_size],
        "past": prompt[: k * block_size + 1],
        "stranger": prompt[: k * block_size] + stranger,
        "twice": prompt[:block_size] * 2 + stranger[:1],
        "changed": prompt[:],
    }[pick]
    if pick == "changed":
        at = rng.randrange(len(tokens))
        tokens[at] += 50
    return tokens or stranger


def observe_match_prefix(fn, case) -> list[dict]:
    """Run a case's calls on a ``BlockAllocator``; every request is admitted with the blocks ``fn``
    finds, and every "match" only asks ``fn``. After each call: what ``fn`` returned, whether that call
    left the allocator as it was, the block table a call made, and the free list."""
    allocator = BlockAllocator(case["num_blocks"], case["block_size"])
    tables, steps = {}, []
    for op in case["ops"]:
        returned = unchanged = made = None
        if op[0] in ("admit", "match"):
            tokens = op[2] if op[0] == "admit" else op[1]
            before = _books(allocator)
            returned = fn(list(tokens), allocator)
            unchanged = _books(allocator) == before
            call = f"match_prefix({len(tokens)} tokens{' of ' + op[1] if op[0] == 'admit' else ''})"
            if op[0] == "admit":
                seq = Sequence(0, list(tokens), 1)
                allocate_slots(seq, allocator, len(tokens), list(returned))  # it takes what was found
                made = tables[op[1]] = seq.block_table
        elif op[0] in ("free", "free_split"):
            table = tables.pop(op[1])
            head = op[2] if op[0] == "free_split" else len(table)
            call = (
                f"free({table[:head]})" + (f", free({table[head:]})" if table[head:] else "") + f" ({op[1]})"
            )
            allocator.free(table[:head])
            if table[head:]:
                allocator.free(table[head:])
        elif op[0] == "drain":
            call = f"{op[1]} takes every free block but {op[2]}"
            made = allocator.alloc_blocks(max(0, allocator.num_free - op[2]))
        else:
            (block,) = made = allocator.alloc_blocks(1)
            call = f"block {block} registered under the key of {op[1]}, holding {op[2]}"
            allocator.register(block, block_hash(None, op[1]), op[2])
        steps.append({"call": call, "returned": returned, "unchanged": unchanged, "table": made,
                      "free": list(allocator.free_blocks)})  # fmt: skip
    return steps


def draw_fork(rng) -> list[dict]:
    """Beam searches of width 2 .. 5 over 2 .. 6 steps on every block size, from one beam (the
    prompt's) forking at step 1, then random parents (beams dropped, some continued by several, one
    step where all continue one beam); prompts ending mid-block or on a boundary, a first block
    already shared with another request, other blocks in use, fresh ids from a shuffled list."""
    cases = []
    for block_size in [*rng.sample(BLOCK_SIZES, len(BLOCK_SIZES)), 4]:
        width, num_steps = rng.randint(2, 5), rng.randint(2, 6)
        prompt = rng.randint(1, 5) * block_size + rng.choice([0, rng.randint(0, block_size - 1)])
        prompt = max(prompt, 1)
        ids = rng.sample(range(128), 128)
        parent = ids[: blocks_needed(prompt, block_size)]
        others = ids[len(parent) : len(parent) + rng.randint(0, 3)]
        counts = [[b, 1] for b in parent] + [[b, rng.randint(1, 3)] for b in others]
        if prompt >= block_size and rng.random() < 0.5:
            counts[0][1] = 2  # the first block is a prefix-cache hit, held by another request too
        steps = [[0] * width]
        for _ in range(num_steps - 1):
            one = rng.random() < 0.2
            steps.append(
                [rng.randrange(width)] * width if one else [rng.randrange(width) for _ in range(width)]
            )
        cases.append(
            {"block_size": block_size, "num_tokens": prompt, "parent": parent, "ref_counts": counts,
             "steps": steps, "fresh": ids[len(parent) + len(others) :]}
        )  # fmt: skip
    return cases


def observe_fork(fn, case) -> list[dict]:
    """``fn`` re-points the tables at every step of the case; after each, what it returned and every
    block's count (blocks at 0 left out). Between steps each beam runs its new token: a table that
    needs one more block gets the next fresh id, as ``alloc()`` hands them out."""
    counts = {b: c for b, c in case["ref_counts"]}
    fresh, bs = list(case["fresh"]), case["block_size"]

    def alloc() -> int:
        if not fresh:
            raise RuntimeError(f"alloc() called more than {len(case['fresh'])} times")
        counts[fresh[0]] = 1
        return fresh.pop(0)

    tables, num_tokens, steps = [list(case["parent"])], case["num_tokens"], []
    for survivors in case["steps"]:
        call = f"fork_beams({tables}, num_tokens={num_tokens}, block_size={bs}, survivors={survivors})"
        got = fn([list(t) for t in tables], num_tokens, bs, list(survivors), counts, alloc)
        steps.append(
            {"call": call, "returned": got, "ref_counts": sorted([b, c] for b, c in counts.items() if c)}
        )
        tables, num_tokens = [list(t) for t in got], num_tokens + 1
        for t in tables:
            while len(t) < blocks_needed(num_tokens, bs):
                t.append(alloc())
    return steps


def describe_fork(case: dict) -> str:
    return (
        f"block_size {case['block_size']}, a {case['num_tokens']}-token prompt in {case['parent']}, "
        f"ref counts {dict(case['ref_counts'])}, survivors' parents per step {case['steps']}"
    )


def _trace(rng, block_size: int, count: int) -> list[list[int]]:
    """``count`` prompts that share whole leading blocks with earlier ones (or with two bases), cut
    anywhere, with tails of their own; a small vocabulary makes equal blocks after other prefixes."""
    vocab = list(range(3, 3 + rng.choice([2, 3, 50])))
    bases = [[rng.choice(vocab) for _ in range(rng.randint(1, 4 * block_size))] for _ in range(2)]
    prompts: list[list[int]] = []
    for _ in range(count):
        prompts.append(_prompt(rng, bases + prompts, vocab, block_size))
    return prompts


def _traps(rng, block_size: int) -> list[list[int]]:
    """Prompts where the rules matter: a block x, then x twice (the same tokens after another prefix),
    then x twice exactly (the block of the last token), then a three-block prompt twice."""
    x = [rng.randint(3, 60) for _ in range(block_size)]
    longer = [rng.randint(3, 60) for _ in range(3 * block_size + 1)]
    return [[*x, 1], [*x, *x, 2], x * 2, x * 2, longer, longer]


def _error_case(rng, case: dict) -> dict:
    """One of the cases that must raise ValueError: block_size 0, capacity -1 (if any), an empty prompt."""
    kind = rng.choice(["block_size", "capacity", "empty"] if "capacity" in case else ["block_size", "empty"])
    if kind == "empty":
        case["prompts"].insert(rng.randrange(len(case["prompts"]) + 1), [])
    else:
        case[kind] = rng.choice([0, -1]) if kind == "block_size" else -1
    return case


def draw_lru(rng) -> list[dict]:
    """Traces of 3 .. 9 requests on every block size, room for 0 .. 12 blocks (often less than a
    trace's blocks), and one call that must raise ValueError."""
    cases = []
    for block_size in [*rng.sample(BLOCK_SIZES, len(BLOCK_SIZES)), rng.choice([1, 2])]:
        prompts = _trace(rng, block_size, rng.randint(3, 9))
        capacity = rng.choice([0, 1, 2, 3, 5, 8, 12])
        cases.append({"prompts": prompts, "block_size": block_size, "capacity": capacity})
    block_size = rng.choice([1, 2, 3, 4])
    cases.append(
        {"prompts": _traps(rng, block_size), "block_size": block_size, "capacity": rng.choice([2, 3])}
    )
    cases.append(_error_case(rng, {"prompts": _trace(rng, 2, 3), "block_size": 2, "capacity": 4}))
    return cases


def observe_lru(fn, case) -> list[dict]:
    call = f"lru_hits({len(case['prompts'])} prompts, block_size={case['block_size']}, capacity={case['capacity']})"
    got = outcome(fn, [list(p) for p in case["prompts"]], case["block_size"], case["capacity"])
    return [{"call": call, "result": describe(got)}]


def describe_trace(case: dict) -> str:
    lengths = [len(p) for p in case["prompts"]]
    room = f", room for {case['capacity']} blocks" if "capacity" in case else ""
    return f"block_size {case['block_size']}{room}, prompts of {lengths} tokens"


def draw_held(rng) -> list[dict]:
    """Requests that share whole leading blocks with earlier ones, cut anywhere (the block of a
    prompt's last token, an earlier prompt's partial block), every block size, and one call that must
    raise ValueError."""
    cases = []
    for block_size in [*rng.sample(BLOCK_SIZES, len(BLOCK_SIZES)), rng.choice([2, 4])]:
        cases.append({"prompts": _trace(rng, block_size, rng.randint(2, 8)), "block_size": block_size})
    block_size = rng.choice([1, 2, 3, 4])
    cases.append({"prompts": _traps(rng, block_size), "block_size": block_size})
    cases.append(_error_case(rng, {"prompts": _trace(rng, 4, 3), "block_size": 4}))
    return cases


def observe_held(fn, case) -> list[dict]:
    call = f"blocks_held({len(case['prompts'])} prompts, block_size={case['block_size']})"
    return [
        {
            "call": call,
            "result": describe(outcome(fn, [list(p) for p in case["prompts"]], case["block_size"])),
        }
    ]


HIDDEN = {
    "L5.1": Hidden(
        draw_clone, observe_clone, describe_clone, answers=("L5_clones.allocator:BlockAllocator.clone",)
    ),
    "L5.2": Hidden(
        draw_free, observe_free, describe_ops, answers=("L5_clones.allocator:BlockAllocator.free",)
    ),
    "L5.3": Hidden(
        draw_block_hashes,
        observe_block_hashes,
        describe_block_hashes,
        answers=("L5_clones.prefix_cache:register_full_blocks",),
    ),
    "L5.4": Hidden(
        draw_match_prefix,
        observe_match_prefix,
        describe_ops,
        answers=("L5_clones.prefix_cache:match_prefix",),
    ),
    "L5.5": Hidden(
        draw_fork,
        observe_fork,
        describe_fork,
        answers=(
            "L5_clones.beams.fork:fork",
            "L5_clones.allocator:BlockAllocator.clone",
            "L5_clones.allocator:BlockAllocator.free",
        ),
    ),
    "L5.6": Hidden(draw_lru, observe_lru, describe_trace, answers=("L5_clones.prefix_cache:match_prefix",)),
    "L5.7": Hidden(
        draw_held,
        observe_held,
        describe_trace,
        answers=("L5_clones.prefix_cache:match_prefix", "L5_clones.sequence:allocate_slots"),
    ),
    "L5.8": catch_hidden(
        ALLOCATOR,
        CATCH_ALL,
        watch=tuple(
            f"{ALLOCATOR}.{name}"
            for name in ("alloc_blocks", "_take_free", "free", "lookup", "register", "clone")
        ),
    ),
    "L5.9": Hidden(
        draw=lambda rng: [{"key": key} for key in rng.sample(PREDICT_KEYS, len(PREDICT_KEYS))],
        observe=lambda fn, case: fn()[case["key"]],
        describe=lambda case: f"the notebook's operations: {case['key']}",
        answers=(
            f"{ALLOCATOR}.alloc_blocks",
            f"{ALLOCATOR}.free",
            f"{ALLOCATOR}.clone",
            "L5_clones.prefix_cache:match_prefix",
            "L5_clones.sequence:allocate_slots",
        ),
        explain=unrevealed,  # the report names the key, never its right value
    ),
}
