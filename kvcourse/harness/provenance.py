"""Which commit and which libraries a measurement ran with: ``tree_commit()``, ``library_versions()``.

A results file names the commit its numbers came from, so that a chapter's table says what code it
measured. Read from git where the tree is a checkout (``+dirty`` when a tracked file differs from the
commit: such numbers are not committed, ``tests/test_numbers.py`` refuses them); a tree sent to a
machine without its ``.git`` (a lent GPU's copy) names it through ``KVCOURSE_COMMIT``, which
``make gpu-run`` sets from its ``--commit``.

Left out on purpose: the untracked files (a new results file must not make its own tree dirty), and
changes under ``bench/results/`` and ``bench/plots/`` (``OUTPUTS``): they are what the measurements write,
not what measures. ``make bench`` calibrates the CPU's step costs (a tracked results file) and then
serves and simulates with them, in one tree; a results file that reads another records what it read
(``bench.serving``'s ``cost_profile``, ``bench.simulate``'s ``setup.profiles``).
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess

from kvcourse.model_store import REPO_ROOT

COMMIT_ENV = "KVCOURSE_COMMIT"
OUTPUTS = ("bench/results", "bench/plots")  # what measurements write: a change there leaves the tree clean


def tree_commit(given: str | None = None) -> str:
    """``given``, else ``$KVCOURSE_COMMIT``, else git's short commit (``+dirty`` when a tracked file
    outside ``OUTPUTS`` differs from it), else ``"unknown"``. Example, in a clean checkout of 046e8bc:
    ``"046e8bc"``; with ``bench/results/bench.json`` rewritten, still ``"046e8bc"``."""
    if given or os.environ.get(COMMIT_ENV):
        return given or os.environ[COMMIT_ENV]

    def git(*args: str) -> str | None:
        try:
            return subprocess.run(
                ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=True
            ).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return None

    commit = git("rev-parse", "--short", "HEAD")
    if not commit:
        return "unknown"
    outside = ["--", ".", *(f":(exclude){path}" for path in OUTPUTS)]
    return commit + ("+dirty" if git("status", "--porcelain", "--untracked-files=no", *outside) else "")


LIBRARIES = ("torch", "triton", "jax", "jaxlib", "transformers")


def library_versions(names: tuple[str, ...] = LIBRARIES) -> dict[str, str | None]:
    """The libraries a run ran with, name -> version (None: not installed), read without importing
    them (importing JAX would claim GPU memory in this process)."""
    found = {}
    for name in names:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def versions() -> str:
    """``library_versions`` in one line: ``torch 2.11.0, triton 3.6.0, ..., no jax``."""
    return ", ".join(f"{n} {v}" if v else f"no {n}" for n, v in library_versions().items())
