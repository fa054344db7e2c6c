"""The L5 notebook's exercise checkers: the learner's sharing pieces against this stage's own code.

- ``check_fork_table``: a fork's block tables and reference counts, against ``BlockAllocator.fork``
  (``allocator.py``);
- ``check_copy_block``: copying a partial block's K/V for a child, against ``KvPool.copy_block``
  (``cache.py``);
- ``check_block_hashes``: the chained keys of a token list's full blocks, against the keys ``reserve``
  (``sequence.py``, through ``prefix_cache.register_full_blocks``) registers in a ``BlockAllocator``.

The grading contract (see ``kvcourse/grading.py``): each checker runs fixed, seeded cases and prints
one deterministic line per case (``ok``, ``WRONG — what differs``, or ``raised`` and the exception),
then ``k/n passed``. The reference notebook stores those lines as the check cell's output and
``make grade`` compares them. The references are the stage's own code, never a copy kept here.

Left out on purpose: partial credit and hints; the fork is graded on its bookkeeping only (the K/V
copy is ``check_copy_block``), with enough free blocks for every case.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvcourse.grading import Case, run_cases, tensor_problem

from .allocator import BlockAllocator, blocks_needed
from .cache import KvPool
from .sequence import Sequence, reserve


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
    (its count + n); a partial last block gets a fresh block per child (its K/V copy is the next
    exercise). Example, block_size 4, parent [3, 5, 8] holding 10 tokens, n = 2, fresh blocks 0, 1:
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


def check_copy_block(copy_block: Callable) -> None:
    """Grade ``copy_block(k, v, src, dst)`` against ``KvPool.copy_block``.

    ``k`` and ``v`` are a pool's tensors, (L, num_blocks, block_size, H_kv, D); block ``src``'s K and V
    must be copied into block ``dst`` in place, in every layer, leaving every other block (and ``src``)
    untouched. Example: 2 layers, src 3, dst 0: k[0, 0] and k[1, 0] become k[0, 3] and k[1, 3].
    """

    def block_problem(what: str, expected: torch.Tensor, got: torch.Tensor) -> str | None:
        problem = tensor_problem(what, expected.transpose(0, 1), got.transpose(0, 1))  # rows = blocks
        return problem and problem.replace(" at positions ", " in blocks ")

    def case(layers: int, num_blocks: int, block_size: int, heads: int, src: int, dst: int, seed: int):
        def run() -> str | None:
            gen = torch.Generator().manual_seed(seed)
            ref = KvPool(layers, num_blocks, block_size, heads, 4)
            ref.k.copy_(torch.randn(ref.k.shape, generator=gen))  # (L, N, B, H_kv, D)
            ref.v.copy_(torch.randn(ref.v.shape, generator=gen))
            k, v = ref.k.clone(), ref.v.clone()
            ref.copy_block(src, dst)
            copy_block(k, v, src, dst)
            return block_problem("K", ref.k, k) or block_problem("V", ref.v, v)

        return run

    run_cases(
        [
            Case("1 layer, 6 blocks of 4, block 3 -> block 0", case(1, 6, 4, 2, 3, 0, seed=1)),
            Case("2 layers, 8 blocks of 4, block 1 -> block 6", case(2, 8, 4, 3, 1, 6, seed=2)),
            Case(
                "4 layers, 5 blocks of 16, block 4 -> block 2 (every layer)", case(4, 5, 16, 3, 4, 2, seed=3)
            ),
            Case("3 layers, block_size 1, block 0 -> block 9", case(3, 10, 1, 1, 0, 9, seed=4)),
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

    gen = torch.Generator().manual_seed(5)
    system = torch.randint(3, 49152, (32,), generator=gen).tolist()
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
