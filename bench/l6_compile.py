"""What L6's first run compiles, unrolled against scanned: ``python -m bench.l6_compile [--device auto|cpu|cuda]
[--variants unrolled,scanned] [--autotune-levels default,0] [--quick] [--model DIR] [--out FILE]``.

Each row is one way to build the engine (``Engine(scan_layers=...)``, and on a GPU
``autotune_level=...``, XLA's ``xla_gpu_autotune_level``: ``default`` leaves XLA's), measured in fresh
Python processes, so that nothing compiled or autotuned for one row serves another (XLA keeps what it
autotuned for the process). Each row runs two processes on workload (b) of ``make bench`` (32 mixed
requests, ``ignore_eos``), with the bench's engine options (``bench.measure.stage_options``):

1. ``cold``: an empty persistent compilation cache (a fresh temporary ``jax_compilation_cache_dir``),
   so every program compiles. It records the first ``generate()``'s seconds; for each program it
   compiled (one per prefill bucket, one per decode width) the seconds of that first call and the
   seconds JAX's compile events cover in it (``jax.monitoring``: trace, lower, XLA compile; nested
   events counted once), and the program's size: its StableHLO's operations, dot products and
   characters (``jit(...).lower(...).as_text()``, before XLA optimizes it). Then the second run
   (warm, nothing to compile: the row's speed), and a third with every prompt one token shorter
   (other lengths in the same buckets): ``compiles`` after each says whether anything was traced again.
2. ``cache``: a new process with the cache the first one filled, as ``make test`` and the smokes
   reuse ``.cache/jax``: the first ``generate()``'s seconds when the programs come from the disk (on a
   GPU, jax 0.10.2 also keeps XLA's per-fusion autotuning results there:
   ``jax_persistent_cache_enable_xla_caches`` defaults to ``xla_gpu_per_fusion_autotune_cache_dir``).

``--autotune-levels`` applies only on a GPU (a CPU has no autotuning: one ``default`` row per variant).
The file records the command, commit, date, machine, JAX version and load average.

Left out on purpose: the Pallas kernel (TPU interpret mode on a CPU compiles a different program),
and the compile of other decode widths or buckets than (b) uses.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from bench.measure import cpu_name, provenance, stage_options
from bench.profile import COMPILE_EVENTS, covered_seconds
from bench.workloads import FULL, QUICK, mixed_workload

VARIANTS = {"unrolled": False, "scanned": True}


def hlo_size(text: str) -> dict:
    """Operations, dot products and characters of a StableHLO module's text.

    Example: a module with ``%0 = stablehlo.dot_general ...`` and ``%1 = stablehlo.add ...`` ->
    ``{"ops": 2, "dots": 1, "chars": len(text)}``.
    """
    ops = [line for line in text.splitlines() if "= stablehlo." in line or line.strip().startswith("stablehlo.")]
    return {"ops": len(ops), "dots": sum("stablehlo.dot_general" in line for line in ops), "chars": len(text)}


def measure_row(model_dir, device: str, quick: bool, scan: bool, autotune, phase: str) -> dict:
    """One process's measurement of one row (see the module docstring); ``phase`` is cold or cache."""
    import jax

    from kvcourse.config import ModelConfig
    from kvcourse.harness.stages import engine_class

    sizes = QUICK if quick else FULL
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    prompts, max_new = mixed_workload(vocab, sizes["b_requests"], sizes["b_prompt"], sizes["b_new"])
    cls = engine_class("L6")
    options = stage_options(cls, sizes, sizes["b_prompt"][1] + sizes["b_new"][1], "cpu")
    options |= {"device": device, "scan_layers": scan, "autotune_level": autotune}
    engine = cls(model_dir, **options)
    spans, calls, label = defaultdict(lambda: defaultdict(list)), {}, [None]

    def listen(event, start, end, **_):
        if event in COMPILE_EVENTS and label[0] is not None:
            spans[label[0]][COMPILE_EVENTS[event]].append((start, end))

    def recorded(fn, describe):
        def call(*args):
            label[0] = describe(args)
            t0 = time.perf_counter()
            out = jax.block_until_ready(fn(*args))
            if label[0] not in calls:  # a program's first call: it compiled (or loaded) the program
                shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args[:3])
                calls[label[0]] = {"first_call_s": time.perf_counter() - t0, "fn": fn, "args": (*shapes, args[3])}
            label[0] = None
            return out

        return call

    jax.monitoring.register_event_time_span_listener(listen)
    engine._prefill = recorded(engine._prefill, lambda a: f"prefill {a[3]['tokens'].shape[0]} tokens")
    engine._decode = recorded(engine._decode, lambda a: f"decode width {a[3]}")
    t0 = time.perf_counter()
    engine.generate(prompts, max_new, ignore_eos=True)
    row = {"first_generate_s": time.perf_counter() - t0, "compiles_after_first": dict(engine.stats().compiles)}
    row["device_kind"] = engine.device.device_kind
    print(f"  first generate() {row['first_generate_s']:.1f} s, compiled {row['compiles_after_first']}", flush=True)
    jax.monitoring.unregister_event_time_span_listener(listen)
    programs = {}
    for name, c in calls.items():
        programs[name] = {"first_call_s": c["first_call_s"]}
        programs[name] |= {f"{part}_s": covered_seconds(spans[name][part]) for part in COMPILE_EVENTS.values()}
    row["programs"] = programs
    if phase == "cache":
        return row
    t0 = time.perf_counter()
    engine.generate(prompts, max_new, ignore_eos=True)
    row["warm_generate_s"] = time.perf_counter() - t0
    row["compiles_after_warm"] = dict(engine.stats().compiles)
    engine.generate([p[:-1] for p in prompts], max_new, ignore_eos=True)  # other lengths, same buckets
    row["compiles_after_other_lengths"] = dict(engine.stats().compiles)
    for name, c in calls.items():  # sizes last: lowering again traces again
        programs[name] |= hlo_size(c["fn"].lower(*c["args"]).as_text())
    return row


def run_child(args, variant: str, autotune: str, phase: str, cache_dir: str) -> dict:
    """Measure one row's phase in a fresh process (its JSON comes back in a temporary file)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = [sys.executable, "-m", "bench.l6_compile", "--device", args.device, "--model", args.model]
        command += ["--child", variant, autotune, phase, out.name] + (["--quick"] if args.quick else [])
        env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=cache_dir, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
        print(f"{variant}, autotune level {autotune}, {phase}:", flush=True)  # as it goes: a run cut short says how far it got
        subprocess.run(command, check=True, env=env)
        return json.loads(Path(out.name).read_text(encoding="utf-8"))


def table(results: dict) -> str:
    """Markdown: per row, the first generate() cold and from the cache, the warm run, each program."""
    rows = results["rows"]
    lines = ["| row | first generate() s | from the cache s | warm s | program | StableHLO ops | dots | XLA compile s |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, r in rows.items():
        cold, cache = r["cold"], r["cache"]
        lead = f"| {name} | {cold['first_generate_s']:.2f} | {cache['first_generate_s']:.2f} | {cold['warm_generate_s']:.2f} "
        for i, (prog, p) in enumerate(cold["programs"].items()):
            head = lead if i == 0 else "| | | | "
            lines.append(f"{head}| {prog} | {p['ops']} | {p['dots']} | {p['XLA compile_s']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.l6_compile", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="JAX's backend (default auto: cuda where JAX has a GPU, else cpu)")  # fmt: skip
    parser.add_argument("--variants", default="unrolled,scanned", help="comma-separated: unrolled, scanned")
    parser.add_argument("--autotune-levels", default="default,0",
                        help="comma-separated xla_gpu_autotune_level values, or default (GPU only)")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="tiny model and sizes (for tests)")
    parser.add_argument("--model", help="model directory (default: the course model)")
    parser.add_argument("--out", help="JSON file to write (default: bench/results/l6-compile-<device>.json)")
    parser.add_argument("--child", nargs=4, metavar=("VARIANT", "LEVEL", "PHASE", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # each process takes what it needs
    if args.child:
        variant, level, phase, out = args.child
        autotune = None if level == "default" else int(level)
        row = measure_row(args.model, args.device, args.quick, VARIANTS[variant], autotune, phase)
        Path(out).write_text(json.dumps(row), encoding="utf-8")
        return 0
    import jax

    if args.device == "auto":
        args.device = "cuda" if any(d.platform == "gpu" for d in jax.devices()) else "cpu"
    if args.quick and not args.model:
        from kvcourse.harness.tiny import make_tiny_checkpoint

        args.model = make_tiny_checkpoint("llama", tempfile.mkdtemp(prefix="kvcourse-l6-compile-"))
    from kvcourse.model_store import resolve_model_dir

    args.model = str(resolve_model_dir(args.model))
    levels = args.autotune_levels.split(",") if args.device == "cuda" else ["default"]
    load_before = os.getloadavg()[0]
    rows = {}
    for variant in args.variants.split(","):
        for level in levels:
            name = variant + (f", autotune level {level}" if args.device == "cuda" else "")
            with tempfile.TemporaryDirectory(prefix="kvcourse-jax-cache-") as cache_dir:
                rows[name] = {"scan_layers": VARIANTS[variant], "autotune_level": level}
                rows[name]["cold"] = run_child(args, variant, level, "cold", cache_dir)
                rows[name]["cache"] = run_child(args, variant, level, "cache", cache_dir)
    command = "python -m bench.l6_compile " + " ".join(argv if argv is not None else sys.argv[1:])
    kind = next(iter(rows.values()))["cold"]["device_kind"]
    machine = kind if args.device == "cuda" else f"{cpu_name()}, {os.cpu_count()} cores"
    results = {"command": command.strip(), **provenance(), "machine": machine, "jax": jax.__version__,
               "device": args.device, "quick": args.quick, "load_average_before": load_before,
               "load_average_after": os.getloadavg()[0], "rows": rows}  # fmt: skip
    print(table(results))
    path = args.out or (None if args.quick else f"bench/results/l6-compile-{args.device}.json")
    if path:
        Path(path).write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
