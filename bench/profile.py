"""Where a stage's time goes: ``python -m bench.profile [--stages L3,L4:cpp,L4:graphs,L6] [--workload b|a] [--quick]
[--device auto|cpu|cuda] [--torch-profiler] [--out FILE]``.

``--out`` also writes the profiles to a JSON file, with the command, commit, machine, OpenMP wait policy
and load average before and after (``bench/results/profile-*.json``, which the chapters cite), and with
``--torch-profiler`` or on a GPU the profiled decode steps too (``kernels``). A stage named twice is profiled twice, the second as ``L4:cpp #2``: two
rounds back to back show how much the machine drifts between them.

Each stage runs the workload ((b) of ``make bench`` by default, or (a), batch-1 decode) once to warm up,
then once more with timers around the parts of its step. For the torch stages (L3-L5):

- ``schedule + pack``: the scheduler and ``prepare`` (Python, building the flat batch);
- ``matmuls + rest``: the model's forward minus its attention calls (projections, MLP, norms, RoPE, head);
- ``attention``: every layer's attention call, split into the K/V write (``set_kv``), the kernel or
  dense attention (``causal_attention`` in L3, the paged kernel in L4/L5) and what is left: in L3 the
  per-sequence gather (``index_select``) and loop, in L4/L5 the call's own overhead.

Times are whole seconds over the run and milliseconds per decode step (steps whose every row is a
decode token); the timers add two clock reads per call, small next to the parts they time. The chapters' profile tables come from this.

L6 (JAX) is one compiled call per prefill and one per decode loop (up to ``max_rounds`` steps on the
device), so its parts are the calls themselves, each timed to ``block_until_ready``: prefill, decode
(and its milliseconds per step), the host's reads of the state (``host_state``, device -> host) and
what is left, the host's Python (admission, packing the prefill work).

On a GPU (``--device cuda``; ``auto``, the default, picks it where torch sees one) the host timers
above time launches and host work, not kernels: a launch returns before its kernel runs, and the
step's wait for the GPU lands wherever the host next reads a result (the sampled tokens, in
``schedule + pack``). So on a GPU each torch stage also runs ``kernel_profile``: a few decode steps of
the workload under ``torch.profiler`` (CPU and CUDA activities), giving per step the GPU's busy time
(its kernels, copies and memsets, summed) against the step's wall time (the difference is launch gaps
and host work), the number of launches, and the top kernels by GPU time. ``--torch-profiler`` runs
the same on a CPU, with CPU activity only: the top ops by self CPU time, and "device busy" n/a (the
host is the device). L6 reports its first run's seconds (tracing and compiling), how many of them
JAX's own compile events cover (``jax.monitoring``: tracing, lowering to StableHLO, XLA's compile) and
its trace counts, besides ms per decode step of its ``while_loop``.

Left out on purpose: JAX's profiler (L6's decode loop is one compiled call; its time per step is
enough here), memory profiling, and operator detail beyond the top kernels.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import os
import sys
import time
from collections import defaultdict
from contextlib import ExitStack, contextmanager
from pathlib import Path
from unittest import mock

import torch

from bench import OMP_WAIT_POLICY
from bench.ceilings import synchronizer
from bench.measure import add_device_option, chosen_device, cpu_name, provenance, stage_options
from bench.workloads import FULL, QUICK, batch1_workload, mixed_workload
from kvcourse.devices import describe
from kvcourse.harness.stages import STAGES, engine_class
from kvcourse.model_store import resolve_model_dir

PARTS = ("schedule + pack", "matmuls + rest", "K/V write", "kernel", "gather + loop")
# on cuda L4, L5: Triton; L4:graphs is L4 on its decode-graph fast path (cuda_graphs=True)
DEFAULT_STAGES = {"cpu": "L3,L4:torch,L4:cpp,L5:cpp,L6", "cuda": "L3,L4,L4:graphs,L5,L6"}
PROFILED_STEPS = 3  # decode steps per torch stage under torch.profiler: the first, one midway, the last
TOP_KERNELS = 5


class Timers:
    """Seconds per timed call, for the whole run and for decode-only steps."""

    def __init__(self):
        self.total = defaultdict(float)
        self.decode = defaultdict(float)
        self.decode_steps = 0
        self.in_decode_step = False

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds = time.perf_counter() - t0
                self.total[name] += seconds
                if self.in_decode_step:
                    self.decode[name] += seconds

        return timed

    def parts(self, t: dict) -> dict:
        """Each part exclusive of the parts nested inside it."""
        return {
            "schedule + pack": t["step"] - t["forward"],
            "matmuls + rest": t["forward"] - t["attention"],
            "K/V write": t["K/V write"],
            "kernel": t["kernel"],
            "gather + loop": t["attention"] - t["K/V write"] - t["kernel"],
        }


def profile_stage(name: str, model_dir, prompts, max_new_tokens, options: dict) -> dict:
    """Run the workload twice on a fresh engine of stage ``name`` built with ``options``; time the parts of the
    second run."""
    engine = engine_class(name)(model_dir, **options)
    engine.generate(prompts, max_new_tokens, ignore_eos=True)  # warm-up
    timers = Timers()
    package = STAGES[name]
    prepare = engine.prepare

    def prepare_and_classify(batch):
        timers.in_decode_step = all(n == 1 for _, n in batch)
        timers.decode_steps += timers.in_decode_step
        return prepare(batch)

    steps_before = engine.stats().steps  # the warm-up's steps are not part of the profile
    with ExitStack() as patches:
        patch = lambda target, attr, name: patches.enter_context(  # noqa: E731
            mock.patch.object(target, attr, timers.wrap(name, getattr(target, attr)))
        )
        engine_module = importlib.import_module(f"{package}.engine")
        patch(engine_module, "attention", "attention")
        patch(engine.pool, "set_kv", "K/V write")
        patch(engine.model, "forward", "forward")
        patch(engine, "step", "step")
        if hasattr(engine, "fast"):  # L4, L5: the paged kernel their fast path chose
            patch(engine.fast, "kernel", "kernel")
        else:  # L3: dense attention on each sequence's gathered history
            patch(importlib.import_module(f"{package}.attention"), "causal_attention", "kernel")
        patches.enter_context(mock.patch.object(engine, "prepare", prepare_and_classify))
        t0 = time.perf_counter()
        engine.generate(prompts, max_new_tokens, ignore_eos=True)
        wall = time.perf_counter() - t0
    return {
        "seconds": wall,
        "steps": engine.stats().steps - steps_before,
        "decode_steps": timers.decode_steps,
        "total_s": timers.parts(timers.total),
        "decode_step_ms": {
            k: 1000 * v / max(timers.decode_steps, 1) for k, v in timers.parts(timers.decode).items()
        },
    }


# JAX's own compile events (jax.monitoring; names as in jax 0.10.2's jax/_src/dispatch.py), by the part
# of a first run they time: tracing Python into a jaxpr, lowering it to StableHLO, XLA's compile
COMPILE_EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "XLA compile",
}


def covered_seconds(spans: list[tuple[float, float]]) -> float:
    """The seconds that a union of (start, end) spans covers, each second counted once (a trace inside
    another trace is not counted twice): ``covered_seconds([(0, 2), (1, 3), (5, 6)])`` -> 4."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(spans):
        total += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return total


@contextmanager
def compile_spans():
    """Collect JAX's compile events while the block runs: yields ``{part: [(start, end), ...]}``."""
    import jax.monitoring

    spans = defaultdict(list)

    def listen(event, start, end, **_):
        if event in COMPILE_EVENTS:
            spans[COMPILE_EVENTS[event]].append((start, end))

    jax.monitoring.register_event_time_span_listener(listen)
    try:
        yield spans
    finally:
        jax.monitoring.unregister_event_time_span_listener(listen)


def profile_l6(model_dir, prompts, max_new_tokens, options: dict) -> dict:
    """Run the workload twice on a fresh L6 engine (the first run compiles, unless JAX's persistent
    cache, recorded as ``persistent_cache``, holds its programs); time each call of the second."""
    import jax

    engine = engine_class("L6")(model_dir, **options)
    with compile_spans() as spans:
        t0 = time.perf_counter()
        # the warm-up compiles every shape the workload needs; generate ends reading the device's state,
        # so nothing is left queued when the clock stops
        engine.generate(prompts, max_new_tokens, ignore_eos=True)
        first_run = time.perf_counter() - t0
    first_run_parts = {part: covered_seconds(spans[part]) for part in COMPILE_EVENTS.values()}
    compiles_after_first = dict(engine.stats().compiles)
    seconds, calls = defaultdict(float), defaultdict(int)

    def timed(name, fn):
        def run(*args):
            t0 = time.perf_counter()
            out = jax.block_until_ready(fn(*args))  # host_state's NumPy copy is ready already
            seconds[name] += time.perf_counter() - t0
            calls[name] += 1
            return out

        return run

    # the engine's jit'd calls (reset and free included, though not reported as parts) and its reads
    timed_parts = {"_prefill": "prefill", "_decode": "decode", "_free": "free_finished",
                   "_reset_logical": "reset_logical", "_zero": "zero_kv_pages", "host_state": "host_state"}  # fmt: skip
    steps_before = engine.stats().steps
    with ExitStack() as patches:
        for attr, name in timed_parts.items():
            patches.enter_context(mock.patch.object(engine, attr, timed(name, getattr(engine, attr))))
        t0 = time.perf_counter()
        engine.generate(prompts, max_new_tokens, ignore_eos=True)
        wall = time.perf_counter() - t0
    steps = engine.stats().steps - steps_before - calls["prefill"]  # a prefill call is one step
    parts = {name: seconds[name] for name in ("prefill", "decode", "host_state")}
    parts["host Python"] = wall - sum(seconds.values())
    return {"seconds": wall, "parts_s": parts, "calls": dict(calls), "steps": steps,
            "decode_step_ms": 1000 * seconds["decode"] / max(steps, 1), "first_run_s": first_run,
            "first_run_compile_s": first_run_parts,  # JAX's compile events during the first run
            "persistent_cache": jax.config.jax_compilation_cache_dir,  # None: the first run compiled all
            "compiles": {"after_first_run": compiles_after_first, "after_second": dict(engine.stats().compiles)}}  # fmt: skip


def l6_table(p: dict) -> str:
    """Markdown: L6's calls, seconds over the run, and ms per decode step."""
    lines = ["| L6 part | s (run) | calls |", "|---|---|---|"]
    lines += [f"| {name} | {sec:.2f} | {p['calls'].get(name, '-')} |" for name, sec in p["parts_s"].items()]
    lines.append(f"| **whole run** | {p['seconds']:.2f} | |")
    lines.append(f"\nL6: {p['steps']} decode steps on the device, {p['decode_step_ms']:.1f} ms each")
    c = p["compiles"]
    lines.append(
        f"L6: first run {p['first_run_s']:.2f} s (tracing and compiling included); traces per jit'd function "
        f"after it {c['after_first_run']}, after the second run {c['after_second']}"
    )
    parts = p.get("first_run_compile_s") or {}
    if parts:
        lines.append(
            "L6: of the first run, JAX's compile events cover "
            + ", ".join(f"{part} {sec:.2f} s" for part, sec in parts.items())
        )
    return "\n".join(lines)


def spread(items: list[int], k: int) -> list[int]:
    """Up to ``k`` of ``items``: the first, the last and evenly between. ``spread([4, 5, 6, 7, 8], 3)`` ->
    ``[4, 6, 8]``; ``spread([4], 3)`` -> ``[4]``; ``spread([], 3)`` -> ``[]``."""
    if not items:
        return []
    return sorted({items[round(j * (len(items) - 1) / max(k - 1, 1))] for j in range(k)})


def kernel_profile(name: str, model_dir, prompts, max_new_tokens, options: dict, steps=PROFILED_STEPS) -> dict:
    """A few decode steps of the workload on a fresh engine of torch stage ``name``, under torch.profiler.

    Three runs on one engine. The first warms up (Triton compiles its kernels) and records each step's
    decode rows (0 for a step with prompt tokens); ``steps`` decode-only steps are chosen from them, the
    first, the last and evenly between (32 rows down to 1 on (b)). The second times every step, the
    device synchronized before and after it, without the profiler (whose own host work would count).
    The third runs the chosen steps under ``torch.profiler``. The same requests give the same steps
    (the scheduler reads no clock), so the runs' step numbers agree; a different step count raises.

    Per chosen step: decode rows, wall ms (second run), and on a GPU the device's busy ms (every kernel,
    copy and memset, summed: overlapping streams would count twice, and the stages use one), its share
    of the wall, and launches (device events). On a CPU busy and launches are None (n/a): the ops run
    on the host, ``ops`` counts them (every op the profiler saw, an op inside another counted too: what
    fusing or stacking work removes), and ``top`` ranks them by self CPU time instead of kernels by GPU
    time.
    """
    engine = engine_class(name)(model_dir, **options)
    device = engine.device
    gpu, sync = device.type == "cuda", synchronizer(device)
    rows: list[int] = []
    prepare, step = engine.prepare, engine.step

    def classify(batch):
        rows.append(len(batch) if all(n == 1 for _, n in batch) else 0)
        return prepare(batch)

    def run(wrapped_step) -> int:
        """One generate with ``wrapped_step(i)`` in place of ``engine.step``; returns how many steps it took."""
        counter = itertools.count()
        with mock.patch.object(engine, "step", lambda: wrapped_step(next(counter))):
            engine.generate(prompts, max_new_tokens, ignore_eos=True)
        return next(counter)

    with mock.patch.object(engine, "prepare", classify):
        engine.generate(prompts, max_new_tokens, ignore_eos=True)  # warm-up
    chosen = spread([i for i, r in enumerate(rows) if r], steps)  # decode-only steps
    walls: dict[int, float] = {}

    def timed(i):
        sync()
        t0 = time.perf_counter()
        out = step()
        sync()
        walls[i] = time.perf_counter() - t0
        return out

    activities = [torch.profiler.ProfilerActivity.CPU]
    activities += [torch.profiler.ProfilerActivity.CUDA] if gpu else []
    profiled: dict[int, list] = {}

    def traced(i):
        if i not in chosen:
            return step()
        sync()
        with torch.profiler.profile(activities=activities) as prof:
            out = step()
            sync()
        profiled[i] = device_events(prof, gpu)
        return out

    counts = [run(timed), run(traced)]
    if counts != [len(rows)] * 2:
        raise RuntimeError(
            f"{name}: the runs took {counts} steps, the warm-up {len(rows)}: not deterministic"
        )
    # kernel (or op) name -> [calls, microseconds] over the chosen steps
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    per_step = []
    for i in chosen:
        for event, us in profiled[i]:
            totals[event][0] += 1
            totals[event][1] += us
        busy = sum(us for _, us in profiled[i]) / 1000 if gpu else None
        per_step.append({"step": i, "rows": rows[i], "wall_ms": 1000 * walls[i], "device_busy_ms": busy,
                         "launches": len(profiled[i]) if gpu else None,
                         "ops": None if gpu else len(profiled[i])})  # fmt: skip
    top = sorted(totals.items(), key=lambda kv: -kv[1][1])[:TOP_KERNELS]
    n = max(len(chosen), 1)
    return {
        "device": describe(device),
        "steps": per_step,
        "top": [{"name": k, "calls_per_step": c / n, "ms_per_step": us / n / 1000} for k, (c, us) in top],
    }


def device_events(prof, gpu: bool) -> list[tuple[str, float]]:
    """(name, microseconds) of what a profiled step ran: on a GPU every device-side event (kernels,
    copies, memsets); on a CPU every op with its self CPU time (its time minus its child ops')."""
    from torch.autograd import DeviceType

    events = prof.events()
    if gpu:
        return [(e.name, e.time_range.elapsed_us()) for e in events if e.device_type == DeviceType.CUDA]
    return [
        (e.name, e.self_cpu_time_total) for e in events if e.device_type == DeviceType.CPU and not e.is_async
    ]


def kernel_table(kernels: dict) -> str:
    """Markdown: per torch stage, its profiled decode steps (wall against device busy time and launches),
    then its top kernels by device time (ops by self CPU time on a CPU)."""

    def na(value, fmt: str) -> str:
        return "n/a" if value is None else format(value, fmt)

    device = next(iter(kernels.values()))["device"]
    lines = [
        f"torch.profiler, decode steps on {device}: wall = the step unprofiled, device synchronized around it; "
        "device busy = its kernels, copies and memsets summed (n/a on a CPU: the host is the device)",
        "",
        "| stage | step | decode rows | wall ms | device busy ms | busy share | launches (ops on a CPU) |",
        "|---|---|---|---|---|---|---|",
    ]
    for spec, k in kernels.items():
        for s in k["steps"]:
            share = None if s["device_busy_ms"] is None else s["device_busy_ms"] / s["wall_ms"]
            lines.append(
                f"| {spec} | {s['step']} | {s['rows']} | {s['wall_ms']:.2f} | {na(s['device_busy_ms'], '.2f')} "
                f"| {na(share, '.0%')} | {na(s['launches'] if s.get('ops') is None else s['ops'], 'd')} |"
            )
    lines += ["", "| stage | top kernels by device time (a CPU: ops by self CPU time) | calls / step | ms / step |",
              "|---|---|---|---|"]  # fmt: skip
    for spec, k in kernels.items():
        for t in k["top"]:
            label = t["name"] if len(t["name"]) <= 80 else t["name"][:77] + "..."
            lines.append(f"| {spec} | `{label}` | {t['calls_per_step']:.1f} | {t['ms_per_step']:.3f} |")
    return "\n".join(lines)


def kernel_results_table(results: dict) -> str:
    """``kernel_table`` of a results file written with ``--torch-profiler`` or on a GPU (its ``kernels``)."""
    return kernel_table(results["kernels"])


def table(profiles: dict) -> str:
    """Markdown: per stage, each part's seconds over the run and ms per decode step."""
    names = list(profiles)
    lines = [
        "| part | " + " | ".join(f"{n} s (run) | {n} ms/decode step" for n in names) + " |",
        "|---|" + "---|---|" * len(names),
    ]
    for part in PARTS:
        cells = [f"{p['total_s'][part]:.2f} | {p['decode_step_ms'][part]:.1f}" for p in profiles.values()]
        lines.append(f"| {part} | " + " | ".join(cells) + " |")
    cells = [f"{p['seconds']:.2f} | {sum(p['decode_step_ms'].values()):.1f}" for p in profiles.values()]
    lines.append("| **whole run / step** | " + " | ".join(cells) + " |")
    steps = [f"{p['steps']} steps | {p['decode_steps']} decode" for p in profiles.values()]
    lines.append("| steps | " + " | ".join(steps) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--stages",
        help="comma-separated stages, a torch one with an optional :kernel or :graphs (its decode graphs) (default: cpu "
        f"{DEFAULT_STAGES['cpu']}; cuda {DEFAULT_STAGES['cuda']})",
    )
    add_device_option(parser, "the stages run")
    parser.add_argument(
        "--torch-profiler", action="store_true",
        help="also run a few decode steps of each torch stage under torch.profiler (always on cuda)",
    )  # fmt: skip
    parser.add_argument(
        "--workload",
        choices=("b", "a"),
        default="b",
        help="(b) 32 mixed requests (default) or (a) batch-1 decode",
    )
    parser.add_argument("--quick", action="store_true", help="tiny model and sizes (for tests)")
    parser.add_argument("--model", help="model directory (default: the course model)")
    parser.add_argument("--out", help="also write the profiles to this JSON file (the chapters' tables)")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()[0]
    device = chosen_device(args.device)
    if device is None:
        return 2
    if device.type == "cuda":
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX shares the GPU with torch
    sizes = QUICK if args.quick else FULL
    if args.quick and not args.model:
        import tempfile

        from kvcourse.harness.tiny import make_tiny_checkpoint

        model_dir = make_tiny_checkpoint("llama", tempfile.mkdtemp(prefix="kvcourse-profile-"))
    else:
        model_dir = resolve_model_dir(args.model)
    from kvcourse.config import ModelConfig

    vocab = ModelConfig.from_dir(model_dir).vocab_size
    if args.workload == "a":
        prompts, max_new_tokens = batch1_workload(model_dir, sizes["a_tokens"])
    else:
        prompts, max_new_tokens = mixed_workload(vocab, sizes["b_requests"], sizes["b_prompt"], sizes["b_new"])
    max_len = max(sizes["b_prompt"][1] + sizes["b_new"][1], len(prompts[0]) + max_new_tokens[0])
    profiles, kernels, l6 = {}, {}, None
    for spec in (args.stages or DEFAULT_STAGES[device.type]).split(","):
        name, _, variant = spec.partition(":")  # "L4:cpp": a kernel; "L4:graphs": the decode graphs
        cls = engine_class(name)
        if name == "L6":
            l6 = profile_l6(model_dir, prompts, max_new_tokens, stage_options(cls, sizes, max_len, device))
            continue
        if not hasattr(cls, "prepare"):
            raise SystemExit(f"{name} has no scheduler step to profile; profile L3, L4, L5 or L6")
        options = stage_options(cls, sizes, max_len, device)
        options |= {"cuda_graphs": True} if variant == "graphs" else {"kernel": variant} if variant else {}
        key = (
            spec if spec not in profiles else f"{spec} #{sum(k.split(' #')[0] == spec for k in profiles) + 1}"
        )
        try:
            profiles[key] = profile_stage(name, model_dir, prompts, max_new_tokens, options)
        except ValueError as e:  # e.g. L4:cpp on a GPU
            print(f"error: {spec}: {e}", file=sys.stderr)
            return 2
        if device.type == "cuda" or args.torch_profiler:
            kernels[key] = kernel_profile(name, model_dir, prompts, max_new_tokens, options)
    parts = [table(profiles)] if profiles else []
    if profiles and device.type == "cuda":
        parts.append(
            f"on {describe(device)} the timers above time launches and host work, not kernels (see below)"
        )
    parts += [kernel_table(kernels)] if kernels else []
    parts += [l6_table(l6)] if l6 else []
    print("\n\n".join(parts))
    if args.out:
        command = "python -m bench.profile " + " ".join(
            a for a in (argv if argv is not None else sys.argv[1:])
        )
        results = {"command": command.strip(), **provenance(), "machine": describe(device) if device.type == "cuda" else f"{cpu_name()}, {os.cpu_count()} cores",
                   "load_average_before": load_before, "load_average_after": os.getloadavg()[0],
                   "omp_wait_policy": OMP_WAIT_POLICY, "workload": args.workload,
                   "profiles": profiles, "kernels": kernels, "l6": l6}  # fmt: skip
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
