"""The L3 notebook's exercise checkers: the learner's function against this stage's own code.

- ``check_slots``: pool slots from a block table, against ``slots`` (``sequence.py``);
- ``check_plan_step``: how many tokens each sequence runs in one step, against what
  ``Scheduler.schedule`` (``scheduler.py``) plans for the same queues;
- ``check_preempt``: sending a running sequence back to waiting when the pool runs dry, against the
  first preemption ``Scheduler`` itself makes in the same state (which sequence, its blocks on the free
  list, both queues, what it keeps and what it forgets);
- ``check_admitted``: how many waiting requests a reservation policy (paged, Oracle, Pow2, Max)
  admits in one step at a KV budget of ``num_blocks``, against what ``Scheduler.schedule`` admits.

The grading contract (see ``kvcourse/grading/cases.py``): each checker runs fixed cases and prints one
deterministic line per case (``ok``, ``WRONG — what differs``, or ``raised`` and the exception), then
``k/n passed``. The reference notebook stores those lines as the check cell's output and ``make grade``
compares them. The references are the stage's own code, never a copy kept here.

Below the checkers, ``HIDDEN`` holds each exercise's hidden cases for ``make grade``
(``kvcourse/grading/hidden.py``): drawn from a seed per grading run and judged in the grader's process against
the independent answers of ``answers.py``, never against this stage's code.

Left out on purpose: partial credit and hints; ``plan_step`` is graded with plenty of free blocks,
so preemption is not part of it (``check_preempt`` grades it alone, one preemption at a time, not the
retry loop around it).
"""

from __future__ import annotations

from collections.abc import Callable

from kvcourse.grading.bugs import version
from kvcourse.grading.cases import Case, named_mistake, run_cases
from kvcourse.grading.hidden import Hidden

from ..allocator import BlockAllocator
from ..scheduler import Scheduler
from ..sequence import Sequence, Status, reserve
from ..sequence import slots as ref_slots


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
    sched = Scheduler(
        BlockAllocator(256, 4),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        prefill_chunk_size=prefill_chunk_size,
    )
    seqs = []
    for i, todo in enumerate(running):
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


def scheduler_admitted(policy, requests, num_blocks, block_size, max_model_len) -> int:
    """How many of ``requests`` ((prompt_len, max_new_tokens) pairs, all waiting, in order)
    ``Scheduler.schedule`` admits in one step under ``policy``, seats and token budget never the limit."""
    allocator = BlockAllocator(num_blocks, block_size)
    tokens = sum(p for p, _ in requests) + 1
    sched = Scheduler(
        allocator,
        max_num_seqs=len(requests) + 1,
        max_num_batched_tokens=tokens,
        reservation=policy,
        max_model_len=max_model_len,
    )
    for i, (prompt_len, max_new) in enumerate(requests):
        sched.add(Sequence(i, [7] * prompt_len, max_new, ignore_eos=True))
    return len(sched.schedule())


def admission_mistakes(policy, requests, num_blocks, block_size, max_model_len) -> dict:
    """The known mistakes of ``admitted``, each what ``Scheduler`` admits on a changed input: another
    policy, no cap on Pow2, or requests picked out of order."""

    def admits(as_policy, reqs=requests, cap=max_model_len) -> int:
        return scheduler_admitted(as_policy, reqs, num_blocks, block_size, cap)

    def jumping() -> int:  # every request that still fits, skipping those that do not
        taken = []
        for request in requests:
            if admits(policy, taken + [request]) == len(taken) + 1:
                taken.append(request)
        return len(taken)

    mistakes = {
        "paged": {"paged holds its prompt's blocks at admission, not its whole length": lambda: admits("oracle")},
        "oracle": {"Oracle holds the whole length (prompt + max_new_tokens), not the prompt": lambda: admits("paged")},
        "pow2": {"Pow2 is capped at max_model_len": lambda: admits("pow2", cap=1 << 30)},
        "max": {"Max holds max_model_len for every request, not its length": lambda: admits("oracle")},
    }.get(policy, {})  # fmt: skip
    return {
        **mistakes,
        "nobody jumps the queue: admission stops at the first request that does not fit": jumping,
    }


def check_admitted(admitted: Callable) -> None:
    """Grade ``admitted(policy, requests, num_blocks, block_size, max_model_len) -> int`` against what
    ``Scheduler.schedule`` admits in its first step.

    ``requests`` are (prompt_len, max_new_tokens) pairs, all waiting, first come first served; seats
    and the token budget are never the limit, blocks are. Example, 16 blocks of 4, max_model_len 32,
    five requests (3, 7): paged admits 5 (a block each), Oracle 5 (3 each), Pow2 4, Max 2.
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

    same = [(3, 7)] * 5
    mixed = [(5, 20), (2, 3), (9, 6), (4, 12), (1, 1)]
    run_cases(
        [
            Case("paged, five (3, 7) on 16 blocks of 4", case("paged", same, 16)),
            Case("oracle, five (3, 7) on 16 blocks of 4", case("oracle", same, 16)),
            Case("pow2, five (3, 7) on 16 blocks of 4", case("pow2", same, 16)),
            Case("max, five (3, 7) on 16 blocks of 4", case("max", same, 16)),
            Case(
                "oracle, mixed lengths: the first that does not fit stops the rest", case("oracle", mixed, 10)
            ),
            Case("pow2, a length already a power of two", case("pow2", [(6, 10), (8, 8)], 8)),
            Case("pow2 never past max_model_len", case("pow2", [(20, 21), (1, 1)], 11, 4, 44)),
            Case("paged holds a prompt's blocks only", case("paged", mixed, 5)),
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
                reserve(seq, allocator, t + 1)
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
    exactly as the scheduler does when ``reserve`` finds the free list too short: the same victim, taken
    out of ``running`` and put into ``waiting`` at its place in scheduling order, all its blocks back on
    the free list, its block table empty, ``num_computed_tokens`` 0 and status ``WAITING``, its prompt
    and generated tokens kept (they are what it recomputes). The reference is a real ``Scheduler`` given
    the same queues, stopped right after its first ``_preempt``.

    Example, block_size 4: running requests 0 (blocks [0, 2], 7 computed) and 1 (blocks [1, 3, 4], 9
    computed, 2 tokens generated), free list [5]; waiting [2] -> victim request 1; running [0]; free list
    [5, 1, 3, 4]; waiting [1, 2]; request 1 keeps its 2 generated tokens and recomputes all 10 tokens.
    """

    def reference(allocator, running, waiting) -> Sequence:
        sched = Scheduler(allocator, max_num_seqs=len(running) + len(waiting), max_num_batched_tokens=4096)
        sched.running, sched.waiting = running, waiting  # the same lists: they change in place

        def first_preemption(seq: Sequence) -> None:
            Scheduler._preempt(sched, seq)
            raise _FirstPreemption(seq)

        sched._preempt = first_preemption
        grower = running[0]  # wants one block more than the free list holds
        target = (len(grower.block_table) + allocator.num_free + 1) * allocator.block_size
        try:
            sched._reserve_or_preempt(grower, target)
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
# judged in the grader's process against the independent answers of answers.py.


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
    """Eight queues, three aimed and five random: Pow2 where the next power of two passes a
    max_model_len that is not one (the cap decides whether it fits), paged where whole lengths would
    not fit but prompts do, and a long request in front of a short one that would fit (nobody jumps the
    queue); the random ones: any policy, 1-8 requests that fit max_model_len, a budget between the
    largest reservation and all of them."""

    def queue(policy, requests, num_blocks, block_size, max_model_len) -> dict:
        return {"policy": policy, "requests": requests, "num_blocks": num_blocks, "block_size": block_size,
                "max_model_len": max_model_len}  # fmt: skip

    block_size = rng.choice([2, 4, 8])
    max_len = rng.choice([40, 48, 56, 100])  # not a power of two
    length = rng.randint(max_len // 2 + 1 + 8, max_len)  # its power of two passes max_len
    capped = -(-max_len // block_size)
    prompts = [rng.randint(1, 4) for _ in range(rng.randint(3, 6))]
    long = rng.randint(12, 20)
    cases = [
        queue("pow2", [[length - 8, 8], [1, 1]], capped, block_size, max_len),
        queue("paged", [[p, 30] for p in prompts], len(prompts), 4, 64),
        queue("oracle", [[long, 10], [1, 1], [2, 1]], -(-(long + 10) // 4) - 1, 4, 64),
    ]
    for _ in range(5):
        block_size = rng.choice([2, 4, 8, 16])
        max_model_len = rng.choice([16, 32, 48, 64, 100])
        requests = []
        for _ in range(rng.randint(1, 8)):
            prompt_len = rng.randint(1, max_model_len - 1)
            requests.append([prompt_len, rng.randint(1, max_model_len - prompt_len)])
        biggest = -(-max_model_len // block_size)
        num_blocks = rng.randint(biggest, biggest * len(requests) + 1)
        cases.append(
            queue(
                rng.choice(["paged", "oracle", "pow2", "max"]),
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
            "L3_block_tensor.sequence:reservation_len",
            "L3_block_tensor.scheduler:Scheduler._held_blocks",
        ),
    ),
}
