"""Build and load a stage's C++ kernel once, cached per CPU: ``load_cpp_kernel(source)``.

``torch.utils.cpp_extension.load`` compiles a ``.cpp`` file against PyTorch's headers (gcc and ninja;
19.7 s on the course's 2-core VM in ``make bench``'s fresh clone of commit 92dedf8, its JSON's
``cpp_kernel_build_seconds``) into a Python module. The build goes to
``.cache/kernels/<cpu>-<hash>/<file>_<hash>/`` (``KVCOURSE_CACHE``), with ``-O3 -march=native -fopenmp``: native
vector instructions are why the build is kept per CPU model, since a binary built for one CPU may not
run on another. A later call, in this process or the next, loads the built module in a fraction of a
second; torch rebuilds only when the source or the flags change. Byte-identical copies (L4's and
L5's kernel) share one build, compiled from whichever copy was built there first (``built_from``).
Each build's seconds are written next to it (``compile_seconds.json``), so a benchmark can report
what the first run paid.

Example::

    module = load_cpp_kernel(Path("L4_paged_kernel/fast/paged_attention.cpp"))
    out = module.paged_attention(q, k_pool, v_pool, block_tables, context_lens, cu_q_lens, 0.125)

Where no C++ compiler with OpenMP is found (a laptop without gcc, macOS's clang without libomp),
the build fails once per process and ``build_problem`` says why; ``load_cpp_kernel`` then raises
``CppKernelUnavailable`` with that reason, ``make setup`` reports it and carries on, and the smokes,
tests and benchmark skip or replace the C++ runs, saying so. Nothing else in the course needs a
compiler.

An interrupted build resumes. torch marks a build in progress with a file ``lock`` in the build folder
and waits, forever, for that file to go; a build killed part way (a closed terminal, ``kill``, a second
Ctrl-C while the first is handled: one Ctrl-C lets torch remove it) leaves it behind. So each build or
load here first takes the course's own lock, an ``fcntl.flock`` on ``build.lock`` beside it
(``model_store.exclusive``), which the operating system releases when its process ends. Holding it, a
``lock`` file is one that no live build holds: it is removed, with one line, ``note: removed a stale
build lock .../lock left by an interrupted build``, and ninja redoes what the interrupted build left
undone (it rebuilds any output it has no record of finishing). A build running beside, in another
process, is waited for, with the line ``waiting for another build of paged_attention_08fd766d (lock
.../build.lock, held by pid 4242)``, for at most 15 minutes (``LOCK_WAIT_SECONDS``), then
``LockTimeout`` names the lock and the process to end.

Left out on purpose: other compilers than gcc/clang, and ahead-of-time wheels.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

from kvcourse.model_store import LockTimeout, cache_root, exclusive

FLAGS = ["-O3", "-march=native", "-fopenmp"]


@functools.cache
def cpu_key() -> str:
    """A folder name for this CPU model and these flags, e.g. ``x86_64-3f2a9c1b``. Worked out once per
    process: reading ``/proc/cpuinfo`` is a file read and a parse, and a stage looks its kernel up on
    every attention call."""
    try:
        names = [
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith(("model name", "flags"))
        ]
    except OSError:
        names = [platform.processor()]
    digest = hashlib.sha256("\n".join([platform.machine(), *names[:2], *FLAGS]).encode()).hexdigest()[:8]
    return f"{platform.machine()}-{digest}"


def _ninja_on_path() -> None:
    """torch's build needs ``ninja`` on PATH; the pinned PyPI ``ninja`` puts it in the venv's bin."""
    if shutil.which("ninja"):
        return
    import ninja

    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


class CppKernelUnavailable(RuntimeError):
    """The C++ kernel cannot be built on this machine; the message says why and what to use instead."""


def load_cpp_kernel(source: Path):
    """The compiled module of ``source`` (built on first use, then loaded from the cache).

    Raises ``CppKernelUnavailable`` where it cannot be built (see ``build_problem``).
    """
    module, problem = _build(source)
    if problem is not None:
        raise CppKernelUnavailable(problem)
    return module


def build_problem(source: Path) -> str | None:
    """None if ``source`` builds (or is built) here, else why not, in one line. Tried once per process.

    Example, with ``CXX=/nonexistent/c++``: ``"paged_attention.cpp could not be built here
    (/bin/sh: 1: /nonexistent/c++: not found); kernel='cpp' needs a C++ compiler with OpenMP, such as
    g++, and kernel='torch' needs none"``.
    """
    return _build(source)[1]


def compiler_complaint(log: str) -> str:
    """The lines of a failed torch build log that are the compiler's (or the shell's), not ninja's
    and not the command it ran; the first three, joined.

    Example: ``compiler_complaint("Error building extension 'k': [1/2] c++ -c k.cpp -o k.o\nFAILED:
    k.o\nc++ -c k.cpp -o k.o\n/bin/sh: 1: c++: not found\nninja: build stopped")`` ->
    ``"/bin/sh: 1: c++: not found"``.
    """
    lines = [x.strip() for x in log.splitlines()]
    own = [
        x
        for x in lines
        if x and " -o " not in x and not x.startswith(("Error building", "FAILED:", "ninja:"))
    ]
    errors = [x for x in own if "error" in x.lower()] or own or lines[-1:]
    return " / ".join(errors[:3])


_BUILDS: dict[Path, tuple] = {}  # build folder -> (module, None) or (None, problem), once per process


def _build(source: Path):
    """(module, None) once ``source`` is built and loaded, or (None, the reason it cannot be).

    Keyed by the build folder, which byte-identical copies share (L4's and L5's kernel): the second
    copy takes the first one's outcome. Asking torch again, after a failed build under the same name,
    gives an ImportError about a missing ``.so`` instead of the compiler's complaint.
    """
    folder = build_folder(source)
    if folder not in _BUILDS:
        try:
            _BUILDS[folder] = _compile(source), None
        except LockTimeout:  # not a compiler's problem: another build is still running, say so
            raise
        except (RuntimeError, OSError, ImportError, subprocess.SubprocessError) as e:
            reason = compiler_complaint(str(e))
            _BUILDS[folder] = (
                None,
                (
                    f"{source.name} could not be built here ({reason}); kernel='cpp' needs a C++ compiler "
                    f"with OpenMP, such as g++, and kernel='torch' needs none"
                ),
            )
    return _BUILDS[folder]


def _compile(source: Path):
    """Build ``source`` with torch's extension builder (or load the cached build); return the module.

    Holds ``build.lock`` throughout (see the module's docstring), so torch's ``lock`` file, if there is
    one, was left by a build that is gone: removed before torch would wait on it.
    """
    from torch.utils import cpp_extension

    _ninja_on_path()
    name, folder = build_name(source), build_folder(source)
    with exclusive(folder / "build.lock", f"build of {name}"):
        stale = folder / "lock"
        if stale.exists():
            stale.unlink()
            print(f"note: removed a stale build lock {stale} left by an interrupted build", file=sys.stderr)
        built = folder / f"{name}.so"
        before = built.stat().st_mtime if built.exists() else None
        t0 = time.perf_counter()
        module = cpp_extension.load(
            name=name,
            sources=[str(built_from(source, folder))],
            extra_cflags=FLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(folder),
            verbose=False,
        )
        if built.stat().st_mtime != before:  # it was (re)built just now; written whole, or not at all
            partial = folder / "compile_seconds.partial"
            partial.write_text(json.dumps({"seconds": time.perf_counter() - t0}) + "\n")
            partial.replace(folder / "compile_seconds.json")
    return module


def built_from(source: Path, folder: Path) -> Path:
    """The copy of ``source`` that ``folder`` is built from: the first one built there, while it is still
    there and byte-identical, else ``source`` (then recorded as that copy, in ``built_from.txt``).

    ninja rebuilds an output whose command changed, and the command names the source's path. Without
    this, L4's and L5's copies of ``paged_attention.cpp``, which share one build folder, would each
    rebuild it (a whole compile) whenever a process asked for the other one than the last build did: the
    L5 notebook after the L4 one, ``make smoke``'s L5 smoke after its L4 smoke, every ``make setup``.

    Example: ``built_from(Path("L5_clones/fast/paged_attention.cpp"), folder)`` ->
    ``Path("/repo/L4_paged_kernel/fast/paged_attention.cpp")`` once L4's copy was built there first.
    """
    record = folder / "built_from.txt"
    try:
        first = Path(record.read_text(encoding="utf-8").strip())
        if first.read_bytes() == source.read_bytes():
            return first
    except OSError:  # not recorded yet, or that copy is gone
        pass
    record.write_text(f"{source.resolve()}\n", encoding="utf-8")
    return source.resolve()


def build_name(source: Path) -> str:
    """The module's name: the file's stem and a hash of its text, so that byte-identical copies in two
    stages share one build. Example: ``paged_attention_1c9e4f02``. The hash is kept per version of the
    file (its modification time and size), so an edited kernel is rebuilt and an unchanged one costs a
    ``stat``."""
    stat = source.stat()
    return _hashed_name(source, stat.st_mtime_ns, stat.st_size)


@functools.cache
def _hashed_name(source: Path, mtime_ns: int, size: int) -> str:
    return f"{source.stem}_{hashlib.sha256(source.read_bytes()).hexdigest()[:8]}"


def build_folder(source: Path) -> Path:
    """Where ``source`` is built for this CPU: ``.cache/kernels/<cpu>-<hash>/<file>_<hash>/``."""
    return cache_root() / "kernels" / cpu_key() / build_name(source)


def compile_seconds(source: Path) -> float | None:
    """How long the cached build of ``source`` took, if it was built here."""
    record = build_folder(source) / "compile_seconds.json"
    return json.loads(record.read_text())["seconds"] if record.exists() else None


def build_all(root: Path) -> list[tuple[Path, bool, float | None, str | None]]:
    """Build every stage's ``.cpp`` kernel under ``root``, in its ``fast/`` folder (``make setup`` does, so
    that no test or benchmark pays the compile). Returns (file, built just now, the build's seconds, the problem or
    None) for each; a kernel that cannot be built here is reported, not raised."""
    done = []
    for source in sorted(root.glob("L[0-9]_*/fast/*.cpp")):
        record = build_folder(source) / "compile_seconds.json"
        before = record.stat().st_mtime if record.exists() else None
        problem = build_problem(source)
        now = record.exists() and record.stat().st_mtime != before
        done.append((source, now, compile_seconds(source), problem))
    return done
