"""A student release of the course and its autograder bundle: ``python -m kvcourse.tools.release DIR``.

    make release DIR=/tmp/kv-class     writes /tmp/kv-class/course and /tmp/kv-class/autograder

``DIR/course`` is what a class clones: a git repository of one commit holding every file this
repository tracks except the answer key, which goes to ``DIR/autograder`` under the same paths:

- the answer key, the one folder ``key/``: the reference notebooks (``key/notebooks/LN_*.ipynb``, the
  exercises' solutions, executed) and each stage's independent answers (``key/LN_*/answers.py``, which
  the hidden cases are judged by);
- the tests that read it (``KEY_TESTS``: they check the key itself, so they belong with it).

The course keeps the chapters, the stages, the exercise notebooks (``notebooks/``: generated, solutions
stubbed), the checkers (``exercises/LN_*/checks.py``), the rest of the test suite and the grader. Its
``make grade`` needs the bundle: ``make grade KEY=/tmp/kv-class/autograder DIR=submissions/`` grades as this
repository does, and without ``KEY=`` it says so. The bundle never goes to the class.

What the release cannot hide: the warm-up exercises rebuild functions of the stages (the chapters
fold those listings behind a "try the exercise first" line), so their answers are in the stages'
code by design. No other exercise's solution is in the course: ``tests/test_release.py`` searches
every file of a release for every solution region.

Left out on purpose: the git history (the release is one new commit, so no earlier answer key can be
dug out of it) and anything not tracked by git (``workspace/``, ``.venv``, caches).
"""

from __future__ import annotations

import argparse
import fnmatch
import shutil
import subprocess
import sys
from pathlib import Path

from kvcourse.model_store import REPO_ROOT

KEY = "key/"  # the answer key: one folder
KEY_TESTS = (
    "tests/test_exercises_*.py",  # each exercise's checker against the independent answer
    "tests/test_grading.py",  # grades the reference notebooks
    "tests/submissions.py",  # submissions built from the reference solutions, for the test above
    "tests/checker_asserts.py",  # what the tests of the exercises assert on a checker's lines
    "tests/test_hidden.py",  # the hidden cases against the independent answers
    "tests/test_integrity.py",  # the reference solutions give no finding
    "tests/test_release.py",  # this release, made from the full repository
)
AUTHOR = ("-c", "user.name=kvcourse release", "-c", "user.email=release@kvcourse.invalid")


def in_key(path: str) -> bool:
    """Whether a tracked file belongs to the answer key: ``in_key("key/L2_token_flat/answers.py")`` and
    ``in_key("tests/test_hidden.py")`` are True, ``in_key("notebooks/L2_token_flat.ipynb")`` is False."""
    return path.startswith(KEY) or any(fnmatch.fnmatchcase(path, pattern) for pattern in KEY_TESTS)


def tracked(root: Path = REPO_ROOT) -> list[str]:
    """The files git tracks in ``root``, as they are in the working tree now."""
    listing = subprocess.run(
        ["git", "ls-files", "-z"], cwd=root, capture_output=True, text=True, check=True
    ).stdout
    return sorted(p for p in listing.split("\0") if p and (root / p).is_file())


def release(out: Path, root: Path = REPO_ROOT) -> tuple[Path, Path]:
    """Write ``out/course`` (a one-commit git repository) and ``out/autograder``; return both."""
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} is not empty: give a new or empty folder (the release never overwrites)")
    course, key = out / "course", out / "autograder"
    for path in tracked(root):
        target = (key if in_key(path) else course) / path
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / path, target)
    (key / "README.md").write_text(BUNDLE_README, encoding="utf-8")
    for command in (
        ["init", "-q"],
        ["add", "-A"],
        [*AUTHOR, "commit", "-q", "-m", "kvcourse, student release"],
    ):
        subprocess.run(["git", *command], cwd=course, check=True, capture_output=True)
    return course, key


BUNDLE_README = """# kvcourse autograder bundle (instructors only: never give it to the class)

The answer key of one student release: `key/` (the reference notebooks in `key/notebooks/`, each
stage's independent answers in `key/LN_*/answers.py`) and the tests that check it, under the paths they
have in the full course.

Grade from the class's copy of the course with this folder as the key:

    make grade KEY=/path/to/autograder DIR=submissions/      a class: writes submissions/gradebook.csv
    make grade KEY=/path/to/autograder NB=workspace/L2_token_flat.ipynb

The grader imports the answers from here in its own process; the submissions run in a sandbox that
cannot see this folder.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvcourse.tools.release", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "dir", nargs="?", help="a new or empty folder: DIR/course and DIR/autograder go there"
    )
    args = parser.parse_args(argv)
    if not args.dir:
        print("error: give the folder to write: make release DIR=/path/to/new/folder", file=sys.stderr)
        return 2
    out = Path(args.dir).resolve()
    if out.is_relative_to(REPO_ROOT):
        print(f"error: {out} is inside the course; give a folder outside {REPO_ROOT}", file=sys.stderr)
        return 2
    try:
        course, key = release(out)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    n_course = sum(1 for p in course.rglob("*") if p.is_file() and ".git" not in p.relative_to(course).parts)
    n_key = sum(1 for p in key.rglob("*") if p.is_file())
    print(f"{course}: the course for the class, {n_course} files (a git repository: clone it or push it)")
    print(f"{key}: the autograder bundle, {n_key} files (keep it: make grade KEY={key} ...)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
