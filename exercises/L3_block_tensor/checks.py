"""The L3 notebook's exercise checkers: the learner's function against this stage's own code.

- ``check_slots``: pool slots from a block table, against ``slots`` (``sequence.py``);
- ``check_plan_step``: how many tokens each sequence runs in one step, against what
  ``Scheduler.schedule`` (``scheduler.py``) plans for the same queues;
- ``check_preempt``: sending a running sequence back to waiting when the pool runs dry, against the
  first preemption ``Scheduler`` itself makes in the same state (which sequence, its blocks on the free
  list, both queues, what it keeps and what it forgets);
- ``check_admitted``: how many waiting requests an admission policy (on demand, or one of the vLLM
  paper's Orca baselines: Oracle, Pow2, Max) admits in one step with a pool of ``num_blocks``, against
  what ``Scheduler.schedule`` admits from the pool the engine gives that policy (``make_allocator``);
- ``check_buddy_waits`` (beyond the stage): who waits, the free blocks and the largest free run after
  each arrival or finish in a buddy pool (external fragmentation), against ``Scheduler`` over the
  engine's buddy allocator (``kvcourse/orca.py``);
- ``check_watermark`` (beyond the stage): admission that keeps a watermark of free blocks for the
  running requests, against ``Scheduler`` run on the pool less the watermark;
- ``check_cheapest_preemption`` (beyond the stage): the fewest computed tokens a preemption that frees
  ``need`` blocks throws away, against an exhaustive search (small cases only);
- ``check_catch_scheduler`` (catch the bug): the learner's test on ``Scheduler`` and on copies of it
  with a bug of the course's mutation list put in (``kvcourse/grading/mutations.py``);
- ``check_predict`` (predict): the learner's prediction of four scheduler steps, key by key against a
  run of this stage, never printing the real value.

The checks of L3.1-L3.7 name the broken rule when a wrong answer gives what a known
mistake gives (``named_mistake``): a slot one row off, a victim from the wrong end, Pow2 uncapped, an
Orca reservation taken as loose blocks, a buddy run taken from the first free run instead of the
smallest.

The grading contract (see ``kvcourse/grading/cases.py``): each checker runs fixed cases and prints one
deterministic line per case (``ok``, ``WRONG — what differs``, or ``raised`` and the exception), then
``k/n passed``. The reference notebook stores those lines as the check cell's output and ``make grade``
compares them. The references are the stage's own code, never a copy kept here (L3.7's, which the
stage has no code for, is an exhaustive search: a valid answer only for the visible cases' sizes).

Below the checkers, ``HIDDEN`` holds each exercise's hidden cases for ``make grade``
(``kvcourse/grading/hidden.py``): drawn from a seed per grading run and judged in the grader's process against
the independent answers of ``key/L3_block_tensor/answers.py``, never against this stage's code.

Left out on purpose: partial credit and hints; ``plan_step`` is graded with plenty of free blocks,
so preemption is not part of it (``check_preempt`` grades it alone, one preemption at a time, not the
retry loop around it).
"""

from __future__ import annotations

import contextlib
import io
import re
from collections.abc import Callable

from kvcourse.engine_config import EngineConfig
from kvcourse.grading.cases import Case, named_mistake, run_cases
from kvcourse.grading.hidden import CaseTimeout, Hidden, short, unrevealed
from kvcourse.grading.mutations import catch_cases, catch_hidden, version
from kvcourse.orca import BuddyAllocator, make_allocator, next_pow2
from L3_block_tensor.allocator import BlockAllocator, OutOfBlocksError
from L3_block_tensor.scheduler import Scheduler
from L3_block_tensor.sequence import Sequence, Status, allocate_slots
from L3_block_tensor.sequence import slots as ref_slots


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
            problem = None if got == expected else f"expected {expected}, got {got}"
            return named_mistake(problem, got, slot_mistakes(block_table, start, end, block_size))

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


def slot_mistakes(block_table, start, end, block_size) -> dict:
    """The known mistakes of ``slots``, each computed with this stage's code on a changed input (or
    the stage's ``slots`` with the mutation list's bug put in)."""
    one_row_off = version("L3_block_tensor.sequence:slots", "L3 slot of a position one row off")
    return {
        "off by one: position p got the slot of position p + 1": lambda: ref_slots(
            block_table, start + 1, end + 1, block_size
        ),
        "the row of position p is p % block_size, not (p + 1) % block_size": lambda: one_row_off(
            block_table, start, end, block_size
        ),
        "off by one: end is not included, the positions are start .. end - 1": lambda: ref_slots(
            block_table, start, end + 1, block_size
        ),
        "the block table is not used: block p // block_size is block_table[p // block_size]": lambda: list(
            range(start, end)
        ),
    }


def scheduler_plan(running, waiting, max_num_batched_tokens, prefill_chunk_size, max_num_seqs):
    """What ``Scheduler.schedule`` plans, in ``plan_step``'s terms, with plenty of free blocks: a running
    request has a prompt of 20 tokens, all but its ``todo`` computed; a waiting one has ``todo`` tokens.
    Example with budget 8, chunk 4, max_num_seqs 4: running [1, 1], waiting [10, 3] -> ([1, 1], [4, 2])."""
    config = EngineConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        prefill_chunk_size=prefill_chunk_size,
    )
    sched = Scheduler(BlockAllocator(256, 4), config)
    seqs = []
    for i, todo in enumerate(running):
        seq = Sequence(i, [1] * 20, 8)
        seq.num_computed_tokens = 20 - todo
        allocate_slots(seq, sched.allocator, seq.num_computed_tokens)
        seq.status = Status.RUNNING
        sched.running.append(seq)
        seqs.append(seq)
    for j, todo in enumerate(waiting):
        seq = Sequence(len(running) + j, [1] * todo, 8)
        sched.add(seq)
        seqs.append(seq)
    planned = {seq.request_id: n for seq, n in sched.schedule()}
    counts = [planned.get(seq.request_id, 0) for seq in seqs]
    return counts[: len(running)], counts[len(running) :]


def hit(found, _got) -> bool:
    """``named_mistake``'s comparison for rules tested on the answer itself: the rule's function
    returns True when the answer breaks it."""
    return found is True


def plan_mistakes(running, waiting, budget, chunk, max_num_seqs, got) -> dict:
    """The rules a wrong ``plan_step`` answer ``got`` (two lists) may break, each a test on it."""
    ran, admitted = got
    todo, counts = list(running) + list(waiting), list(ran) + list(admitted)
    return {
        "a request runs more tokens than it has left": lambda: any(
            n > t for n, t in zip(counts, todo, strict=True)
        ),
        "the step runs more than max_num_batched_tokens tokens": lambda: sum(counts) > budget,
        "a chunk is longer than prefill_chunk_size": lambda: chunk is not None and max(counts) > chunk,
        "without chunking a request runs all its tokens or none": lambda: (
            chunk is None and any(0 < n < t for n, t in zip(counts, todo, strict=True))
        ),
        "more than max_num_seqs requests run (running ones hold their seats even with 0 tokens)": lambda: (
            len(running) + sum(1 for n in admitted if n) > max(max_num_seqs, len(running))
        ),
        "a waiting request jumped the queue: admission stops at the first one that gets 0": lambda: any(
            admitted[i] == 0 and any(admitted[i + 1 :]) for i in range(len(admitted))
        ),
    }


def check_plan_step(plan_step: Callable) -> None:
    """Grade ``plan_step(running, waiting, max_num_batched_tokens, prefill_chunk_size, max_num_seqs)``
    against what ``Scheduler.schedule`` does with plenty of free blocks.

    ``running`` and ``waiting`` give, for each sequence in scheduling order, the tokens it has not
    computed yet (1 for a sequence that is decoding). The answer is two lists of the same lengths: the
    tokens each sequence runs this step, 0 for one that does not run. Example with budget 8, chunk 4,
    max_num_seqs 4: running [1, 1], waiting [10, 3] -> ([1, 1], [4, 2]).
    """

    def case(running, waiting, budget, chunk, max_num_seqs) -> Callable[[], str | None]:
        def run() -> str | None:
            want = scheduler_plan(running, waiting, budget, chunk, max_num_seqs)
            got = plan_step(list(running), list(waiting), budget, chunk, max_num_seqs)
            if not isinstance(got, tuple | list) or len(got) != 2:
                return f"returned {got!r}, expected two lists (running, waiting)"
            got = (list(got[0]), list(got[1]))
            problem = (
                None
                if got == want
                else f"expected running {want[0]}, waiting {want[1]}; got {got[0]}, {got[1]}"
            )
            return named_mistake(
                problem, got, plan_mistakes(running, waiting, budget, chunk, max_num_seqs, got), same=hit
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


def scheduler_admitted(policy, requests, num_blocks, block_size, max_model_len, allocator=None) -> int:
    """How many of ``requests`` ((prompt_len, max_new_tokens) pairs, all waiting, in order)
    ``Scheduler.schedule`` admits in one step under ``policy``, seats and token budget never the limit,
    from the pool the engine gives that policy (``make_allocator``: the free list on demand, a buddy
    allocator of runs for an Orca policy), or from ``allocator`` when one is given."""
    tokens = sum(p for p, _ in requests) + 1
    config = EngineConfig(
        max_num_seqs=len(requests) + 1,
        max_num_batched_tokens=tokens,
        admission_policy=policy,
        max_model_len=max_model_len,
        num_blocks=num_blocks,
        block_size=block_size,
    )
    sched = Scheduler(allocator or make_allocator(config, BlockAllocator, OutOfBlocksError), config)
    for i, (prompt_len, max_new) in enumerate(requests):
        sched.add(Sequence(i, [7] * prompt_len, max_new, ignore_eos=True))
    return len(sched.schedule())


def admission_mistakes(policy, requests, num_blocks, block_size, max_model_len) -> dict:
    """The known mistakes of ``admitted``, each what ``Scheduler`` admits on a changed input: another
    policy, no cap on Pow2, Pow2's old rule (as Oracle on the rounded length), an Orca reservation
    taken as loose blocks (the free list instead of the buddy), or requests picked out of order."""

    def admits(as_policy, reqs=requests, cap=max_model_len, allocator=None) -> int:
        return scheduler_admitted(as_policy, reqs, num_blocks, block_size, cap, allocator)

    def loose(as_policy) -> int:  # the reservation's blocks from the free list: no run, no power of two
        return admits(as_policy, allocator=BlockAllocator(num_blocks, block_size))

    def rounded_whole() -> int:  # Pow2 rounding prompt + output: Oracle on that length
        return admits("oracle", [(p, min(next_pow2(p + o), max_model_len) - p) for p, o in requests])

    def jumping() -> int:  # every request that still fits, skipping those that do not
        taken = []
        for request in requests:
            if admits(policy, taken + [request]) == len(taken) + 1:
                taken.append(request)
        return len(taken)

    run = "an Orca reservation is one run of a power of two of blocks (7 blocks take 8), not loose blocks"
    mistakes = {
        "on_demand": {
            "on_demand holds its prompt's blocks at admission, not its whole length": lambda: loose("oracle"),
        },
        "oracle": {
            "Oracle holds the whole length (prompt + max_new_tokens), not the prompt": lambda: (
                admits("on_demand")
            ),
            run: lambda: loose("oracle"),
        },
        "pow2": {
            "Pow2 rounds the output only: prompt + next_pow2(max_new_tokens), not next_pow2(prompt + "
            "max_new_tokens)": rounded_whole,
            "Pow2 is capped at max_model_len": lambda: admits("pow2", cap=1 << 30),
            run: lambda: loose("pow2"),
        },
        "max": {
            "Max holds max_model_len for every request, not its length": lambda: admits("oracle"),
            run: lambda: loose("max"),
        },
    }.get(policy, {})  # fmt: skip
    return {
        **mistakes,
        "nobody jumps the queue: admission stops at the first request that does not fit": jumping,
    }


def check_admitted(admitted: Callable) -> None:
    """Grade ``admitted(policy, requests, num_blocks, block_size, max_model_len) -> int`` against what
    ``Scheduler.schedule`` admits in its first step, on the pool the engine gives the policy.

    ``requests`` are (prompt_len, max_new_tokens) pairs, all waiting, first come first served; seats
    and the token budget are never the limit, blocks are. Example, 16 blocks of 4, max_model_len 32,
    five requests (3, 5): on_demand admits 5 (a block each), Oracle 5 (2 blocks each, a run of 2),
    Pow2 4 (3 + 8 positions: 3 blocks, a run of 4), Max 2 (8 blocks, a run of 8).
    """

    def case(policy, requests, num_blocks, block_size=4, max_model_len=32) -> Callable[[], str | None]:
        def run() -> str | None:
            want = scheduler_admitted(policy, requests, num_blocks, block_size, max_model_len)
            got = admitted(policy, [tuple(r) for r in requests], num_blocks, block_size, max_model_len)
            problem = None if got == want else f"expected {want} admitted, got {got!r}"
            return named_mistake(
                problem, got, admission_mistakes(policy, requests, num_blocks, block_size, max_model_len)
            )

        return run

    same = [(3, 5)] * 5
    mixed = [(5, 20), (2, 3), (9, 6), (4, 12), (1, 1)]
    run_cases(
        [
            Case("on_demand, five (3, 5) on 16 blocks of 4", case("on_demand", same, 16)),
            Case("oracle, five (3, 5) on 16 blocks of 4", case("oracle", same, 16)),
            Case("pow2, five (3, 5) on 16 blocks of 4", case("pow2", same, 16)),
            Case("max, five (3, 5) on 16 blocks of 4", case("max", same, 16)),
            Case("oracle: 10 positions are 3 blocks, a run of 4", case("oracle", [(2, 8)] * 6, 16)),
            Case(
                "oracle, mixed lengths: the first that does not fit stops the rest", case("oracle", mixed, 12)
            ),
            Case("pow2 rounds the output only: 6 + 16 positions", case("pow2", [(6, 10), (8, 8)], 8)),
            Case("pow2 never past max_model_len", case("pow2", [(1, 17), (1, 1)], 8)),
            Case("max: max_model_len 48 is 12 blocks, a run of 16", case("max", [(3, 5)] * 3, 24, 4, 48)),
            Case("on_demand holds a prompt's blocks only", case("on_demand", mixed, 5)),
        ]
    )


class _FirstPreemption(Exception):
    """Raised by the reference scheduler right after its first ``_preempt``, to stop it there."""


def _preempt_state(block_size: int, num_blocks: int, running: list, waiting: list, retired: int):
    """The queues and allocator of one ``check_preempt`` case, built with this stage's classes.

    running: (request_id, prompt_len, generated, computed, priority) per sequence; waiting:
    (request_id, prompt_len, generated, priority) per sequence (a waiting one that has generated tokens
    was preempted before). Running sequences grow a position at a time, in turn, so their block tables
    interleave; ``retired`` blocks, taken first and freed at the end, leave the free list out of id order.
    Returns (allocator, running, waiting), both queues in scheduling order.
    """
    allocator = BlockAllocator(num_blocks, block_size)
    gone = allocator.alloc_blocks(retired)  # a finished request's blocks, given back below

    def make(request_id: int, prompt_len: int, generated: int, priority: int) -> Sequence:
        seq = Sequence(request_id, [100 * request_id + i for i in range(prompt_len)], 64, priority=priority)
        seq.output_ids = [5000 + 100 * request_id + i for i in range(generated)]
        return seq

    run = [make(rid, n, gen, prio) for rid, n, gen, _, prio in running]
    for t in range(max((c for *_, c, _ in running), default=0)):  # one position of each, in turn
        for seq, (*_, computed, _) in zip(run, running, strict=True):
            if t < computed:
                allocate_slots(seq, allocator, t + 1)
    for seq, (*_, computed, _) in zip(run, running, strict=True):
        seq.num_computed_tokens = computed
        seq.status = Status.RUNNING
    allocator.free(gone)
    wait = [make(*spec) for spec in waiting]
    return allocator, sorted(run, key=Sequence.sort_key), sorted(wait, key=Sequence.sort_key)


VICTIM_FIELD_RULES = {
    "block_table": "the victim holds no blocks once preempted: its block table is []",
    "num_computed_tokens": "preemption forgets to reset what the victim computed: it recomputes from 0",
    "status": "a preempted request is WAITING again",
    "prompt_ids": "the victim keeps its prompt: it is what it recomputes",
    "output_ids": "the victim keeps its generated tokens: they are what it recomputes",
}


def max_victim(running: list) -> int:
    """The request id of the last running request in scheduling order, from a case's spec
    ((request_id, prompt_len, generated, computed, priority) per request)."""
    return max(running, key=lambda r: (-r[4], r[0]))[0]


def victim_rule(got_id: int, running: list, want_id: int) -> str:
    """Which rule a wrong victim breaks, from a case's running specs: " (rule)" or ""."""
    priority = {r[0]: r[4] for r in running}
    if got_id not in priority:
        return " (the victim is a running request)"
    most_important = min(running, key=lambda r: (-r[4], r[0]))[0]
    if got_id == most_important:
        return " (the victim is the least important running request (the last of running), not the most)"
    if priority[got_id] != priority[want_id]:
        return " (priority comes first: the victim has the lowest priority, then the highest request id)"
    return " (among equal priorities the newest request goes: the highest request id)"


def check_preempt(preempt: Callable) -> None:
    """Grade ``preempt(running, waiting, allocator) -> victim`` against ``Scheduler``'s own preemption.

    ``running`` and ``waiting`` are lists of ``Sequence`` in scheduling order (``Sequence.sort_key``:
    higher priority first, then lower request id), as ``Scheduler`` keeps them; ``allocator`` is the
    ``BlockAllocator`` whose blocks the running sequences hold. ``preempt`` must change them in place
    exactly as the scheduler does when ``allocate_slots`` finds the free list too short: the same victim, taken
    out of ``running`` and put into ``waiting`` at its place in scheduling order, all its blocks back on
    the free list, its block table empty, ``num_computed_tokens`` 0 and status ``WAITING``, its prompt
    and generated tokens kept (they are what it recomputes). The reference is a real ``Scheduler`` given
    the same queues, stopped right after its first ``_preempt``.

    Example, block_size 4: running requests 0 (blocks [0, 2], 7 computed) and 1 (blocks [1, 3, 4], 9
    computed, 2 tokens generated), free list [5]; waiting [2] -> victim request 1; running [0]; free list
    [5, 1, 3, 4]; waiting [1, 2]; request 1 keeps its 2 generated tokens and recomputes all 10 tokens.
    """

    def reference(allocator, running, waiting) -> Sequence:
        sched = Scheduler(
            allocator, EngineConfig(max_num_seqs=len(running) + len(waiting), max_num_batched_tokens=4096)
        )
        sched.running, sched.waiting = running, waiting  # the same lists: they change in place

        def first_preemption(seq: Sequence) -> None:
            Scheduler._preempt(sched, seq)
            raise _FirstPreemption(seq)

        sched._preempt = first_preemption
        grower = running[0]  # wants one block more than the free list holds
        target = (len(grower.block_table) + allocator.num_free + 1) * allocator.block_size
        try:
            sched._allocate_or_preempt(grower, target)
        except _FirstPreemption as stop:
            return stop.args[0]
        raise AssertionError("the reference scheduler preempted nobody")  # a broken case, not the learner

    def case(block_size: int, num_blocks: int, running: list, waiting: list, retired: int = 0):
        def run() -> str | None:
            ref_alloc, ref_running, ref_waiting = _preempt_state(
                block_size, num_blocks, running, waiting, retired
            )
            allocator, mine, queue = _preempt_state(block_size, num_blocks, running, waiting, retired)
            by_id = {seq.request_id: seq for seq in mine + queue}
            want_table = list(next(s for s in ref_running if s.request_id == max_victim(running)).block_table)
            want = reference(ref_alloc, ref_running, ref_waiting)
            got = preempt(mine, queue, allocator)
            if got is not by_id.get(getattr(got, "request_id", None)):
                return f"returned {got!r}, expected the preempted Sequence (request {want.request_id})"
            if got.request_id != want.request_id:
                rule = victim_rule(got.request_id, running, want.request_id)
                return f"preempted request {got.request_id}, expected request {want.request_id}{rule}"
            ids = [[s.request_id for s in q] for q in (mine, queue, ref_running, ref_waiting)]
            for what, have, expected in (("running", ids[0], ids[2]), ("waiting", ids[1], ids[3])):
                if have != expected:
                    rule = ""
                    if what == "waiting" and have == [i for i in expected if i != got.request_id] + [
                        got.request_id
                    ]:
                        rule = " (the victim goes back at its place in scheduling order, not at the end)"
                    return f"{what} is {have} afterwards, expected {expected}{rule}"
            free, ref_free = list(allocator.free_blocks), list(ref_alloc.free_blocks)
            if free != ref_free:
                before = ref_free[: len(ref_free) - len(want_table)]
                problem = f"free list {free} afterwards, expected {ref_free}"
                return named_mistake(
                    problem,
                    free,
                    {
                        "preemption keeps the blocks of the victim: all of them go back": lambda: before,
                        "the victim's blocks go back in block-table order, not reversed": lambda: (
                            before + want_table[::-1]
                        ),
                    },
                )
            if allocator.owned != ref_alloc.owned:
                return (
                    f"the allocator counts blocks {sorted(allocator.owned)} as handed out, expected "
                    f"{sorted(ref_alloc.owned)} (give blocks back with allocator.free)"
                )
            for what in ("block_table", "num_computed_tokens", "status", "prompt_ids", "output_ids"):
                if getattr(got, what) != getattr(want, what):
                    rule = VICTIM_FIELD_RULES.get(what, "")
                    return (
                        f"the victim's {what} is {getattr(got, what)!r}, expected {getattr(want, what)!r}"
                        + (f" ({rule})" if rule else "")
                    )
            return None

        return run

    run_cases(
        [
            Case(
                "the worked example: two running, free list [5]",
                case(4, 6, [(0, 6, 2, 7, 0), (1, 8, 2, 9, 0)], [(2, 5, 0, 0)]),
            ),
            Case(
                "three decoding, equal priority: the newest goes",
                case(4, 12, [(0, 6, 3, 8, 0), (1, 7, 2, 8, 0), (2, 5, 4, 8, 0)], [], retired=2),
            ),
            Case(
                "its blocks join the back of the free list, in block-table order",
                case(4, 14, [(0, 9, 2, 10, 0), (1, 10, 3, 12, 0)], [], retired=3),
            ),
            Case(
                "an older request goes back in front of newer waiting ones",
                case(4, 12, [(1, 6, 2, 7, 0), (3, 9, 1, 9, 0)], [(4, 6, 0, 0), (5, 3, 0, 0)], retired=1),
            ),
            Case(
                "priorities: the lowest priority goes, though it is the oldest",
                case(
                    4, 12, [(0, 5, 1, 5, 0), (1, 6, 3, 8, 2), (2, 4, 2, 5, 1)], [(3, 4, 0, 1), (4, 7, 0, 0)]
                ),
            ),
            Case(
                "generated tokens are kept: all 14 are recomputed",
                case(4, 10, [(0, 4, 5, 8, 0), (1, 8, 6, 13, 0)], [(2, 3, 0, 0)]),
            ),
            Case(
                "in the middle of a chunked prefill: 8 of 20 prompt tokens computed",
                case(4, 10, [(0, 5, 3, 7, 0), (1, 20, 0, 8, 0)], []),
            ),
            Case(
                "the only running request preempts itself",
                case(4, 8, [(2, 8, 4, 11, 0)], [(0, 4, 2, 0), (3, 5, 0, 0)], retired=2),
            ),
            Case(
                "block_size 1: a block per position",
                case(1, 10, [(0, 3, 1, 3, 0), (1, 2, 2, 3, 0)], [], retired=1),
            ),
        ]
    )


# Hidden cases (kvcourse/grading/hidden.py): drawn per grading run, observed here in the learner's kernel,
# judged in the grader's process against the independent answers of key/L3_block_tensor/answers.py.


def draw_slots(rng) -> list[dict]:
    """Random block tables (shuffled ids of a larger pool, sometimes longer than the positions asked
    for) and ranges of positions: a whole prefill, one decode token, a chunk crossing block edges,
    a range starting or ending on an edge, an empty range."""
    cases = []
    for _ in range(8):
        block_size = rng.choice([1, 2, 3, 4, 5, 7, 8, 16])
        table = rng.sample(range(rng.randint(1, 12) + 4), rng.randint(1, 5))
        capacity = len(table) * block_size  # positions the table has room for
        ranges = []
        for _ in range(rng.randint(2, 4)):
            edge = rng.randrange(len(table)) * block_size  # the first position of a block
            start = rng.choice([0, edge, rng.randrange(capacity)])
            end = rng.choice([start, start + 1, rng.randint(start, capacity), capacity])
            ranges.append([start, end])
        cases.append({"block_table": table, "block_size": block_size, "ranges": ranges})
    return cases


def as_ids(value) -> list[int] | str:
    """A list or tuple of whole numbers as a list of ints (``(3, 4)`` -> [3, 4], as the visible check
    takes them), anything else as its repr."""
    if not isinstance(value, list | tuple):
        return repr(value)
    try:
        return [int(x) for x in value]
    except (TypeError, ValueError):
        return repr(value)


def observe_slots(fn, case) -> list[dict]:
    steps = []
    for start, end in case["ranges"]:
        got = fn(list(case["block_table"]), start, end, case["block_size"])
        steps.append({"call": f"slots(start={start}, end={end})", "returned": as_ids(got)})
    return steps


def describe_slots(case: dict) -> str:
    ranges = ", ".join(f"{s}..{e - 1}" if e > s else f"none at {s}" for s, e in case["ranges"])
    return f"block table {case['block_table']}, block_size {case['block_size']}: positions {ranges}"


def draw_plans(rng) -> list[dict]:
    """Queues for one step, three aimed and seven random: a long prompt that does not fit the budget
    left in front of a short one that does (nobody jumps the queue), more waiting prompts that fit
    than free seats (``max_num_seqs``), a budget that runs out among the running requests. Running
    requests are mostly decoding (1 token), some in the middle of a prefill; waiting prompts of any
    length; chunking off, of 1 token, or of a few."""

    def plan(running, waiting, budget, chunk, max_num_seqs) -> dict:
        return {
            "running": running,
            "waiting": waiting,
            "max_num_batched_tokens": budget,
            "prefill_chunk_size": chunk,
            "max_num_seqs": max(1, max_num_seqs),
        }

    decodes, left = [1] * rng.randint(0, 3), rng.randint(2, 10)
    long_first = [left + rng.randint(1, 8), rng.randint(1, left), rng.randint(1, 6)]
    seats = [1] * rng.randint(0, 3)
    prefills = [rng.randint(3, 12) for _ in range(3)]
    cases = [
        plan(decodes, long_first, len(decodes) + left, None, len(decodes) + 3),
        plan(
            seats,
            [rng.randint(1, 4) for _ in range(4)],
            64,
            rng.choice([None, 8]),
            len(seats) + rng.randint(0, 2),
        ),
        plan(prefills, [rng.randint(1, 8)], rng.randint(1, sum(prefills) - 1), rng.randint(2, 6), 4),
    ]
    for _ in range(7):
        running = [1 if rng.random() < 0.6 else rng.randint(2, 20) for _ in range(rng.randint(0, 5))]
        waiting = [rng.randint(1, 24) for _ in range(rng.randint(0 if running else 1, 4))]
        budget = rng.randint(1, sum(running) + sum(waiting) + 2)
        chunk = rng.choice([None, None, 1, rng.randint(2, 8), rng.randint(2, 16)])
        cases.append(plan(running, waiting, budget, chunk, len(running) + rng.randint(0, 3)))
    rng.shuffle(cases)
    return cases


def observe_plan(fn, case) -> list[dict]:
    args = [list(case["running"]), list(case["waiting"])]
    got = fn(*args, case["max_num_batched_tokens"], case["prefill_chunk_size"], case["max_num_seqs"])
    if isinstance(got, list | tuple) and len(got) == 2:
        returned = [as_ids(got[0]), as_ids(got[1])]
    else:
        returned = repr(got)
    return [{"call": f"plan_step({describe_plan(case)})", "returned": returned}]


def describe_plan(case: dict) -> str:
    return (
        f"running {case['running']}, waiting {case['waiting']}, budget {case['max_num_batched_tokens']}, "
        f"chunk {case['prefill_chunk_size']}, max_num_seqs {case['max_num_seqs']}"
    )


def draw_preemptions(rng) -> list[dict]:
    """Queues at the moment the free list runs dry (the state ``check_preempt`` builds, see
    ``_preempt_state``), one aimed and seven random. The aimed one has priorities: the oldest running
    request has the lowest and goes, with tokens generated that it must keep, and a newer request of
    its priority waits, behind which it must go back. The random ones: 1 to 4 running requests,
    decoding or in the middle of a prefill, shuffled request ids, now and then priorities; waiting
    requests new or preempted before (with generated tokens). Block sizes 1 to 8; a few free blocks
    and retired ones, so the free list is out of id order."""

    def running_request(rid: int, priority: int, decoding: bool) -> list[int]:
        prompt_len, generated = rng.randint(1, 12), rng.choice([0, 0, rng.randint(1, 6)])
        generated = max(generated, 2 - prompt_len, int(decoding))  # >= 2 tokens: one cached, one not yet
        num_tokens = prompt_len + generated
        computed = num_tokens - 1 if decoding else rng.randint(1, num_tokens - 1)  # or mid-prefill
        return [rid, prompt_len, generated, computed, priority]

    def preemption(block_size: int, running: list, waiting: list) -> dict:
        retired = rng.randint(0, 3)
        needed = sum(-(-computed // block_size) for *_, computed, _ in running)
        return {
            "block_size": block_size,
            "num_blocks": needed + retired + rng.randint(0, 3),
            "running": running,
            "waiting": waiting,
            "retired": retired,
        }

    oldest, middle, newest, waits_behind, waits_ahead = sorted(rng.sample(range(12), 5))
    running = [
        running_request(oldest, 0, True),
        running_request(middle, 1, False),
        running_request(newest, 2, True),
    ]
    waiting = [
        [waits_ahead, rng.randint(1, 10), 0, 1],
        [waits_behind, rng.randint(1, 10), rng.randint(0, 3), 0],
    ]
    cases = [preemption(rng.choice([2, 3, 4]), running, waiting)]
    for _ in range(7):
        n_running, n_waiting = rng.randint(1, 4), rng.randint(0, 3)
        ids = rng.sample(range(12), n_running + n_waiting)  # request ids, in no particular order
        prioritized = rng.random() < 0.4
        running = [
            running_request(rid, rng.randint(0, 2) * prioritized, rng.random() < 0.6)
            for rid in ids[:n_running]
        ]
        waiting = [
            [rid, rng.randint(1, 10), rng.choice([0, 0, rng.randint(1, 5)]), rng.randint(0, 2) * prioritized]
            for rid in ids[n_running:]
        ]
        cases.append(preemption(rng.choice([1, 2, 3, 4, 5, 8]), running, waiting))
    rng.shuffle(cases)
    return cases


def observe_preempt(fn, case) -> list[dict]:
    """Build the case's queues and allocator, call ``fn(running, waiting, allocator)``, and record
    the victim and its fields, both queues, the free list, the blocks handed out, and the state of
    every sequence (the others must not change)."""
    allocator, running, waiting = _preempt_state(
        case["block_size"], case["num_blocks"], case["running"], case["waiting"], case["retired"]
    )
    everyone = sorted(running + waiting, key=lambda s: s.request_id)
    got = fn(running, waiting, allocator)
    victim = next((seq for seq in everyone if seq is got), None)

    def state(seq: Sequence | None) -> dict:
        if seq is None:
            return dict.fromkeys(("block_table", "num_computed_tokens", "status", "prompt_ids", "output_ids"))
        return {
            "block_table": list(seq.block_table),
            "num_computed_tokens": seq.num_computed_tokens,
            "status": seq.status.value if isinstance(seq.status, Status) else repr(seq.status),
            "prompt_ids": list(seq.prompt_ids),
            "output_ids": list(seq.output_ids),
        }

    return [
        {
            "call": "preempt(running, waiting, allocator)",
            "victim": victim.request_id if victim else f"returned {got!r}, not one of the sequences",
            **{f"victim's {key}": value for key, value in state(victim).items()},
            "running": [seq.request_id for seq in running],
            "waiting": [seq.request_id for seq in waiting],
            "free list": list(allocator.free_blocks),
            "handed out": sorted(allocator.owned),
            "every sequence": {str(seq.request_id): state(seq) for seq in everyone},
        }
    ]


def describe_preempt(case: dict) -> str:
    running = ", ".join(
        f"request {rid} (prompt {n}, {gen} generated, {c} computed, priority {p})"
        for rid, n, gen, c, p in case["running"]
    )
    waiting = ", ".join(f"request {rid} (priority {p})" for rid, _, _, p in case["waiting"]) or "none"
    return (
        f"block_size {case['block_size']}, {case['num_blocks']} blocks ({case['retired']} retired); "
        f"running {running}; waiting {waiting}"
    )


def draw_admissions(rng) -> list[dict]:
    """Ten queues, six aimed and four random. Aimed, each where one known mistake changes the count:
    Pow2 where the cap at max_model_len makes the run smaller; Pow2 where rounding the output alone
    and rounding prompt + output give runs of different sizes; an Orca policy whose reservations are
    not a power of two of blocks, on a pool that holds them all as loose blocks; Max with a
    max_model_len that is not a power of two of blocks; on_demand where whole lengths would not fit
    but prompts do; a long request in front of a short one that would fit (nobody jumps the queue).
    The random ones: any policy, 1-8 requests that fit max_model_len, a pool between the largest
    reservation and all of them."""

    def queue(policy, requests, num_blocks, block_size, max_model_len) -> dict:
        return {"policy": policy, "requests": requests, "num_blocks": num_blocks, "block_size": block_size,
                "max_model_len": max_model_len}  # fmt: skip

    def run(positions: int, block_size: int) -> int:  # the buddy run that holds them, in blocks
        return next_pow2(-(-positions // block_size))

    def pow2(prompt_len, max_new, max_model_len) -> int:
        return prompt_len + min(next_pow2(max_new), max_model_len - prompt_len)

    def request(max_model_len: int, differs) -> list[int]:  # a (prompt, output) pair that makes differs true
        while True:
            prompt_len = rng.randint(1, max_model_len - 1)
            max_new = rng.randint(1, max_model_len - prompt_len)
            if differs(prompt_len, max_new):
                return [prompt_len, max_new]

    cases = []
    block_size, max_len = rng.choice([2, 4, 8]), rng.choice([40, 48, 56, 100])  # not a power of two
    capped = request(  # uncapped, the output's power of two passes max_model_len and takes a bigger run
        max_len, lambda p, o: run(p + next_pow2(o), block_size) > run(pow2(p, o, max_len), block_size)
    )
    pool = run(pow2(*capped, max_len), block_size)
    cases.append(queue("pow2", [capped, [1, 1]], pool, block_size, max_len))

    block_size, max_len, k = rng.choice([2, 4, 8]), rng.choice([32, 48, 64, 100]), rng.randint(2, 4)

    def whole(p: int, o: int) -> int:  # the wrong rule's reservation: next_pow2(prompt + output), capped
        return min(next_pow2(p + o), max_len)

    odd = request(max_len, lambda p, o: run(pow2(p, o, max_len), block_size) != run(whole(p, o), block_size))
    smaller = min(run(pow2(*odd, max_len), block_size), run(whole(*odd), block_size))
    cases.append(queue("pow2", [odd] * k, k * smaller, block_size, max_len))

    block_size, k = rng.choice([2, 4]), rng.randint(2, 5)
    blocks = rng.choice([3, 5, 6, 7])  # not a power of two: the run is bigger
    length = rng.randint((blocks - 1) * block_size + 1, blocks * block_size)
    prompt_len = rng.randint(1, length - 1)
    cases.append(queue("oracle", [[prompt_len, length - prompt_len]] * k, k * blocks, block_size, 64))

    block_size, max_len = rng.choice([(4, 48), (4, 40), (2, 24), (8, 96)])  # 12 or 10 blocks: a run of 16
    n = rng.randint(2, 4)
    cases.append(queue("max", [[rng.randint(1, 8), rng.randint(1, 8)] for _ in range(n)],
                       n * -(-max_len // block_size), block_size, max_len))  # fmt: skip

    prompts = [rng.randint(1, 4) for _ in range(rng.randint(3, 6))]
    cases.append(queue("on_demand", [[p, 30] for p in prompts], len(prompts), 4, 64))

    long = rng.randint(12, 20)
    cases.append(queue("oracle", [[long, 10], [1, 1], [2, 1]], run(long + 10, 4) - 1, 4, 64))

    for _ in range(4):
        block_size = rng.choice([2, 4, 8, 16])
        max_model_len = rng.choice([16, 32, 48, 64, 100])
        requests = []
        for _ in range(rng.randint(1, 8)):
            prompt_len = rng.randint(1, max_model_len - 1)
            requests.append([prompt_len, rng.randint(1, max_model_len - prompt_len)])
        biggest = run(max_model_len, block_size)
        num_blocks = rng.randint(biggest, biggest * len(requests) + 1)
        cases.append(
            queue(
                rng.choice(["on_demand", "oracle", "pow2", "max"]),
                requests,
                num_blocks,
                block_size,
                max_model_len,
            )
        )
    rng.shuffle(cases)
    return cases


def observe_admitted(fn, case) -> list[dict]:
    got = fn(case["policy"], [tuple(r) for r in case["requests"]], case["num_blocks"], case["block_size"],
             case["max_model_len"])  # fmt: skip
    returned = int(got) if isinstance(got, int) and not isinstance(got, bool) else repr(got)
    return [{"call": f"admitted({describe_admitted(case)})", "returned": returned}]


def describe_admitted(case: dict) -> str:
    return (
        f"{case['policy']}, requests {case['requests']}, {case['num_blocks']} blocks of {case['block_size']}, "
        f"max_model_len {case['max_model_len']}"
    )


HIDDEN = {
    "L3.1": Hidden(draw_slots, observe_slots, describe_slots, answers=("L3_block_tensor.sequence:slots",)),
    "L3.2": Hidden(
        draw_plans,
        observe_plan,
        describe_plan,
        answers=(
            "L3_block_tensor.scheduler:Scheduler.schedule",
            "L3_block_tensor.scheduler:Scheduler._num_new_tokens",
        ),
    ),
    "L3.3": Hidden(
        draw_preemptions,
        observe_preempt,
        describe_preempt,
        answers=("L3_block_tensor.scheduler:Scheduler._preempt",),
    ),
    "L3.4": Hidden(
        draw_admissions,
        observe_admitted,
        describe_admitted,
        answers=(
            "kvcourse.orca:held_at_admission",
            "L3_block_tensor.scheduler:Scheduler.hold_len",
        ),
    ),
}


# ---------------------------------------------------------------------------------------------------
# L3.5-L3.9: three exercises beyond the stage (external fragmentation in a buddy pool, a watermark,
# the cheapest preemption), a test that catches the scheduler's bugs, and a prediction. Their visible
# references are the stage's code over another pool (L3.5: the engine's buddy allocator) or on a
# changed input (L3.6), an exhaustive search (L3.7: the exercise asks for an algorithm that scales;
# trying every subset does not), the mutation list (L3.8) and a run of the stage (L3.9).


def returned_or_raised(fn, *args) -> dict:
    """One call's result as an observation: ``{"returned": [ints]}`` for a pair of whole numbers,
    ``{"returned": repr}`` for anything else, ``{"raised": "ValueError"}`` for an exception (its type
    only: the message is the learner's)."""
    try:
        got = fn(*args)
    except CaseTimeout:
        raise  # the hidden cases' time is up: the grader reports it and stops
    except Exception as e:  # noqa: BLE001 - compared with what the reference raises
        return {"raised": type(e).__name__}
    ok = isinstance(got, list | tuple) and len(got) == 2
    if ok and all(isinstance(x, int) and not isinstance(x, bool) for x in got):
        return {"returned": [int(x) for x in got]}
    return {"returned": repr(got)}


def said(observation: dict) -> str:
    """An observation in words: ``{"returned": [2, 3]} -> "(2, 3)"``, ``{"raised": "ValueError"}``
    -> ``"raised ValueError"``."""
    if "raised" in observation:
        return f"raised {observation['raised']}"
    value = observation["returned"]
    return f"({value[0]}, {value[1]})" if isinstance(value, list) else value


def float_pair(observation: dict) -> bool:
    """True when a call returned a pair of whole numbers as floats (``(34.0, 1)``): a dtype mistake."""
    value = observation.get("returned")
    return isinstance(value, str) and re.fullmatch(r"[(\[]\d+(\.0)?, \d+(\.0)?[)\]]", value) is not None


# L3.5 external fragmentation in a buddy pool


def scheduler_buddy_waits(num_blocks: int, events: list, allocator=None, blocks_of=None) -> list[tuple]:
    """``buddy_waits``'s answer from this stage's ``Scheduler``: after each event, the waiting request
    ids, the free blocks and the largest free run (None when ``allocator`` has no runs).

    The pool is the one the engine gives an Orca policy (``make_allocator``: a buddy allocator), or
    ``allocator`` (a known mistake's). Request k, the k-th arrival, is a ``Sequence`` that holds exactly
    its blocks under admission_policy "oracle" (block_size 2, a prompt of 2n - 1 tokens and 1 new
    token: n blocks, one run of next_pow2(n)); an arrival is ``add``, a finish ``abort`` (a running
    request gives its run back, a waiting one leaves the queue), then ``schedule()`` admits in order
    whoever fits. ``blocks_of(n)`` changes the blocks an arrival asks for (a known mistake's).
    Example, 8 blocks, arrive 3, arrive 1, arrive 3: ([], 4, 4), ([], 3, 2), ([2], 3, 2).
    """
    config = EngineConfig(
        num_blocks=num_blocks,
        block_size=2,
        admission_policy="oracle",
        max_num_seqs=len(events) + 1,
        max_num_batched_tokens=1 << 30,  # never the limit (with no update(), each step plans every prompt again)
    )
    allocator = allocator or make_allocator(config, BlockAllocator, OutOfBlocksError)
    sched = Scheduler(allocator, config)
    arrived, trace = 0, []
    for kind, value in events:
        if kind == "arrive":
            n = blocks_of(value) if blocks_of else value
            sched.add(Sequence(arrived, [7] * (2 * n - 1), 1, ignore_eos=True))
            arrived += 1
        else:
            sched.abort(value)
        sched.schedule()
        largest = getattr(allocator, "largest_free_run", None)
        trace.append(([seq.request_id for seq in sched.waiting], allocator.num_free, largest))
    return trace


class _LowestRun(BuddyAllocator):
    """A known mistake: a request's run comes from the free run with the lowest first block that holds
    it, not from the smallest. The buddy allocator, shown only that run."""

    def alloc_blocks(self, n: int) -> list[int]:
        fits = [start for start, run in self.free_runs.items() if run >= next_pow2(n)]
        hidden = {start: run for start, run in self.free_runs.items() if fits and start != min(fits)}
        for start in hidden:
            del self.free_runs[start]
        try:
            return super().alloc_blocks(n)
        finally:
            self.free_runs.update(hidden)


class _NoMerge(BuddyAllocator):
    """A known mistake: a run given back stays a free run of its size, never merged with its buddy."""

    def free(self, blocks: list[int]) -> None:
        if blocks:
            self.free_runs[blocks[0]] = self.runs.pop(blocks[0])


class _Stretches:
    """A known mistake: a request's next_pow2(n) blocks from the first stretch of consecutive free
    blocks that holds them, wherever it starts (a buddy run starts at a multiple of its size)."""

    def __init__(self, num_blocks: int):
        self.block_size, self.taken, self.sizes = 2, [False] * num_blocks, {}

    @property
    def num_free(self) -> int:
        return self.taken.count(False)

    def alloc_blocks(self, n: int) -> list[int]:
        size = next_pow2(n)
        for start in range(len(self.taken) - size + 1):
            if not any(self.taken[start : start + size]):
                self.taken[start : start + size] = [True] * size
                self.sizes[start] = size
                return list(range(start, start + n))
        raise OutOfBlocksError(size, self.num_free)

    def free(self, blocks: list[int]) -> None:
        if blocks:
            size = self.sizes.pop(blocks[0])
            self.taken[blocks[0] : blocks[0] + size] = [False] * size


def as_trace(got, n: int) -> list[tuple] | str:
    """A learner's ``buddy_waits`` result as n (waiting, free, largest) triples of ints, or what is
    wrong with its shape. ``[([2], 3, 2)]`` -> ``[([2], 3, 2)]``; ``None`` -> a sentence."""
    expected = f"expected a list of {n} (waiting, free, largest_free_run) triples: a list of ids, two ints"
    if not isinstance(got, list | tuple) or len(got) != n:
        return f"returned {short(got)}, {expected}"
    trace = []
    for step in got:
        ids = as_ids(step[0]) if isinstance(step, list | tuple) and len(step) == 3 else "?"
        numbers = isinstance(step, list | tuple) and len(step) == 3 and all(
            isinstance(x, int) and not isinstance(x, bool) for x in step[1:]
        )
        if isinstance(ids, str) or not numbers:
            return f"returned a step {short(step)}, {expected}"
        trace.append((ids, int(step[1]), int(step[2])))
    return trace


def describe_event(events: list, k: int) -> str:
    """Event k in words: ``("arrive", 3)`` -> ``"request 2 arrives, 3 blocks"`` (the 3rd arrival)."""
    kind, value = events[k]
    if kind == "arrive":
        return f"request {sum(e[0] == 'arrive' for e in events[:k])} arrives, {value} blocks"
    return f"request {value} finishes"


def said_step(step: tuple) -> str:
    """One step in words: ``([2], 3, 2)`` -> ``"waiting [2], 3 free, largest free run 2"``."""
    return f"waiting {step[0]}, {step[1]} free, largest free run {step[2]}"


def buddy_mistakes(num_blocks: int, events: list, got: list, want: list) -> dict:
    """The rules a wrong ``buddy_waits`` answer ``got`` may break, each a test on it (True: broken):
    its waiting lists are those of a known mistake's pool (the stage's ``Scheduler`` over that pool),
    or it breaks a rule that can be read off the answer itself."""

    def waits_as(allocator, blocks_of=None) -> bool:
        theirs = scheduler_buddy_waits(num_blocks, events, allocator, blocks_of)
        return [w for w, _, _ in got] == [w for w, _, _ in theirs] != [w for w, _, _ in want]

    def unrounded() -> bool:  # a step with the right queues, free blocks short of the runs' rounding
        arrivals = [value for kind, value in events if kind == "arrive"]
        gone: set[int] = set()
        for k, (kind, value) in enumerate(events):
            arrived = sum(e[0] == "arrive" for e in events[: k + 1])
            gone |= {value} if kind == "finish" else set()
            running = [r for r in range(arrived) if r not in gone and r not in want[k][0]]
            rounding = sum(next_pow2(arrivals[r]) - arrivals[r] for r in running)
            if got[k][0] == want[k][0] and rounding and got[k][1] == want[k][1] + rounding:
                return True
        return False

    def jumped() -> bool:  # a request admitted while an earlier one still waits
        gone: set[int] = set()
        for k, (kind, value) in enumerate(events):
            arrived = sum(e[0] == "arrive" for e in events[: k + 1])
            gone |= {value} if kind == "finish" else set()
            waiting = got[k][0]
            if waiting and any(r not in waiting for r in range(min(waiting), arrived) if r not in gone):
                return True
        return False

    return {  # the pools first: a model's whole waiting lists say more than one symptom
        "the smallest free run that holds the request, not the one with the lowest first block": lambda: (
            waits_as(_LowestRun(num_blocks, 2, OutOfBlocksError))
        ),
        "a run given back merges with its buddy (the run at start ^ size) while that buddy is free, whole": (
            lambda: waits_as(_NoMerge(num_blocks, 2, OutOfBlocksError))
        ),
        "a run starts at a multiple of its size: free blocks in a row are not a run": lambda: waits_as(
            _Stretches(num_blocks), None
        ),
        "counted free blocks without contiguity: the request's run must be one free run": lambda: waits_as(
            BlockAllocator(num_blocks, 2), next_pow2
        ),
        "that is paging: under Orca a request needs one free run of next_pow2(n) blocks, not n free blocks": (
            lambda: waits_as(BlockAllocator(num_blocks, 2))
        ),
        "n blocks take a run of next_pow2(n) blocks: the rest of the run is held too": unrounded,
        "nobody jumps the queue: while a request waits, every later one waits too": jumped,
    }


def check_buddy_waits(buddy_waits: Callable) -> None:
    """Grade ``buddy_waits(num_blocks, events) -> [(waiting, free, largest_free_run), ...]`` against this
    stage's ``Scheduler`` over the engine's buddy allocator (``scheduler_buddy_waits``)."""

    def case(num_blocks: int, events: list) -> Callable[[], str | None]:
        def run() -> str | None:
            want = scheduler_buddy_waits(num_blocks, events)
            got = as_trace(buddy_waits(num_blocks, [tuple(e) for e in events]), len(events))
            if isinstance(got, str):
                return got
            if got == want:
                return None
            k = next(k for k, (g, w) in enumerate(zip(got, want, strict=True)) if g != w)
            problem = (
                f"after event {k + 1} ({describe_event(events, k)}): {said_step(got[k])}; expected "
                f"{said_step(want[k])}"
            )
            return named_mistake(problem, got, buddy_mistakes(num_blocks, events, got, want), same=hit)

        return run

    def arrive(*sizes: int) -> list[tuple]:
        return [("arrive", n) for n in sizes]

    def finish(*ids: int) -> list[tuple]:
        return [("finish", r) for r in ids]

    run_cases(
        [
            Case(
                "the worked example: 3 blocks free, a request of 3 waits",
                case(8, arrive(3, 1, 3) + finish(0, 1)),
            ),
            Case("a request of 5 blocks takes a run of 8", case(16, arrive(5, 5, 1) + finish(0))),
            Case(
                "the smallest free run that holds it, not the first",
                case(16, arrive(4, 4, 2) + finish(0) + arrive(2, 4, 4)),
            ),
            Case(
                "runs given back merge with their buddies, up to the whole pool",
                case(16, arrive(1, 1, 2, 4, 8) + finish(0, 1, 2, 3) + arrive(8) + finish(4, 5) + arrive(16)),
            ),
            Case(
                "blocks 2..5 are free, yet no run of 4 is",
                case(8, arrive(2, 2, 2, 2) + finish(1, 2) + arrive(4)),
            ),
            Case(
                "4 blocks free in two pieces: a request of 4 waits",
                case(8, arrive(2, 2, 2, 2) + finish(0, 2) + arrive(4)),
            ),
            Case(
                "first come, first served: a request of 1 waits behind one of 8",
                case(16, arrive(8, 4, 8, 1) + finish(0)),
            ),
            Case(
                "a request that finishes while waiting leaves the queue",
                case(8, arrive(4, 8, 2) + finish(1)),
            ),
            Case(
                "a pool of 12 blocks starts as runs of 8 and 4",
                case(12, arrive(4, 8) + finish(0) + arrive(2, 2)),
            ),
        ]
    )


def draw_buddy_traces(rng) -> list[dict]:
    """Eight event lists, four aimed and four random. Aimed: a pool filled with equal runs, every other
    one given back, then a request twice their size, which waits with half the pool free (external
    fragmentation); small runs given back in a random order, which merge back into the whole pool;
    a big request that waits with small ones behind it, one of which gives up; a pool that is not a
    power of two (its first runs, and the smallest that fits). Random: pools of 8 to 64 blocks, 12 to
    30 events, mostly small requests, finishes of any request not finished yet. Every request fits the
    empty pool."""
    pools = [8, 12, 16, 24, 32, 40, 48, 64]

    def largest(num_blocks: int) -> int:
        return 1 << (num_blocks.bit_length() - 1)

    def size(top: int) -> int:  # blocks a request asks for, up to top, most of them small
        return rng.randint(1, top) if rng.random() < 0.3 else rng.randint(1, max(1, top // 4))

    cases = []
    run, count = rng.choice([1, 2, 4]), rng.choice([8, 16])
    num_blocks = run * count
    events = [("arrive", rng.randint(run // 2 + 1, run)) for _ in range(count)]
    events += [("finish", r) for r in rng.sample(range(0, count, 2), count // 2)]
    events += [("arrive", 2 * run - rng.randint(0, run - 1))]
    cases.append({"num_blocks": num_blocks, "events": events})

    num_blocks = rng.choice([16, 32])
    sizes = [1, 1, 2, 4, 8][: rng.randint(3, 5)]
    sizes += [rng.choice([1, 2]) for _ in range(rng.randint(1, 4))]
    events = [("arrive", n) for n in sizes]
    events += [("finish", r) for r in rng.sample(range(len(sizes)), len(sizes))]
    events += [("arrive", num_blocks - rng.randint(0, num_blocks // 2 - 1))]
    cases.append({"num_blocks": num_blocks, "events": events})

    num_blocks = rng.choice([16, 32])
    half = num_blocks // 2
    events = [("arrive", half), ("arrive", rng.randint(1, half // 2)), ("arrive", half)]
    events += [("arrive", rng.randint(1, 2)) for _ in range(rng.randint(1, 3))]
    events += [("finish", rng.choice([2, 3])), ("finish", 0)]
    cases.append({"num_blocks": num_blocks, "events": events})

    num_blocks = rng.choice([12, 24, 40, 48])
    events = [("arrive", rng.randint(1, largest(num_blocks) // 2)) for _ in range(rng.randint(2, 4))]
    events += [("arrive", largest(num_blocks)), ("finish", 0)]
    cases.append({"num_blocks": num_blocks, "events": events})

    for _ in range(4):
        num_blocks = rng.choice(pools)
        events, alive = [], []
        for _ in range(rng.randint(12, 30)):
            if alive and rng.random() < 0.4:
                gone = rng.choice(alive)
                alive.remove(gone)
                events.append(("finish", gone))
            else:
                alive.append(sum(e[0] == "arrive" for e in events))
                events.append(("arrive", size(largest(num_blocks))))
        cases.append({"num_blocks": num_blocks, "events": events})
    rng.shuffle(cases)
    return cases


def observe_buddy_waits(fn, case) -> list[dict] | str:
    """One step per event, named by the event; or what is wrong with the result's shape."""
    events = [tuple(e) for e in case["events"]]
    got = as_trace(fn(case["num_blocks"], list(events)), len(events))
    if isinstance(got, str):
        return got
    return [
        {
            "call": f"event {k + 1} ({describe_event(events, k)})",
            "waiting": waiting,
            "free": free,
            "largest free run": largest,
        }
        for k, (waiting, free, largest) in enumerate(got)
    ]


def describe_buddy_waits(case: dict) -> str:
    events = " ".join(f"{'+' if kind == 'arrive' else '-'}{value}" for kind, value in case["events"])
    return f"{case['num_blocks']} blocks: {events}"


def scheduler_watermark(running, waiting, num_free, block_size, watermark) -> dict:
    """``admit_with_watermark``'s answer from this stage's ``Scheduler``, as an observation: one step
    of the running requests alone (each decodes its newest token, growing its block table with
    ``allocate_slots``), then admission by a second ``Scheduler`` whose pool is the free blocks less the
    watermark (the watermark's blocks are hidden from admission, and only from admission)."""
    if watermark < 0 or block_size < 1:
        return {"raised": "ValueError"}
    held = sum(-(-(n - 1) // block_size) for n in running)
    allocator = BlockAllocator(max(1, held + num_free), block_size)
    if held + num_free == 0:
        allocator.alloc_blocks(1)  # a pool of 0 blocks: BlockAllocator wants one, so hold it
    sched = Scheduler(
        allocator, EngineConfig(max_num_seqs=len(running) + 1, max_num_batched_tokens=len(running) + 1)
    )
    for i, n in enumerate(running):
        seq = Sequence(i, [1] * (n - 1), n)
        seq.output_ids = [7]  # its newest token, not cached yet
        allocate_slots(seq, allocator, n - 1)
        seq.num_computed_tokens, seq.status = n - 1, Status.RUNNING
        sched.running.append(seq)
    sched.schedule()
    if sched.num_preemptions:
        return {"raised": "ValueError"}  # the running requests' growth does not fit: the stage preempts
    room = allocator.num_free - watermark  # what admission may take
    if room < 1 or not waiting:
        return {"returned": [0, allocator.num_free]}
    admission = BlockAllocator(room, block_size)
    newcomers = Scheduler(
        admission, EngineConfig(max_num_seqs=len(waiting), max_num_batched_tokens=sum(waiting))
    )
    for j, prompt_len in enumerate(waiting):
        newcomers.add(Sequence(j, [1] * prompt_len, 1))
    admitted = len(newcomers.schedule())
    return {"returned": [admitted, admission.num_free + watermark]}


def watermark_mistakes(running, waiting, num_free, block_size, watermark) -> dict:
    """The known mistakes of ``admit_with_watermark``, each the stage's answer on a changed input."""

    def ref(*args) -> str:
        return said(scheduler_watermark(*args))

    return {
        "the running requests grow first: their new blocks come before admission": lambda: ref(
            [], waiting, num_free, block_size, watermark
        ),
        "off by one: a decoding request needs a block for position num_tokens - 1, not num_tokens": lambda: (
            ref([n + 1 for n in running], waiting, num_free, block_size, watermark)
        ),
        "free blocks may come down to the watermark itself (>= watermark, not >)": lambda: ref(
            running, waiting, num_free, block_size, watermark + 1
        ),
        "the watermark holds back admission only: running requests may grow into it": lambda: (
            "raised ValueError"
            if "raised" in scheduler_watermark(running, [], num_free - watermark, block_size, 0)
            else None
        ),
    }


def check_watermark(admit_with_watermark: Callable) -> None:
    """Grade ``admit_with_watermark(running, waiting, num_free, block_size, watermark) -> (admitted,
    free_after)`` against this stage's ``Scheduler`` (see ``scheduler_watermark``)."""

    def case(running, waiting, num_free, block_size, watermark) -> Callable[[], str | None]:
        def run() -> str | None:
            args = (list(running), list(waiting), num_free, block_size, watermark)
            want = scheduler_watermark(*args)
            got = returned_or_raised(admit_with_watermark, *args)
            if got == want:
                return None
            problem = f"got {said(got)}, expected {said(want)}"
            if float_pair(got):
                return f"{problem} (admitted and free_after are ints, not floats)"
            return named_mistake(problem, said(got), watermark_mistakes(*args))

        return run

    run_cases(
        [
            Case("no running requests, watermark 0: every prompt that fits", case([], [3, 4, 2], 5, 2, 0)),
            Case("watermark 2 stops the third prompt", case([], [3, 4, 2], 6, 2, 2)),
            Case("decoders crossing into a new block take theirs first", case([5, 9, 4], [2, 2], 4, 4, 1)),
            Case("decoders inside their last block take nothing", case([6, 7, 8], [4, 4, 4], 3, 4, 1)),
            Case("the first prompt that does not fit stops the rest", case([2], [9, 1, 1], 5, 2, 1)),
            Case("the watermark does not hold back running requests", case([3, 3], [1], 2, 2, 2)),
            Case("block_size 1: a block per position", case([4, 2], [3, 1], 7, 1, 2)),
            Case("the running requests alone do not fit: ValueError", case([5, 5], [1], 1, 4, 0)),
            Case("a negative watermark: ValueError", case([], [1], 4, 4, -1)),
        ]
    )


def draw_watermarks(rng) -> list[dict]:
    """Ten steps, two of them tight (after the first prompts exactly the watermark is left): block
    sizes 1 to 8; 0 to 5 decoding requests, their newest position now and then the
    first of a block (``n - 1`` a multiple of the block size); 0 to 6 waiting prompts; free blocks
    that cover the growth, a watermark from 0 to a few blocks; one case whose growth does not fit and
    one with a negative watermark."""

    def step(bad_growth: bool = False, bad_watermark: bool = False) -> dict:
        block_size = rng.choice([1, 2, 3, 4, 8])
        running = []
        for _ in range(rng.randint(0 if not bad_growth else 1, 5)):
            n = rng.randint(2, 30)
            if rng.random() < 0.5:  # its newest token starts a block
                n = block_size * rng.randint(1, 4) + 1
            running.append(n)
        growth = sum(-(-n // block_size) - -(-(n - 1) // block_size) for n in running)
        num_free = growth + rng.randint(0, 8)
        if bad_growth:
            running.append(block_size * rng.randint(1, 3) + 1)  # one more block than is free
            num_free = growth
        waiting = [rng.randint(1, 4 * block_size) for _ in range(rng.randint(0, 6))]
        watermark = -rng.randint(1, 3) if bad_watermark else rng.randint(0, 4)
        return {
            "running": running,
            "waiting": waiting,
            "num_free": num_free,
            "block_size": block_size,
            "watermark": watermark,
        }

    def tight() -> dict:  # after the first prompts, exactly the watermark is left
        case = step()
        case["waiting"] = case["waiting"] or [rng.randint(1, 9)]
        size, first = case["block_size"], rng.randint(1, len(case["waiting"]))
        growth = sum((n - 1) % size == 0 for n in case["running"])
        taken = sum(-(-p // size) for p in case["waiting"][:first])
        case["watermark"] = rng.randint(1, 4)
        case["num_free"] = growth + taken + case["watermark"]
        return case

    cases = [step() for _ in range(6)] + [tight(), tight(), step(bad_growth=True), step(bad_watermark=True)]
    rng.shuffle(cases)
    return cases


def observe_watermark(fn, case) -> list[dict]:
    args = (list(case["running"]), list(case["waiting"]), case["num_free"], case["block_size"])
    got = returned_or_raised(fn, *args, case["watermark"])
    return [{"call": f"admit_with_watermark({describe_watermark(case)})", "result": said(got)}]


def describe_watermark(case: dict) -> str:
    return (
        f"running {case['running']}, waiting {case['waiting']}, {case['num_free']} free, block_size "
        f"{case['block_size']}, watermark {case['watermark']}"
    )


def exhaustive_preemption(computed, need, block_size, blocks_of=None) -> dict:
    """``cheapest_preemption``'s answer by trying every set of victims (2^n of them: fine for the
    visible cases' n <= 9, hopeless for the hidden cases' 60), as an observation. ``blocks_of(c)``
    is the blocks a request with ``c`` computed tokens holds (default: ceil(c / block_size))."""
    if block_size < 1 or need < 0 or any(c < 0 for c in computed):
        return {"raised": "ValueError"}
    blocks_of = blocks_of or (lambda c: -(-c // block_size))
    best = None
    for mask in range(1 << len(computed)):
        chosen = [c for i, c in enumerate(computed) if mask >> i & 1]
        if sum(blocks_of(c) for c in chosen) >= need:
            best = min(best or (sum(chosen), len(chosen)), (sum(chosen), len(chosen)))
    return {"raised": "ValueError"} if best is None else {"returned": list(best)}


def greedy_preemption(computed, need, block_size) -> dict:
    """A known mistake: victims taken fewest computed tokens first until enough blocks are free."""
    lost = victims = freed = 0
    for c in sorted(computed):
        if freed >= need:
            break
        lost, victims, freed = lost + c, victims + 1, freed + -(-c // block_size)
    return {"returned": [lost, victims]} if freed >= need else {"raised": "ValueError"}


def check_cheapest_preemption(cheapest_preemption: Callable) -> None:
    """Grade ``cheapest_preemption(computed, need, block_size) -> (tokens_lost, victims)`` against an
    exhaustive search over every set of victims."""

    def case(computed, need, block_size) -> Callable[[], str | None]:
        def run() -> str | None:
            want = exhaustive_preemption(computed, need, block_size)
            got = returned_or_raised(cheapest_preemption, list(computed), need, block_size)
            if got == want:
                return None
            mistakes = {
                "among sets that lose as few tokens, the fewest victims": lambda: said(
                    exhaustive_most_victims(computed, need, block_size)
                ),
                "fewest tokens first is not the cheapest set: a request with many tokens in few blocks can "
                "be cheaper": lambda: said(greedy_preemption(computed, need, block_size)),
                "a partly filled block is held too: a request holds ceil(computed / block_size) blocks": lambda: (
                    said(exhaustive_preemption(computed, need, block_size, lambda c: c // block_size))
                ),
            }
            problem = f"got {said(got)}, expected {said(want)}"
            if float_pair(got):
                return f"{problem} (tokens_lost and victims are ints, not floats)"
            return named_mistake(problem, said(got), mistakes)

        return run

    run_cases(
        [
            Case("nothing to free: need 0", case([5, 9], 0, 4)),
            Case("one request frees enough", case([3, 17, 8], 2, 4)),
            Case("two small requests beat one large", case([12, 4, 4, 30], 2, 4)),
            Case("fewest tokens first is not cheapest", case([9, 4, 4, 7], 3, 4)),
            Case("partly filled blocks count as blocks", case([1, 1, 1, 16, 6], 3, 8)),
            Case("equal tokens lost: the fewest victims", case([6, 2, 4, 9], 2, 4)),
            Case("a request with 0 computed tokens frees nothing", case([0, 0, 6, 2], 2, 2)),
            Case("5 of the 6 blocks held", case([5, 3, 7], 5, 3)),
            Case("more blocks than all of them hold: ValueError", case([4, 4], 3, 4)),
        ]
    )


def exhaustive_most_victims(computed, need, block_size) -> dict:
    """A known mistake: the tie between sets that lose as few tokens broken towards more victims."""
    best = None
    for mask in range(1 << len(computed)):
        chosen = [c for i, c in enumerate(computed) if mask >> i & 1]
        if sum(-(-c // block_size) for c in chosen) >= need:
            best = min(best or (sum(chosen), -len(chosen)), (sum(chosen), -len(chosen)))
    return {"raised": "ValueError"} if best is None else {"returned": [best[0], -best[1]]}


def draw_preemption_costs(rng) -> list[dict]:
    """Eleven cases: four small (up to 10 running requests) and four of 40 to 60 running requests with
    up to 500 computed tokens each (too many for trying every set); block sizes 1 to 16; some
    requests with 0 tokens, some with exactly full blocks, ties made likely by repeated lengths; ``need``
    from 0 to everything held, and one case that asks for more than everything (ValueError); then the
    three other errors the exercise specifies, each on a small case: a ``block_size`` below 1, a
    negative ``need``, a negative count in ``computed`` (ValueError)."""

    def costs(n: int, top: int, block_size: int) -> list[int]:
        pool = [rng.randint(0, top) for _ in range(max(2, n // 3))] + [block_size * rng.randint(1, 4)]
        return [rng.choice(pool) if rng.random() < 0.5 else rng.randint(0, top) for _ in range(n)]

    cases = []
    for k in range(8):
        big = k >= 4
        block_size = rng.choice([4, 8, 16] if big else [1, 2, 4, 8, 16])
        computed = costs(rng.randint(40, 60) if big else rng.randint(1, 10), 500 if big else 60, block_size)
        held = sum(-(-c // block_size) for c in computed)
        need = rng.randint(0, held) if k != 3 else held + rng.randint(1, 3)
        cases.append({"computed": computed, "need": need, "block_size": block_size})
    computed = costs(rng.randint(1, 10), 60, 4)
    cases.append({"computed": computed, "need": rng.randint(0, 3), "block_size": rng.choice([0, -1, -4])})
    cases.append({"computed": computed, "need": -rng.randint(1, 3), "block_size": rng.choice([1, 2, 4])})
    spoilt = computed[:]
    spoilt[rng.randrange(len(spoilt))] = -rng.randint(1, 9)
    cases.append({"computed": spoilt, "need": rng.randint(0, 2), "block_size": rng.choice([1, 2, 4])})
    rng.shuffle(cases)
    return cases


def observe_preemption_cost(fn, case) -> list[dict]:
    got = returned_or_raised(fn, list(case["computed"]), case["need"], case["block_size"])
    return [{"call": f"cheapest_preemption({describe_preemption_cost(case)})", "result": said(got)}]


def describe_preemption_cost(case: dict) -> str:
    computed = case["computed"]
    shown = str(computed) if len(computed) <= 12 else f"{len(computed)} requests {computed[:6]}..."
    return f"computed {shown}, need {case['need']}, block_size {case['block_size']}"


SCHEDULER = "L3_block_tensor.scheduler:Scheduler"
SHOWN_BUGS = [  # the check cell's; the hidden cases add the rest of SCHEDULER_BUGS
    "L3 preemption keeps the blocks of the victim",
    "L3 preempts the most important sequence instead of the least",
]
SCHEDULER_BUGS = [
    *SHOWN_BUGS,
    "L3 preemption forgets to reset what the victim computed",
    "L3 admits waiting sequences in a step that preempted",
    "L3 a finished sequence keeps its blocks",
    "L3 admission ignores max_num_seqs",
]


def check_catch_scheduler(test_scheduler: Callable) -> None:
    """Grade a learner's ``test_scheduler(Scheduler)``: it must pass this stage's ``Scheduler`` and fail
    it with each bug of ``SHOWN_BUGS`` put in (``kvcourse/grading/mutations.py``). A test that is still the
    stub (it raises NotImplementedError) raises in every case, so it reads as not done yet rather than
    as a test that catches the bugs."""
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # the learner's prints, dropped as run_cases does
            test_scheduler(version(SCHEDULER))
        stub = None
    except NotImplementedError as e:
        stub = e
    except Exception:  # noqa: BLE001 - the correct version's case reports it
        stub = None

    def unless_stub(case: Case) -> Case:
        def run() -> str | None:
            if stub is not None:
                raise stub
            return case.run()

        return Case(case.name, run)

    run_cases([unless_stub(c) for c in catch_cases(test_scheduler, SCHEDULER, SHOWN_BUGS, "the scheduler")])


def run_predicted_steps() -> dict:
    """The L3.9 operations, run on this stage: a pool of 5 blocks of 2; requests 0..3 with prompts of
    3, 2, 1, 2 tokens and max_new_tokens 5, 4, 2, 3 (eos ignored) submitted together; four steps of
    ``schedule`` then ``update``, the model's next token always 7. Returns the state the learner
    predicts."""
    sched = Scheduler(BlockAllocator(5, 2), EngineConfig(max_num_seqs=4, max_num_batched_tokens=64))
    seqs = [
        Sequence(i, [100 + i] * prompt_len, max_new, ignore_eos=True)
        for i, (prompt_len, max_new) in enumerate([(3, 5), (2, 4), (1, 2), (2, 3)])
    ]
    for seq in seqs:
        sched.add(seq)
    for _ in range(4):
        batch = sched.schedule()
        wanted = [seq for seq, n in batch if seq.num_computed_tokens + n == seq.num_tokens]
        sched.update(batch, [7] * len(wanted))
    return {
        "block_tables": [list(seq.block_table) for seq in seqs],
        "num_computed_tokens": [seq.num_computed_tokens for seq in seqs],
        "free_list": list(sched.allocator.free_blocks),
        "running": [seq.request_id for seq in sched.running],
        "waiting": [seq.request_id for seq in sched.waiting],
        "finished": [seq.request_id for seq in sched.finished],
        "num_preemptions": sched.num_preemptions,
    }


def how_wrong(want, got) -> str | None:
    """What differs between a predicted value and the real one, without saying the real one: None
    when equal. ``how_wrong([2, 4], [4, 2]) -> "2 of 2 entries differ"``."""
    if got == want:
        return None
    if isinstance(want, int):
        return "not the number the run gives" if isinstance(got, int) else f"{type(got).__name__}, not an int"
    if not isinstance(got, list):
        return f"{type(got).__name__}, not a list"
    if len(got) != len(want):
        return (
            f"{len(got)} {'entry' if len(got) == 1 else 'entries'}: not the number of entries the run gives"
        )
    wrong = sum(g != w for g, w in zip(got, want, strict=True))
    return f"{wrong} of {len(want)} entries differ"


def check_predict(predict: Callable) -> None:
    """Grade ``predict() -> dict`` against the state the run of the stage gives, one case per key;
    no line says the real value (the demo cell below the check shows it)."""
    want = run_predicted_steps()

    def case(key: str) -> Callable[[], str | None]:
        def run() -> str | None:
            got = predict()
            if not isinstance(got, dict):
                return f"predict() returned {type(got).__name__}, not a dict"
            if key not in got:
                return f"no key {key!r} in the prediction"
            value = got[key]
            if isinstance(value, tuple):
                value = list(value)
            if key == "block_tables" and isinstance(value, list):
                value = [list(v) if isinstance(v, tuple) else v for v in value]
            return how_wrong(want[key], value)

        return run

    run_cases([Case(key.replace("_", " "), case(key)) for key in want])


def draw_predict(rng) -> list[dict]:
    """One case, the same every run: the operations are the exercise."""
    return [{}]


def observe_predict(fn, case) -> object:
    return fn()


HIDDEN.update(
    {
        "L3.5": Hidden(
            draw_buddy_traces,
            observe_buddy_waits,
            describe_buddy_waits,
            answers=(
                "kvcourse.orca:BuddyAllocator.alloc_blocks",
                "kvcourse.orca:BuddyAllocator.free",
                "kvcourse.orca:BuddyAllocator._release",
            ),
        ),
        "L3.6": Hidden(
            draw_watermarks,
            observe_watermark,
            describe_watermark,
            answers=("L3_block_tensor.scheduler:Scheduler.schedule",),
        ),
        "L3.7": Hidden(draw_preemption_costs, observe_preemption_cost, describe_preemption_cost),
        "L3.8": catch_hidden(
            SCHEDULER,
            SCHEDULER_BUGS,
            watch=tuple(
                f"{SCHEDULER}.{name}"
                for name in ("schedule", "update", "_allocate_or_preempt", "_preempt", "_finish")
            ),
        ),
        "L3.9": Hidden(
            draw_predict,
            observe_predict,
            lambda case: "the four steps of the exercise",
            answers=(
                "L3_block_tensor.scheduler:Scheduler.schedule",
                "L3_block_tensor.scheduler:Scheduler.update",
            ),
            explain=unrevealed,  # the report says which keys are wrong, never their right values
        ),
    }
)
