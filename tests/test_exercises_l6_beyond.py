"""L6's exercises beyond the warm-ups: their checkers pass the answer key and fail plausible wrong answers,
naming the rule each breaks; and the warm-ups' checkers name the rules of their known mistakes.

- L6.5 (beyond the stage): copy-on-write allocation, ``check_allocate_cow``;
- L6.6 (beyond the stage): compaction of the pool, ``check_compact``;
- L6.7 (catch the bug): a learner's test of ``allocate_for_seq``, ``check_catch_allocate``;
- L6.8 (predict): the tables after five operations, ``check_predict``;
- L6.1 and L6.2 (warm-ups): dtypes and the named mistakes of ``allocate_mistakes`` / ``free_mistakes``.

For each new exercise: the independent answer (``key/L6_tpu_jax/answers.py``) passes the visible
check and the hidden cases of three seeds; the untouched stub fails both; a plausible wrong answer fails
both, with the rule it breaks in its visible line; the hidden cases differ between seeds. L6.7's hidden
cases are judged from observations made here (``observe_catch`` on each drawn case, as ``harvest`` makes
them, without the cache clearing that makes a real harvest take seconds per case); the reference
notebook's grading (``tests/test_grading.py``) runs the real harvest.

Left out on purpose: the notebooks (``tests/test_grading.py``) and L6.4's visible check (it needs the
notebook's 4 devices).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from checker_asserts import assert_fails, assert_fails_hidden, assert_passes, graded_lines, hidden_problems
from jax.sharding import PartitionSpec as P

from exercises.L6_tpu_jax import checks as l6
from key.L6_tpu_jax import answers
from kvcourse.grading import hidden
from kvcourse.grading.mutations import outcome_of, version
from L6_tpu_jax.page_table import PageTable, SequenceTable

PACKAGE = "L6_tpu_jax"
SEEDS = (0, 1, 2)


def stub(*args):
    """The exercise notebook's untouched cell."""
    raise NotImplementedError("Exercise L6.k")


def assert_passes_hidden(exercise_id: str, fn) -> None:
    for seed in SEEDS:
        assert hidden_problems(PACKAGE, exercise_id, fn, seed=seed) == [], (exercise_id, seed)


def assert_draws_differ(exercise_id: str) -> None:
    draws = [l6.HIDDEN[exercise_id].draw(hidden.rng_for(seed, exercise_id)) for seed in SEEDS]
    assert draws[0] != draws[1] and draws[1] != draws[2], exercise_id


def line_of(lines: list[str], case_name: str) -> str:
    return next(line for line in lines if line.startswith("case ") and case_name in line)


# ---- L6.1 and L6.2: dtypes and named mistakes


def allocate_float_dests(*args):
    """Right values, but the destinations as float32 (what the issue's learner returned)."""
    refs, table, lens, dests = answers.allocate(*args)
    return refs, table, lens, dests.astype(np.float32)


def allocate_row_off(*args):
    """Each destination one row after the token's: (pos + 1) % page_size."""
    refs, table, lens, dests = answers.allocate(*args)
    ps = args[-1]
    return refs, table, lens, dests // ps * ps + (dests % ps + 1) % ps


def allocate_in_batch_order(refs, table, lens, slots, pos, page_size):
    """Hands out the pages in the order the slots come in the batch, not in slot order."""
    refs, table, lens = refs.copy(), table.copy(), lens.copy()
    for s, p in zip(slots, pos, strict=True):
        lens[s] = max(lens[s], p + 1)
    for s in dict.fromkeys(slots.tolist()):
        for j in range(-(-lens[s] // page_size)):
            if table[s, j] < 0:
                page = np.flatnonzero(refs == 0)[0]
                refs[page], table[s, j] = 1, page
    dests = [table[s, p // page_size] * page_size + p % page_size for s, p in zip(slots, pos, strict=True)]
    return refs, table, lens, np.array(dests, np.int32)


@pytest.mark.parametrize(
    ("wrong", "case_name", "rule"),
    [
        (allocate_float_dests, "first page", "new_token_dests is float32, expected int32"),
        (allocate_row_off, "prefill of 9 tokens", "new_token_dests is one row off"),
        (allocate_in_batch_order, "lists slot 2 before slot 0", "ascending slot order, not in batch order"),
    ],
)
def test_l6_allocate_names_the_rule(capsys, wrong, case_name, rule):
    l6.check_allocate(wrong)
    lines = graded_lines(capsys)
    assert_fails(lines, case_name)
    assert rule in line_of(lines, case_name), lines
    assert hidden_problems(PACKAGE, "L6.1", wrong, seed=0)


def test_l6_allocate_hidden_cases_see_the_dtype():
    problems = hidden_problems(PACKAGE, "L6.1", allocate_float_dests, seed=0)
    assert problems and all("dtypes is" in p and "float32" in p for p in problems), problems


def free_keeping_refcounts(*args):
    refs, table, lens, used = answers.free_finished(*args)
    return args[0].copy(), table, lens, used


def free_counting_minus_one(refs, table, lens, used, finished):
    """Takes every entry of a finished row for a page, -1 too: refs[-1] is the last page's count."""
    refs, table, lens = refs.copy(), table.copy(), lens.copy()
    for s in np.flatnonzero(finished):
        for page in table[s]:
            refs[page] -= 1
    table[finished], lens[finished] = -1, 0
    return refs, table, lens, used & ~finished


@pytest.mark.parametrize(
    ("wrong", "case_name", "rule"),
    [
        (free_keeping_refcounts, "one sequence on pages [1, 3]", "one reference per page it holds"),
        (free_counting_minus_one, "5 slots, one unused", "-1 in a row is no page"),
    ],
)
def test_l6_free_finished_names_the_rule(capsys, wrong, case_name, rule):
    l6.check_free_finished(wrong)
    lines = graded_lines(capsys)
    assert_fails(lines, case_name)
    assert rule in line_of(lines, case_name), lines
    assert hidden_problems(PACKAGE, "L6.2", wrong, seed=0)


def test_l6_mesh_rules_name_each_spec():
    assert l6.mesh_rules({"params": P(), "decode_state": P(), "kv_pages": P("data", None)}) == ""
    rules = l6.mesh_rules({"params": P("data"), "decode_state": P("data"), "kv_pages": P()})
    assert rules.count(";") == 2 and "weights are whole" in rules and "axis 0 (the pages)" in rules


# ---- L6.5: copy-on-write allocation


def cow_in_place(refs, table, lens, slots, pos, page_size):
    """L6.1's allocation: a shared page is written in place, nothing is copied."""
    return (*answers.allocate(refs, table, lens, slots, pos, page_size), [])


def cow_copies_for_every_holder(refs, table, lens, slots, pos, page_size):
    """Copies a page for every slot that held it shared when the batch began, the last holder too."""
    refs, table, lens, shared = refs.copy(), table.copy(), lens.copy(), refs > 1
    copies = []
    for s in sorted(set(slots.tolist())):
        mine = pos[slots == s]
        lens[s] = max(lens[s], int(mine.max()) + 1)
        for j in sorted({int(p) // page_size for p in mine}):
            old = int(table[s, j])
            if old < 0 or shared[old]:
                new = int(np.flatnonzero(refs == 0)[0])
                refs[new], table[s, j] = 1, new
                if old >= 0:
                    refs[old] -= 1
                    copies.append((old, new))
    dests = [table[s, p // page_size] * page_size + p % page_size for s, p in zip(slots, pos, strict=True)]
    return refs, table, lens, np.array(dests, np.int32), copies


def cow_no_shortage_check(refs, table, lens, slots, pos, page_size):
    """Right when the pool has room; when not, returns the tables unchanged instead of raising."""
    try:
        return answers.allocate_cow(refs, table, lens, slots, pos, page_size)
    except ValueError:
        return refs.copy(), table.copy(), lens.copy(), np.full(len(slots), -1, np.int32), []


def test_l6_cow_passes_the_answer(capsys):
    l6.check_allocate_cow(answers.allocate_cow)
    assert_passes(graded_lines(capsys))
    assert_passes_hidden("L6.5", answers.allocate_cow)
    assert_draws_differ("L6.5")


def test_l6_cow_fails_the_stub(capsys):
    l6.check_allocate_cow(stub)
    assert graded_lines(capsys)[-1] == "0/7 passed"
    assert_fails_hidden(PACKAGE, "L6.5", stub)


@pytest.mark.parametrize(
    ("wrong", "case_name", "rule"),
    [
        (cow_in_place, "lazy clone of slot 0", "a shared page is copied before it is written"),
        (cow_copies_for_every_holder, "both clones on [3, 5] decode", "its last holder writes in place"),
        (cow_no_shortage_check, "needs 3 pages and 1 is free", "raise ValueError naming what it needs"),
    ],
)
def test_l6_cow_names_the_rule(capsys, wrong, case_name, rule):
    l6.check_allocate_cow(wrong)
    lines = graded_lines(capsys)
    assert_fails(lines, case_name)
    assert rule in line_of(lines, case_name), lines
    assert_fails_hidden(PACKAGE, "L6.5", wrong)


# ---- L6.6: compaction


def compact_moves_descending(refs, table):
    """Right ids and tables, but the moves from the highest page down: a chain overwrites itself."""
    new_refs, new_table, moves = answers.compact(refs, table)
    return new_refs, new_table, moves[::-1]


def compact_per_entry(refs, table):
    """Renumbers the entries of the table in reading order, so a page shared by clones splits."""
    new_table, moves, refs_new = np.full_like(table, -1), [], np.zeros_like(refs)
    k = 0
    for s, j in zip(*np.nonzero(table >= 0), strict=True):
        new_table[s, j], refs_new[k] = k, 1
        if table[s, j] != k:
            moves.append((int(table[s, j]), k))
        k += 1
    return refs_new, new_table, moves


def compact_trusting_refcounts(refs, table):
    """Never checks the refcounts against the table."""
    live = [int(p) for p in np.flatnonzero(refs > 0)]
    new_id = {old: new for new, old in enumerate(live)}
    new_table = np.array([[new_id.get(int(p), -1) if p >= 0 else -1 for p in row] for row in table], np.int32)
    new_refs = np.zeros_like(refs)
    new_refs[: len(live)] = refs[live]
    return new_refs, new_table, [(old, new) for new, old in enumerate(live) if old != new]


def test_l6_compact_passes_the_answer(capsys):
    l6.check_compact(answers.compact)
    assert_passes(graded_lines(capsys))
    assert_passes_hidden("L6.6", answers.compact)
    assert_draws_differ("L6.6")


def test_l6_compact_fails_the_stub(capsys):
    l6.check_compact(stub)
    assert graded_lines(capsys)[-1] == "0/6 passed"
    assert_fails_hidden(PACKAGE, "L6.6", stub)


@pytest.mark.parametrize(
    ("wrong", "case_name", "rule"),
    [
        (compact_moves_descending, "each moves down by one", "before it was copied away (order the moves)"),
        (compact_per_entry, "clones share page 2", "every entry of a page gets one new id"),
        (compact_trusting_refcounts, "two holders: ValueError", "raise ValueError"),
    ],
)
def test_l6_compact_names_the_rule(capsys, wrong, case_name, rule):
    l6.check_compact(wrong)
    lines = graded_lines(capsys)
    assert_fails(lines, case_name)
    assert rule in line_of(lines, case_name), lines
    assert_fails_hidden(PACKAGE, "L6.6", wrong)


# ---- L6.7: a test that catches allocate_for_seq's bugs


def catch_problems(test, seed: int) -> list[str]:
    """The grader's verdict on ``test``'s hidden cases, from observations made as ``harvest`` makes them."""
    cases = l6.HIDDEN["L6.7"].draw(hidden.rng_for(seed, "L6.7"))
    record = {"observations": [{"ok": l6.observe_catch(test, case)} for case in cases], "aliased": []}
    return hidden.judge(PACKAGE, "L6.7", seed, record)


def weak_test(allocate_for_seq):
    """Checks only that a page a decode crosses into gets refcount 1."""
    seqs = SequenceTable(jnp.array([4], jnp.int32), jnp.array([[0, -1]], jnp.int32), jnp.array([True]), 4)
    pages = PageTable(jnp.array([1, 0, 0], jnp.int32))
    _, pages, _ = allocate_for_seq(seqs, pages, jnp.array([0], jnp.int32), jnp.array([4], jnp.int32))
    assert pages.page_ref_counts.tolist()[1] == 1


def always_fails(allocate_for_seq):
    raise AssertionError("nothing is right")


def test_l6_the_answer_key_catches_every_bug():
    assert outcome_of(answers.test_allocate, version(l6.ALLOCATE)) == "passes"
    for bug in l6.CATCH_ALL:
        assert outcome_of(answers.test_allocate, version(l6.ALLOCATE, bug)) == "fails", bug
    assert len(l6.CATCH_ALL) == 6 and set(l6.CATCH_VISIBLE) < set(l6.CATCH_ALL)


def test_l6_catch_passes_the_answer(capsys):
    l6.check_catch_allocate(answers.test_allocate)
    assert_passes(graded_lines(capsys))
    for seed in SEEDS:
        assert catch_problems(answers.test_allocate, seed) == [], seed
    assert_draws_differ("L6.7")


def test_l6_catch_reports_the_bugs_a_weak_test_misses(capsys):
    l6.check_catch_allocate(weak_test)
    lines = graded_lines(capsys)
    assert_fails(lines, "grants the pages it can")
    assert "your test passes allocate_for_seq with this bug" in line_of(lines, "grants the pages it can")
    problems = catch_problems(weak_test, 0)  # it misses the all-or-nothing bug and page 0's
    assert len(problems) == 2 and any("grants the pages it can" in p for p in problems), problems


def test_l6_catch_fails_a_test_that_always_fails(capsys):
    l6.check_catch_allocate(always_fails)
    lines = graded_lines(capsys)
    assert "your test fails allocate_for_seq as the stage has it" in line_of(lines, "the correct version"), (
        lines
    )
    assert catch_problems(always_fails, 0)
    l6.check_catch_allocate(stub)  # a stub catches no bug: every case reads "not done yet"
    lines = graded_lines(capsys)
    assert lines[-1] == "0/3 passed" and all("raised NotImplementedError" in line for line in lines[:-1]), (
        lines
    )


# ---- L6.8: predict


def test_l6_predict_passes_the_answer(capsys):
    l6.check_predict(answers.predict)
    assert_passes(graded_lines(capsys))
    assert_passes_hidden("L6.8", answers.predict)
    assert l6.predict_steps()[-1][1] == answers.predict()  # the stage agrees with the hand-worked key


def test_l6_predict_fails_the_stub(capsys):
    l6.check_predict(stub)
    assert graded_lines(capsys)[-1] == "0/4 passed"
    assert_fails_hidden(PACKAGE, "L6.8", stub)


def test_l6_predict_says_how_many_entries_differ_not_which_values(capsys):
    """The clone's own page taken as the highest free one (5, not 3): two arrays wrong."""
    wrong = {**answers.predict(), "page_indices": [[-1, -1, -1], [2, 1, -1], [0, 5, 4]]}
    wrong["new_token_dests"] = [11, 4, 22, 23, 16]
    l6.check_predict(lambda: wrong)
    lines = graded_lines(capsys)
    assert "case 2 (page_indices after step 5): WRONG — 1 of 9 entries differ" in lines, lines
    assert "case 4 (new_token_dests after step 5): WRONG — 2 of 5 entries differ" in lines, lines
    assert not any("[0, 3, 4]" in line for line in lines), lines
    assert hidden_problems(PACKAGE, "L6.8", lambda: wrong)


def test_l6_predict_that_runs_the_stage_is_not_credited():
    problems = hidden_problems(PACKAGE, "L6.8", lambda: l6.predict_steps()[-1][1])
    assert any("the answer runs" in p for p in problems), problems
