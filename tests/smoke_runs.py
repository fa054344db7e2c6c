"""A stage's smoke script run inside the test process, shared by tests/test_lN.py and tests/test_smokes.py."""

from __future__ import annotations

import importlib

from kvcourse.harness.smoke import smoke_main
from kvcourse.harness.stages import STAGES

COURSE_SMOKE_TOKENS = 8  # new tokens per prompt in make test's course-model smoke of L1 (make smoke: 64)


def smoke_module(stage: str):
    """The smoke script of a stage, imported as a module (its ``runs``, ``previous``, ``extra``)."""
    return importlib.import_module(f"{STAGES[stage]}.{stage.lower()}_smoke")


def run_smoke_in_process(stage: str, argv: list[str]) -> int:
    """``python LN_x/lN_smoke.py ARGV`` without a new process; returns its exit status."""
    mod = smoke_module(stage)
    return smoke_main(
        stage, mod.runs, getattr(mod, "previous", None), argv=argv, extra=getattr(mod, "extra", None)
    )


def course_smoke(stage: str, model_dir, capsys, prompts=None) -> tuple[int, str]:
    """A stage's smoke on the course model, COURSE_SMOKE_TOKENS new tokens per prompt, on the course
    prompt set or the file ``prompts``. Returns (exit status, everything it printed)."""
    argv = ["--model", str(model_dir), "--max-new-tokens", str(COURSE_SMOKE_TOKENS)]
    status = run_smoke_in_process(stage, argv + (["--prompts", str(prompts)] if prompts else []))
    return status, capsys.readouterr().out
