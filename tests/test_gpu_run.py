"""``make gpu-run`` without a GPU: its refusal with the plan, a plan that fits its nine minutes and names
flags its commands take, and the run's bookkeeping (time limits, skips, the record) on stand-in steps."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvcourse.model_store import REPO_ROOT
from kvcourse.tools import gpu_run
from kvcourse.tools.gpu_run import Plan


def test_without_a_gpu_it_prints_its_plan_and_exits_2():
    run = subprocess.run(
        ["make", "-s", "gpu-run"],
        cwd=REPO_ROOT,
        env=os.environ | {"CUDA_VISIBLE_DEVICES": ""},
        capture_output=True,
        text=True,
    )
    assert run.returncode == 2, run.stdout + run.stderr
    steps = [line for line in run.stdout.splitlines() if line.lstrip()[:2] in {f"{i}." for i in range(1, 10)}]
    assert [s.split(",")[0].split(". ")[1] for s in steps] == [p.name for p in gpu_run.plan()]
    assert "error: make gpu-run needs a CUDA device: torch.cuda.is_available() is False" in run.stderr


def test_the_plan_fits_nine_minutes_and_every_flag_exists():
    """The required steps' usual seconds add up to at most 9 minutes; each command names a module
    whose --help lists every flag the plan passes it (asked of its ``main`` in this process: a new
    process per module spent 30 s importing torch and JAX again)."""
    steps = gpu_run.plan()
    assert sum(s.seconds for s in steps if not s.optional) <= 9 * 60
    helps = {}  # module -> its --help, asked once (bench.kernels runs three times)
    for step in steps:
        module, flags = step.command[2], [w for w in step.command[3:] if w.startswith("--")]
        if flags and module not in helps:
            out = io.StringIO()
            with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
                importlib.import_module(module).main(["--help"])
            assert exit_.value.code == 0, f"{module} --help: exit {exit_.value.code}"
            helps[module] = out.getvalue()
        for flag in flags:
            assert flag in helps[module], f"{step.name}: {module} has no {flag}"


def test_fits_keeps_the_required_steps_time():
    assert gpu_run.fits(Plan("bench (b)", [], 310, ""), 200, []) == "needs about 310 s, 200 s left"
    assert gpu_run.fits(Plan("a", [], 100, ""), 200, []) is None
    later = [Plan("b", [], 150, "")]
    assert gpu_run.fits(Plan("sweep", [], 100, "", optional=True), 200, later) == "needs about 100 s, 200 s left"


def fake_step(name: str, code: str, seconds: int = 1, optional: bool = False) -> Plan:
    return Plan(name, [sys.executable, "-c", code], seconds, "a stand-in", optional)


def test_a_run_records_each_step_and_skips_what_does_not_fit(monkeypatch, tmp_path, capsys):
    """Stand-in steps on a pretend GPU: one passes, one fails, one needs more time than the run has,
    one runs past what is left and is stopped; the record and the summary say each, with the card
    and the commit; the exit status is 1 (a step that ran failed)."""
    steps = [
        fake_step("passes", "print('fine')"),
        fake_step("fails", "import sys; print('broken'); sys.exit(3)"),
        fake_step("too big", "print('never')", seconds=10**6),
        fake_step("slow", "import time; time.sleep(60)"),
    ]
    monkeypatch.setattr(gpu_run, "plan", lambda: steps)
    monkeypatch.setattr(gpu_run, "no_gpu", lambda: None)
    monkeypatch.setattr(gpu_run, "wheel_site", lambda wheels, site: (None, "the pins"))
    monkeypatch.setattr(gpu_run, "shaped_model", lambda folder: folder)
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "Pretend GPU")
    assert gpu_run.main(["--out", str(tmp_path), "--minutes", "0.1", "--commit", "abc1234"]) == 1
    [folder] = (tmp_path / "gpu-runs").iterdir()
    record = json.loads((folder / "gpu-run.json").read_text())
    assert record["device_name"] == "Pretend GPU" and record["commit"] == "abc1234"
    assert [(s["name"], s["status"]) for s in record["steps"]] == [
        ("passes", "ok"),
        ("fails", "FAILED"),
        ("too big", "skipped"),
        ("slow", "timed out"),
    ]
    assert record["steps"][1]["note"] == "exit 3"
    assert record["steps"][2]["note"].startswith("skipped for time: needs about 1000000 s")
    assert Path(record["steps"][0]["log"]).read_text() == "fine\n"
    summary = (folder / "summary.txt").read_text()
    assert "gpu_run: 1/3 steps ran clean on Pretend GPU; 1 skipped for time" in summary
    assert summary.splitlines()[0].startswith("gpu_run on Pretend GPU, commit abc1234")


def test_wheels_are_needed_only_where_the_pins_are_missing(monkeypatch, tmp_path):
    assert gpu_run.wheel_site(tmp_path / "none", tmp_path / "site")[0] is None  # this venv has the pins
    monkeypatch.setattr(gpu_run, "PINNED", {"transformers": "0.0.1", "tokenizers": "0.0.1"})
    with pytest.raises(SystemExit, match=r"holds no wheels: run make gpu-wheels"):
        gpu_run.wheel_site(tmp_path / "none", tmp_path / "site")


def test_a_results_file_names_the_commit_a_copy_without_git_was_sent_at(monkeypatch):
    """On a GPU machine the tree is a copy without ``.git``: ``make gpu-run COMMIT=`` hands the commit to
    every step through ``KVCOURSE_COMMIT``, and the bench's results record it; in a checkout, git's."""
    import re

    from bench.measure import provenance
    from kvcourse.harness.provenance import COMMIT_ENV, tree_commit

    monkeypatch.delenv(COMMIT_ENV, raising=False)
    assert re.fullmatch(r"[0-9a-f]{7,}(\+dirty)?|unknown", tree_commit())
    assert tree_commit("abc1234") == "abc1234"
    monkeypatch.setenv(COMMIT_ENV, "def5678")
    assert tree_commit() == "def5678" and provenance()["commit"] == "def5678"
