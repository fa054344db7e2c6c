"""Grade exercise notebooks: ``python -m kvcourse.grade`` (``make grade``).

    make grade NB=workspace/L2_token_flat.ipynb          one notebook (a learner's, or a reference)
    make grade NB=workspace/L2_token_flat.ipynb EX=L2.2   one exercise: only what it needs runs
    make grade                                            every notebook in workspace/
    make grade DIR=submissions/                           a class: writes submissions/gradebook.csv

For a notebook the report reads like a teacher's: one line per exercise, then each failing case once
in plain text, then ``graded <path>: K/N exercises pass``; the exit status is 0 only when K == N::

    L2.1 allocate blocks: PASS
    L2.2 free blocks: FAIL, 3 of 5 cases pass
    L2.3 reserve: FAIL, not done yet (it raises NotImplementedError)

    L2.2 case 4 (free([1, 1]) after alloc_blocks(2)): WRONG — expected ValueError (double free), got no error
    ...
    graded workspace/L2_token_flat.ipynb: 1/3 exercises pass

How. The answer key of a notebook is its stage's generated exercise notebook
(``notebooks/exercises/LN_*.ipynb``): its stubs name the exercises, and its check cells hold the
expected output. The grader builds a copy of the learner's notebook in which every check cell is the
key's (the expected answers come from the key, never from the learner's file, whose check cells show
whatever the learner's last run printed), drops the cells tagged ``demo`` (plots and timings no
exercise needs) and, for ``EX=``, every cell but the ones tagged ``setup``, the exercise's own cells and
its check cell. nbval runs that copy in a fresh kernel (``kvcourse/nbval_report.py`` records each
cell); an exercise passes when its check cell's output matches the key's. A learner's own ``print``
calls never count: only check cells are compared, and their checkers swallow what the learner's code
prints.

Submissions are code: grading runs them, with the grader's permissions. Grade a class inside a
container or under a throwaway account. A notebook whose check cells differ from the key's is refused
(graded 0), since editing a check cell is the one way to change what is graded.

Left out on purpose: partial credit (an exercise passes or fails), hidden tests, and sandboxing.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from kvcourse.exercises import CHECK_MARKER, NOTEBOOKS, read, render

ROOT = NOTEBOOKS.parent
WORKSPACE = ROOT / "workspace"
SANITIZE = NOTEBOOKS / "sanitize.cfg"
CELL_TIMEOUT = 600  # seconds a single cell may run
NOTEBOOK_TIMEOUT = 1800  # seconds one notebook may take in all
STUB_TITLE_RE = re.compile(r'raise NotImplementedError\("Exercise (L\d+\.\d+)(?::\s*(.*?))?"\)')


@dataclass
class Exercise:
    exercise_id: str  # "L2.3"
    title: str  # "reserve"
    check: int  # index of its check cell in the answer key
    first: int  # index of the key's first cell after the previous check cell


@dataclass
class Verdict:
    exercise: Exercise
    passed: bool
    summary: str  # "PASS", "FAIL, 3 of 5 cases pass", ...
    failures: list[str] = field(default_factory=list)  # failing case lines, each once


@dataclass
class Grade:
    path: str
    verdicts: list[Verdict]
    refused: str | None = None  # why the notebook was not graded

    @property
    def passed(self) -> int:
        return sum(v.passed for v in self.verdicts)


def is_check(cell) -> bool:
    return cell.cell_type == "code" and CHECK_MARKER in cell.source


def tags(cell) -> list[str]:
    return cell.get("metadata", {}).get("tags", [])


def exercises_of(key) -> list[Exercise]:
    """The exercises of an answer key, in order: each stub's id and title, and the check cell after it.

    Every exercise has its own check cell, the first one after its stub.
    """
    found, first, pending = [], 0, []
    for i, cell in enumerate(key.cells):
        if cell.cell_type != "code":
            continue
        pending += [(m[1], m[2] or "") for m in STUB_TITLE_RE.finditer(cell.source)]
        if is_check(cell):
            if len(pending) != 1:
                raise ValueError(
                    f"answer key cell {i}: a check cell must follow exactly one exercise, found {pending}"
                )
            found.append(Exercise(pending[0][0], pending[0][1], i, first))
            pending, first = [], i + 1
    return found


def answer_key_for(nb, path: Path):
    """The generated exercise notebook that grades ``nb``: the one sharing most cell ids with it, or
    else the one whose stage tag (``L2``) starts the file name."""
    keys = sorted((NOTEBOOKS / "exercises").glob("L[0-9]*_*.ipynb"))
    ids = {c.get("id") for c in nb.cells} - {None}
    best = max(keys, key=lambda k: len(ids & {c.get("id") for c in read(k).cells}), default=None)
    if best is not None and ids & {c.get("id") for c in read(best).cells}:
        return read(best)
    m = re.search(r"(L\d+)", path.name)
    named = [k for k in keys if m and k.name.startswith(m[1] + "_")]
    if not named:
        raise ValueError(f"{path}: cannot tell which stage's exercises this notebook holds")
    return read(named[0])


def check_cells_edited(nb, key) -> str | None:
    """Why the learner's check cells are not the key's (edited, missing, added), or None."""
    mine = [c.source for c in nb.cells if is_check(c)]
    theirs = [c.source for c in key.cells if is_check(c)]
    if len(mine) != len(theirs):
        return f"it has {len(mine)} check cells, the exercise notebook has {len(theirs)}"
    for k, (a, b) in enumerate(zip(mine, theirs, strict=True), start=1):
        if a != b:
            return f"check cell {k} was edited (it should read {b.splitlines()[-1].strip()!r})"
    return None


def build_run(nb, key, exercises: list[Exercise], only: str | None):
    """The notebook nbval runs, and the role of each of its code cells (index -> exercise id or None).

    Check cells come from the key, with their expected outputs; cells the key tags ``demo`` are
    dropped; with ``only``, so is everything but ``setup`` cells and that exercise's span.
    """
    key_ids = {c.get("id"): c for c in key.cells if c.get("id")}
    check_cells = [c for c in key.cells if is_check(c)]
    chosen = next((e for e in exercises if e.exercise_id == only), None) if only else None
    if only and chosen is None:
        raise ValueError(
            f"no exercise {only} in this notebook (it has {', '.join(e.exercise_id for e in exercises)})"
        )
    cells, roles, k = [], {}, 0  # k: check cells seen so far
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        if is_check(cell):
            ex = exercises[k]
            k += 1
            if chosen is None or ex is chosen:
                roles[len(cells)] = ex.exercise_id
                cells.append(check_cells[k - 1])
            continue
        cell_tags = tags(key_ids.get(cell.get("id"), cell))
        if "demo" in cell_tags:
            continue
        in_span = chosen is not None and k == exercises.index(chosen)
        if chosen is None or "setup" in cell_tags or in_span:
            cells.append(cell)
    run = nbformat.v4.new_notebook(cells=cells, metadata=key.metadata)
    return run, roles


def run_nbval(notebook: Path, timeout: int = NOTEBOOK_TIMEOUT) -> list[dict] | str:
    """Run nbval on one notebook in a fresh kernel; each code cell's record, or why it could not run."""
    with tempfile.TemporaryDirectory(prefix="kvcourse-grade-") as tmp:
        report = Path(tmp) / "cells.json"
        env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", MPLBACKEND="Agg", KVCOURSE_NBVAL_REPORT=str(report))
        cmd = [
            sys.executable, "-m", "pytest", "--nbval-lax", "--nbval-current-env",
            "--nbval-sanitize-with", str(SANITIZE), f"--nbval-cell-timeout={CELL_TIMEOUT}",
            "-p", "kvcourse.nbval_report", "-p", "no:cacheprovider", "-o", "addopts=", "-q", str(notebook),
        ]  # fmt: skip
        try:
            subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return f"the notebook ran longer than {timeout} s"
        if not report.exists():
            return "the notebook could not be run (is it a valid notebook?)"
        return json.loads(report.read_text(encoding="utf-8"))


def verdict(ex: Exercise, record: dict | None) -> Verdict:
    """One exercise's verdict from its check cell's record."""
    if record is None:
        return Verdict(ex, False, "FAIL, its check cell did not run")
    lines = record["text"].splitlines()
    cases = [line for line in lines if line.startswith("case ")]
    failing = [line for line in cases if not line.endswith(": ok")]
    if record["passed"]:
        return Verdict(ex, True, "PASS")
    if record["error"] and not cases:
        return Verdict(ex, False, f"FAIL, the check cell raised {record['error'].splitlines()[0]}")
    if cases and all("raised NotImplementedError" in line for line in failing) and len(failing) == len(cases):
        return Verdict(ex, False, "FAIL, not done yet (it raises NotImplementedError)")
    ok = len(cases) - len(failing)
    if not failing:  # every case passed, yet the output differs: extra or missing lines
        return Verdict(ex, False, "FAIL, its output differs from the expected one", lines)
    return Verdict(ex, False, f"FAIL, {ok} of {len(cases)} cases pass", failing)


def grade(
    path: Path, only: str | None = None, timeout: int = NOTEBOOK_TIMEOUT, shown: str | None = None
) -> Grade:
    """Grade one notebook (``only``: one exercise id)."""
    shown = shown or str(path)
    try:
        nb = read(path)
        key = answer_key_for(nb, path)
    except Exception as e:  # not a notebook, or not one of the course's
        return Grade(shown, [], refused=f"cannot read it as a course notebook ({str(e).splitlines()[0]})")
    exercises = exercises_of(key)
    edited = check_cells_edited(nb, key)
    if edited:
        return Grade(shown, [Verdict(e, False, "FAIL, refused") for e in exercises], refused=edited)
    run, roles = build_run(nb, key, exercises, only)
    with tempfile.TemporaryDirectory(prefix="kvcourse-grade-") as tmp:
        target = Path(tmp) / path.name
        target.write_text(render(run), encoding="utf-8")
        records = run_nbval(target, timeout)
    if isinstance(records, str):
        return Grade(shown, [Verdict(e, False, "FAIL, not graded") for e in exercises], refused=records)
    by_cell = {r["cell"]: r for r in records}
    graded = [e for e in exercises if only is None or e.exercise_id == only]
    at = {ex_id: cell for cell, ex_id in roles.items()}
    return Grade(shown, [verdict(e, by_cell.get(at[e.exercise_id])) for e in graded])


def report(g: Grade) -> str:
    """The teacher's report of one notebook (see the module docstring)."""
    lines = []
    if g.refused:
        lines.append(f"not graded: {g.refused}")
    lines += [f"{v.exercise.exercise_id} {v.exercise.title}: {v.summary}" for v in g.verdicts]
    failures = [(v, line) for v in g.verdicts for line in v.failures]
    if failures:
        lines.append("")
        lines += [f"{v.exercise.exercise_id} {line}" for v, line in failures]
    lines.append(f"graded {g.path}: {g.passed}/{len(g.verdicts)} exercises pass")
    return "\n".join(lines)


def gradebook(folder: Path, timeout: int) -> Path:
    """Grade every notebook in ``folder``, each in its own kernel and time limit; write gradebook.csv."""
    grades = []
    for nb in sorted(folder.glob("*.ipynb")):
        g = grade(nb, timeout=timeout, shown=str(nb))
        print(report(g), flush=True)
        print()
        grades.append(g)
    columns = sorted({v.exercise.exercise_id for g in grades for v in g.verdicts}, key=_exercise_order)
    out = folder / "gradebook.csv"
    with out.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["notebook", *columns, "passed", "total", "note"])
        for g in grades:
            marks = {v.exercise.exercise_id: "pass" if v.passed else "fail" for v in g.verdicts}
            row = [Path(g.path).name, *(marks.get(c, "") for c in columns), g.passed, len(g.verdicts)]
            writer.writerow([*row, g.refused or ""])
    width = max((len(Path(g.path).name) for g in grades), default=8)
    print(f"{'notebook':<{width}}  passed")
    for g in grades:
        note = f"  (not graded: {g.refused})" if g.refused else ""
        print(f"{Path(g.path).name:<{width}}  {g.passed}/{len(g.verdicts)}{note}")
    print(f"wrote {out}")
    return out


def _exercise_order(exercise_id: str) -> tuple[int, int]:
    stage, number = exercise_id[1:].split(".")
    return int(stage), int(number)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcourse.grade", description=__doc__.splitlines()[0])
    parser.add_argument("notebook", nargs="*", help="notebooks to grade (default: every one in workspace/)")
    parser.add_argument("--exercise", help="grade one exercise only, e.g. L2.2")
    parser.add_argument("--dir", help="grade every notebook of a folder and write its gradebook.csv")
    parser.add_argument("--timeout", type=int, default=NOTEBOOK_TIMEOUT, help="seconds per notebook")
    args = parser.parse_args(argv)
    if args.dir:
        folder = Path(args.dir)
        if not folder.is_dir():
            print(f"error: {folder} is not a folder", file=sys.stderr)
            return 2
        gradebook(folder, args.timeout)
        return 0
    paths = [Path(p) for p in args.notebook] or sorted(WORKSPACE.glob("L[0-9]*_*.ipynb"))
    if not paths:
        print(
            "error: no notebooks in workspace/: run `make workspace` first, or give NB=path", file=sys.stderr
        )
        return 2
    missing = [p for p in paths if not p.is_file()]
    if missing:
        print(f"error: {missing[0]} does not exist", file=sys.stderr)
        return 2
    status = 0
    for path in paths:
        g = grade(path, only=args.exercise, timeout=args.timeout)
        print(report(g), flush=True)
        status |= g.refused is not None or g.passed < len(g.verdicts)
    return 1 if status else 0


if __name__ == "__main__":
    sys.exit(main())
