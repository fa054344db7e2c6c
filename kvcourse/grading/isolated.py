"""The hidden cases of one notebook, run where no cell of the notebook runs: ``python -m kvcourse.grading.isolated``.

The notebook's own run (nbval, ``kvcourse/grading/gradebook.py``) shows whether each check cell prints
what it must. What an exercise is credited for is decided here, in a fresh process the grader starts
in the sandbox after that run, which reads one JSON request on stdin::

    {"package": "L2_token_flat", "seed": 81723, "seconds": 30,
     "cells": [{"role": "course" | "learner" | "check", "source": "...", "exercise": "L2.1" | null}, ...],
     "exercises": [{"id": "L2.1", "check": 4, "args": "alloc_blocks"}, ...]}

and writes one JSON line per exercise on stdout: ``{"exercise": "L2.1", "observations": [...], "aliased":
[...], "tampered": [...], "status": "ran" | "no record" | "died"}``.

For each exercise a child process is forked from this one, which has run nothing of the notebook.
The child runs the notebook's cells above the exercise's check cell (the course's cells before the
learner's first are run once, here, before the first fork: ``shared_cells``): the course's cells as they are,
the learner's cells as their **definitions only** (``definitions``: imports, ``def``, ``class`` and
assignments to plain names; a statement that does something at the top level, such as rewriting a
file or patching the grader, is not run), then evaluates the check cell's arguments and runs the
hidden cases on them (``hidden.observe_all``). No cell below the check cell runs, and no check cell
runs at all. Before the first case the child

- forgets the grader: its modules leave ``sys.modules`` and the notebook's namespace, so the learner's
  code can import them again only through the import system, which the audit hook sees;
- installs an **audit hook** (``sys.addaudithook``: Python code cannot remove one) that refuses, while
  a frame of the learner's code is on the stack, what an answer never needs: reaching frames
  (``sys._getframe``, a traceback's ``tb_frame``), the garbage collector's object lists, tracing and
  profiling hooks, ``ctypes``, processes, sockets, writing any file, reading ``/proc``, and
  importing or opening the grader, the answer key or another stage (a later stage's identical copy
  of this stage's code). Each refusal is sent to this process at once (``tampered``) and the learner's
  code gets a ``PermissionError``;
- watches for the stage's own implementation running (``hidden.watching``: by what the code is, not
  where it lives); each time it runs, that is sent at once (``aliased``).

The child's record reaches this process on a pipe of its own, with a random token only the child's
code holds (no frame of it can be reached while the learner's code runs), written with functions
bound before the learner's code ran, so a learner's function that writes to the pipe cannot pass
off a record; what is sent at once (``aliased``, ``tampered``) can only cost the submission.
Standard output and error of the child go to ``/dev/null``.

Left out on purpose: an answer that rebinds Python's builtins or the stage's code to hide from the
watch while it runs (the audit hook sees no assignment), and a CPU or memory cap per case (the whole
run has the sandbox's limits and ``seconds`` per exercise, after which the child is killed).
"""

from __future__ import annotations

import ast
import importlib
import json
import marshal
import os
import re
import secrets
import select
import signal
import sys
import time
from pathlib import Path

from kvcourse.grading.integrity import strip_magics

ROOT = Path(__file__).resolve().parents[2]
LEARNER = "<submission>"  # the file name the learner's code is compiled under
GRADER = ("kvcourse.grading", "exercises", "key")  # packages a learner's code may not reach
STAGE_RE = re.compile(r"L\d+_[a-z_]+$")
DENIED = {
    "sys._getframe": "reaches a frame (sys._getframe)",
    "sys._current_frames": "reaches the frames of threads",
    "sys._current_exceptions": "reaches the exceptions of threads",
    "gc.get_objects": "lists every object (gc.get_objects)",
    "gc.get_referrers": "lists what refers to an object (gc.get_referrers)",
    "gc.get_referents": "lists what an object refers to (gc.get_referents)",
    "sys.setprofile": "replaces the profiling hook (sys.setprofile)",
    "sys.settrace": "replaces the tracing hook (sys.settrace)",
    "os.system": "runs a shell command",
    "subprocess.Popen": "starts a process",
    "os.posix_spawn": "starts a process",
    "os.exec": "replaces the process",
    "os.fork": "forks the process",
    "os.forkpty": "forks the process",
    "os.kill": "sends a signal",
    "os.killpg": "sends a signal",
    "pty.spawn": "starts a process",
    "_thread.start_new_thread": "starts a thread (the watch follows one thread)",
}
DENIED_PREFIXES = {"ctypes.": "uses ctypes", "socket.": "uses a socket", "os.spawn": "starts a process"}
FRAMES = ("tb_frame", "gi_frame", "cr_frame", "ag_frame")


def definitions(source: str) -> str:
    """The statements of a learner's cell that define something: imports, functions, classes and
    assignments to plain names. ``definitions("import os\\nos.remove('x')\\ndef f(): pass")`` keeps
    the first and last lines."""
    try:
        tree = ast.parse(strip_magics(source))
    except SyntaxError:
        return ""
    kept = []
    for node in tree.body:
        if isinstance(node, ast.Import | ast.ImportFrom | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            kept.append(node)
        elif isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) for t in node.targets):
            kept.append(node)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            kept.append(node)
    return ast.unparse(ast.Module(body=kept, type_ignores=[]))


def is_grader(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in GRADER)


def other_stage(module: str, package: str) -> bool:
    root = module.split(".")[0]
    return bool(STAGE_RE.match(root)) and root != package


def audit_hook(package: str, fd: int):
    """The hook that refuses, while the learner's code runs, what the module docstring lists."""
    own = (ROOT / package).as_posix() + "/"
    shared = (ROOT / "kvcourse").as_posix() + "/"
    grading = (ROOT / "kvcourse" / "grading").as_posix() + "/"
    root = ROOT.as_posix() + "/"
    busy = [False]
    getframe, write, fspath, realpath = sys._getframe, os.write, os.fsdecode, os.path.realpath

    def refused(event: str, args: tuple) -> str | None:
        if event in DENIED:
            return DENIED[event]
        for prefix, what in DENIED_PREFIXES.items():
            if event.startswith(prefix):
                return what
        if event == "object.__getattr__" and args[1] in FRAMES:
            return f"reaches a frame (.{args[1]})"
        if event == "import":
            if is_grader(args[0]):
                return f"imports {args[0]}, the grader's"
            if other_stage(args[0], package):
                return f"imports {args[0]}, another stage's code"
        if event == "open":
            path, mode, flags = args
            if isinstance(path, int):
                return None if mode in (None, "r", "rb") else f"opens file descriptor {path} to write"
            path = realpath(fspath(path))
            if (mode and any(c in mode for c in "wax+")) or (flags and flags & (os.O_WRONLY | os.O_RDWR)):
                return f"writes {path}"
            if path.startswith("/proc/"):
                return f"reads {path}"
            if path.startswith(root) and not (
                path.startswith(own) or (path.startswith(shared) and not path.startswith(grading))
            ):
                return f"reads {path[len(root):]}, outside its stage"
        return None

    def hook(event: str, args: tuple) -> None:
        if busy[0] or (event == "object.__getattr__" and args[1] not in FRAMES):
            return  # the profile hook reads each frame's f_code: the common case, kept cheap
        busy[0] = True
        try:
            what = refused(event, args)
            frame = getframe(1) if what else None
            while frame is not None and frame.f_code.co_filename != LEARNER:
                frame = frame.f_back
        finally:
            busy[0] = False
        if what and frame is not None:  # refused only while the learner's code runs
            write(fd, "".join(["tampered ", what.replace("\n", " "), "\n"]).encode())
            raise PermissionError(f"the grader refuses this: {what}")

    return hook


def run_cell(k: int, cell: dict, namespace: dict) -> None:
    """Run one cell in ``namespace``: the course's as it is, the learner's as its definitions only; an
    error ends the cell, not the run (as in the notebook)."""
    learner = cell["role"] == "learner"
    source = definitions(cell["source"]) if learner else strip_magics(cell["source"])
    try:
        exec(compile(source, LEARNER if learner else f"<course cell {k}>", "exec"), namespace)  # noqa: S102
    except Exception:  # noqa: BLE001, S110
        pass


def shared_cells(cells: list[dict]) -> int:
    """How many cells every child shares: the course's cells before the first of the learner's (the
    setup: the model loaded once), unless they import JAX (XLA's threads do not survive a fork)."""
    count = next((k for k, c in enumerate(cells) if c["role"] != "course"), len(cells))
    for cell in cells[:count]:
        try:
            tree = ast.parse(strip_magics(cell["source"]))
        except SyntaxError:
            return 0
        if any(name.split(".")[0] == "jax" for node in ast.walk(tree) for name in imported(node)):
            return 0
    return count


def imported(node) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    return [node.module or ""] if isinstance(node, ast.ImportFrom) else []


def child(request: dict, exercise: dict, fd: int, token: str, namespace: dict, start: int) -> None:
    """Run one exercise's hidden cases (see the module docstring), in ``namespace`` where the first
    ``start`` cells ran already; never returns."""
    write, dumps, exit_now, join = os.write, marshal.dumps, os._exit, "".join
    null = os.open(os.devnull, os.O_RDWR)
    for std in (0, 1, 2):
        os.dup2(null, std)
    from kvcourse.grading import hidden

    package, exercise_id = request["package"], exercise["id"]
    for k, cell in enumerate(request["cells"][: exercise["check"]]):
        if k >= start and cell["role"] != "check":
            run_cell(k, cell, namespace)
    spec = hidden.load_fresh(package).HIDDEN[exercise_id]
    cases = spec.draw(hidden.rng_for(request["seed"], exercise_id))
    try:
        values = eval(compile(f"({exercise['args']},)", LEARNER, "eval"), namespace)  # noqa: S307
    except Exception as e:  # noqa: BLE001 - the answer is not defined
        values = None
        problem = f"{type(e).__name__}: {hidden.first_line(str(e))}"
    for name, value in list(namespace.items()):  # the grader leaves the learner's reach
        owner = getattr(value, "__name__", None) if type(value).__name__ == "module" else None
        owner = owner or getattr(value, "__module__", None)
        if isinstance(owner, str) and is_grader(owner):
            del namespace[name]
    for name in [m for m in sys.modules if is_grader(m)]:
        del sys.modules[name]
    sys.addaudithook(audit_hook(package, fd))
    if values is None:
        observations, caught = [{"error": problem}] * len(cases), []
    else:
        fn, *context = values
        observations, caught = hidden.observe_all(spec, fn, context, cases, request["seconds"], fd)
    record = {"exercise": exercise_id, "observations": observations, "aliased": sorted(set(caught))}
    # marshal (C code, bound before the learner's code ran), not json (its encoder is a module
    # global the learner's code could replace), and join, not +: no code of the learner's sees the token
    write(fd, join(["record ", token, " ", dumps(record).hex(), "\n"]).encode())
    exit_now(0)


def collect(pid: int, read_end: int, token: str, seconds: float) -> dict:
    """What one child sent: its record (the line with ``token``) and what it was seen doing."""
    chunks, deadline = [], time.monotonic() + seconds
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([read_end], [], [], left)[0]:
            os.kill(pid, signal.SIGKILL)
            break
        chunk = os.read(read_end, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(read_end)
    status = os.waitpid(pid, 0)[1]
    found = {"observations": None, "aliased": [], "tampered": [], "status": "ran"}
    records = []
    for line in b"".join(chunks).decode(errors="replace").splitlines():
        kind, _, rest = line.partition(" ")
        try:
            if kind == "aliased":
                found["aliased"].append(rest)
            elif kind == "tampered":
                found["tampered"].append(rest)
            elif kind == "record" and rest.startswith(token + " "):
                records.append(marshal.loads(bytes.fromhex(rest[len(token) + 1 :])))
        except (ValueError, EOFError, TypeError):
            continue
    if len(records) == 1 and isinstance(records[0], dict) and isinstance(records[0].get("observations"), list):
        found["observations"] = records[0]["observations"]
        found["aliased"] += records[0].get("aliased", [])
    elif os.WIFSIGNALED(status) or os.WEXITSTATUS(status) != 0:
        found["status"] = "died"
    else:
        found["status"] = "no record"
    found["aliased"] = sorted(set(found["aliased"]))
    return found


PRELOADED = ("torch", "numpy", "matplotlib.pyplot")  # what every notebook's first cell imports


def run(request: dict) -> list[dict]:
    """Each exercise's findings, one child process per exercise (see the module docstring). The
    libraries every notebook imports are imported once, here, before the first fork (JAX is not: XLA
    must see the notebook's first cell's flags, and its threads do not survive a fork), and torch
    keeps to one thread."""
    for name in PRELOADED:
        importlib.import_module(name)
    # OpenMP's worker threads do not survive a fork (a child's first parallel op would wait for them
    # forever): torch runs on this thread only, here and in every child
    sys.modules["torch"].set_num_threads(1)
    namespace, start = {"__name__": "__main__"}, shared_cells(request["cells"])
    null = os.open(os.devnull, os.O_RDWR)
    saved = os.dup(1), os.dup(2)
    os.dup2(null, 1), os.dup2(null, 2)  # what the course's cells print is not this run's output
    for k, cell in enumerate(request["cells"][:start]):
        run_cell(k, cell, namespace)
    sys.stdout.flush(), sys.stderr.flush()
    os.dup2(saved[0], 1), os.dup2(saved[1], 2)
    results = []
    for exercise in request["exercises"]:
        token = secrets.token_hex(16)
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read_end)
            try:
                child(request, exercise, write_end, token, namespace, start)
            finally:
                os._exit(1)
        os.close(write_end)
        found = collect(pid, read_end, token, request["seconds"] + 120)  # the cells above run first
        results.append({"exercise": exercise["id"], **found})
    return results


def main() -> int:
    request = json.loads(sys.stdin.read())
    for result in run(request):
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
