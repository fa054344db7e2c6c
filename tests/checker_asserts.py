"""Assertions on what an exercise checker prints, shared by the tests/test_exercises_*.py files.

A checker prints one line per case (``case k (name): ok`` or ``WRONG — ...`` or ``raised ...``), then
``k/n passed``. ``hidden_problems`` says what ``make grade`` makes of the same function on the
exercise's hidden cases (``kvcourse/hidden.py``).
"""

from __future__ import annotations

import contextlib
import io
import json
import tempfile
from pathlib import Path

from kvcourse import hidden


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
    """The hidden cases ``fn`` fails, in the grader's words (empty when all pass): harvested as in the
    learner's kernel (tripwires on the stage's own code), judged as in the grader's process."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / f"{exercise_id}.json"
        with contextlib.redirect_stdout(io.StringIO()):  # harvest's one line; the checker's stay captured
            hidden.harvest(package, exercise_id, fn, *context, seed=seed, out=str(out))
        record = json.loads(out.read_text(encoding="utf-8"))
    return hidden.judge(package, exercise_id, seed, record)
