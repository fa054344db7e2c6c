"""The course on a CUDA GPU, checked end to end: ``python -m kvcourse.tools.gpu_check`` (``make gpu-check``).

    python -m kvcourse.tools.gpu_check [--max-new-tokens N] [--timeout SECONDS] [--side-by-side]
                                       [--json FILE] [--commit SHA] [--plan]

It runs from the repository root as it is, with no ``make setup``, on whatever torch, Triton and JAX
the machine has (a locked-down cluster node included), and downloads nothing. In order:

1. the L4/L5 kernel cases (``kvcourse.harness.kernel_cases``: block sizes 1, 7, 16; GQA 1:1, 3:1, 4:1; head
   dims 16, 64, 128; 1 and 4 KV splits; and the query-tile cases, prompts of 1 to 2,048 rows and
   chunks after long histories) on CUDA tensors: each stage's compiled Triton kernel in its default
   launch with each dot precision (IEEE and 3xTF32, counted apart in the step's line, so the run says
   which one holds the 2e-5 bound), the PyTorch reference kernel and its split-KV extension
   (``fast/split_kv.py``) against dense attention on the same GPU, in this process;
2. every stage's smoke with ``--device cuda``, one process per stage, on checkpoints built here on the
   spot in a temporary folder (``kvcourse.harness.tiny``), a tiny Qwen3 and a tiny Llama, and on the course
   model where it is prepared, else on a random Llama of the course model's shape (SmolLM2-135M's).
   L6 runs on the two tiny ones: XLA compiles each of its programs anew for every model shape, 40 s
   to 2 min apiece for SmolLM2's shape on an H100, and its smoke builds five engines;
3. one line per step, then a verdict naming the GPU and the library versions.

``--side-by-side`` runs the smokes all at once, one process each, while this process runs the kernel
cases: they only check correctness, so they can share the GPU (an H100 80 GB: 180 s side by side
against about 590 s one after another, the run of 2026-11-27, ``bench/gpu-runs/2026-11-27/``).
``--json FILE`` records each step's verdict, the card, the library versions, the commit and the date
(``bench/results/gpu-check-cuda.json``, which ``make numbers`` draws the README's GPU table from;
``table`` draws it). ``--commit`` names the commit where the tree is not a git checkout (a copy
sent to a GPU machine; ``kvcourse.harness.provenance``).

Each smoke's whole output goes to ``.cache/gpu_check/<stage>.log`` (``KVCOURSE_CACHE``); a failed
step prints the end of its log. ``--plan`` prints the commands it would run and exits (no GPU needed).
Without a CUDA device it refuses: one ``error: ...`` line, exit status 2. Otherwise the exit status is 0
when every step passes, 1 when one fails or runs past ``--timeout``.

The smokes run with ``XLA_PYTHON_CLIENT_PREALLOCATE=false``: JAX would otherwise take 75% of the GPU's
memory as it starts, and L6's smoke runs L5 and HF in torch in the same process.

Left out on purpose: speed. Numbers come from ``make bench``; this checks that everything runs and
agrees on a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from kvcourse.devices import describe, resolve_device
from kvcourse.harness.provenance import library_versions, tree_commit, versions
from kvcourse.harness.stages import STAGES
from kvcourse.model_store import REPO_ROOT, cache_root, prepared_default_model

TINY_QWEN3, TINY_LLAMA, SMOLLM2_SHAPED, COURSE = (
    "tiny Qwen3",
    "tiny Llama",
    "SmolLM2-shaped random Llama",
    "course model",
)
L6_MODELS = (TINY_QWEN3, TINY_LLAMA)
HEAD_DIMS = (16, 64, 128)


@dataclass
class Step:
    """One line of the summary: a name, and a command to run (None: a check done in this process)."""

    name: str
    command: list[str] | None = None


def plan(models: dict[str, Path], max_new_tokens: int) -> list[Step]:
    """The steps of a check over ``models`` (title -> checkpoint folder), in order.

    Example, with the three built checkpoints: the L1 step runs ``python L1_contiguous/l1_smoke.py
    --device cuda --max-new-tokens 32 --model TINY_QWEN3_DIR --model TINY_LLAMA_DIR --model
    SMOLLM2_DIR``, and the L6 step the two tiny ones only.
    """
    steps = [Step("L4/L5 kernels")]
    for stage, folder in STAGES.items():
        chosen = [path for title, path in models.items() if stage != "L6" or title in L6_MODELS]
        script = Path(folder) / f"{stage.lower()}_smoke.py"
        command = [sys.executable, str(script), "--device", "cuda", "--max-new-tokens", str(max_new_tokens)]
        steps.append(Step(stage, command + [arg for path in chosen for arg in ("--model", str(path))]))
    return steps


# title -> (arch, size, folder name) of the checkpoints built on the spot
BUILT = {
    TINY_QWEN3: ("qwen3", "tiny", "tiny-qwen3"),
    TINY_LLAMA: ("llama", "tiny", "tiny-llama"),
    SMOLLM2_SHAPED: ("llama", "smollm2", "smollm2-shaped-llama"),
}


def model_folders(folder: Path) -> dict[str, Path]:
    """The checkpoints the check runs, title -> folder: the course model if it is prepared, else a random
    one of its shape, and the tiny Qwen3 and Llama; all but the course model in ``folder``."""
    course = prepared_default_model()
    built = [TINY_QWEN3, TINY_LLAMA] if course else list(BUILT)
    return ({COURSE: course} if course else {}) | {title: folder / BUILT[title][2] for title in built}


def build_models(folders: dict[str, Path]) -> None:
    """Write the checkpoints ``model_folders`` named (``kvcourse.harness.tiny``). They get the course model's
    tokenizer where it can be prepared, else a byte tokenizer."""
    from kvcourse.harness.tiny import make_tiny_checkpoint

    for title, path in folders.items():
        if title in BUILT:
            arch, size, _ = BUILT[title]
            make_tiny_checkpoint(arch, path, size=size)


def check_kernels() -> tuple[bool, str]:
    """Step 1: every kernel case on CUDA (the decode and mixed cases, then the query-tile ones), each
    stage's Triton kernel (IEEE and 3xTF32 dots), its PyTorch reference and the reference's split-KV
    extension against dense attention. Returns (passed, one line, with the Triton kernel's failures by
    precision)."""
    from kvcourse.harness.kernel_cases import QUERY_TILE_CASES, cases, dense_reference, make_case

    kernels = {}  # name -> kernel(*args, num_splits)
    for stage in ("L4", "L5"):
        fast = f"{STAGES[stage]}.fast"
        module = importlib.import_module(f"{fast}.triton_paged_attention")
        reference = importlib.import_module(f"{STAGES[stage]}.paged_attention").paged_attention
        split_kv = importlib.import_module(f"{fast}.split_kv").split_kv_attention
        for precision in module.PRECISIONS:
            kernels[f"{stage} triton {precision}"] = lambda *args, splits, m=module, p=precision: (
                m.triton_paged_attention(*args, num_splits=splits, config=default_launch(m, args, p))
            )
        kernels[f"{stage} torch"] = lambda *args, splits, k=reference, s=split_kv: (
            k(*args) if splits == 1 else s(*args, num_splits=splits)
        )
    worst, failed, total = 0.0, [], 0
    for case in [*cases(), *QUERY_TILE_CASES]:
        for head_dim in HEAD_DIMS:
            args = make_case(*case, head_dim=head_dim, device="cuda")
            expected = dense_reference(*args)
            for splits in (1, 4):
                for name, kernel in kernels.items():
                    total += 1
                    error = (kernel(*args, splits=splits) - expected).abs().max().item()
                    worst = max(worst, error)
                    if not error < 2e-5:
                        failed.append(f"{name} {case[:3]} head_dim {head_dim}, {splits} splits: {error:.1e}")
    line = f"{total - len(failed)}/{total} cases match dense attention (largest difference {worst:.1e})"
    triton = ", ".join(f"{sum(f'triton {p} ' in f for f in failed)} failed with {p} dots" for p in ("ieee", "tf32x3"))
    return not failed, f"{line}; Triton: {triton}" + "".join(f"\n      FAILED {f}" for f in failed[:5])


def default_launch(module, args: tuple, precision: str):
    """The launch ``module.triton_paged_attention`` takes by default for the case ``args`` on a GPU
    (``choose_launch``), with its dots in ``precision``."""
    q, k_pool, _, block_tables = args[:4]
    n_tok, n_heads = q.shape[:2]
    block_size, n_kv = k_pool.shape[1], k_pool.shape[2]
    n_seqs, max_positions = block_tables.shape[0], block_tables.shape[1] * block_size
    launch = module.choose_launch(n_tok, n_seqs, n_heads // n_kv, max_positions, interpreted=False)
    return dataclasses.replace(launch, precision=precision)


def run_step(step: Step, log: Path, timeout: float) -> tuple[bool, str]:
    """Step 2: one stage's smoke in its own process, its output in ``log``. Returns (passed, one line)."""
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
    }
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        try:
            done = subprocess.run(
                step.command, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            return False, f"ran past --timeout {timeout:.0f} s (log: {log})"
    lines = log.read_text(errors="replace").strip().splitlines() or [""]
    summary = re.sub(rf"^{step.name} smoke: ", "", lines[-1])
    if done.returncode == 0:
        return True, summary
    return False, f"exit {done.returncode}: {summary} (log: {log})\n" + "\n".join(
        f"      {x}" for x in lines[-12:]
    )


@dataclass
class Verdict:
    """What one step did: passed or not, its line (the smoke's summary, or why it failed), its seconds."""

    name: str
    ok: bool
    line: str
    seconds: float


def run_steps(steps: list[Step], logs: Path, timeout: float, side_by_side: bool) -> list[Verdict]:
    """Run ``steps`` (the kernel cases here, each smoke in its own process, its log in ``logs``), one
    after another or all at once; returns their verdicts in ``steps``' order, each printed as it ends."""

    def one(step: Step) -> Verdict:
        t0 = time.perf_counter()
        if step.command is None:
            try:
                ok, line = check_kernels()
            except Exception as e:  # noqa: BLE001 -- a crash is this step's verdict, not the run's end
                ok, line = False, f"{type(e).__name__}: {str(e)[:400]}"
        else:
            ok, line = run_step(step, logs / f"{step.name.lower()}.log", timeout)
        verdict = Verdict(step.name, ok, line, round(time.perf_counter() - t0, 1))
        print(f"{step.name:<14}{'ok' if ok else 'FAILED':<8}{line} ({verdict.seconds:.0f} s)", flush=True)
        return verdict

    if not side_by_side:
        return [one(step) for step in steps]
    with ThreadPoolExecutor(len(steps)) as pool:  # threads that wait on processes, and the kernel cases
        return list(pool.map(one, steps))


def record(verdicts: list[Verdict], gpu: str, commit: str, side_by_side: bool, max_new_tokens: int) -> dict:
    """The JSON ``--json`` writes: the card, the versions, the commit and date, and every step's verdict."""
    return {
        "command": "python -m kvcourse.tools.gpu_check" + (" --side-by-side" if side_by_side else ""),
        "device_name": gpu,
        "versions": library_versions(),
        "commit": commit,
        "date": time.strftime("%Y-%m-%d"),
        "max_new_tokens": max_new_tokens,
        "passed": sum(v.ok for v in verdicts),
        "steps": [asdict(v) for v in verdicts],
    }


def table(results: dict) -> str:
    """The README's GPU table from a ``--json`` record: one row per step, its first line only.

    Example row: ``| L5 | FAILED | exit 1: RuntimeError: Expected all tensors ... | 78 |``.
    """
    lines = ["| step | verdict | what it printed | seconds |", "|---|---|---|---|"]
    for step in results["steps"]:
        first = step["line"].split("\n")[0].replace("|", "\\|")
        lines.append(f"| {step['name']} | {'ok' if step['ok'] else 'FAILED'} | {first} | {step['seconds']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvcourse.tools.gpu_check", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--max-new-tokens", type=int, default=32, help="per prompt, in every smoke (default 32)"
    )
    parser.add_argument("--timeout", type=float, default=300, help="seconds allowed per smoke (default 300)")
    parser.add_argument(
        "--side-by-side", action="store_true", help="run the smokes at once, beside the kernel cases"
    )
    parser.add_argument("--json", help="also write every step's verdict, the card and versions to this file")
    parser.add_argument("--commit", help="the commit the tree is at, where it is not a git checkout")
    parser.add_argument("--plan", action="store_true", help="print the commands and exit (no GPU needed)")
    args = parser.parse_args(argv)
    if args.plan:
        for step in plan(model_folders(Path("TMP")), args.max_new_tokens):
            print(f"{step.name}: {' '.join(step.command) if step.command else 'in this process'}")
        return 0
    try:
        device = resolve_device("cuda", what="python -m kvcourse.tools.gpu_check")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    gpu = describe(device)
    print(f"gpu_check on {gpu}; {versions()}", flush=True)
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvcourse-gpu-check-") as tmp:
        t0 = time.perf_counter()
        models = model_folders(Path(tmp))
        build_models(models)
        print(
            f"checkpoints ({time.perf_counter() - t0:.0f} s): "
            + ", ".join(f"{t} {p}" for t, p in models.items())
        )
        steps = plan(models, args.max_new_tokens)
        verdicts = run_steps(steps, cache_root() / "gpu_check", args.timeout, args.side_by_side)
    print(f"\n== gpu_check summary ({gpu})")
    for v in verdicts:
        print(f"{v.name:<14}{'ok' if v.ok else 'FAILED':<8}{v.line.splitlines()[0]} ({v.seconds:.0f} s)")
    passed = sum(v.ok for v in verdicts)
    if args.json:
        results = record(verdicts, gpu, tree_commit(args.commit), args.side_by_side, args.max_new_tokens)
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote {args.json}")
    minutes, seconds = divmod(round(time.perf_counter() - t_start), 60)
    print(
        f"gpu_check: {passed}/{len(verdicts)} steps passed on {gpu} in {minutes} min {seconds} s; {versions()}"
    )
    return 0 if passed == len(verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
