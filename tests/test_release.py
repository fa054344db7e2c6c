"""A student release holds no answer, and grading with its autograder bundle gives today's verdicts.

``make release DIR=...`` (``kvcourse/tools/release.py``) writes ``DIR/course`` for the class and
``DIR/autograder`` for the instructor. Here one release is made per test module, then:

- no file of the course is in the answer key (``key/``: the reference notebooks and the independent
  answers; the tests that read them), the bundle holds all of ``key/``, and the course is a git
  repository of one commit (no history to dig an old key out of);
- every exercise's solution region (the code between ``# BEGIN SOLUTION`` and ``# END SOLUTION`` in the
  reference notebooks), compared line by line without blank lines and comments, occurs in no file of the
  course. A warm-up's solution rebuilds a function of its stage, so it may occur in the stages' code
  (later stages copy it) and in other chapters, but not in the exercise notebooks or checkers, and in its
  own chapter only inside a folded ``<details>`` listing;
- without the bundle, the course's ``make grade`` grades a learner's notebook on the cases it shows
  (and says the hidden ones are the instructor's) and refuses a class, naming ``KEY=``; with it, an L2
  notebook's wrong answer gets the same report as in this repository, hidden cases included, line for
  line;
- the mutation list names no test that the release leaves out (its ``make mutants`` and
  ``tests/test_mutants.py`` need them);
- the release's chapters are what ``make numbers`` draws there, without the git history;
- the grading sandbox hides the bundle from the notebooks it runs, wherever the bundle lies.

Left out on purpose: running the release's whole ``make test`` (minutes; the closing check of an issue
does it from a fresh release).
"""

from __future__ import annotations

import fnmatch
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kvcourse.grading import exercises, gradebook
from kvcourse.grading.mutations import MUTATIONS
from kvcourse.grading.sandbox import Sandbox, bwrap_works
from kvcourse.harness.stages import STAGES
from kvcourse.model_store import cache_root
from kvcourse.tools import release

ROOT = Path(__file__).resolve().parent.parent
REFERENCES = exercises.reference_notebooks(ROOT / "key" / "notebooks")
DETAILS_RE = re.compile(r"<details>.*?</details>", re.S)


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> tuple[Path, Path]:
    return release.release(tmp_path_factory.mktemp("release") / "class")


def significant(text: str) -> list[str]:
    """The lines of ``text`` that say something: stripped, without blank lines and comments."""
    return [s for line in text.splitlines() if (s := line.strip()) and not s.startswith("#")]


def holds(text: str, needle: list[str]) -> bool:
    """Whether ``needle``'s lines occur one after another among ``text``'s significant lines."""
    hay = significant(text)
    return any(hay[i : i + len(needle)] == needle for i, line in enumerate(hay) if line == needle[0])


def texts(path: Path) -> list[str]:
    """What a file says: a notebook's cell sources one by one, any other text file whole."""
    if path.suffix == ".ipynb":
        return [cell.source for cell in exercises.read(path).cells]
    try:
        return [path.read_text(encoding="utf-8")]
    except UnicodeDecodeError:
        return []


def solution_regions() -> list[tuple[str, str, str, list[str]]]:
    """(exercise id, kind, stage package, significant lines) of every solution region of the course."""
    regions = []
    for ref in REFERENCES:
        nb, stage = exercises.read(ref), exercises.stage_of(ref)
        kinds = exercises.kinds(nb)
        for number, code in exercises.solutions(nb).items():
            exercise_id = f"{stage}.{number}"
            regions.append((exercise_id, kinds.get(exercise_id, "?"), STAGES[stage], significant(code)))
    return regions


def test_the_course_holds_no_file_of_the_key(made):
    course, key = made
    files = [p.relative_to(course).as_posix() for p in course.rglob("*") if p.is_file()]
    files = [f for f in files if not f.startswith(".git/")]
    assert files and not [f for f in files if release.in_key(f)]
    assert not (course / "key").exists() and not list(course.rglob("answers.py"))
    assert sorted(p.name for p in (course / "notebooks").glob("*.ipynb")) == [p.name for p in REFERENCES]
    for path in (course / "notebooks").glob("*.ipynb"):  # the exercise notebooks: no solution in them
        assert not exercises.solutions(exercises.read(path)), path.name
    assert sorted(p.name for p in (key / "key" / "notebooks").glob("*.ipynb")) == [p.name for p in REFERENCES]
    assert len(list(key.glob("key/L[0-9]*_*/answers.py"))) == len(STAGES)
    tracked_key = [p for p in release.tracked(ROOT) if p.startswith("key/")]
    assert (
        sorted(p.relative_to(key).as_posix() for p in (key / "key").rglob("*") if p.is_file()) == tracked_key
    )
    log = subprocess.run(["git", "log", "--oneline"], cwd=course, capture_output=True, text=True, check=True)
    assert len(log.stdout.splitlines()) == 1, log.stdout


def test_every_exercise_has_a_kind():
    for exercise_id, kind, _, _ in solution_regions():
        assert kind in exercises.KINDS, f"{exercise_id}: its heading names no kind ({kind})"


def test_no_solution_region_is_in_the_course(made):
    course, _ = made
    files = [p for p in course.rglob("*") if p.is_file() and ".git" not in p.relative_to(course).parts]
    found = []
    for exercise_id, kind, package, lines in solution_regions():
        assert lines, f"{exercise_id}: an empty solution region"
        for path in files:
            rel = path.relative_to(course).as_posix()
            chapter = rel == f"lessons/{package}.md"
            if kind == "warm-up" and not (chapter or rel.startswith(("exercises/", "notebooks/"))):
                continue  # a warm-up rebuilds stage code, which later stages copy and chapters show
            for text in texts(path):
                if kind == "warm-up" and chapter:
                    text = DETAILS_RE.sub("", text)  # folded behind "try the exercise first"
                if holds(text, lines):
                    found.append(f"{exercise_id} ({kind}) is in {rel}")
    assert not found, "\n".join(found)


def test_the_search_finds_a_solution_where_it_is():
    """The search can fail: a reference notebook holds its own solutions, a stub notebook does not."""
    exercise_id, _, _, lines = solution_regions()[0]
    ref = REFERENCES[0]
    assert any(holds(text, lines) for text in texts(ref)), exercise_id
    assert not any(holds(text, lines) for text in texts(exercises.exercise_path(ref)))


def grade(tree: Path, notebook: Path, *extra: str) -> subprocess.CompletedProcess:
    """``make grade``'s command, run from ``tree`` with its own code first on the path. No bytecode is
    cached there: the release stays as made for this module's other tests, which list its files."""
    env = {**os.environ, "PYTHONPATH": str(tree), "KVCOURSE_CACHE": str(cache_root()), "PYTHONDONTWRITEBYTECODE": "1"}
    command = [sys.executable, "-m", "kvcourse.grading.gradebook", str(notebook), "--seed", "7", *extra]
    return subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_grading_needs_the_bundle_and_with_it_gives_todays_verdicts(made, tmp_path):
    course, key = made
    reference = ROOT / "key" / "notebooks" / "L2_token_flat.ipynb"
    key_nb = exercises.read(exercises.exercise_path(reference))
    right = exercises.solutions(exercises.read(reference))
    answers = {1: right[1], 2: "return None  # wrong on purpose: frees nothing\n"}  # 3 and on: untouched
    notebook = tmp_path / "L2_token_flat.ipynb"
    notebook.write_text(exercises.render(exercises.put_back(key_nb, answers)), encoding="utf-8")

    shown = grade(course, notebook, "--exercise", "L2.1")  # a learner's copy: the cases shown, and a note
    assert "L2.1 alloc_blocks: PASS on the cases shown" in shown.stdout, shown.stdout + shown.stderr
    assert "hidden cases not graded" in shown.stdout and "seed" not in shown.stdout, shown.stdout
    (tmp_path / "class").mkdir()
    refused = subprocess.run(
        [sys.executable, "-m", "kvcourse.grading.gradebook", "--dir", str(tmp_path / "class")],
        cwd=course,
        env={**os.environ, "PYTHONPATH": str(course), "PYTHONDONTWRITEBYTECODE": "1"},
        capture_output=True,
        text=True,
    )
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "KEY=" in refused.stderr and "answer key" in refused.stderr, refused.stderr

    # the wrong answer, on the hidden cases too: only the cells L2.2 needs run (two kernels, not the class)
    here = grade(ROOT, notebook, "--exercise", "L2.2")
    unsafe = ["--no-sandbox"] if bwrap_works() else []  # without bubblewrap KEY= is refused otherwise
    there = grade(course, notebook, "--exercise", "L2.2", "--key", str(key), *unsafe)
    assert here.stdout.splitlines(), here.stderr
    there_lines = [x for x in there.stdout.splitlines() if x != f"note: {gradebook.UNSAFE_NOTE}"]
    assert here.stdout.splitlines() == there_lines, (here.stdout, there.stdout, there.stderr)
    assert "L2.2 free: FAIL" in here.stdout and "hidden case" in here.stdout, here.stdout


@pytest.mark.skipif(bwrap_works() is not None, reason=f"optional dependency missing: {bwrap_works()}")
def test_the_box_hides_the_bundle_wherever_it_is(tmp_path):
    """An instructor's bundle outside /tmp (here under the repository's ignored .cache) is covered in the
    box like the course's own key/."""
    (ROOT / ".cache").mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=ROOT / ".cache", prefix="bundle-") as bundle:
        answers = Path(bundle) / "key" / "L2_token_flat" / "answers.py"
        answers.parent.mkdir(parents=True)
        answers.write_text("SECRET = 1\n")
        probe = f"import os; print(os.path.exists({str(answers)!r}), os.listdir({bundle!r}))"
        for key, seen in ((None, "True ['key']"), (Path(bundle), "False []")):
            box = Sandbox.here(ROOT, memory_bytes=4 << 30, cpu_seconds=60, key=key)
            argv, limits = box.wrap([sys.executable, "-c", probe], tmp_path)
            done = subprocess.run(argv, capture_output=True, text=True, preexec_fn=limits, timeout=60)
            assert done.stdout.strip() == seen, (key, done.stdout, done.stderr)


def test_a_release_never_overwrites_and_stays_outside_the_course(made, tmp_path, capsys):
    course, _ = made
    with pytest.raises(ValueError, match="is not empty"):
        release.release(course.parent)
    assert release.main([str(ROOT / "workspace" / "class")]) == 2
    assert "inside the course" in capsys.readouterr().err
    assert release.main([]) == 2
    assert "make release DIR=" in capsys.readouterr().err


def test_the_release_draws_the_same_tables_without_the_history(made):
    """make numbers --check passes in the release, whose git history is one commit: a table's
    provenance line is read from its results file, never from git log."""
    course, _ = made
    done = subprocess.run(
        [sys.executable, "-m", "kvcourse.tools.numbers", "--check"],
        cwd=course,
        env={**os.environ, "PYTHONPATH": str(course), "PYTHONDONTWRITEBYTECODE": "1"},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_mutation_list_names_no_test_the_release_leaves_out():
    left_out = [
        (m.name, test)
        for m in MUTATIONS
        for test in m.tests
        if any(fnmatch.fnmatchcase(test.partition("::")[0], p) for p in release.KEY_TESTS)
    ]
    assert not left_out
