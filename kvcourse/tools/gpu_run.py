"""One call on a lent GPU, well spent: ``python -m kvcourse.tools.gpu_run`` (``make gpu-run``).

    python -m kvcourse.tools.gpu_run [--out FOLDER] [--minutes 9] [--commit SHA] [--plan]

A lent GPU machine gives a session minutes, not hours, and installs nothing: it runs the course from
the repository root on the machine's own torch, Triton and JAX, with ``transformers`` (the course's pin)
installed from wheels carried beside the tree where the machine's differs (``make gpu-wheels``, run
where pip reaches PyPI, fills ``.cache/gpu-wheels/``; carry that folder). In order, each step in its own
process with a time limit cut from what is left of ``--minutes``:

1. ``gpu_check --side-by-side``: the kernel cases and every stage's smoke at once (correctness only,
   so they share the GPU without harm), into ``results/gpu-check-cuda.json``; then ``bench.agreement``:
   L4's tokens on (b) against HF batch 1, one way of running its attention at a time;
2. alone, the timings: the decode kernel table, the prefill table, L6's compile (``bench.l6_compile``:
   scanned layers, to the first ``generate()``, cold and from the persistent cache), ``bench.run`` on workload (b) for L4
   and L5, eager and with decode graphs, against HF batch 1 (on a random Llama of SmolLM2-135M's shape
   where the course model is not prepared: timings depend on shapes, not weights);
3. where time is left, the decode profile again, the ``cuda``-marked engine tests and the kernel sweep
   (every launch shape of the Triton kernel).

A step whose usual time (``Plan.seconds``, from the runs of 2026-11-27 and 2026-11-28) no longer fits is skipped
and the run says so. Everything lands in one folder, ready to commit: ``--out`` (default ``bench``)
gets ``results/*-cuda*.json`` and ``plots/*-cuda*.png`` beside the CPU's, and
``gpu-runs/<date>/`` the run's record (``gpu-run.json``: each step, its command, verdict, seconds,
skipped or not, with the card, the versions and the commit), its printed summary and each step's log.
The exit status is 0 when every step that ran passed, 1 otherwise; with no CUDA device the run prints
its plan and exits 2.

Left out on purpose: the serving simulator's step-cost calibration (the simulator is issue 44's; it
joins the plan when it exists), and anything that needs a second GPU.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvcourse.harness.provenance import COMMIT_ENV, library_versions, tree_commit
from kvcourse.model_store import REPO_ROOT, cache_root, prepared_default_model

WHEELS = ("transformers", "tokenizers")  # what the GPU machine's image may hold at another version
PINNED = {name: version for name, version in
          (line.split("==") for line in (REPO_ROOT / "requirements.txt").read_text().splitlines()
           if line.split("==")[0] in WHEELS)}  # fmt: skip


@dataclass
class Plan:
    """One step: its name, its command (``{out}``, ``{model}`` filled in at run time), the seconds it
    took on the H100 of 2026-11-27 (or an estimate, said so in ``why``), and whether it runs only
    where time is left at the end."""

    name: str
    command: list[str]
    seconds: int
    why: str
    optional: bool = False


def plan() -> list[Plan]:
    """The steps, in order (``python`` is this interpreter): correctness first, then the timings, each
    change's before and after side by side in one step (the kernel tables time the launch before and
    each change; ``bench.run`` and ``bench.profile`` run L4 eager and with its decode graphs; L6's
    unrolled layers, 81 s to a first ``generate()`` on the H100 of 2026-11-27, did not fit beside the
    scanned ones in 2026-11-28's run, so ``bench.l6_compile`` builds the scanned ones only)."""
    py = [sys.executable, "-m"]
    return [
        Plan("gpu-check", [*py, "kvcourse.tools.gpu_check", "--side-by-side", "--max-new-tokens", "8",
                           "--timeout", "200", "--json", "{out}/results/gpu-check-cuda.json"], 200,
             "kernel cases (both dot precisions) and every smoke at once: 180 s at 32 new tokens on 2026-11-27; "
             "at 16, L4's and L6's smokes were still running when 152 s ran out on 2026-11-28"),
        Plan("agreement", [*py, "bench.agreement", "--device", "cuda", "--model", "{model}",
                           "--out", "{out}/results/agreement-cuda.json"], 60,
             "estimated: HF batch 1 on (b) (62 s on 2026-11-28 in bench.run, with its warm-up) and L4 five "
             "ways: which change left HF batch 1 on request 29 on 2026-11-28"),
        Plan("decode kernels", [*py, "bench.kernels", "--device", "cuda",
                                "--out", "{out}/results/kernels-cuda.json"], 40,
             "34 s on 2026-11-28 (the launch before, each change, the default)"),
        Plan("prefill kernels", [*py, "bench.kernels", "--device", "cuda", "--prefill",
                                 "--out", "{out}/results/kernels-prefill-cuda.json"], 25, "25 s on 2026-11-28"),
        Plan("L6 compile", [*py, "bench.l6_compile", "--device", "cuda", "--variants", "scanned",
                            "--autotune-levels", "default", "--model", "{model}", "--out", "{out}/results/l6-compile-cuda.json"], 90,
             "estimated: scanned, cold and from the persistent cache; unrolled and scanned together "
             "did not finish in 161 s on 2026-11-28 (unrolled: 81 s to a first generate() on 2026-11-27)"),
        Plan("bench (b)", [*py, "bench.run", "--device", "cuda", "--workloads", "b", "--stages", "L4,L5",
                           "--peers", "none", "--model", "{model}", "--out", "{out}"], 125,
             "114 s on 2026-11-28; HF batch 1, the token reference, 62 s of it"),
        Plan("decode profile", [*py, "bench.profile", "--device", "cuda", "--stages", "L4,L4:graphs",
                                "--model", "{model}", "--out", "{out}/results/profile-cuda.json"], 40,
             "35 s on 2026-11-28", optional=True),
        Plan("cuda tests", [*py, "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda",
                            "tests/test_decode_graphs.py"], 40,
             "estimated: real decode graphs, on by default, against HF",
             optional=True),
        Plan("kernel sweep", [*py, "bench.kernels", "--device", "cuda", "--sweep",
                              "--out", "{out}/results/kernels-sweep-cuda.json"], 90,
             "estimated: 36 launch shapes at each decode shape", optional=True),
    ]  # fmt: skip


@dataclass
class Done:
    """What a step did: ``status`` is ok, FAILED, timed out or skipped (with why)."""

    name: str
    command: str
    status: str
    seconds: float
    note: str = ""
    log: str | None = None


@dataclass
class Run:
    """The run's record, written as ``gpu-run.json``."""

    device_name: str
    versions: dict
    commit: str
    date: str
    minutes: float
    steps: list[Done] = field(default_factory=list)


def wheel_site(wheels: Path, site: Path) -> tuple[Path | None, str]:
    """Where the carried wheels were installed (a folder to put first on PYTHONPATH), or None where the
    machine's own packages are the course's pins; and a line saying which. Installs with pip, offline.

    Example, on a machine with transformers 5.17.0 and the two wheels carried:
    ``(Path(".cache/gpu-site"), "installed transformers 5.23.0, tokenizers 0.23.3 from .cache/gpu-wheels")``.
    """
    have = library_versions(WHEELS)
    if have == PINNED:
        return None, "the machine's " + ", ".join(f"{n} {v}" for n, v in have.items()) + " are the pins"
    found = sorted(wheels.glob("*.whl"))
    if not found:
        raise SystemExit(
            f"error: this machine has {have}, the course pins {PINNED}, and {wheels} holds no wheels: run "
            "make gpu-wheels where pip reaches PyPI, and carry that folder"
        )
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
         "--upgrade", "--target", str(site), *map(str, found)],
        check=True,
    )  # fmt: skip
    return site, f"installed {', '.join(w.name.split('-')[0] + ' ' + w.name.split('-')[1] for w in found)} from {wheels}"


def shaped_model(folder: Path) -> Path:
    """The checkpoint the timings run on: the course model where it is prepared, else a random Llama
    of its shape, written into ``folder`` (``kvcourse.harness.tiny``)."""
    course = prepared_default_model()
    if course:
        return course
    from kvcourse.harness.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint("llama", folder / "smollm2-shaped-llama", size="smollm2")


def run_step(step: Plan, command: list[str], log: Path, limit: float, env: dict) -> Done:
    """Run one step's ``command`` for at most ``limit`` seconds, its output in ``log``."""
    t0 = time.perf_counter()
    with log.open("w") as out:
        try:
            code = subprocess.run(
                command, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=limit
            ).returncode
            status = "ok" if code == 0 else "FAILED"
            note = "" if code == 0 else f"exit {code}"
        except subprocess.TimeoutExpired:
            status, note = "timed out", f"stopped after {limit:.0f} s"
    tail = log.read_text(errors="replace").strip().splitlines()[-1:] or [""]
    return Done(step.name, " ".join(command), status, round(time.perf_counter() - t0, 1),
                note or tail[0][:200], str(log))  # fmt: skip


def fits(step: Plan, left: float, later: list[Plan]) -> str | None:
    """Why ``step`` is skipped with ``left`` seconds to go, or None if it runs: a required step needs its
    usual seconds; an optional one must also leave the required steps after it theirs.

    Example: ``fits(Plan("bench (b)", [], 310, ""), 200, [])`` -> ``"needs about 310 s, 200 s left"``.
    """
    need = step.seconds + (sum(s.seconds for s in later if not s.optional) if step.optional else 0)
    return None if need <= left else f"needs about {step.seconds} s, {left:.0f} s left"


def no_gpu() -> str | None:
    """Why this machine cannot run the plan, or None: torch missing, or no CUDA device."""
    try:
        import torch
    except ImportError:
        return f"{sys.executable} has no torch"
    return None if torch.cuda.is_available() else "torch.cuda.is_available() is False"


def print_plan(steps: list[Plan], minutes: float) -> None:
    print(f"make gpu-run: {len(steps)} steps within {minutes:g} min on a CUDA GPU, each in its own process:")
    for i, step in enumerate(steps, 1):
        extra = ", only if time is left at the end" if step.optional else ""
        command = " ".join(step.command[1:]).format(out="OUT", model="MODEL")
        print(f"  {i}. {step.name}, about {step.seconds} s ({step.why}{extra}): python {command}")
    print("  OUT: --out (default bench); MODEL: the course model if prepared, else a random one of its shape")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcourse.tools.gpu_run", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO_ROOT / "bench"), help="folder for results/, plots/, gpu-runs/")
    parser.add_argument("--minutes", type=float, default=9.0, help="the whole run's limit (default 9)")
    parser.add_argument("--commit", help="the commit the tree is at, where it is not a git checkout")
    parser.add_argument("--plan", action="store_true", help="print the plan and exit (no GPU needed)")
    args = parser.parse_args(argv)
    steps = plan()
    problem = no_gpu()
    if args.plan or problem:
        print_plan(steps, args.minutes)
        if args.plan:
            return 0
        print(f"error: make gpu-run needs a CUDA device: {problem}", file=sys.stderr)
        return 2
    import torch
    deadline = time.perf_counter() + args.minutes * 60
    out = Path(args.out).resolve()
    date = time.strftime("%Y-%m-%d")
    record = out / "gpu-runs" / date
    (record / "logs").mkdir(parents=True, exist_ok=True)
    (out / "results").mkdir(parents=True, exist_ok=True)
    site, wheel_line = wheel_site(REPO_ROOT / ".cache" / "gpu-wheels", cache_root() / "gpu-site")
    if site:  # the wheels' versions are the ones the steps import, and the record names
        sys.path.insert(0, str(site))
        importlib.invalidate_caches()
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(site or ""), str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
        "PYTHONUNBUFFERED": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "MPLBACKEND": "Agg",
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        COMMIT_ENV: tree_commit(args.commit),
    }
    card = torch.cuda.get_device_name(0)
    run = Run(card, library_versions(), env[COMMIT_ENV], date, args.minutes)
    lines = [f"gpu_run on {card}, commit {run.commit}; {wheel_line}"]
    print(lines[0], flush=True)
    with tempfile.TemporaryDirectory(prefix="kvcourse-gpu-run-") as tmp:
        model = shaped_model(Path(tmp))
        for i, step in enumerate(steps):
            left = deadline - time.perf_counter()
            command = [part.format(out=out, model=model) for part in step.command]
            why = fits(step, left, steps[i + 1 :])
            if why:
                done = Done(step.name, " ".join(command), "skipped", 0.0, f"skipped for time: {why}")
            else:
                limit = max(30.0, left - sum(s.seconds for s in steps[i + 1 :] if not s.optional))
                log = record / "logs" / f"{step.name.replace(' ', '-').replace('(', '').replace(')', '')}.log"
                done = run_step(step, command, log, min(limit, left), env)
            run.steps.append(done)
            lines.append(f"{done.name:<16}{done.status:<10}{done.seconds:>6.0f} s  {done.note}")
            print(lines[-1], flush=True)
    ran = [d for d in run.steps if d.status != "skipped"]
    bad = [d for d in ran if d.status != "ok"]
    lines.append(f"gpu_run: {len(ran) - len(bad)}/{len(ran)} steps ran clean on {card}; "
                 f"{len(run.steps) - len(ran)} skipped for time; record in {record}")  # fmt: skip
    print(lines[-1])
    (record / "gpu-run.json").write_text(json.dumps(asdict(run), indent=1) + "\n")
    (record / "summary.txt").write_text("\n".join(lines) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
