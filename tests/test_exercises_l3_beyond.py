"""The L3 notebook's newer exercises can fail and can pass, in process, without running a notebook.

- L3.5 ``buddy_waits`` goes beyond the stage: the independent answer (a bitmap) and the reference
  notebook's solution pass the visible check and the hidden cases of three seeds; wrong answers, each
  one rule of the buddy allocator broken (the lowest free run, no merging, no power of two, no
  alignment, no contiguity, paging, jumping the queue), fail both and the visible line names the
  rule; the visible reference (L3's ``Scheduler`` over the engine's buddy allocator) and the answer
  agree on the notebook's worked example, on many drawn cases and on pools of every size up to 70;
  the hidden cases always hold external fragmentation; an answer that runs the buddy allocator is
  flagged.
- L3.6 ``admit_with_watermark`` and L3.7 ``cheapest_preemption`` go beyond the stage: the independent
  answers (``answers.py``) and the reference notebook's solutions pass the visible checks and the
  hidden cases of three seeds; the untouched stub fails both; plausible wrong answers (the running
  requests' growth forgotten or one position late, the watermark off by one; fewest tokens first,
  floor instead of ceil, the wrong tie) fail both, and the visible line names the broken rule. The
  visible references (the stage's ``Scheduler`` on the pool less the watermark; an exhaustive search)
  and the answers agree on many drawn cases.
- L3.8, catch the bug: the answer key's test and the notebook's pass the stage's ``Scheduler`` and
  fail every bug of ``SCHEDULER_BUGS`` (all in the course's mutation list); a weak test is reported
  with the bugs it misses; a test that always raises fails the correct version.
- L3.9, predict: the hand-written answer equals a run of the stage; a wrong prediction fails with
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
# L3.5 external fragmentation in a buddy pool


def runs_model(num_blocks, events, *, smallest=True, merge=True, rounded=True, in_order=True):
    """buddy_waits with one mistake switched on: the free run with the lowest first block instead of the
    smallest (``smallest=False``), runs given back never merged (``merge=False``), free blocks counted as
    if a request held only its n blocks (``rounded=False``), a request that does not fit skipped
    (``in_order=False``)."""
    free_runs, start = {}, 0
    while start < num_blocks:
        free_runs[start] = 1 << ((num_blocks - start).bit_length() - 1)
        start += free_runs[start]
    held, queue, trace, arrived = {}, [], [], 0

    def take(n):
        size = 1 << (n - 1).bit_length()
        fits = sorted((run if smallest else 0, first, run) for first, run in free_runs.items() if run >= size)
        if not fits:
            return None
        _, first, run = fits[0]
        del free_runs[first]
        while run > size:
            run //= 2
            free_runs[first + run] = run
        return first, size, n

    for kind, value in events:
        if kind == "arrive":
            queue.append((arrived, value))
            arrived += 1
        elif value in held:
            first, size, _ = held.pop(value)
            while merge and free_runs.get(first ^ size) == size:
                del free_runs[first ^ size]
                first, size = min(first, first ^ size), 2 * size
            free_runs[first] = size
        else:
            queue = [(r, n) for r, n in queue if r != value]
        for r, n in list(queue):
            run = take(n)
            if run is None and in_order:
                break
            if run is not None:
                held[r] = run
                queue.remove((r, n))
        free = sum(free_runs.values()) + (0 if rounded else sum(size - n for _, size, n in held.values()))
        trace.append(([r for r, _ in queue], free, max(free_runs.values(), default=0)))
    return trace


def counting_model(num_blocks, events, *, rounded=True, aligned=True):
    """buddy_waits without runs: a request is admitted when its next_pow2(n) blocks (n blocks, with
    ``rounded=False``: paging) are free anywhere; or, with ``aligned=False``, when that many are free in a
    row, wherever the row starts."""
    owner, queue, trace, arrived = [None] * num_blocks, [], [], 0

    def take(r, n):
        size = 1 << (n - 1).bit_length() if rounded else n
        free = [b for b, o in enumerate(owner) if o is None]
        if aligned:
            chosen = free[:size] if len(free) >= size else None
        else:
            starts = [b for b in range(num_blocks - size + 1) if all(o is None for o in owner[b : b + size])]
            chosen = list(range(starts[0], starts[0] + size)) if starts else None
        if chosen is None:
            return False
        for b in chosen:
            owner[b] = r
        return True

    for kind, value in events:
        if kind == "arrive":
            queue.append((arrived, value))
            arrived += 1
        else:
            owner = [None if o == value else o for o in owner]
            queue = [(r, n) for r, n in queue if r != value]
        while queue and take(*queue[0]):
            queue.pop(0)
        free = owner.count(None)
        trace.append(([r for r, _ in queue], free, free))
    return trace


def arrive(*sizes):
    return [("arrive", n) for n in sizes]


def finish(*ids):
    return [("finish", r) for r in ids]


BUDDY_WRONG = [
    (
        lambda nb, ev: runs_model(nb, ev, smallest=False),
        "the smallest free run that holds it, not the first",
        "the smallest free run that holds the request",
    ),
    (
        lambda nb, ev: runs_model(nb, ev, merge=False),
        "runs given back merge with their buddies, up to the whole pool",
        "a run given back merges with its buddy",
    ),
    (
        lambda nb, ev: runs_model(nb, ev, rounded=False),
        "a request of 5 blocks takes a run of 8",
        "n blocks take a run of next_pow2(n) blocks",
    ),
    (
        lambda nb, ev: runs_model(nb, ev, in_order=False),
        "first come, first served: a request of 1 waits behind one of 8",
        "nobody jumps the queue",
    ),
    (
        lambda nb, ev: counting_model(nb, ev, aligned=False),
        "blocks 2..5 are free, yet no run of 4 is",
        "a run starts at a multiple of its size",
    ),
    (
        lambda nb, ev: counting_model(nb, ev),
        "4 blocks free in two pieces: a request of 4 waits",
        "counted free blocks without contiguity",
    ),
    (
        lambda nb, ev: counting_model(nb, ev, rounded=False),
        "the worked example: 3 blocks free, a request of 3 waits",
        "that is paging",
    ),
]
BUDDY_IDS = ["lowest run", "no merge", "unrounded", "jumps", "unaligned", "loose blocks", "paging"]


@pytest.mark.parametrize(("wrong", "case_name", "rule"), BUDDY_WRONG, ids=BUDDY_IDS)
def test_buddy_wrong_answers_fail_with_their_rule(capsys, wrong, case_name, rule):
    checks.check_buddy_waits(wrong)
    lines = graded_lines(capsys)
    assert_fails(lines, case_name)
    named_line(lines, case_name, rule)
    assert_fails_hidden(PACKAGE, "L3.5", wrong)


@pytest.mark.parametrize("fn", [answers.buddy_waits, "notebook"], ids=["answers", "notebook"])
def test_buddy_right_answers_pass(capsys, fn):
    fn = notebook_solution("buddy_waits") if fn == "notebook" else fn
    checks.check_buddy_waits(fn)
    assert_passes(graded_lines(capsys))
    assert_hidden_passes("L3.5", fn)


def test_the_notebooks_worked_example():
    """The table in the notebook, worked by hand: 8 blocks, arrive 3, 1, 3, then 0 and 1 finish."""
    events = arrive(3, 1, 3) + finish(0, 1)
    by_hand = [([], 4, 4), ([], 3, 2), ([2], 3, 2), ([], 3, 2), ([], 4, 4)]
    assert checks.scheduler_buddy_waits(8, events) == by_hand
    assert [(list(w), f, x) for w, f, x in answers.buddy_waits(8, events)] == by_hand
    assert [w for w, _, _ in counting_model(8, events, rounded=False)] == [[], [], [], [], []]  # paging


def test_the_stage_and_the_answer_agree_on_buddy_pools():
    """The visible reference (L3's Scheduler over the engine's buddy allocator) and the answer's bitmap,
    on the hidden cases of 30 seeds and on random pools of every size from 1 to 70 blocks."""
    for seed in range(30):
        for case in checks.draw_buddy_traces(hidden.rng_for(seed, "L3.5")):
            events = [tuple(e) for e in case["events"]]
            want = [(list(w), f, x) for w, f, x in answers.buddy_waits(case["num_blocks"], events)]
            assert checks.scheduler_buddy_waits(case["num_blocks"], events) == want, case
    rng = random.Random(35)
    for num_blocks in range(1, 71):
        largest = 1 << (num_blocks.bit_length() - 1)
        events, alive = [], []
        for _ in range(40):
            if alive and rng.random() < 0.45:
                events.append(("finish", alive.pop(rng.randrange(len(alive)))))
            else:
                alive.append(sum(kind == "arrive" for kind, _ in events))
                events.append(("arrive", rng.randint(1, largest)))
        want = [(list(w), f, x) for w, f, x in answers.buddy_waits(num_blocks, events)]
        assert checks.scheduler_buddy_waits(num_blocks, events) == want, (num_blocks, events)


def test_the_hidden_buddy_cases_show_external_fragmentation():
    """Every seed draws a case where a request waits though its run's blocks are free (the aimed one)."""
    for seed in SEEDS:
        stuck = 0
        for case in checks.draw_buddy_traces(hidden.rng_for(seed, "L3.5")):
            sizes = [n for kind, n in case["events"] if kind == "arrive"]
            trace = answers.buddy_waits(case["num_blocks"], [tuple(e) for e in case["events"]])
            runs = [1 << (sizes[w[0]] - 1).bit_length() if w else 0 for w, _, _ in trace]  # the first waiter's
            stuck += sum(1 for (w, free, largest), run in zip(trace, runs, strict=True) if w and largest < run <= free)
        assert stuck, seed


def test_a_malformed_buddy_answer_is_told_so(capsys):
    checks.check_buddy_waits(lambda num_blocks, events: [([], 0)] * len(events))
    lines = graded_lines(capsys)
    assert lines[-1] == "0/9 passed", lines
    assert all("expected a list of" in line for line in lines[:-1]), lines
    assert_fails_hidden(PACKAGE, "L3.5", lambda num_blocks, events: None)


def test_an_answer_that_runs_the_buddy_allocator_is_flagged():
    def borrowed(num_blocks, events):
        return checks.scheduler_buddy_waits(num_blocks, events)

    problems = hidden_problems(PACKAGE, "L3.5", borrowed)
    assert any("the answer runs BuddyAllocator" in p for p in problems), problems


# ---------------------------------------------------------------------------------------------------
# L3.6 admission with a watermark


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
    assert_fails_hidden(PACKAGE, "L3.6", wrong)


@pytest.mark.parametrize("fn", [answers.admit_with_watermark, "notebook"], ids=["answers", "notebook"])
def test_watermark_right_answers_pass(capsys, fn):
    fn = notebook_solution("admit_with_watermark") if fn == "notebook" else fn
    checks.check_watermark(fn)
    assert_passes(graded_lines(capsys))
    assert_hidden_passes("L3.6", fn)


def test_the_stage_and_the_answer_agree_on_watermarks():
    """The visible reference (L3's Scheduler on the pool less the watermark) and the answer's
    arithmetic, on the hidden cases of 30 seeds."""
    for seed in range(30):
        for case in checks.draw_watermarks(hidden.rng_for(seed, "L3.6")):
            args = [case[k] for k in ("running", "waiting", "num_free", "block_size", "watermark")]
            want = checks.returned_or_raised(answers.admit_with_watermark, *args)
            assert checks.scheduler_watermark(*args) == want, case


# ---------------------------------------------------------------------------------------------------
# L3.7 the cheapest preemption


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
    assert_fails_hidden(PACKAGE, "L3.7", wrong)


@pytest.mark.parametrize("fn", [answers.cheapest_preemption, "notebook"], ids=["answers", "notebook"])
def test_cheapest_preemption_right_answers_pass(capsys, fn):
    fn = notebook_solution("cheapest_preemption") if fn == "notebook" else fn
    checks.check_cheapest_preemption(fn)
    assert_passes(graded_lines(capsys))
    assert_hidden_passes("L3.7", fn)


def test_floats_are_named_as_such(capsys):
    def as_floats(computed, need, block_size):
        lost, victims = answers.cheapest_preemption(computed, need, block_size)
        return float(lost), victims

    checks.check_cheapest_preemption(as_floats)
    named_line(graded_lines(capsys), "one request frees enough", "ints, not floats")
    assert_fails_hidden(PACKAGE, "L3.7", as_floats)


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
        sizes = [len(c["computed"]) for c in checks.draw_preemption_costs(hidden.rng_for(seed, "L3.7"))]
        assert max(sizes) >= 40 and min(sizes) <= 10, sizes


# ---------------------------------------------------------------------------------------------------
# L3.8 catch the bug


def test_the_scheduler_bugs_are_the_mutation_lists():
    names = {m.name for m in MUTATIONS}
    assert set(checks.SCHEDULER_BUGS) <= names and set(checks.SHOWN_BUGS) < set(checks.SCHEDULER_BUGS)
    assert all(m.file == "L3_block_tensor/scheduler.py" for m in MUTATIONS if m.name in checks.SCHEDULER_BUGS)


@pytest.mark.parametrize("fn", [answers.test_scheduler, "notebook"], ids=["answers", "notebook"])
def test_the_answer_keys_test_catches_every_bug(capsys, fn):
    fn = notebook_solution("test_scheduler") if fn == "notebook" else fn
    checks.check_catch_scheduler(fn)
    assert_passes(graded_lines(capsys))
    assert_hidden_passes("L3.8", fn)


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
    problems = hidden_problems(PACKAGE, "L3.8", only_max_num_seqs)
    missed = [bug for bug in checks.SCHEDULER_BUGS if any(f"bug '{bug}'" in p for p in problems)]
    assert missed and "L3 admission ignores max_num_seqs" not in missed, problems
    assert_fails_hidden(PACKAGE, "L3.8", only_max_num_seqs)


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
    assert_fails_hidden(PACKAGE, "L3.8", always_fails)


def test_the_stub_fails_the_catch_exercise(capsys):
    checks.check_catch_scheduler(stub)
    lines = graded_lines(capsys)
    assert lines[-1] == "0/3 passed" and all("raised NotImplementedError" in x for x in lines[:-1]), lines
    assert_fails_hidden(PACKAGE, "L3.8", stub)


# ---------------------------------------------------------------------------------------------------
# L3.9 predict


def test_the_hand_written_prediction_is_what_the_stage_does(capsys):
    assert answers.predict() == checks.run_predicted_steps()
    for fn in (answers.predict, notebook_solution("predict")):
        checks.check_predict(fn)
        assert_passes(graded_lines(capsys))
        assert_hidden_passes("L3.9", fn)


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
    assert_fails_hidden(PACKAGE, "L3.9", wrong)


def test_a_prediction_that_runs_the_stage_is_flagged(capsys):
    def oracle():
        return checks.run_predicted_steps()

    checks.check_predict(oracle)
    assert_passes(graded_lines(capsys))  # the visible check cannot tell ...
    problems = hidden_problems(PACKAGE, "L3.9", oracle)
    assert any("the answer runs Scheduler.schedule" in p for p in problems), problems  # ... the grader can


def test_the_stub_fails_the_new_exercises(capsys):
    for checker, exercise in (
        (checks.check_buddy_waits, "L3.5"),
        (checks.check_watermark, "L3.6"),
        (checks.check_cheapest_preemption, "L3.7"),
        (checks.check_predict, "L3.9"),
    ):
        checker(stub)
        lines = graded_lines(capsys)
        assert lines[-1].startswith("0/"), lines
        assert all("raised NotImplementedError" in line for line in lines[:-1]), lines
        assert_fails_hidden(PACKAGE, exercise, stub)


def test_hidden_cases_differ_between_seeds():
    for exercise in ("L3.5", "L3.6", "L3.7", "L3.8"):
        draw = checks.HIDDEN[exercise].draw
        drawn = [draw(hidden.rng_for(seed, exercise)) for seed in range(6)]
        assert len({repr(d) for d in drawn}) > 1, exercise
    assert checks.HIDDEN["L3.9"].draw(random.Random(0)) == [{}]  # one prediction, the same every run


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


def admitted_old_pow2(policy, requests, num_blocks, block_size, max_model_len):
    """Pow2 as the course had it: next_pow2(prompt + output), capped; that is Oracle on that length."""
    if policy == "pow2":
        policy = "oracle"
        requests = [(p, min(1 << (p + o - 1).bit_length(), max_model_len) - p) for p, o in requests]
    return answers.admitted(policy, requests, num_blocks, block_size, max_model_len)


def admitted_loose(policy, requests, num_blocks, block_size, max_model_len):
    """An Orca reservation as loose blocks: on_demand's arithmetic on a prompt as long as the reservation."""
    if policy == "oracle":
        policy, requests = "on_demand", [(p + o, o) for p, o in requests]
    return answers.admitted(policy, requests, num_blocks, block_size, max_model_len)


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
    (
        checks.check_admitted,
        admitted_old_pow2,
        "pow2 rounds the output only: 6 + 16 positions",
        "Pow2 rounds the output only",
    ),
    (
        checks.check_admitted,
        admitted_loose,
        "oracle: 10 positions are 3 blocks, a run of 4",
        "an Orca reservation is one run of a power of two of blocks",
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
