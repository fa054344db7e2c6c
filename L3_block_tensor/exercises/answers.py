"""Independent answers to the L3 exercises, for the grader's hidden cases (``kvcourse/grading/hidden.py``).

Each function has the signature the notebook asks for and is written apart from the stage's own
code (``sequence.py``, ``scheduler.py``), so a bug in the stage cannot make a wrong answer pass:
``slots`` lists every slot of the table and cuts the range out of it, ``plan_step`` hands out seats
and budget from plain counters, ``preempt`` picks its victim with ``max`` over the scheduling order
and inserts it into ``waiting`` by hand, ``admitted`` adds up each policy's blocks with its own
arithmetic. Tests check that the stage and these answers agree on many
drawn cases.

``EXPECT`` maps each exercise to ``case -> observation``: the exercise's ``observe`` (``checks.py``)
run on the answer. ``STAGE_ADAPTERS`` give the stage's own implementations the learner's signatures
(``Scheduler.schedule`` as ``plan_step``, ``Scheduler._preempt`` as ``preempt``), for the tests. The
grader imports this file; a submission's sandbox cannot read it.

Left out on purpose: error messages (only the error's type is graded).
"""

from __future__ import annotations

import math

from ..scheduler import Scheduler
from ..sequence import Status
from .checks import HIDDEN, scheduler_admitted, scheduler_plan


def slots(block_table, start, end, block_size):
    """Every slot the table holds, in position order, then positions start .. end - 1 of them."""
    every = []
    for block in block_table:
        every += range(block * block_size, (block + 1) * block_size)
    return every[start:end]


def plan_step(running, waiting, max_num_batched_tokens, prefill_chunk_size, max_num_seqs):
    """Running requests take their share of the budget in turn; waiting ones follow while a seat and
    a share are left."""

    def share(todo, left):  # the tokens a request runs with ``left`` of the budget
        if prefill_chunk_size is None:
            return todo if todo <= left else 0  # all or nothing
        return min(todo, prefill_chunk_size, left)

    left = max_num_batched_tokens
    ran = []
    for todo in running:
        ran.append(share(todo, left))
        left -= ran[-1]
    admitted = [0] * len(waiting)
    seats = max_num_seqs - len(running)
    for i, todo in enumerate(waiting):
        n = share(todo, left)
        if seats <= 0 or n == 0:
            break  # nobody behind it is admitted either
        admitted[i] = n
        left -= n
        seats -= 1
    return ran, admitted


def preempt(running, waiting, allocator):
    """The running request last in scheduling order gives back its blocks and waits again."""
    victim = max(running, key=lambda seq: (-seq.priority, seq.request_id))
    running.remove(victim)
    allocator.free(list(victim.block_table))
    victim.block_table = []
    victim.num_computed_tokens = 0
    victim.status = Status.WAITING
    key = (-victim.priority, victim.request_id)
    at = next((i for i, seq in enumerate(waiting) if (-seq.priority, seq.request_id) > key), len(waiting))
    waiting.insert(at, victim)
    return victim


def admitted(policy, requests, num_blocks, block_size, max_model_len):
    """Requests are admitted in order while the free blocks cover what each holds from admission:
    its prompt's blocks (paged), or its whole reservation (Oracle: its length; Pow2: the next power of
    two, at most max_model_len; Max: max_model_len)."""
    free, count = num_blocks, 0
    for prompt_len, max_new in requests:
        length = prompt_len + max_new
        held = {
            "paged": prompt_len,
            "oracle": length,
            "pow2": min(2 ** math.ceil(math.log2(length)), max_model_len),
            "max": max_model_len,
        }[policy]
        blocks = math.ceil(held / block_size)
        if blocks > free:
            break
        free -= blocks
        count += 1
    return count


def scheduler_preempt(running, waiting, allocator):
    """``Scheduler._preempt`` as ``preempt``: on the given queues, of ``running[-1]``, the victim
    ``_reserve_or_preempt`` picks."""
    sched = Scheduler(allocator, max_num_seqs=len(running) + len(waiting), max_num_batched_tokens=1)
    sched.running, sched.waiting = running, waiting
    victim = running[-1]
    sched._preempt(victim)
    return victim


ANSWERS = {"L3.1": slots, "L3.2": plan_step, "L3.3": preempt, "L3.4": admitted}
EXPECT = {ex: (lambda case, ex=ex: HIDDEN[ex].observe(ANSWERS[ex], case)) for ex in ANSWERS}
STAGE_ADAPTERS = {"L3.2": scheduler_plan, "L3.3": scheduler_preempt, "L3.4": scheduler_admitted}
