"""A class of L2 submissions as an instructor meets them, for the grading tests.

``write_class(folder)`` writes eight notebooks, each a copy of the L2 exercise notebook
(its N exercises; the class is about L2.1 to L2.3, the others stay untouched unless said):

- ``untouched``: nothing done (none pass);
- ``correct``: the reference solutions, each printing a debugging line (all N pass: what a learner's code
  prints is not graded);
- ``crashing``: L2.1 solved, then ``os._exit(1)`` in the cell of L2.2: the kernel dies (L2.1 passes, and
  the note says where);
- ``hanging``: L2.1 and L2.2 solved, L2.3 loops forever (two pass, and the note says it
  timed out);
- ``check_edited``: the solutions, and a check cell changed to print its expected text (all N pass: the
  key's check cell is run, and the note says so);
- ``cheat_patch``: replaces the three checkers by functions that print the expected text (none pass);
- ``cheat_rebind``: rebinds ``checks`` to a namespace of such functions (none pass);
- ``cheat_alias``: answers with the stage's own code (none pass).

``EXPECTED`` holds each one's row: marks, and a piece of its note ("" for none). Given ``escape``
(a path in the repository and a port on the host's loopback), a ninth, ``escaping``, solves L2.1 in a
cell that also tries to write that file and to connect to that port (``ESCAPING``: L2.1 passes, no note).
"""

from __future__ import annotations

import copy
from pathlib import Path

from kvcourse.grading import exercises

REFERENCE = exercises.KEY_NOTEBOOKS / "L2_token_flat.ipynb"
CHECKERS = {1: "check_alloc_blocks", 2: "check_free", 3: "check_allocate_slots"}

N = len(exercises.solutions(exercises.read(REFERENCE)))  # the notebook's exercises, L2.1 .. L2.N


def marks(*passing: int) -> list[str]:
    """A row's marks: ``marks(1, 2)`` -> ``["pass", "pass", "fail", ...]``, one per exercise."""
    return ["pass" if k in passing else "fail" for k in range(1, N + 1)]


EXPECTED = {
    "untouched": (marks(), ""),
    "correct": (marks(*range(1, N + 1)), ""),
    "crashing": (marks(1), "kernel died in the cell of L2.2"),
    "hanging": (marks(1, 2), "L2.3 timed out after"),
    "check_edited": (marks(*range(1, N + 1)), "check cell 2 edited"),
    "cheat_patch": (marks(), "changes the grader"),
    "cheat_rebind": (marks(), "changes the grader"),
    "cheat_alias": (marks(), "L2.1 not credited"),
}
ESCAPING = (marks(1), "")


def expected_texts(exercise) -> dict[int, str]:
    """What each check cell prints when its exercise is right: the key's stored output."""
    checks = [c for c in exercise.cells if exercises.CHECK_MARKER in c.source]
    return {k: "".join(o.get("text", "") for o in c.outputs) for k, c in enumerate(checks, start=1)}


def with_cell(nb, number: int, source: str):
    """A copy of ``nb`` whose exercise ``number`` cell (the one holding its stub) reads ``source``."""
    nb = copy.deepcopy(nb)
    stub = f'"Exercise L2.{number}'
    next(c for c in nb.cells if c.cell_type == "code" and stub in c.source).source = source
    return nb


def write_class(folder: Path, escape: tuple[Path, int] | None = None) -> list[Path]:
    exercise = exercises.read(exercises.exercise_path(REFERENCE))
    solutions = exercises.solutions(exercises.read(REFERENCE))
    solved = exercises.put_back(exercise, solutions)
    chatty = exercises.put_back(
        exercise, {k: f'print("my debugging line")\n{code}' for k, code in solutions.items()}
    )
    texts = expected_texts(exercise)
    printers = {CHECKERS[k]: f"lambda *args, **kwargs: print({texts[k]!r}, end='')" for k in CHECKERS}

    crashing = exercises.put_back(exercise, {1: solutions[1]})
    crashing = with_cell(crashing, 2, "import os\nos._exit(1)\n\ndef free(self, blocks):\n    pass\n")
    hanging = exercises.put_back(exercise, {1: solutions[1], 2: solutions[2], 3: "while True:\n    pass\n"})
    edited = copy.deepcopy(solved)
    check = [c for c in edited.cells if exercises.CHECK_MARKER in c.source][1]
    check.source = f"# NBVAL_CHECK_OUTPUT\nprint({texts[2]!r}, end='')"
    patch = "\n".join(f"checks.{name} = {printer}" for name, printer in printers.items())
    rebind = (
        "from types import SimpleNamespace\n\nchecks = SimpleNamespace(\n"
        + "".join(f"    {name}={printer},\n" for name, printer in printers.items())
        + ")"
    )
    alias = exercises.put_back(exercise, {})
    alias = with_cell(alias, 1, "alloc_blocks = BlockAllocator.alloc_blocks")
    alias = with_cell(alias, 2, "free = BlockAllocator.free")
    alias = with_cell(alias, 3, "from L2_token_flat.sequence import allocate_slots")

    notebooks = {
        "untouched": exercise,
        "correct": chatty,
        "crashing": crashing,
        "hanging": hanging,
        "check_edited": edited,
        "cheat_patch": with_cell(exercise, 1, patch),
        "cheat_rebind": with_cell(exercise, 1, rebind),
        "cheat_alias": alias,
    }
    if escape:
        attempt = (
            "import pathlib\nimport socket\n\ntry:\n"
            f"    pathlib.Path({str(escape[0])!r}).write_text('escaped')\nexcept OSError:\n    pass\ntry:\n"
            f"    socket.create_connection(('127.0.0.1', {escape[1]}), timeout=2)\nexcept OSError:\n    pass\n\n"
        )
        cell = next(c for c in solved.cells if c.cell_type == "code" and "def alloc_blocks" in c.source)
        notebooks["escaping"] = with_cell(exercise, 1, attempt + cell.source)
    paths = []
    for name, nb in notebooks.items():
        path = folder / f"{name}.ipynb"
        path.write_text(exercises.render(nb), encoding="utf-8")
        paths.append(path)
    return paths
