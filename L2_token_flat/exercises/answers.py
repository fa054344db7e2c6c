"""Independent answers to the L2 exercises, for the grader's hidden cases (``kvcourse/grading/hidden.py``).

Each function has the signature the notebook asks for and is written apart from the stage's own
code (``allocator.py``, ``sequence.py``), so a bug in the stage cannot make a wrong answer pass:
the free list is a plain Python list here, and ``reserve`` counts blocks with a loop. Tests check
that the stage and these answers agree on many drawn cases.

``EXPECT`` maps each exercise to ``case -> observation``: the exercise's ``observe`` (``checks.py``)
run on the answer. The grader imports this file; a submission's sandbox cannot read it.

Left out on purpose: error messages (only the error's type is graded).
"""

from __future__ import annotations

from ..allocator import OutOfBlocksError
from .checks import HIDDEN


def alloc_blocks(self, n):
    """The first ``n`` ids of the free list, all or none."""
    if n < 0:
        raise ValueError(n)
    free = list(self.free_blocks)
    if len(free) < n:
        raise OutOfBlocksError(needed=n, free=len(free))
    taken, rest = free[:n], free[n:]
    self.free_blocks.clear()
    self.free_blocks.extend(rest)
    self.owned |= set(taken)
    return taken


def free(self, blocks):
    """Append ``blocks`` to the free list, unless any id is outside the pool, free, or repeated."""
    if any(not 0 <= b < self.num_blocks for b in blocks):
        raise ValueError(blocks)
    if len(set(blocks)) != len(blocks) or not set(blocks) <= self.owned:
        raise ValueError(blocks)
    self.owned -= set(blocks)
    self.free_blocks.extend(blocks)


def reserve(seq, allocator, target_len):
    """Add blocks until ``target_len`` positions fit; slots of every new block's rows."""
    size = allocator.block_size
    have = len(seq.block_table)
    need = 0
    while (have + need) * size < target_len:
        need += 1
    new = allocator.alloc_blocks(need)
    for b in new:
        seq.block_table.append(b)
        seq.slot_indices += [b * size + row for row in range(size)]


ANSWERS = {"L2.1": alloc_blocks, "L2.2": free, "L2.3": reserve}
EXPECT = {ex: (lambda case, ex=ex: HIDDEN[ex].observe(ANSWERS[ex], case)) for ex in ANSWERS}
