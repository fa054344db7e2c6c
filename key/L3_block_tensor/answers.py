"""Independent answers to the L3 exercises, for the grader's hidden cases (``kvcourse/grading/hidden.py``).

Each function has the signature the notebook asks for and is written apart from the stage's own
code (``sequence.py``, ``scheduler.py``) and the buddy allocator (``kvcourse/orca.py``), so a bug in
either cannot make a wrong answer pass: ``slots`` lists every slot of the table and cuts the range
out of it, ``plan_step`` hands out seats and budget from plain counters, ``preempt`` picks its victim
with ``max`` over the scheduling order and inserts it into ``waiting`` by hand, ``admitted`` adds up
each policy's blocks and runs with its own arithmetic. Beyond the stage: ``buddy_waits`` reads the
buddy's free runs off a bitmap of owners instead of keeping free lists, ``admit_with_watermark``
counts the blocks decoders start with a modulo, ``cheapest_preemption`` is a knapsack over blocks to
free. ``test_scheduler`` is the answer key's test for the catch-the-bug exercise and ``predict`` was
worked out by hand (its docstring shows how). Tests check that the stage and these answers agree on
many drawn cases.

``EXPECT`` maps each exercise to ``case -> observation``: the exercise's ``observe`` (``exercises/L3_block_tensor/checks.py``)
run on the answer. ``STAGE_ADAPTERS`` give the stage's own implementations the learner's signatures
(``Scheduler.schedule`` as ``plan_step``, ``Scheduler._preempt`` as ``preempt``; for L3.5 the
stage's ``Scheduler`` over the engine's buddy allocator, for L3.6 the stage's ``Scheduler`` on the
pool less the watermark, for L3.8 a test that compares with the stage's ``Scheduler``, for L3.9 a
run of the stage), for the tests. L3.7 has none: the stage has no such code. The grader imports
this file; a submission's sandbox cannot read it.

Left out on purpose: error messages (only the error's type is graded).
"""

from __future__ import annotations

import math

from exercises.L3_block_tensor.checks import (
    HIDDEN,
    run_predicted_steps,
    scheduler_admitted,
    scheduler_buddy_waits,
    scheduler_plan,
    scheduler_watermark,
)
from kvcourse.engine_config import EngineConfig
from L3_block_tensor.allocator import BlockAllocator
from L3_block_tensor.scheduler import Scheduler
from L3_block_tensor.sequence import Sequence, Status


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
    """Requests are admitted in order while the free blocks cover what each takes at admission: its
    prompt's blocks (on_demand), or one buddy run of a power of two of blocks for its whole reservation
    (Oracle: prompt + output; Pow2: prompt + the output's next power of two, at most max_model_len in
    all; Max: max_model_len). From an empty pool that only hands runs out, the smallest free run that
    fits is always there when enough blocks are free: every halving leaves one free run of each size
    below the one it split, so the free runs are of different sizes, and free runs of different sizes
    all smaller than a run of 2^k add up to less than 2^k."""
    free, count = num_blocks, 0
    for prompt_len, max_new in requests:
        rounded = 2 ** math.ceil(math.log2(max_new)) if max_new > 0 else 0
        held = {
            "on_demand": prompt_len,
            "oracle": prompt_len + max_new,
            "pow2": min(prompt_len + rounded, max_model_len),
            "max": max_model_len,
        }[policy]
        blocks = math.ceil(held / block_size)
        if policy != "on_demand":
            blocks = 2 ** math.ceil(math.log2(blocks))  # one buddy run
        if blocks > free:
            break
        free -= blocks
        count += 1
    return count


def buddy_waits(num_blocks, events):
    """A bitmap of who holds each block. A free run is a block-aligned stretch of 2^k free blocks
    (``start % 2^k == 0``) that is not half of a larger one inside the pool that is free too; a request
    of n blocks takes the first 2^k of the smallest such run with 2^k >= n (lowest start among
    equals). Giving blocks back only clears them: the runs are read off the bitmap again, so merging
    with buddies needs no bookkeeping."""
    owner = [None] * num_blocks

    def whole(start, size):  # blocks start .. start + size - 1 aligned, inside the pool and all free
        inside = start % size == 0 and start + size <= num_blocks
        return inside and all(o is None for o in owner[start : start + size])

    def free_runs():  # (size, start) of every free run
        runs, size = [], 1
        while size <= num_blocks:
            for start in range(0, num_blocks - size + 1, size):
                if whole(start, size) and not whole(start - start % (2 * size), 2 * size):
                    runs.append((size, start))
            size *= 2
        return runs

    def take(request, n):
        size = 2 ** math.ceil(math.log2(n))
        fits = [run for run in free_runs() if run[0] >= size]
        if not fits:
            return False
        _, start = min(fits)
        owner[start : start + size] = [request] * size
        return True

    queue, arrivals, trace = [], 0, []
    for kind, value in events:
        if kind == "arrive":
            queue.append((arrivals, value))
            arrivals += 1
        else:
            owner[:] = [None if o == value else o for o in owner]  # its run, free again
            queue = [(r, n) for r, n in queue if r != value]
        while queue and take(*queue[0]):
            queue.pop(0)
        largest = max((size for size, _ in free_runs()), default=0)
        trace.append(([r for r, _ in queue], owner.count(None), largest))
    return trace


def scheduler_preempt(running, waiting, allocator):
    """``Scheduler._preempt`` as ``preempt``: on the given queues, of ``running[-1]``, the victim
    ``_allocate_or_preempt`` picks."""
    sched = Scheduler(
        allocator, EngineConfig(max_num_seqs=len(running) + len(waiting), max_num_batched_tokens=1)
    )
    sched.running, sched.waiting = running, waiting
    victim = running[-1]
    sched._preempt(victim)
    return victim


def admit_with_watermark(running, waiting, num_free, block_size, watermark):
    """Running requests take the block their new position (num_tokens - 1) starts, if it starts one;
    then prompts are admitted in order while the free blocks left stay at or above the watermark."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if watermark < 0:
        raise ValueError(f"watermark must be >= 0, got {watermark}")
    growth = sum(1 for n in running if (n - 1) % block_size == 0)
    if growth > num_free:
        raise ValueError(f"the running requests need {growth} new blocks, only {num_free} are free")
    free, count = num_free - growth, 0
    for prompt_len in waiting:
        blocks = math.ceil(prompt_len / block_size)
        if free - blocks < watermark:
            break
        free -= blocks
        count += 1
    return count, free


def cheapest_preemption(computed, need, block_size):
    """A min-cost covering knapsack: ``best[b]`` is the cheapest (tokens lost, victims) that frees at
    least ``b`` blocks, over the requests seen so far; each request is taken at most once (``b`` runs
    down)."""
    if block_size < 1 or need < 0 or any(c < 0 for c in computed):
        raise ValueError(f"block_size must be >= 1, need and computed >= 0: {block_size}, {need}, {computed}")
    held = [math.ceil(c / block_size) for c in computed]
    if need > sum(held):
        raise ValueError(f"need {need} blocks, the running requests hold only {sum(held)}")
    best = [(0, 0)] + [None] * need
    for c, blocks in zip(computed, held, strict=True):
        if blocks == 0:
            continue
        for b in range(need, 0, -1):
            before = best[max(0, b - blocks)]
            if before is not None:
                option = (before[0] + c, before[1] + 1)
                if best[b] is None or option < best[b]:
                    best[b] = option
    return best[need]


def test_scheduler(Scheduler):
    """Three short scenarios on a small pool, each checked step by step with ``check_invariants``."""

    def step(sched):
        batch = sched.schedule()
        wanted = [seq for seq, n in batch if seq.num_computed_tokens + n == seq.num_tokens]
        sched.update(batch, [7] * len(wanted))
        sched.check_invariants()
        return [(seq.request_id, n) for seq, n in batch]

    # 1. max_num_seqs 2: the third request waits until one finishes
    sched = Scheduler(BlockAllocator(16, 2), EngineConfig(max_num_seqs=2, max_num_batched_tokens=64))
    for i in range(3):
        sched.add(Sequence(i, [1, 2], 2, ignore_eos=True))
    assert step(sched) == [(0, 2), (1, 2)]
    assert step(sched) == [(0, 1), (1, 1)]
    assert sched.allocator.num_free == 16 and step(sched) == [(2, 2)]

    # 2. a low-priority request that came first is preempted, gives back all its blocks, recomputes
    sched = Scheduler(BlockAllocator(4, 2), EngineConfig(max_num_seqs=4, max_num_batched_tokens=64))
    low = Sequence(0, [1, 2], 6, ignore_eos=True, priority=-1)
    high = Sequence(1, [3, 4], 6, ignore_eos=True, priority=1)
    sched.add(low)
    sched.add(high)
    while sched.num_preemptions == 0:
        step(sched)
    assert low.status is Status.WAITING and low.block_table == [] and low.num_computed_tokens == 0
    assert high.status is Status.RUNNING and sched.allocator.num_free == 4 - len(high.block_table)

    # 3. a step that preempts admits nobody; then the newcomer runs; everything is given back
    sched = Scheduler(BlockAllocator(4, 2), EngineConfig(max_num_seqs=2, max_num_batched_tokens=64))
    sched.add(Sequence(0, [1, 2], 6, ignore_eos=True))
    sched.add(Sequence(1, [3, 4], 6, ignore_eos=True))
    step(sched)
    urgent = Sequence(2, [5], 1, ignore_eos=True, priority=5)
    sched.add(urgent)
    while sched.num_preemptions == 0:
        batch = step(sched)
    assert batch == [(0, 1)] and urgent.status is Status.WAITING
    while sched.has_unfinished():
        step(sched)
    assert sched.allocator.num_free == 4 and urgent.status is Status.FINISHED


def predict():
    """Worked by hand (block_size 2, blocks 0..4). Step 1 prefills all four: tables [0, 1], [2], [3],
    [4]; free none. Step 2: request 0 decodes position 3 (its 2 blocks suffice); request 1 decodes
    position 2, needs a block, finds none: the last running, request 3, is preempted (block 4 back)
    and request 1 takes it; request 2 decodes position 1 and, with its 2nd token, finishes (block 3
    back). No admission: the step preempted. Step 3: request 0 takes block 3 for position 4; request
    1 fits in [2, 4]; request 3 (3 tokens, 2 blocks) does not fit the empty free list. Step 4: request
    0 fits in [0, 1, 3]; request 1 needs a block for position 4, none is free, and it is the last
    running: it preempts itself (blocks 2, 4 back); no admission."""
    return {
        "block_tables": [[0, 1, 3], [], [], []],
        "num_computed_tokens": [6, 0, 2, 0],
        "free_list": [2, 4],
        "running": [0],
        "waiting": [1, 3],
        "finished": [2],
        "num_preemptions": 2,
    }


ANSWERS = {
    "L3.1": slots,
    "L3.2": plan_step,
    "L3.3": preempt,
    "L3.4": admitted,
    "L3.5": buddy_waits,
    "L3.6": admit_with_watermark,
    "L3.7": cheapest_preemption,
    "L3.8": test_scheduler,
    "L3.9": predict,
}
EXPECT = {ex: (lambda case, ex=ex: HIDDEN[ex].observe(ANSWERS[ex], case)) for ex in ANSWERS}


def scheduler_watermark_answer(running, waiting, num_free, block_size, watermark):
    """``checks.scheduler_watermark`` (the stage's ``Scheduler``) as ``admit_with_watermark``."""
    got = scheduler_watermark(running, waiting, num_free, block_size, watermark)
    if "raised" in got:
        raise ValueError(f"the stage's Scheduler: {got['raised']}")
    return tuple(got["returned"])


def oracle_test(Subject):
    """A test that runs the stage's own ``Scheduler`` beside the one handed in and compares every step
    (block tables, computed tokens, statuses, free list, preemptions): what the watch flags in a
    learner's test. Three scenarios: a seat limit and finishing, a preemption by priority, a newcomer
    in a step that preempts."""

    def run(cls, num_blocks, max_num_seqs, requests, late=None):
        sched = cls(
            BlockAllocator(num_blocks, 2), EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64)
        )
        seqs = [
            Sequence(i, [1 + i] * n, m, ignore_eos=True, priority=p) for i, (n, m, p) in enumerate(requests)
        ]
        for seq in seqs:
            sched.add(seq)
        seen = []
        for step in range(12):
            if late and step == 1:
                seqs.append(Sequence(len(seqs), [9] * late[0], late[1], ignore_eos=True, priority=late[2]))
                sched.add(seqs[-1])
            batch = sched.schedule()
            ends = [seq for seq, n in batch if seq.num_computed_tokens + n == seq.num_tokens]
            sched.update(batch, [7] * len(ends))
            seen.append(
                (
                    [(seq.request_id, n) for seq, n in batch],
                    [(list(s.block_table), s.num_computed_tokens, s.status.value) for s in seqs],
                    list(sched.allocator.free_blocks),
                    sched.num_preemptions,
                )
            )
        return seen

    for scenario in (
        (8, 2, [(2, 2, 0)] * 3),
        (4, 4, [(2, 6, -1), (2, 6, 1)]),
        (4, 2, [(2, 6, 0), (2, 6, 0)], (1, 1, 5)),
    ):
        assert run(Subject, *scenario) == run(Scheduler, *scenario), scenario


STAGE_ADAPTERS = {
    "L3.2": scheduler_plan,
    "L3.3": scheduler_preempt,
    "L3.4": scheduler_admitted,
    "L3.5": scheduler_buddy_waits,
    "L3.6": scheduler_watermark_answer,
    "L3.8": oracle_test,
    "L3.9": run_predicted_steps,
}
