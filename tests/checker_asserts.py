"""Assertions on what an exercise checker prints, shared by the tests/test_exercises_*.py files.

A checker prints one line per case (``case k (name): ok`` or ``WRONG — ...`` or ``raised ...``), then
``k/n passed``.
"""

from __future__ import annotations


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
