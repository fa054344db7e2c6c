"""Hidden cases: what ``make grade`` checks beyond the cases a notebook shows.

A check cell prints its fixed cases, and the exercise notebook stores what it must print; printing
that text is not solving the exercise. So the grader also draws cases the notebook never shows, from
a seed it picks per run, and judges them outside the learner's process:

1. in a fresh sandboxed process that runs no cell of the notebook (``kvcourse/grading/isolated.py``:
   the learner's definitions only, one child process per exercise), ``observe_all`` calls the
   learner's function on each case drawn from the seed and keeps only what came back (an
   *observation*: plain values, no pickles), which reach the grader on a pipe of their own
   (``harvest`` does the same in the caller's process, for tests);
2. in the grader's own process, which never ran the learner's code, ``expected`` draws the same cases
   and observes the stage's independent answer (``key/LN_*/answers.py``: a second implementation
   written apart from the stage's, never the stage function the exercise re-implements), and
   ``compare`` tells the first difference.

Each stage declares its exercises' hidden cases in ``exercises/LN_*/checks.py`` as ``HIDDEN = {"L2.1":
Hidden(...)}`` and their answers in ``key/LN_*/answers.py`` as ``EXPECT = {"L2.1": callable(case) ->
observation}``. A stage is named by its package (``"L2_token_flat"``): its checkers are the module
``exercises.L2_token_flat.checks``, its answers ``key.L2_token_flat.answers`` (``checks_of``, ``answers_of``).
A ``Hidden`` holds:

- ``draw(rng) -> [case, ...]``: JSON-able inputs, from a ``random.Random``;
- ``observe(fn, case, *context) -> observation``: runs ``fn`` on one case. ``context`` is what the
  check cell passes after the function (L1.2's ``engine``), so the learner's function meets the same
  objects as in the visible check;
- ``describe(case) -> str``: the case in words, for the report;
- ``answers``: the stage's own implementation of the exercise, as ``"module:Qualified.name"``. While
  the learner's function runs on hidden cases, a profile hook watches for their code running
  (``watching``), known by its ``fingerprint`` (what the code is, not the file it lives in), so an
  answer that calls, aliases or copies the stage's code (``alloc_blocks = BlockAllocator.alloc_blocks``,
  a later stage's byte-identical copy, the source ``exec``'d) is caught however it got hold of it,
  and the grader flags it instead of crediting it. ``observe`` itself must not run them. A dict constant (L6's
  ``SPECS``) is caught when one of its values is used;
- ``atol``: the tolerance for floats (online softmax against a dense one), else exact;
- ``explain(want, got)``: what the report says of a difference, when ``compare``'s "got X, expected Y"
  would say too much (``unrevealed``: a prediction's answer) or too little (a catch-the-bug verdict).

Observations are lists of steps, each a dict (``{"call": "alloc_blocks(2)", "returned": [0, 1],
"free": [2, 3]}``), or any JSON value; ``compare`` names the first step and key that differ.

Left out on purpose: hiding the cases from a learner who reads this file (the seed changes per run;
what is drawn is not secret, what the answer is must be computed), and partial credit.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import json
import math
import os
import random
import sys
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcourse.grading import cases
from kvcourse.grading.cases import first_line

SECONDS = 60  # the time all of an exercise's hidden cases may take in the learner's kernel


@dataclass(frozen=True)
class Hidden:
    """One exercise's hidden cases (see the module docstring)."""

    draw: Callable[[random.Random], list[dict]]
    observe: Callable[..., Any]
    describe: Callable[[dict], str]
    answers: tuple[str, ...] = ()
    atol: float = 0.0
    explain: Callable[[Any, Any], str | None] | None = None  # (want, got) -> what differs; default compare


class CaseTimeout(Exception):
    """The hidden cases ran past their time."""


def rng_for(seed: int, exercise_id: str) -> random.Random:
    """The generator an exercise's cases are drawn from: the same in the kernel and in the grader.

    Example: ``rng_for(7, "L2.1").random()`` is the same number in every process.
    """
    return random.Random(f"{seed}:{exercise_id}")


def resolve(target: str):
    """``"pkg.module:Class.method"`` -> (owner object, attribute name, the function found there)."""
    module_name, _, qualname = target.partition(":")
    owner = importlib.import_module(module_name)
    *path, name = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, name, getattr(owner, name)


def fingerprint(code, _code_type=types.CodeType, _tuple=tuple, _type=type, _repr=repr) -> tuple:
    """What a code object is, wherever it was compiled: its bytecode, names, local names and
    constants (nested code objects by their own fingerprint), not its file, line numbers, qualified
    name or docstring (a method copied out of its class is dedented, and its docstring with it). Two copies of a function, in two files, in an ``exec``'d string, or in a later
    stage's byte-identical file, have the same fingerprint; renaming a local variable changes it.
    Builtins it uses are bound when it is defined (a learner's code may rebind ``builtins``)."""
    consts = _tuple(
        fingerprint(c) if _type(c) is _code_type else (_type(c).__name__, _repr(c)) for c in code.co_consts
    )
    if consts and consts[0][0] in ("str", "NoneType"):  # a function's docstring, or None without one
        consts = (("doc", ""), *consts[1:])
    return (code.co_code, code.co_names, code.co_varnames, code.co_argcount, code.co_kwonlyargcount, consts)


def code_of(target: str):
    """The code object of ``target``'s function (a property's getter), or None for a constant."""
    *_, value = resolve(target)
    value = getattr(value, "fget", value)
    return getattr(getattr(value, "__func__", value), "__code__", None)


class AliasedAnswer(Exception):
    """Raised when the answer uses a value of a watched constant (see ``Tripped``)."""


class Tripped:
    """What each value of a watched constant (a dict, such as L6's ``SPECS``) is while the hidden cases
    run: reading an attribute of it, or iterating it, records the target in ``caught`` and raises (a
    constant runs no code a profile hook could see)."""

    def __init__(self, target: str, caught: list[str]):
        self.__dict__.update(_target=target, _caught=caught)

    def _trip(self):
        self._caught.append(self._target)
        raise AliasedAnswer(f"the answer uses the stage's own {self._target.partition(':')[2]}")

    def __getattr__(self, name):
        self._trip()

    def __iter__(self):
        self._trip()


@contextlib.contextmanager
def watching(targets: tuple[str, ...], caught: list[str], fd: int | None = None):
    """Record in ``caught`` every target whose code runs while the block runs (and, given ``fd``,
    write ``aliased "<target>"`` there at once: the isolated run's pipe, ``kvcourse/grading/isolated.py``).

    A profile hook looks at each Python call's code object: its fingerprint (``fingerprint``) says
    whether it is the stage's own implementation, whatever object it was reached through (the class
    attribute, an alias taken earlier, a wrapper, a copy of the function, a later stage's identical
    copy, an ``exec``'d copy of its source). The learner's own code, written by the learner, never
    matches, even when it has replaced the stage's attribute.

    A target that is a dict (a constant the exercise asks for) keeps its keys, and its values become
    ``Tripped`` until the block ends. JAX's caches are cleared first: ``jit`` runs a function it traced
    before from its cache, without running its Python code again.
    """
    forbidden, constants = {}, []
    for target in targets:
        *_, value = resolve(target)
        if isinstance(value, dict):
            constants.append((value, dict(value)))
            value.update({key: Tripped(target, caught) for key in value})
        else:
            forbidden[fingerprint(code_of(target))] = target
    if "jax" in sys.modules:
        sys.modules["jax"].clear_caches()

    # everything the hook uses is bound here, as defaults (reading a function's defaults is an
    # audited event, which the isolated run refuses to the learner's code): no global a learner
    # could rebind, no closure cell a learner could change through sys.getprofile()
    def hook(frame, event, arg, _seen={}, _forbidden=forbidden, _fd=fd, _id=id, _fp=fingerprint,  # noqa: B006
             _append=caught.append, _write=os.write, _join="".join):  # fmt: skip
        if event == "call":
            code = frame.f_code
            known = _seen.get(_id(code))
            if known is None or known[0] is not code:  # a new code object (ids are reused)
                known = _seen[_id(code)] = (code, _forbidden.get(_fp(code)))
            if known[1] is not None:
                _append(known[1])
                if _fd is not None:
                    _write(_fd, _join(["aliased ", known[1], "\n"]).encode())

    previous = sys.getprofile()
    sys.setprofile(hook)
    try:
        yield
    finally:
        sys.setprofile(previous)
        for constant, values in constants:
            constant.update(values)


def time_limit(seconds: int):
    """Raise ``CaseTimeout`` in the block after ``seconds`` (main thread only; elsewhere no limit)."""
    return cases.time_limit(seconds, CaseTimeout(f"the hidden cases ran past their {seconds} s"))


def checks_of(package: str):
    """A stage's checkers and hidden cases: ``checks_of("L2_token_flat")`` is ``exercises.L2_token_flat.checks``."""
    return importlib.import_module(f"exercises.{package}.checks")


def answers_of(package: str):
    """A stage's independent answers: ``answers_of("L2_token_flat")`` is ``key.L2_token_flat.answers``
    (the grader's process only; a student release has them in its autograder bundle)."""
    return importlib.import_module(f"key.{package}.answers")


def load_fresh(package: str):
    """A new copy of the stage's checkers (``exercises/<package>/checks.py``) loaded from its file, so
    that changes a notebook made to the imported module (a checker replaced, a dict edited) do not reach
    the hidden cases."""
    name = f"exercises.{package}.checks"
    spec = importlib.util.spec_from_file_location(name, importlib.util.find_spec(name).origin)
    fresh = importlib.util.module_from_spec(spec)
    fresh.__package__ = name.rpartition(".")[0]
    spec.loader.exec_module(fresh)
    return fresh


def observe_all(hidden: Hidden, fn, context, cases: list, seconds: float, fd: int | None = None):
    """Run ``fn`` on each case under the watch: (observations, the targets seen running).

    The cases share ``seconds``; the first one to run out of time is recorded as such and ends the
    run. What the learner's code prints is dropped."""
    observations, caught = [], []
    deadline = time.monotonic() + seconds
    for case in cases:
        try:
            with (
                contextlib.redirect_stdout(io.StringIO()),
                time_limit(max(1, round(deadline - time.monotonic()))),
            ):
                with watching(hidden.answers, caught, fd):
                    got = hidden.observe(fn, case, *context)
            observations.append({"ok": to_json(got)})
        except Exception as e:  # noqa: BLE001 - the learner's code may raise anything
            observations.append({"error": f"{type(e).__name__}: {first_line(str(e))}"})
            if isinstance(e, CaseTimeout):
                break  # a loop that never ends would cost every other case the same
    return observations, caught


def harvest(
    package: str, exercise_id: str, fn, *context, seed: int, out: str, seconds: float = SECONDS
) -> None:
    """Run ``fn`` on an exercise's hidden cases in this process; write the record ``judge`` reads to
    ``out``. For tests and instructors' own checks: the grader runs a submission's answers in an
    isolated process instead (``kvcourse/grading/isolated.py``)."""
    hidden = load_fresh(package).HIDDEN[exercise_id]
    cases = hidden.draw(rng_for(seed, exercise_id))
    observations, caught = observe_all(hidden, fn, context, cases, seconds)
    record = {
        "exercise": exercise_id,
        "seed": seed,
        "observations": observations,
        "aliased": sorted(set(caught)),
    }
    Path(out).write_text(json.dumps(record), encoding="utf-8")
    print(f"{exercise_id}: {len(observations)} hidden cases run")


def expected(package: str, exercise_id: str, seed: int) -> tuple[list[dict], list]:
    """The hidden cases of one exercise and the independent answer's observation of each."""
    hidden = checks_of(package).HIDDEN[exercise_id]
    answer = answers_of(package).EXPECT[exercise_id]
    cases = hidden.draw(rng_for(seed, exercise_id))
    return cases, [to_json(answer(case)) for case in cases]


def judge(package: str, exercise_id: str, seed: int, record: dict | None) -> list[str]:
    """Each failing hidden case once, in words (empty when all pass). ``record`` is what ``harvest``
    wrote, or None when none came back."""
    if record is None:
        return ["hidden cases: no record came back"]
    hidden = checks_of(package).HIDDEN[exercise_id]
    cases, wants = expected(package, exercise_id, seed)
    got = record.get("observations")
    if not isinstance(got, list):
        return ["hidden cases: the record is malformed"]
    problems = [
        f"hidden cases: the answer runs {t.partition(':')[2]}, the stage's own"
        for t in record.get("aliased", [])
    ]
    for k, (case, want) in enumerate(zip(cases, wants, strict=False), start=1):
        if k > len(got):
            problems.append(f"hidden case {k} ({hidden.describe(case)}): did not run")
            break
        obs = got[k - 1] if isinstance(got[k - 1], dict) else {}
        if "error" in obs:
            problems.append(f"hidden case {k} ({hidden.describe(case)}): raised {obs['error']}")
            continue
        explain = hidden.explain or (lambda w, g: compare(w, g, hidden.atol))
        problem = explain(want, obs.get("ok"))
        if problem:
            problems.append(f"hidden case {k} ({hidden.describe(case)}): {problem}")
    return problems


def to_json(value):
    """A JSON-able copy of an observation: tuples become lists, tensors and arrays their ``tolist()``,
    numbers plain ints and floats. ``to_json((1, torch.tensor([2.0]))) -> [1, [2.0]]``."""
    if hasattr(value, "tolist") and not isinstance(value, str | bytes):
        return value.tolist()
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_json(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    return repr(value)


def compare(want, got, atol: float = 0.0) -> str | None:
    """None when ``got`` matches ``want`` (floats within ``atol``), else the first difference.

    Steps (dicts in a list) are named by their ``call``::

        >>> compare([{"call": "alloc_blocks(2)", "returned": [0, 1]}],
        ...         [{"call": "alloc_blocks(2)", "returned": [1, 0]}])
        'after alloc_blocks(2): returned is [1, 0], expected [0, 1]'
    """
    if isinstance(want, list) and want and all(isinstance(w, dict) and "call" in w for w in want):
        if not isinstance(got, list):
            return f"got {short(got)}, expected {len(want)} steps"
        for k, step in enumerate(want):
            if k >= len(got) or not isinstance(got[k], dict):
                return f"stopped before {step['call']}"
            for key, value in step.items():
                if not same(value, got[k].get(key), atol):
                    return f"after {step['call']}: {key} is {short(got[k].get(key))}, expected {short(value)}"
        return None
    return None if same(want, got, atol) else f"got {short(got)}, expected {short(want)}"


def unrevealed(want, got) -> str | None:
    """What differs, without the expected values: a prediction's report must not hand out its answer.

    Example: ``unrevealed({"free": [2, 3], "table": [0, 1]}, {"free": [3, 2], "table": [0, 1]})``
    -> ``"free is wrong"``; a value that is not a dict gives ``"the answer is wrong"``.
    """
    if same(want, got, 0.0):
        return None
    if isinstance(want, dict) and isinstance(got, dict):
        wrong = [k for k in want if not same(want[k], got.get(k), 0.0)] + sorted(set(got) - set(want))
        return f"{', '.join(map(str, wrong))} {'is' if len(wrong) == 1 else 'are'} wrong"
    return "the answer is wrong"


def same(want, got, atol: float) -> bool:
    """Structural equality, floats within ``atol`` (NaN never equal)."""
    if isinstance(want, float) or (isinstance(want, int) and isinstance(got, float) and atol):
        if isinstance(got, bool) or not isinstance(got, int | float) or math.isnan(got):
            return False
        return abs(got - want) <= atol if atol else got == want
    if isinstance(want, list):
        return (
            isinstance(got, list)
            and len(got) == len(want)
            and all(same(w, g, atol) for w, g in zip(want, got, strict=True))
        )
    if isinstance(want, dict):
        return (
            isinstance(got, dict)
            and got.keys() == want.keys()
            and all(same(want[k], got[k], atol) for k in want)
        )
    return type(want) is type(got) and want == got


def short(value, width: int = 120) -> str:
    """A value in at most ``width`` characters: ``short(list(range(100)), 20) -> '[0, 1, 2, 3, 4, 5...'``."""
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def main(argv: list[str] | None = None) -> int:
    """``python -m kvcourse.grading.hidden PACKAGE EXERCISE SEED``: print the hidden cases and the answer's
    observations as JSON (for instructors who want to see what a seed draws)."""
    package, exercise_id, seed = (argv or sys.argv[1:])[:3]
    cases, wants = expected(package, exercise_id, int(seed))
    print(json.dumps([{"case": c, "expected": w} for c, w in zip(cases, wants, strict=True)], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
