"""The course's structure, checked: closed stages, a shared layer that only looks down, current diffs.

- every module of a stage imports only kvcourse, the standard library, third-party packages and its
  own stage; only ``lN_smoke.py`` imports another stage, and only the previous stage's engine;
- nothing in kvcourse/ imports a stage (``kvcourse/stages.py`` looks one up by name for the CLI);
- ``lessons/diffs/*.diff`` are what ``make diffs`` writes now, and the files a stage does not change
  are byte-identical to the previous stage's;
- every ```diff block a chapter shows is a run of lines of its stage's diff file, so a chapter never
  shows code that is not the code.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

from kvcourse import diffs
from kvcourse.stages import STAGES

ROOT = Path(__file__).resolve().parent.parent
STAGE_DIRS = list(STAGES.values())

# What each stage keeps from the previous one untouched (the diff's "unchanged, byte for byte").
IDENTICAL = {
    "L4_paged_kernel": ["allocator.py", "cache.py", "scheduler.py", "sequence.py"],
    "L5_clones": [
        "attention.py",
        "cpp_paged_attention.py",
        "paged_attention.cpp",
        "paged_attention.py",
        "triton_paged_attention.py",
    ],
}


def imported_modules(path: Path) -> list[tuple[str, int]]:
    """(top-level package, line) of every absolute import in a Python file; relative ones are ''."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(alias.name.split(".")[0], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append(("" if node.level else node.module.split(".")[0], node.lineno))
    return found


def previous_stage(stage: str) -> str | None:
    i = STAGE_DIRS.index(stage)
    return STAGE_DIRS[i - 1] if i else None


@pytest.mark.parametrize("stage", STAGE_DIRS)
def test_a_stage_imports_only_kvcourse_third_party_and_itself(stage):
    problems = []
    for path in sorted((ROOT / stage).glob("*.py")):
        smoke = path.name.endswith("_smoke.py")
        for module, line in imported_modules(path):
            if module not in STAGE_DIRS or module == stage:
                continue
            if smoke and module == previous_stage(stage):
                continue  # a smoke compares with the previous stage's engine
            problems.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
        text = path.read_text(encoding="utf-8")
        if "importlib" in text or "engine_class" in text:
            problems.append(f"{path.relative_to(ROOT)} looks a module up by name")
    assert not problems, "\n".join(problems)


def test_a_smoke_imports_the_previous_stage_engine_only():
    for stage in STAGE_DIRS[1:]:
        smoke = next((ROOT / stage).glob("l*_smoke.py"))
        text = smoke.read_text(encoding="utf-8")
        imports = re.findall(rf"from ({'|'.join(STAGE_DIRS)})\.(\w+) import", text)
        others = [(pkg, mod) for pkg, mod in imports if pkg != stage]
        assert others == [(previous_stage(stage), "engine")], f"{smoke.name}: {others}"


def test_kvcourse_imports_no_stage():
    problems = [
        f"kvcourse/{path.name}:{line} imports {module}"
        for path in sorted((ROOT / "kvcourse").glob("*.py"))
        for module, line in imported_modules(path)
        if module in STAGE_DIRS
    ]
    assert not problems, "\n".join(problems)


def test_imports_in_a_stage_resolve_to_real_packages():
    """A typo like ``from kvcours.model import ...`` would pass the scan above; every top-level
    package a stage imports must be the stage itself, kvcourse, the standard library or installed."""
    import importlib.util

    for stage in STAGE_DIRS:
        for path in (ROOT / stage).glob("*.py"):
            for module, line in imported_modules(path):
                if module and module not in sys.stdlib_module_names and module != "__future__":
                    assert importlib.util.find_spec(module), (
                        f"{path.relative_to(ROOT)}:{line}: no module {module}"
                    )


@pytest.mark.parametrize("old, new", diffs.pairs(), ids=[new for _, new in diffs.pairs()])
def test_committed_stage_diff_is_current(old, new):
    path = diffs.diff_path(old, new)
    assert path.exists(), f"{path} is missing: run `make diffs`"
    assert path.read_text(encoding="utf-8") == diffs.stage_diff(old, new), (
        f"{path} is stale: run `make diffs`"
    )


@pytest.mark.parametrize("stage, names", IDENTICAL.items(), ids=list(IDENTICAL))
def test_files_a_stage_does_not_change_are_byte_identical(stage, names):
    before = previous_stage(stage)
    for name in names:
        assert (ROOT / stage / name).read_bytes() == (ROOT / before / name).read_bytes(), f"{stage}/{name}"
    header = diffs.diff_path(before, stage).read_text(encoding="utf-8").splitlines()[1]
    assert header == f"# unchanged, byte for byte: {', '.join(sorted(names))}"


@pytest.mark.parametrize("old, new", diffs.pairs(), ids=[new for _, new in diffs.pairs()])
def test_a_chapter_shows_only_lines_of_its_stage_diff(old, new):
    chapter = (ROOT / "lessons" / f"{new}.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```diff\n(.*?)```", chapter, flags=re.S)
    assert blocks, f"lessons/{new}.md shows no ```diff block from {diffs.diff_path(old, new).name}"
    whole = diffs.diff_path(old, new).read_text(encoding="utf-8")
    for block in blocks:
        assert "\n" + block in "\n" + whole, (
            f"lessons/{new}.md shows a diff that is not in the diff file:\n{block}"
        )
