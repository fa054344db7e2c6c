"""Catch-the-bug exercises: the learner writes a test, and the test is graded by the bugs it catches.

A catch-the-bug exercise hands the learner's test function a piece of the stage (a class, such as L2's
``BlockAllocator``, or a function, such as L3's ``reserve``). The test exercises it and raises
(``assert``) when it misbehaves. Grading runs the test on

- the **correct** version: the stage's code, which the test must pass, and
- **buggy** versions: the same code with one bug of the course's mutation list
  (``kvcourse/harness/mutations.py``) put in, each of which the test must fail.

Every version, the correct one included, is made the same way: the named definition's source is read
from the stage's file, the bug's text replaced (none for the correct one), and the result executed in
a copy of the module's namespace, under a file name of its own (``<L2_token_flat.allocator, handed to
your test>``). So the versions cannot be told apart by where they come from, and a test that runs the
stage's own code as an oracle is seen by the hidden cases' watch (``hidden.watching``), which knows the
stage's code by its real file. Exception classes and everything else the definition uses stay the
module's own (``OutOfBlocksError`` is the class the learner imports).

    bug = mutation("L2 allocator hands out the blocks it has, then raises")
    BuggyAllocator = version("L2_token_flat.allocator:BlockAllocator", bug)
    outcome_of(learner_test, BuggyAllocator)   # -> "fails" when the test caught it, "passes" if not

``catch_cases`` makes the visible check cell's cases and ``catch_hidden`` an exercise's ``Hidden``.
A case's line names the bug, never the learner's own message (it must print the same for everyone).

Left out on purpose: bugs outside the mutation list (a bug a learner could not be told about), and
partial credit (a test that misses one bug fails the exercise; the report says which).
"""

from __future__ import annotations

import ast
import functools
import importlib
import random
from collections.abc import Callable
from pathlib import Path

from kvcourse.grading.cases import Case, first_line
from kvcourse.grading.hidden import Hidden
from kvcourse.harness.mutations import MUTATIONS, Mutation

CORRECT = "the correct version"


def mutation(name: str) -> Mutation:
    """The mutation of ``kvcourse/tools/mutants.py`` called ``name`` (a ``KeyError`` names the unknown one)."""
    found = [m for m in MUTATIONS if m.name == name]
    if not found:
        raise KeyError(f"no mutation named {name!r} in kvcourse/harness/mutations.py")
    return found[0]


@functools.cache
def version(target: str, bug_name: str | None = None):
    """The definition ``target`` (``"package.module:Name"``, top level) rebuilt from its source, with
    the mutation ``bug_name`` put in (None: unchanged). Each call with the same arguments gives the
    same object, so a class is built once per run.

    Example: ``version("L2_token_flat.allocator:BlockAllocator")(4, 2).alloc_blocks(1) -> [0]``.
    """
    module_name, _, name = target.partition(":")
    module = importlib.import_module(module_name)
    path = Path(module.__file__)
    text = path.read_text(encoding="utf-8")
    if bug_name is not None:
        bug = mutation(bug_name)
        if not path.as_posix().endswith(bug.file):
            raise ValueError(f"mutation {bug_name!r} changes {bug.file}, not {module_name}'s file")
        if text.count(bug.old) != 1:
            raise ValueError(
                f"mutation {bug_name!r}: its text occurs {text.count(bug.old)} times in {bug.file}"
            )
        text = text.replace(bug.old, bug.new)
    nodes = [n for n in ast.parse(text).body if getattr(n, "name", None) == name]
    if len(nodes) != 1:
        raise ValueError(f"{module_name} defines {name} {len(nodes)} times at the top level, not once")
    node = nodes[0]
    start = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
    source = "\n" * (start - 1) + "\n".join(text.splitlines()[start - 1 : node.end_lineno]) + "\n"
    if bug_name is not None and bug.new not in source:
        raise ValueError(f"mutation {bug_name!r} changes {module_name} outside {name}")
    namespace = dict(vars(module))
    exec(compile(source, f"<{module_name}, handed to your test>", "exec"), namespace)  # noqa: S102
    return namespace[name]


def outcome_of(test: Callable, subject) -> str:
    """``"passes"`` when ``test(subject)`` returns, ``"fails"`` when it raises (any exception but
    ``NotImplementedError``, which the exercise's stub raises: it is passed on, so that an untouched
    exercise reads "not done yet" and catches no bug)."""
    try:
        test(subject)
    except NotImplementedError:
        raise
    except Exception:  # noqa: BLE001 - a test may fail with any exception, as under pytest
        return "fails"
    return "passes"


def verdict(want: str, got) -> str | None:
    """A hidden case's difference in words: ``verdict("fails", "passes")`` -> ``"your test passes this
    buggy version: it does not catch the bug"``."""
    if want == got:
        return None
    if got == "passes":
        return "your test passes this buggy version: it does not catch the bug"
    return "your test fails the correct version"


def catch_cases(test: Callable, target: str, bugs: list[str], what: str) -> list[Case]:
    """The check cell's cases: ``test`` on the correct ``target`` (it must pass), then on each of ``bugs``
    (it must fail). ``what`` names the subject in the lines: ``"the allocator"``."""

    def correct() -> str | None:
        try:
            test(version(target))
        except NotImplementedError:
            raise
        except Exception as e:  # noqa: BLE001
            return (
                f"your test fails {what} as the stage has it ({type(e).__name__}: {first_line(str(e), 60)})"
            )
        return None

    def buggy(bug: str) -> Callable[[], str | None]:
        def run() -> str | None:
            if outcome_of(test, version(target, bug)) == "passes":
                return f"your test passes {what} with this bug: it does not catch it"
            return None

        return run

    return [Case(f"{CORRECT} of {what}: your test passes", correct)] + [
        Case(f"bug '{bug}': your test fails", buggy(bug)) for bug in bugs
    ]


def catch_hidden(target: str, bugs: list[str], watch: tuple[str, ...]) -> Hidden:
    """The hidden cases of a catch-the-bug exercise: the correct version and every one of ``bugs``, in
    an order drawn from the seed. A case is ``{"bug": name}`` (None: the correct version); its
    observation is ``"passes"`` or ``"fails"``, and the independent answer (a test that catches them
    all) passes the first and fails the others. ``watch`` names the stage code the learner's test must
    not run itself (its real methods: an oracle test would)."""

    def draw(rng: random.Random) -> list[dict]:
        cases = [{"bug": None}] + [{"bug": bug} for bug in bugs]
        rng.shuffle(cases)
        return cases

    def observe(test, case):
        return outcome_of(test, version(target, case["bug"]))

    def describe(case) -> str:
        return CORRECT if case["bug"] is None else f"bug '{case['bug']}'"

    return Hidden(draw=draw, observe=observe, describe=describe, answers=watch, explain=verdict)
