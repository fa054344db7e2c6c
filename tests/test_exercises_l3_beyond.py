"""The L3 notebook's newer exercises can fail and can pass, in process, without running a notebook.

- L3.5 ``admit_with_watermark`` and L3.6 ``cheapest_preemption`` go beyond the stage: the independent
  answers (``answers.py``) and the reference notebook's solutions pass the visible checks and the
  hidden cases of three seeds; the untouched stub fails both; plausible wrong answers (the running
  requests' growth forgotten or one position late, the watermark off by one; fewest tokens first,
  floor instead of ceil, the wrong tie) fail both, and the visible line names the broken rule. The
  visible references (the stage's ``Scheduler`` on the pool less the watermark; an exhaustive search)
  and the answers agree on many drawn cases.
- L3.7, catch the bug: the answer key's test and the notebook's pass the stage's ``Scheduler`` and
  fail every bug of ``SCHEDULER_BUGS`` (all in the course's mutation list); a weak test is reported
  with the bugs it misses; a test that always raises fails the correct version.
- L3.8, predict: the hand-written answer equals a run of the stage; a wrong prediction fails with
  per-key lines that never print the real value; a prediction that runs the stage is flagged.
- L3.1-L3.4 name the broken rule for the known mistakes (step 2 of issue 37).

No model is loaded; every case runs on a few blocks.
"""

from __future__ import annotations

import random
from bisect import insort
from pathlib import Path

import nbformat
import pytest
from checker_asserts import (
    assert_fails,
    assert_fails_hidden,
    assert_passes,
    graded_lines,
    hidden_problems,
)

from exercises.L3_block_tensor import checks
from key.L3_block_tensor import answers
from kvcourse.engine_config import EngineConfig
from kvcourse.grading import hidden
from kvcourse.grading.mutations import CORRECT, MUTATIONS, version
from L3_block_tensor.allocator import BlockAllocator
from L3_block_tensor.scheduler import Scheduler
from L3_block_tensor.sequence import Sequence, Status

NOTEBOOKS = Path(__file__).resolve().parent.parent / "key" / "notebooks"
PACKAGE = "L3_block_tensor"
SEEDS = (0, 1, 2)


def notebook_solution(name: str):
    """The function ``name`` as the reference notebook defines it (its whole cell, markers and all),
    with what the notebook's earlier cells import."""
    nb = nbformat.read(str(NOTEBOOKS / "L3_block_tensor.ipynb"), as_version=4)
    sources = [c.source for c in nb.cells if c.cell_type == "code" and f"def {name}(" in c.source]
    sources = [s for s in sources if "# BEGIN SOLUTION" in s]
    assert len(sources) == 1, f"{len(sources)} solution cells define {name}"
    namespace = {"Sequence": Sequence, "Status": Status, "insort": insort}
    exec(compile(sources[0], f"L3_block_tensor.ipynb:{name}", "exec"), namespace)  # noqa: S102
    return namespace[name]


def stub(*args):
    raise NotImplementedError("Exercise L3.k: not done yet")


def assert_hidden_passes(exercise_id: str, fn) -> None:
    for seed in SEEDS:
        assert hidden_problems(PACKAGE, exercise_id, fn, seed=seed) == [], (exercise_id, seed)


def named_line(lines: list[str], case_name: str, rule: str) -> str:
    """The line of the case named ``case_name``: WRONG, with ``rule`` in it."""
    found = [line for line in lines if line.startswith("case ") and f"({case_name}): " in line]
    assert found, f"no case {case_name!r} in {lines}"
    assert "WRONG" in found[0] and rule in found[0], found[0]
    return found[0]


# ---------------------------------------------------------------------------------------------------
# L3.5 admission with a watermark


def wm(running, waiting, num_free, block_size, watermark, *, grows=True, late=False, strict=False):
    """admit_with_watermark with one mistake switched on."""
    if watermark < 0 or block_size < 1:
        raise ValueError("bad input")
    new = 0
    if grows:
        new = sum((n if late else n - 1) % block_size == 0 for n in running)
    if new > num_free:
        raise ValueError("no room")
    free, count = num_free - new, 0
    for p in waiting:
        blocks = -(-p // block_size)
        if free - blocks < watermark + strict:
            break
        free, count = free - blocks, count + 1
    return count, free


WATERMARK_WRONG = [
    (
        lambda *a: wm(*a, grows=False),
        "decoders crossing into a new block take theirs first",
        "the running requests grow first",
    ),
    (
        lambda *a: wm(*a, late=True),
        "decoders crossing into a new block take theirs first",
        "off by one: a decoding request needs a block for position num_tokens - 1",
    ),
    (
        lambda *a: wm(*a, strict=True),
        "watermark 2 stops the third prompt",
        "free blocks may come down to the watermark itself",
    ),
]


@pytest.mark.parametrize(("wrong", "case_name", "rule"), WATERMARK_WRONG, ids=["no growth", "late", "strict"])
def test_watermark_wrong_answers_fail_with_their_rule(capsys, wrong, case_name, rule):
    checks.check_watermark(wrong)
    lines = graded_lines(capsys)
    assert_fails(lines, case_name)
    named_line(lines, case_name, rule)
    assert_fails_hidden(PACKAGE, "L3.5", wrong)


@pytest.mark.parametrize("fn", [answers.admit_with_watermark, "notebook"], ids=["answers", "notebook"])
def test_watermark_right_answers_pass(capsys, fn):
    fn = notebook_solution("admit_with_watermark") if fn == "notebook" else fn
    checks.check_watermark(fn)
    assert_passes(graded_lines(capsys))
    assert_hidden_passes("L3.5", fn)


def test_the_stage_and_the_answer_agree_on_watermarks():
    """The visible reference (L3's Scheduler on the pool less the watermark) and the answer's
    arithmetic, on the hidden cases of 30 seeds."""
    for seed in range(30):
        for case in checks.draw_watermarks(hidden.rng_for(seed, "L3.5")):
            args = [case[k] for k in ("running", "waiting", "num_free", "block_size", "watermark")]
            want = checks.returned_or_raised(answers.admit_with_watermark, *args)
            assert checks.scheduler_watermark(*args) == want, case


# ---------------------------------------------------------------------------------------------------
# L3.6 the cheapest preemption


def greedy(computed, need, block_size):
    lost = victims = freed = 0
    if need > sum(-(-c // block_size) for c in computed):
        raise ValueError("too many")
    for c in sorted(computed):
        if freed >= need:
            break
        lost, victims, freed = lost + c, victims + 1, freed + -(-c // block_size)
    return lost, victims


def floor_blocks(computed, need, block_size):
    return answers.cheapest_preemption([c // block_size * block_size for c in computed], need, block_size)


def most_victims(computed, need, block_size):
    """The right tokens, the tie broken towards more victims (one request split into blocks-worth)."""
    best = {0: (0, 0)}
    for c in computed:
        b = -(-c // block_size)
        for have, (lost, n) in list(best.items()):
            key = min(need, have + b)
            option = (lost + c, -(n + 1))
            if key not in best or option < (best[key][0], -best[key][1]):
                best[key] = (option[0], -option[1])
    if need not in best:
        raise ValueError("too many")
    return best[need]


CHEAPEST_WRONG = [
    (greedy, "fewest tokens first is not cheapest", "fewest tokens first is not the cheapest set"),
    (floor_blocks, "partly filled blocks count as blocks", "a partly filled block is held too"),
    (most_victims, "equal tokens lost: the fewest victims", "among sets that lose as few tokens, the fewest"),
]


@pytest.mark.parametrize(("wrong", "case_name", "rule"), CHEAPEST_WRONG, ids=["greedy", "floor", "tie"])
def test_cheapest_preemption_wrong_answers_fail_with_their_rule(capsys, wrong, case_name, rule):
    checks.check_cheapest_preemption(wrong)
    lines = graded_lines(capsys)
    assert_fails(lines, case_name)
    named_line(lines, case_name, rule)
    assert_fails_hidden(PACKAGE, "L3.6", wrong)


@pytest.mark.parametrize("fn", [answers.cheapest_preemption, "notebook"], ids=["answers", "notebook"])
def test_cheapest_preemption_right_answers_pass(capsys, fn):
    fn = notebook_solution("cheapest_preemption") if fn == "notebook" else fn
    checks.check_cheapest_preemption(fn)
    assert_passes(graded_lines(capsys))
    assert_hidden_passes("L3.6", fn)


def test_floats_are_named_as_such(capsys):
    def as_floats(computed, need, block_size):
        lost, victims = answers.cheapest_preemption(computed, need, block_size)
        return float(lost), victims

    checks.check_cheapest_preemption(as_floats)
    named_line(graded_lines(capsys), "one request frees enough", "ints, not floats")
    assert_fails_hidden(PACKAGE, "L3.6", as_floats)


def test_the_exhaustive_search_and_the_answer_agree():
    """Every set of victims tried, against the answer's knapsack, on small random cases."""
    rng = random.Random(37)
    for _ in range(300):
        block_size = rng.choice([1, 2, 3, 4, 8])
        computed = [
            rng.choice([0, rng.randint(0, 40), block_size * rng.randint(1, 3)])
            for _ in range(rng.randint(0, 8))
        ]
        need = rng.randint(0, sum(-(-c // block_size) for c in computed) + 1)
        want = checks.returned_or_raised(answers.cheapest_preemption, computed, need, block_size)
        assert checks.exhaustive_preemption(computed, need, block_size) == want, (computed, need, block_size)


def test_trying_every_set_is_too_slow_for_the_hidden_cases():
    """The hidden cases hold requests by the dozen: 2^40 sets and more."""
    for seed in SEEDS:
        sizes = [len(c["computed"]) for c in checks.draw_preemption_costs(hidden.rng_for(seed, "L3.6"))]
        assert max(sizes) >= 40 and min(sizes) <= 10, sizes


# ---------------------------------------------------------------------------------------------------
# L3.7 catch the bug


def test_the_scheduler_bugs_are_the_mutation_lists():
    names = {m.name for m in MUTATIONS}
    assert set(checks.SCHEDULER_BUGS) <= names and set(checks.SHOWN_BUGS) < set(checks.SCHEDULER_BUGS)
    assert all(m.file == "L3_block_tensor/scheduler.py" for m in MUTATIONS if m.name in checks.SCHEDULER_BUGS)


@pytest.mark.parametrize("fn", [answers.test_scheduler, "notebook"], ids=["answers", "notebook"])
def test_the_answer_keys_test_catches_every_bug(capsys, fn):
    fn = notebook_solution("test_scheduler") if fn == "notebook" else fn
    checks.check_catch_scheduler(fn)
    assert_passes(graded_lines(capsys))
    assert_hidden_passes("L3.7", fn)


def only_max_num_seqs(Scheduler):
    """A weak test: it checks max_num_seqs and nothing else."""
    sched = Scheduler(BlockAllocator(8, 2), EngineConfig(max_num_seqs=1, max_num_batched_tokens=32))
    for i in range(2):
        sched.add(Sequence(i, [5, 6], 2, ignore_eos=True))
    assert [seq.request_id for seq, _ in sched.schedule()] == [0]


def test_a_weak_test_is_told_which_bugs_it_misses(capsys):
    checks.check_catch_scheduler(only_max_num_seqs)
    lines = graded_lines(capsys)
    assert lines[-1] == "1/3 passed", lines
    for bug in checks.SHOWN_BUGS:
        assert f"(bug '{bug}': your test fails): WRONG" in lines[1] + lines[2]
    assert all("WRONG — your test passes the scheduler with this bug" in line for line in lines[1:3])
    problems = hidden_problems(PACKAGE, "L3.7", only_max_num_seqs)
    missed = [bug for bug in checks.SCHEDULER_BUGS if any(f"bug '{bug}'" in p for p in problems)]
    assert missed and "L3 admission ignores max_num_seqs" not in missed, problems
    assert_fails_hidden(PACKAGE, "L3.7", only_max_num_seqs)


def always_fails(Scheduler):
    raise AssertionError("nothing passes")


def test_a_test_that_prints_prints_nothing_into_the_check(capsys):
    def chatty(Scheduler):
        print("debugging")
        answers.test_scheduler(Scheduler)

    checks.check_catch_scheduler(chatty)
    lines = graded_lines(capsys)
    assert "debugging" not in "\n".join(lines)
    assert_passes(lines)


def test_a_test_that_always_raises_fails_the_correct_version(capsys):
    checks.check_catch_scheduler(always_fails)
    lines = graded_lines(capsys)
    assert lines[0].startswith(f"case 1 ({CORRECT} of the scheduler: your test passes): WRONG"), lines
    assert_fails_hidden(PACKAGE, "L3.7", always_fails)


def test_the_stub_fails_the_catch_exercise(capsys):
    checks.check_catch_scheduler(stub)
    lines = graded_lines(capsys)
    assert lines[-1] == "0/3 passed" and all("raised NotImplementedError" in x for x in lines[:-1]), lines
    assert_fails_hidden(PACKAGE, "L3.7", stub)


# ---------------------------------------------------------------------------------------------------
# L3.8 predict


def test_the_hand_written_prediction_is_what_the_stage_does(capsys):
    assert answers.predict() == checks.run_predicted_steps()
    for fn in (answers.predict, notebook_solution("predict")):
        checks.check_predict(fn)
        assert_passes(graded_lines(capsys))
        assert_hidden_passes("L3.8", fn)


def test_a_wrong_prediction_fails_without_the_answer(capsys):
    def wrong():  # a preemption too few: request 1 still running with its blocks
        return {
            "block_tables": [[0, 1, 3], [2, 4], [], []],
            "num_computed_tokens": [6, 5, 2, 0],
            "free_list": [4, 2],
            "running": [0, 1],
            "waiting": [3],
            "finished": [2],
            "num_preemptions": 1,
        }

    checks.check_predict(wrong)
    lines = graded_lines(capsys)
    assert lines[-1] == "1/7 passed", lines
    assert "case 5 (waiting): WRONG — 1 entry: not the number of entries the run gives" in lines
    assert "case 1 (block tables): WRONG — 1 of 4 entries differ" in lines
    assert "case 3 (free list): WRONG — 2 of 2 entries differ" in lines
    assert "case 7 (num preemptions): WRONG — not the number the run gives" in lines
    for line in lines:  # no line shows the real free list, tables or queues
        assert "[2, 4]" not in line and "[0, 1, 3]" not in line and "[1, 3]" not in line
    assert_fails_hidden(PACKAGE, "L3.8", wrong)


def test_a_prediction_that_runs_the_stage_is_flagged(capsys):
    def oracle():
        return checks.run_predicted_steps()

    checks.check_predict(oracle)
    assert_passes(graded_lines(capsys))  # the visible check cannot tell ...
    problems = hidden_problems(PACKAGE, "L3.8", oracle)
    assert any("the answer runs Scheduler.schedule" in p for p in problems), problems  # ... the grader can


def test_the_stub_fails_the_new_exercises(capsys):
    for checker, exercise in (
        (checks.check_watermark, "L3.5"),
        (checks.check_cheapest_preemption, "L3.6"),
        (checks.check_predict, "L3.8"),
    ):
        checker(stub)
        lines = graded_lines(capsys)
        assert lines[-1].startswith("0/"), lines
        assert all("raised NotImplementedError" in line for line in lines[:-1]), lines
        assert_fails_hidden(PACKAGE, exercise, stub)


def test_hidden_cases_differ_between_seeds():
    for exercise in ("L3.5", "L3.6", "L3.7"):
        draw = checks.HIDDEN[exercise].draw
        drawn = [draw(hidden.rng_for(seed, exercise)) for seed in range(6)]
        assert len({repr(d) for d in drawn}) > 1, exercise
    assert checks.HIDDEN["L3.8"].draw(random.Random(0)) == [{}]  # one prediction, the same every run


# ---------------------------------------------------------------------------------------------------
# L3.1-L3.4: the broken rule named


def slots_one_row_off(block_table, start, end, block_size):
    return [block_table[p // block_size] * block_size + (p + 1) % block_size for p in range(start, end)]


def plan_without_seats(running, waiting, budget, chunk, max_num_seqs):
    return answers.plan_step(running, waiting, budget, chunk, len(running) + len(waiting))


def preempt_first(running, waiting, allocator):
    victim = running.pop(0)
    allocator.free(victim.block_table)
    victim.block_table, victim.num_computed_tokens, victim.status = [], 0, Status.WAITING
    insort(waiting, victim, key=Sequence.sort_key)
    return victim


def preempt_keeps_blocks(running, waiting, allocator):
    victim = running.pop()
    victim.num_computed_tokens, victim.status = 0, Status.WAITING
    insort(waiting, victim, key=Sequence.sort_key)
    return victim


def admitted_uncapped(policy, requests, num_blocks, block_size, max_model_len):
    return answers.admitted(policy, requests, num_blocks, block_size, 1 << 30)


NAMED = [
    (checks.check_slots, slots_one_row_off, "one decode token at position 16, block_size 16", "off by one"),
    (
        checks.check_slots,
        slots_one_row_off,
        "block_size 7: positions 6..8 cross a block edge",
        "the row of position p is p % block_size",
    ),
    (
        checks.check_plan_step,
        plan_without_seats,
        "max_num_seqs stops admission",
        "more than max_num_seqs requests run",
    ),
    (
        checks.check_preempt,
        preempt_first,
        "three decoding, equal priority: the newest goes",
        "the victim is the least important running request",
    ),
    (
        checks.check_preempt,
        preempt_keeps_blocks,
        "the worked example: two running, free list [5]",
        "preemption keeps the blocks of the victim",
    ),
    (
        checks.check_admitted,
        admitted_uncapped,
        "pow2 never past max_model_len",
        "Pow2 is capped at max_model_len",
    ),
]


@pytest.mark.parametrize(
    ("checker", "wrong", "case_name", "rule"),
    NAMED,
    ids=[f"{w.__name__}-{i}" for i, (_, w, _, _) in enumerate(NAMED)],
)
def test_warm_up_checks_name_the_broken_rule(capsys, checker, wrong, case_name, rule):
    checker(wrong)
    named_line(graded_lines(capsys), case_name, rule)


def test_the_new_mutation_breaks_max_num_seqs():
    """The new mutation names a test of the course's that fails on it (``make mutants`` runs it)."""
    bug = next(m for m in MUTATIONS if m.name == "L3 admission ignores max_num_seqs")
    assert bug.tests == ("tests/test_l3.py::test_max_num_seqs_caps_the_running_set",)
    one_seat = EngineConfig(max_num_seqs=1, max_num_batched_tokens=32)
    sched = version(checks.SCHEDULER, bug.name)(BlockAllocator(8, 2), one_seat)
    for i in range(2):
        sched.add(Sequence(i, [5, 6], 2, ignore_eos=True))
    assert len(sched.schedule()) == 2  # the bug: both run with one seat
    real = Scheduler(BlockAllocator(8, 2), one_seat)
    for i in range(2):
        real.add(Sequence(i, [5, 6], 2, ignore_eos=True))
    assert len(real.schedule()) == 1
