"""``make bench``: every stage against Hugging Face and against the machine's ceilings, in one run.

    python -m bench.run [--device auto|cpu|cuda] [--workloads b,u] [--quick] [--out DIR] [--model DIR]
                        [--stages L3,L4] [--peers none]

Systems: HF ``generate`` one request at a time (``HF batch 1``, the token reference), HF ``generate``
on all requests left-padded (``HF batched``), transformers' own paged continuous batching
(``HF generate_batch``), and every stage present (L4 and L5 with their C++ kernel on a CPU, their
Triton kernel on a GPU: ``kernel="auto"``), each on its readable step (``cuda_graphs=False``). On a GPU,
L4 and L5 also run on their decode-graph fast path (``cuda_graphs=True``, ``kvcourse/decode_graphs.py``,
the engines' default there) as systems of their own, ``L4 + decode graphs`` and ``L5 + decode graphs``,
beside the readable ones.

Every system runs on one device, ``--device``: ``auto`` (the default) is a CUDA GPU where torch sees
one, else the CPU; ``cuda`` without a GPU is refused in one ``error:`` line (exit status 2). The HF
peers' model, every torch stage (``device=``) and L6 (``Engine(device=...)``, JAX's backend of that
name: ``make bench`` leaves ``JAX_PLATFORMS`` unset, so a CUDA build of JAX has its GPU) all run there,
with TF32 off (``kvcourse.devices``). On a GPU, JAX is told not to take 75% of the GPU's memory as it
starts (``XLA_PYTHON_CLIENT_PREALLOCATE=false``): the torch systems share the card.

Workloads (fixed-length: every request produces exactly its max_new_tokens); a CPU runs them all, a
GPU (a), (b) and (u) only (``PLANS``):

- (a) batch-1 decode: one chat prompt, 128 new tokens;
- (b) 32 mixed requests: prompt lengths 10-300, max_new_tokens 16-128 (seeded), all submitted at once;
- (u) 32 uniform requests: 128-token prompts, 64 new tokens each (where HF batched wastes nothing);
- (c) 8 samples of one 200-token prompt, 64 tokens each: L5 and L6 prefill it once and clone (sharing
  its full blocks), the others run 8 requests; the most blocks held at once against 8 private copies;
- (d) decode latency against context length (128 .. 2048), per stage: the time of 32 extra decode
  steps after a prompt of that length, divided by 32 (the fastest of 3 runs of each length).
- (e) L6 alone: its reference attention, jit'd, per block size (``q_block`` x ``kv_pages_per_block``)
  on a 32-sequence decode batch and a 512-token prefill; and the time of a logical reset (metadata)
  against a physical one (also zeroes every page of the pool).
- (f) one batch-1 decode token's matrix-vector products alone, per weight name, in PyTorch (L1-L5)
  and in XLA (L6): the time each takes and the cores it keeps busy (``bench/matvec.py``).

On a GPU, (c), (d), (e) and (f) are skipped, each with its reason in the JSON (``skipped``, from
``GPU_SKIPS``), and (b) runs first, so that L6's first run of (b) is the first thing JAX compiles in
the process, as in a fresh one (XLA keeps what it autotuned for the process). ``--workloads`` runs a
part of the device's plan (the rest goes into ``skipped`` as not asked for): a GPU session whose
commands may run 10 minutes each runs (b) in one process and (u), (a) in another.

How each time is taken (``measure.timed_together``): one workload at a time, every system on it
built fresh; each gets one untimed warm-up run of the workload (it compiles L6's programs; its time
is kept as ``warmup_seconds``), then ``repeats`` (3) timed runs, interleaved across the systems (A B
C, A B C, A B C: this VM's speed drifts, and a drift then falls on every system alike). A time is the
median of a system's runs, every run's seconds kept in ``runs``. On a GPU each timed region begins and
ends with ``torch.cuda.synchronize()``. An engine's ``stats().compiles`` (L6's traces per jit'd
function) is kept after its warm-up and after its timed runs (``compiles``): equal when the timed runs
compiled nothing. Systems that run one request after another (HF batch 1, L1, L2) warm up on the
first request and are timed once on (b) and (u): three runs would cost ten minutes each for numbers
no target depends on. HF batched is credited only with the tokens each request asked
for; ``computed_new_tokens`` says what it generated.

The outputs of the timed runs are compared token for token with HF batch 1's (``agreement``, the tie
rule of ``kvcourse.harness.compare`` the only tolerance). A stage's mismatch, or a stage's fast path's,
fails the bench (exit status 1) after the results are written; a peer's (HF batched, HF
generate_batch: comparisons, not the course's code) is printed and fails nothing. Each mismatch is in
the JSON's ``disagreements`` (``report.disagreements``: the system, whether it is a peer, the
workload, the request, the token, and HF's top-2 gap there, which is why the tie rule did not
apply). KV utilization on (b) and the blocks held on (c) come from the ``stats()`` of
a fresh engine that ran only that workload: live positions / positions held, summed over every step.

Ceilings (``bench/ceilings.py``) are measured in the same run, and every speed is also reported as a
ratio to the peers and to the ceilings, because this machine is shared and noisy: only ratios measured
side by side mean anything. The targets of issue #13 (on a CPU) or of issue #27 (on a GPU) are checked
from those ratios (``targets`` in the JSON, met or missed). Results go to ``OUT/results/bench.json`` and
``OUT/plots/*.png`` (OUT defaults to ``bench/``); a GPU run's to ``bench-cuda.json`` and
``*-cuda.png``, a part's with its letters (``bench-cuda-b.json``: ``report.result_name``), so that no
run overwrites another device's. ``--quick`` runs every part on a tiny random model with tiny sizes
and one timed run, so that the test suite can check the benchmark code without paying for it.

The parts: ``workloads.py`` (sizes and requests), ``systems.py`` (the systems behind one call),
``measure.py`` (timing, agreement and memory), ``ceilings.py`` (the machine's limits), ``matvec.py``
((f)), ``report.py`` (ratios, targets, tables, plots); this file runs them in order. ``profile.py`` is
separate: where a stage's step spends its time.

Left out on purpose: sampling cost (every run is greedy, the clones of (c) too), latency
percentiles under load, TPUs, and the GPU's kernel table (the paged kernels alone against SDPA and
the copy bandwidth: a part of its own).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

import torch
from tqdm import tqdm

from bench import ceilings, matvec
from bench.measure import (
    add_device_option,
    agreement,
    block_size_sweep,
    chosen_device,
    cpp_kernel_problem,
    cpu_name,
    decode_latency,
    gpu_info,
    kv_stats,
    package_version,
    provenance,
    requests_job,
    requests_row,
    reset_times,
    runs_once,
    samples_job,
    samples_row,
    stage_options,
    timed_together,
)
from bench.report import add_ratios, disagreements, plot, result_name, summary_table, targets, verdict
from bench.systems import hf_batch1, hf_batched, hf_generate_batch, present_stages, stage
from bench.workloads import FULL, QUICK, batch1_workload, mixed_workload
from kvcourse.cpp_kernels import compile_seconds
from kvcourse.devices import describe
from kvcourse.harness.stages import engine_class, engine_options
from kvcourse.model import Transformer
from kvcourse.model_store import REPO_ROOT, resolve_model_dir

# The workloads each device type runs, in this order.
PLANS = {"cpu": ("a", "b", "u", "c", "d", "e", "f"), "cuda": ("b", "u", "a")}
GPU_SKIPS = {
    "c": "not in the GPU plan: issue #27's targets are on (b) and (u); sharing a prompt's blocks is "
    "measured on the CPU, and a GPU session's device time is short",
    "d": "not in the GPU plan: 5 context lengths x 3 runs x 6 stages for a curve no GPU target uses; "
    "bench.profile --device cuda times decode steps with torch.profiler instead",
    "e": "not in the GPU plan: it sweeps the block sizes of L6's JAX reference attention for the CPU; "
    "the GPU's paged kernels are timed alone in a kernel table of their own",
    "f": "not in the GPU plan: it times batch-1 matrix-vector products on the host's CPU cores",
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.splitlines()[0])
    add_device_option(parser, "every system runs")
    parser.add_argument(
        "--workloads", help="comma-separated part of the device's plan (default: all of it; cpu: "
        f"{','.join(PLANS['cpu'])}, cuda: {','.join(PLANS['cuda'])})",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="tiny model and sizes (for tests)")
    parser.add_argument("--out", default=str(REPO_ROOT / "bench"), help="folder for results/ and plots/")
    parser.add_argument("--model", help="model directory (default: the course model)")
    parser.add_argument("--stages", help="comma-separated stages to run (default: every stage present)")
    parser.add_argument(
        "--peers",
        help="comma-separated peers besides HF batch 1, or none (default: HF batched,HF generate_batch)",
    )
    args = parser.parse_args(argv)
    device = chosen_device(args.device)
    if device is None:
        return 2
    gpu = device.type == "cuda"
    plan = PLANS[device.type]
    chosen_works = plan if args.workloads is None else [w for w in args.workloads.split(",") if w]
    if set(chosen_works) - set(plan):
        parser.error(f"--workloads: choose from {','.join(plan)} on {device.type}, got {args.workloads}")
    skipped = {w: GPU_SKIPS[w] for w in PLANS["cpu"] if gpu and w not in plan}
    skipped |= {w: "not asked for (--workloads)" for w in plan if w not in chosen_works}
    stages = args.stages.split(",") if args.stages else present_stages()
    if gpu:
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # before JAX starts its GPU client
        if "L6" in stages:  # refuse now, not after minutes of other systems, where JAX has no GPU
            from kvcourse.devices import jax_device

            try:
                jax_device(str(device))
            except ValueError as e:
                print(f"error: --device {args.device}: L6 runs on JAX's GPU backend, and {e} (make setup "
                      "ACCEL=cuda installs JAX's CUDA build; JAX_PLATFORMS must not say cpu)", file=sys.stderr)  # fmt: skip
                return 2
    sizes = QUICK if args.quick else FULL
    tmp = None
    if args.quick and not args.model:
        from kvcourse.harness.tiny import make_tiny_checkpoint

        tmp = tempfile.TemporaryDirectory(prefix="kvcourse-bench-")
        model_dir = make_tiny_checkpoint("llama", tmp.name)
    else:
        model_dir = resolve_model_dir(args.model)
    out = Path(args.out)
    (out / "results").mkdir(parents=True, exist_ok=True)
    (out / "plots").mkdir(parents=True, exist_ok=True)

    model = Transformer.from_dir(model_dir)
    vocab = model.cfg.vocab_size
    max_len = max(sizes["d_contexts"]) + sizes["d_steps"] + 8
    max_len = max(max_len, sizes["b_prompt"][1] + sizes["b_new"][1], sizes["c_prompt"] + sizes["c_new"])
    results = {
        "device": describe(device),
        "machine": {"platform": platform.platform(), "processor": cpu_name(), "threads": torch.get_num_threads(),
                    "torch": torch.__version__, "triton": package_version("triton"),
                    "jax": package_version("jax"), "jaxlib": package_version("jaxlib")}
                   | ({"gpu": gpu_info(device)} if gpu else {}),
        "quick": args.quick,
        "sizes": sizes,
        "workloads": list(chosen_works),
        "skipped": skipped,
        "ceilings": ceilings.measure(model.w, quick=args.quick, device=device),
        "cpp_kernel_build_seconds": {str(p.relative_to(REPO_ROOT)): compile_seconds(p)
                                     for p in sorted(REPO_ROOT.glob("L[0-9]_*/fast/*.cpp"))},
    }  # fmt: skip
    a_prompts, a_max_new = batch1_workload(model_dir, sizes["a_tokens"])
    b_prompts, b_max_new = mixed_workload(vocab, sizes["b_requests"], sizes["b_prompt"], sizes["b_new"])
    c_prompt = mixed_workload(vocab, 1, (sizes["c_prompt"],) * 2, (1, 1), seed=7)[0][0]

    u_prompts, u_max_new = mixed_workload(
        vocab, sizes["u_requests"], (sizes["u_prompt"],) * 2, (sizes["u_new"],) * 2, seed=3
    )
    requests = {"a": (a_prompts, a_max_new), "b": (b_prompts, b_max_new), "u": (u_prompts, u_max_new)}
    results["workload_ceilings"] = {
        w: ceilings.workload_ceiling(model.w, *requests[w], results["ceilings"]["matmul_GFLOPs"] * 1e9)
        for w in ("b", "u")
    }
    peers = {"HF batched": hf_batched, "HF generate_batch": hf_generate_batch}  # report.PEERS's names
    chosen = list(peers) if args.peers is None else [p for p in args.peers.split(",") if p and p != "none"]
    unknown = set(chosen) - set(peers)
    if unknown:
        parser.error(f"--peers: unknown {sorted(unknown)}; choose from {', '.join(peers)} or none")
    # HF batch 1 comes first: its outputs (and top-2 gaps) are the token reference for everyone after.
    makers = {"HF batch 1": lambda: hf_batch1(model_dir, str(device))}
    makers |= {name: lambda name=name: peers[name](model_dir, str(device)) for name in chosen}
    options = {n: stage_options(engine_class(n), sizes, max_len, device) for n in stages}
    results["stage_options"] = options
    problems = {} if gpu else {n: cpp_kernel_problem(engine_class(n)) for n in stages}
    results["cpp_kernel_problems"] = {n: p for n, p in problems.items() if p}
    makers |= {n: lambda n=n: stage(n, model_dir, **options[n]) for n in stages}
    if gpu:  # the decode-graph fast path beside each stage that has it, as a system of its own
        for n in [n for n in stages if "cuda_graphs" in engine_options(engine_class(n))]:
            label = f"{n} + decode graphs"
            options[label] = options[n] | {"cuda_graphs": True}  # results["stage_options"] is this dict
            makers[label] = lambda n=n, label=label: stage(n, model_dir, label=label, **options[label])
    one_at_a_time = {"HF batch 1"} | {n for n in stages if "max_num_seqs" not in options[n]}
    works = {name: ["a", "b", "u", "c", "d"] for name in makers}
    for n in one_at_a_time & set(stages):  # L1, L2 are not peers on the uniform workload
        works[n].remove("u")
    peer_works = {"HF batch 1": ["a", "b", "u", "c"], "HF batched": ["a", "b", "u", "c"],
                  "HF generate_batch": ["b", "u", "c"]}  # the peer rows; it has no batch-1 story  # fmt: skip
    works |= {name: w for name, w in peer_works.items() if name in works}
    works = {name: [w for w in ws if w in chosen_works] for name, ws in works.items()}  # the device's plan
    parts = {w: [name for name in makers if w in works[name]] for w in chosen_works if w in "abuc"}

    def runs(name: str, work: str) -> int:  # a warm-up and the timed runs
        once = work != "c" and runs_once(name in one_at_a_time, len(requests[work][0]))
        return 1 + (1 if once else sizes["repeats"])

    total = sum(runs(n, w) for w, names in parts.items() for n in names)
    total += sum(len(sizes["d_contexts"]) for w in works.values() if "d" in w)
    rows: dict[str, dict] = {name: {} for name in makers}
    repeats = sizes["repeats"]
    with tqdm(total=total, desc="bench", unit="run") as progress:
        # One workload at a time, every system on it built fresh (so that an engine's stats() describe
        # that workload alone), their timed runs interleaved, and dropped after: engines hold pools.
        for work, names in parts.items():
            progress.set_postfix_str(f"({work}) building {len(names)} systems")
            systems = {name: makers[name]() for name in names}
            if work == "c":
                jobs = {
                    n: samples_job(s, c_prompt, sizes["c_new"], sizes["c_n"], repeats)
                    for n, s in systems.items()
                }
            else:
                jobs = {n: requests_job(s, *requests[work], repeats) for n, s in systems.items()}
            progress.set_postfix_str(f"({work}) {', '.join(names)}")
            timed = timed_together(jobs, progress.update, ceilings.synchronizer(device))
            for name, (row, outs) in timed.items():  # HF batch 1 first
                system = systems[name]
                if work == "c":
                    rows[name]["c"] = samples_row(system, row, outs, sizes["c_new"], sizes["c_n"])
                else:
                    rows[name][work] = requests_row(system, row, outs, *requests[work])
                if name == "HF batch 1":
                    references = list(system.references)  # of its last run
                else:
                    rows[name][work]["agreement"] = agreement(outs, references)
                if system.engine is not None and (
                    work == "b" or work == "c" and hasattr(system.engine, "generate_samples")
                ):
                    rows[name][f"{work}_kv"] = kv_stats(system.engine)  # (c): only where samples share blocks
            del systems, jobs
        for name, make in makers.items():  # (d): one system at a time, each length the fastest of 3 runs
            if "d" in works[name]:
                progress.set_postfix_str(f"{name} (d)")
                system, rows[name]["d"] = make(), {}
                for c in sizes["d_contexts"]:
                    rows[name]["d"][str(c)] = decode_latency(system, vocab, c, sizes["d_steps"], repeats)
                    progress.update()
                del system
    for row in rows.values():
        if "c_kv" in row:
            row["c_kv"]["private_copies_blocks"] = sizes["c_n"] * -(
                -(sizes["c_prompt"] + sizes["c_new"]) // row["c_kv"]["block_size"]
            )
    results["systems"] = rows
    if "L6" in stages and "e" in chosen_works:
        results["e"] = {
            "block_sizes_ms": block_size_sweep(model.cfg, sizes),
            "reset_ms": reset_times(model_dir, options["L6"]),
        }
    if "f" in chosen_works:
        results["f"] = matvec.measure(model.w, sizes["f_repeats"])
    add_ratios(results)
    results["targets"] = targets(results)
    results["disagreements"] = disagreements(results)
    results.update(provenance())
    (out / "results" / f"{result_name(results)}.json").write_text(json.dumps(results, indent=1) + "\n")
    plot(results, out / "plots")
    print(summary_table(results))
    if tmp:
        tmp.cleanup()
    status, text = verdict(results["disagreements"])
    if text:
        print(text)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
