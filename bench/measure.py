"""The benchmark's measurements: each runs one system on one workload and returns plain numbers.

Times come from ``time.perf_counter`` around whole calls, after an untimed warm-up, as the median of
several runs (all kept), the systems' runs interleaved (``timed_together``); memory from each
engine's ``stats()``. Nothing here knows a stage by name: pools are sized from the options an engine
takes (``kvcourse.harness.stages.engine_options``).

On a GPU every timed region starts and ends with ``torch.cuda.synchronize()``, so no run's kernels
spill into the next one's time. JAX needs no call of its own: an L6 ``generate`` ends by reading the
state its last jit'd call produced back to the host (``host_state``), which waits for that call, and
it queues nothing after that read.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from bench import ceilings
from bench.systems import System
from bench.workloads import mixed_workload
from kvcourse.cpp_kernels import build_problem
from kvcourse.devices import resolve_device
from kvcourse.harness.compare import compare
from kvcourse.harness.provenance import tree_commit
from kvcourse.harness.reference import Reference
from kvcourse.harness.stages import engine_options
from kvcourse.model_store import REPO_ROOT


@dataclass
class Job:
    """One system's share of one workload: ``run()`` returns the outputs; ``warmup()`` (default: ``run``
    itself) runs once, untimed, before any timed run; then ``repeats`` timed runs. ``compiles()``, for
    an engine, returns its ``stats().compiles`` (traces per jit'd function; empty for a torch stage)."""

    run: Callable[[], list[list[int]]]
    repeats: int
    warmup: Callable[[], object] | None = None
    compiles: Callable[[], dict] | None = None


def timed_together(
    jobs: dict[str, Job], tick=lambda: None, sync=lambda: None
) -> dict[str, tuple[dict, list[list[int]]]]:
    """Time several systems on one workload, their runs interleaved: every warm-up first, then round r
    runs each system's r-th timed run (A B C, A B C, A B C). ``tick()`` is called after every run;
    ``sync()`` (``ceilings.synchronizer``) before each clock starts and before it stops.

    This machine is a shared VM whose speed drifts over minutes (its matmul rate was 153 GFLOP/s in the
    ``make bench`` run committed in a26ba50 and 99 in the one committed in 2efbf97, the same day). Three runs of one system and then three of the next would
    put that drift between them, into their ratio; interleaved, it falls on all of them alike.
    Returns, per system, its row (``seconds``: the median of its runs; ``runs``: every run's seconds;
    ``warmup_seconds``; for an engine, ``compiles`` after the warm-up and after the timed runs: equal
    when the timed runs compiled nothing new) and its last run's outputs.
    """

    def timed(fn):
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        return out, time.perf_counter() - t0

    rows = {}
    for name, job in jobs.items():
        rows[name] = {"warmup_seconds": timed(job.warmup or job.run)[1], "runs": []}
        if job.compiles:
            rows[name]["compiles"] = {"after_warmup": job.compiles()}
        tick()
    outs = {}
    for round_ in range(max((job.repeats for job in jobs.values()), default=0)):
        for name, job in jobs.items():
            if round_ < job.repeats:
                outs[name], seconds = timed(job.run)
                rows[name]["runs"].append(seconds)
                tick()
    for name, job in jobs.items():
        if job.compiles:
            rows[name]["compiles"]["after_runs"] = job.compiles()
    return {
        name: ({"seconds": statistics.median(row["runs"])} | row, outs[name]) for name, row in rows.items()
    }


def runs_once(one_at_a_time: bool, n_requests: int) -> bool:
    """Whether a system is timed once on a workload, not ``repeats`` times: when it runs its requests
    one after another (HF batch 1, L1, L2) and there are several (its three runs would cost ten minutes
    each for numbers no target depends on)."""
    return one_at_a_time and n_requests > 1


def requests_job(system: System, prompts, max_new_tokens, repeats: int) -> Job:
    """(a), (b), (u): the requests all at once. A system timed once (``runs_once``) warms up on the
    first request only."""
    compiles = engine_compiles(system)
    if runs_once(system.one_at_a_time, len(prompts)):
        return Job(
            lambda: system.run(prompts, max_new_tokens),
            1,
            lambda: system.run(prompts[:1], max_new_tokens[:1]),
            compiles,
        )
    return Job(lambda: system.run(prompts, max_new_tokens), repeats, compiles=compiles)


def engine_compiles(system: System) -> Callable[[], dict] | None:
    """A course engine's compile counter (``stats().compiles``, traces per jit'd function), or None for an
    HF peer. E.g. for L6 after a first run: ``{"prefill": 2, "decode": 6}``; a torch stage: ``{}``."""
    if system.engine is None:
        return None
    return lambda: dict(system.engine.stats().compiles)


def requests_row(system: System, row: dict, outs, prompts, max_new_tokens) -> dict:
    """A timed row of (a), (b), (u) with its tokens: useful ones are the max_new_tokens; ``computed_new_tokens``
    is what the system generated (more for HF batched); ``warmup_requests`` how many requests its
    untimed warm-up ran (the first one only for a system timed once, see ``requests_job``)."""
    assert [len(o) for o in outs] == max_new_tokens, f"{system.name} did not produce fixed-length outputs"
    useful = sum(max_new_tokens)
    warmup_requests = 1 if runs_once(system.one_at_a_time, len(prompts)) else len(prompts)
    return row | {"new_tokens": useful, "computed_new_tokens": system.computed(prompts, max_new_tokens),
                  "tok_s": useful / row["seconds"], "requests": len(prompts),
                  "warmup_requests": warmup_requests}  # fmt: skip


def samples_job(system: System, prompt, max_new: int, n: int, repeats: int) -> Job:
    """(c): n samples of one prompt."""
    return Job(lambda: system.run_samples(prompt, max_new, n), repeats, compiles=engine_compiles(system))


def samples_row(system: System, row: dict, outs, max_new: int, n: int) -> dict:
    assert [len(o) for o in outs] == [max_new] * n, f"{system.name} did not produce {n} x {max_new} tokens"
    return row | {"new_tokens": n * max_new, "tok_s": n * max_new / row["seconds"]}


def agreement(outs: list[list[int]], references: list[Reference]) -> dict:
    """Each output against HF batch 1's, with the tie rule: counts, every tie and mismatch by request
    index, and HF's top-2 logit gap at the first token where each of those differs (``hf_gaps``; None
    where one of the two has no token there: a missing token is never a tie). E.g. ``{"match": 30,
    "ties": {"7": "tie@40"}, "mismatches": {"29": "DIFF@102"}, "hf_gaps": {"7": 0.0004, "29": 0.83}}``:
    request 29's gap, above the tie rule's 1e-3 (``TIE_GAP``), is why the rule did not excuse it."""
    results = [compare(ref.tokens, out, ref) for out, ref in zip(outs, references, strict=True)]
    gaps = {
        str(i): ref.gaps[r.first_diff] if r.first_diff < min(len(out), len(ref.gaps)) else None
        for i, (r, out, ref) in enumerate(zip(results, outs, references, strict=True))
        if r.first_diff is not None
    }
    return {
        "match": len(results) - len(gaps),
        "ties": {str(i): r.status for i, r in enumerate(results) if r.first_diff is not None and r.ok},
        "mismatches": {str(i): r.status for i, r in enumerate(results) if not r.ok},
        "hf_gaps": gaps,
    }


def kv_stats(engine) -> dict:
    """What an engine's ``stats()`` says about its KV memory after it ran one workload (its warm-up
    and timed runs, all alike: utilization and peaks are those of one run).

    Every engine reports the same ``EngineStats``: utilization (live / held positions, summed over
    its steps), the most blocks held and shared at once, preemptions (over every run). L1 has no
    blocks (0). L1 and L2 warm up on the first request, which they then count twice (1 of 33).
    """
    s = engine.stats()
    return {
        "device": s.device,
        "kernel": s.kernel,
        "utilization": s.kv_utilization,
        "preemptions": s.preemptions,
        "block_size": s.block_size,
        "blocks_held": s.blocks_held,
        "blocks_shared": s.blocks_shared,
    }


def block_size_sweep(cfg, sizes: dict) -> dict:
    """(e) L6's reference attention alone, jit'd, for a decode batch and a prefill, per block size.

    ``q_block`` x ``kv_pages_per_block`` only changes how much work each loop step does (and the
    summation order), never which keys a query sees. Milliseconds per call, median of 5.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    from L6_tpu_jax.attention import decode_only_paged_attention, ragged_paged_attention

    rng = np.random.default_rng(0)
    n_heads, n_kv, d, ps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 16
    n_seq, ctx, prefill = sizes["e_decode_seqs"], sizes["e_context"], sizes["e_prefill"]
    per_seq = -(-max(ctx, prefill) // ps)
    n_pages = n_seq * per_seq
    pool = jnp.asarray(rng.standard_normal((n_pages, ps, 2 * n_kv, d), np.float32))
    pages = jnp.asarray(rng.permutation(n_pages).reshape(n_seq, per_seq).astype(np.int32))
    batches = {
        "decode": (n_seq, jnp.full(n_seq, ctx, jnp.int32), jnp.arange(n_seq + 1, dtype=jnp.int32)),
        "prefill": (prefill, jnp.full(n_seq, prefill, jnp.int32).at[1:].set(0),
                    jnp.full(n_seq + 1, prefill, jnp.int32).at[0].set(0)),
    }  # fmt: skip

    def ms(kernel, args) -> float:
        f = jax.jit(kernel)
        return 1000 * ceilings.median_seconds(lambda: f(*args).block_until_ready(), 5)

    rows = {}
    for work, (n_tok, context_lens, cu) in batches.items():
        q = jnp.asarray(rng.standard_normal((n_tok, n_heads, d), np.float32))
        args = (q, pool, context_lens, pages, cu, jnp.int32(n_seq if work == "decode" else 1))
        for qb, kb in sizes["e_blocks"]:
            rows[f"{work} ragged q{qb} x kv{kb}"] = ms(
                functools.partial(ragged_paged_attention, q_block=qb, kv_pages_per_block=kb), args
            )
            if work == "decode" and qb == 1:
                rows[f"decode batched kv{kb}"] = ms(
                    functools.partial(decode_only_paged_attention, kv_pages_per_block=kb), args
                )
    return rows


def reset_times(model_dir, options: dict) -> dict:
    """(e) Milliseconds of L6's logical reset (metadata only) and physical reset (also zeroes every page)."""
    import jax

    from L6_tpu_jax.engine import Engine

    out = {}
    for mode in ("logical", "physical"):
        engine = Engine(model_dir, reset=mode, **options)

        def reset(engine=engine):
            engine.reset()
            jax.block_until_ready((engine.state, engine.kv_pages))  # until the device has done it

        reset()  # compile
        out[mode] = 1000 * ceilings.median_seconds(reset, 5)
        out["pool_MiB"] = sum(pool.nbytes for pool in engine.kv_pages) / 2**20
    return out


def decode_latency(system: System, vocab: int, context: int, steps: int, repeats: int = 3) -> float:
    """Seconds per decode step at ``context``: (time for 1 + steps tokens - time for 1) / steps.

    Both runs prefill the same prompt, so the difference is the decode steps alone. Each time is the
    fastest of ``repeats`` runs, not the median: the prefill's own noise (seconds, at 2,048 tokens) would
    otherwise swamp a difference of a second or two (two medians of two runs gave L1 a 2,048-token step
    of 0 ms in the ``make bench`` run committed in a26ba50, 2026-11-23).
    """
    prompt = mixed_workload(vocab, 1, (context, context), (1, 1), seed=context)[0]
    short = min(ceilings.run_seconds(lambda: system.run(prompt, [1]), repeats))
    long = min(ceilings.run_seconds(lambda: system.run(prompt, [1 + steps]), repeats))
    return max(long - short, 0.0) / steps


def add_device_option(parser, what: str) -> None:
    """The bench scripts' ``--device auto|cpu|cuda`` option (``bench_device`` resolves it); ``what`` ends
    its help: ``add_device_option(parser, "the kernels run")``."""
    parser.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto",
        help=f"where {what} (default auto: cuda where torch sees a GPU, else cpu)",
    )  # fmt: skip


def bench_device(name: str) -> torch.device:
    """The device ``--device`` names: ``auto`` is a CUDA GPU where torch sees one, else the CPU; ``cpu`` and
    ``cuda`` are resolved by ``kvcourse.devices.resolve_device`` (which turns TF32 off on a GPU).

    Example on a machine without a GPU: ``bench_device("auto")`` -> ``device(type='cpu')``;
    ``bench_device("cuda")`` raises ``ValueError: --device cuda: no CUDA device (...)``.
    """
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return resolve_device(name, what=f"--device {name}")


def chosen_device(name: str) -> torch.device | None:
    """``bench_device(name)``, or None after printing its refusal as one ``error:`` line on stderr: a
    bench's ``main`` then returns 2. Example without a GPU: ``chosen_device("cuda")`` prints
    ``error: --device cuda: no CUDA device (...)`` and returns None."""
    try:
        return bench_device(name)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return None


def package_version(name: str) -> str | None:
    """An installed distribution's version, or None (e.g. ``package_version("triton")`` -> ``"3.7.1"``)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def gpu_info(device: torch.device) -> dict:
    """The GPU a run used: its name, memory, compute capability, CUDA runtime and driver versions."""
    props = torch.cuda.get_device_properties(device)
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=True,
        )  # fmt: skip
        driver = smi.stdout.splitlines()[0].strip()
    except (OSError, subprocess.SubprocessError, IndexError):
        driver = None  # no nvidia-smi on this machine: the JSON says so with null
    return {
        "name": props.name,
        "memory_GiB": props.total_memory / 2**30,
        "compute_capability": f"{props.major}.{props.minor}",
        "cuda_runtime": torch.version.cuda,
        "driver": driver,
    }


def cpu_ticks() -> list[int] | None:
    """The CPU time counters of ``/proc/stat`` (user, nice, system, idle, iowait, irq, softirq, steal, ...),
    in ticks; None where there is no such file (not Linux)."""
    try:
        return [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None


def stolen(before: list[int] | None, after: list[int] | None) -> float | None:
    """The share of the CPU time between two ``cpu_ticks`` that the hypervisor gave to another machine
    (steal): on a shared VM, the run's slowdown that no model of the engine can predict. Example: 2,000
    ticks passed, 100 of them steal -> 0.05."""
    if before is None or after is None or len(before) < 8:
        return None
    passed = [b - a for a, b in zip(before, after, strict=True)]
    return passed[7] / sum(passed) if sum(passed) else 0.0


def provenance() -> dict:
    """What a results file records of where it was measured, for the tables ``make numbers`` draws from
    it: the commit (``kvcourse.harness.provenance.tree_commit``: ``+dirty`` when the working tree's
    code differed from it (not its results and plots), ``$KVCOURSE_COMMIT`` on a copy without ``.git``, as ``make gpu-run`` sends) and the
    date, e.g. ``{"commit": "c14a18f", "date": "2026-11-26"}``; ``"unknown"`` outside a git checkout."""
    return {"commit": tree_commit(), "date": time.strftime("%Y-%m-%d")}


def save_results(results: dict, out: str | None, default: str, quick: bool) -> None:
    """Write ``results`` as JSON to ``out``, else to ``bench/results/<default>``; a ``--quick`` run (the
    tests') writes only where ``out`` says. Prints the path it wrote."""
    path = out or (None if quick else REPO_ROOT / "bench" / "results" / default)
    if path:
        Path(path).write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {path}")


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what ``platform`` knows."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.processor() or platform.machine()


def stage_options(engine_cls, sizes: dict, max_len: int, device: torch.device | str = "cpu") -> dict:
    """Pool and batch sizes large enough that (b), (c) and (d) run without preemption in every stage,
    and no larger (every block is allocated up front: 3.8 GB per engine if sized for 40 x 2048 tokens,
    arithmetic at 46,080 B per token),
    and the device (``"cpu"`` or ``"cuda"``: L1-L5 put their tensors there, L6 picks that JAX backend).

    Read from the options the engine takes (``engine_options``), so no stage is named here: L2-L5 take ``num_blocks`` and
    L3-L6 ``max_num_seqs``; L6 calls its pool ``num_pages`` (Levanter's name). A stage with a
    ``kernel`` choice (L4, L5) runs, on a CPU, its compiled C++ kernel, the fastest it has there (its
    PyTorch kernel where no compiler could build the C++ one; ``cpp_kernel_problem`` says why); on a
    GPU ``kernel="auto"``, which is its Triton kernel; a stage with decode graphs (L4, L5) runs without
    them (``cuda_graphs=False``, its readable step, though on a GPU its default turns them on): ``bench.run``
    and ``bench.profile`` run them as a variant of their own (``L4 + decode graphs``, ``L4:graphs``). A stage with a
    prefix cache (L5) runs without it: every timed run repeats the warm-up's prompts, and the blocks
    the warm-up left in the cache would let it skip their prefill, which new requests never get (L5
    1.5x L4 on (u) in the ``make bench`` run committed in a26ba50, 2026-11-23, that found this). (c)'s sharing is the clone, which needs
    no cache.
    """
    params = engine_options(engine_cls)
    size = params.get("page_size", params.get("block_size", 16))
    blocks = max(
        sizes["b_requests"] * -(-(sizes["b_prompt"][1] + sizes["b_new"][1]) // size),  # (b), all at once
        sizes["c_n"] * -(-(sizes["c_prompt"] + sizes["c_new"]) // size),  # (c) without sharing
        -(-max_len // size),  # (d), one long sequence
    )
    options = {"max_model_len": max_len, "device": str(device)}
    options |= {name: blocks for name in ("num_blocks", "num_pages") if name in params}
    options |= {"max_num_seqs": sizes["b_requests"]} if "max_num_seqs" in params else {}
    gpu = torch.device(device).type == "cuda"
    if "kernel" in params and (gpu or not cpp_kernel_problem(engine_cls)):
        options["kernel"] = "auto" if gpu else "cpp"
    options |= {"cuda_graphs": False} if "cuda_graphs" in params else {}
    options |= {"enable_prefix_caching": False} if "enable_prefix_caching" in params else {}
    return options


def cpp_kernel_problem(engine_cls) -> str | None:
    """Why the C++ kernel of ``engine_cls``'s stage cannot be built here, or None (also None for a stage
    without one)."""
    package = engine_cls.__module__.rsplit(".", 1)[0]
    source = REPO_ROOT / package / "fast" / "paged_attention.cpp"
    return build_problem(source) if source.exists() else None
