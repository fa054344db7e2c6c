"""Every committed results file says which code made it and when: a ``commit`` that is a clean tree's (a
short hash, never ``+dirty`` or ``unknown``) and a ``date`` (``YYYY-MM-DD``). The chapters quote these
files, and a number is only as good as the code a reader can check it out at.

Writers record both through ``bench.measure.provenance`` (``kvcourse.harness.provenance.tree_commit``),
which adds ``+dirty`` when a tracked file outside ``bench/results/`` and ``bench/plots/`` differs from
the commit: rerun from a clean checkout (commit first, ``git status`` clean), then commit the results.
"""

from __future__ import annotations

import json
import re

import pytest

from kvcourse.model_store import REPO_ROOT

RESULTS = sorted(
    [*(REPO_ROOT / "bench" / "results").glob("*.json"), *(REPO_ROOT / "bench" / "gpu-runs").rglob("*.json")]
)
COMMIT = re.compile(r"^[0-9a-f]{7,40}$")
DATE = re.compile(r"^\d{4}-\d{2}-\d{2}")

def provenance_problems(results: dict) -> list[str]:
    """What a results file's provenance lacks: ``provenance_problems({"commit": "c14a18f+dirty"})`` ->
    ``["commit 'c14a18f+dirty' is not a clean tree's short hash", "no date"]``."""
    problems = []
    commit = results.get("commit")
    if not commit:
        problems.append("no commit")
    elif not COMMIT.match(str(commit)):
        problems.append(f"commit {commit!r} is not a clean tree's short hash")
    date = results.get("date")
    if not date:
        problems.append("no date")
    elif not DATE.match(str(date)):
        problems.append(f"date {date!r} is not YYYY-MM-DD")
    return problems


def test_there_are_results_files():
    assert len(RESULTS) >= 10, RESULTS


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_every_results_file_records_a_clean_commit_and_a_date(path):
    results = json.loads(path.read_text(encoding="utf-8"))
    problems = provenance_problems(results) if isinstance(results, dict) else ["not a JSON object"]
    assert not problems, f"{path.relative_to(REPO_ROOT)}: " + "; ".join(problems)


def test_the_rule_catches_a_dirty_tree_a_missing_date_and_an_unknown_commit():
    assert provenance_problems({"commit": "046e8bc", "date": "2026-11-27"}) == []
    assert provenance_problems({"commit": "c14a18f+dirty", "date": "2026-11-26"}) == [
        "commit 'c14a18f+dirty' is not a clean tree's short hash"
    ]
    assert provenance_problems({"commit": "unknown", "date": "2026-11-26"})
    assert provenance_problems({"committed_in": "07dfa70", "when": "2026-11-25 17:01:34"}) == [
        "no commit",
        "no date",
    ]
    assert provenance_problems({}) == ["no commit", "no date"]


def test_a_tree_is_dirty_when_code_differs_not_when_a_results_file_does(tmp_path, monkeypatch):
    """``make bench`` calibrates (rewriting a tracked results file) and then measures in the same tree:
    its later results still name a clean commit; a changed source file makes the tree dirty."""
    import subprocess

    from kvcourse.harness import provenance

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)  # fmt: skip

    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "bench" / "plots").mkdir()
    for name in ("engine.py", "bench/results/step-cost-cpu.json", "bench/plots/curve.png"):
        (tmp_path / name).write_text("0\n")
    git("init", "-q")
    git("add", ".")
    git("commit", "-qm", "start")
    monkeypatch.delenv(provenance.COMMIT_ENV, raising=False)
    monkeypatch.setattr(provenance, "REPO_ROOT", tmp_path)
    clean = provenance.tree_commit()
    assert COMMIT.match(clean)
    (tmp_path / "bench/results/step-cost-cpu.json").write_text("1\n")
    (tmp_path / "bench/plots/curve.png").write_text("1\n")
    assert provenance.tree_commit() == clean
    (tmp_path / "engine.py").write_text("1\n")
    assert provenance.tree_commit() == clean + "+dirty"
