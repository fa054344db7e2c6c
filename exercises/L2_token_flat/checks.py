"""The L2 notebook's exercise checkers: the learner's bookkeeping against this stage's own code.

- ``check_alloc_blocks`` and ``check_free``: the free list's two methods, each put into
  ``BlockAllocator`` (``allocator.py``) in place of its own and run side by side with it on fixed
  sequences of calls;
- ``check_allocate_slots``: growing a sequence's blocks, against ``allocate_slots`` on a ``Sequence``
  (``sequence.py``);
- beyond the stage, ``check_pick_adjacent`` (L2.4, an allocation policy that keeps a request's blocks
  adjacent; its expected picks are stored as data) and ``check_compaction_moves`` (L2.5, a compaction
  plan, run on a simulated pool and held to the fewest moves, stored as data);
- ``check_test_allocator`` (L2.6, catch the bug): the learner's test against ``BlockAllocator`` and two
  of its bugs from the course's mutation list (``kvcourse/grading/mutations.py``);
- ``check_predict`` (L2.7): the learner's prediction against what the operations leave when run on
  this stage's code, key by key, without printing the real values.

The grading contract (see ``kvcourse/grading/cases.py``): each checker runs fixed cases and prints one
deterministic line per case (``ok``, ``WRONG — what differs``, or ``raised`` and the exception), then
``k/n passed``. The reference notebook stores those lines as the check cell's output and ``make grade``
compares them. The references are the stage's own code, never a copy kept here. When a wrong
answer gives what a known mistake gives (the free list's wrong end, a double free accepted, one block
too few), its line says which rule it breaks.

Left out on purpose: partial credit and hints; a case stops at the first call that differs.
"""

from __future__ import annotations

from collections.abc import Callable

from kvcourse.grading.cases import Case, describe, first_line, named_mistake, outcome, run_cases
from kvcourse.grading.hidden import Hidden, unrevealed
from kvcourse.grading.mutations import catch_cases, catch_hidden
from L2_token_flat.allocator import BlockAllocator, OutOfBlocksError
from L2_token_flat.sequence import Sequence
from L2_token_flat.sequence import allocate_slots as ref_allocate_slots


def run_free_list_cases(allocator_cls: Callable, cases: list[tuple[str, int, list]]) -> None:
    """Run ``allocator_cls`` and ``BlockAllocator`` side by side on each (name, num_blocks, calls).

    After every call the return value (or the exception type: ``OutOfBlocksError``, ``ValueError``)
    and the free list must match the reference's.
    """

    def case(num_blocks: int, ops: list[tuple[str, object]]) -> Callable[[], str | None]:
        def run() -> str | None:
            ref, got = BlockAllocator(num_blocks, 4), allocator_cls(num_blocks, 4)
            for op, arg in ops:
                call = f"{op}({arg!r})" if op == "free" else f"alloc_blocks({arg})"
                before, owned = list(ref.free_blocks), set(ref.owned)  # both allocators agree so far
                want = outcome(getattr(ref, op), list(arg) if op == "free" else arg)
                have = outcome(getattr(got, op), list(arg) if op == "free" else arg)
                problem = None
                if want[0] == "raised":
                    expected = OutOfBlocksError if isinstance(want[1], OutOfBlocksError) else ValueError
                    if have[0] != "raised" or not isinstance(have[1], expected):
                        problem = f"{call}: expected {expected.__name__}, {describe(have)}"
                elif have[0] == "raised":
                    problem = f"{call}: expected {want[1]!r}, raised {type(have[1]).__name__}: {have[1]}"
                elif op == "alloc_blocks" and (not isinstance(have[1], list) or have[1] != want[1]):
                    problem = f"{call}: expected {want[1]!r}, {describe(have)}"
                if problem is None and list(got.free_blocks) != list(ref.free_blocks):
                    problem = (
                        f"after {call}: free list {list(got.free_blocks)}, expected {list(ref.free_blocks)}"
                    )
                if problem:
                    return problem + free_list_rule(
                        op, arg, before, owned, num_blocks, have, list(got.free_blocks)
                    )
            return None

        return run

    run_cases([Case(name, case(num_blocks, ops)) for name, num_blocks, ops in cases])


def free_list_rule(op: str, arg, before: list[int], owned: set[int], num_blocks: int, have, after) -> str:
    """The rule a wrong call broke, when its result is what a known mistake gives (``" (...)"``), else "".

    ``before`` and ``owned`` are the books before the call (both allocators agreed on them), ``have`` the
    call's ``outcome`` and ``after`` the free list it left. Example: ``alloc_blocks(2)`` on free list
    [0, 1, 2] returning [2, 1] -> ``" (blocks taken from the back of the free list: the front is handed
    out next)"``.
    """
    returned = have[1] if have[0] == "ok" else None
    raised = have[0] == "raised"
    if op == "alloc_blocks":
        if arg <= len(before):
            if arg >= 1 and returned == before[::-1][:arg]:
                rule = "blocks taken from the back of the free list: the front is handed out next"
            elif arg > 1 and returned == before[:arg][::-1]:
                rule = "blocks taken from the front, but in the wrong order"
            else:
                rule = None
        elif after != before:
            rule = "a failed allocation took blocks: all or nothing, OutOfBlocksError takes none"
        else:
            rule = None
        return f" ({rule})" if rule else ""
    blocks = list(arg)
    if not raised:
        if any(b not in range(num_blocks) for b in blocks):
            rule = "an id outside the pool was accepted"
        elif len(set(blocks)) != len(blocks):
            rule = "an id repeated in one call was accepted: it would be on the free list twice"
        elif not set(blocks) <= owned:
            rule = "a double free was accepted: a block that is already free was freed again"
        elif after == blocks[::-1] + before or after == blocks + before:
            rule = "freed blocks went to the front of the free list: they go to the back"
        elif sorted(after) == sorted(before + blocks):
            rule = "the freed blocks are in the wrong order: they go to the back, in the order given"
        else:
            rule = None
    elif after != before:
        rule = "free changed the free list before it found the bad id: check every id first"
    else:
        rule = None
    return f" ({rule})" if rule else ""


def check_alloc_blocks(alloc_blocks: Callable) -> None:
    """Grade ``alloc_blocks(self, n)``: ``BlockAllocator`` with this method in place of its own.

    Example: 4 blocks; alloc_blocks(3) -> [0, 1, 2], free list [3]; alloc_blocks(2) then raises
    OutOfBlocksError and the free list is still [3].
    """
    yours = type("YourAllocBlocks", (BlockAllocator,), {"alloc_blocks": alloc_blocks})
    run_free_list_cases(
        yours,
        [
            ("alloc 3 of 4 blocks", 4, [("alloc_blocks", 3)]),
            ("alloc 0 blocks", 4, [("alloc_blocks", 0), ("alloc_blocks", 1)]),
            ("all 4 blocks, in id order", 4, [("alloc_blocks", 4)]),
            (
                "OutOfBlocksError takes nothing",
                4,
                [("alloc_blocks", 2), ("alloc_blocks", 3), ("alloc_blocks", 2)],
            ),
            ("a freed block comes back last", 4, [("alloc_blocks", 3), ("free", [1]), ("alloc_blocks", 2)]),
        ],
    )


def check_free(free: Callable) -> None:
    """Grade ``free(self, blocks)``: ``BlockAllocator`` with this method in place of its own.

    Example: 4 blocks; alloc_blocks(3); free([1]) -> free list [3, 1]; free([1]) again raises
    ValueError (a double free) and changes nothing.
    """
    yours = type("YourFree", (BlockAllocator,), {"free": free})
    run_free_list_cases(
        yours,
        [
            ("a freed block goes to the back", 4, [("alloc_blocks", 3), ("free", [1]), ("alloc_blocks", 2)]),
            ("double free is refused", 4, [("alloc_blocks", 2), ("free", [0]), ("free", [0])]),
            (
                "a repeated id in one call frees nothing",
                4,
                [("alloc_blocks", 3), ("free", [2, 1, 2]), ("free", [2])],
            ),
            ("an id outside the pool is refused", 4, [("alloc_blocks", 4), ("free", [1, 7])]),
            (
                "interleaved allocs and frees, 6 blocks",
                6,
                [
                    ("alloc_blocks", 2),
                    ("alloc_blocks", 3),
                    ("free", [3, 0]),
                    ("alloc_blocks", 3),
                    ("free", [1, 4]),
                    ("alloc_blocks", 2),
                ],
            ),
        ],
    )


def allocate_slots_rule(seq, ref_seq, block_size: int, target: int) -> str:
    """The rule a wrong ``allocate_slots`` broke, as ``" (...)"``, when its tables show a known mistake; else "".

    Example: block_size 4, target_len 6, block table [0] where [0, 2] was expected -> ``" (one block
    too few: target_len positions need ceil(target_len / block_size) blocks)"``.
    """
    have, want = len(seq.block_table), len(ref_seq.block_table)
    if have == want - 1:
        rule = "one block too few: target_len positions need ceil(target_len / block_size) blocks"
    elif have == want + 1:
        rule = "one block too many: a block is needed only when a position falls past the last one"
    elif have > want:
        rule = "blocks added for positions already covered: allocate only the missing blocks"
    elif seq.block_table == ref_seq.block_table and seq.slot_indices == [
        b + row for b in seq.block_table for row in range(block_size)
    ]:
        rule = (
            "block ids used as slots: block b holds slots b * block_size .. b * block_size + block_size - 1"
        )
    elif seq.block_table == ref_seq.block_table:
        rule = "the slots do not follow the block table: one entry per slot of every block, in table order"
    else:
        rule = None
    return f" ({rule})" if rule else ""


def check_allocate_slots(allocate_slots: Callable) -> None:
    """Grade ``allocate_slots(seq, allocator, target_len)`` against this stage's ``allocate_slots``.

    Both get a ``Sequence`` and a ``BlockAllocator`` in the same state (another sequence has taken and
    returned blocks, so free ids are not in order); after each call ``seq.block_table``,
    ``seq.slot_indices`` and the free list must match, and a call that needs more blocks than are free
    must raise ``OutOfBlocksError`` leaving sequence and free list as they were. Example with
    block_size 4, block table [0] and free list 2, 3: target_len 6 -> block table [0, 2],
    slot_indices [0, 1, 2, 3, 8, 9, 10, 11].
    """

    def case(block_size: int, num_blocks: int, taken: int, returned: list[int], targets: list[int]):
        def state():
            allocator = BlockAllocator(num_blocks, block_size)
            allocator.alloc_blocks(taken)  # another sequence's blocks ...
            allocator.free(returned)  # ... some given back: the free list is no longer in id order
            return Sequence(prompt_ids=[1]), allocator

        def run() -> str | None:
            (ref_seq, ref_alloc), (seq, allocator) = state(), state()
            for target in targets:
                want = outcome(ref_allocate_slots, ref_seq, ref_alloc, target)
                have = outcome(allocate_slots, seq, allocator, target)
                call = f"allocate_slots(target_len={target})"
                if want[0] == "raised":
                    if have[0] != "raised" or not isinstance(have[1], OutOfBlocksError):
                        return f"{call}: expected OutOfBlocksError, {describe(have)}"
                    if list(allocator.free_blocks) != list(ref_alloc.free_blocks):
                        return (
                            f"after {call}: free list {list(allocator.free_blocks)}, expected "
                            f"{list(ref_alloc.free_blocks)} (blocks were taken before OutOfBlocksError: "
                            "ask for all the missing blocks in one alloc_blocks call)"
                        )
                elif have[0] == "raised":
                    return f"{call}: raised {type(have[1]).__name__}: {first_line(str(have[1]))}"
                for what in ("block_table", "slot_indices"):
                    if getattr(seq, what) != getattr(ref_seq, what):
                        problem = (
                            f"after {call}: {what} {getattr(seq, what)}, expected {getattr(ref_seq, what)}"
                        )
                        return problem + allocate_slots_rule(seq, ref_seq, allocator.block_size, target)
                if list(allocator.free_blocks) != list(ref_alloc.free_blocks):
                    return (
                        f"after {call}: free list {list(allocator.free_blocks)}, "
                        f"expected {list(ref_alloc.free_blocks)}"
                    )
            return None

        return run

    run_cases(
        [
            Case("block_size 4: 4 then 6 positions", case(4, 8, 2, [0], [4, 6])),
            Case(
                "block_size 4: target 0 allocates nothing, then target 1 one block", case(4, 8, 0, [], [0, 1])
            ),
            Case("block_size 1: a block per position", case(1, 8, 5, [3, 1], [2, 3, 5])),
            Case("block_size 7: 15, 21, 22 positions", case(7, 6, 3, [2, 0], [15, 21, 22])),
            Case("block_size 4: a prompt of 9 in one call", case(4, 8, 4, [1, 3], [9, 10])),
            Case("OutOfBlocksError leaves sequence and free list alone", case(4, 4, 2, [], [4, 13, 8])),
        ]
    )


# Hidden cases (kvcourse/grading/hidden.py): drawn per grading run, observed here in the learner's kernel,
# judged in the grader's process against the independent answers of key/L2_token_flat/answers.py.


def draw_free_list_ops(rng) -> list[dict]:
    """Random runs of calls on a small pool: allocations that fit, that do not, and zero-sized ones;
    frees of held blocks, and now and then of a free block (a double free), a repeated id or an id
    outside the pool. The draw keeps its own rough idea of which blocks are held, only to aim frees."""
    cases = []
    for _ in range(8):
        num_blocks, ops = rng.randint(1, 10), []
        free, held = list(range(num_blocks)), []
        for _ in range(rng.randint(3, 9)):
            if not held or rng.random() < 0.45:
                n = rng.choice([0, 1, 1, 2, 3, len(free), len(free) + 1])
                ops.append(["alloc_blocks", n])
                if n <= len(free):
                    held, free = held + free[:n], free[n:]
                continue
            pick = rng.sample(held, rng.randint(1, len(held)))
            if rng.random() < 0.3:
                pick.append(rng.choice([pick[0], num_blocks, -1, *free]))  # repeated, outside, or free
            else:
                held, free = [b for b in held if b not in pick], free + pick
            ops.append(["free", pick])
        cases.append({"num_blocks": num_blocks, "ops": ops})
    return cases


def observe_free_list(method: str):
    """Run a case's calls on ``BlockAllocator`` with ``fn`` as its ``method``; after each call record
    what it returned (or which error it raised) and the free list."""

    def observe(fn, case) -> list[dict]:
        allocator = type("Yours", (BlockAllocator,), {method: fn})(case["num_blocks"], 4)
        steps = []
        for op, arg in case["ops"]:
            call = f"{op}({arg!r})"
            try:
                returned = getattr(allocator, op)(list(arg) if op == "free" else arg)
                step = {"call": call, "returned": returned if op == "alloc_blocks" else None}
            except (OutOfBlocksError, ValueError) as e:
                step = {
                    "call": call,
                    "raised": "OutOfBlocksError" if isinstance(e, OutOfBlocksError) else "ValueError",
                }
            steps.append({**step, "free": list(allocator.free_blocks)})
        return steps

    return observe


def describe_free_list_ops(case: dict) -> str:
    calls = ", ".join(f"{op}({arg!r})" for op, arg in case["ops"])
    return f"{case['num_blocks']} blocks: {calls}"


def draw_allocate_slots(rng) -> list[dict]:
    """Random pools whose free list is out of id order, and growing targets, some past the pool."""
    cases = []
    for _ in range(8):
        block_size, num_blocks = rng.choice([1, 2, 3, 4, 7, 16]), rng.randint(2, 9)
        taken = rng.randint(0, num_blocks - 1)
        returned = rng.sample(range(taken), rng.randint(0, taken))
        targets, t = [], 0
        for _ in range(rng.randint(2, 4)):
            t += rng.randint(0, 2 * block_size + 1)
            targets.append(t)
        cases.append(
            {
                "block_size": block_size,
                "num_blocks": num_blocks,
                "taken": taken,
                "returned": returned,
                "targets": targets,
            }
        )
    return cases


def observe_allocate_slots(fn, case) -> list[dict]:
    allocator = BlockAllocator(case["num_blocks"], case["block_size"])
    allocator.alloc_blocks(case["taken"])  # another sequence's blocks ...
    allocator.free(case["returned"])  # ... some given back: the free list is out of id order
    seq, steps = Sequence(prompt_ids=[1]), []
    for target in case["targets"]:
        call = f"allocate_slots(target_len={target})"
        try:
            fn(seq, allocator, target)
            step = {"call": call, "raised": None}
        except OutOfBlocksError:
            step = {"call": call, "raised": "OutOfBlocksError"}
        steps.append(
            {**step, "block_table": list(seq.block_table), "slot_indices": list(seq.slot_indices),
             "free": list(allocator.free_blocks)}
        )  # fmt: skip
    return steps


def describe_allocate_slots(case: dict) -> str:
    return (
        f"block_size {case['block_size']}, {case['num_blocks']} blocks, {case['taken']} taken and "
        f"{case['returned']} given back, targets {case['targets']}"
    )


HIDDEN = {
    "L2.1": Hidden(
        draw_free_list_ops,
        observe_free_list("alloc_blocks"),
        describe_free_list_ops,
        answers=("L2_token_flat.allocator:BlockAllocator.alloc_blocks",),
    ),
    "L2.2": Hidden(
        draw_free_list_ops,
        observe_free_list("free"),
        describe_free_list_ops,
        answers=("L2_token_flat.allocator:BlockAllocator.free",),
    ),
    "L2.3": Hidden(
        draw_allocate_slots,
        observe_allocate_slots,
        describe_allocate_slots,
        answers=("L2_token_flat.sequence:allocate_slots",),
    ),
}


# ---------------------------------------------------------------------------------------------------
# Beyond the stage (L2.4, L2.5), catch the bug (L2.6) and predict (L2.7).


def run_problem(got) -> str | None:
    """None when ``got`` is a list of ints, else what it is."""
    if not isinstance(got, list) or not all(type(b) is int for b in got):
        return f"returned {got!r}, expected a list of ints"
    return None


# L2.4's expected picks were computed once with key/L2_token_flat/answers.py's pick_adjacent and are stored here as data
# (its policy is what the exercise asks for, so a second implementation here would be an answer key;
# tests/test_exercises_l2_beyond.py checks these values against key/L2_token_flat/answers.py). An exception class stands
# for a case that must raise it.
ADJACENT_CASES = [
    ("extends the table's last block", [0, 5, 1, 6, 7], [4], 2, [5, 6]),
    ("an empty table takes the first run that fits", [9, 2, 3, 6, 7, 8], [], 3, [6, 7, 8]),
    ("extends, then the first run that fits the rest", [3, 4, 10, 11, 12, 0], [1, 2], 4, [3, 4, 10, 11]),
    ("two runs fit: the first, though a later one is shorter", [10, 4, 0, 9, 2, 5, 3], [7], 2, [2, 3]),
    ("no run fits: the longest first, then again", [0, 2, 3, 5, 6, 7, 9], [], 5, [5, 6, 7, 2, 3]),
    ("equally long runs: the lowest first", [5, 1, 8, 2, 9], [], 3, [1, 2, 5]),
    ("the free list's order does not matter", [12, 3, 11, 4, 10], [0], 2, [3, 4]),
    ("n = 0 takes nothing", [1, 2], [0], 0, []),
    ("more than is free raises OutOfBlocksError", [1, 2], [0], 3, OutOfBlocksError),
    ("n < 0 raises ValueError", [1, 2], [0], -1, ValueError),
]


def check_pick_adjacent(pick_adjacent: Callable) -> None:
    """Grade ``pick_adjacent(free_blocks, table, n) -> list[int]`` on fixed cases (see the notebook):
    its picks, that it changes neither argument, OutOfBlocksError when n is more than is free and
    ValueError when n < 0."""

    def case(
        free: list[int], table: list[int], n: int, expected: list[int] | type
    ) -> Callable[[], str | None]:
        def run() -> str | None:
            free_arg, table_arg = list(free), list(table)
            have = outcome(pick_adjacent, free_arg, table_arg, n)
            if (free_arg, table_arg) != (free, table):
                return "the arguments were changed: return the picks and leave free_blocks and table alone"
            if isinstance(expected, type):  # the exception the case must raise
                if have[0] == "raised" and isinstance(have[1], expected):
                    return None
                return f"expected {expected.__name__}, {describe(have)}"
            if have[0] == "raised":
                return f"raised {type(have[1]).__name__}: {first_line(str(have[1]))}"
            problem = run_problem(have[1]) or (
                None if have[1] == expected else f"picked {have[1]}, expected {expected}"
            )
            return named_mistake(
                problem,
                have[1],
                {
                    "the free list's front, as alloc_blocks takes it: adjacency ignored": lambda: free[:n],
                    "the lowest free ids: runs and the table's last block ignored": lambda: sorted(free)[:n],
                    "the right ids, in the wrong order: they go in the order they join the table": lambda: (
                        have[1] if sorted(have[1]) == sorted(expected) else None
                    ),
                },
            )

        return run

    run_cases([Case(name, case(free, table, n, want)) for name, free, table, n, want in ADJACENT_CASES])


def draw_adjacent(rng) -> list[dict]:
    """Pools of 6 to 16 blocks, a third to nearly all of them free (shuffled), a table of held blocks
    whose last one is often followed by a free block; n from 1 to one more than is free. Among them, at
    random places: n = 0, n < 0, two runs that fit where the first is the longer, and no run that fits
    with two longest runs of equal length."""
    cases = []
    for _ in range(10):
        num_blocks = rng.randint(6, 16)
        ids = list(range(num_blocks))
        free = sorted(rng.sample(ids, rng.randint(num_blocks // 3, num_blocks - 1)))
        held = [b for b in ids if b not in free]
        table = rng.sample(held, rng.randint(0, len(held)))
        before_free = [b for b in held if b + 1 in free and b not in table]
        if table and before_free and rng.random() < 0.6:
            table[-1] = rng.choice(before_free)  # the table can be extended
        rng.shuffle(free)
        n = rng.choice([1, 2, rng.randint(1, len(free)), rng.randint(1, len(free)), len(free), len(free) + 1])
        cases.append({"free": free, "table": table, "n": n})
    zero, negative = rng.sample(range(len(cases)), 2)
    cases[zero]["n"], cases[negative]["n"] = 0, -rng.randint(1, 3)
    need = rng.randint(2, 4)  # two runs fit; the first is longer, a single block fits nothing
    cases.insert(rng.randint(0, len(cases)), runs_case(rng, [1, need + rng.randint(1, 3), need], need))
    longest = rng.randint(2, 4)  # nothing fits; two longest runs and a shorter one, in any order
    lengths = rng.sample([longest, longest, rng.randint(1, longest - 1)], 3)
    cases.insert(rng.randint(0, len(cases)), runs_case(rng, lengths, longest + 1))
    return cases


def runs_case(rng, lengths: list[int], n: int) -> dict:
    """A case whose free ids form runs of ``lengths`` in id order, one or two ids apart, shuffled; the
    table is empty or ends in a block that cannot be extended. ``runs_case(rng, [2, 1], 3)`` may give
    free [3, 0, 1], table [6], n 3."""
    free, at = [], rng.randint(0, 3)
    for length in lengths:
        free += range(at, at + length)
        at += length + rng.randint(1, 2)
    rng.shuffle(free)
    return {"free": free, "table": rng.choice([[], [at + 1]]), "n": n}


def observe_adjacent(fn, case) -> dict:
    free, table = list(case["free"]), list(case["table"])
    try:
        got = {"returned": fn(free, table, case["n"])}
    except OutOfBlocksError:
        got = {"raised": "OutOfBlocksError"}
    except ValueError:
        got = {"raised": "ValueError"}
    return {**got, "arguments unchanged": (free, table) == (case["free"], case["table"])}


def describe_adjacent(case: dict) -> str:
    return f"pick_adjacent(free_blocks={case['free']}, table={case['table']}, n={case['n']})"


def apply_moves(tables: list[list[int]], num_blocks: int, moves) -> str | None:
    """Run ``moves`` (pairs (src, dst): copy block src's contents into block dst) on a pool whose blocks
    hold the tables' contents; None when every table ends up packed in order from block 0 (table 0
    first), else what went wrong. The simulation is the reference of L2.5: it checks a plan, it does
    not make one."""
    if not isinstance(moves, list | tuple):
        return f"returned {type(moves).__name__}, expected a list of (src, dst) pairs"
    pool = [None] * num_blocks  # what each block holds: (table, entry) or None
    for i, table in enumerate(tables):
        for j, b in enumerate(table):
            pool[b] = (i, j)
    for k, move in enumerate(moves):
        if not (isinstance(move, list | tuple) and len(move) == 2 and all(type(x) is int for x in move)):
            return f"move {k} is {move!r}, not a pair of block ids"
        src, dst = move
        if not (0 <= src < num_blocks and 0 <= dst < num_blocks):
            return f"move {k} {tuple(move)} names a block outside the pool of {num_blocks}"
        pool[dst] = pool[src]
    want = [(i, j) for i, table in enumerate(tables) for j in range(len(table))]
    for target, entry in enumerate(want):
        if pool[target] != entry:
            if entry not in pool:
                i, j = entry
                return (
                    f"the contents of table {i}'s entry {j} (block {tables[i][j]}) were overwritten "
                    "before they were copied"
                )
            return f"block {target} holds {describe_entry(pool[target])}, expected table {entry[0]}'s entry {entry[1]}"
    return None


def describe_entry(entry) -> str:
    return "nothing" if entry is None else f"table {entry[0]}'s entry {entry[1]}"


# L2.5's fewest moves per case were computed once with key/L2_token_flat/answers.py's compaction_moves and are stored
# here as data (None: no plan exists, ValueError); the plans themselves are checked by apply_moves.
COMPACTION_CASES = [
    ("already packed: nothing moves", [[0, 1], [2]], 4, 0),
    ("one table, two blocks out of place", [[3, 1, 5]], 6, 2),
    ("a chain: each move frees the next destination", [[1, 2, 3]], 4, 3),
    ("two tables swap places: a cycle needs a spare block", [[2, 3], [0, 1]], 5, 6),
    ("a block already in place stays", [[0, 4], [2, 5]], 6, 2),
    ("a chain backwards: 0 -> 1 before 5 -> 0", [[5], [0]], 6, 2),
    ("a full pool with nothing to move: no spare needed, no error", [[0], [1]], 2, 0),
    ("a full pool with a cycle: no plan, ValueError", [[1], [0]], 2, None),
]


def check_compaction_moves(compaction_moves: Callable) -> None:
    """Grade ``compaction_moves(tables, num_blocks) -> list[(src, dst)]``: running the moves on a
    simulated pool must pack every table, and use the fewest moves; a pool without a spare block for a
    cycle raises ValueError."""

    def case(tables, num_blocks: int, fewest: int | None) -> Callable[[], str | None]:
        def run() -> str | None:
            have = outcome(compaction_moves, [list(t) for t in tables], num_blocks)
            if fewest is None:
                if have[0] == "raised" and isinstance(have[1], ValueError):
                    return None
                return f"expected ValueError (no block is free to break the cycle), {describe(have)}"
            if have[0] == "raised":
                problem = f"raised {type(have[1]).__name__}: {first_line(str(have[1]))}"
                if isinstance(have[1], ValueError):
                    problem += " (a plan exists: only a cycle of moves with no spare block has none)"
                return problem
            problem = apply_moves(tables, num_blocks, have[1])
            if problem:
                return problem
            if len(have[1]) != fewest:
                moved = any(src in placed_blocks(tables) for src, _ in have[1])
                hint = " (a block already in place was copied away: it can stay)" if moved else ""
                return f"{len(have[1])} moves, {fewest} are enough{hint}"
            return None

        return run

    run_cases([Case(name, case(tables, n, fewest)) for name, tables, n, fewest in COMPACTION_CASES])


def offsets(tables) -> list[int]:
    """Where each table starts once packed: ``[[5, 6], [1]] -> [0, 2]``."""
    out, at = [], 0
    for t in tables:
        out.append(at)
        at += len(t)
    return out


def placed_blocks(tables) -> set[int]:
    """The blocks already where packing puts them: ``[[0, 4], [2, 5]] -> {0, 2}``."""
    return {b for o, t in zip(offsets(tables), tables, strict=True) for j, b in enumerate(t) if b == o + j}


def draw_compaction(rng) -> list[dict]:
    """Pools of 2 to 10 blocks holding 1 to 3 tables: some packed already (one of them a full pool),
    some full (a cycle may leave no spare block), tables shuffled across the pool, and one chain that
    runs backwards (a table at the pool's front whose blocks move up, to make room for the one before)."""
    cases = []
    for c in range(8):
        num_blocks = rng.randint(2, 10)
        used = num_blocks if c < 3 else rng.randint(1, num_blocks)
        ids = rng.sample(range(num_blocks), used) if c not in (2, 3) else list(range(used))
        cuts = sorted(rng.sample(range(1, used), min(rng.randint(0, 2), used - 1))) if used > 1 else []
        tables = [ids[a:b] for a, b in zip([0, *cuts], [*cuts, used], strict=True)]
        cases.append({"tables": tables, "num_blocks": num_blocks})
    m = rng.randint(1, 3)  # the front table's m blocks move up by m; the other table's fill the front
    num_blocks = rng.randint(3 * m, 3 * m + 3)
    cases.append(
        {"tables": [rng.sample(range(2 * m, num_blocks), m), list(range(m))], "num_blocks": num_blocks}
    )
    rng.shuffle(cases)
    return cases


def observe_compaction(fn, case) -> dict:
    tables = [list(t) for t in case["tables"]]
    try:
        moves = fn(tables, case["num_blocks"])
    except ValueError:
        return {"raised": "ValueError"}
    problem = apply_moves(case["tables"], case["num_blocks"], moves)
    return {"packed": problem is None, "moves": len(moves) if problem is None else None}


def describe_compaction(case: dict) -> str:
    return f"compaction_moves(tables={case['tables']}, num_blocks={case['num_blocks']})"


ALLOCATOR = "L2_token_flat.allocator:BlockAllocator"
# L2.6: the allocator bugs of kvcourse/grading/mutations.py; the check cell shows two, the hidden
# cases run them all.
ALLOCATOR_BUGS = [
    "L2 allocator hands out the blocks it has, then raises",
    "L2 allocator hands out blocks from the back of the free list",
    "L2 allocator forgets which blocks it handed out",
    "L2 free accepts a double free",
    "L2 free gives blocks back before it has checked them all",
    "L2 free puts blocks at the front of the free list",
]
SHOWN_BUGS = ["L2 free accepts a double free", "L2 allocator hands out blocks from the back of the free list"]


def check_test_allocator(test_allocator: Callable) -> None:
    """Grade the learner's ``test_allocator(BlockAllocator)``: it must pass this stage's allocator and
    fail each of two buggy ones (the hidden cases try every bug of the list)."""
    run_cases(catch_cases(test_allocator, ALLOCATOR, SHOWN_BUGS, "the allocator"))


def prediction_state() -> dict:
    """Run L2.7's operations (the notebook shows them) on this stage's allocator and ``allocate_slots``."""
    allocator = BlockAllocator(6, block_size=4)
    a, b, c = Sequence([1]), Sequence([1]), Sequence([1])
    ref_allocate_slots(a, allocator, 5)
    ref_allocate_slots(b, allocator, 4)
    ref_allocate_slots(a, allocator, 8)
    ref_allocate_slots(a, allocator, 9)
    allocator.free(b.block_table)
    ref_allocate_slots(c, allocator, 10)
    try:
        ref_allocate_slots(a, allocator, 13)
        raised = None
    except OutOfBlocksError as e:
        raised = type(e).__name__
    a_table = list(a.block_table)
    allocator.free(a.block_table)
    return {
        "a block_table": a_table,
        "c block_table": list(c.block_table),
        "slot of c's position 5": c.slot_indices[5],
        "exception of allocate_slots(a, 13)": raised,
        "free list": list(allocator.free_blocks),
    }


def check_predict(predict: Callable) -> None:
    """Grade ``predict() -> dict`` against what L2.7's operations really leave, key by key, without
    printing the real values (the demo cell below the check shows them)."""
    real = prediction_state()

    def key_case(key: str) -> Callable[[], str | None]:
        def run() -> str | None:
            got = predict()
            if not isinstance(got, dict) or key not in got:
                return f"predict() has no key {key!r}"
            return differs(got[key], real[key])

        return run

    run_cases([Case(key, key_case(key)) for key in real])


def differs(got, want) -> str | None:
    """None when equal, else how ``got`` differs from ``want`` without showing ``want``.

    Examples: ``differs([1, 2], [1, 3]) -> '1 of 2 entries differ'``; ``differs([1], [1, 3])`` ->
    ``'1 entry, not the right number'``; ``differs(5, 6) -> 'not the value the operations give'``;
    ``differs(KeyError, "KeyError")`` -> ``'the class KeyError, expected the name of an exception as a
    str, or None'``. A wrong type is named only where the notebook fixes the type (a list, an int), so
    that a str or None never tells whether an exception was raised.
    """
    if got == want and type(got) is type(want):
        return None
    if isinstance(want, list):
        if not isinstance(got, list):
            return f"a {type(got).__name__}, expected a list"
        if len(got) != len(want):
            return f"{len(got)} {'entry' if len(got) == 1 else 'entries'}, not the right number"
        return f"{sum(g != w for g, w in zip(got, want, strict=True))} of {len(want)} entries differ"
    if type(want) is int and type(got) is not int:
        return f"a {type(got).__name__}, expected an int"
    if isinstance(want, str | None) and not isinstance(got, str | None):
        what = f"the class {got.__name__}" if isinstance(got, type) else f"a {type(got).__name__}"
        return f"{what}, expected the name of an exception as a str, or None"
    return "not the value the operations give"


def observe_predict(fn, case) -> object:
    return fn()


HIDDEN["L2.4"] = Hidden(draw_adjacent, observe_adjacent, describe_adjacent)
HIDDEN["L2.5"] = Hidden(draw_compaction, observe_compaction, describe_compaction)
HIDDEN["L2.6"] = catch_hidden(
    ALLOCATOR,
    ALLOCATOR_BUGS,
    ("L2_token_flat.allocator:BlockAllocator.alloc_blocks", "L2_token_flat.allocator:BlockAllocator.free"),
)
HIDDEN["L2.7"] = Hidden(
    lambda rng: [{}],
    observe_predict,
    lambda case: "predict()",
    answers=(
        "L2_token_flat.allocator:BlockAllocator.alloc_blocks",
        "L2_token_flat.allocator:BlockAllocator.free",
        "L2_token_flat.sequence:allocate_slots",
    ),
    explain=unrevealed,  # the report says which keys are wrong, never their right values
)
