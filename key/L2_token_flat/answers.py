"""Independent answers to the L2 exercises, for the grader's hidden cases (``kvcourse/grading/hidden.py``).

Each function has the signature the notebook asks for and is written apart from the stage's own
code (``allocator.py``, ``sequence.py``), so a bug in the stage cannot make a wrong answer pass:
the free list is a plain Python list here, and ``allocate_slots`` counts blocks with a loop. ``pick_adjacent``
rebuilds the runs of free ids from a set, ``compaction_moves`` moves chains before cycles,
``test_allocator`` is a test that catches every allocator bug of L2.6, and ``predict`` was worked out by
hand. Tests check
that the stage and these answers agree on many drawn cases.

``EXPECT`` maps each exercise to ``case -> observation``: the exercise's ``observe`` (``exercises/L2_token_flat/checks.py``)
run on the answer. ``STAGE_ADAPTERS`` give L2.6 and L2.7 answers made of the stage's own code (a test
that compares with the stage's allocator; the operations run), for the tests; L2.4 and L2.5 have no
stage implementation. The grader imports this file; a submission's sandbox cannot read it.

Left out on purpose: error messages (only the error's type is graded).
"""

from __future__ import annotations

from exercises.L2_token_flat.checks import HIDDEN
from L2_token_flat.allocator import OutOfBlocksError


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


def allocate_slots(seq, allocator, target_len):
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


def pick_adjacent(free_blocks, table, n):
    """Extend the table's last block upward, then the first run that fits, else the longest run whole."""
    if n < 0:
        raise ValueError(n)
    if n > len(free_blocks):
        raise OutOfBlocksError(needed=n, free=len(free_blocks))
    left, picked = set(free_blocks), []
    last = table[-1] if table else None
    while last is not None and len(picked) < n and last + 1 in left:
        last += 1
        picked.append(last)
        left.discard(last)
    while len(picked) < n:
        runs = []  # [start, length] of every run of consecutive free ids, by start
        for b in sorted(left):
            if runs and runs[-1][0] + runs[-1][1] == b:
                runs[-1][1] += 1
            else:
                runs.append([b, 1])
        want = n - len(picked)
        fits = [r for r in runs if r[1] >= want]
        start, length = fits[0] if fits else max(runs, key=lambda r: (r[1], -r[0]))
        take = list(range(start, start + min(want, length)))
        picked += take
        left -= set(take)
    return picked


def compaction_moves(tables, num_blocks):
    """Moves along chains first (into blocks nobody needs), then each cycle through one spare block."""
    goal, offset = {}, 0  # block -> where its contents must end up
    for table in tables:
        for j, b in enumerate(table):
            goal[b] = offset + j
        offset += len(table)
    pending = {b: d for b, d in goal.items() if b != d}
    moves = []
    progress = True
    while progress:  # a chain: move a block whose destination holds nothing still needed
        progress = False
        for b in sorted(pending):
            if pending[b] not in pending:
                moves.append((b, pending.pop(b)))
                progress = True
    if not pending:
        return moves
    spare = [b for b in range(num_blocks) if b not in pending and b not in goal.values()]
    if not spare:
        raise ValueError(f"no spare block among {num_blocks} to break a cycle of moves")
    temp = spare[0]
    came_from = {d: b for b, d in pending.items()}
    while pending:
        first = min(pending)
        moves.append((first, temp))
        cur = first
        while came_from[cur] != first:
            moves.append((came_from[cur], cur))
            pending.pop(came_from[cur])
            cur = came_from[cur]
        moves.append((temp, pending.pop(first)))
    return moves


def test_allocator(BlockAllocator):
    """A test that fails every allocator bug of the exercise: order, books, all or nothing, checks."""
    a = BlockAllocator(4, 2)
    assert a.alloc_blocks(3) == [0, 1, 2]
    a.free([1])
    assert list(a.free_blocks) == [3, 1]
    assert a.alloc_blocks(2) == [3, 1]
    try:
        a.alloc_blocks(1)
        raise AssertionError("alloc_blocks(1) with nothing free did not raise")
    except OutOfBlocksError:
        pass
    a.free([0, 2])
    assert list(a.free_blocks) == [0, 2]
    for bad in ([0], [3, 3], [1, 9], [3, 0]):
        before = list(a.free_blocks), set(a.owned)
        try:
            a.free(bad)
            raise AssertionError(f"free({bad}) did not raise")
        except ValueError:
            pass
        assert (list(a.free_blocks), set(a.owned)) == before, bad
    b = BlockAllocator(3, 2)
    b.alloc_blocks(1)
    try:
        b.alloc_blocks(3)
        raise AssertionError("alloc_blocks(3) with 2 free did not raise")
    except OutOfBlocksError:
        pass
    assert list(b.free_blocks) == [1, 2]


def predict():
    """Worked out by hand from the operations in the notebook (block_size 4, 6 blocks)."""
    return {
        "a block_table": [0, 1, 3],
        "c block_table": [4, 5, 2],
        "slot of c's position 5": 21,
        "exception of allocate_slots(a, 13)": "OutOfBlocksError",
        "free list": [0, 1, 3],
    }


def oracle_test(Subject):
    """L2.6 as the stage's code answers it: the subject run beside the stage's ``BlockAllocator`` on one
    sequence of calls, comparing results and books after each."""
    from L2_token_flat.allocator import BlockAllocator

    ours, stage = Subject(5, 4), BlockAllocator(5, 4)
    calls = [("alloc_blocks", 2), ("free", [0]), ("alloc_blocks", 4), ("free", [1, 3]), ("free", [0, 0]),
             ("free", [1]), ("free", [2, 7]), ("free", [2, 3]), ("alloc_blocks", 3)]  # fmt: skip
    for op, arg in calls:
        results = []
        for allocator in (ours, stage):
            try:
                results.append(("returned", getattr(allocator, op)(arg)))
            except (OutOfBlocksError, ValueError) as e:
                results.append(("raised", type(e)))
        assert results[0] == results[1], (op, arg, results)
        assert (list(ours.free_blocks), ours.owned) == (list(stage.free_blocks), stage.owned), (op, arg)


def predict_by_running():
    """L2.7 as the stage's code answers it: the operations run (``prediction_state`` of ``exercises/L2_token_flat/checks.py``)."""
    from exercises.L2_token_flat.checks import prediction_state

    return prediction_state()


ANSWERS = {
    "L2.1": alloc_blocks,
    "L2.2": free,
    "L2.3": allocate_slots,
    "L2.4": pick_adjacent,
    "L2.5": compaction_moves,
    "L2.6": test_allocator,
    "L2.7": predict,
}
EXPECT = {ex: (lambda case, ex=ex: HIDDEN[ex].observe(ANSWERS[ex], case)) for ex in ANSWERS}
STAGE_ADAPTERS = {"L2.6": oracle_test, "L2.7": predict_by_running}
