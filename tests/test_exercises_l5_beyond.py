"""L5's exercises beyond the warm-ups, and the broken rules the warm-ups' checks now name.

The notebook's L5.6 (the hits of an LRU prefix cache on a trace), L5.7 (the blocks a pool holds when no
request finishes), L5.8 (a test that catches the allocator's bugs) and L5.9 (a prediction of a fork,
frees and prefix hits) are held to:

- the independent answer of ``key/L5_clones/answers.py`` and the reference notebook's solution
  pass the visible check, and the answer passes the hidden cases of three seeds;
- the untouched stub (a function raising NotImplementedError) fails, visibly and hidden;
- plausible wrong answers fail visibly, with the rule they break in the case's line, and hidden;
- the hidden cases differ between seeds (L5.9's are the keys of the one prediction, in an order
  drawn per seed);
- L5.6's visible expectations are literal data in ``checks.py`` (it ships without the answer key):
  they must equal what the answer key and the named mistakes give;
- L5.7's visible reference is the stage itself (``match_prefix`` and ``allocate_slots``); it agrees with the
  answer key on the hidden cases of several seeds;
- L5.8: the key's test catches every bug of the list and passes the correct allocator; a weak test is
  reported with the bugs it misses; a test that always raises fails the correct version.

The warm-ups' wrong answers (``tests/test_exercises_l5.py``) now get the rule they break named in the
check's line: a shared partial block, one reference for n children, a shared block freed at once, a
head-first free, unchained keys, a key for the tail, the last token's block matched, a collision
taken, a dropped beam's blocks kept.

Everything runs on allocators of a few blocks; no model is loaded.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import pytest
from checker_asserts import assert_fails, assert_fails_hidden, assert_passes, graded_lines, hidden_problems
from test_exercises_l5 import (
    clone_counts_one,
    clone_shares_partial,
    fork_keeps_dropped,
    fork_shares_partial,
    free_at_once,
    free_head_first,
    hashes_unchained,
    hashes_with_tail,
    match_trusts_the_key,
    match_unchained,
    match_with_last_block,
)

from exercises.L5_clones import checks
from key.L5_clones import answers
from kvcourse.grading.cases import outcome
from kvcourse.grading.exercises import read
from kvcourse.grading.hidden import rng_for
from kvcourse.grading.mutations import outcome_of, version
from L5_clones.allocator import BlockAllocator
from L5_clones.prefix_cache import block_hash
from L5_clones.sequence import Sequence, allocate_slots

NOTEBOOK = Path(__file__).resolve().parent.parent / "key" / "notebooks" / "L5_clones.ipynb"
SEEDS = (0, 1, 2)


def stub(*args):
    raise NotImplementedError("Exercise L5.k")


# ---- the warm-ups' checks name the broken rule ----


@pytest.mark.parametrize(
    "checker, wrong, rule",
    [
        (checks.check_clone_table, clone_shares_partial, "the partial last block is shared, not copied"),
        (checks.check_clone_table, clone_counts_one, "each full block gains 1 reference, not n"),
        (checks.check_free, free_at_once, "a shared block is freed at once"),
        (checks.check_free, free_head_first, "the table goes back head first"),
        (checks.check_block_hashes, hashes_unchained, "the keys do not chain"),
        (checks.check_block_hashes, hashes_with_tail, "the partial last block got a key"),
        (checks.check_match_prefix, match_with_last_block, "the block holding the last token was matched"),
        (checks.check_match_prefix, match_unchained, "the keys do not chain"),
        (checks.check_match_prefix, match_trusts_the_key, "a key hit was taken without comparing"),
        (checks.check_fork_beams, fork_keeps_dropped, "a dropped beam keeps its blocks"),
        (checks.check_fork_beams, fork_shares_partial, "a further survivor shares the beam's partial block"),
    ],
    ids=lambda x: getattr(x, "__name__", "rule"),
)
def test_warm_up_checks_name_the_broken_rule(capsys, checker, wrong, rule):
    checker(wrong)
    lines = graded_lines(capsys)
    assert any("WRONG" in line and f"({rule}" in line for line in lines), lines


def test_a_right_answer_gets_no_rule_named(capsys):
    """A rule is named only on a wrong line: the answer key's lines are plain ``ok``."""
    for checker, answer in [
        (checks.check_clone_table, answers.clone_table),
        (checks.check_free, answers.free),
        (checks.check_block_hashes, answers.block_hashes),
        (checks.check_match_prefix, answers.match_prefix),
        (checks.check_fork_beams, answers.fork_beams),
    ]:
        checker(answer)
        assert_passes(graded_lines(capsys))


# ---- wrong answers to L5.6 (lru_hits) and L5.7 (blocks_held) ----


def _lru(prompts, block_size, capacity, name, limit, order):
    """An LRU prefix cache with the naming of blocks, the blocks looked at and the order of use given."""
    if block_size < 1 or capacity < 0 or not all(prompts):
        raise ValueError("block_size, capacity or a prompt out of range")
    cache, hits = OrderedDict(), []
    for p in prompts:
        count = 0
        while count < limit(p, block_size) and name(p, count, block_size) in cache:
            count += 1
        hits.append(count)
        for i in order(len(p) // block_size):
            cache[name(p, i, block_size)] = None
            cache.move_to_end(name(p, i, block_size))
        while len(cache) > capacity:
            cache.popitem(last=False)
    return hits


def _chained(p, i, bs):
    return tuple(p[: (i + 1) * bs])


def _not_last(p, bs):
    return (len(p) - 1) // bs


def _tail_first(n):
    return range(n - 1, -1, -1)


def lru_unchained(prompts, block_size, capacity):
    """Names a block by its own tokens: the same tokens after another prefix hit."""
    return _lru(
        prompts,
        block_size,
        capacity,
        lambda p, i, bs: tuple(p[i * bs : (i + 1) * bs]),
        _not_last,
        _tail_first,
    )


def lru_last_block(prompts, block_size, capacity):
    """Counts the block of the prompt's last token as a hit."""
    return _lru(prompts, block_size, capacity, _chained, lambda p, bs: len(p) // bs, _tail_first)


def lru_head_first(prompts, block_size, capacity):
    """Uses a request's blocks head first: its first block is the first evicted, and the chain with it."""
    return _lru(prompts, block_size, capacity, _chained, _not_last, range)


def lru_no_errors(prompts, block_size, capacity):
    """Right on valid input, but returns zeros instead of refusing a bad one."""
    if block_size < 1 or capacity < 0 or not all(prompts):
        return [0] * len(prompts)
    return answers.lru_hits(prompts, block_size, capacity)


def held_with_last_block(prompts, block_size):
    """Shares the block of a prompt's last token too."""
    if block_size < 1 or not all(prompts):
        raise ValueError("bad input")
    seen, held, total = set(), [], 0
    for p in prompts:
        names = [tuple(p[: (i + 1) * block_size]) for i in range(len(p) // block_size)]
        shared = 0
        while shared < len(names) and names[shared] in seen:
            shared += 1
        total += -(-len(p) // block_size) - shared
        held.append(total)
        seen.update(names)
    return held


def held_unshared(prompts, block_size):
    """Shares nothing: every prompt takes all its blocks."""
    if block_size < 1 or not all(prompts):
        raise ValueError("bad input")
    out, total = [], 0
    for p in prompts:
        total += -(-len(p) // block_size)
        out.append(total)
    return out


def held_previous_only(prompts, block_size):
    """Compares each prompt with the one just before it only."""
    if block_size < 1 or not all(prompts):
        raise ValueError("bad input")
    out, total = [], 0
    for r, p in enumerate(prompts):
        shared = answers.blocks_held([prompts[r - 1], p], block_size)
        total += shared[1] - shared[0] if r else shared[0]
        out.append(total)
    return out


@pytest.mark.parametrize(
    "exercise, checker, wrong, case_name, rule",
    [
        ("L5.6", checks.check_lru_hits, lru_unchained, "after another prefix", "named by its own tokens"),
        ("L5.6", checks.check_lru_hits, lru_last_block, "the same 8 tokens twice", "last token was counted"),
        ("L5.6", checks.check_lru_hits, lru_head_first, "room for 2 blocks", "used head first"),
        ("L5.6", checks.check_lru_hits, lru_no_errors, "capacity -1 raises ValueError", None),
        (
            "L5.7",
            checks.check_blocks_held,
            held_with_last_block,
            "the same 8 tokens twice",
            "last token was shared",
        ),
        ("L5.7", checks.check_blocks_held, held_unshared, "system prompt", "nothing was shared"),
        ("L5.7", checks.check_blocks_held, held_previous_only, "not the one just before", None),
    ],
    ids=lambda x: getattr(x, "__name__", None) if callable(x) else None,
)
def test_wrong_beyond_answers_fail_with_their_rule(capsys, exercise, checker, wrong, case_name, rule):
    checker(wrong)
    lines = graded_lines(capsys)
    assert_fails(lines, case_name)
    if rule:
        named = [line for line in lines if case_name in line]
        assert any("WRONG" in line and rule in line.partition("WRONG")[2] for line in named), named
    assert_fails_hidden("L5_clones", exercise, wrong, seeds=SEEDS)


def test_lru_literal_expectations_are_the_answer_keys_and_the_mistakes():
    """checks.py ships without the answer key, so L5.6's visible expectations are literal: they must be
    what the key and the three named mistakes give on the visible cases."""

    def results(fn):
        out = []
        for _, prompts, block_size, capacity in checks.LRU_CASES:
            kind, got = outcome(fn, [list(p) for p in prompts], block_size, capacity)
            out.append("ValueError" if kind == "raised" and isinstance(got, ValueError) else got)
        return out

    assert checks.LRU_EXPECTED == results(answers.lru_hits)
    mistakes = list(checks.LRU_MISTAKES.values())
    assert mistakes == [results(lru_unchained), results(lru_last_block), results(lru_head_first)]


def test_lru_answer_on_a_hand_worked_trace():
    """The notebook's worked example and a cache too small for a request's blocks, by hand: block_size
    2, room for 2; [1..7] leaves (1, 2) and (1, 2, 3, 4) (its third block was the least recent)."""
    assert answers.lru_hits([[1, 2, 3, 4, 5], [1, 2, 9]], 2, 3) == [0, 1]
    assert answers.lru_hits([[1, 2, 3, 4, 5, 6, 7]] * 2, 2, 2) == [0, 2]
    assert answers.lru_hits([[1, 2, 3, 4, 5, 6, 7]] * 2, 2, 0) == [0, 0]


def test_blocks_held_answer_agrees_with_the_stage_on_drawn_cases():
    """The key's closed count against this stage admitting the same prompts (``match_prefix`` and
    ``allocate_slots`` on a pool that never runs out), on the hidden cases of six seeds."""
    for seed in range(6):
        for case in checks.HIDDEN["L5.7"].draw(rng_for(seed, "L5.7")):
            prompts, block_size = case["prompts"], case["block_size"]
            if block_size < 1 or not all(prompts):
                continue
            assert answers.blocks_held(prompts, block_size) == checks._held_by_stage(prompts, block_size), (
                case
            )


def test_blocks_held_by_hand():
    """block_size 4: [1..6] holds 2 blocks; the same again shares its full block (block 0) only: 3;
    [1..9] then shares block 0 (block 1 of the earlier ones is partial, never registered): 5."""
    assert answers.blocks_held([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6], list(range(1, 10))], 4) == [2, 3, 5]


# ---- L5.8: the learner's test, graded by the bugs it catches ----


def weak_test(BlockAllocator):
    """Checks only the clone's reference counts."""
    a = BlockAllocator(8, 4)
    parent = a.alloc_blocks(3)
    a.clone(parent, 10, 2)
    assert [a.blocks[b].ref_count for b in parent] == [3, 3, 1]


def always_raises(BlockAllocator):
    raise AssertionError("everything is a bug")


def test_the_key_test_catches_every_bug_and_passes_the_allocator():
    assert outcome_of(answers.test_allocator, version(checks.ALLOCATOR)) == "passes"
    for bug in checks.CATCH_ALL:
        assert outcome_of(answers.test_allocator, version(checks.ALLOCATOR, bug)) == "fails", bug
    assert set(checks.CATCH_SHOWN) < set(checks.CATCH_ALL)


def test_a_weak_test_is_told_the_bugs_it_misses(capsys):
    checks.check_catch_allocator(weak_test)
    assert_fails(graded_lines(capsys), "head first")
    for seed in SEEDS:
        problems = hidden_problems("L5_clones", "L5.8", weak_test, seed=seed)
        missed = [bug for bug in checks.CATCH_ALL if any(f"bug '{bug}'" in p for p in problems)]
        assert "L5 free hands a block table back head first" in missed, problems
        assert "L5 clone copies for the children it can, then runs out" in missed, problems
        assert "L5 clone takes one reference on a shared block for all its children" not in missed, problems


def test_a_test_that_always_raises_fails_the_correct_version(capsys):
    checks.check_catch_allocator(always_raises)
    assert_fails(graded_lines(capsys), "the correct version")
    assert_fails_hidden("L5_clones", "L5.8", always_raises, seeds=SEEDS)


# ---- L5.9: the prediction ----


def test_a_wrong_prediction_is_told_how_many_entries_differ_not_which(capsys):
    def head_first_frees():  # C's blocks given back head first: free list [..., 0, 1, 4] before D
        return {
            "D's block table": [0, 1, 5, 6],
            "E's block table": [0, 7],
            "ref counts": [2, 1, 0, 0, 0, 1, 1, 1],
            "free list": [2, 3],
        }

    checks.check_predict(head_first_frees)
    lines = graded_lines(capsys)
    assert_fails(lines, "free list")
    assert any("free list): WRONG — free list has the wrong number of entries" in line for line in lines), (
        lines
    )
    real = checks._predict_run()
    assert not any(str(real["free list"]) in line for line in lines), lines
    assert_fails_hidden("L5_clones", "L5.9", head_first_frees, seeds=SEEDS)

    def one_off():
        return {**answers.PREDICTED, "ref counts": [2, 2, 0, 0, 0, 1, 1, 1]}

    checks.check_predict(one_off)
    assert "case 3 (ref counts): WRONG — 1 of 8 entries differ" in graded_lines(capsys)


def test_the_hand_written_prediction_is_what_the_stage_does():
    assert answers.PREDICTED == checks._predict_run()


# ---- every new exercise: the key and the notebook pass, the stub fails, seeds differ ----

NEW = [
    ("L5.6", checks.check_lru_hits, "lru_hits"),
    ("L5.7", checks.check_blocks_held, "blocks_held"),
    ("L5.8", checks.check_catch_allocator, "test_allocator"),
    ("L5.9", checks.check_predict, "predict"),
]


def notebook_solutions() -> dict:
    """The functions the reference notebook's solution cells define, run with what its setup imports."""
    namespace = {
        "block_hash": block_hash,
        "BlockAllocator": BlockAllocator,
        "Sequence": Sequence,
        "allocate_slots": allocate_slots,
    }
    for cell in read(NOTEBOOK).cells:
        if cell.cell_type == "code" and "# BEGIN SOLUTION" in cell.source:
            exec(cell.source, namespace)  # the course's own notebook: defines the solved functions
    return namespace


@pytest.mark.parametrize("exercise, checker, name", NEW, ids=[n for _, _, n in NEW])
def test_the_answer_key_passes_visibly_and_hidden(capsys, exercise, checker, name):
    checker(answers.ANSWERS[exercise])
    assert_passes(graded_lines(capsys))
    for seed in SEEDS:
        assert hidden_problems("L5_clones", exercise, answers.ANSWERS[exercise], seed=seed) == []


@pytest.mark.parametrize("exercise, checker, name", NEW, ids=[n for _, _, n in NEW])
def test_the_notebook_solution_passes(capsys, exercise, checker, name):
    solved = notebook_solutions()[name]
    checker(solved)
    assert_passes(graded_lines(capsys))
    assert hidden_problems("L5_clones", exercise, solved, seed=3) == []


@pytest.mark.parametrize("exercise, checker, name", NEW, ids=[n for _, _, n in NEW])
def test_the_stub_fails(capsys, exercise, checker, name):
    checker(stub)
    lines = graded_lines(capsys)
    passed, total = lines[-1].removesuffix(" passed").split("/")
    assert passed != total, lines
    assert_fails_hidden("L5_clones", exercise, stub, seeds=SEEDS)


@pytest.mark.parametrize("exercise", ["L5.6", "L5.7", "L5.8", "L5.9"])
def test_hidden_cases_differ_between_seeds(exercise):
    draw = checks.HIDDEN[exercise].draw
    assert draw(rng_for(0, exercise)) != draw(rng_for(1, exercise))
    assert draw(rng_for(0, exercise)) == draw(rng_for(0, exercise))
