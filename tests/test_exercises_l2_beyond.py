"""L2's new exercises (issue 37): L2.4 and L2.5 beyond the stage (an allocation policy that keeps a
request's blocks adjacent, a compaction plan), L2.6 catch the bug (a test for the allocator, graded by the
bugs of ``kvcourse/grading/mutations.py`` it catches), L2.7 predict (the free list after a few requests),
and the rules L2's warm-up checkers name.

For each: the independent answer (``answers.py``) and the reference notebook's solution pass the visible
checker and the hidden cases of three seeds; the untouched stub fails; plausible wrong answers fail both,
with the broken rule named in the visible line; the hidden cases differ from seed to seed (L2.7 has one
fixed case by design). The data the visible checkers keep (L2.4's picks, L2.5's fewest moves) equals
what the answer gives. No model is loaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from checker_asserts import assert_fails, assert_passes, graded_lines, hidden_problems

from exercises.L2_token_flat import checks
from key.L2_token_flat import answers
from kvcourse.grading import exercises, hidden, mutations
from L2_token_flat.allocator import BlockAllocator, OutOfBlocksError

NOTEBOOK = Path(__file__).resolve().parent.parent / "key" / "notebooks" / "L2_token_flat.ipynb"
SEEDS = (0, 1, 2)


def solution(name: str):
    """The function ``name`` as the reference notebook's solution cell defines it."""
    nb = exercises.read(NOTEBOOK)
    (source,) = [
        c.source
        for c in nb.cells
        if c.cell_type == "code" and f"def {name}(" in c.source and "# BEGIN SOLUTION" in c.source
    ]
    namespace: dict = {"OutOfBlocksError": OutOfBlocksError, "BlockAllocator": BlockAllocator}
    exec(compile(source, f"{NOTEBOOK.name}:{name}", "exec"), namespace)  # noqa: S102
    return namespace[name]


def stub(*args):
    raise NotImplementedError("Exercise L2.k")


def problems(exercise: str, fn, seed: int) -> list[str]:
    return hidden_problems("L2_token_flat", exercise, fn, seed=seed)


def assert_hidden_passes(exercise: str, fn) -> None:
    for seed in SEEDS:
        assert problems(exercise, fn, seed) == [], (exercise, seed)


def assert_hidden_fails(exercise: str, fn) -> None:
    for seed in SEEDS:
        assert problems(exercise, fn, seed), (exercise, seed)


def assert_named(lines: list[str], case_name: str, rule: str) -> None:
    assert_fails(lines, case_name)
    assert any(case_name in line and rule in line for line in lines), lines


@pytest.mark.parametrize("exercise", ["L2.4", "L2.5", "L2.6"])
def test_hidden_cases_differ_between_seeds(exercise):
    draw = checks.HIDDEN[exercise].draw
    drawn = [json.dumps(draw(hidden.rng_for(seed, exercise))) for seed in SEEDS]
    assert len(set(drawn)) == len(SEEDS)


# ---- L2.4 pick_adjacent ----


def pick_front(free_blocks, table, n):
    """The stage's rule: the front of the free list."""
    if n > len(free_blocks):
        raise OutOfBlocksError(needed=n, free=len(free_blocks))
    return list(free_blocks[:n])


def pick_no_extend(free_blocks, table, n):
    """Rules 2 and 3 only: the table's last block is not extended first."""
    return answers.pick_adjacent(free_blocks, [], n)


def pick_sorted(free_blocks, table, n):
    """Right ids, returned in ascending order rather than the order they join the table."""
    return sorted(answers.pick_adjacent(free_blocks, table, n))


def pick_with(fit, longest):
    """The exercise's rules, with rule 2's run chosen by ``fit`` among the runs that fit and rule 3's by
    ``longest`` among all runs (each a list of consecutive ids, in id order)."""

    def pick(free_blocks, table, n):
        if n < 0:
            raise ValueError(f"n = {n}")
        if n > len(free_blocks):
            raise OutOfBlocksError(needed=n, free=len(free_blocks))
        left, picked = sorted(free_blocks), []
        while table + picked and len(picked) < n and (table + picked)[-1] + 1 in left:
            picked.append((table + picked)[-1] + 1)
            left.remove(picked[-1])
        while len(picked) < n:
            runs = []
            for b in left:
                if runs and runs[-1][-1] + 1 == b:
                    runs[-1].append(b)
                else:
                    runs.append([b])
            want = n - len(picked)
            fits = [r for r in runs if len(r) >= want]
            taken = (fit(fits) if fits else longest(runs))[:want]
            picked += taken
            left = [b for b in left if b not in taken]
        return picked

    return pick


def first_longest(runs):
    return max(runs, key=len)


pick_best_fit = pick_with(lambda fits: min(fits, key=len), first_longest)
pick_best_fit.__doc__ = "Rule 2 takes the shortest run that fits (best fit), not the first."
pick_highest_tie = pick_with(lambda fits: fits[0], lambda runs: max(reversed(runs), key=len))
pick_highest_tie.__doc__ = "Rule 3 breaks a tie between equally long runs by the highest ids."


def pick_no_negative_check(free_blocks, table, n):
    """Right for n >= 0; n < 0 picks nothing instead of raising ValueError."""
    return [] if n < 0 else answers.pick_adjacent(free_blocks, table, n)


def pick_popping(free_blocks, table, n):
    """Right picks, but it removes them from the caller's list."""
    picked = answers.pick_adjacent(free_blocks, table, n)
    for b in picked:
        free_blocks.remove(b)
    return picked


@pytest.mark.parametrize("fn", [answers.pick_adjacent, "notebook"])
def test_adjacent_right_answers_pass(capsys, fn):
    fn = solution("pick_adjacent") if fn == "notebook" else fn
    checks.check_pick_adjacent(fn)
    assert_passes(graded_lines(capsys))
    assert_hidden_passes("L2.4", fn)


@pytest.mark.parametrize(
    ("wrong", "case_name", "rule"),
    [
        (pick_front, "extends the table's last block", "the free list's front, as alloc_blocks takes it"),
        (pick_no_extend, "extends the table's last block", "picked [0, 1], expected [5, 6]"),
        (pick_popping, "extends the table's last block", "the arguments were changed"),
        (pick_sorted, "no run fits", "the right ids, in the wrong order"),
        (pick_best_fit, "two runs fit: the first", "picked [9, 10], expected [2, 3]"),
        (pick_highest_tie, "equally long runs: the lowest first", "picked [8, 9, 1], expected [1, 2, 5]"),
        (pick_no_negative_check, "n < 0 raises ValueError", "expected ValueError, returned []"),
        (stub, "extends the table's last block", "NotImplementedError"),
    ],
)
def test_adjacent_wrong_answers_fail_with_their_rule(capsys, wrong, case_name, rule):
    checks.check_pick_adjacent(wrong)
    assert_named(graded_lines(capsys), case_name, rule)
    assert_hidden_fails("L2.4", wrong)


def test_adjacent_stored_picks_are_the_answers():
    for _, free, table, n, want in checks.ADJACENT_CASES:
        if isinstance(want, type):
            with pytest.raises(want):
                answers.pick_adjacent(free, table, n)
        else:
            assert answers.pick_adjacent(free, table, n) == want


def test_adjacent_a_wrong_tie_break_is_not_called_the_free_list_front(capsys):
    """Issue 37 (a learner's trial): case 5's free list once began [8, 9, 1], which is also what taking
    the highest of two equally long runs gives, and the line blamed the free list's front."""
    checks.check_pick_adjacent(pick_highest_tie)
    lines = graded_lines(capsys)
    assert_named(lines, "equally long runs", "picked [8, 9, 1], expected [1, 2, 5]")
    assert not any("free list's front" in line for line in lines), lines


def test_adjacent_a_right_policy_built_from_the_rules_passes(capsys):
    """``pick_with`` with the rules as the notebook states them is a right answer: the wrong answers built
    from it differ only where they say."""
    right = pick_with(lambda fits: fits[0], first_longest)
    checks.check_pick_adjacent(right)
    assert_passes(graded_lines(capsys))
    assert_hidden_passes("L2.4", right)


def test_adjacent_answer_on_a_worked_example():
    """By hand: free runs 0 | 2 3 | 5 6 7 | 9, nothing fits 5: the longest run (5 6 7), then the first
    run that fits the other 2 (2 3)."""
    assert answers.pick_adjacent([9, 7, 0, 2, 6, 3, 5], [], 5) == [5, 6, 7, 2, 3]
    assert answers.pick_adjacent([7, 3, 4], [2], 1) == [3]


# ---- L2.5 compaction_moves ----


def moves_one_per_block(tables, num_blocks):
    """Copies every block to its goal in table order, without minding what the destination holds."""
    moves, at = [], 0
    for table in tables:
        for b in table:
            if b != at:
                moves.append((b, at))
            at += 1
    return moves


def moves_by_destination(tables, num_blocks):
    """The moves outside cycles in order of destination (right for a chain that shifts down, as
    [[1, 2, 3]]), then each cycle through a spare block: a chain that runs the other way, as [[5], [0]],
    overwrites block 0 before it is copied."""
    goal = {b: g for g, b in enumerate(b for table in tables for b in table)}
    pending = {b: g for b, g in goal.items() if b != g}
    in_cycle = set()
    for b in pending:
        seen, cur = [], b
        while cur in pending and cur not in seen:
            seen.append(cur)
            cur = pending[cur]
        if cur == b:
            in_cycle.add(b)
    moves = sorted(((b, g) for b, g in pending.items() if b not in in_cycle), key=lambda m: m[1])
    cycles = {b: pending[b] for b in in_cycle}
    spare = next((b for b in range(num_blocks) if b not in cycles and b not in goal.values()), None)
    if cycles and spare is None:
        raise ValueError("no spare block")
    while cycles:
        start = min(cycles)
        moves.append((start, spare))
        dst = start
        while (src := next(b for b, g in cycles.items() if g == dst)) != start:
            moves.append((src, dst))
            del cycles[src]
            dst = src
        moves.append((spare, cycles.pop(start)))
    return moves


def moves_need_a_spare(tables, num_blocks):
    """Right plans, but a full pool raises ValueError even when nothing is in a cycle."""
    if sum(len(t) for t in tables) == num_blocks:
        raise ValueError(f"no spare block among {num_blocks}")
    return answers.compaction_moves(tables, num_blocks)


def moves_every_block(tables, num_blocks):
    """A right plan padded with a copy of a block already in place onto itself."""
    moves = answers.compaction_moves(tables, num_blocks)
    placed = sorted(checks.placed_blocks(tables))
    return moves + [(placed[0], placed[0])] if placed else moves + [moves[-1]] if moves else [(0, 0)]


@pytest.mark.parametrize("fn", [answers.compaction_moves, "notebook"])
def test_compaction_right_answers_pass(capsys, fn):
    fn = solution("compaction_moves") if fn == "notebook" else fn
    checks.check_compaction_moves(fn)
    assert_passes(graded_lines(capsys))
    assert_hidden_passes("L2.5", fn)


@pytest.mark.parametrize(
    ("wrong", "case_name", "rule"),
    [
        (moves_one_per_block, "two tables swap places", "were overwritten before they were copied"),
        (moves_every_block, "already packed", "a block already in place was copied away"),
        (moves_by_destination, "a chain backwards", "table 1's entry 0 (block 0) were overwritten"),
        (
            moves_need_a_spare,
            "a full pool with nothing to move",
            "raised ValueError: no spare block among 2 (a plan exists",
        ),
        (stub, "one table", "NotImplementedError"),
    ],
)
def test_compaction_wrong_answers_fail_with_their_rule(capsys, wrong, case_name, rule):
    checks.check_compaction_moves(wrong)
    assert_named(graded_lines(capsys), case_name, rule)
    assert_hidden_fails("L2.5", wrong)


def test_compaction_stored_counts_are_the_answers():
    for _, tables, num_blocks, fewest in checks.COMPACTION_CASES:
        if fewest is None:
            with pytest.raises(ValueError, match="no spare block"):
                answers.compaction_moves(tables, num_blocks)
        else:
            moves = answers.compaction_moves(tables, num_blocks)
            assert checks.apply_moves(tables, num_blocks, moves) is None
            assert len(moves) == fewest


def test_compaction_hidden_cases_hold_cycles_and_full_pools():
    """Across the three seeds the draw reaches a plan with a cycle through a spare block and a full
    pool with no plan at all."""
    outcomes = [
        answers.EXPECT["L2.5"](case)
        for seed in SEEDS
        for case in checks.HIDDEN["L2.5"].draw(hidden.rng_for(seed, "L2.5"))
    ]
    assert {"raised": "ValueError"} in outcomes
    assert any(o.get("moves", 0) and o["moves"] > 2 for o in outcomes)


def test_compaction_wrong_chain_order_passes_the_other_chain(capsys):
    """``moves_by_destination`` is right on the chain that shifts down: only the backward chain
    (issue 37's [[5], [0]]) catches it."""
    checks.check_compaction_moves(moves_by_destination)
    lines = graded_lines(capsys)
    assert any("a chain: each move frees" in line and line.endswith(": ok") for line in lines), lines


def test_apply_moves_names_the_lost_entry():
    assert checks.apply_moves([[1], [0]], 3, [(1, 0), (0, 1)]) == (
        "the contents of table 1's entry 0 (block 0) were overwritten before they were copied"
    )
    assert checks.apply_moves([[1], [0]], 3, [(1, 2), (0, 1), (2, 0)]) is None


# ---- L2.6 catch the bug ----


def test_the_answer_key_catches_every_bug():
    for bug in [None, *checks.ALLOCATOR_BUGS]:
        verdict = mutations.outcome_of(answers.test_allocator, mutations.version(checks.ALLOCATOR, bug))
        assert verdict == ("passes" if bug is None else "fails"), bug


def weak_test(BlockAllocator):
    """Checks only the order of a first allocation."""
    assert BlockAllocator(4, 2).alloc_blocks(2) == [0, 1]


def always_raises(BlockAllocator):
    raise AssertionError("every allocator is wrong")


@pytest.mark.parametrize("fn", [answers.test_allocator, "notebook"])
def test_catch_right_answers_pass(capsys, fn):
    fn = solution("test_allocator") if fn == "notebook" else fn
    checks.check_test_allocator(fn)
    assert_passes(graded_lines(capsys))
    assert_hidden_passes("L2.6", fn)


def test_a_weak_test_is_told_which_bugs_it_misses(capsys):
    checks.check_test_allocator(weak_test)
    assert_named(graded_lines(capsys), "bug 'L2 free accepts a double free'", "does not catch it")
    for seed in SEEDS:
        missed = problems("L2.6", weak_test, seed)
        assert any("L2 free gives blocks back before it has checked them all" in p for p in missed), missed
        assert not any("the correct version" in p for p in missed), missed


def test_a_test_that_always_raises_fails_the_correct_allocator(capsys):
    checks.check_test_allocator(always_raises)
    assert_named(
        graded_lines(capsys), "the correct version", "your test fails the allocator as the stage has it"
    )
    assert_hidden_fails("L2.6", always_raises)
    checks.check_test_allocator(stub)
    assert_fails(graded_lines(capsys), "the correct version")
    assert_hidden_fails("L2.6", stub)


def oracle_test(Allocator):
    """Compares the class with the stage's own allocator: not credited."""
    ours, theirs = Allocator(4, 2), BlockAllocator(4, 2)
    assert ours.alloc_blocks(3) == theirs.alloc_blocks(3)


def test_an_oracle_test_is_not_credited():
    for seed in SEEDS:
        assert any("the stage's own" in p for p in problems("L2.6", oracle_test, seed))


# ---- L2.7 predict ----


def test_the_prediction_key_is_what_the_stage_does():
    assert answers.predict() == checks.prediction_state()


@pytest.mark.parametrize("fn", [answers.predict, "notebook"])
def test_predict_right_answers_pass(capsys, fn):
    fn = solution("predict") if fn == "notebook" else fn
    checks.check_predict(fn)
    assert_passes(graded_lines(capsys))
    assert_hidden_passes("L2.7", fn)


def predict_no_reuse():
    """Forgets that b's freed block goes to the back of the free list and is handed out to c."""
    return {**answers.predict(), "c block_table": [4, 5, 0], "free list": [1, 3, 2]}


def predict_by_running():
    """Runs the stage instead of predicting: the hidden case sees its code run."""
    return checks.prediction_state()


def predict_exception_class():
    """The right prediction, with the exception given as its class rather than its name."""
    return {**answers.predict(), "exception of allocate_slots(a, 13)": OutOfBlocksError}


def test_predict_an_exception_class_is_told_the_type_expected(capsys):
    checks.check_predict(predict_exception_class)
    lines = graded_lines(capsys)
    assert_named(
        lines,
        "exception of allocate_slots(a, 13)",
        "the class OutOfBlocksError, expected the name of an exception as a str, or None",
    )
    assert lines[-1] == "4/5 passed", lines
    for seed in SEEDS:
        assert problems("L2.7", predict_exception_class, seed) == [
            "hidden case 1 (predict()): exception of allocate_slots(a, 13) is wrong"
        ]


@pytest.mark.parametrize("notebook", [NOTEBOOK, exercises.exercise_path(NOTEBOOK)])
def test_predict_keys_are_stated_in_the_text_and_the_stub(notebook):
    """Issue 37: a right prediction under other key names got 0/5. The exercise's text and the function
    the learner fills in (the stub keeps the comment above the solution) name every key the check reads."""
    nb = exercises.read(notebook)
    (text,) = [c.source for c in nb.cells if c.cell_type == "markdown" and "## Exercise L2.7" in c.source]
    (code,) = [c.source for c in nb.cells if c.cell_type == "code" and "def predict():" in c.source]
    head = code.split("# BEGIN SOLUTION")[0] if "# BEGIN SOLUTION" in code else code
    for key in checks.prediction_state():
        assert f'`"{key}"`' in text, key
        assert f'"{key}"' in head, key


def test_predict_wrong_answers_fail_without_showing_the_values(capsys):
    checks.check_predict(predict_no_reuse)
    lines = graded_lines(capsys)
    assert_named(lines, "c block_table", "1 of 3 entries differ")
    assert_named(lines, "free list", "3 of 3 entries differ")
    assert not any("[4, 5, 2]" in line or "[0, 1, 3]" in line for line in lines), lines
    assert_hidden_fails("L2.7", predict_no_reuse)
    checks.check_predict(stub)
    assert_fails(graded_lines(capsys), "a block_table")
    assert_hidden_fails("L2.7", stub)
    assert_hidden_fails("L2.7", predict_by_running)


# ---- rules the warm-up checkers name (item 6) ----


def free_before_checking(self, blocks):
    for b in blocks:
        if b not in range(self.num_blocks) or b not in self.owned:
            raise ValueError(f"block {b}")
        self.owned.discard(b)
        self.free_blocks.append(b)


def allocate_one_too_many(seq, allocator, target_len):
    missing = target_len // allocator.block_size + 1 - len(seq.block_table)
    if missing > 0:
        new = allocator.alloc_blocks(missing)
        seq.block_table.extend(new)
        for b in new:
            seq.slot_indices.extend(range(b * allocator.block_size, (b + 1) * allocator.block_size))


def test_free_names_a_check_done_too_late(capsys):
    checks.check_free(free_before_checking)
    assert_named(
        graded_lines(capsys),
        "an id outside the pool is refused",
        "free changed the free list before it found the bad id",
    )


def test_reserve_names_one_block_too_many(capsys):
    checks.check_allocate_slots(allocate_one_too_many)
    assert_named(graded_lines(capsys), "block_size 4: 4 then 6 positions", "one block too many")


def test_reserve_case_labels_say_what_runs():
    """Issue 37: case 2 ran target_len 1 after 0 under a label that said only 'target 0'."""
    source = Path(checks.__file__).read_text(encoding="utf-8")
    assert (
        '"block_size 4: target 0 allocates nothing, then target 1 one block", case(4, 8, 0, [], [0, 1])'
        in source
    )
