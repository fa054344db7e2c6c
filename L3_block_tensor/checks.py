"""The L3 notebook's exercise checkers: the learner's function against this stage's own code.

- ``check_slots``: pool slots from a block table, against ``slots`` (``sequence.py``);
- ``check_plan_step``: how many tokens each sequence runs in one step, against what
  ``Scheduler.schedule`` (``scheduler.py``) plans for the same queues.

The grading contract (see ``kvcourse/grading.py``): each checker runs fixed cases and prints one
deterministic line per case (``ok``, ``WRONG — what differs``, or ``raised`` and the exception), then
``k/n passed``. The reference notebook stores those lines as the check cell's output and ``make grade``
compares them. The references are the stage's own code, never a copy kept here.

Left out on purpose: partial credit and hints; ``plan_step`` is graded with plenty of free blocks,
so preemption is not part of it.
"""

from __future__ import annotations

from collections.abc import Callable

from kvcourse.grading import Case, run_cases

from .allocator import BlockAllocator
from .scheduler import Scheduler
from .sequence import Sequence, Status, reserve
from .sequence import slots as ref_slots


def check_slots(slots: Callable) -> None:
    """Grade ``slots(block_table, start, end, block_size) -> list of slot ids`` against this stage's
    ``slots``. Example: block table [7, 2], block_size 4, positions 2..5 -> [30, 31, 8, 9]."""

    def case(block_table: list[int], start: int, end: int, block_size: int) -> Callable[[], str | None]:
        def run() -> str | None:
            expected = ref_slots(block_table, start, end, block_size)
            got = slots(list(block_table), start, end, block_size)
            if not isinstance(got, list | tuple):
                return f"returned {got!r}, expected a list of {len(expected)} slot ids"
            got = [int(s) for s in got]
            return None if got == expected else f"expected {expected}, got {got}"

        return run

    run_cases(
        [
            Case("block table [7, 2], block_size 4, positions 2..5", case([7, 2], 2, 6, 4)),
            Case("a whole prefill: [3, 0, 5], block_size 4, positions 0..9", case([3, 0, 5], 0, 10, 4)),
            Case("one decode token at position 16, block_size 16", case([4, 9], 16, 17, 16)),
            Case("block_size 1: the table is the slot list", case([5, 2, 8], 0, 3, 1)),
            Case("block_size 7: positions 6..8 cross a block edge", case([1, 4], 6, 9, 7)),
            Case("no positions (start == end)", case([0], 3, 3, 4)),
        ]
    )


def check_plan_step(plan_step: Callable) -> None:
    """Grade ``plan_step(running, waiting, max_num_batched_tokens, prefill_chunk_size, max_num_seqs)``
    against what ``Scheduler.schedule`` does with plenty of free blocks.

    ``running`` and ``waiting`` give, for each sequence in scheduling order, the tokens it has not
    computed yet (1 for a sequence that is decoding). The answer is two lists of the same lengths: the
    tokens each sequence runs this step, 0 for one that does not run. Example with budget 8, chunk 4,
    max_num_seqs 4: running [1, 1], waiting [10, 3] -> ([1, 1], [4, 2]).
    """

    def expected(running, waiting, budget, chunk, max_seqs):
        sched = Scheduler(
            BlockAllocator(256, 4),
            max_num_seqs=max_seqs,
            max_num_batched_tokens=budget,
            prefill_chunk_size=chunk,
        )
        seqs = []
        for i, todo in enumerate(running):  # a running sequence: prompt of 20, todo left to compute
            seq = Sequence(i, [1] * 20, 8)
            seq.num_computed_tokens = 20 - todo
            reserve(seq, sched.allocator, seq.num_computed_tokens)
            seq.status = Status.RUNNING
            sched.running.append(seq)
            seqs.append(seq)
        for j, todo in enumerate(waiting):
            seq = Sequence(len(running) + j, [1] * todo, 8)
            sched.add(seq)
            seqs.append(seq)
        planned = {seq.request_id: n for seq, n in sched.schedule()}
        counts = [planned.get(s.request_id, 0) for s in seqs]
        return counts[: len(running)], counts[len(running) :]

    def case(running, waiting, budget, chunk, max_seqs) -> Callable[[], str | None]:
        def run() -> str | None:
            want = expected(running, waiting, budget, chunk, max_seqs)
            got = plan_step(list(running), list(waiting), budget, chunk, max_seqs)
            if not isinstance(got, tuple | list) or len(got) != 2:
                return f"returned {got!r}, expected two lists (running, waiting)"
            got = (list(got[0]), list(got[1]))
            return (
                None
                if got == want
                else f"expected running {want[0]}, waiting {want[1]}; got {got[0]}, {got[1]}"
            )

        return run

    run_cases(
        [
            Case("decodes and a chunked prompt: budget 8, chunk 4", case([1, 1], [10, 3], 8, 4, 4)),
            Case("no chunking: a prompt runs whole or waits", case([1, 1, 1], [6, 2], 8, None, 8)),
            Case("no chunking: nobody jumps the queue", case([1], [9, 2], 8, None, 8)),
            Case("a running prefill continues by chunks", case([7, 1], [5], 6, 4, 4)),
            Case("max_num_seqs stops admission", case([1, 1, 1], [2, 2], 16, 8, 4)),
            Case("the budget runs out among running requests", case([5, 5, 1], [3], 6, 5, 8)),
        ]
    )
