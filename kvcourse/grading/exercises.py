"""Make the exercise notebooks from the reference notebooks: ``python -m kvcourse.grading.exercises``.

    key/notebooks/L1_contiguous.ipynb  (solutions, executed)  ->  notebooks/L1_contiguous.ipynb

The reference notebooks are part of the answer key (``key/``, which a student release leaves out); the
exercise notebooks in ``notebooks/`` are what a learner opens (``make workspace`` copies them), never
edited by hand.

Markers. In a code cell of a reference notebook, the lines between ``# BEGIN SOLUTION`` and
``# END SOLUTION`` are an exercise's solution; an optional title follows a colon::

    def write_kv(k_cache, v_cache, start, k, v):
        # BEGIN SOLUTION: write K/V into the cache
        end = start + k.shape[0]
        ...
        # END SOLUTION

In the exercise notebook the whole region, markers included, becomes one stub line at the BEGIN
marker's indentation::

    def write_kv(k_cache, v_cache, start, k, v):
        raise NotImplementedError("Exercise L1.1: write K/V into the cache")

"L1" comes from the file name, and k counts the regions of the notebook from the top (1, 2, ...), so
a cell may hold several. Without a title the stub says just ``"Exercise L1.1"``. Solution regions are
function bodies: the stub must leave valid code behind, and the graders call the function.

Outputs. Check cells (code cells containing ``# NBVAL_CHECK_OUTPUT``) keep their outputs, which are the
expected answers, and their execution counts (nbval skips comparing a cell whose count is empty).
Every other code cell loses its outputs and execution count. Per-cell execution timestamps are
dropped everywhere. Relative markdown links are made relative to the exercise notebook's folder
(``[chapter](../../lessons/L1_contiguous.md)`` in ``key/notebooks/`` becomes
``[chapter](../lessons/L1_contiguous.md)`` in ``notebooks/``: ``relinked``). The result is written
with ``nbformat`` in a fixed format, so running this twice gives identical bytes and ``--check`` can
tell whether the committed notebooks are up to date.

Kinds. Each exercise's markdown heading names its kind (``kinds``): a *warm-up* rebuilds a function
the stage has (the chapter folds that listing), *beyond the stage* asks for a variant no file of the
course holds, *catch the bug* asks for a test that the grader runs on buggy versions of the stage
(``kvcourse/grading/mutations.py``), and *predict* asks for the state a fixed sequence of operations
leaves.

``put_back(exercise_nb, answers)`` does the reverse for tests: it replaces stubs with code, the
reference solutions (``solutions(reference_nb)``) or a deliberately wrong answer.

Left out on purpose: hiding anything outside solution regions (markdown stays as written, links
aside), and exercises whose solution is not a function body. Hidden cases are not in any notebook:
each stage's checkers (``exercises/LN_*/checks.py``) draw them at grading time
(``kvcourse/grading/hidden.py``).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import sys
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import nbformat

from kvcourse.grading.generated import sync

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"  # the learner's exercise notebooks (generated) and sanitize.cfg
KEY_NOTEBOOKS = ROOT / "key" / "notebooks"  # the reference notebooks: solutions, executed (the answer key)
CHECK_MARKER = "# NBVAL_CHECK_OUTPUT"
BEGIN_RE = re.compile(r"^(?P<indent>[ \t]*)# BEGIN SOLUTION(?::[ \t]*(?P<title>.*?))?[ \t]*$")
END_RE = re.compile(r"^[ \t]*# END SOLUTION[ \t]*$")
RELATIVE_LINK_RE = re.compile(r"\]\((?![a-zA-Z][a-zA-Z0-9+.-]*:|#|/)")  # "](" + a relative target
LINK_RE = re.compile(RELATIVE_LINK_RE.pattern + r"([^)\s#]+)")  # "](" + a relative target, captured
KINDS = ("warm-up", "beyond the stage", "catch the bug", "predict")
HEADING_RE = re.compile(
    r"^#+ Exercises? (?P<ids>L\d+\.\d+(?:(?:, | and )L\d+\.\d+)*) \((?P<kind>[^)]*)\)", re.M
)
STUB_RE = re.compile(r'^(?P<indent>[ \t]*)raise NotImplementedError\("Exercise L\d+\.(?P<number>\d+)[:"]')


@dataclass(frozen=True)
class Exercise:
    number: int  # k in "Exercise LN.k", counted from the top of the notebook
    title: str  # "" when the BEGIN marker has none
    solution: str  # the region's code, dedented, without the markers

    def stub(self, stage: str, indent: str) -> str:
        """The line that replaces the region, e.g. ``raise NotImplementedError("Exercise L1.2: ...")``."""
        message = f"Exercise {stage}.{self.number}" + (f": {self.title}" if self.title else "")
        return f"{indent}raise NotImplementedError({json.dumps(message, ensure_ascii=False)})"


def stage_of(path: str | Path) -> str:
    """The stage tag of a notebook file: ``notebooks/L1_contiguous.ipynb -> 'L1'``."""
    m = re.match(r"(L\d+)_", Path(path).name)
    if not m:
        raise ValueError(f"{path}: a notebook name starts with its stage tag and an underscore (LN_...)")
    return m.group(1)


def exercise_path(reference: str | Path) -> Path:
    """Where the exercise version of a reference notebook lives: ``key/notebooks/L1_contiguous.ipynb ->
    notebooks/L1_contiguous.ipynb``."""
    return NOTEBOOKS / Path(reference).name


def relinked(nb, source: Path, folder: Path):
    """``nb`` (changed in place) with each relative markdown link made relative to ``folder`` instead of
    ``source``. Example, from key/notebooks/ to notebooks/: ``](../../lessons/L1.md)`` ->
    ``](../lessons/L1.md)``; from notebooks/ to workspace/, the same link stays ``](../lessons/L1.md)``."""

    def move(m: re.Match) -> str:
        target = os.path.normpath(source.resolve() / m[1])
        return "](" + os.path.relpath(target, folder.resolve())

    for cell in nb.cells:
        if cell.cell_type == "markdown":
            cell.source = LINK_RE.sub(move, cell.source)
    return nb


def _split(source: str, stage: str, first: int, where: str) -> tuple[str, list[Exercise]]:
    """Replace each solution region of one cell's source by its stub; return the new source and regions.

    Example (stage "L1", first=3), one line per list item::

        ["def f():", "    # BEGIN SOLUTION: add", "    return 1 + 1", "    # END SOLUTION"]
        -> ["def f():", '    raise NotImplementedError("Exercise L1.3: add")'],
           [Exercise(number=3, title="add", solution="return 1 + 1\\n")]
    """
    out: list[str] = []
    found: list[Exercise] = []
    region: list[str] | None = None
    indent = title = ""
    for lineno, line in enumerate(source.split("\n"), start=1):
        begin, end = BEGIN_RE.match(line), END_RE.match(line)
        if region is None:
            if end:
                raise ValueError(f"{where}, line {lineno}: '# END SOLUTION' without '# BEGIN SOLUTION'")
            if begin:
                region, indent, title = [], begin["indent"], begin["title"] or ""
            else:
                out.append(line)
        elif begin:
            raise ValueError(f"{where}, line {lineno}: '# BEGIN SOLUTION' inside another solution region")
        elif end:
            if not any(s.strip() for s in region):
                raise ValueError(f"{where}, line {lineno}: empty solution region")
            ex = Exercise(first + len(found), title, textwrap.dedent("\n".join(region) + "\n"))
            found.append(ex)
            out.append(ex.stub(stage, indent))
            region = None
        else:
            region.append(line)
    if region is not None:
        raise ValueError(f"{where}: '# BEGIN SOLUTION' without '# END SOLUTION'")
    return "\n".join(out), found


def _is_check(cell) -> bool:
    return cell.cell_type == "code" and CHECK_MARKER in cell.source


def split_notebook(reference, stage: str):
    """The exercise notebook (a new object; ``reference`` is untouched) and its list of ``Exercise``."""
    nb = relinked(copy.deepcopy(reference), KEY_NOTEBOOKS, NOTEBOOKS)
    exercises: list[Exercise] = []
    for i, cell in enumerate(nb.cells):
        cell.metadata.pop("execution", None)
        if cell.cell_type != "code":
            continue
        source, found = _split(cell.source, stage, len(exercises) + 1, f"cell {i}")
        if found and _is_check(cell):
            raise ValueError(f"cell {i}: a check cell cannot hold a solution region")
        cell.source = source
        exercises.extend(found)
        if not _is_check(cell):
            cell.outputs = []
            cell.execution_count = None
    return nb, exercises


def make_exercise_notebook(reference, stage: str):
    """The exercise version of a reference notebook (an ``nbformat`` node), built in memory."""
    return split_notebook(reference, stage)[0]


def solutions(reference) -> dict[int, str]:
    """Each exercise's solution code by number: ``{1: "end = start + ...\\n", 2: ...}``."""
    _, exercises = split_notebook(reference, "LN")  # the stage only names the stubs, dropped here
    return {ex.number: ex.solution for ex in exercises}


def put_back(exercise, answers: Mapping[int, str]):
    """A copy of an exercise notebook with the stub of exercise k replaced by ``answers[k]``.

    ``answers`` holds unindented code; it is indented like the stub it replaces. Stubs without an
    answer stay. ``put_back(ex, solutions(ref))`` gives the reference's code back; tests also use it
    to plant a wrong answer.
    """
    nb = copy.deepcopy(exercise)
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        lines = []
        for line in cell.source.split("\n"):
            m = STUB_RE.match(line)
            if m and int(m["number"]) in answers:
                code = answers[int(m["number"])].rstrip("\n")
                lines.append(textwrap.indent(code, m["indent"]))
            else:
                lines.append(line)
        cell.source = "\n".join(lines)
    return nb


def kinds(reference) -> dict[str, str]:
    """Each exercise's kind, from the notebook's headings: ``## Exercise L2.4 (beyond the stage) — ...``
    and ``## Exercises L2.1 and L2.2 (warm-up) — ...`` give ``{"L2.4": "beyond the stage", "L2.1":
    "warm-up", "L2.2": "warm-up"}``. A kind outside ``KINDS`` is refused."""
    found = {}
    for cell in reference.cells:
        if cell.cell_type != "markdown":
            continue
        for m in HEADING_RE.finditer(cell.source):
            if m["kind"] not in KINDS:
                raise ValueError(f"exercise heading {m[0]!r}: the kind is one of {', '.join(KINDS)}")
            found.update({ex: m["kind"] for ex in re.findall(r"L\d+\.\d+", m["ids"])})
    return found


def read(path: str | Path):
    return nbformat.read(str(path), as_version=4)


def render(nb) -> str:
    """The notebook as the exact text ``nbformat.write`` puts in a file (so tests can compare bytes)."""
    text = nbformat.writes(nb, version=4)
    return text if text.endswith("\n") else text + "\n"


def reference_notebooks(folder: str | Path = KEY_NOTEBOOKS) -> list[Path]:
    """Every reference notebook ``LN_*.ipynb`` of the course, sorted by name."""
    return sorted(Path(folder).glob("L[0-9]*_*.ipynb"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvcourse.grading.exercises", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if any is out of date")
    parser.add_argument("--notebooks", default=KEY_NOTEBOOKS, help="folder of reference notebooks")
    args = parser.parse_args(argv)
    stale = 0
    for ref in reference_notebooks(args.notebooks):
        nb, exercises = split_notebook(read(ref), stage_of(ref))
        target = exercise_path(ref)
        differs, shown = sync(target, render(nb), args.check), os.path.relpath(target)
        if args.check:
            stale += differs
            print(f"{shown}: {'OUT OF DATE' if differs else 'up to date'}")
        else:
            print(f"{shown}: {len(exercises)} exercise(s), {'written' if differs else 'unchanged'}")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
