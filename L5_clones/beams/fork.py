"""The books of a beam-search step: the beams' block tables re-pointed, and the block copies that takes.

Survivor i of a step continues beam ``parents[i]``. ``fork`` drops every beam no survivor continues
(its table freed: a block a sibling shares only loses a reference), gives a beam's first survivor that
beam's table as it is, and each further survivor a ``BlockAllocator.clone`` of it: its full blocks
shared, its partial last block copied into a fresh one. It returns the survivors' tables and the
(src, dst) block copies; the engine copies the K/V (``KvPool.copy_block``). Most candidates die a step
after they are born, which is why the blocks of their common history must be shared, not copied.

``fork_needs`` says beforehand how many free blocks a fork takes beyond what its drops give back, so
that the scheduler can make room first (``Scheduler._make_room``): ``fork`` itself never runs short.

Both are pure bookkeeping on the allocator: no sequence, no tensor. Left out on purpose: sharing the
partial block too and copying it at the first write (copy-on-write; see ``BlockAllocator.clone``).
"""

from __future__ import annotations

from collections import Counter

from ..allocator import BlockAllocator


def fork(
    allocator: BlockAllocator, tables: list[list[int]], num_tokens: int, parents: list[int]
) -> tuple[list[list[int]], list[tuple[int, int]]]:
    """The survivors' block tables, survivor i continuing beam ``parents[i]`` whose table is
    ``tables[parents[i]]`` (every beam holds ``num_tokens`` positions), and the block copies to make.

    Example, block_size 4, beams 0 and 1 with 10 positions each in [3, 5, 8] and [3, 5, 9] (ref counts
    2, 2, 1, 1), free list [0], parents [0, 0]: beam 1 is dropped and frees 9 (3 and 5 go down to 1;
    free list [0, 9]); survivor 0 keeps [3, 5, 8]; survivor 1 is a clone, [3, 5, 0], 8's rows to be
    copied into 0 (3 and 5 back up to 2):

        fork(allocator, [[3, 5, 8], [3, 5, 9]], 10, [0, 0]) -> ([[3, 5, 8], [3, 5, 0]], [(8, 0)])
    """
    for j, table in enumerate(tables):
        if j not in parents:  # dropped: one reference less on every block it held
            allocator.free(table)
    new, copies = [], []
    for i, j in enumerate(parents):
        if j in parents[:i]:  # a further survivor of beam j: a clone of its table
            [table], copy = allocator.clone(tables[j], num_tokens, 1)
            new.append(table)
            copies += copy
        else:  # the first survivor of beam j takes its table
            new.append(tables[j])
    return new, copies


def fork_needs(
    allocator: BlockAllocator, tables: list[list[int]], num_tokens: int, parents: list[int]
) -> int:
    """Free blocks ``fork`` takes beyond what its drops give back (0 if they give back enough): a copy
    of the partial last block per further survivor, less the blocks that only dropped beams hold.

    Example, ``fork``'s: one further survivor of a beam ending mid-block takes 1 block, and dropping
    beam 1 gives back block 9 (3 and 5 stay held by beam 0): 1 - 1 = 0.
    """
    dropped = Counter(b for j, table in enumerate(tables) if j not in parents for b in table)
    given_back = sum(allocator.blocks[b].ref_count == held for b, held in dropped.items())
    clones = len(parents) - len(set(parents))
    return max(0, allocator.clone_needs(num_tokens, clones) - given_back)
