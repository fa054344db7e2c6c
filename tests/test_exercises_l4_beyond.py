"""L4's exercises beyond the warm-ups can fail and can pass, in process, without running a notebook.

For L4.4 (a sliding window that reads only the blocks it needs), L4.5 (merging partials kept as
(out, lse)), L4.6 (a test that catches ``attend_blocks``' bugs) and L4.7 (predicting the block loop's
state):

- the independent answer (``answers.py``) and the reference notebook's solution pass the visible check,
  and the answer passes the hidden cases of three seeds;
- the untouched stub fails, visibly and on the hidden cases;
- plausible wrong answers fail visibly with the rule they break named in the case line, and fail the
  hidden cases of three seeds;
- the hidden cases differ between seeds (L4.7's are the prediction's keys, in an order drawn per seed);
- the catch-the-bug answer passes the stage's ``attend_blocks`` and fails every bug of the list; a weak
  test is reported by the bugs it misses, and a test that always raises fails the correct version.

It also holds L4.1-L4.3's named rules: a forgotten rescale of ``acc`` says so, not only where the
output differs. Every case runs on tiny tensors: no model is loaded.
"""

from __future__ import annotations

import random
from pathlib import Path

import nbformat
import pytest
import torch
from checker_asserts import assert_fails, assert_fails_hidden, assert_passes, graded_lines, hidden_problems

from exercises.L4_paged_kernel import checks
from key.L4_paged_kernel import answers
from kvcourse.grading.hidden import rng_for
from kvcourse.grading.mutations import outcome_of, version

NOTEBOOK = Path(__file__).resolve().parent.parent / "key" / "notebooks" / "L4_paged_kernel.ipynb"
PACKAGE = "L4_paged_kernel"


def notebook_solution(name: str):
    """The function ``name`` as the reference notebook defines it: its cell, markers and all, run with
    torch (what the setup cell imports)."""
    nb = nbformat.read(str(NOTEBOOK), as_version=4)
    (source,) = [c.source for c in nb.cells if c.cell_type == "code" and c.source.startswith(f"def {name}(")]
    namespace = {"torch": torch}
    exec(source, namespace)  # noqa: S102 - the course's own notebook
    return namespace[name]


def stub(*args):
    raise NotImplementedError("Exercise L4.k")


# ---------------------------------------------------------------------------------------------------
# Wrong answers, each one plausible mistake, written apart from checks.py's list of known mistakes.


def _window_loop(q, k_pool, v_pool, blocks, q_pos, scale, window, *, skip=True, guard=True):
    """A block loop over a window with one mistake switched on: every block read (``skip=False``), or
    no guard for rows that have seen nothing yet (``guard=False``)."""
    block_size = k_pool.shape[1]
    first = max(0, int(q_pos[0]) - window + 1) // block_size if skip else 0
    last = int(q_pos[-1]) // block_size if skip else len(blocks) - 1
    m, l, acc = torch.full((len(q),), float("-inf")), torch.zeros(len(q)), torch.zeros(q.shape)
    read = []
    for j in range(first, last + 1):
        read.append(blocks[j])
        k_pos = j * block_size + torch.arange(block_size)
        s = (q @ k_pool[blocks[j]].T * scale).masked_fill(
            (k_pos[None, :] > q_pos[:, None]) | (k_pos[None, :] <= q_pos[:, None] - window), float("-inf")
        )
        m_new = torch.maximum(m, s.amax(dim=-1))
        base = torch.where(torch.isinf(m_new), 0.0, m_new) if guard else m_new
        p, alpha = torch.exp(s - base[:, None]), torch.exp(m - base)
        l, acc, m = alpha * l + p.sum(dim=-1), alpha[:, None] * acc + p @ v_pool[blocks[j]], m_new
    return acc / l[:, None], read


def window_one_wider(q, k_pool, v_pool, blocks, q_pos, scale, window):
    return answers.attend_window(q, k_pool, v_pool, blocks, q_pos, scale, window + 1)  # p - window .. p


def window_reads_every_block(q, k_pool, v_pool, blocks, q_pos, scale, window):
    return _window_loop(q, k_pool, v_pool, blocks, q_pos, scale, window, skip=False)


def window_without_guard(q, k_pool, v_pool, blocks, q_pos, scale, window):
    return _window_loop(q, k_pool, v_pool, blocks, q_pos, scale, window, guard=False)


def window_logical_ids(q, k_pool, v_pool, blocks, q_pos, scale, window):
    out, read = answers.attend_window(q, k_pool, v_pool, blocks, q_pos, scale, window)
    return out, [blocks.index(b) for b in read]  # logical indices, not the table's ids


def lse_exp_on_its_own(out1, lse1, out2, lse2):
    w1, w2 = torch.exp(lse1)[:, None], torch.exp(lse2)[:, None]  # inf past 88
    out = (w1 * torch.nan_to_num(out1) + w2 * torch.nan_to_num(out2)) / (w1 + w2)
    return out, torch.log(w1 + w2)[:, 0]


def lse_nan_leaks(out1, lse1, out2, lse2):
    top = torch.maximum(lse1, lse2)
    w1, w2 = torch.exp(lse1 - top)[:, None], torch.exp(lse2 - top)[:, None]
    return (w1 * out1 + w2 * out2) / (w1 + w2), top + torch.log(w1 + w2)[:, 0]  # 0 * NaN = NaN


def lse_max_only(out1, lse1, out2, lse2):
    top = torch.maximum(lse1, lse2)
    w1, w2 = torch.exp(lse1 - top)[:, None], torch.exp(lse2 - top)[:, None]
    out = (w1 * torch.nan_to_num(out1) + w2 * torch.nan_to_num(out2)) / (w1 + w2)
    return out, top  # the union's lse is more than the larger side's


def predict_with_stale_row():
    return answers.PREDICTION | {"m": [[5, 7, 12], [5, 7, 12]]}  # the stale 12 taken as a key


def predict_without_causality():
    return answers.PREDICTION | {"keys": [[3, 3, 2], [3, 3, 2]]}  # the query at 6 sees position 7


def predict_global_split_max():
    return answers.PREDICTION | {"split_m": [[7, 7], [9, 9]]}  # one max for both splits


VISIBLE = {
    "L4.4": checks.check_attend_window,
    "L4.5": checks.check_merge_lse,
    "L4.6": checks.check_catch_attend_blocks,
    "L4.7": checks.check_predict,
}
SOLUTIONS = {"L4.4": "attend_window", "L4.5": "merge_lse", "L4.6": "test_attend_blocks", "L4.7": "predict"}

WRONG = [
    # (exercise, wrong answer, a case it fails, the rule that case's line names)
    ("L4.4", window_one_wider, "decode at position 29", "a query sees window + 1 keys"),
    ("L4.4", window_reads_every_block, "decode at position 29", "a block no query can see was read"),
    (
        "L4.4",
        window_without_guard,
        "later rows see nothing in the first block read",
        "rows that see nothing in the first block read are NaN",
    ),
    (
        "L4.4",
        window_logical_ids,
        "blocks [6, 1, 3]",
        "read holds logical block indices, not the table's physical ids",
    ),
    ("L4.5", lse_exp_on_its_own, "large scores (lse up to 214)", "exp(lse) on its own overflows"),
    ("L4.5", lse_nan_leaks, "side 2 saw no key", "an empty side's NaN leaks into the result"),
    ("L4.5", lse_max_only, "4 rows, 5 + 7 keys", "lse of the union is not max(lse1, lse2)"),
    ("L4.7", predict_with_stale_row, "m: each query's running max", "the stale row (position 8)"),
    ("L4.7", predict_without_causality, "keys: the keys each block", "does not see position 7 (causal)"),
    ("L4.7", predict_global_split_max, "split_m", "each split keeps its own max"),
]


@pytest.mark.parametrize("exercise", list(VISIBLE))
def test_the_independent_answer_passes(capsys, exercise):
    VISIBLE[exercise](answers.ANSWERS[exercise])
    assert_passes(graded_lines(capsys))
    for seed in (0, 1, 2):
        assert hidden_problems(PACKAGE, exercise, answers.ANSWERS[exercise], seed=seed) == []


@pytest.mark.parametrize("exercise", list(VISIBLE))
def test_the_reference_notebook_solution_passes(capsys, exercise):
    VISIBLE[exercise](notebook_solution(SOLUTIONS[exercise]))
    assert_passes(graded_lines(capsys))


@pytest.mark.parametrize("exercise", list(VISIBLE))
def test_the_stub_fails(capsys, exercise):
    VISIBLE[exercise](stub)
    lines = graded_lines(capsys)
    assert_fails(lines, "")  # some case fails; for L4.6 the correct version's, for the others all raise
    if exercise != "L4.6":
        assert all("raised NotImplementedError" in line for line in lines[:-1]), lines
    assert_fails_hidden(PACKAGE, exercise, stub)


@pytest.mark.parametrize(
    ("exercise", "wrong", "case_name", "rule"), WRONG, ids=[w.__name__ for _, w, _, _ in WRONG]
)
def test_a_wrong_answer_fails_and_its_rule_is_named(capsys, exercise, wrong, case_name, rule):
    VISIBLE[exercise](wrong)
    lines = graded_lines(capsys)
    assert_fails(lines, case_name)
    named = [line for line in lines if case_name in line and "WRONG" in line]
    assert named and rule in named[0], lines
    assert_fails_hidden(PACKAGE, exercise, wrong)


@pytest.mark.parametrize("exercise", list(VISIBLE))
def test_the_hidden_cases_differ_between_seeds(exercise):
    draws = [checks.HIDDEN[exercise].draw(rng_for(seed, exercise)) for seed in (0, 1, 2)]
    assert draws[0] != draws[1] != draws[2] != draws[0]


def test_the_prediction_is_judged_against_the_hand_written_one():
    """L4.7's hidden cases are the prediction's keys (the input is fixed), judged against a dict
    written by hand (``answers.PREDICTION``), which the stage's run must give too."""
    assert sorted(case["key"] for case in checks.HIDDEN["L4.7"].draw(random.Random(0))) == sorted(
        answers.PREDICTION
    )
    assert checks.predict_state() == answers.PREDICTION


# ---------------------------------------------------------------------------------------------------
# L4.6, catch the bug


def test_the_answer_key_catches_every_bug_and_passes_the_stage():
    assert outcome_of(answers.test_attend_blocks, version(checks.ATTEND_TARGET)) == "passes"
    for bug in checks.CATCH_ALL:
        assert outcome_of(answers.test_attend_blocks, version(checks.ATTEND_TARGET, bug)) == "fails", bug
    assert set(checks.CATCH_SHOWN) < set(checks.CATCH_ALL)  # the hidden cases try bugs the check does not


def weak_test(attend_blocks):
    """One decode query over two full blocks [0, 1], scale 1: it catches a query that cannot see itself
    and nothing that needs a shuffled table, a stale row, a chunk or a scale."""
    gen = torch.Generator().manual_seed(1)
    k_pool, v_pool = torch.randn(2, 4, 1, 2, generator=gen), torch.randn(2, 4, 1, 2, generator=gen)
    q = torch.randn(1, 1, 1, 2, generator=gen)
    m, l, acc = attend_blocks(q, k_pool, v_pool, [0, 1], torch.tensor([7]), 1.0)
    keys, values = k_pool[:, :, 0].flatten(0, 1), v_pool[:, :, 0].flatten(0, 1)  # (8, 2)
    want = torch.softmax(keys @ q[0, 0, 0], dim=0) @ values
    assert torch.allclose(acc[0, 0, 0] / l[0, 0, 0], want, atol=1e-5)


def test_a_weak_test_is_reported_by_the_bugs_it_misses(capsys):
    checks.check_catch_attend_blocks(weak_test)
    lines = graded_lines(capsys)
    assert lines[0].endswith(": ok"), lines  # it passes the correct version
    missed = [line for line in lines if "your test passes attend_blocks with this bug" in line]
    assert {bug for bug in checks.CATCH_SHOWN if any(f"'{bug}'" in line for line in missed)} == set(
        checks.CATCH_SHOWN
    ), lines
    problems = hidden_problems(PACKAGE, "L4.6", weak_test)
    assert any("L4 PyTorch kernel forgets the scale" in p for p in problems), problems


def test_a_test_that_always_raises_fails_the_correct_version(capsys):
    def always(attend_blocks):
        raise AssertionError("wrong")

    checks.check_catch_attend_blocks(always)
    lines = graded_lines(capsys)
    assert_fails(lines, "the correct version of attend_blocks")
    assert "your test fails attend_blocks as the stage has it" in lines[0]
    assert_fails_hidden(PACKAGE, "L4.6", always)


def test_a_test_that_runs_the_stage_kernel_is_flagged():
    """An oracle test: it compares the function handed over with the stage's own ``attend_blocks``."""
    from L4_paged_kernel.paged_attention import attend_blocks as stage

    def oracle(attend_blocks):
        args = (
            torch.randn(1, 1, 2, 2),
            torch.randn(3, 2, 1, 2),
            torch.randn(3, 2, 1, 2),
            [2, 0],
            torch.tensor([2, 3]),
            0.5,
        )
        assert all(torch.allclose(a, b) for a, b in zip(attend_blocks(*args), stage(*args), strict=True))

    problems = hidden_problems(PACKAGE, "L4.6", oracle)
    assert any("the stage's own" in p for p in problems), problems


# ---------------------------------------------------------------------------------------------------
# L4.1-L4.3: the rule a known mistake breaks is named (issue 37, item 6)


def attend_loop(q, k_pool, v_pool, blocks, q_pos, scale, *, rescale_l=True, rescale_acc=True, ahead=0):
    """L4.2's loop with one mistake: no rescale of l or of acc, or a mask that lets a query see
    ``ahead`` keys past its own position."""
    block_size = k_pool.shape[1]
    m, l, acc = torch.full((len(q),), float("-inf")), torch.zeros(len(q)), torch.zeros(q.shape)
    for j, block in enumerate(blocks):
        k_pos = j * block_size + torch.arange(block_size)
        s = (q @ k_pool[block].T * scale).masked_fill(k_pos[None, :] > q_pos[:, None] + ahead, float("-inf"))
        m_new = torch.maximum(m, s.amax(dim=-1))
        p, alpha = torch.exp(s - m_new[:, None]), torch.exp(m - m_new)
        l = (alpha if rescale_l else 1.0) * l + p.sum(dim=-1)
        acc = (alpha[:, None] if rescale_acc else 1.0) * acc + p @ v_pool[block]
        m = m_new
    return acc / l[:, None]


def attend_acc_not_rescaled(*args):
    return attend_loop(*args, rescale_acc=False)


def attend_l_not_rescaled(*args):
    return attend_loop(*args, rescale_l=False)


def attend_sees_next_key(*args):
    return attend_loop(*args, ahead=1)


def merge_added(m1, l1, acc1, m2, l2, acc2):
    return (acc1 + acc2) / (l1 + l2)[:, None]


def splits_floor(block_table, context_len, block_size, num_splits):
    n = -(-context_len // block_size)
    per = max(n // num_splits, 1)
    return [
        (f, block_table[f : min(f + per, n)], min(min(f + per, n) * block_size, context_len) - f * block_size)
        for f in range(0, n, per)
    ]


NAMED = [
    (checks.check_attend_blocks, attend_acc_not_rescaled, "acc is not rescaled when the running max changes"),
    (checks.check_attend_blocks, attend_l_not_rescaled, "l is not rescaled when the running max changes"),
    (checks.check_attend_blocks, attend_sees_next_key, "the mask lets a query see the key after it"),
    (checks.check_merge, merge_added, "the two sides are added without rescaling each to the common max"),
    (checks.check_kv_splits, splits_floor, "per_split is floor(n_blocks / num_splits), not ceil"),
]


@pytest.mark.parametrize(("checker", "wrong", "rule"), NAMED, ids=[w.__name__ for _, w, _ in NAMED])
def test_a_warm_up_mistake_is_named(capsys, checker, wrong, rule):
    checker(wrong)
    lines = graded_lines(capsys)
    assert any(f"({rule}" in line for line in lines if "WRONG" in line), lines
