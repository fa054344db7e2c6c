"""The diff between neighbouring stages, written as files: ``python -m kvcourse.tools.diffs`` (``make diffs``).

    lessons/diffs/L1_L2.diff     L2_token_flat against L1_contiguous
    ...
    lessons/diffs/L3_L4.diff     L4_paged_kernel's lesson files against L3_block_tensor's
    lessons/diffs/L4_fast.diff   what L4_paged_kernel's fast paths (its ``fast/`` folder) add
    lessons/diffs/L4_L5.diff     L5_clones against L4_paged_kernel, in two steps: prefix cache, clones
    lessons/diffs/L5_beams.diff  L5_clones's beam search (its ``beams/`` wing), whole
    lessons/diffs/L6_mesh.diff   L6's mesh engine against its one-device engine
    lessons/diffs/L5_L6_names.md L5's names and L6's (``kvcourse/tools/names.py``)

A stage is a closed snapshot of the one before it, so the unified diff of the two folders is exactly
what the lesson changes. Each file starts with a short header (files unchanged byte for byte, files
new in the stage, files gone, and where the fast paths' diff is) and then one unified diff per changed
file, 3 lines of context, paths ``a/L2_token_flat/x.py`` and ``b/L3_block_tensor/x.py`` as git writes
them.

Compared: the stage's lesson files, its top-level modules. Its wings (``WINGS``: the fast paths in
``fast/``, compiled kernels, split-KV, decode graphs; L5's beam search in ``beams/``) are diffed apart,
each in ``LN_<wing>.diff``, against the previous stage's folder of that name (none before L4's fast
paths and L5's beams: the files come in whole); a stage whose wing is byte for byte the previous
one's gets no file of its own, and its lesson diff's header says so. Left out: ``__init__.py`` (a
package marker naming the stage) and the smoke script (``lN_smoke.py``), the stage's own harness, not
its lesson (the notebook's checkers and answers are not in the stage at all: ``exercises/`` and
``key/``). L6 is not
diffed against L5: it is a rewrite in JAX, and ``names.py`` maps L5's names to Levanter's instead (a
table, also written into the L6 chapter). Within L6, ``mesh/engine.py`` is a copy of ``engine.py``
changed for a device mesh: ``L6_mesh.diff`` is that change, then the files only the mesh uses, whole
(``MESH``).

A stage that teaches two ideas (``STEPS``: L5, the prefix cache and clones) gets its diff in two
marked parts, each a diff of its own: the first from the previous stage to the text after step 1, the
second from there to the stage. The text after step 1 is made by a declared rule (``split_steps``):
every change of the whole diff is cut into paragraphs (runs of changed lines up to a blank line followed
by a line indented no deeper, so a new function is one paragraph; an import line stands alone; a new
file is one paragraph), and a paragraph whose text names the second
idea (``Steps.words[1]``) belongs to step 2, any other to step 1. A paragraph that names both ideas is
an error: the stage's code must keep its two ideas apart, paragraph by paragraph.

``--check`` writes nothing and exits 1 if a committed diff is out of date (the tests run it).
"""

from __future__ import annotations

import argparse
import ast
import difflib
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from kvcourse.grading.generated import sync

ROOT = Path(__file__).resolve().parents[2]
DIFFED = ("L1_contiguous", "L2_token_flat", "L3_block_tensor", "L4_paged_kernel", "L5_clones")
NOT_COMPARED = ("__init__.py",)
FAST = "fast"  # each stage's folder of fast paths, apart from its lesson
WINGS = (FAST, "beams")  # the folders beside a stage's lesson, each diffed apart (L5's beam search)
WHAT = {FAST: "fast paths", "beams": "beam search"}  # what each wing holds, as its diff's header says


@dataclass(frozen=True)
class Steps:
    """The ideas a stage teaches one after the other: a name and a line for each, and for each the
    words that name it (a regular expression, matched case-insensitively). ``mixed`` names changed
    paragraphs, by file and first line, that may name both ideas: they go whole into step 2. It is
    for a stage that has not caught up with a change to the one before it."""

    names: tuple[str, str]
    about: tuple[str, str]
    words: tuple[str, str]
    mixed: tuple[tuple[str, str], ...] = ()

    def step_of(self, lines: list[str]) -> set[int]:
        """The steps whose words the lines name: ``{0}``, ``{1}``, both, or none."""
        text = "\n".join(lines)
        return {i for i, words in enumerate(self.words) if re.search(words, text, flags=re.I)}


STEPS = {
    "L5_clones": Steps(
        names=("the prefix cache", "clones"),
        about=(
            "blocks shared by reference count: full blocks keyed by a chained hash of their tokens, "
            "found again by later requests",
            "n samples of a prompt cloned from one prefill: its full blocks shared, its partial last "
            "block copied by the engine, as the scheduler says; and the seam of a group of sequences "
            "(beam search, beside the lesson in beams/)",
        ),
        words=(
            r"prefix|hash|cached|lookup|regist",
            r"clon|sampl|cop(y|ies)|(?<!max_)num_seqs|num_running_seqs|generator|group",
        ),
    ),
}


class MixedParagraph(ValueError):
    """A changed paragraph names both ideas of a stage taught in two steps."""


# L6's lesson of sharding: (stage, one-device file, mesh file, files only the mesh uses).
NEW_FILE = "\ndiff -u "  # how each file's diff starts
MESH = ("L6_tpu_jax", "engine.py", "mesh/engine.py", ("mesh/tables.py", "mesh/multihost.py"))


def lesson_files(stage_dir: Path) -> dict[str, str]:
    """The stage's lesson files (its top-level modules) by file name, with their text (smoke script,
    harness and fast paths left out)."""
    return {
        f.name: f.read_text(encoding="utf-8")
        for f in sorted([*stage_dir.glob("*.py"), *stage_dir.glob("*.cpp")])
        if f.name not in NOT_COMPARED and not f.name.endswith("_smoke.py")
    }


def wing_files(stage_dir: Path, wing: str = FAST) -> dict[str, str]:
    """The stage's files of one wing, ``fast/x.py`` -> text ({} for a stage without it)."""
    folder = stage_dir / wing
    return {
        f"{wing}/{f.name}": f.read_text(encoding="utf-8")
        for f in sorted([*folder.glob("*.py"), *folder.glob("*.cpp")])
    }


def file_diffs(a: dict[str, str], b: dict[str, str], old: str, new: str, labels=("", "")) -> list[str]:
    """One unified diff per file that differs between ``a`` and ``b`` (name -> text), the files of
    stage folders ``old`` and ``new``; ``labels`` follow the paths on the ``---``/``+++`` lines."""
    lines = []
    for name in sorted(a.keys() | b.keys()):
        if a.get(name) != b.get(name):
            from_path = f"a/{old}/{name}" if name in a else "/dev/null"
            to_path = f"b/{new}/{name}" if name in b else "/dev/null"
            lines += unified(a.get(name, ""), b.get(name, ""), from_path, to_path, labels)
    return lines


def unified(before: str, after: str, from_path: str, to_path: str, labels=("", "")) -> list[str]:
    """One file's diff as git writes it: a ``diff -u`` line, then the unified diff, 3 lines of context."""
    diff = difflib.unified_diff(
        before.splitlines(keepends=True), after.splitlines(keepends=True), from_path, to_path, *labels, n=3
    )
    return [f"diff -u {from_path} {to_path}", *(line.rstrip("\n").rstrip("\t") for line in diff)]


IMPORT = re.compile(r"(from \S+ )?import ")


def paragraphs(lines: list[str]) -> list[list[str]]:
    """Cut changed lines into paragraphs. A blank line ends one when the next line is indented no deeper
    than the paragraph's first (blank lines inside a function or a docstring nested in it do not: a
    new function is one paragraph); the blank lines go with the paragraph after them, trailing ones
    with the last. An import line is a paragraph of its own.

    Example: ``["a", "b", "", "c", "", "  d", "import x", "e"]`` -> ``[["a", "b"], ["", "c", "", "  d"],
    ["import x"], ["e"]]``.
    """
    found: list[list[str]] = []
    blanks: list[str] = []
    start = 0  # the indentation of the current paragraph's first line
    for line in lines:
        if not line.strip():
            blanks.append(line)
            continue
        indent = len(line) - len(line.lstrip())
        if not found or IMPORT.match(line) or IMPORT.match(found[-1][-1]) or (blanks and indent <= start):
            found.append(blanks + [line])
            start = indent
        else:
            found[-1] += blanks + [line]
        blanks = []
    if blanks:
        found.append(blanks) if not found else found[-1].extend(blanks)
    return found


def in_step_1(paragraph: list[str], step: int | None, code: list[list[str]]) -> bool:
    """Whether a changed paragraph is step 1's: its ``step`` is 0, or it is an import (``step`` None)
    whose names step 1's changed code uses, or step 2's does not (``code``: each step's lines).

    Example: ``from dataclasses import replace`` is step 2's when only step 2's lines call ``replace``.
    """
    if step is not None:
        return step == 0
    line = next(line for line in paragraph if line.strip())
    names = re.findall(r"(\w+)\s*(?:,|$)", line.split(" import ")[-1].strip())

    def uses(lines: list[str]) -> bool:
        return any(re.search(rf"\b{n}\b", line) for n in names for line in lines)

    return uses(code[0]) or not uses(code[1])


def split_steps(before: str, after: str, steps: Steps, name: str = "") -> str:
    """The text of a file after the first of two steps that take it from ``before`` to ``after``.

    Each change of ``after`` against ``before`` (a run of removed and added lines) is cut into
    ``paragraphs``; a paragraph that names the second idea is the second step's, any other the
    first's, and an import line goes with the first step that uses a name it imports. The text after
    step 1 holds the first step's paragraphs; a change whose paragraphs are all the second step's
    keeps its old lines until then. Raises ``MixedParagraph`` for a paragraph that names both ideas,
    and ValueError where the text after step 1 of a Python file does not parse.

    Example, with L5's words: ``"a\nb\n"`` -> ``"a\nhash\n\nclone\nb\n"`` gives
    ``"a\nhash\nb\n"`` after step 1 (the prefix cache); clones then add ``\nclone``.
    """
    a, b = before.splitlines(keepends=True), after.splitlines(keepends=True)
    if not a:  # a new file is one paragraph: it comes in whole, in one step
        named = steps.step_of(b)
        if len(named) > 1:
            raise MixedParagraph(f"{name}: a new file names both {steps.names[0]} and {steps.names[1]}")
        return "" if named == {1} else after
    changes = []  # (old lines, [(paragraph, step or None for an import)])
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b).get_opcodes():
        if tag == "equal":
            changes.append((a[i1:i2], None))
            continue
        found = []
        for paragraph in paragraphs(b[j1:j2]):
            named = steps.step_of(paragraph)
            if (name, next(line for line in paragraph if line.strip()).strip()) in steps.mixed:
                named = {1}
            if len(named) > 1:
                raise MixedParagraph(
                    f"{name}: this paragraph names both {steps.names[0]} and {steps.names[1]}; keep them "
                    f"apart, a blank line between them:\n{''.join(paragraph)}"
                )
            imports = IMPORT.match(next(line for line in paragraph if line.strip()))
            found.append((paragraph, None if imports else int(named == {1})))
        changes.append((a[i1:i2], found))
    code = [[], []]  # the lines of each step's changed paragraphs, imports left out
    for _, found in changes:
        for paragraph, step in found or []:
            if step is not None:
                code[step] += paragraph
    middle: list[str] = []
    for old, found in changes:
        if found is None:
            middle += old
        elif not found:  # lines removed only: in step 1, unless they name the second idea only
            middle += old if steps.step_of(old) == {1} else []
        else:
            middle += [
                line for paragraph, step in found if in_step_1(paragraph, step, code) for line in paragraph
            ]
            middle += [] if any(in_step_1(p, s, code) for p, s in found) else old
    text = "".join(middle)
    if name.endswith(".py"):
        try:
            ast.parse(text)
        except SyntaxError as e:
            raise ValueError(f"{name}: the text after step 1 does not parse ({e})") from e
    return text


def header(old: str, new: str, a: dict[str, str], b: dict[str, str], what: str) -> list[str]:
    """The lines a diff file starts with: what it compares, and which files are unchanged, new, gone."""
    same = [name for name in sorted(a.keys() & b.keys()) if a[name] == b[name]]
    return [
        f"# {new} against {old}: {what} (written by `make diffs`; do not edit)",
        f"# unchanged, byte for byte: {', '.join(same) or '-'}",
        f"# new in {new}: {', '.join(sorted(b.keys() - a.keys())) or '-'}",
        f"# gone: {', '.join(sorted(a.keys() - b.keys())) or '-'}",
    ]


def stage_diff(old: str, new: str, root: Path = ROOT) -> str:
    """The unified diff of stage folder ``new``'s lesson files against ``old``'s, with its header; in
    two marked parts where ``new`` teaches two steps (``STEPS``)."""
    a, b = lesson_files(root / old), lesson_files(root / new)
    lines = header(old, new, a, b, "what the lesson changes")
    for wing in WINGS:
        wing_a, wing_b = wing_files(root / old, wing), wing_files(root / new, wing)
        if wing_b and wing_b == wing_a:
            lines.append(
                f"# {wing}/: byte for byte {old}'s ({wing_diff_path(old, wing, root).relative_to(root)})"
            )
        elif wing_b:
            where = wing_diff_path(new, wing, root).relative_to(root)
            lines.append(f"# {wing}/: the {WHAT[wing]}, diffed apart in {where}")
    steps = STEPS.get(new)
    if steps is None:
        return "\n".join(lines + file_diffs(a, b, old, new)) + "\n"
    middle = {name: split_steps(a.get(name, ""), text, steps, name) for name, text in b.items()}
    middle = {name: text for name, text in middle.items() if text or name in a}  # a new file may wait
    lines.append(
        f"# in two steps, each diffed on its own: 1. {steps.names[0]}, 2. {steps.names[1]}; a changed "
        f"paragraph that names {steps.names[1]} is step 2's (kvcourse/tools/diffs.py)"
    )
    label = f"(after step 1, {steps.names[0]})"
    lines.append(f"# ==== step 1 of 2, {steps.names[0]}: {steps.about[0]}")
    lines += file_diffs(a, middle, old, new, ("", label))
    lines.append(f"# ==== step 2 of 2, {steps.names[1]}: {steps.about[1]}")
    lines += file_diffs(middle, b, new, new, (label, ""))
    return "\n".join(lines) + "\n"


def wing_diff(stage: str, wing: str = FAST, root: Path = ROOT) -> str | None:
    """What stage ``stage``'s wing (``fast/``, ``beams/``) adds to the previous stage's (the whole
    files where that has none), with a header; None where it has none, or the previous stage's byte
    for byte."""
    before = DIFFED[DIFFED.index(stage) - 1]
    a, b = wing_files(root / before, wing), wing_files(root / stage, wing)
    if not b or a == b:
        return None
    lines = header(before, stage, a, b, f"its {WHAT[wing]}, apart from the lesson ({wing}/)")
    return "\n".join(lines + file_diffs(a, b, before, stage)) + "\n"


def mesh_diff(root: Path = ROOT) -> str:
    """The unified diff of L6's mesh engine against its one-device engine, with its header, then the
    files only the mesh uses, each as a new file."""
    stage, single, mesh, only = MESH
    lines = [
        f"# {stage}/{mesh} against {stage}/{single}: what running over a device mesh changes "
        "(written by `make diffs`; do not edit)",
        f"# then the files only the mesh uses, whole: {', '.join(only)}",
    ]
    text = {name: (root / stage / name).read_text(encoding="utf-8") for name in (single, mesh, *only)}
    lines += unified(text[single], text[mesh], f"a/{stage}/{single}", f"b/{stage}/{mesh}")
    lines += file_diffs({}, {name: text[name] for name in only}, stage, stage)
    return "\n".join(lines) + "\n"


def diff_path(old: str, new: str, root: Path = ROOT) -> Path:
    """``lessons/diffs/L2_L3.diff`` for ``("L2_token_flat", "L3_block_tensor")``."""
    return root / "lessons" / "diffs" / f"{old.split('_')[0]}_{new.split('_')[0]}.diff"


def wing_diff_path(stage: str, wing: str = FAST, root: Path = ROOT) -> Path:
    """``lessons/diffs/L4_fast.diff`` for ``"L4_paged_kernel"``, ``L5_beams.diff`` for
    ``("L5_clones", "beams")``."""
    return root / "lessons" / "diffs" / f"{stage.split('_')[0]}_{wing}.diff"


def pairs() -> list[tuple[str, str]]:
    """Neighbouring stages that are diffed: (L1, L2) .. (L4, L5)."""
    return list(zip(DIFFED, DIFFED[1:], strict=False))


def outputs(root: Path = ROOT) -> list[tuple[Path, str]]:
    """Every file ``make diffs`` writes, with its text: each pair's lesson diff, the diff of each wing
    that changes in a stage, L6's mesh diff and the table of L5's names and L6's."""
    from kvcourse.tools import names

    found = [(diff_path(old, new, root), stage_diff(old, new, root)) for old, new in pairs()]
    for stage in DIFFED[1:]:
        for wing in WINGS:
            text = wing_diff(stage, wing, root)
            if text is not None:
                found.append((wing_diff_path(stage, wing, root), text))
    found.append((root / "lessons" / "diffs" / "L6_mesh.diff", mesh_diff(root)))
    return found + names.outputs(root)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvcourse.tools.diffs", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a diff is stale")
    args = parser.parse_args(argv)
    from kvcourse.tools import names

    wrong = names.problems()
    for line in wrong:
        print(f"names: {line}")
    stale = 0
    for path, text in outputs():
        differs, shown = sync(path, text, args.check), path.relative_to(ROOT)
        if args.check:
            stale += differs
            print(f"{shown}: {'OUT OF DATE: run make diffs' if differs else 'up to date'}")
        else:
            changed = f"{text.count(NEW_FILE)} file(s) differ, " if path.suffix == ".diff" else ""
            print(f"{shown}: {changed}{'written' if differs else 'unchanged'}")
    return 1 if stale or wrong else 0


if __name__ == "__main__":
    sys.exit(main())
