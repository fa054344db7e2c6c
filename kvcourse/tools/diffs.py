"""The diff between neighbouring stages, written as files: ``python -m kvcourse.tools.diffs`` (``make diffs``).

    lessons/diffs/L1_L2.diff   L2_token_flat against L1_contiguous
    ...
    lessons/diffs/L4_L5.diff   L5_clones against L4_paged_kernel
    lessons/diffs/L6_mesh.diff L6's mesh engine against its one-device engine
    lessons/diffs/L5_L6_names.md  L5's names and L6's (``kvcourse/tools/names.py``)

A stage is a closed snapshot of the one before it, so the unified diff of the two folders is exactly
what the lesson changes. Each file starts with a short header (files unchanged byte for byte, files
new in the stage, files gone) and then one unified diff per changed file, 3 lines of context, paths
``a/L2_token_flat/x.py`` and ``b/L3_block_tensor/x.py`` as git writes them.

Compared: the stage's engine modules and its C++ kernel source (``*.cpp``). Left out: ``__init__.py`` (a
package marker naming the stage), the smoke script (``lN_smoke.py``) and the ``exercises/`` folder (the
notebook's checkers and the grader's independent answers), which are each stage's own harness, not its
lesson. L6 is not diffed against L5: it is a rewrite in JAX, and ``names.py`` maps L5's names to
Levanter's instead (a table, also written into the L6 chapter). Within L6, ``mesh_engine.py`` is a copy
of ``engine.py`` changed for a device mesh: ``L6_mesh.diff`` is that change, then the files only the
mesh uses, whole (``MESH``).

``--check`` writes nothing and exits 1 if a committed diff is out of date (the tests run it).
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

from kvcourse.grading.generated import sync

ROOT = Path(__file__).resolve().parents[2]
DIFFED = ("L1_contiguous", "L2_token_flat", "L3_block_tensor", "L4_paged_kernel", "L5_clones")
NOT_COMPARED = ("__init__.py",)
# L6's lesson of sharding: (stage, one-device file, mesh file, files only the mesh uses).
NEW_FILE = "\ndiff -u "  # how each file's diff starts
MESH = ("L6_tpu_jax", "engine.py", "mesh_engine.py", ("mesh_tables.py", "multihost.py"))


def lesson_files(stage_dir: Path) -> dict[str, str]:
    """The stage's engine modules and kernel sources by file name, with their text (smoke script and
    harness left out)."""
    return {
        f.name: f.read_text(encoding="utf-8")
        for f in sorted([*stage_dir.glob("*.py"), *stage_dir.glob("*.cpp")])
        if f.name not in NOT_COMPARED and not f.name.endswith("_smoke.py")
    }


def stage_diff(old: str, new: str, root: Path = ROOT) -> str:
    """The unified diff of stage folder ``new`` against ``old``, with its header."""
    a, b = lesson_files(root / old), lesson_files(root / new)
    same = [name for name in sorted(a.keys() & b.keys()) if a[name] == b[name]]
    added = sorted(b.keys() - a.keys())
    gone = sorted(a.keys() - b.keys())
    lines = [
        f"# {new} against {old}: what the lesson changes (written by `make diffs`; do not edit)",
        f"# unchanged, byte for byte: {', '.join(same) or '-'}",
        f"# new in {new}: {', '.join(added) or '-'}",
        f"# gone: {', '.join(gone) or '-'}",
    ]
    for name in sorted(a.keys() | b.keys()):
        if name in same:
            continue
        before = a.get(name, "").splitlines(keepends=True)
        after = b.get(name, "").splitlines(keepends=True)
        from_path = f"a/{old}/{name}" if name in a else "/dev/null"
        to_path = f"b/{new}/{name}" if name in b else "/dev/null"
        lines.append(f"diff -u {from_path} {to_path}")
        lines.extend(
            line.rstrip("\n") for line in difflib.unified_diff(before, after, from_path, to_path, n=3)
        )
    return "\n".join(lines) + "\n"


def mesh_diff(root: Path = ROOT) -> str:
    """The unified diff of L6's mesh engine against its one-device engine, with its header, then the
    files only the mesh uses, each as a new file."""
    stage, single, mesh, only = MESH
    lines = [
        f"# {stage}/{mesh} against {stage}/{single}: what running over a device mesh changes "
        "(written by `make diffs`; do not edit)",
        f"# then the files only the mesh uses, whole: {', '.join(only)}",
    ]
    for before, after in [(single, mesh), *((None, name) for name in only)]:
        old = (root / stage / before).read_text(encoding="utf-8") if before else ""
        new = (root / stage / after).read_text(encoding="utf-8")
        from_path = f"a/{stage}/{before}" if before else "/dev/null"
        to_path = f"b/{stage}/{after}"
        lines.append(f"diff -u {from_path} {to_path}")
        lines.extend(
            line.rstrip("\n")
            for line in difflib.unified_diff(
                old.splitlines(keepends=True), new.splitlines(keepends=True), from_path, to_path, n=3
            )
        )
    return "\n".join(lines) + "\n"


def outputs(root: Path = ROOT) -> list[tuple[Path, str]]:
    """Every file ``make diffs`` writes, with its text: the stage diffs, L6's mesh diff, the names."""
    from kvcourse.tools import names

    written = [(diff_path(old, new, root), stage_diff(old, new, root)) for old, new in pairs()]
    written.append((root / "lessons" / "diffs" / "L6_mesh.diff", mesh_diff(root)))
    return written + names.outputs(root)


def diff_path(old: str, new: str, root: Path = ROOT) -> Path:
    """``lessons/diffs/L2_L3.diff`` for ``("L2_token_flat", "L3_block_tensor")``."""
    return root / "lessons" / "diffs" / f"{old.split('_')[0]}_{new.split('_')[0]}.diff"


def pairs() -> list[tuple[str, str]]:
    """Neighbouring stages that are diffed: (L1, L2) .. (L4, L5)."""
    return list(zip(DIFFED, DIFFED[1:], strict=False))


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
