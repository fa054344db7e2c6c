"""What paging buys at the vLLM paper's scale, on a simulated clock (``kvcourse.harness.simulate``):

    python -m bench.simulate --calibrate [--quick] [--model DIR] [--out FILE]   time real L3 steps, fit StepCost
    python -m bench.simulate --gpu-profile [--out FILE]                       a GPU's StepCost from committed runs
    python -m bench.simulate [--quick] [--jobs N] [--out DIR]                  the experiment (part of make bench)

**--calibrate** times real steps of the L3 engine on this machine's CPU (the course model,
SmolLM2-135M-Instruct in fp32) over a design of steps (``CALIBRATION``): decode batches of 1 to 64
sequences at contexts of 16 to 1,024 positions, prefills of one prompt of 2 to 1,024 tokens, prompt
chunks after earlier positions, several prompts in one step, and steps that mix decode rows with a
prompt. A step of a given shape is made without computing what came before it: each sequence is
submitted with a prompt of its context's length and told its first positions are already computed
(``num_computed_tokens``), so the step computes only its new tokens and its attention reads every
position; the pool holds whatever an earlier step left there, and a step's time does not depend on the
values it reads. Every shape runs once to warm up, then ``repeats`` times, the shapes interleaved (a
drift of this shared VM falls on all alike); a sample is the mean of its runs (a served stream's time is
the sum of its steps, slow ones included). ``StepCost.fit`` fits the samples (a curve over the tokens a
step computes: this CPU's cost is not a line in them); ``bench/results/step-cost-cpu.json`` keeps them,
the fit, R^2 and its relative errors.
``--quick`` runs a tiny random Llama on a few shapes (for tests) and writes only where ``--out`` says.

**--gpu-profile** writes ``bench/results/step-cost-gpu.json`` from GPU measurements already committed,
all from one NVIDIA H200 run (commit 3e0e7d2, 2026-11-28, a random Llama of SmolLM2-135M's shape):
``GPU_SOURCES`` names the figure behind each coefficient and ``gpu_profile`` says how it is derived
and what is assumed. No GPU is needed to write it.

**The experiment** serves ShareGPT-like and Alpaca-like streams (``kvcourse.harness.stream``: the
paper's Fig. 11 means, lognormal lengths; synthetic, no dataset) on the simulated engine, under the
four admission policies (paging on demand, and the paper's Orca Max, Pow2 and Oracle on a buddy
allocator), with each cost profile. The setup is the paper's OPT-13B one in tokens (``PAPER``): a pool
of 15,728 positions (983 blocks of 16), max_model_len 2048, and vLLM's scheduler defaults of the
paper's time. Per dataset and profile:

1. the unloaded latency: on demand at a rate where requests rarely overlap (``LOW_LOAD``), over
   ``reference_requests`` requests; the latency bound is ``BOUND_FACTOR`` times it. The paper states no
   bound (its Fig. 12 curves are flat, then explode), so ``bounds`` reports the rates at 3x and 10x
   too. A finite stream caps the latency: when every request arrives at once, the mean normalized
   latency is about half the time the whole stream takes over the mean output, which for 1,000
   requests on the GPU profile is some 15-30 times the unloaded latency, so the bound must sit well
   below that;
2. a coarse search per policy (``coarse_search``, one seed): the rate doubles from ``COARSE_START``
   times the unloaded one until the bound is passed, or until the stream arrives in a blink of its
   run, where a higher rate changes nothing; its last two rates bracket the knee;
3. ``fine_rates`` rates spaced evenly from 0.75x the bracket's lower rate to 1.25x its upper one, each
   with every seed of ``seeds`` (``requests`` requests; a seed's requests are the same at every rate,
   its Poisson arrivals scaled); a curve that does not cross the bound gets more rates (``extend``);
4. the sustainable rate: where the seed-mean normalized latency first crosses the bound, by linear
   interpolation between the two rates around the crossing (also per seed: the spread); the ratios
   paged/Oracle, paged/Pow2, paged/Max; and the memory breakdown (``summary``'s ``memory_breakdown``,
   the paper's Fig. 2) at each policy's highest rate under the bound, averaged over seeds.

``PLANS`` holds the sizes (``full``: 3 seeds, 1,000 requests a point, 12 rates a policy).

Results: ``bench/results/simulated.json`` (``_quick`` with ``--quick``), plots
``bench/plots/simulated_latency.png`` and ``simulated_breakdown.png``. ``--jobs`` runs points in that
many processes (default 2); the results do not depend on it.

Left out on purpose: the real engine at this scale (a CPU cannot serve thousands of requests in
minutes; ``bench.serving`` serves a small stream in real time, and the tests check that the simulator
takes the engine's decisions step by step), the paper's FasterTransformer baseline, and swapping.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from bench import OMP_WAIT_POLICY
from bench.measure import cpu_name, cpu_ticks, provenance, save_results, stolen
from bench.workloads import FULL, mixed_workload
from kvcourse.engine_config import EngineConfig
from kvcourse.harness.serving import summary
from kvcourse.harness.simulate import SimulatedEngine, StepCost, simulate, step_features
from kvcourse.harness.stream import MIXES, at_rate, describe, synthetic_stream
from kvcourse.orca import ADMISSION_POLICIES

ROOT = Path(__file__).resolve().parent
VOCAB = 49152  # SmolLM2's vocabulary: the prompts' random ids (no decision depends on them)

# ---------------------------------------------------------------------------------------------------
# The paper's setup, in tokens (Kwon et al., SOSP 2023; checked against its text, see PAPER["why"]).

PAPER = {
    "kv_bytes_per_token": 819_200,  # OPT-13B: 2 x 5120 x 40 x 2 bytes (fp16), section 3 ("800 KB")
    "kv_memory_bytes": 12 * 2**30,  # Table 1: 13B on one A100 (40 GB): 26 GB of parameters, 12 GB for KV
    "pool_positions": 15_728,  # 12 GiB / 800 KiB; Table 1: "Max. # KV cache slots 15.7K"
    "block_size": 16,
    "num_blocks": 983,  # 15,728 // 16
    "max_model_len": 2048,  # OPT's, and Orca (Max)'s reservation (section 6.1)
    "max_num_seqs": 256,  # vLLM v0.1.0-v0.1.7 (June-September 2023) EngineArgs defaults, read in their sdists
    "max_num_batched_tokens": 2560,
    "why": [
        "section 3: 'for the 13B parameter OPT model, the KV cache of a single token demands 800 KB of space, "
        "calculated as 2 (key and value vectors) x 5120 (hidden state size) x 40 (number of layers) x 2 (bytes "
        "per FP16)'",
        "Table 1 (13B): GPUs A100, total GPU memory 40 GB, parameter size 26 GB, memory for KV cache 12 GB, "
        "max. # KV cache slots 15.7K (= 12 GiB / 800 KiB = 15,728)",
        "vLLM 0.1.0, 0.1.4 and 0.1.7 (PyPI sdists, vllm/engine/arg_utils.py): block_size 16, "
        "max_num_batched_tokens 2560, max_num_seqs 256",
        "vLLM 0.1.0's scheduler batched a step's prompts with the running sequences' decode tokens under "
        "max_num_batched_tokens, as L3's does; 0.1.7's ran prompt steps apart from decode steps",
    ],
}
PAPER_FIG2 = {  # % of KV memory (Fig. 2): token states, reservation, internal frag., external frag. & others
    "max": [20.4, 13.3, 57.3, 8.9],
    "pow2": [26.8, 17.9, 13.6, 41.6],
    "oracle": [38.2, 25.2, None, 36.6],
    "on_demand": [96.3, None, None, None],
}
PAPER_RATIOS = {
    "sharegpt": {"on_demand/oracle": [1.7, 2.7], "on_demand/max": [2.7, 8.0],
                 "where": "section 6.2, ShareGPT, OPT-13B/66B/175B (Fig. 12 top row)"},
    "alpaca": {"on_demand/oracle": [1.3, 1.3],
               "where": "section 6.3, OPT-13B, Alpaca, basic sampling (Fig. 12 (d)); no Max ratio is stated"},
}  # fmt: skip


def paper_config(policy: str) -> EngineConfig:
    """The simulated engine's config: the paper's pool in tokens and vLLM's defaults of its time, under
    ``policy``; whole prompts a step (no chunked prefill in vLLM 0.1)."""
    return EngineConfig(
        max_model_len=PAPER["max_model_len"],
        block_size=PAPER["block_size"],
        num_blocks=PAPER["num_blocks"],
        admission_policy=policy,
        max_num_seqs=PAPER["max_num_seqs"],
        max_num_batched_tokens=PAPER["max_num_batched_tokens"],
        vocab_size=VOCAB,
    )


# ---------------------------------------------------------------------------------------------------
# --calibrate: real L3 steps on this machine

CALIBRATION = {  # a step: [(positions already computed, new tokens)] per sequence
    "full": {
        "decode": [(b, c) for b in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64) for c in (16, 128, 512, 1024)
                   if b * c <= 32_768],
        "prefill": [(1, t, 0) for t in (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256, 512, 1024)]
        + [(1, 128, 896), (1, 256, 768), (1, 512, 512), (1, 256, 256)]  # chunks after earlier positions
        + [(4, 64, 0), (16, 64, 0), (8, 128, 0), (4, 256, 0)],  # several prompts in one step
        "mixed": [(16, 256, 256), (8, 1024, 512)],  # (decode rows, their context, a prompt's tokens)
        "repeats": 5,
        "max_model_len": 2048,
        "num_blocks": 2200,  # the largest shapes: 64 x 513 positions, 33 blocks each (2,112 blocks; 1.6 GB of fp32 K/V)
        "max_num_seqs": 64,
    },
    "quick": {
        "decode": [(1, 8), (4, 8), (2, 32), (4, 32)],
        "prefill": [(1, 16, 0), (1, 32, 0), (1, 8, 8), (2, 8, 0)],
        "mixed": [(2, 16, 8)],
        "repeats": 1,
        "max_model_len": 128,
        "num_blocks": 32,
        "max_num_seqs": 8,
    },
}


def calibration_steps(plan: dict) -> list[dict]:
    """The design as steps: a name and the (computed, new) pair of each of its sequences.
    Example: decode (4, 128) -> ``{"name": "decode 4 x 128", "rows": [(128, 1)] * 4}``."""
    steps = [{"name": f"decode {b} x {c}", "rows": [(c, 1)] * b} for b, c in plan["decode"]]
    for n, t, after in plan["prefill"]:
        name = f"prefill {n} x {t}" + (f" after {after}" if after else "")
        steps.append({"name": name, "rows": [(after, t)] * n})
    for b, c, t in plan["mixed"]:
        steps.append({"name": f"mixed {b} x decode at {c} + prompt {t}", "rows": [(c, 1)] * b + [(0, t)]})
    return steps


def run_step(engine, rows: list[tuple[int, int]], rng: random.Random) -> float:
    """Seconds of one engine step made of ``rows``: each sequence a prompt of computed + new random ids,
    of which the first ``computed`` count as computed, and max_new_tokens 1 (it finishes in the step)."""
    for computed, new in rows:
        seq = engine.add_request([rng.randrange(3, VOCAB) for _ in range(computed + new)], 1, ignore_eos=True)
        seq.num_computed_tokens = computed  # the step computes only the new tokens, and attends to all
    t0 = time.perf_counter()
    engine.step()
    seconds = time.perf_counter() - t0
    if engine.has_unfinished():
        raise RuntimeError(f"a calibration step of {len(rows)} sequences did not run as one step")
    return seconds


def calibrate(model_dir, plan: dict, command: str) -> dict:
    """Time every step of the plan on the L3 engine (CPU), fit ``StepCost``, return the record."""
    from L3_block_tensor.engine import Engine

    engine = Engine(model_dir, device="cpu", block_size=16, num_blocks=plan["num_blocks"],
                    max_model_len=plan["max_model_len"], max_num_seqs=plan["max_num_seqs"])  # fmt: skip
    steps, rng = calibration_steps(plan), random.Random(0)
    runs: list[list[float]] = [[] for _ in steps]
    load_before, ticks = os.getloadavg(), cpu_ticks()
    for round_ in range(plan["repeats"] + 1):  # the first round warms up
        for i, step in enumerate(steps):
            seconds = run_step(engine, step["rows"], rng)
            if round_:
                runs[i].append(seconds)
    samples = []
    for step, times in zip(steps, runs, strict=True):
        tokens = sum(new for _, new in step["rows"])
        context = sum(computed + new for computed, new in step["rows"])
        samples.append({"name": step["name"], "tokens": tokens, "seqs": len(step["rows"]), "context": context,
                        "seconds": statistics.fmean(times), "runs": times})  # fmt: skip
    cost = StepCost.fit(samples)
    quality = cost.quality(samples)
    for sample in samples:
        sample["predicted"] = cost.predict(sample["tokens"], sample["seqs"], sample["context"])
    return {
        "command": command,
        **provenance(),
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                    "omp_wait_policy": OMP_WAIT_POLICY},  # fmt: skip
        "load_average_before": list(load_before),
        "load_average_after": list(os.getloadavg()),
        "steal": stolen(ticks, cpu_ticks()),  # the share of CPU time the VM lost to other machines meanwhile
        "model": Path(model_dir).name,
        "engine": "L3_block_tensor, fp32, block_size 16, max_num_batched_tokens = max_model_len",
        "plan": {k: v for k, v in plan.items() if k not in ("decode", "prefill", "mixed")},
        "method": "StepCost.fit: a curve over the tokens a step computes (points at token_points), a cost per "
        "sequence and one per context position, by non-negative least squares (scipy nnls) on the error "
        "relative to the model's prediction; each sample the mean of the step's timed runs",
        "fit": quality,
        "samples": samples,
        "coefficients": cost.as_json(),
    }


# ---------------------------------------------------------------------------------------------------
# --gpu-profile: a StepCost from committed GPU figures

GPU_SOURCES = {
    "per_context": "bench/results/kernels-cuda.json: row 'paged kernel (Triton)', shape '32 x 4,096 (9/3 x 64)' "
    "(one layer's decode attention over 32 x 4,096 positions, SmolLM2's heads), ms",
    "base + per_row": "bench/results/profile-cuda.json: kernels['L4:graphs'].steps, the wall ms of three decode "
    "steps of workload (b) with decode graphs (32, 18 and 1 rows), device synchronized around each",
    "per_token": "bench/results/bench-cuda-b.json: ceilings.parameters and ceilings.matmul_GFLOPs (fp32 "
    "8192^3, TF32 off): 2 x parameters FLOPs a token at that rate",
    "check": "bench/results/bench-cuda-b.json: systems['L4 + decode graphs'].b.seconds and systems.L4.b.seconds "
    "(median (b) runs), against the profile's prediction over (b)'s replayed steps",
}


def replay_b() -> list[tuple[int, int, int, bool]]:
    """Workload (b) as ``bench.profile`` ran it on L4, step by step: (tokens, seqs, context, decode only).
    The requests are ``bench.workloads.mixed_workload``'s (seeded); the options are those
    ``bench.profile`` gives L4 for (b) (``bench.measure.stage_options``: max_model_len = the longest
    prompt + max_new_tokens of the sizes, 428, so 428 tokens a step; 864 blocks of 16; 32 sequences);
    the decisions are the scheduler's own, replayed by the simulated engine (its cost is irrelevant).
    """
    sizes = FULL
    prompts, max_new = mixed_workload(VOCAB, sizes["b_requests"], sizes["b_prompt"], sizes["b_new"])
    max_len = max(sizes["b_prompt"][1] + sizes["b_new"][1], len(prompts[0]) + max_new[0])
    config = EngineConfig(max_model_len=max_len, block_size=16, num_blocks=864, max_num_seqs=32,
                          max_num_batched_tokens=max_len, vocab_size=VOCAB)  # fmt: skip
    engine = SimulatedEngine(config, StepCost.line(0.0, 0.0, 0.0, 0.0))
    for p, n in zip(prompts, max_new, strict=True):
        engine.add_request(p, n)
    steps, schedule = [], engine.scheduler.schedule

    def recorded():
        batch = schedule()
        steps.append((*step_features(batch), all(n == 1 for _, n in batch)))
        return batch

    engine.scheduler.schedule = recorded
    while engine.has_unfinished():
        engine.step()
    return steps


def gpu_profile(command: str) -> dict:
    """The H200 profile from committed figures, with every step of its derivation (``GPU_SOURCES``)."""
    results = ROOT / "results"
    kernels = json.loads((results / "kernels-cuda.json").read_text())
    profile = json.loads((results / "profile-cuda.json").read_text())
    bench_b = json.loads((results / "bench-cuda-b.json").read_text())
    layers = 30  # SmolLM2-135M's layers (the random Llama of its shape the run built)
    [row] = [r for r in kernels["rows"]
             if r["system"] == "paged kernel (Triton)" and r["shape"] == "32 x 4,096 (9/3 x 64)"]  # fmt: skip
    per_context = row["ms"] / 1e3 * layers / (32 * 4096)
    steps = replay_b()
    graphs = profile["kernels"]["L4:graphs"]["steps"]
    points = []  # (rows, wall seconds - per_context x context) of each profiled decode step
    for s in graphs:
        tokens, seqs, context, decode = steps[s["step"]]
        if not decode or seqs != s["rows"]:
            raise RuntimeError(
                f"replayed step {s['step']} has {seqs} rows (decode only: {decode}), the profile {s['rows']}"
            )
        points.append((seqs, s["wall_ms"] / 1e3 - per_context * context))
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    per_row = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    base = my - per_row * mx
    ceilings = bench_b["ceilings"]
    per_token = 2 * ceilings["parameters"] / (ceilings["matmul_GFLOPs"] * 1e9)
    cost = StepCost.line(base, per_token, max(0.0, per_row - per_token), per_context)
    predicted = sum(cost.predict(t, s, c) for t, s, c, _ in steps)
    measured = {name: bench_b["systems"][name]["b"]["seconds"] for name in ("L4 + decode graphs", "L4")}
    return {
        "command": command,
        **provenance(),
        "card": f"{bench_b['device']}; kernels-cuda.json: {kernels['device_name']}; profile-cuda.json: {profile['machine']}",
        "measured_at": {"bench-cuda-b.json": [bench_b["commit"], bench_b["date"]],
                        "profile-cuda.json": [profile["commit"], profile["date"]],
                        "kernels-cuda.json": [kernels["commit"], kernels["date"]]},  # fmt: skip
        "engine": "L4 on the H200 (Triton paged kernel; decode graphs for base and per-row), fp32, SmolLM2-135M shape",
        "sources": GPU_SOURCES,
        "derivation": {
            "per_context": f"{row['ms']:.4f} ms x {layers} layers / (32 x 4,096) positions = {per_context * 1e9:.2f} ns",
            "decode_steps": [{"step": s["step"], "rows": s["rows"], "wall_ms": s["wall_ms"],
                              "replayed_context": steps[s["step"]][2]} for s in graphs],  # fmt: skip
            "base, per_row": "least squares line through the decode steps' (rows, wall - per_context x context): "
            f"base {base * 1e3:.3f} ms, {per_row * 1e6:.2f} us a row",
            "per_token": f"2 x {ceilings['parameters']:,} FLOPs / {ceilings['matmul_GFLOPs']:,.0f} GFLOP/s = "
            f"{per_token * 1e6:.2f} us",
            "per_seq": f"per_row - per_token = {cost.per_seq * 1e6:.2f} us (a decode row is one token and one sequence)",
            "replay": f"{len(steps)} steps, {sum(d for *_, d in steps)} decode-only (profile-cuda.json: "
            f"{profile['profiles']['L4']['steps']} and {profile['profiles']['L4']['decode_steps']})",
        },
        "assumed": [
            "a prompt token costs its matmuls at the card's measured fp32 rate on 8192^3 products (an optimistic "
            "floor: SmolLM2's 576-wide products run below it)",
            "every step runs at decode-graph speed (L4 captures graphs for decode-only steps; a step with a prompt "
            "runs eager, which the profile's eager 1-row step puts at about 30 ms instead of about 3)",
            "the decode steps were timed with the device synchronized around each; (b)'s own runs overlap the "
            "host's work with the device's",
            "the K/V pool is the paper's in tokens; SmolLM2's K/V per token (46,080 B in fp32) is not OPT-13B's "
            "(819,200 B), and only the step times come from the GPU",
        ],
        "check": {"predicted_b_seconds": predicted, "measured_b_seconds": measured,
                  "note": "the profile over (b)'s replayed steps against (b)'s measured medians"},  # fmt: skip
        "coefficients": cost.as_json(),
    }


# ---------------------------------------------------------------------------------------------------
# The experiment

DATASETS = ("sharegpt", "alpaca")
PROFILES = ("cpu", "gpu")  # bench/results/step-cost-<name>.json
BOUND_FACTOR = 5  # the latency bound: this many times the unloaded normalized latency
SENSITIVITY = (3, 10)  # other factors, reported beside it
LOW_LOAD = 0.25  # the unloaded reference's rate: a quarter of a request in flight, had each run alone
COARSE_START = 4  # the coarse search starts at this many times that rate, below every knee seen
PLANS = {
    "full": {"seeds": (0, 1, 2), "requests": 1000, "reference_requests": 200, "fine_rates": 12, "scale": 1.0,
             "num_blocks": PAPER["num_blocks"]},
    "quick": {"seeds": (0, 1), "requests": 24, "reference_requests": 12, "fine_rates": 3, "scale": 0.1,
              "num_blocks": 160},  # tests: every code path on tiny streams and a small pool (Max: one run of 128)
}  # fmt: skip


@functools.lru_cache(maxsize=16)
def stream(mix: str, seed: int, n: int, scale: float) -> tuple:
    """The seed's requests of a dataset (arrivals at 1 req/s; ``at_rate`` moves them)."""
    return tuple(synthetic_stream(mix, n, 1.0, seed, vocab_size=VOCAB, max_model_len=PAPER["max_model_len"],
                                  scale=scale))  # fmt: skip


def run_point(profile: dict, mix: str, policy: str, rate: float, seed: int, n: int, plan: dict) -> dict:
    """One simulated run: the seed's n requests of ``mix`` at ``rate`` under ``policy``; its summary
    without the per-request rows."""
    config = paper_config(policy)
    if plan["num_blocks"] != config.num_blocks:
        config = EngineConfig(**{**vars(config), "num_blocks": plan["num_blocks"]})
    requests = at_rate(list(stream(mix, seed, n, plan["scale"])), rate, seed)
    s = summary(simulate(requests, config, StepCost.from_json(profile)))
    keep = ("mean_normalized_latency", "ttft_p50", "tpot_p50", "output_tokens_per_s", "preemptions", "steps",
            "kv_utilization", "memory_breakdown", "duration_s")  # fmt: skip
    return {"rate": rate, "seed": seed, **{k: s[k] for k in keep}}


def coarse_search(profile: dict, mix: str, policy: str, start: float, bound: float, plan: dict) -> list[dict]:
    """Runs at start x 2^k (k = 0, 1, ...) until the mean normalized latency passes ``bound``, or the
    stream's arrivals span under 1% of the run (saturated: a higher rate changes nothing)."""
    rows, rate = [], start
    while True:
        rows.append(run_point(profile, mix, policy, rate, plan["seeds"][0], plan["requests"], plan))
        if rows[-1]["mean_normalized_latency"] > bound or plan["requests"] / rate < 0.01 * rows[-1]["duration_s"]:
            return rows
        rate *= 2


def crossing(rates: list[float], latencies: list[float], bound: float) -> float | None:
    """The rate at which ``latencies`` first rise past ``bound``, linear between the two rates around it;
    None if they never do, or are past it from the first rate.
    Example: ``crossing([1, 2, 3], [0.1, 0.2, 0.6], 0.4) -> 2.5``."""
    for r0, r1, v0, v1 in zip(rates, rates[1:], latencies, latencies[1:], strict=False):
        if v0 <= bound < v1:
            return r0 + (bound - v0) * (r1 - r0) / (v1 - v0)
        if v0 > bound:
            return None
    return None


def fine_grid(coarse: list[dict], count: int) -> list[float]:
    """``count`` rates evenly from 0.75x the last coarse rate under the bound to 1.25x the first past it."""
    over = coarse[-1]["rate"]
    under = coarse[-2]["rate"] if len(coarse) > 1 else over / 2
    lo, hi = 0.75 * under, 1.25 * over
    return [lo + (hi - lo) * i / (count - 1) for i in range(count)]


def curve(rows: list[dict], seeds) -> dict:
    """Per rate (sorted): the seeds' mean normalized latencies, their mean, min and max."""
    rates = sorted({r["rate"] for r in rows})
    per_seed = {s: {r["rate"]: r["mean_normalized_latency"] for r in rows if r["seed"] == s} for s in seeds}
    values = [[per_seed[s][rate] for s in seeds] for rate in rates]
    return {"rates": rates, "per_seed": {str(s): [per_seed[s][r] for r in rates] for s in seeds},
            "mean": [statistics.fmean(v) for v in values], "min": [min(v) for v in values],
            "max": [max(v) for v in values]}  # fmt: skip


def sustainable(c: dict, bound: float) -> dict:
    """The sustainable rate of a curve under ``bound``: on the seed mean, and per seed."""
    per_seed = {s: crossing(c["rates"], v, bound) for s, v in c["per_seed"].items()}
    return {"rate": crossing(c["rates"], c["mean"], bound), "per_seed": per_seed}


def breakdown_at(rows: list[dict], c: dict, bound: float) -> dict | None:
    """The memory breakdown at the highest rate whose seed-mean latency is within ``bound``, averaged
    over its seeds (a share is averaged over the seeds in which some request waited)."""
    under = [r for r, v in zip(c["rates"], c["mean"], strict=True) if v <= bound]
    if not under:
        return None
    parts = [r["memory_breakdown"] for r in rows if r["rate"] == under[-1] and r["memory_breakdown"]]
    if not parts:
        return {"rate": under[-1], "shares": None}
    keys = [k for k in parts[0] if k not in ("steps", "seconds")]
    return {"rate": under[-1], "seeds": len(parts), "shares": {k: statistics.fmean(p[k] for p in parts) for k in keys}}


def unloaded_rate(profile: dict, mix: str, plan: dict) -> float:
    """``LOW_LOAD`` over the modelled end-to-end time of a request of the stream's mean lengths, alone:
    its prefill step, then a decode step per further token."""
    d = describe(list(stream(mix, plan["seeds"][0], plan["reference_requests"], plan["scale"])))
    prompt, output, cost = round(d["mean_prompt"]), round(d["mean_output"]), StepCost.from_json(profile)
    alone = cost.predict(prompt, 1, prompt) + (output - 1) * cost.predict(1, 1, prompt + output // 2)
    return LOW_LOAD / alone


def call(job: tuple):
    """Run ``fn(*args)`` for ``job = (fn, args)``: one task of a process pool."""
    fn, args = job
    return fn(*args)


def experiment(plan: dict, profiles: dict[str, dict], jobs: int) -> dict:
    """Every dataset x profile x policy: the reference, the coarse search, the fine sweep, the verdicts."""
    keys = [(p, m) for p in profiles for m in DATASETS]
    cells = [(p, m, policy) for p, m in keys for policy in ADMISSION_POLICIES]
    first = plan["seeds"][0]
    with ProcessPoolExecutor(max_workers=jobs) as pool:

        def each(jobs_: list[tuple]) -> list:
            return list(pool.map(call, jobs_))

        lows = {k: unloaded_rate(profiles[k[0]], k[1], plan) for k in keys}
        refs = each([(run_point, (profiles[p], m, "on_demand", lows[p, m], first, plan["reference_requests"], plan))
                     for p, m in keys])  # fmt: skip
        bounds = {k: BOUND_FACTOR * ref["mean_normalized_latency"] for k, ref in zip(keys, refs, strict=True)}
        starts = {k: COARSE_START * low for k, low in lows.items()}
        coarse = dict(zip(cells, each([(coarse_search, (profiles[p], m, policy, starts[p, m], bounds[p, m], plan))
                                       for p, m, policy in cells]), strict=True))  # fmt: skip
        grids = {cell: fine_grid(coarse[cell], plan["fine_rates"]) for cell in cells}
        fine: dict[tuple, list[dict]] = {cell: [] for cell in cells}
        for _ in range(4):  # a grid whose seed-mean curve does not cross the bound is extended, up to 3 times
            tasks = [(cell, rate, seed) for cell in cells for rate in grids[cell] for seed in plan["seeds"]
                     if not any(r["rate"] == rate and r["seed"] == seed for r in fine[cell])]  # fmt: skip
            if not tasks:
                break
            done = each([(run_point, (profiles[c[0]], c[1], c[2], rate, seed, plan["requests"], plan))
                         for c, rate, seed in tasks])  # fmt: skip
            for (cell, _, _), row in zip(tasks, done, strict=True):
                fine[cell].append(row)
            for cell in cells:
                c = curve(fine[cell], plan["seeds"])
                if crossing(c["rates"], c["mean"], bounds[cell[:2]]) is None:
                    grids[cell] = extend(c, bounds[cell[:2]], plan["fine_rates"])
    results = {}
    for (p, m), ref in zip(keys, refs, strict=True):
        bound = bounds[p, m]
        cell = {"unloaded": {"rate": lows[p, m], **ref}, "bound": bound,
                "bound_rule": f"{BOUND_FACTOR} x the unloaded mean normalized latency", "policies": {}}  # fmt: skip
        for policy in ADMISSION_POLICIES:
            rows = sorted(fine[p, m, policy], key=lambda r: (r["rate"], r["seed"]))
            c = curve(rows, plan["seeds"])
            cell["policies"][policy] = {
                "coarse": coarse[p, m, policy], "curve": c, "runs": rows,
                "sustainable": sustainable(c, bound),
                "bounds": {str(f): sustainable(c, f / BOUND_FACTOR * bound)["rate"] for f in SENSITIVITY},
                "breakdown": breakdown_at(rows, c, bound),
            }  # fmt: skip
        cell["ratios"] = ratios(cell["policies"], plan["seeds"])
        results[f"{p}/{m}"] = cell
    return results


def extend(c: dict, bound: float, count: int) -> list[float]:
    """A curve that never crosses ``bound`` gets ``count`` // 3 more rates (at least 2): past its end at
    its spacing if it stays under the bound, else below its start, halving.
    Example: rates [4, 5, 6], all under, count 6 -> [4, 5, 6, 7, 8]; all over -> [4, 5, 6, 2, 1]."""
    rates, more = c["rates"], max(2, count // 3)
    if c["mean"][0] > bound:
        return rates + [rates[0] / 2**k for k in range(1, more + 1)]
    step = rates[1] - rates[0] if len(rates) > 1 else rates[0]
    return rates + [rates[-1] + step * k for k in range(1, more + 1)]


def ratios(policies: dict, seeds) -> dict:
    """Paged's sustainable rate over each Orca policy's: on the seed means, and the range over seeds."""
    out = {}
    paged = policies["on_demand"]["sustainable"]
    for other in ("oracle", "pow2", "max"):
        theirs = policies[other]["sustainable"]
        per_seed = [paged["per_seed"][str(s)] / theirs["per_seed"][str(s)] for s in seeds
                    if paged["per_seed"][str(s)] and theirs["per_seed"][str(s)]]  # fmt: skip
        out[f"on_demand/{other}"] = {
            "ratio": paged["rate"] / theirs["rate"] if paged["rate"] and theirs["rate"] else None,
            "seed_range": [min(per_seed), max(per_seed)] if per_seed else None,
        }
    return out


# ---------------------------------------------------------------------------------------------------
# Plots and the printed table

COLORS = {"on_demand": "tab:blue", "oracle": "tab:green", "pow2": "tab:orange", "max": "tab:red"}
LABELS = {"on_demand": "paged (vLLM)", "oracle": "Orca (Oracle)", "pow2": "Orca (Pow2)", "max": "Orca (Max)"}
SHARES = ("token_states", "reservation", "internal_fragmentation", "external_fragmentation", "other_free")


def plots(results: dict, tag: str, folder: Path) -> list[str]:
    """``simulated_latency``: latency against rate per dataset x profile (seed mean, min-max band, the
    bound, each policy's sustainable rate dotted; both axes logarithmic: the knees lie 10x apart);
    ``simulated_breakdown``: Fig. 2's bars beside the measured breakdown per profile (ShareGPT), the
    buddy's power-of-two rounding hatched apart from the rest of internal fragmentation."""
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    cells = results["cells"]
    fig, axes = plt.subplots(len(DATASETS), len(PROFILES), figsize=(11, 7.5), squeeze=False)
    for i, mix in enumerate(DATASETS):
        for j, prof in enumerate(PROFILES):
            ax, cell = axes[i][j], cells[f"{prof}/{mix}"]
            for policy, row in cell["policies"].items():
                c = row["curve"]
                ax.plot(c["rates"], c["mean"], marker=".", color=COLORS[policy], label=LABELS[policy])
                ax.fill_between(c["rates"], c["min"], c["max"], color=COLORS[policy], alpha=0.2)
                if row["sustainable"]["rate"]:
                    ax.axvline(row["sustainable"]["rate"], color=COLORS[policy], linestyle=":", linewidth=1)
            ax.axhline(cell["bound"], color="grey", linestyle="--", label="bound")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_title(f"{MIXES[mix]['label']}, {prof} step costs", fontsize=9)
            ax.set_xlabel("request rate (req/s)")
            ax.set_ylabel("mean normalized latency (s/token)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"simulated: {results['setup']['pool']}, {results['plan']['requests']} requests a point, "
                 f"{len(results['plan']['seeds'])} seeds (band: min-max)", fontsize=9)  # fmt: skip
    fig.tight_layout()
    names = [f"simulated_latency{tag}.png", f"simulated_breakdown{tag}.png"]
    fig.savefig(folder / names[0], dpi=110)
    plt.close(fig)
    fig, axes = plt.subplots(1, 1 + len(PROFILES), figsize=(12, 4.2), sharey=True)
    order = ("max", "pow2", "oracle", "on_demand")
    segments = ("token states", "reservation", "internal frag. (past the length)", "internal frag. (buddy rounding)",
                "external frag.", "other free")  # fmt: skip
    paper = {p: [PAPER_FIG2[p][0], PAPER_FIG2[p][1], PAPER_FIG2[p][2], None, PAPER_FIG2[p][3], None] for p in order}
    panels = [("the paper, Fig. 2 (OPT-13B, section 6.2; red: external frag. & others)", paper)]
    for prof in PROFILES:
        bars = {}
        for p in order:
            b = (cells[f"{prof}/sharegpt"]["policies"][p]["breakdown"] or {}).get("shares")
            rounding = b["internal_of_which_buddy_rounding"] if b else 0
            bars[p] = [100 * x for x in (b["token_states"], b["reservation"], b["internal_fragmentation"] - rounding,
                                         rounding, b["external_fragmentation"], b["other_free"])] if b else [None] * 6  # fmt: skip
        panels.append((f"simulated, ShareGPT-like, {prof} step costs", bars))
    for ax, (title, bars) in zip(axes, panels, strict=True):
        bottom = [0.0] * len(order)
        for k, (name, color) in enumerate(zip(segments, ("tab:blue", "tab:orange", "tab:green", "tab:green", "tab:red",
                                                         "tab:purple"), strict=True)):  # fmt: skip
            heights = [bars[p][k] or 0 for p in order]
            ax.bar([LABELS[p] for p in order], heights, bottom=bottom, label=name, color=color,
                   hatch="//" if "buddy" in name else None, edgecolor="white")  # fmt: skip
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
        ax.set_title(title, fontsize=8)
        ax.tick_params(axis="x", labelsize=7)
    axes[0].set_ylabel("% of KV memory")
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(folder / names[1], dpi=110)
    plt.close(fig)
    return names


def headline(results: dict) -> str:
    """The printed tables (``make numbers`` writes them into the L3 chapter and the README): per profile
    and dataset, each policy's sustainable rate and paging's ratios beside the paper's; and the memory
    breakdown of each policy beside the paper's Fig. 2."""

    def fmt(x, spec=".3g"):
        return "-" if x is None else format(x, spec)

    def ratio(r):
        spread = f" ({fmt(r['seed_range'][0], '.2f')}-{fmt(r['seed_range'][1], '.2f')})" if r["seed_range"] else ""
        return f"{fmt(r['ratio'], '.2f')}x{spread}"

    paper = {"sharegpt": "1.7x-2.7x, 2.7x-8x (section 6.2, OPT-13B to 175B)",
             "alpaca": "1.3x over Oracle (section 6.3, OPT-13B); no Max ratio stated"}  # fmt: skip
    lines = ["| profile | dataset | paged | Oracle | Pow2 | Max | paged/Oracle (seeds) | paged/Pow2 | paged/Max (seeds) "
             "| the paper: paged/Oracle, paged/Max |", "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for key, cell in results["cells"].items():
        profile, dataset = key.split("/")
        rates = [cell["policies"][p]["sustainable"]["rate"] for p in ("on_demand", "oracle", "pow2", "max")]
        rs = cell["ratios"]
        lines.append(f"| {profile} | {dataset} | " + " | ".join(f"{fmt(r)} req/s" for r in rates) + " | "
                     + " | ".join(ratio(rs[f"on_demand/{o}"]) for o in ("oracle", "pow2", "max"))
                     + f" | {paper[dataset]} |")  # fmt: skip
    lines += ["", "| profile / dataset | policy | at (req/s) | token states | reservation | internal frag. (of it, "
              "buddy rounding) | external frag. | other free | the paper's Fig. 2 |",
              "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for key, cell in results["cells"].items():
        for policy, row in cell["policies"].items():
            b = (row["breakdown"] or {}).get("shares")
            if not b:
                continue
            fig2 = " / ".join("-" if v is None else f"{v}%" for v in PAPER_FIG2[policy])
            lines.append(f"| {key} | {LABELS[policy]} | {row['breakdown']['rate']:.3g} | "
                         + " | ".join(f"{100 * b[k]:.1f}%" for k in SHARES[:2])
                         + f" | {100 * b['internal_fragmentation']:.1f}% ({100 * b['internal_of_which_buddy_rounding']:.1f}%) | "
                         + " | ".join(f"{100 * b[k]:.1f}%" for k in SHARES[3:]) + f" | {fig2} |")  # fmt: skip
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.simulate", description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--calibrate", action="store_true", help="time real L3 steps here and fit the CPU profile")
    mode.add_argument("--gpu-profile", action="store_true", help="write the GPU profile from committed GPU runs")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (for tests); writes only where --out says")
    parser.add_argument("--model", help="--calibrate: model directory (default: the course model)")
    parser.add_argument("--out", help="--calibrate, --gpu-profile: the JSON file; the experiment: its results folder")
    parser.add_argument("--profiles", default=str(ROOT / "results"), help="folder of step-cost-{cpu,gpu}.json")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="processes for the runs")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    command = "python -m bench.simulate" + "".join(
        f" {flag}" for flag, on in (("--calibrate", args.calibrate), ("--gpu-profile", args.gpu_profile),
                                    ("--quick", args.quick)) if on)  # fmt: skip
    if args.calibrate:
        torch.set_num_threads(max(1, os.cpu_count() or 1))
        if args.quick and not args.model:
            from kvcourse.harness.tiny import make_tiny_checkpoint

            model_dir = make_tiny_checkpoint("llama", tempfile.mkdtemp(prefix="kvcourse-calibrate-"))
        else:
            from kvcourse.model_store import resolve_model_dir

            model_dir = resolve_model_dir(args.model)
        record = calibrate(model_dir, CALIBRATION["quick" if args.quick else "full"], command)
        for s in record["samples"]:
            print(f"{s['name']:40s} {1e3 * s['seconds']:9.1f} ms  model {1e3 * s['predicted']:9.1f} ms")
        print(f"fit: {record['coefficients']}; R^2 {record['fit']['r2']:.4f}, mean relative error "
              f"{100 * record['fit']['mean_relative_error']:.1f}%, largest {100 * record['fit']['max_relative_error']:.1f}%")  # fmt: skip
        save_results(record, args.out, "step-cost-cpu.json", args.quick)
        return 0
    if args.gpu_profile:
        record = gpu_profile(command)
        print(json.dumps(record["derivation"], indent=1))
        print(f"coefficients {record['coefficients']}; (b) predicted {record['check']['predicted_b_seconds']:.3f} s, "
              f"measured {record['check']['measured_b_seconds']}")  # fmt: skip
        save_results(record, args.out, "step-cost-gpu.json", False)
        return 0
    began = time.time()
    name = "quick" if args.quick else "full"
    plan = PLANS[name]
    paths = {p: Path(args.profiles) / f"step-cost-{p}.json" for p in PROFILES}
    missing = [str(path) for path in paths.values() if not path.exists()]
    if missing:
        print(f"error: no step-cost profile {', '.join(missing)}: write it with python -m bench.simulate "
              "--calibrate (cpu) or --gpu-profile (gpu)", file=sys.stderr)  # fmt: skip
        return 2
    profiles = {p: StepCost.load(path).as_json() for p, path in paths.items()}
    cells = experiment(plan, profiles, args.jobs)
    tag = "_quick" if args.quick else ""
    results = {
        "command": command,
        **provenance(),
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "python": platform.python_version(), "jobs": args.jobs},
        "setup": {"pool": f"{plan['num_blocks']} blocks of {PAPER['block_size']} ({plan['num_blocks'] * PAPER['block_size']:,} positions)",
                  "paper": PAPER, "config": {k: v for k, v in vars(paper_config("on_demand")).items() if k != "sizing"}
                  | {"num_blocks": plan["num_blocks"]},
                  "streams": {m: {"label": MIXES[m]["label"], **MIXES[m], "scale": plan["scale"],
                                  **describe(list(stream(m, plan["seeds"][0], plan["requests"], plan["scale"])))}
                              for m in DATASETS},
                  "profiles": profiles},  # fmt: skip
        "plan": plan,
        "method": __doc__.split("**The experiment**")[1].split("Results:")[0].strip(),
        "paper": {"fig2": PAPER_FIG2, "ratios": PAPER_RATIOS},
        "cells": cells,
    }
    results["seconds"] = time.time() - began
    out = Path(args.out) if args.out else ROOT / "results"
    results["plots"] = plots(results, tag, out.parent / "plots")
    print(headline(results))
    if args.out or not args.quick:
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"simulated{tag}.json"
        path.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {path} in {results['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
