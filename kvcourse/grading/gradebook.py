"""Grade exercise notebooks: ``python -m kvcourse.grading.gradebook`` (``make grade``).

    make grade NB=workspace/L2_token_flat.ipynb          one notebook (a learner's, or a reference)
    make grade NB=workspace/L2_token_flat.ipynb EX=L2.2   one exercise: only what it needs runs
    make grade                                            every notebook in workspace/
    make grade DIR=submissions/                           a class: writes submissions/gradebook.csv
    make grade ... TIMEOUT=120 SEED=1234                  seconds per cell; the hidden cases' seed
    make grade KEY=../autograder DIR=submissions/         in a student release: the answer key's bundle
    make grade DIR=submissions/ UNSAFE=1                  without bubblewrap (refused otherwise; every
                                                          row's note says so)

For a notebook the report reads like a teacher's: one line per exercise, each failing case once in
plain text, the notes, then ``graded <path>: K/N exercises pass``; the exit status is 0 only when
K == N::

    L2.1 alloc_blocks: PASS
    L2.2 free: FAIL, 3 of 5 cases pass
    L2.3 allocate_slots: FAIL, not done yet (it raises NotImplementedError)

    L2.2 case 4 (free([1, 1]) after alloc_blocks(2)): WRONG — expected ValueError (double free), got no error
    hidden cases: seed 81723 (SEED=81723 grades them again)
    graded workspace/L2_token_flat.ipynb: 1/3 exercises pass

How. What a notebook is graded against is its stage's generated exercise notebook
(``notebooks/LN_*.ipynb``; the code calls it the notebook's key): its stubs name the exercises, its
check cells hold the expected output. The grader builds the notebook it runs from the key: the
learner's version of each exercise cell (the cells that hold a stub in the key) and of each cell the
learner added, the key's version of every other cell (a check cell edited or deleted changes
nothing; cells tagged ``demo``, plots and timings no exercise needs, are left out). nbval runs it in
a fresh kernel inside a **sandbox** (``kvcourse/grading/sandbox.py``: bubblewrap, memory and
CPU-time limits), with a time limit per cell; a dead kernel is noticed at once
(``kvcourse/grading/nbval_report.py``). Then, for each exercise whose check cell printed what it
must, the exercise's **hidden cases**, drawn from a seed picked per run (``kvcourse/grading/hidden.py``),
run where no cell of the notebook runs: a fresh sandboxed process (``kvcourse/grading/isolated.py``)
runs the cells above the check cell, the learner's as their definitions only, calls the learner's
function on each case and hands the observations back on a pipe of its own; no cell the learner
added below can touch them.

An exercise passes when its check cell prints what the key holds (the cases the notebook shows) and
every hidden case gives what the stage's independent answer gives; this grader process, which never
runs the learner's code, makes that comparison. It is not credited, whatever it printed, when its
answer runs the stage's own implementation, or any identical copy of it (the hidden cases' watch
knows the code by what it is, not where it lives; the source imports it: ``kvcourse/grading/integrity.py``),
or reaches for another stage's code; no exercise is credited when the learner's code changes the
grader, or tries to while its hidden cases run (the isolated run refuses and reports it). The
gradebook's note column says why, and what happened when a kernel died or a cell ran out of time.

The independent answers are the answer key's, ``key/LN_*/answers.py``. A student release (``make
release``, ``kvcourse/tools/release.py``) has no ``key/``: its bundle holds it, and ``--key BUNDLE``
(``KEY=``) makes the grader import the answers from there (``use_key``); the sandbox hides the bundle as
it hides ``key/`` here.
Without it, a learner's ``make grade NB=...`` in a release grades the cases the notebook shows and says
the hidden ones are the instructor's; a class (``DIR=``) is refused.

Left out on purpose: partial credit (an exercise passes or fails), and grading a notebook whose cells
lost their ids (Jupyter keeps them; such a notebook is refused with a note).
"""

from __future__ import annotations

import argparse
import ast
import csv
import importlib.util
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from kvcourse.grading import hidden
from kvcourse.grading.exercises import CHECK_MARKER, NOTEBOOKS, ROOT, read, render, stage_of
from kvcourse.grading.integrity import Finding, scan
from kvcourse.grading.sandbox import INSTALL_HINT, Sandbox, bwrap_works
from kvcourse.harness.stages import STAGES

WORKSPACE = ROOT / "workspace"
SANITIZE = NOTEBOOKS / "sanitize.cfg"
CELL_TIMEOUT = 60  # seconds one cell may run (TIMEOUT=); the slowest reference cell takes 20 s here
NOTEBOOK_TIMEOUT = 1800  # seconds one notebook may take in all, cells and kernel start included
MEMORY_BYTES = 8 << 30  # address space of each process of a submission
UNSAFE_NOTE = "graded WITHOUT a sandbox (--no-sandbox): the notebook ran with the grader's permissions"
STUB_TITLE_RE = re.compile(r'raise NotImplementedError\("Exercise (L\d+\.\d+)(?::\s*(.*?))?"\)')


@dataclass
class Exercise:
    exercise_id: str  # "L2.3"
    title: str  # "allocate_slots"
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
    refused: str | None = None  # why the notebook was not graded at all
    notes: list[str] = field(default_factory=list)  # what the gradebook's note column says
    seed: int | None = None

    @property
    def passed(self) -> int:
        return sum(v.passed for v in self.verdicts)

    @property
    def note(self) -> str:
        return "; ".join(([f"not graded: {self.refused}"] if self.refused else []) + self.notes)


@dataclass
class RunCell:
    """One code cell of the notebook the grader runs, and what it is there for."""

    source: str
    role: str  # "course", "learner" or "check"
    exercise_id: str | None  # the exercise whose span holds it (None: setup, or after the last one)


def is_check(cell) -> bool:
    return cell.cell_type == "code" and CHECK_MARKER in cell.source


def tags(cell) -> list[str]:
    return cell.get("metadata", {}).get("tags", [])


def package_of(name: str) -> str:
    """The stage package of a notebook file name: ``"L2_token_flat.ipynb" -> "L2_token_flat"``."""
    stage = stage_of(name)
    if stage not in STAGES:
        raise ValueError(f"{name}: not a stage's notebook")
    return STAGES[stage]


NO_KEY = "this copy of the course has no answer key (your instructor's make grade KEY=... grades them)"


def use_key(bundle: Path | None) -> str | None:
    """Make the answer key importable as the package ``key`` (every stage's independent answers are
    ``key.<stage>.answers``), from ``bundle/key`` (a release's autograder folder) when given, else from
    this course's ``key/``; None when every stage's answers are there, else what is missing and how to
    give it. The key comes from that folder only, never from elsewhere on ``sys.path`` (another
    checkout's), so a student release without the bundle has none."""
    folder = (bundle if bundle is not None else ROOT) / "key"
    if (folder / "__init__.py").is_file():
        spec = importlib.util.spec_from_file_location(
            "key", folder / "__init__.py", submodule_search_locations=[str(folder)]
        )
        sys.modules["key"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["key"])
    else:
        sys.modules["key"] = None  # import key fails: this copy has no answer key
    for package in STAGES.values():
        missing = [
            f
            for f in ("__init__.py", f"{package}/__init__.py", f"{package}/answers.py")
            if not (folder / f).is_file()
        ]
        if missing:
            where = f"{bundle} has no key/{missing[0]}" if bundle else "this is a student release"
            return (
                f"the answer key is not here ({where}): grade with the autograder bundle that "
                "make release wrote beside the course, make grade KEY=path/to/autograder ..."
            )
    return None


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
    keys = sorted(NOTEBOOKS.glob("L[0-9]*_*.ipynb"))
    ids = {c.get("id") for c in nb.cells} - {None}
    best = max(keys, key=lambda k: len(ids & {c.get("id") for c in read(k).cells}), default=None)
    if best is not None and ids & {c.get("id") for c in read(best).cells}:
        return best, read(best)
    m = re.search(r"(L\d+)", path.name)
    named = [k for k in keys if m and k.name.startswith(m[1] + "_")]
    if not named:
        raise ValueError(f"{path}: cannot tell which stage's exercises this notebook holds")
    return named[0], read(named[0])


def check_cells_edited(nb, key) -> str | None:
    """Which of the learner's check cells differ from the key's (edited, missing), or None."""
    mine = {c.get("id"): c.source for c in nb.cells if c.cell_type == "code"}
    changed = [
        k
        for k, cell in enumerate((c for c in key.cells if is_check(c)), start=1)
        if mine.get(cell.get("id")) != cell.source
    ]
    if not changed:
        return None
    return f"check cell {', '.join(map(str, changed))} edited or missing (the exercise notebook's were run)"


def check_args(check_source: str) -> str:
    """The arguments of a check cell's call, as source: ``checks.check_free(free)`` -> ``"free"``."""
    call = next(
        node.value
        for node in ast.parse(check_source).body
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
    )
    return ", ".join(ast.unparse(a) for a in call.args)


def build_run(nb, key, exercises: list[Exercise], only: str | None) -> list[RunCell]:
    """The cells the grader runs (see the module docstring) and which of them are the learner's.

    Each of the learner's cells sits where the learner put it: after the key cell it follows.
    """
    chosen = next((e for e in exercises if e.exercise_id == only), None) if only else None
    if only and chosen is None:
        raise ValueError(
            f"no exercise {only} in this notebook (it has {', '.join(e.exercise_id for e in exercises)})"
        )
    key_ids = {c.get("id") for c in key.cells}
    added: dict[str | None, list[str]] = {}  # key cell id -> the learner's cells after it
    mine: dict[str, str] = {}
    after = None
    for cell in nb.cells:
        if cell.get("id") in key_ids:
            after = cell.get("id")
            mine[after] = cell.source
        elif cell.cell_type == "code" and cell.source.strip():
            added.setdefault(after, []).append(cell.source)
    span_of = {}  # key cell index -> the exercise whose span holds it
    for ex in exercises:
        span_of.update({i: ex for i in range(ex.first, ex.check + 1)})
    last_setup = max((i for i, c in enumerate(key.cells) if "setup" in tags(c)), default=-1)
    cells: list[RunCell] = []
    for i, cell in enumerate(key.cells):
        ex = span_of.get(i)
        keep = chosen is None or ex is chosen or "setup" in tags(cell)
        if cell.cell_type == "code" and keep and "demo" not in tags(cell):
            exercise_id = ex.exercise_id if ex else None
            if is_check(cell):
                cells.append(RunCell(cell.source, "check", exercise_id))
            elif STUB_TITLE_RE.search(cell.source):
                if cell.get("id") in mine:  # deleted: the learner's answer may sit in a cell of their own
                    cells.append(RunCell(mine[cell.get("id")], "learner", exercise_id))
            else:
                cells.append(RunCell(cell.source, "course", exercise_id))
        if keep:
            extra = added.pop(cell.get("id"), [])
            if i == last_setup:  # cells added above the setup cells run after them
                extra = added.pop(None, []) + extra
            below = span_of.get(i + 1)  # an added cell belongs to the span it sits in
            cells += [RunCell(source, "learner", below.exercise_id if below else None) for source in extra]
    return cells


def nbval_command(notebook: Path, sanitize: Path, cell_timeout: int) -> list[str]:
    """pytest with the report and nbval alone: with ``PYTEST_DISABLE_PLUGIN_AUTOLOAD`` no other installed
    plugin loads (hypothesis's took 1.9 s of every run's start here, and a plugin a learner added has no
    say in a grade). The report loads first, so that its package's ``__init__`` keeps rfc3987_syntax out
    before nbval imports nbformat."""
    return [
        sys.executable, "-m", "pytest", "-p", "kvcourse.grading.nbval_report", "-p", "nbval.plugin",
        "--nbval-lax", "--nbval-current-env", "--nbval-sanitize-with", str(sanitize),
        f"--nbval-cell-timeout={cell_timeout}", "-p", "no:cacheprovider", "-o", "addopts=", "-q", str(notebook),
    ]  # fmt: skip


def run_nbval(
    notebook: Path, workdir: Path, cell_timeout: int, box: Sandbox
) -> tuple[list[dict] | str, bool]:
    """Run nbval on one notebook in a fresh kernel, in the sandbox: each code cell's record (as far as
    the run got) or why nothing could be read, and whether the run was stopped at ``NOTEBOOK_TIMEOUT``."""
    report = workdir / "cells.json"
    sanitize = workdir / SANITIZE.name
    sanitize.write_bytes(SANITIZE.read_bytes())  # the run reads it from its work folder
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "KVCOURSE_NBVAL"))
    }
    env.update(OMP_WAIT_POLICY="PASSIVE", MPLBACKEND="Agg", KVCOURSE_NBVAL_REPORT=str(report))
    env.update(MPLCONFIGDIR=str(workdir / "mpl"), JUPYTER_RUNTIME_DIR=str(workdir / "runtime"))
    env.update(PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")  # see nbval_command
    argv, limits = box.wrap(nbval_command(notebook, sanitize, cell_timeout), workdir)
    proc = subprocess.Popen(
        argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=limits,
        start_new_session=True,
    )  # fmt: skip
    stopped, output = False, ""
    try:
        output = proc.communicate(timeout=NOTEBOOK_TIMEOUT)[0].decode(errors="replace")
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.communicate()
        stopped = True
    if not report.exists():
        said = output.strip().splitlines()[-1:] or ["no output"]
        return f"the notebook could not be run ({said[0][:200]})", stopped
    return json.loads(report.read_text(encoding="utf-8")), stopped


def run_isolated(
    cells: list[RunCell], graded: list[Exercise], package: str, seed: int, seconds: int, box: Sandbox
) -> dict[str, dict] | str:
    """Each graded exercise's hidden-case findings, from a fresh sandboxed process that runs no cell
    of the notebook (``kvcourse/grading/isolated.py``), or why none came back."""
    checks_at = {c.exercise_id: i for i, c in enumerate(cells) if c.role == "check"}
    request = {
        "package": package,
        "seed": seed,
        "seconds": seconds,
        "cells": [{"role": c.role, "source": c.source, "exercise": c.exercise_id} for c in cells],
        "exercises": [
            {"id": e.exercise_id, "check": checks_at[e.exercise_id], "args": check_args(cells[checks_at[e.exercise_id]].source)}
            for e in graded
        ],
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env.update(OMP_WAIT_POLICY="PASSIVE", MPLBACKEND="Agg")
    argv, limits = box.wrap([sys.executable, "-m", "kvcourse.grading.isolated"], None)
    try:
        done = subprocess.run(
            argv, cwd=ROOT, env=env, input=json.dumps(request).encode(), capture_output=True,
            preexec_fn=limits, start_new_session=True, timeout=NOTEBOOK_TIMEOUT,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return f"the hidden cases ran past {NOTEBOOK_TIMEOUT} s in all"
    found = {}
    for line in done.stdout.decode(errors="replace").splitlines():
        try:
            result = json.loads(line)
        except ValueError:
            continue
        if isinstance(result, dict) and result.get("exercise") in checks_at:
            found[result["exercise"]] = result
    if not found:
        said = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        return f"the hidden cases could not be run ({said[0][:200]})"
    return found


def visible_verdict(record: dict | None) -> tuple[bool, str, list[str]]:
    """(passed, summary, failing lines) of a check cell, from its record."""
    if record is None:
        return False, "FAIL, its check cell did not run", []
    lines = record["text"].splitlines()
    cases = [line for line in lines if line.startswith("case ")]
    failing = [line for line in cases if not line.endswith(": ok")]
    if record["passed"]:
        return True, "PASS", []
    if record["status"] in ("died", "dead"):
        return False, "FAIL, the kernel died before its check cell finished", []
    if record["status"] == "timeout":
        return False, "FAIL, its check cell ran out of time", []
    if record["error"] and not cases:
        return False, f"FAIL, the check cell raised {record['error'].splitlines()[0]}", []
    if cases and all("raised NotImplementedError" in line for line in failing) and len(failing) == len(cases):
        return False, "FAIL, not done yet (it raises NotImplementedError)", []
    if not failing:  # every case passed, yet the output differs: extra or missing lines
        return False, "FAIL, its output differs from the expected one", lines
    return False, f"FAIL, {len(cases) - len(failing)} of {len(cases)} cases pass", failing


def what_happened(cells: list[RunCell], records: dict[int, dict], cell_timeout: int) -> list[str]:
    """Notes on cells that did not end normally: a dead kernel, a cell out of time."""
    notes = []
    for index, record in sorted(records.items()):
        cell = cells[index]
        where = f"the cell of {cell.exercise_id}" if cell.exercise_id else f"code cell {index + 1}"
        if record["status"] == "died":
            notes.append(f"kernel died in {where}")
        elif record["status"] == "timeout":
            notes.append(f"{cell.exercise_id or f'code cell {index + 1}'} timed out after {cell_timeout} s")
    return notes


def grade(
    path: Path,
    only: str | None = None,
    cell_timeout: int = CELL_TIMEOUT,
    seed: int | None = None,
    box: Sandbox | None = None,
    shown: str | None = None,
    hidden_cases: bool = True,
) -> Grade:
    """Grade one notebook (``only``: one exercise id); ``hidden_cases=False`` grades the cases the
    notebook shows only (a student release without its answer key)."""
    shown = shown or str(path)
    seed = (new_seed() if seed is None else seed) if hidden_cases else None
    box = box or Sandbox.here(ROOT, MEMORY_BYTES, 2 * NOTEBOOK_TIMEOUT)
    try:
        nb = read(path)
        key_path, key = answer_key_for(nb, path)
        package = package_of(key_path.name)
    except Exception as e:  # not a notebook, or not one of the course's
        return Grade(shown, [], refused=f"cannot read it as a course notebook ({str(e).splitlines()[0]})")
    exercises = exercises_of(key)
    graded = [e for e in exercises if only is None or e.exercise_id == only]
    if not {c.get("id") for c in nb.cells} & {c.get("id") for c in key.cells}:
        why = "its cells have no ids that match the exercise notebook's (was it saved by an old tool?)"
        return Grade(shown, [Verdict(e, False, "FAIL, not graded") for e in graded], refused=why)
    checks = hidden.checks_of(package)
    with tempfile.TemporaryDirectory(prefix="kvcourse-grade-") as tmp:
        workdir = Path(tmp)
        cells = build_run(nb, key, exercises, only)
        run = nbformat.v4.new_notebook(
            cells=[nbformat.v4.new_code_cell(c.source) for c in cells], metadata=key.metadata
        )
        for cell, keyed in zip(run.cells, cells, strict=True):
            if keyed.role == "check":  # the key's expected output, for nbval to compare
                cell.outputs = next(c.outputs for c in key.cells if c.source == keyed.source)
                cell.execution_count = 1
        target = workdir / path.name
        target.write_text(render(run), encoding="utf-8")
        records, stopped = run_nbval(target, workdir, cell_timeout, box)
    if isinstance(records, str):
        return Grade(
            shown, [Verdict(e, False, "FAIL, not graded") for e in graded], refused=records, seed=seed
        )
    by_cell = {r["cell"]: r for r in records}
    check_at = {c.exercise_id: i for i, c in enumerate(cells) if c.role == "check"}
    notes = [] if only else [n for n in [check_cells_edited(nb, key)] if n]
    learner = [(c.exercise_id, c.source) for c in cells if c.role == "learner"]
    findings = scan(learner, {e.exercise_id: checks.HIDDEN[e.exercise_id].answers for e in graded})
    # the hidden cases run for the exercises that can still be credited: their cases shown pass, the
    # source neither changes the grader nor takes the stage's own answer
    barred = {f.exercise_id for f in findings if f.kind == "alias"}
    barred |= {e.exercise_id for e in graded} if any(f.kind == "tamper" for f in findings) else set()
    to_run = [
        e
        for e in graded
        if visible_verdict(by_cell.get(check_at[e.exercise_id]))[0] and e.exercise_id not in barred
    ]
    found: dict[str, dict] | str = {}
    if hidden_cases and to_run:
        # the hidden cases end on their own, well before nbval's cell limit would have interrupted them
        found = run_isolated(cells, to_run, package, seed, max(1, cell_timeout // 2), box)
    if isinstance(found, str):
        notes_run, found = [found], {}
    else:
        notes_run = []
    for result in found.values():  # what the learner's code tried while its hidden cases ran
        for what in result["tampered"]:
            if what.endswith(("another stage's code", "outside its stage")):
                continue  # reaching for the stage's code elsewhere: that exercise is not credited
            findings.append(Finding(None, "tamper", f"{what}, while the hidden cases of {result['exercise']} ran"))
    tampered = [f for f in findings if f.kind == "tamper"]
    if tampered:
        where = f" in the cell of {tampered[0].exercise_id}" if tampered[0].exercise_id else ""
        notes.append(f"changes the grader: {tampered[0].what}{where}; nothing credited")
    verdicts = []
    for ex in graded:
        passed, summary, failures = visible_verdict(by_cell.get(check_at[ex.exercise_id]))
        result = found.get(ex.exercise_id)
        record = result if result and result["observations"] is not None else None
        problems = hidden.judge(package, ex.exercise_id, seed, record) if hidden_cases and passed else []
        if result and record is None:
            problems = [f"hidden cases: no record came back (the process that ran them: {result['status']})"]
        aliased = [f.what for f in findings if f.kind == "alias" and f.exercise_id == ex.exercise_id]
        aliased += [
            f"runs {t.partition(':')[2]}, the stage's own answer" for t in (result or {}).get("aliased", [])
        ]
        aliased += [
            w for w in (result or {}).get("tampered", []) if w.endswith(("another stage's code", "outside its stage"))
        ]
        if aliased:
            notes.append(f"{ex.exercise_id} not credited: {aliased[0]}")
            passed, summary = False, "FAIL, not credited: the answer uses the stage's own implementation"
        elif tampered:
            passed, summary = False, "FAIL, not credited: the notebook changes the grader"
        elif passed and problems:
            total = len(record["observations"]) if record else 0
            passed, summary = (
                False,
                f"FAIL, the cases shown pass, {len(problems)} of {total} hidden cases fail",
            )
            failures = problems
        if passed and not hidden_cases:
            summary = "PASS on the cases shown"
        verdicts.append(Verdict(ex, passed, summary, failures))
    if not hidden_cases:
        notes.append(f"hidden cases not graded: {NO_KEY}")
    notes += notes_run + what_happened(cells, by_cell, cell_timeout)
    if stopped:
        notes.append(f"the notebook ran past {NOTEBOOK_TIMEOUT} s in all and was stopped")
    return Grade(shown, verdicts, notes=notes, seed=seed)


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
    lines += [f"note: {note}" for note in g.notes]
    if g.seed is not None:
        lines.append(f"hidden cases: seed {g.seed} (SEED={g.seed} grades them again)")
    lines.append(f"graded {g.path}: {g.passed}/{len(g.verdicts)} exercises pass")
    return "\n".join(lines)


def new_seed() -> int:
    return random.SystemRandom().randrange(1, 100_000)


def gradebook(folder: Path, cell_timeout: int, seed: int, box: Sandbox, unsafe: str | None = None) -> Path:
    """Grade every notebook in ``folder``, each in its own sandboxed kernel, all on the same hidden
    cases; write gradebook.csv. ``unsafe``: the note every row gets when no sandbox was used."""
    grades = []
    for nb in sorted(folder.glob("*.ipynb")):
        t0 = time.perf_counter()
        g = grade(nb, cell_timeout=cell_timeout, seed=seed, box=box, shown=str(nb))
        g.notes += [unsafe] if unsafe else []
        print(report(g), f"({time.perf_counter() - t0:.0f} s)", flush=True)
        print()
        grades.append(g)
    columns = sorted({v.exercise.exercise_id for g in grades for v in g.verdicts}, key=_exercise_order)
    out = folder / "gradebook.csv"
    with out.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["notebook", *columns, "passed", "total", "seed", "note"])
        for g in grades:
            marks = {v.exercise.exercise_id: "pass" if v.passed else "fail" for v in g.verdicts}
            row = [Path(g.path).name, *(marks.get(c, "") for c in columns), g.passed, len(g.verdicts)]
            writer.writerow([*row, g.seed if g.seed is not None else "", g.note])
    width = max((len(Path(g.path).name) for g in grades), default=8)
    print(f"{'notebook':<{width}}  passed")
    for g in grades:
        print(
            f"{Path(g.path).name:<{width}}  {g.passed}/{len(g.verdicts)}"
            + (f"  ({g.note})" if g.note else "")
        )
    print(f"wrote {out}")
    return out


def _exercise_order(exercise_id: str) -> tuple[int, int]:
    stage, number = exercise_id[1:].split(".")
    return int(stage), int(number)


def known_exercises() -> list[str]:
    """Every exercise id of the exercise notebooks: ``["L1.1", ..., "L6.4"]``."""
    keys = sorted(NOTEBOOKS.glob("L[0-9]*_*.ipynb"))
    found = [ex.exercise_id for key in keys for ex in exercises_of(read(key))]
    return sorted(found, key=_exercise_order)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvcourse.grading.gradebook", description=__doc__.splitlines()[0]
    )
    parser.add_argument("notebook", nargs="*", help="notebooks to grade (default: every one in workspace/)")
    parser.add_argument("--exercise", help="grade one exercise only, e.g. L2.2")
    parser.add_argument("--dir", help="grade every notebook of a folder and write its gradebook.csv")
    parser.add_argument("--timeout", type=int, default=CELL_TIMEOUT, help="seconds one cell may run")
    parser.add_argument("--seed", type=int, help="the hidden cases' seed (default: a new one each run)")
    parser.add_argument("--key", help="a student release's autograder bundle (make release)")
    parser.add_argument(
        "--no-sandbox", action="store_true",
        help="grade a class or with KEY= even without bubblewrap (every row's note says so)",
    )  # fmt: skip
    args = parser.parse_args(argv)

    def fail(message: str) -> int:
        print(f"error: {message}", file=sys.stderr)
        return 2

    if args.timeout < 1:
        return fail(f"--timeout must be >= 1 second, got {args.timeout}")
    if args.exercise and args.exercise not in known_exercises():
        return fail(f"no exercise {args.exercise!r}; the exercises are {', '.join(known_exercises())}")
    bundle = Path(args.key).resolve() if args.key else None
    if bundle is not None and not bundle.is_dir():
        return fail(f"KEY={args.key} is not a folder (the autograder bundle of make release)")
    missing_key = use_key(bundle)
    if missing_key and (bundle is not None or args.dir):
        return fail(missing_key)
    if missing_key:
        print(f"note: {NO_KEY}: grading the cases each notebook shows", file=sys.stderr)
    box = Sandbox.here(ROOT, MEMORY_BYTES, 2 * NOTEBOOK_TIMEOUT, key=bundle)
    if box.warning():
        print(box.warning(), file=sys.stderr)
    if not box.use_bwrap and (args.dir or bundle is not None) and not args.no_sandbox:
        return fail(
            f"{bwrap_works()}: refusing to grade untrusted notebooks without a sandbox (their code would "
            f"run with your permissions: it could read the answer key). Install it: {INSTALL_HINT}; or "
            "grade anyway with --no-sandbox (make grade ... UNSAFE=1), which every row's note says"
        )
    unsafe = UNSAFE_NOTE if not box.use_bwrap and args.no_sandbox else None
    if args.dir:
        folder = Path(args.dir)
        if not folder.is_dir():
            return fail(f"{folder} is not a folder")
        gradebook(folder, args.timeout, new_seed() if args.seed is None else args.seed, box, unsafe)
        return 0
    paths = [Path(p) for p in args.notebook] or sorted(WORKSPACE.glob("L[0-9]*_*.ipynb"))
    if not paths:
        return fail("no notebooks in workspace/: run `make workspace` first, or give NB=path")
    missing = [p for p in paths if not p.is_file()]
    if missing:
        return fail(f"{missing[0]} does not exist")
    status = 0
    for path in paths:
        try:
            g = grade(
                path,
                only=args.exercise,
                cell_timeout=args.timeout,
                seed=args.seed,
                box=box,
                hidden_cases=missing_key is None,
            )
        except ValueError as e:  # EX= names an exercise of another notebook
            return fail(str(e))
        g.notes += [unsafe] if unsafe else []
        print(report(g), flush=True)
        status |= g.refused is not None or g.passed < len(g.verdicts)
    return 1 if status else 0


if __name__ == "__main__":
    sys.exit(main())
