"""Hidden cases (kvcourse/grading/hidden.py) of every exercise: drawn, observed and judged as make grade does.

For each exercise of each exercise notebook:

- it has hidden cases (``HIDDEN`` in its stage's ``exercises/LN_*/checks.py``) and an independent
  answer (``EXPECT`` in ``key/LN_*/answers.py``), at least 4 cases that change with the seed (a
  prediction's fixed sequence of operations excepted);
- where the stage implements what the exercise asks (every kind but some exercises beyond the stage),
  the stage's own implementation agrees with that answer on cases drawn from several seeds, so the
  two implementations hold each other in check;
- an answer that calls the stage's own implementation is caught by the hidden cases' watch;
- with the stage's own implementation broken (a mutant), the independent answer still passes and a
  wrong answer still fails: the verdict does not depend on the code the exercise re-implements.

An exercise whose check cell passes more than the function (L1.2's ``engine``) gets those objects
from ``CONTEXT`` in its stage's answers module, built once per test process. The stage's own code in the
learner's signature comes from ``STAGE_ADAPTERS`` there, where the two differ.
"""

from __future__ import annotations

import functools
import inspect
import json

import pytest

from kvcourse.grading import exercises, hidden
from kvcourse.grading.gradebook import exercises_of, known_exercises
from kvcourse.harness.stages import STAGES

SEEDS = range(5)


EXERCISES = [(STAGES[ex.split(".")[0]], ex) for ex in known_exercises()]  # (stage package, exercise id)
KINDS = {
    ex: kind
    for ref in exercises.reference_notebooks()
    for ex, kind in exercises.kinds(exercises.read(ref)).items()
}


def spec(package: str, exercise_id: str) -> hidden.Hidden:
    return hidden.checks_of(package).HIDDEN[exercise_id]


def has_stage_code(package: str, exercise_id: str) -> bool:
    """Whether the hidden cases watch for stage code (a beyond-the-stage exercise may have none)."""
    return bool(spec(package, exercise_id).answers)


def adapted(package: str, exercise_id: str) -> bool:
    return exercise_id in getattr(hidden.answers_of(package), "STAGE_ADAPTERS", {})


# the exercises the stage's own code answers: every warm-up, catch-the-bug (an oracle test) and prediction
# (the operations run), and the exercises beyond the stage that the stage can answer through an adapter
STAGED = [
    (package, ex)
    for package, ex in EXERCISES
    if has_stage_code(package, ex) and (KINDS[ex] != "beyond the stage" or adapted(package, ex))
]


def stage_function(package: str, exercise_id: str):
    """The stage's own implementation, in the learner's signature (``STAGE_ADAPTERS`` of the stage's
    answers module where the signatures differ)."""
    adapters = getattr(hidden.answers_of(package), "STAGE_ADAPTERS", {})
    if exercise_id in adapters:
        return adapters[exercise_id]
    return hidden.resolve(spec(package, exercise_id).answers[0])[2]


@functools.cache
def context(package: str, exercise_id: str) -> tuple:
    """What the exercise's check cell passes after the function (L1.2's engine), built once: the
    ``CONTEXT`` of the stage's answers module, or nothing."""
    made = getattr(hidden.answers_of(package), "CONTEXT", {}).get(exercise_id)
    return made() if made else ()


def harvested(package: str, exercise_id: str, fn, seed: int, tmp_path, *context) -> dict:
    out = tmp_path / f"{exercise_id}-{seed}.json"
    hidden.harvest(package, exercise_id, fn, *context, seed=seed, out=str(out))
    return json.loads(out.read_text())


@pytest.mark.parametrize(("package", "exercise_id"), EXERCISES)
def test_every_exercise_has_hidden_cases_and_an_answer(package, exercise_id):
    answers = hidden.answers_of(package)
    assert exercise_id in answers.EXPECT
    if KINDS[exercise_id] != "beyond the stage":  # the others rebuild, test or run the stage's code
        assert has_stage_code(package, exercise_id), "no stage implementation named for the watch"
    cases = spec(package, exercise_id).draw(hidden.rng_for(0, exercise_id))
    if KINDS[exercise_id] == "predict":  # one fixed sequence of operations, whatever the seed
        assert cases, "no case"
        return
    assert len(cases) >= 4
    assert cases != spec(package, exercise_id).draw(hidden.rng_for(1, exercise_id)), (
        "the seed changes nothing"
    )


@pytest.mark.parametrize(("package", "exercise_id"), STAGED)
def test_the_stage_agrees_with_the_independent_answer(package, exercise_id):
    hid, fn = spec(package, exercise_id), stage_function(package, exercise_id)
    for seed in SEEDS:
        cases, wants = hidden.expected(package, exercise_id, seed)
        for case, want in zip(cases, wants, strict=True):
            got = hidden.to_json(hid.observe(fn, case, *context(package, exercise_id)))
            assert hidden.compare(want, got, hid.atol) is None, (seed, hid.describe(case))


@pytest.mark.parametrize(("package", "exercise_id"), STAGED)
def test_an_answer_that_runs_the_stage_code_is_caught(package, exercise_id, tmp_path):
    fn = stage_function(package, exercise_id)
    record = harvested(package, exercise_id, fn, 0, tmp_path, *context(package, exercise_id))
    assert record["aliased"], record
    assert hidden.judge(package, exercise_id, 0, record), "an aliased answer was not failed"


@pytest.mark.parametrize(("package", "exercise_id"), EXERCISES)
def test_a_broken_stage_changes_no_verdict(package, exercise_id, tmp_path, monkeypatch):
    answers = hidden.answers_of(package)
    for target in spec(package, exercise_id).answers:  # the mutant: the stage's own code raises
        owner, name, _ = hidden.resolve(target)
        monkeypatch.setattr(owner, name, lambda *a, **k: (_ for _ in ()).throw(RuntimeError("mutant")))
    extra = context(package, exercise_id)
    right = harvested(package, exercise_id, answers.ANSWERS[exercise_id], 0, tmp_path, *extra)
    assert hidden.judge(package, exercise_id, 0, right) == []
    wrong = harvested(package, exercise_id, lambda *a, **k: None, 1, tmp_path, *extra)
    assert hidden.judge(package, exercise_id, 1, wrong)


def test_judge_names_the_first_difference():
    want = [{"call": "alloc_blocks(2)", "returned": [0, 1], "free": [2]}]
    got = [{"call": "alloc_blocks(2)", "returned": [1, 0], "free": [2]}]
    assert hidden.compare(want, got) == "after alloc_blocks(2): returned is [1, 0], expected [0, 1]"
    assert hidden.compare([0.5, 1.0], [0.5, 1.0 + 1e-7], atol=1e-6) is None
    assert hidden.compare([0.5], [float("nan")], atol=1.0) is not None
    assert hidden.compare({"a": 1}, {"a": True}) is not None


def test_a_case_that_never_ends_is_stopped(tmp_path):
    def forever(self, n):
        while True:
            pass

    out = tmp_path / "forever.json"
    hidden.harvest("L2_token_flat", "L2.1", forever, seed=0, out=str(out), seconds=1)
    record = json.loads(out.read_text())
    assert record["observations"] == [{"error": "CaseTimeout: the hidden cases ran past their 1 s"}]


def specified_errors() -> list[tuple[str, str, str]]:
    """(package, exercise id, its check cell's checker) of every exercise whose text asks for a ValueError."""
    found = []
    for path in sorted(exercises.NOTEBOOKS.glob("L[0-9]*_*.ipynb")):
        nb = exercises.read(path)
        for ex in exercises_of(nb):
            text = "\n".join(c.source for c in nb.cells[ex.first : ex.check + 1])
            if "ValueError" in text:
                checker = nb.cells[ex.check].source.split("checks.")[1].split("(")[0]
                found.append((STAGES[ex.exercise_id.split(".")[0]], ex.exercise_id, checker))
    return found


@pytest.mark.parametrize(("package", "exercise_id", "checker"), specified_errors())
def test_every_specified_error_is_a_case(package, exercise_id, checker):
    """An exercise whose text asks for a ValueError has a case that expects one: among its hidden cases
    (the independent answer raises it for some draw of a few seeds), or in its check cell's checker."""
    hidden_errors = any(
        "ValueError" in json.dumps(want) for seed in range(3) for want in hidden.expected(package, exercise_id, seed)[1]
    )
    shown = "ValueError" in inspect.getsource(getattr(hidden.checks_of(package), checker))
    assert hidden_errors or shown, f"{exercise_id}: its text asks for ValueError, no case expects one"


def test_l3_7_has_a_case_for_each_error_its_text_names():
    """L3.7 asks for ValueError on need above everything held, block_size below 1, a negative need, a
    negative count in computed: each is a hidden case for every seed, and an answer that checks only
    the first fails."""
    for seed in range(5):
        cases = spec("L3_block_tensor", "L3.7").draw(hidden.rng_for(seed, "L3.7"))
        assert any(c["block_size"] < 1 for c in cases) and any(c["need"] < 0 for c in cases), seed
        assert any(min(c["computed"]) < 0 for c in cases), seed
    answer = hidden.answers_of("L3_block_tensor").cheapest_preemption

    def lenient(computed, need, block_size):
        try:
            return answer(computed, need, block_size)
        except ValueError:
            if block_size < 1 or need < 0 or min(computed) < 0:
                return (0, 0)
            raise

    observations, caught = hidden.observe_all(
        spec("L3_block_tensor", "L3.7"), lenient, (), hidden.expected("L3_block_tensor", "L3.7", 0)[0], 60
    )
    record = {"observations": observations, "aliased": caught}
    assert len(hidden.judge("L3_block_tensor", "L3.7", 0, record)) == 3


def test_the_watch_knows_the_stage_code_by_what_it_is(tmp_path):
    """L2.1 answered by L3's ``alloc_blocks`` (another stage's identical copy) or by L2's own source
    ``exec``'d under another file name is caught; a copy with a local renamed is the learner's."""
    import inspect
    import re
    import textwrap

    from L2_token_flat.allocator import BlockAllocator
    from L3_block_tensor.allocator import BlockAllocator as Later

    source = textwrap.dedent(inspect.getsource(BlockAllocator.alloc_blocks))
    namespace = dict(vars(inspect.getmodule(BlockAllocator)))
    exec(compile(source, "<a copy>", "exec"), namespace)  # noqa: S102
    renamed = dict(vars(inspect.getmodule(BlockAllocator)))
    exec(compile(re.sub(r"\bblocks\b", "handed", source), "<a copy>", "exec"), renamed)  # noqa: S102
    target = "L2_token_flat.allocator:BlockAllocator.alloc_blocks"
    for fn, caught in ((Later.alloc_blocks, True), (namespace["alloc_blocks"], True), (renamed["alloc_blocks"], False)):
        record = harvested("L2_token_flat", "L2.1", fn, 0, tmp_path)
        assert (record["aliased"] == [target]) is caught, (fn, record["aliased"])


def test_refactored_versions_run_alike_and_read_differently():
    """A catch-the-bug exercise's hidden versions: the same behaviour as the stage's code, other code
    (bytecode, names), another listing for each salt."""
    import dis

    from kvcourse.grading import mutations

    target = "L2_token_flat.allocator:BlockAllocator"
    plain, one, two = (mutations.version(target, None, salt) for salt in (None, 1, 2))
    for cls in (plain, one, two):
        a = cls(5, 2)
        assert a.alloc_blocks(2) == [0, 1] and (a.free([0]) or list(a.free_blocks)) == [2, 3, 4, 0]
    listing = [[(i.opname, i.argrepr) for i in dis.get_instructions(c.alloc_blocks)] for c in (plain, one, two)]
    assert listing[0] != listing[1] != listing[2]
    assert hidden.fingerprint(plain.alloc_blocks.__code__) != hidden.fingerprint(one.alloc_blocks.__code__)
