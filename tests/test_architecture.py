"""The course's structure, checked: closed stages, a shared layer that only looks down, current diffs.

- every module of a stage imports only kvcourse, the standard library, third-party packages and its
  own stage; only ``lN_smoke.py`` imports another stage, and only the previous stage's engine;
- a stage's lesson files (and its ``fast/`` paths) import only the part of kvcourse stages use
  (``kvcourse/*.py``); its scripts (``lN_*.py``) may add the harness;
- a stage's folder holds nothing of grading: no ``exercises/``, no checker or answer, no import of the
  grading (``kvcourse.grading``, ``exercises``, ``key``). The grading tree sits beside the stages, one
  package per stage: ``exercises/<stage>/checks.py`` (ships to a class) imports its own stage and never
  the answer key, ``key/<stage>/answers.py`` its own stage and checkers; each stage has both, a
  reference notebook ``key/notebooks/<stage>.ipynb`` and an exercise notebook ``notebooks/<stage>.ipynb``;
- kvcourse's layers only look down: runtime (``kvcourse/*.py``) < harness < grading < tools, and only
  the harness and the tools name a stage (nothing in kvcourse imports one; ``harness/stages.py`` looks
  one up by name for the CLI);
- ``lessons/diffs/*.diff`` are what ``make diffs`` writes now (each stage's lesson diff, its wings'
  diffs apart: ``fast/``, L5's ``beams/``), and the files a stage does not change are byte-identical to the previous stage's, its
  ``fast/`` folder included;
- the lesson path stays small: no engine of L1-L5 over 300 lines (their shared options and the pool's
  sizing live in ``kvcourse/engine_config.py``), L3's lesson diff adds at most 380 non-blank lines, L4's
  at most 300 (its kernels, kernel choice and decode graphs live in ``fast/``) and L5's at most 500
  (beam search lives in ``beams/``);
- the scheduler keeps the books: ``scheduler.py`` imports nothing that holds K/V and no wing, only the
  engine meets a wing, and L5's ``sequence.py`` knows nothing of beams;
- a stage taught in two steps (L5: the prefix cache, then clones) has its diff in two parts that add
  up to the whole: every changed paragraph lands in exactly one, by the rule ``make diffs`` declares;
- every ```diff block a chapter shows is a run of lines of its stage's diff file (or its wings'),
  so a chapter never shows code that is not the code.
"""

from __future__ import annotations

import ast
import difflib
import re
import sys
from collections import Counter
from pathlib import Path

import pytest

from kvcourse.harness.stages import STAGES
from kvcourse.tools import diffs, names

ROOT = Path(__file__).resolve().parent.parent
STAGE_DIRS = list(STAGES.values())
LAYERS = ("runtime", "harness", "grading", "tools")  # kvcourse's layers, lowest first
GRADING_TREE = ("exercises", "key")  # the checkers (they ship to a class) and the answer key (it does not)
STAGE_NAME = re.compile(rf"\b({'|'.join(STAGE_DIRS)})\b")

# What each stage keeps from the previous one untouched (the diff's "unchanged, byte for byte").
IDENTICAL = {
    "L4_paged_kernel": ["allocator.py", "cache.py", "scheduler.py", "sequence.py"],
    "L5_clones": [
        "attention.py",
        "paged_attention.py",
        "fast/__init__.py",
        "fast/cpp_paged_attention.py",
        "fast/paged_attention.cpp",
        "fast/split_kv.py",
        "fast/triton_paged_attention.py",
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


def kvcourse_layer(node: ast.Import | ast.ImportFrom) -> list[str]:
    """The kvcourse layer of each kvcourse module an import statement names: ``from kvcourse.harness
    import smoke`` -> ``["harness"]``, ``from kvcourse.model import x`` -> ``["runtime"]``."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif node.level or not node.module:
        return []
    elif node.module == "kvcourse":
        names = [f"kvcourse.{alias.name}" for alias in node.names]
    else:
        names = [node.module]
    parts = [name.split(".") for name in names if name.split(".")[0] == "kvcourse"]
    return [p[1] if len(p) > 1 and p[1] in LAYERS else "runtime" for p in parts]


def layer_of(path: Path) -> str:
    """The layer of a kvcourse module: ``kvcourse/harness/smoke.py`` -> ``"harness"``; the command
    line's entry point (``__main__.py``) is the harness's."""
    rel = path.relative_to(ROOT / "kvcourse").parts
    if rel == ("__main__.py",):
        return "harness"
    return rel[0] if len(rel) > 1 else "runtime"


def kvcourse_imports(path: Path) -> list[tuple[str, int]]:
    """(layer, line) of every kvcourse import in a Python file."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [
        (layer, node.lineno)
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for layer in kvcourse_layer(node)
    ]


def stage_part_layers(stage: str, path: Path) -> tuple[str, ...]:
    """The kvcourse layers a file of a stage may import: its lesson files and ``fast/`` only the
    runtime, its scripts (``lN_smoke.py``, ``l6_multihost.py``) the harness too; none the grading."""
    rel = path.relative_to(ROOT / stage)
    if len(rel.parts) == 1 and re.fullmatch(r"l[0-9]_\w+\.py", rel.name):
        return ("runtime", "harness")
    return ("runtime",)


@pytest.mark.parametrize("stage", STAGE_DIRS)
def test_a_stage_imports_only_kvcourse_third_party_and_itself(stage):
    problems = []
    for path in sorted((ROOT / stage).rglob("*.py")):
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
        allowed = stage_part_layers(stage, path)
        problems += [
            f"{path.relative_to(ROOT)}:{line} imports kvcourse's {layer} (allowed here: {', '.join(allowed)})"
            for layer, line in kvcourse_imports(path)
            if layer not in allowed
        ]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("stage", STAGE_DIRS)
def test_a_stage_holds_nothing_of_grading(stage):
    """A stage's folder holds its engine and parts, its smoke and (L4, L5) ``fast/``: no ``exercises/``
    folder, no checker or answer module, and no module that imports the grading in any form."""
    folder = ROOT / stage
    problems = [f"{stage}/exercises/ exists"] if (folder / "exercises").exists() else []
    for path in sorted(folder.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if path.name in ("checks.py", "answers.py"):
            problems.append(f"{rel} is grading code")
        problems += [f"{rel}:{line} imports {m}" for m, line in imported_modules(path) if m in GRADING_TREE]
        problems += [
            f"{rel}:{line} imports kvcourse's grading"
            for layer, line in kvcourse_imports(path)
            if layer == "grading"
        ]
    assert not problems, "\n".join(problems)


def test_the_grading_tree_has_one_package_per_stage():
    """Each stage has its checkers, its answers and both its notebooks, and nothing else is there (a
    student release has no ``key/``: ``tests/test_release.py`` checks that its bundle holds it whole)."""
    keyed = (ROOT / "key").exists()
    for tree, name in [("exercises", "checks.py")] + ([("key", "answers.py")] if keyed else []):
        assert (ROOT / tree / "__init__.py").is_file(), tree
        packages = sorted(p.name for p in (ROOT / tree).iterdir() if (p / "__init__.py").is_file())
        assert packages == sorted(STAGE_DIRS), (tree, packages)
        for stage in STAGE_DIRS:
            assert (ROOT / tree / stage / name).is_file(), f"{tree}/{stage}/{name}"
    for folder in ["notebooks"] + (["key/notebooks"] if keyed else []):
        notebooks = sorted(p.stem for p in (ROOT / folder).glob("*.ipynb"))
        assert notebooks == sorted(STAGE_DIRS), (folder, notebooks)


def grading_tree_problems(path: Path, stage: str, allowed: tuple[str, ...]) -> list[str]:
    """What a module of the grading tree for ``stage`` imports or names that it may not: another stage,
    or a package of the grading tree outside ``allowed`` (by import, or by name in a string, as a lookup
    with ``importlib`` would)."""
    rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    problems = [
        f"{rel}:{line} imports {m}"
        for m, line in imported_modules(path)
        if (m in STAGE_DIRS and m != stage) or (m in GRADING_TREE and m not in allowed) or m == ""
    ]
    for text, line in code_strings(path):
        named = re.match(r"(\w+)[./:]", text)
        if named and named[1] in GRADING_TREE and named[1] not in allowed:
            problems.append(f"{rel}:{line} names {named[1]} ({text[:40]!r})")
    return problems


@pytest.mark.parametrize("stage", STAGE_DIRS)
def test_the_checkers_never_reach_the_answer_key(stage):
    """``exercises/`` ships in a student release and ``key/`` does not: a checker imports its own stage,
    kvcourse and third-party packages, never the key (nor another stage); the answers import their
    stage and its checkers. No relative imports: each module names what it uses."""
    problems = []
    for path in sorted((ROOT / "exercises" / stage).rglob("*.py")):
        problems += grading_tree_problems(path, stage, allowed=("exercises",))
    for path in sorted((ROOT / "key" / stage).rglob("*.py")):
        problems += grading_tree_problems(path, stage, allowed=GRADING_TREE)
    assert not problems, "\n".join(problems)


def test_the_grading_tree_rules_can_fail(tmp_path):
    """A made-up checker that imports the key, one that looks it up by name and one that imports another
    stage are caught; so is a stage module that imports a checker."""
    bad = tmp_path / "checks.py"
    bad.write_text(
        "from key.L2_token_flat import answers\n"
        "import importlib\n"
        'ANSWERS = importlib.import_module("key.L2_token_flat.answers")\n'
        "from L3_block_tensor.allocator import BlockAllocator\n"
        "from L2_token_flat.allocator import BlockAllocator\n"
    )
    assert grading_tree_problems(bad, "L2_token_flat", allowed=("exercises",)) == [
        f"{bad}:1 imports key",
        f"{bad}:4 imports L3_block_tensor",
        f"{bad}:3 names key ('key.L2_token_flat.answers')",
    ]
    staged = tmp_path / "engine.py"
    staged.write_text("from exercises.L2_token_flat import checks\nfrom kvcourse.grading import hidden\n")
    assert [m for m, _ in imported_modules(staged) if m in GRADING_TREE] == ["exercises"]
    assert [layer for layer, _ in kvcourse_imports(staged)] == ["grading"]


def test_a_smoke_imports_the_previous_stage_engine_only():
    for stage in STAGE_DIRS[1:]:
        smoke = next((ROOT / stage).glob("l*_smoke.py"))
        text = smoke.read_text(encoding="utf-8")
        imports = re.findall(rf"from ({'|'.join(STAGE_DIRS)})\.(\w+) import", text)
        others = [(pkg, mod) for pkg, mod in imports if pkg != stage]
        assert others == [(previous_stage(stage), "engine")], f"{smoke.name}: {others}"


def kvcourse_modules() -> list[Path]:
    return sorted((ROOT / "kvcourse").rglob("*.py"))


def test_kvcourse_imports_no_stage():
    problems = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in kvcourse_modules()
        for module, line in imported_modules(path)
        if module in STAGE_DIRS
    ]
    assert not problems, "\n".join(problems)


def test_kvcourse_layers_only_look_down():
    problems = [
        f"{path.relative_to(ROOT)}:{line} ({layer_of(path)}) imports kvcourse's {layer}"
        for path in kvcourse_modules()
        for layer, line in kvcourse_imports(path)
        if LAYERS.index(layer) > LAYERS.index(layer_of(path))
    ]
    assert not problems, "\n".join(problems)


def code_strings(path: Path) -> list[tuple[str, int]]:
    """(text, line) of every string constant in a Python file that is not a docstring."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        (node.value, node.lineno)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    ]


def test_only_the_harness_and_the_tools_name_a_stage():
    """The stages' own names (``L4_paged_kernel``) appear in the code of the harness and the tools
    only; the runtime and grading find a stage through them (a docstring may still mention one)."""
    problems = [
        f"{path.relative_to(ROOT)}:{line} names {match.group(1)}"
        for path in kvcourse_modules()
        if layer_of(path) in ("runtime", "grading")
        for text, line in code_strings(path)
        for match in STAGE_NAME.finditer(text)
    ]
    assert not problems, "\n".join(problems)


def test_the_layer_tests_can_fail(tmp_path):
    """A made-up runtime module that imports the harness, and one that names a stage, are caught."""
    bad = tmp_path / "bad.py"
    bad.write_text('from kvcourse.harness.smoke import run\nWHERE = "L3_block_tensor/engine.py"\n')
    assert [layer for layer, _ in kvcourse_imports(bad)] == ["harness"]
    assert [m.group(1) for text, _ in code_strings(bad) for m in STAGE_NAME.finditer(text)] == [
        "L3_block_tensor"
    ]


def test_imports_in_a_stage_resolve_to_real_packages():
    """A typo like ``from kvcours.model import ...`` would pass the scan above; every top-level
    package a stage imports must be the stage itself, kvcourse, the standard library or installed."""
    import importlib.util

    for stage in STAGE_DIRS:
        for path in (ROOT / stage).rglob("*.py"):
            for module, line in imported_modules(path):
                if module and module not in sys.stdlib_module_names and module != "__future__":
                    assert importlib.util.find_spec(module), (
                        f"{path.relative_to(ROOT)}:{line}: no module {module}"
                    )


DIFF_FILES = diffs.outputs()


@pytest.mark.parametrize("path, text", DIFF_FILES, ids=[path.name for path, _ in DIFF_FILES])
def test_committed_diff_is_current(path, text):
    assert path.exists(), f"{path} is missing: run `make diffs`"
    assert path.read_text(encoding="utf-8") == text, f"{path} is stale: run `make diffs`"


def test_no_diff_file_is_left_over():
    """Every file in lessons/diffs/ is one make diffs writes (a renamed stage leaves no stale diff)."""
    written = sorted(path.name for path, _ in DIFF_FILES if path.parent.name == "diffs")
    assert sorted(p.name for p in (ROOT / "lessons" / "diffs").iterdir()) == written


@pytest.mark.parametrize("stage, names", IDENTICAL.items(), ids=list(IDENTICAL))
def test_files_a_stage_does_not_change_are_byte_identical(stage, names):
    before = previous_stage(stage)
    for name in names:
        assert (ROOT / stage / name).read_bytes() == (ROOT / before / name).read_bytes(), f"{stage}/{name}"
    header = diffs.diff_path(before, stage).read_text(encoding="utf-8").splitlines()[:5]
    lesson = sorted(name for name in names if not name.startswith(f"{diffs.FAST}/"))
    assert header[1] == f"# unchanged, byte for byte: {', '.join(lesson)}"
    fast = sorted(name for name in names if name.startswith(f"{diffs.FAST}/"))
    if fast:  # the whole fast/ folder, so no fast diff of its own
        assert fast == sorted(diffs.wing_files(ROOT / stage))
        assert header[4].startswith(f"# {diffs.FAST}/: byte for byte {before}'s")
        assert diffs.wing_diff(stage) is None


# the most lines each engine may have: their shared options and the pool's sizing are EngineConfig's
ENGINE_LINES = {
    "L1_contiguous": 300,
    "L2_token_flat": 300,
    "L3_block_tensor": 300,
    "L4_paged_kernel": 300,
    "L5_clones": 300,
}
# the most non-blank lines a lesson diff may add: L3's scheduler and batch without the incidental
# (options, sizing and request checks are EngineConfig's), L4's kernel without its fast paths, L5's
# prefix cache and clones without beam search (its wing, beams/)
DIFF_ADDS = {
    ("L2_token_flat", "L3_block_tensor"): 380,
    ("L3_block_tensor", "L4_paged_kernel"): 300,
    ("L4_paged_kernel", "L5_clones"): 500,
}


def added_lines(text: str) -> list[str]:
    """The non-blank lines a diff adds (``grep '^+[^+]'``: its ``+++`` file lines and bare ``+`` left out)."""
    return [line for line in text.splitlines() if re.match(r"\+[^+]", line)]


def test_the_lesson_path_stays_small():
    """The engines a learner reads stay within their lines (``ENGINE_LINES``), and the lesson diffs
    within theirs (``DIFF_ADDS``): L3 adds batching, L4 the kernel that walks the block table, one
    call over the flat batch (its fast paths are diffed apart)."""
    assert list(ENGINE_LINES) == list(diffs.DIFFED)
    for stage, cap in ENGINE_LINES.items():
        lines = (ROOT / stage / "engine.py").read_text(encoding="utf-8").count("\n")
        assert lines <= cap, f"{stage}/engine.py has {lines} lines, more than {cap}"
    for (old, new), cap in DIFF_ADDS.items():
        added = added_lines(diffs.diff_path(old, new).read_text(encoding="utf-8"))
        assert len(added) <= cap, f"the {old} -> {new} lesson diff adds {len(added)} lines, more than {cap}"


def test_added_lines_counts_what_grep_counts():
    diff = "--- a/x.py\n+++ b/x.py\n@@ -1 +1,3 @@\n-old\n+new\n+\n+    indented\n ++context\n"
    assert added_lines(diff) == ["+new", "+    indented"]


def test_l5_keeps_beam_search_beside_its_lesson():
    """L5 teaches two ideas (the prefix cache, clones) and keeps beam search in a wing (``beams/``,
    diffed apart in ``L5_beams.diff``): none of the wing's lines is in its lesson diff, whose size
    ``DIFF_ADDS`` bounds."""
    text = diffs.diff_path("L4_paged_kernel", "L5_clones").read_text(encoding="utf-8")
    assert "/beams/" not in text and diffs.wing_diff_path("L5_clones", "beams").exists()


def stage_imports(path: Path) -> set[str]:
    """The modules of its own stage a file imports: ``from .cache import KvPool`` -> ``cache``,
    ``from . import beams`` -> ``beams``, ``from ..allocator import x`` (in a wing) -> ``allocator``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level:
            found |= {node.module.split(".")[0]} if node.module else {a.name for a in node.names}
    return found


@pytest.mark.parametrize("stage", [s for s in STAGE_DIRS if (ROOT / s / "scheduler.py").exists()])
def test_the_scheduler_keeps_the_books_and_the_engine_owns_the_tensors(stage):
    """A scheduler deals in ids and block tables: it imports nothing that holds K/V (``cache.py``, the
    attention files) and no wing; only the engine meets a wing (``fast/``, ``beams/``)."""
    holds_kv = {"cache", "attention", "paged_attention", *diffs.WINGS}
    assert not stage_imports(ROOT / stage / "scheduler.py") & holds_kv, f"{stage}/scheduler.py"
    for name in diffs.lesson_files(ROOT / stage):
        if name != "engine.py":
            assert not stage_imports(ROOT / stage / name) & set(diffs.WINGS), f"{stage}/{name} imports a wing"


def test_a_sequence_knows_nothing_of_beams():
    """L5's ``sequence.py`` imports nothing of the beam-search wing and names no beam: a beam's slot
    and its group are the wing's business (the scheduler knows a group, never a beam)."""
    path = ROOT / "L5_clones" / "sequence.py"
    assert "beams" not in stage_imports(path)
    assert not re.search(r"beam", path.read_text(encoding="utf-8"), flags=re.I)
    assert "beams" not in stage_imports(ROOT / "L5_clones" / "scheduler.py")


def test_the_import_rules_can_fail(tmp_path):
    """``stage_imports`` sees what the two rules above look for: the pool, a wing, the beams' group."""
    path = tmp_path / "scheduler.py"
    path.write_text(
        "from .cache import KvPool\nfrom .beams.group import BeamGroup\nfrom . import fast\nimport torch\n"
    )
    assert stage_imports(path) == {"cache", "beams", "fast"}


def changed_lines(before: str, after: str) -> tuple[Counter, Counter]:
    """The lines the diff of ``after`` against ``before`` adds and removes, those with a letter or a digit
    (a lone ``\"\"\"`` or ``)`` may pair up differently in two diffs than in one)."""
    lines = difflib.unified_diff(before.splitlines(), after.splitlines(), lineterm="", n=0)
    signs = [
        (line[0], line[1:]) for line in lines if line[:3] not in ("+++", "---") and re.search(r"\w", line)
    ]
    return Counter(s for sign, s in signs if sign == "+"), Counter(s for sign, s in signs if sign == "-")


@pytest.mark.parametrize("stage", list(diffs.STEPS))
def test_a_stage_taught_in_two_steps_has_two_parts_that_add_up(stage):
    """Every changed paragraph of the stage's lesson diff lands in exactly one step (``split_steps``
    raises on a paragraph that names both ideas, or a text after step 1 that does not parse), and the
    two parts together add and remove exactly the lines the whole diff does."""
    steps, before = diffs.STEPS[stage], previous_stage(stage)
    a, b = diffs.lesson_files(ROOT / before), diffs.lesson_files(ROOT / stage)
    for name, text in b.items():
        middle = diffs.split_steps(a.get(name, ""), text, steps, name)
        (added_1, removed_1), (added_2, removed_2) = (
            changed_lines(a.get(name, ""), middle),
            changed_lines(middle, text),
        )
        assert (added_1 + added_2, removed_1 + removed_2) == changed_lines(a.get(name, ""), text), name
        assert not added_1 & removed_2, f"{name}: step 2 takes back lines step 1 added"
    shown = diffs.diff_path(before, stage).read_text(encoding="utf-8")
    assert [line for line in shown.splitlines() if line.startswith("# ==== ")] == [
        f"# ==== step {i + 1} of 2, {steps.names[i]}: {steps.about[i]}" for i in range(2)
    ]


def test_the_step_rule_sorts_paragraphs_and_refuses_a_mixed_one():
    """The docstrings' examples, and the rule failing: a paragraph naming both ideas, and a split that
    would leave a docstring open after step 1."""
    steps = diffs.STEPS["L5_clones"]
    assert diffs.paragraphs(["a", "b", "", "c", "", "  d", "import x", "e"]) == [
        ["a", "b"], ["", "c", "", "  d"], ["import x"], ["e"]
    ]  # fmt: skip
    assert diffs.split_steps("a\nb\n", "a\nhash\n\nclone\nb\n", steps) == "a\nhash\nb\n"
    with pytest.raises(diffs.MixedParagraph, match="names both the prefix cache and clones"):
        diffs.split_steps("a\nb\n", "a\nthe hash of a clone\nb\n", steps, "x.py")
    with pytest.raises(ValueError, match="x.py: the text after step 1 does not parse"):
        diffs.split_steps(
            'def f():\n    """Doc."""\n', 'def f():\n    """Doc.\n\n    Clones.\n    """\n', steps, "x.py"
        )


@pytest.mark.parametrize("old, new", diffs.pairs())
def test_a_chapter_shows_only_lines_of_its_stage_diff(old, new):
    chapter = (ROOT / "lessons" / f"{new}.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```diff\n(.*?)```", chapter, flags=re.S)
    assert blocks, f"lessons/{new}.md shows no ```diff block from {diffs.diff_path(old, new).name}"
    shown = [diffs.diff_path(old, new)]
    shown += [path for wing in diffs.WINGS if (path := diffs.wing_diff_path(new, wing)).exists()]
    for block in blocks:
        assert any("\n" + block in "\n" + path.read_text(encoding="utf-8") for path in shown), (
            f"lessons/{new}.md shows a diff that is not in {' or '.join(p.name for p in shown)}:\n{block}"
        )


def test_the_l6_chapter_shows_only_lines_of_its_mesh_diff():
    """Every ```diff block of the L6 chapter is a run of lines of L6_mesh.diff (which
    ``test_committed_diff_is_current`` keeps current)."""
    whole = diffs.mesh_diff()
    chapter = (ROOT / "lessons" / "L6_tpu_jax.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```diff\n(.*?)```", chapter, flags=re.S)
    assert blocks, "lessons/L6_tpu_jax.md shows no ```diff block from L6_mesh.diff"
    for block in blocks:
        assert "\n" + block in "\n" + whole, (
            f"lessons/L6_tpu_jax.md shows a diff not in L6_mesh.diff:\n{block}"
        )


def test_the_l5_to_l6_name_map_is_complete_and_true():
    """Every public name of L5 is mapped, every mapped name is L5's, every L6 name the map gives is
    L6's (the table file and the chapter's copy are kept current with the diffs)."""
    assert names.problems() == []


def test_the_name_map_check_names_the_missing_name_and_its_side():
    """A row L5 lacks, an L5 name without a row and an L6 name L6 lacks are each one line."""
    broken = dict(names.NAMES)
    del broken["allocator.py:BlockAllocator.clone"]
    broken["allocator.py:BlockAllocator.spoon"] = ("page_table.py:allocate_for_seq", "no such L5 name")
    broken["sequence.py:allocate_slots"] = ("page_table.py:reserve_pages", "no such L6 name")
    assert names.problems(broken) == [
        "L5 has allocator.py:BlockAllocator.clone, which NAMES does not map: add a row",
        "NAMES maps allocator.py:BlockAllocator.spoon, which L5 does not have (renamed or gone?)",
        "NAMES maps sequence.py:allocate_slots to page_table.py:reserve_pages, which L6 does not have",
    ]


def test_the_one_device_engine_holds_no_mesh_code():
    """L6's lesson path: ``engine.py`` and the tables it uses know nothing of meshes, shards or hosts;
    that is ``mesh/``'s: ``engine.py``, ``tables.py`` and ``multihost.py``."""
    for name in ("engine.py", "page_table.py", "decode_state.py", "device_stats.py", "kv_cache.py"):
        code = (
            (ROOT / "L6_tpu_jax" / name).read_text(encoding="utf-8").split('"""', 2)[2]
        )  # past the docstring
        for word in ("shard", "mesh", "psum", "check_same_call", "PartitionSpec", "local_copy"):
            assert word not in code.lower(), f"L6_tpu_jax/{name} mentions {word!r} outside its docstring"


def packages() -> list[Path]:
    """Every package of the repository (a folder with an ``__init__.py``) that has modules of its own."""
    found = []
    for init in sorted(ROOT.glob("**/__init__.py")):
        if any(part.startswith(".") for part in init.relative_to(ROOT).parts):
            continue
        if [m for m in init.parent.glob("*.py") if m.name not in ("__init__.py", "__main__.py")]:
            found.append(init.parent)
    return found


def unnamed_modules(package: Path) -> list[str]:
    """The modules of ``package`` its docstring does not name: a name counts in backticks (``cli``,
    ``cli.py``) or at the start of a listing line (``    run   the main part``)."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text(encoding="utf-8"))) or ""
    missing = []
    for module in sorted(package.glob("*.py")):
        stem = module.stem
        if stem == "__init__":
            continue
        named = re.search(rf"`{re.escape(stem)}(\.py)?`", doc) or re.search(
            rf"^\s*{re.escape(stem)}(\.py)?\s", doc, re.MULTILINE
        )
        if not named:
            missing.append(module.name)
    return missing


@pytest.mark.parametrize("package", packages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_package_docstring_names_its_modules(package):
    """A reader opening a folder's ``__init__.py`` finds what each of its files is for."""
    assert not unnamed_modules(package), f"{package.relative_to(ROOT)}/__init__.py does not name {unnamed_modules(package)}"
