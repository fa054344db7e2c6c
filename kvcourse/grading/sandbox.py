"""The box a submission runs in while it is graded: bubblewrap where installed, resource limits always.

``make grade`` executes learners' notebooks, which are code. Each one runs under

- **bubblewrap** (``bwrap``, Debian's ``bubblewrap`` package): only the submission's work folder
  (writable) and a read-only runtime are in the box: the system's programs, libraries and ``/etc``
  (``SYSTEM``), the repository, the Python environment and the model cache (``needed``). No home
  folder (a private, empty one), no other checkout, no other submission, a private ``/tmp``, its own
  ``/proc`` (its own process namespace: the grader's processes and their command lines are not
  there), no network (loopback only, which the Jupyter kernel talks over), its own IPC and host-name
  namespaces, killed with the grader. The answer key is out of sight: the course's ``key/`` (the
  reference notebooks with their solutions, each stage's independent answers), a release's
  autograder bundle (``key``) and the git history are covered by empty folders;
- **limits** set with ``setrlimit`` (what ``prlimit`` sets): address space (``memory_bytes``) and CPU
  seconds (``cpu_seconds``). A process over its CPU time is killed, which the grader reports as a
  dead kernel.

Without bubblewrap a submission runs with the grader's permissions (it can read the key, and the
grader's command line in ``/proc``): the grader refuses a class or a release's bundle then, unless
told ``--no-sandbox`` (``UNSAFE=1``), which every row's note repeats; the limits still apply, and
``warning()`` says what is missing and how to install it. Example::

    box = Sandbox.here(repo, memory_bytes=8 << 30, cpu_seconds=1800)
    argv, preexec = box.wrap([sys.executable, "-m", "pytest", ...], workdir)
    subprocess.run(argv, preexec_fn=preexec, ...)

Left out on purpose: seccomp filters and cgroups (a container per submission, as Gradescope does, is
the next step up), and hiding the stages' code (the notebooks import it; an answer that calls it is
caught by the hidden cases' watch instead).
"""

from __future__ import annotations

import functools
import os
import resource
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvcourse.model_store import cache_root

SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/sys")  # the runtime
BOX_HOME = "/tmp/home"  # the box's own home folder, empty, in its private /tmp
INSTALL_HINT = "apt-get install bubblewrap (Debian/Ubuntu) or dnf install bubblewrap (Fedora)"


@functools.cache
def bwrap_works() -> str | None:
    """None when ``bwrap`` can make a box here, else why not (missing, or refused by the kernel)."""
    path = shutil.which("bwrap")
    if path is None:
        return "bubblewrap (bwrap) is not installed"
    probe = [path, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--unshare-all", "true"]
    try:
        done = subprocess.run(probe, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"bwrap does not run here ({e})"
    if done.returncode != 0:
        return f"bwrap cannot make a sandbox here ({done.stderr.strip().splitlines()[-1:]})"
    return None


@dataclass(frozen=True)
class Sandbox:
    """How to box one grading run (see the module docstring)."""

    repo: Path
    memory_bytes: int
    cpu_seconds: int
    use_bwrap: bool
    key: Path | None = None  # a student release's autograder bundle, out of sight like the answers

    @classmethod
    def here(cls, repo: Path, memory_bytes: int, cpu_seconds: int, key: Path | None = None) -> Sandbox:
        return cls(repo, memory_bytes, cpu_seconds, use_bwrap=bwrap_works() is None, key=key)

    def warning(self) -> str | None:
        """The one line to print when submissions will run outside bubblewrap."""
        if self.use_bwrap:
            return None
        return (
            f"warning: {bwrap_works()}: notebooks run with the grader's permissions, under memory and "
            f"CPU-time limits only. Install it: {INSTALL_HINT}"
        )

    def covered(self) -> list[Path]:
        """What the box hides: the answer key (one folder, ``key/``, or a release's bundle) and the
        history that holds it."""
        return [self.repo / "key", self.repo / ".git"] + ([self.key] if self.key else [])

    def wrap(self, argv: list[str], workdir: Path | None) -> tuple[list[str], Callable[[], None]]:
        """The command that runs ``argv`` in the box, and the ``preexec_fn`` that sets the limits;
        ``workdir`` is the one folder it may write (None: none, its private /tmp aside)."""
        return (self._bwrap(workdir) + argv if self.use_bwrap else argv), self._limits

    def needed(self) -> list[Path]:
        """What a run reads besides the system's runtime: the repository, the Python environment (its
        real folders: a venv may link elsewhere) and the model cache. Nothing else of the machine is
        in the box: no home folder, no other checkout (the full course a release was made from), no
        folder of the class's other submissions."""
        paths = [self.repo, Path(sys.prefix), Path(sys.base_prefix), cache_root()]
        found = {Path(os.path.realpath(p)) for p in paths} | {p.absolute() for p in paths if not p.is_symlink()}
        return sorted(p for p in found if p.exists() and not any(p.is_relative_to(s) for s in SYSTEM))

    def _bwrap(self, workdir: Path | None) -> list[str]:
        args = ["bwrap", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp"]
        for path in SYSTEM:  # the read-only runtime: programs, libraries, their configuration
            if os.path.islink(path):
                args += ["--symlink", os.readlink(path), path]
            elif os.path.isdir(path):
                args += ["--ro-bind", path, path]
        for path in self.needed():
            args += ["--ro-bind", str(path), str(path)]
        args += ["--dir", BOX_HOME, "--setenv", "HOME", BOX_HOME]
        for path in self.covered():
            if path.is_dir():
                args += ["--tmpfs", str(path)]
            elif path.exists():
                args += ["--ro-bind", "/dev/null", str(path)]
        if workdir is not None:
            args += ["--bind", str(workdir), str(workdir)]  # the submission's folder, the one it may write
        args += ["--unshare-all", "--die-with-parent", "--new-session", "--chdir", str(self.repo)]
        return args + ["--"]

    def _limits(self) -> None:
        resource.setrlimit(resource.RLIMIT_AS, (self.memory_bytes, self.memory_bytes))
        resource.setrlimit(resource.RLIMIT_CPU, (self.cpu_seconds, self.cpu_seconds))
