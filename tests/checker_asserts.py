"""Assertions on what an exercise checker prints, shared by the tests/test_exercises_*.py files.

A checker prints one line per case (``case k (name): ok`` or ``WRONG — ...`` or ``raised ...``), then
``k/n passed``. ``hidden_problems`` and ``assert_fails_hidden`` judge a function on an exercise's hidden
cases (``kvcourse/grading/hidden.py``) as the grader does.
"""

from __future__ import annotations

import contextlib
import io
import json
import tempfile
from pathlib import Path

from kvcourse.grading import hidden


def graded_lines(capsys) -> list[str]:
    """What a checker printed: one line per case, then ``k/n passed``."""
    return capsys.readouterr().out.strip().splitlines()


def assert_fails(lines: list[str], case_name: str) -> None:
    """The summary is not n/n, and the case whose name contains ``case_name`` says WRONG or raised."""
    passed, total = lines[-1].removesuffix(" passed").split("/")
    assert passed != total, lines
    named = [line for line in lines if line.startswith("case ") and case_name in line]
    assert named, f"no case named {case_name!r} in {lines}"
    assert any("WRONG" in line or "raised" in line for line in named), named


def assert_passes(lines: list[str]) -> None:
    """Every case ok and the summary n/n."""
    cases = [line for line in lines if line.startswith("case ")]
    assert cases and all(line.endswith(": ok") for line in cases), lines
    assert lines[-1] == f"{len(cases)}/{len(cases)} passed", lines


def hidden_problems(package: str, exercise_id: str, fn, *context, seed: int = 0) -> list[str]:
    """What the grader says of ``fn`` on an exercise's hidden cases drawn from ``seed``: the learner's
    side (``harvest``) then the grader's (``judge``), as ``make grade`` runs them; empty when all pass.
    ``context`` is what the check cell passes after the function (L1.2's engine)."""
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()):
        out = Path(tmp) / "hidden.json"
        hidden.harvest(package, exercise_id, fn, *context, seed=seed, out=str(out))
        record = json.loads(out.read_text())
    return hidden.judge(package, exercise_id, seed, record)


def assert_fails_hidden(package: str, exercise_id: str, fn, *context, seeds=(0, 1, 2)) -> None:
    """``fn`` fails the exercise's hidden cases of every seed in ``seeds``."""
    for seed in seeds:
        assert hidden_problems(package, exercise_id, fn, *context, seed=seed), (
            f"{getattr(fn, '__name__', fn)} passes the hidden cases of {exercise_id}, seed {seed}"
        )
