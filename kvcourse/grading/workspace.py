"""The learner's own copies of the exercise notebooks: ``python -m kvcourse.grading.workspace`` (``make workspace``).

Copies the exercise notebooks ``notebooks/LN_*.ipynb`` into ``workspace/`` (git-ignored), where the
learner works, with the notebooks' relative links made relative to their new folder (``relinked``; both
folders sit at the top of the course, so ``../lessons/L1_contiguous.md`` stays as it is), so the
chapters open from the workspace. A notebook already in
``workspace/`` is never overwritten: a second run says which ones it kept, so
new exercises reach a learner without touching the work already done. ``make test``, ``make
exercises`` and ``make smoke`` never write there.

Left out on purpose: merging a newer exercise notebook into an edited copy (delete your copy, or
rename it, to get the new one).
"""

from __future__ import annotations

import sys
from pathlib import Path

from kvcourse.grading.exercises import NOTEBOOKS, ROOT, read, relinked, render

WORKSPACE = ROOT / "workspace"


def make_workspace(folder: Path = WORKSPACE, source: Path = NOTEBOOKS) -> tuple[list[str], list[str]]:
    """Copy every exercise notebook that ``folder`` does not have yet; return (copied, kept) names."""
    folder.mkdir(parents=True, exist_ok=True)
    copied, kept = [], []
    for nb in sorted(source.glob("L[0-9]*_*.ipynb")):
        target = folder / nb.name
        if target.exists():
            kept.append(nb.name)
        else:
            target.write_text(render(relinked(read(nb), nb.parent, folder)), encoding="utf-8")
            copied.append(nb.name)
    return copied, kept


def main() -> int:
    copied, kept = make_workspace()
    shown = WORKSPACE.relative_to(WORKSPACE.parent)
    for name in copied:
        print(f"{shown}/{name}: copied from notebooks/")
    for name in kept:
        print(f"{shown}/{name}: kept (already there; delete it to start over)")
    print(
        f"open the notebooks with `make notebooks`, grade one with `make grade NB={shown}/{(copied + kept)[0]}`"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
