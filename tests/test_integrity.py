"""The static scan of a submission's code (kvcourse/grading/integrity.py): it flags what it should and
nothing a learner's honest answer does.

- the reference solutions of every notebook, which are honest answers, give no finding;
- the three cheats of issue 28 and a few neighbours are found, with the exercise they sit in;
- calling a checker from a scratch cell, or a method of the learner's own objects that shares a
  name with the stage's answer, is not a finding.
"""

from __future__ import annotations

import pytest

from kvcourse.grading import exercises, hidden
from kvcourse.grading.gradebook import package_of
from kvcourse.grading.integrity import scan

ALLOC = "L2_token_flat.allocator:BlockAllocator.alloc_blocks"
ALLOCATE_SLOTS = "L2_token_flat.sequence:allocate_slots"
ANSWERS = {"L2.1": (ALLOC,), "L2.3": (ALLOCATE_SLOTS,)}
REFERENCES = exercises.reference_notebooks(exercises.KEY_NOTEBOOKS)


@pytest.mark.parametrize("reference", REFERENCES, ids=[p.stem for p in REFERENCES])
def test_reference_solutions_are_clean(reference):
    """Every solution, as the learner's cell would hold it (the whole reference cell), is clean."""
    package = package_of(reference.name)
    specs = hidden.checks_of(package).HIDDEN
    answers = {ex: spec.answers for ex, spec in specs.items()}
    cells = [
        (None, c.source)
        for c in exercises.read(reference).cells
        if c.cell_type == "code" and "# BEGIN SOLUTION" in c.source
    ]
    assert cells
    assert scan(cells, answers) == []


@pytest.mark.parametrize(
    ("source", "kind", "says"),
    [
        (
            "checks.check_alloc_blocks = lambda *a, **k: print('5/5 passed')",
            "tamper",
            "replaces checks.check_alloc_blocks",
        ),
        ("from types import SimpleNamespace\nchecks = SimpleNamespace()", "tamper", "rebinds checks"),
        ("setattr(checks, 'check_free', print)", "tamper", "calls setattr() on checks"),
        ("import sys\nsys.modules['L2_token_flat.checks'] = None", "tamper", "uses .modules"),
        ("import importlib", "tamper", "imports importlib"),
        ("from L2_token_flat import answers", "tamper", "imports L2_token_flat.answers"),
        ("import key", "tamper", "imports key"),
        ("from key.L2_token_flat.answers import free", "tamper", "imports key.L2_token_flat.answers"),
        ("from key import notebooks", "tamper", "imports key"),
        ("text = open('notebooks/L2_token_flat.ipynb').read()", "tamper", "names a notebook file"),
        ("exec('x = 1')", "tamper", "calls exec()"),
        (  # a catch-the-bug test that compares with the grader's own correct version
            "def test_allocator(Allocator):\n    Right = checks.version('L2_token_flat.allocator:BlockAllocator')",
            "tamper",
            "reads checks.version",
        ),
        ("def predict():\n    return checks.predict_steps()[-1]", "tamper", "reads checks.predict_steps"),
        (
            "import kvcourse\nversion = kvcourse.grading.mutations.version",
            "tamper",
            "reaches kvcourse.grading",
        ),
        (  # the grader through another name (issue 45): an import under an alias, an assignment
            "from exercises.L3_block_tensor import checks as _c\n_c.how_wrong = lambda want, got: None",
            "tamper",
            "imports exercises.L3_block_tensor",
        ),
        ("c = checks\nc.how_wrong = print", "tamper", "binds c to the grader"),
        ("x = 1\nd = c = checks\nd.check_free = print", "tamper", "binds d to the grader"),
        ("def predict(c=checks):\n    return c.predict_steps()", "tamper", "passes checks around"),
        ("alloc_blocks = BlockAllocator.alloc_blocks", "alias", "reads BlockAllocator.alloc_blocks"),
        (
            "from L2_token_flat.sequence import allocate_slots",
            "alias",
            "imports allocate_slots from L2_token_flat.sequence",
        ),
        (
            "import L2_token_flat.sequence\nr = L2_token_flat.sequence.allocate_slots",
            "alias",
            "reads L2_token_flat.sequence.allocate_slots",
        ),
        (
            "class Mine(BlockAllocator):\n    def alloc_blocks(self, n):\n        return super().alloc_blocks(n)",
            "alias",
            "calls super().alloc_blocks",
        ),
    ],
)
def test_cheats_are_found(source, kind, says):
    findings = scan([("L2.1", source)], ANSWERS)
    assert findings, source
    assert findings[0].kind == kind and says in findings[0].what, findings


@pytest.mark.parametrize(
    "source",
    [
        "checks.check_alloc_blocks(alloc_blocks)",  # trying a checker in a scratch cell
        "def allocate_slots(seq, allocator, target_len):\n    new = allocator.alloc_blocks(2)\n    return new",
        "%timeit alloc_blocks(a, 2)\nprint(a.free_blocks)",
        "def alloc_blocks(self, n):\n    raise NotImplementedError('Exercise L2.1')",
        "this is not python (",
    ],
)
def test_honest_code_is_not_flagged(source):
    assert scan([("L2.1", source)], ANSWERS) == []
