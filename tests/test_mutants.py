"""The mutation check (``python -m kvcourse.tools.mutants``, ``make mutants``) without running its mutations:
every mutation still applies to this tree, and the runner tells caught from survived from stale on a
toy repository of two files."""

from __future__ import annotations

from kvcourse.model_store import REPO_ROOT
from kvcourse.tools.mutants import MUTATIONS, Mutation, run_all, stale


def test_every_mutation_still_applies_to_this_tree():
    """Each ``old`` text occurs exactly once in its file and each test id names an existing test, so
    the list cannot go stale silently while the stages change around it."""
    assert stale(MUTATIONS, REPO_ROOT) == []
    assert len(MUTATIONS) >= 30


def test_the_runner_tells_caught_from_survived_and_stale(tmp_path):
    toy = tmp_path / "toy"
    (toy / "tests").mkdir(parents=True)
    (toy / "calc.py").write_text("def add(a, b):\n    return a + b\n")
    (toy / "tests" / "test_calc.py").write_text(
        "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"
    )
    test = ("tests/test_calc.py::test_add",)
    caught = Mutation("subtracts", "calc.py", "return a + b", "return a - b", test)
    survives = Mutation("swaps the operands", "calc.py", "return a + b", "return b + a", test)
    lines: list[str] = []
    assert run_all([caught, survives], root=toy, report=lines.append) == 1
    assert lines[0].startswith("caught") and "tests/test_calc.py::test_add" in lines[0]
    assert lines[1].startswith("survived") and lines[-1].startswith("mutants: 1/2 caught in ")
    assert (toy / "calc.py").read_text() == "def add(a, b):\n    return a + b\n"  # the copy was mutated
    lines.clear()
    gone = Mutation("edits a line that is not there", "calc.py", "return a * b", "return 0", test)
    missing = Mutation(
        "names a test that is not there",
        "calc.py",
        "return a + b",
        "return 0",
        ("tests/test_calc.py::test_sub",),
    )
    assert run_all([gone, missing], root=toy, report=lines.append) == 2
    assert lines == [
        "stale: edits a line that is not there: old text found 0 times in calc.py",
        "stale: names a test that is not there: no test tests/test_calc.py::test_sub",
        "mutants: the list is stale (2 problem(s)); nothing was run",
    ]
