"""Break each promise the chapters make, one at a time, and check that a test notices.

    python -m kvcourse.tools.mutants [--list] [--timeout S] [NAME ...]      (make mutants)

``MUTATIONS`` (``kvcourse/grading/mutations.py``, which the catch-the-bug exercises draw from too) is
a list of small, named bugs, each the kind a learner (or a reviewer) could write. Each names its file,
an exact piece of text that must occur exactly once there, what replaces it, and the tests that must
fail.

The script copies the repository once into a scratch folder (without ``.git``, ``.venv``, ``.cache``,
the notebooks, the key's included, and workspace), then for each mutation: writes the mutated file,
runs its tests there in a fresh process (``pytest -x -q -p no:cacheprovider`` without autoloaded
plugins, ``PYTHONPATH`` = the scratch copy, the real ``KVCOURSE_CACHE`` so models and HF references are
found, no bytecode written), and puts the file back.
A mutation is *caught* when those tests fail, and *survived* when they pass. One line per mutation:

    caught     12.3 s  L5 clone shares the partial block  (tests/test_pressure.py::test_sampled_...)

then ``mutants: K/N caught in T s``. Exit status: 0 when every mutation that could run was caught, 1
when one survived, 2 when the list is stale (an ``old`` text not found exactly once, a test id that
does not exist) or a mutation broke the test run itself (a collection error, a timeout). The C++
mutation runs where the kernel builds (its build, under the mutated source's own name, is deleted
afterwards) and the Triton one where triton is installed; elsewhere they are reported as skipped.

``tests/test_mutants.py`` checks on every ``make test`` that each ``old`` text still occurs exactly
once and each test id names a test that exists, without running any mutation.

Left out on purpose: generating mutations automatically (mutmut, cosmic-ray: thousands of mutants,
most of them equivalent or trivially caught; these are the bugs the chapters warn about), and running
mutations in parallel (two cores).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvcourse.grading.mutations import MUTATIONS, Mutation
from kvcourse.model_store import REPO_ROOT, cache_root

IGNORED = (".git", ".venv", ".cache", ".hypothesis", ".pytest_cache", ".ruff_cache", "__pycache__",
           "notebooks", "workspace", "*.egg-info")  # fmt: skip


@dataclass
class Outcome:
    mutation: Mutation
    verdict: str  # caught | survived | skipped | error
    seconds: float
    detail: str  # the failing test, the skip reason, or what went wrong


def stale(mutations: Sequence[Mutation], root: Path) -> list[str]:
    """What no longer matches the tree under ``root``: an ``old`` text not found exactly once, a
    mutation that changes nothing, a test id whose file or test function does not exist."""
    problems = []
    for m in mutations:
        path = root / m.file
        count = path.read_text(encoding="utf-8").count(m.old) if path.is_file() else 0
        if count != 1:
            problems.append(f"{m.name}: old text found {count} times in {m.file}")
        if m.old == m.new:
            problems.append(f"{m.name}: new text equals old text")
        for test in m.tests:
            file, _, func = test.partition("::")
            name = func.split("[")[0]
            source = root / file
            if not source.is_file() or not re.search(rf"^def {re.escape(name)}\(", source.read_text(), re.M):
                problems.append(f"{m.name}: no test {test}")
    names = [m.name for m in mutations]
    problems += [f"two mutations are called {n!r}" for n in sorted({n for n in names if names.count(n) > 1})]
    return problems


def unavailable(need: str | None, root: Path) -> str | None:
    """Why a mutation cannot run on this machine (None if it can)."""
    if need == "triton" and importlib.util.find_spec("triton") is None:
        return "triton is not installed here"
    if need == "cpp":
        from kvcourse.cpp_kernels import build_problem

        return build_problem(root / "L4_paged_kernel" / "fast" / "paged_attention.cpp")
    return None


def cpp_build_folder(source: Path) -> Path:
    """Where ``kvcourse.cpp_kernels`` builds ``source`` as it is now (its name hashes the text)."""
    from kvcourse.cpp_kernels import cpu_key

    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:8]
    return cache_root() / "kernels" / cpu_key() / f"{source.stem}_{digest}"


def run_tests(scratch: Path, tests: Sequence[str], timeout: float) -> tuple[int | None, str]:
    """Run ``tests`` in ``scratch`` in a fresh process; (exit status or None on timeout, its output)."""
    env = dict(
        os.environ,
        PYTHONPATH=str(scratch),
        KVCOURSE_CACHE=str(cache_root()),
        PYTHONDONTWRITEBYTECODE="1",  # a file put back within the same second must not run stale bytecode
        PYTEST_DISABLE_PLUGIN_AUTOLOAD="1",  # nbval, xdist: seconds of imports a run; no test needs them
    )
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    try:
        res = subprocess.run(cmd, cwd=scratch, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = e.stdout or b""
        return None, out.decode(errors="replace") if isinstance(out, bytes) else out
    return res.returncode, res.stdout + res.stderr


def failed_test(output: str) -> str:
    """The first ``FAILED``/``ERROR`` line of pytest's short summary, without the prefix."""
    for line in output.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return line.split(" ", 1)[1].split(" - ")[0]
    return "a test failed"


def run_one(m: Mutation, scratch: Path, timeout: float) -> Outcome:
    """Apply ``m`` in ``scratch``, run its tests, put the file back."""
    reason = unavailable(m.needs, scratch)
    if reason:
        return Outcome(m, "skipped", 0.0, reason)
    path = scratch / m.file
    original = path.read_text(encoding="utf-8")
    path.write_text(original.replace(m.old, m.new), encoding="utf-8")
    build = cpp_build_folder(path) if path.suffix == ".cpp" else None
    built_before = build is not None and build.exists()
    t0 = time.perf_counter()
    try:
        status, output = run_tests(scratch, m.tests, timeout)
    finally:
        path.write_text(original, encoding="utf-8")
        if build is not None and not built_before:
            shutil.rmtree(build, ignore_errors=True)  # the mutated kernel's build: nobody needs it again
    seconds = time.perf_counter() - t0
    if status == 1:
        return Outcome(m, "caught", seconds, failed_test(output))
    if status == 0:
        return Outcome(m, "survived", seconds, "every test passed: " + ", ".join(m.tests))
    what = "timed out" if status is None else f"pytest exited {status}"
    return Outcome(m, "error", seconds, f"{what}: " + " | ".join(output.strip().splitlines()[-3:]))


def copy_repository(root: Path, into: Path) -> Path:
    """A scratch copy of the repository's source, tests and docs."""
    dest = into / "repo"
    shutil.copytree(root, dest, ignore=shutil.ignore_patterns(*IGNORED), symlinks=True)
    return dest


def run_all(
    mutations: Sequence[Mutation],
    root: Path = REPO_ROOT,
    timeout: float = 600,
    report: Callable[[str], None] | None = None,
) -> int:
    """Run every mutation against a scratch copy of ``root``; print one line each and a total; return
    the exit status (0 all caught, 1 one survived, 2 a stale list or a broken run). ``report`` gets
    each line (default: print it at once)."""
    report = report or functools.partial(print, flush=True)
    problems = stale(mutations, root)
    if problems:
        for p in problems:
            report(f"stale: {p}")
        report(f"mutants: the list is stale ({len(problems)} problem(s)); nothing was run")
        return 2
    t0 = time.perf_counter()
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="kvcourse-mutants-") as tmp:
        scratch = copy_repository(root, Path(tmp))
        for m in mutations:
            o = run_one(m, scratch, timeout)
            outcomes.append(o)
            report(f"{o.verdict:<9}{o.seconds:7.1f} s  {m.name}  ({o.detail})")
    count = {v: sum(o.verdict == v for o in outcomes) for v in ("caught", "survived", "skipped", "error")}
    ran = len(outcomes) - count["skipped"]
    notes = [f"{count[v]} {v}" for v in ("survived", "error", "skipped") if count[v]]
    report(
        f"mutants: {count['caught']}/{ran} caught in {time.perf_counter() - t0:.0f} s"
        + (f" ({', '.join(notes)})" if notes else "")
    )
    if count["error"]:
        return 2
    return 1 if count["survived"] else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvcourse.tools.mutants", description=__doc__.splitlines()[0])
    p.add_argument("names", nargs="*", help="run only the mutations whose name contains one of these")
    p.add_argument("--list", action="store_true", help="print the mutations and their tests, run nothing")
    p.add_argument("--timeout", type=float, default=600, help="seconds per mutation's test run (default 600)")
    args = p.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.names or any(n.lower() in m.name.lower() for n in args.names)]
    if not chosen:
        print(f"error: no mutation name contains any of {args.names}", file=sys.stderr)
        return 2
    if args.list:
        for m in chosen:
            print(f"{m.name}\n    {m.file}: {m.old!r} -> {m.new!r}\n    " + "\n    ".join(m.tests))
        return 0
    return run_all(chosen, timeout=args.timeout)


if __name__ == "__main__":
    sys.exit(main())
