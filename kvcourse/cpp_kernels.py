"""Build and load a stage's C++ kernel once, cached per CPU: ``load_cpp_kernel(source)``.

``torch.utils.cpp_extension.load`` compiles a ``.cpp`` file against PyTorch's headers (gcc and ninja,
about 40 s on this 2-core machine) into a Python module. The build goes to
``.cache/kernels/<cpu>-<hash>/<file>_<hash>/`` (``KVCOURSE_CACHE``), with ``-O3 -march=native -fopenmp``: native
vector instructions are why the build is kept per CPU model, since a binary built for one CPU may not
run on another. A later call, in this process or the next, loads the built module in a fraction of a
second; torch rebuilds only when the source or the flags change. Each build's seconds are written
next to it (``compile_seconds.json``), so a benchmark can report what the first run paid.

Example::

    module = load_cpp_kernel(Path("L4_paged_kernel/paged_attention.cpp"))
    out = module.paged_attention(q, k_pool, v_pool, block_tables, context_lens, cu_q_lens, 0.125)

Left out on purpose: other compilers than gcc/clang, and ahead-of-time wheels.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import shutil
import time
from pathlib import Path

from kvcourse.model_store import cache_root

FLAGS = ["-O3", "-march=native", "-fopenmp"]


def cpu_key() -> str:
    """A folder name for this CPU model and these flags, e.g. ``x86_64-3f2a9c1b``."""
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


@functools.cache
def load_cpp_kernel(source: Path):
    """The compiled module of ``source`` (built on first use, then loaded from the cache)."""
    from torch.utils import cpp_extension

    _ninja_on_path()
    name, folder = build_name(source), build_folder(source)
    folder.mkdir(parents=True, exist_ok=True)
    built = folder / f"{name}.so"
    before = built.stat().st_mtime if built.exists() else None
    t0 = time.perf_counter()
    module = cpp_extension.load(
        name=name,
        sources=[str(source)],
        extra_cflags=FLAGS,
        extra_ldflags=["-fopenmp"],
        build_directory=str(folder),
        verbose=False,
    )
    if built.stat().st_mtime != before:  # it was (re)built just now
        (folder / "compile_seconds.json").write_text(json.dumps({"seconds": time.perf_counter() - t0}) + "\n")
    return module


def build_name(source: Path) -> str:
    """The module's name: the file's stem and a hash of its text, so that byte-identical copies in two
    stages share one build. Example: ``paged_attention_1c9e4f02``."""
    return f"{source.stem}_{hashlib.sha256(source.read_bytes()).hexdigest()[:8]}"


def build_folder(source: Path) -> Path:
    """Where ``source`` is built for this CPU: ``.cache/kernels/<cpu>-<hash>/<file>_<hash>/``."""
    return cache_root() / "kernels" / cpu_key() / build_name(source)


def compile_seconds(source: Path) -> float | None:
    """How long the cached build of ``source`` took, if it was built here."""
    record = build_folder(source) / "compile_seconds.json"
    return json.loads(record.read_text())["seconds"] if record.exists() else None


def build_all(root: Path) -> list[tuple[Path, bool, float | None]]:
    """Build every stage's ``.cpp`` kernel under ``root`` (``make setup`` does, so that no test or
    benchmark pays the compile). Returns (file, built just now, the build's seconds) for each."""
    done = []
    for source in sorted(root.glob("L[0-9]_*/*.cpp")):
        record = build_folder(source) / "compile_seconds.json"
        before = record.stat().st_mtime if record.exists() else None
        load_cpp_kernel(source)
        done.append((source, record.stat().st_mtime != before, compile_seconds(source)))
    return done
