"""The catch-the-bug machinery (``kvcourse/grading/mutations.py``) on L2's allocator and a test written here.

- a version is the stage's definition rebuilt: the correct one behaves as the stage's class, a buggy one
  as the stage's class with the mutation put in, and neither runs under the stage's file (so the hidden
  cases' watch sees a test that runs the stage's own code, and only such a test);
- a mutation of another file, or one whose text is gone, is refused with its name;
- the check cell's cases and the hidden cases pass a test that catches the bug, and name the bug a weak
  test lets through; a test that always raises fails the correct version.

Left out on purpose: each stage's catch-the-bug exercise (``tests/test_exercises_*_beyond.py`` hold the
answer key's test to every bug of its list).
"""

from __future__ import annotations

import random

import pytest

from kvcourse.grading import hidden, mutations
from kvcourse.grading.cases import run_cases
from L2_token_flat.allocator import BlockAllocator, OutOfBlocksError

TARGET = "L2_token_flat.allocator:BlockAllocator"
PARTIAL = "L2 allocator hands out the blocks it has, then raises"


def all_or_nothing(allocator_cls) -> None:
    """A test that catches PARTIAL: a refused allocation leaves the free list as it was."""
    a = allocator_cls(3, 4)
    a.alloc_blocks(1)
    with pytest.raises(OutOfBlocksError):
        a.alloc_blocks(5)
    assert list(a.free_blocks) == [1, 2], list(a.free_blocks)


def weak(allocator_cls) -> None:
    """A test that only checks the first allocation."""
    assert allocator_cls(3, 4).alloc_blocks(2) == [0, 1]


def oracle(allocator_cls) -> None:
    """A test that compares with the stage's own allocator: the watch must see it."""
    a, b = allocator_cls(3, 4), BlockAllocator(3, 4)
    assert a.alloc_blocks(2) == b.alloc_blocks(2)


def test_versions_behave_as_the_stage_with_and_without_the_bug():
    correct, buggy = mutations.version(TARGET), mutations.version(TARGET, PARTIAL)
    assert correct is mutations.version(TARGET) and correct is not BlockAllocator
    all_or_nothing(BlockAllocator)
    all_or_nothing(correct)
    with pytest.raises(AssertionError, match=r"\[\]"):
        all_or_nothing(buggy)
    for cls in (correct, buggy):
        assert cls.alloc_blocks.__code__.co_filename == "<L2_token_flat.allocator, handed to your test>"


def test_a_mutation_of_another_file_or_an_unknown_one_is_refused():
    with pytest.raises(ValueError, match="changes L3_block_tensor/allocator.py"):
        mutations.version(TARGET, "L3 allocator hands out the blocks it has, then raises")
    with pytest.raises(KeyError, match="no mutation named 'no such bug'"):
        mutations.version(TARGET, "no such bug")


def test_the_check_cell_names_the_bug_a_weak_test_lets_through(capsys):
    assert run_cases(mutations.catch_cases(all_or_nothing, TARGET, [PARTIAL], "the allocator")) == (2, 2)
    assert run_cases(mutations.catch_cases(weak, TARGET, [PARTIAL], "the allocator")) == (1, 2)
    lines = capsys.readouterr().out.splitlines()
    assert f"case 2 (bug '{PARTIAL}': your test fails): WRONG — your test passes the allocator" in lines[-2]


def test_a_test_that_always_fails_fails_the_correct_version(capsys):
    def always(allocator_cls):
        raise AssertionError("nothing is right")

    assert run_cases(mutations.catch_cases(always, TARGET, [PARTIAL], "the allocator")) == (1, 2)
    assert "your test fails the allocator as the stage has it (AssertionError" in capsys.readouterr().out


def test_hidden_cases_hold_every_bug_in_a_drawn_order_and_watch_for_the_stage():
    spec = mutations.catch_hidden(TARGET, [PARTIAL], ("L2_token_flat.allocator:BlockAllocator.alloc_blocks",))
    orders = {tuple(c["bug"] or "" for c in spec.draw(hidden.rng_for(s, "L2.x"))) for s in range(8)}
    assert len(orders) == 2 and all(sorted(o) == ["", PARTIAL] for o in orders)
    cases = spec.draw(random.Random(0))
    assert [spec.observe(all_or_nothing, c) for c in cases] == [
        "passes" if c["bug"] is None else "fails" for c in cases
    ]
    assert {spec.observe(weak, c) for c in cases} == {"passes"}
    caught: list[str] = []
    with hidden.watching(spec.answers, caught):
        spec.observe(all_or_nothing, cases[0])
    assert caught == []
    with hidden.watching(spec.answers, caught):
        spec.observe(oracle, cases[0])
    assert caught == ["L2_token_flat.allocator:BlockAllocator.alloc_blocks"]
