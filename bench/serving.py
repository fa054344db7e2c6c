"""Serving at a fixed KV memory in real time, at this course's scale, beside the simulated clock.

    python -m bench.serving [--quick | --plan NAME] [--out DIR] [--model DIR] [--profile FILE]

One command (part of ``make bench``), on the CPU, SmolLM2-135M-Instruct in fp32. Every system serves
request streams (``kvcourse.harness.stream``: Poisson arrivals from a seed, lengths from the synthetic
Alpaca-like mix with the paper's means, or a quarter of them with ``--quick``) in real time at the
same KV pool size, and every output is checked against HF greedy one request at a time (eos
disabled, as ``ignore_eos``; ``bench.systems.hf_batch1``), with the course's tie rule.

- (a) the real engine against the simulator: L3 under the plan's admission policies (paging on
  demand, and of the paper's Orca baselines on a buddy allocator, ``kvcourse.orca``, Oracle and Max:
  Pow2 lies between them and is simulated only, for time) serves the plan's streams (two seeds, 64
  Alpaca-like requests at half the paper's means) at three rates around that policy's knee **as the
  simulator predicts it**
  (``kvcourse.harness.simulate`` with the CPU cost profile ``bench/results/step-cost-cpu.json`` that
  ``python -m bench.simulate --calibrate`` measured, the engine's own config, the same requests);
  each run records the measured mean normalized latency beside the simulator's prediction for the
  same stream (with that profile, with a ``StepCost`` fitted to the other seed's runs, ``heldout``, and
  with one fitted to the run's own steps, ``in_sample``, which keeps the machine's drift out), its
  steps, the share of CPU time stolen from this VM during it (``stolen``; a run that lost more than
  ``STEAL_LIMIT`` runs again, up to the plan's ``retries`` times, and the least-stolen try is kept),
  its memory breakdown (the paper's Fig. 2) and its outputs' agreement with HF; the
  simulated curve of every policy over many rates is drawn beside the measured points. The knee is
  where the simulated seed-mean latency crosses ``SHORT_BOUND_FACTOR`` times on demand's unloaded
  latency, found by linear interpolation (``bench.simulate.crossing``);
- (b) peers on one stream at one rate: HF ``generate`` in static batches (collect what has
  arrived, left-pad, run to the longest max_new_tokens; a batch only as large as the pool holds at the
  longest length, as a server reserving per request must; its tokens come back when the batch ends,
  so its TTFT is the batch's end), transformers' continuous batching (``ContinuousBatchingManager``,
  ``add_request`` + ``get_result`` with streaming, its paged cache given the pool's blocks), and
  L3, L4 and L5 (paged); L6 is left out: it has no ``add_request`` + ``step`` to feed in real time;
- (c) chunked prefill's payoff: short requests decoding while long prompts arrive; the running
  requests' inter-token gaps (p50, p99) and the long prompts' TTFT, without chunking and for a few
  chunk sizes (L3, on demand);
- (d) the engine against itself (``--plan repeats``, a command of its own: (a) alone, 27 runs, 47
  minutes in the committed run): the profile is calibrated first, in the same process (``bench.simulate.calibrate``,
  the ``--calibrate`` design), then each stream of (a) is served three times, minutes apart. Run to
  run, the same requests on the same engine take more or less time as the VM's speed moves, and near
  the knee queueing turns a slower step into a longer wait; the repeats measure how close one run
  comes to another, the floor under any prediction's error. ``repeats_table`` sets the simulator against one run, against
  the repeats' mean, and each run against the other repeats.

Timing is noisy: this VM has 2 cores shared with other work; the JSON records ``os.getloadavg()``
before and after each part. Writes ``bench/results/serving[_<plan>].json`` and
``bench/plots/serving_*.png``; ``table`` prints (a)'s, (b)'s and (c)'s tables from the JSON, and
``repeats_table`` (d)'s (``make numbers`` writes them into the L3 chapter).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from bench.measure import agreement, cpu_name, cpu_ticks, package_version, provenance, stolen
from bench.simulate import CALIBRATION, calibrate, crossing
from bench.systems import fixed_length_model, hf_batch1
from kvcourse.config import ModelConfig
from kvcourse.harness.reference import Reference
from kvcourse.harness.serving import Timeline, request_metrics, serve, summary
from kvcourse.harness.simulate import StepCost, simulate, step_features
from kvcourse.harness.stream import MIXES, Request, at_rate, describe, synthetic_stream
from kvcourse.model_store import resolve_model_dir
from kvcourse.orca import ADMISSION_POLICIES
from L3_block_tensor.engine import Engine as L3Engine
from L4_paged_kernel.engine import Engine as L4Engine
from L5_clones.engine import Engine as L5Engine

ROOT = Path(__file__).resolve().parent
BLOCK = 16
PLANS = {  # sizes: what --quick runs, and what the full run does
    "full": {"n": 64, "seeds": [35, 36], "scale": 0.5, "max_len": 128, "blocks": 24, "around": [0.7, 1.0, 1.3],
             "policies": ["on_demand", "oracle", "max"], "peer_n": 16, "peer_rate": 1.0, "chunks": [None, 32, 64, 128], "short": 4, "short_new": 96,
             "long": 3, "long_prompt": 768, "retries": 2},
    "quick": {"n": 8, "seeds": [35], "scale": 0.25, "max_len": 128, "blocks": 24, "around": [0.7, 1.3],
              "policies": ["on_demand", "max"],
              "peer_n": 5, "peer_rate": 2.0, "chunks": [None, 32], "short": 3, "short_new": 32, "long": 2,
              "long_prompt": 256, "retries": 1},
    "tiny": {"n": 4, "seeds": [35, 36], "scale": 0.1, "max_len": 64, "blocks": 12, "around": [1.0],
             "policies": list(ADMISSION_POLICIES),
             "peer_n": 4, "peer_rate": 2.0, "chunks": [None, 16], "short": 2, "short_new": 16, "long": 1,
             "long_prompt": 40, "retries": 0},  # tests only
    # (d) the engine against itself: every stream served three times, minutes apart, and priced by a
    # profile calibrated at the start of the same command; no peers, no chunked prefill
    "repeats": {"n": 64, "seeds": [36], "scale": 0.5, "max_len": 128, "blocks": 24, "around": [0.7, 1.0, 1.3],
                "policies": ["on_demand", "oracle", "max"], "repeats": 3, "calibrate": "full", "retries": 2},
    "tiny-repeats": {"n": 4, "seeds": [36], "scale": 0.1, "max_len": 64, "blocks": 12, "around": [1.0],
                     "policies": ["on_demand", "max"], "repeats": 2, "calibrate": "quick", "retries": 0},  # tests only
}  # fmt: skip
SEED = 35
PROFILE = ROOT / "results" / "step-cost-cpu.json"  # the CPU's step costs, from bench.simulate --calibrate
GRID = [0.02 * 1.08**k for k in range(90)]  # simulated rates, 0.02 to about 18 req/s, 8% apart
# The knee of a short stream: its latency can grow only until its last request has arrived, so its curve
# flattens well below bench.simulate's bound for 1,000 requests (BOUND_FACTOR x unloaded); here 4 x.
SHORT_BOUND_FACTOR = 4
# A run the hypervisor took more than STEAL_LIMIT of the CPU from measures the neighbours, not the engine:
# it runs again, up to the plan's "retries" more times, and the least-stolen try is kept (every try's
# steal is recorded, "tries_steal").
STEAL_LIMIT = 0.03


def load() -> list[float]:
    return list(os.getloadavg())


def checked(outputs: list[list[int]], refs: list[Reference]) -> dict:
    return agreement(outputs, refs)


def pool_bytes(model_dir, plan) -> int:
    """The plan's KV pool in bytes: its blocks of 16 tokens, at the model's bytes a token (SmolLM2-135M
    in fp32: 2 x 3 x 64 x 30 x 4 = 46,080; the engines' set-up line shows the sum)."""
    return plan["blocks"] * BLOCK * ModelConfig.from_dir(model_dir).kv_bytes_per_token()


def engine(cls, model_dir, plan, **options):
    options = {
        "block_size": BLOCK,
        "kv_cache_bytes": pool_bytes(model_dir, plan),
        "max_model_len": plan["max_len"],
        **options,
    }
    if cls is not L3Engine:
        options["kernel"] = "cpp"
    return cls(model_dir, **options)


def run_engine(eng, requests: list[Request], refs) -> dict:
    eng.generate([r.prompt_ids for r in requests[:4]], 4, ignore_eos=True)  # warm-up, untimed
    timeline = serve(eng, requests)
    return result(timeline, refs, eng.stats().describe())


def timed_serve(eng, requests: list[Request]) -> tuple[Timeline, list[dict]]:
    """``serve`` the requests, keeping each step's shape (``step_features`` of the batch the scheduler
    planned) beside its measured seconds: the samples ``StepCost.fit`` takes. The scheduler's
    ``schedule`` is wrapped for the run and put back after."""
    samples, plan = [], eng.scheduler.schedule

    def schedule():
        batch = plan()
        samples.append(dict(zip(("tokens", "seqs", "context"), step_features(batch), strict=True)))
        return batch

    eng.scheduler.schedule = schedule
    try:
        timeline = serve(eng, requests)
    finally:
        del eng.scheduler.schedule  # the class's method again
    for sample, step in zip(samples, timeline.steps, strict=True):
        sample["seconds"] = step["dt"]
    return timeline, [x for x in samples if x["seqs"]]


def quiet_serve(eng, requests: list[Request], retries: int) -> tuple[float, Timeline, list[dict], list[float]]:
    """``timed_serve``, again while the hypervisor stole more than ``STEAL_LIMIT`` of the CPU time (at most
    ``retries`` more times): the least-stolen try's (steal, timeline, steps), and every try's steal.
    Example: tries stolen 8.5% then 0.4% -> the second, and [0.085, 0.004]."""
    tries = []  # (steal, timeline, steps); a steal of 0 where /proc/stat is missing (not Linux)
    while not tries or (min(t[0] for t in tries) > STEAL_LIMIT and len(tries) <= retries):
        ticks = cpu_ticks()
        timeline, steps = timed_serve(eng, requests)
        tries.append((stolen(ticks, cpu_ticks()) or 0.0, timeline, steps))
    steal, timeline, steps = min(tries, key=lambda t: t[0])
    return steal, timeline, steps, [t[0] for t in tries]


def heldout(served: list[tuple], engines: dict) -> dict:
    """The simulator again, its step costs fitted to the real runs' own steps: for each seed, a
    ``StepCost`` fitted to the steps of the other seeds' runs (this machine, this load, this hour)
    predicts this seed's runs; each row gets ``heldout`` beside ``predicted``. One seed alone: nothing."""
    seeds = sorted({seed for _, seed, *_ in served})
    fits = {}
    for seed in seeds if len(seeds) > 1 else []:
        train = [x for _, s, _, _, steps in served if s != seed for x in steps]
        test = [x for _, s, _, _, steps in served if s == seed for x in steps]
        cost = StepCost.fit(train)
        fits[str(seed)] = {"coefficients": cost.as_json(), "fitted_on": len(train), "fit": cost.quality(train),
                           "on_this_seed": cost.quality(test)}  # fmt: skip
        for policy, s, row, reqs, _ in served:
            if s == seed:
                predicted = simulated(reqs, engines[policy].config, cost)["mean_normalized_latency"]
                measured = row["summary"]["mean_normalized_latency"]
                row["heldout"] = {"mean_normalized_latency": predicted, "simulated_over_measured": predicted / measured}
    return fits


def in_sample(reqs: list[Request], config, steps: list[dict], measured: float) -> dict:
    """The simulator with a ``StepCost`` fitted to this run's own steps, two ways: ``fit`` as
    ``StepCost.fit`` weighs them (the error relative to the model's prediction) and
    ``measured_relative`` (relative to the measured time: its first round alone). Each gives its
    predicted total over the measured total of the steps, and its simulated latency over the measured
    one: what the model's shape and the fit's weighting cost, with the machine's drift between a
    calibration and the run taken out."""
    out = {}
    for name, options in (("fit", {}), ("measured_relative", {"rounds": 1})):
        cost = StepCost.fit(steps, **options)
        latency = simulated(reqs, config, cost)["mean_normalized_latency"]
        out[name] = {"total_ratio": cost.quality(steps)["total_ratio"], "simulated_over_measured": latency / measured}
    return out


def at_speed(reqs: list[Request], config, steps: list[dict], measured: float, cost: StepCost) -> dict:
    """The simulator with ``cost`` scaled to the machine's speed during this run: by ``speed``, the run's
    measured step time over what ``cost`` prices its steps at (one number a run; 1.1: the machine ran 10%
    slower than when ``cost`` was measured). The shape stays the profile's; only the speed is the run's.
    Example: steps priced at 9 s that took 10 s -> ``cost.scaled(10 / 9)``."""
    speed = sum(x["seconds"] for x in steps) / sum(cost.predict(x["tokens"], x["seqs"], x["context"]) for x in steps)
    latency = simulated(reqs, config, cost.scaled(speed))["mean_normalized_latency"]
    return {"speed": speed, "simulated_over_measured": latency / measured}


def rescore(path: Path, model_dir) -> dict:
    """``at_speed`` for every real run of a results file written before it existed: each run's requests
    drawn again from the plan's seeds and the run's rate (checked: the simulator's prediction for them is
    the one the file holds) and its recorded steps. Adds ``in_sample.at_speed`` to each run and
    ``rescored`` (command, commit, date) to the file; nothing measured changes."""
    results = json.loads(path.read_text(encoding="utf-8"))
    plan, cost = results["plan"], StepCost.from_json(results["cost_profile"])
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    config = engine(L3Engine, model_dir, plan).config
    for policy, rows in results["policies"].items():
        for row in rows:
            base = synthetic_stream("alpaca", plan["n"], 1.0, row["seed"], vocab_size=vocab,
                                    max_model_len=plan["max_len"], scale=plan["scale"])  # fmt: skip
            reqs = at_rate(base, row["rate"], row["seed"] + 1)
            policy_config = replace(config, admission_policy=policy)
            again = simulated(reqs, policy_config, cost)["mean_normalized_latency"]
            if again != row["predicted"]["mean_normalized_latency"]:
                raise SystemExit(f"{path}: the requests of {policy}, seed {row['seed']}, {row['rate']:.3f} req/s do not "
                                 f"draw again as they were run (simulated {again}, recorded {row['predicted']['mean_normalized_latency']})")  # fmt: skip
            steps = [dict(zip(("tokens", "seqs", "context", "seconds"), x, strict=True)) for x in row["steps"]]
            measured = row["summary"]["mean_normalized_latency"]
            row["in_sample"]["at_speed"] = at_speed(reqs, policy_config, steps, measured, cost)
    results["rescored"] = {"command": f"python -m bench.serving --rescore {path}", **provenance()}
    return results


def result(timeline: Timeline, refs, setup: str) -> dict:
    return {
        "setup": setup,
        "summary": summary(timeline),
        "requests": request_metrics(timeline),
        "kv_over_time": timeline.steps[:: max(1, len(timeline.steps) // 200)],
        "agreement": checked(timeline.outputs, refs),
    }


def hf_static(model_dir, requests: list[Request], refs, pool_positions: int) -> dict:
    """HF generate in static batches: when idle, take what has arrived (in order, as many as the
    pool holds at the batch's longest length), left-pad, run to the longest max_new_tokens."""
    model = fixed_length_model(model_dir)
    timeline, start, i = Timeline.empty(requests), time.perf_counter(), 0
    while i < len(requests):
        now = time.perf_counter() - start
        if requests[i].arrival > now:
            time.sleep(requests[i].arrival - now)
            continue
        batch = [i]
        while i + len(batch) < len(requests) and requests[i + len(batch)].arrival <= now:
            nxt = batch + [i + len(batch)]
            width = max(len(requests[j].prompt_ids) for j in nxt) + max(
                requests[j].max_new_tokens for j in nxt
            )
            if len(nxt) * width > pool_positions:
                break
            batch = nxt
        prompts = [requests[j].prompt_ids for j in batch]
        width, longest = max(map(len, prompts)), max(requests[j].max_new_tokens for j in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # (B, W)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])  # (B, W)
        with torch.inference_mode():
            out = model.generate(
                ids, attention_mask=mask, max_new_tokens=longest, do_sample=False, pad_token_id=0
            )
        done = time.perf_counter() - start
        for row, j in enumerate(batch):
            timeline.tokens(j, out[row, width : width + requests[j].max_new_tokens].tolist(), done)
        i += len(batch)
    timeline.end = time.perf_counter() - start
    return result(timeline, refs, f"HF generate, static batches of at most {pool_positions} positions")


def hf_continuous(model_dir, requests: list[Request], refs, num_blocks: int) -> dict:
    """transformers' continuous batching manager, fed in real time, streaming its tokens back."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = fixed_length_model(model_dir)
    config = GenerationConfig(do_sample=False, max_new_tokens=max(r.max_new_tokens for r in requests),
                              eos_token_id=-1, pad_token_id=0)  # fmt: skip
    sizing = ContinuousBatchingConfig(page_size=BLOCK, num_blocks=num_blocks, max_batch_tokens=256)
    timeline = Timeline.empty(requests)
    with model.continuous_batching_context_manager(
        generation_config=config, continuous_batching_config=sizing, warmup=False
    ) as manager:
        start, ids, finished = time.perf_counter(), {}, set()
        while len(finished) < len(requests):
            now = time.perf_counter() - start
            while len(ids) < len(requests) and requests[len(ids)].arrival <= now:
                r = requests[len(ids)]
                ids[manager.add_request(r.prompt_ids, max_new_tokens=r.max_new_tokens, streaming=True)] = len(
                    ids
                )
            out = manager.get_result(timeout=0.01)
            if out is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching stopped before finishing")
                continue
            if out.error is not None:
                raise RuntimeError(f"transformers' continuous batching failed: {out.error}")
            j = ids[out.request_id]
            timeline.tokens(j, list(out.generated_tokens), time.perf_counter() - start)
            if out.is_finished():
                finished.add(j)
        timeline.end = time.perf_counter() - start
    return result(timeline, refs, f"transformers {package_version('transformers')} continuous batching, "
                  f"{num_blocks} pages of {BLOCK}")  # fmt: skip


def simulated(reqs: list[Request], config, cost: StepCost) -> dict:
    """The simulator's summary of ``reqs`` served under ``config`` (no per-request rows)."""
    return summary(simulate(reqs, config, cost))


def knees(streams: dict[int, list[Request]], configs: dict, cost: StepCost) -> dict:
    """Per policy, the simulated curve over ``GRID`` (seed-mean normalized latency) and its knee: the rate
    where it crosses the bound, ``SHORT_BOUND_FACTOR`` x on demand's latency with requests alone (0.02
    req/s apart, the grid's first rate), by linear interpolation. Runs in seconds: no model compute."""
    unloaded = statistics.fmean(
        simulated(at_rate(reqs, GRID[0], seed + 1), configs["on_demand"], cost)["mean_normalized_latency"]
        for seed, reqs in streams.items()
    )
    bound = SHORT_BOUND_FACTOR * unloaded
    out = {"unloaded": unloaded, "bound": bound, "bound_rule": f"{SHORT_BOUND_FACTOR} x on demand's unloaded latency",
           "policies": {}}  # fmt: skip
    for policy, config in configs.items():
        rates, means = [], []
        for rate in GRID:  # up the grid until the curve is well past the bound
            latencies = [simulated(at_rate(reqs, rate, seed + 1), config, cost)["mean_normalized_latency"]
                         for seed, reqs in streams.items()]  # fmt: skip
            rates.append(rate)
            means.append(statistics.fmean(latencies))
            if means[-1] > 3 * bound:
                break
        knee = crossing(rates, means, bound)
        # no crossing in the grid (a stream too short to queue): the runs go where the grid ended
        out["policies"][policy] = {"rates": rates, "mean": means, "knee": knee, "center": knee or rates[-1]}
    return out


def chunk_stream(plan, vocab: int) -> list[Request]:
    """Short requests decoding from t=0, and long prompts (8 new tokens each) arriving among them."""
    import random

    rng = random.Random(SEED)
    reqs = [
        Request(0.0, [rng.randrange(3, vocab) for _ in range(16)], plan["short_new"])
        for _ in range(plan["short"])
    ]
    for k in range(plan["long"]):
        reqs.append(Request(2.0 + 3.0 * k, [rng.randrange(3, vocab) for _ in range(plan["long_prompt"])], 8))
    return reqs


def chunked(model_dir, plan, vocab: int, refs_of) -> dict:
    reqs = chunk_stream(plan, vocab)
    refs = refs_of(reqs)
    rows = {}
    for chunk in plan["chunks"]:
        per_token = ModelConfig.from_dir(model_dir).kv_bytes_per_token()
        options = {"max_model_len": 1024, "kv_cache_bytes": 256 * BLOCK * per_token}
        if chunk:
            options |= {"prefill_chunk_size": chunk, "max_num_batched_tokens": chunk + plan["short"]}
        eng = L3Engine(model_dir, block_size=BLOCK, **options)
        eng.generate([reqs[0].prompt_ids], [2], ignore_eos=True)
        timeline = serve(eng, reqs)
        short = range(plan["short"])
        gaps = [g for i in short for g in timeline.gaps(i)]
        long_ttft = [timeline.first_token[i] - timeline.arrivals[i] for i in range(plan["short"], len(reqs))]
        from kvcourse.harness.serving import percentile

        rows[str(chunk)] = {
            "running_gap_p50": percentile(gaps, 50),
            "running_gap_p99": percentile(gaps, 99),
            "running_gap_max": max(gaps),
            "long_ttft_mean": sum(long_ttft) / len(long_ttft),
            "long_ttft": long_ttft,
            "agreement": checked(timeline.outputs, refs),
            "load": load(),
        }
    return {"stream": describe(reqs), "by_chunk": rows}


LABELS = {"on_demand": "paged (vLLM)", "oracle": "Orca (Oracle)", "pow2": "Orca (Pow2)", "max": "Orca (Max)"}
SHARES = ("token_states", "reservation", "internal_fragmentation", "external_fragmentation", "other_free")


def plots(results: dict, tag: str, folder: Path) -> list[str]:
    """``serving_policies``: per policy, the simulated latency curve and the measured runs (one marker per
    seed) against the rate, and the measured memory breakdown at the knee; ``serving_chunked_prefill``."""
    import matplotlib.pyplot as plt

    out = []
    sim = results["simulated"]
    fig, ax = plt.subplots(1, 2, figsize=(11, 3.8))
    for k, (policy, curve) in enumerate(sim["policies"].items()):
        color = f"C{k}"
        ax[0].plot(curve["rates"], curve["mean"], color=color, label=f"{LABELS[policy]}, simulated")
        runs = results["policies"].get(policy, [])
        if runs:
            ax[0].scatter([r["rate"] for r in runs], [r["summary"]["mean_normalized_latency"] for r in runs],
                          color=color, marker="o", s=22, label=f"{LABELS[policy]}, measured")  # fmt: skip
    ax[0].axhline(sim["bound"], color="grey", linestyle=":", label="bound")
    top = max(r["rate"] for runs in results["policies"].values() for r in runs)
    ax[0].set_xlim(0, 1.6 * top)
    ax[0].set_ylim(0.5 * sim["unloaded"], 4 * sim["bound"])
    ax[0].set_xlabel("request rate (req/s)")
    ax[0].set_ylabel("mean normalized latency (s/token)")
    ax[0].set_yscale("log")
    ax[0].legend(fontsize=6, ncol=2)
    names = list(results["policies"])
    bottom = [0.0] * len(names)
    for share in SHARES:
        values = []
        for policy in names:
            parts = [r["summary"]["memory_breakdown"] for r in results["policies"][policy]
                     if r["factor"] == 1.0 and r["summary"]["memory_breakdown"]]  # fmt: skip
            values.append(100 * statistics.fmean(p[share] for p in parts) if parts else 0.0)
        ax[1].bar([LABELS[p] for p in names], values, bottom=bottom, label=share.replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax[1].set_ylabel("% of the KV pool, while a request waits")
    ax[1].tick_params(axis="x", labelsize=7)
    ax[1].legend(fontsize=6)
    fig.suptitle(f"L3 at a {results['kv_cache_bytes'] / 2**20:.1f} MiB KV pool, "
                 f"{next(iter(results['streams'].values()))['label']}, {results['plan']['n']} requests a run", fontsize=9)  # fmt: skip
    fig.tight_layout()
    path = folder / f"serving_policies{tag}.png"
    folder.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    out.append(path.name)
    plt.close(fig)
    if "chunked_prefill" not in results:  # a repeats plan
        return out
    rows = results["chunked_prefill"]["by_chunk"]
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for key, row in rows.items():
        ax.scatter(row["long_ttft_mean"], row["running_gap_p99"], s=40)
        ax.annotate("no chunking" if key == "None" else f"chunk {key}", (row["long_ttft_mean"], row["running_gap_p99"]),
                    fontsize=8)  # fmt: skip
    ax.set_xlabel("long prompts' mean TTFT (s)")
    ax.set_ylabel("running requests' p99 inter-token gap (s)")
    fig.tight_layout()
    path = folder / f"serving_chunked_prefill{tag}.png"
    fig.savefig(path, dpi=110)
    out.append(path.name)
    plt.close(fig)
    return out


def table(results: dict) -> str:
    """The three tables of a run: (a) per policy and rate, measured against simulated latency and the
    memory breakdown; (b) the peers; (c) chunked prefill."""

    def pct(x):
        return "-" if x is None else f"{100 * x:.1f}%"

    sim = results["simulated"]
    lines = ["| admission policy | simulated knee (req/s) | rate (req/s) | measured (s/token, per seed) | "
             "simulated (s/token, per seed) | simulated / measured | held-out fit / measured | own steps' fit / measured | "
             "run time, simulated / measured | CPU stolen | token states | reservation | "
             "internal frag. | external frag. | other free | outputs = HF |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for policy, runs in results["policies"].items():
        knee = sim["policies"][policy]["knee"]
        knee = "none in the grid" if knee is None else f"{knee:.2f}"
        for factor in sorted({r["factor"] for r in runs}):
            rows = [r for r in runs if r["factor"] == factor]
            measured = " / ".join(f"{r['summary']['mean_normalized_latency']:.3f}" for r in rows)
            predicted = " / ".join(f"{r['predicted']['mean_normalized_latency']:.3f}" for r in rows)
            errors = " / ".join(f"{r['simulated_over_measured']:.2f}" for r in rows)
            held = " / ".join(f"{r['heldout']['simulated_over_measured']:.2f}" for r in rows if "heldout" in r) or "-"
            span = " / ".join(f"{r['predicted']['duration_s'] / r['summary']['duration_s']:.2f}" for r in rows)
            steal = " / ".join(pct(r.get("steal")) + (f" ({len(r['tries_steal'])} tries)" if len(r.get("tries_steal", [])) > 1 else "")
                               for r in rows)  # fmt: skip
            own = " / ".join(f"{r['in_sample']['fit']['simulated_over_measured']:.2f}" for r in rows if "in_sample" in r) or "-"
            parts = [r["summary"]["memory_breakdown"] for r in rows if r["summary"]["memory_breakdown"]]
            shares = [pct(statistics.fmean(p[k] for p in parts)) if parts else "-" for k in SHARES]
            match = sum(r["agreement"]["match"] for r in rows)
            total = sum(r["summary"]["requests"] for r in rows)
            lines.append(f"| {LABELS[policy]} | {knee} | {factor:.1f} x = {rows[0]['rate']:.2f} | {measured} | "
                         f"{predicted} | {errors} | {held} | {own} | {span} | {steal} | " + " | ".join(shares) + f" | {match}/{total} |")  # fmt: skip
    runs = [r for rows in results["policies"].values() for r in rows]
    errors = [[abs(ratio(r) - 1) for r in runs if ratio(r) is not None] for ratio in (
        lambda r: r["simulated_over_measured"],
        lambda r: r["heldout"]["simulated_over_measured"] if "heldout" in r else None,
        lambda r: r["in_sample"]["fit"]["simulated_over_measured"] if "in_sample" in r else None)]
    lines.append("| runs within 10% of the measured latency | | | | | "
                 + " | ".join(f"{sum(e <= 0.1 for e in k)} of {len(k)}" if k else "-" for k in errors) + " |" + " |" * 8)
    lines.append("| mean error of the simulated latency (largest) | | | | | "
                 + " | ".join(f"{pct(statistics.fmean(k))} ({pct(max(k))})" if k else "-" for k in errors) + " |" + " |" * 8)
    lines += ["", "| system | mean normalized latency (s/token) | TTFT p50 (s) | TPOT p50 (s) | output tokens/s | "
              "outputs = HF |", "|---|---|---|---|---|---|"]  # fmt: skip
    for peer, row in results["peers"].items():
        if peer == "rate":
            continue
        s = row.get("summary")
        if not s:
            lines.append(f"| {peer} | {row['error']} | | | | |")
            continue
        tpot = "(not streamed)" if peer == "HF static batches" else f"{s['tpot_p50']:.3f}"
        lines.append(f"| {peer} | {s['mean_normalized_latency']:.3f} | {s['ttft_p50']:.2f} | {tpot} | "
                     f"{s['output_tokens_per_s']:.1f} | {row['agreement']['match']}/{s['requests']} |")  # fmt: skip
    lines += ["", "| prefill | running requests' inter-token gap p50 (s) | p99 (s) | long prompts' mean TTFT (s) | "
              "outputs = HF |", "|---|---|---|---|---|"]  # fmt: skip
    for key, row in results["chunked_prefill"]["by_chunk"].items():
        label = "whole prompt in one step" if key == "None" else f"chunks of {key}"
        agree = row["agreement"]
        lines.append(f"| {label} | {row['running_gap_p50']:.3f} | {row['running_gap_p99']:.3f} | "
                     f"{row['long_ttft_mean']:.2f} | {agree['match']}/{agree['match'] + len(agree['hf_gaps'])} |")  # fmt: skip
    return "\n".join(lines)


def repeats_table(results: dict) -> str:
    """(d), a repeats plan's table: per policy and rate, each repeat's measured latency beside the
    simulator's (one number: the same requests, the same profile), and how far apart the repeats are;
    then, per repeat, what the profile prices that run's own steps at against their measured time (the
    machine's speed then, against its speed at the calibration) and the CPU time stolen. The second
    table counts, over the runs (and over those that lost at most ``STEAL_LIMIT`` of the CPU to the
    hypervisor), how often a 10% check passes: the simulator against one run, the simulator
    against the mean of the repeats, and the engine against itself (each run against each other repeat
    of the same stream, as if that run had been the prediction), the simulator with the profile scaled to
    the run's speed (``at_speed``: the profile's shape, one speed a run) and with a ``StepCost`` fitted to
    the run's own steps (``in_sample``: the decisions and a shape of the run's own)."""

    def pct(x):
        return f"{100 * x:.1f}%"

    lines = ["| admission policy | seed | rate (req/s) | measured, repeat by repeat (s/token) | largest / smallest repeat | "
             "simulated (s/token) | simulated / each repeat | simulated / the repeats' mean | "
             "profile's price of the run's steps / their time | the profile at the run's speed / measured | "
             "own steps' fit / measured | CPU stolen |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    # |ratio - 1| of each check: the simulator against one run, against the mean, another run against one, and
    # against that run the simulator at the run's speed and priced by a fit to the run's own steps
    checks = {"all": ([], [], [], [], []), "quiet": ([], [], [], [], [])}
    for policy, runs in results["policies"].items():
        for (factor, seed), rows in itertools.groupby(sorted(runs, key=lambda r: (r["factor"], r["seed"], r["repeat"])),
                                                      key=lambda r: (r["factor"], r["seed"])):  # fmt: skip
            rows = list(rows)
            measured = [r["summary"]["mean_normalized_latency"] for r in rows]
            predicted = rows[0]["predicted"]["mean_normalized_latency"]
            own = [r["in_sample"]["fit"]["simulated_over_measured"] for r in rows]
            speed = [r["in_sample"]["at_speed"]["simulated_over_measured"] for r in rows]
            calm = [(r["steal"] or 0) <= STEAL_LIMIT for r in rows]
            for (single, mean, itself, sped, fitted), keep in ((checks["all"], [True] * len(rows)), (checks["quiet"], calm)):
                kept = list(itertools.compress(measured, keep))
                single += [abs(predicted / m - 1) for m in kept]
                mean += [abs(predicted / statistics.fmean(kept) - 1)] if kept else []
                itself += [abs(other / m - 1) for m, other in itertools.permutations(kept, 2)]
                sped += [abs(x - 1) for x in itertools.compress(speed, keep)]
                fitted += [abs(x - 1) for x in itertools.compress(own, keep)]
            lines.append(
                f"| {LABELS[policy]} | {seed} | {factor:.1f} x = {rows[0]['rate']:.2f} | "
                + " / ".join(f"{m:.3f}" for m in measured)
                + f" | {max(measured) / min(measured):.2f} | {predicted:.3f} | "
                + " / ".join(f"{predicted / m:.2f}" for m in measured)
                + f" | {predicted / statistics.fmean(measured):.2f} | "
                + " / ".join(f"{1 / r['in_sample']['at_speed']['speed']:.2f}" for r in rows)
                + " | " + " / ".join(f"{x:.2f}" for x in speed)
                + " | " + " / ".join(f"{x:.2f}" for x in own)
                + " | " + " / ".join(pct(r["steal"]) for r in rows) + " |"
            )  # fmt: skip

    def passes(errors):
        if not errors:
            return "none | - | -"
        return f"{sum(e <= 0.1 for e in errors)} of {len(errors)} | {pct(statistics.fmean(errors))} | {pct(max(errors))}"

    lines += ["", f"| the 10% check | passes | mean error | largest error | passes, runs that lost at most "
              f"{pct(STEAL_LIMIT)} | mean error | largest error |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    labels = ("the simulated latency against one run", "the simulated latency against the repeats' mean",
              "a run against another repeat of its stream",
              "the simulated latency, the profile scaled to the run's speed, against that run",
              "the simulated latency, priced by a fit to the run's own steps, against that run")  # fmt: skip
    for k, label in enumerate(labels):
        lines.append(f"| {label} | {passes(checks['all'][k])} | {passes(checks['quiet'][k])} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small run, under 3 minutes")
    parser.add_argument("--plan", choices=sorted(PLANS), help="sizes by name (tiny: the tests')")
    parser.add_argument("--out", default=str(ROOT / "results"))
    parser.add_argument("--model", default=None)
    parser.add_argument("--rescore", metavar="JSON", help="add at_speed to a results file's runs (no serving)")
    parser.add_argument("--profile", help=f"the step-cost profile the simulator uses (default {PROFILE.relative_to(ROOT.parent)}; "
                        "the repeats plans calibrate their own)")  # fmt: skip
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    if args.rescore:
        path = Path(args.rescore)
        if args.plan or args.quick or args.profile:
            parser.error("--rescore takes the plan and the profile from the file it rescores; drop --plan, --quick and --profile")
        if not path.is_file():
            parser.error(f"--rescore: no results file {path}")
        try:
            results = rescore(path, resolve_model_dir(args.model))
        except (ValueError, KeyError, TypeError) as e:  # not JSON, or not bench.serving's
            parser.error(f"--rescore: {path} is not a results file of bench.serving ({type(e).__name__}: {e})")
        path.write_text(json.dumps(results, indent=1) + "\n")
        print(repeats_table(results) if "peers" not in results else table(results))
        print(f"rescored {path}")
        return 0
    name = args.plan or ("quick" if args.quick else "full")
    plan, tag = PLANS[name], "" if name == "full" else f"_{name}"
    if plan.get("calibrate") and args.profile:
        parser.error(f"--plan {name} prices its runs with a profile it calibrates first; --profile does not apply")
    model_dir = resolve_model_dir(args.model)
    began = time.time()
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    streams = {seed: synthetic_stream("alpaca", plan["n"], 1.0, seed, vocab_size=vocab,
                                      max_model_len=plan["max_len"], scale=plan["scale"])
               for seed in plan["seeds"]}  # fmt: skip
    hf = hf_batch1(model_dir)

    def refs_of(reqs):
        hf.run([r.prompt_ids for r in reqs], [r.max_new_tokens for r in reqs])
        return list(hf.references)

    refs = {seed: refs_of(reqs) for seed, reqs in streams.items()}
    command = "python -m bench.serving" + ("" if name == "full" else f" --plan {name}" if args.plan else " --quick")
    if plan.get("calibrate"):  # timed here, minutes before the runs it prices, not on another day
        calibration = calibrate(model_dir, CALIBRATION[plan["calibrate"]], command)
        cost = StepCost.from_json(calibration["coefficients"])
        profile = {"file": None, "calibrated": {k: calibration[k] for k in ("steal", "fit", "plan")}}
        print(f"calibrated: {calibration['coefficients']}; mean relative error "
              f"{100 * calibration['fit']['mean_relative_error']:.1f}%, steal {100 * (calibration['steal'] or 0):.2f}%")  # fmt: skip
    else:
        cost = StepCost.load(args.profile or PROFILE)
        profile = {"file": Path(args.profile or PROFILE).name}
    engines = {policy: engine(L3Engine, model_dir, plan, admission_policy=policy) for policy in plan["policies"]}
    for eng in engines.values():
        eng.generate([r.prompt_ids for r in streams[plan["seeds"][0]][:4]], 4, ignore_eos=True)  # warm-up
    config = engines["on_demand"].config  # each policy's: the same but for admission_policy
    simulation = knees(streams, {p: replace(config, admission_policy=p) for p in ADMISSION_POLICIES}, cost)
    results = {
        "command": command,
        **provenance(),
        "machine": {
            "cpu": cpu_name(),
            "cores": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": package_version("transformers"),
        },  # fmt: skip
        "note": "2 shared cores: timings are noisy; load is os.getloadavg() (1, 5, 15 min) at each part",
        "plan": plan,
        "kv_cache_bytes": pool_bytes(model_dir, plan),
        "cost_profile": {**profile, **cost.as_json()},
        "streams": {str(seed): {"label": MIXES["alpaca"]["label"] + f", means x {plan['scale']}", **describe(reqs)}
                    for seed, reqs in streams.items()},
        "simulated": simulation,
        "policies": {policy: [] for policy in plan["policies"]},
        "load": {"start": load()},
    }  # fmt: skip
    served = []  # (policy, seed, its row, the requests, the step samples) of every real run
    # factor by factor, then repeat by repeat, the policies and seeds side by side: a drift falls on all
    for factor, repeat in itertools.product(plan["around"], range(plan.get("repeats", 1))):
        for seed, base in streams.items():
            for policy, eng in engines.items():
                knee = simulation["policies"][policy]["center"]
                reqs = at_rate(base, factor * knee, seed + 1)
                steal, timeline, steps, tries = quiet_serve(eng, reqs, plan["retries"])
                row = result(timeline, refs[seed], eng.stats().describe())
                served.append((policy, seed, row, reqs, steps))
                predicted = simulated(reqs, eng.config, cost)
                row |= {"seed": seed, "factor": factor, "repeat": repeat, "rate": factor * knee, "load": load(),
                        "steal": steal, "tries_steal": tries,
                        "predicted": {k: predicted[k] for k in ("mean_normalized_latency", "memory_breakdown",
                                                                "preemptions", "duration_s")}}  # fmt: skip
                measured = row["summary"]["mean_normalized_latency"]
                row["simulated_over_measured"] = predicted["mean_normalized_latency"] / measured
                row["in_sample"] = in_sample(reqs, eng.config, steps, measured)
                row["in_sample"]["at_speed"] = at_speed(reqs, eng.config, steps, measured, cost)
                row["steps"] = [[x["tokens"], x["seqs"], x["context"], round(x["seconds"], 5)] for x in steps]
                results["policies"][policy].append(row)
                print(f"{policy:9s} seed {seed} {factor:.1f} x knee ({factor * knee:.2f} req/s), repeat {repeat}: "
                      f"normalized {measured:.3f} s/token, simulated {predicted['mean_normalized_latency']:.3f} "
                      f"(x {row['simulated_over_measured']:.2f}), {row['summary']['preemptions']} preemptions, "
                      f"{row['agreement']['match']}/{len(reqs)} match", flush=True)  # fmt: skip
    results["heldout"] = heldout(served, engines)
    if "peer_n" not in plan:  # the repeats plans: (a) alone
        return finish(results, began, tag, args.out, repeats_table)
    reqs = at_rate(streams[SEED][: plan["peer_n"]], plan["peer_rate"], SEED + 1)  # peers: one stream, one rate
    refs = refs[SEED][: plan["peer_n"]]
    peers = {"HF static batches": lambda: hf_static(model_dir, reqs, refs, plan["blocks"] * BLOCK)}
    peers["HF continuous batching"] = lambda: hf_continuous(model_dir, reqs, refs, plan["blocks"])
    peers["L3 paged"] = lambda: run_engine(engines["on_demand"], reqs, refs)
    peers["L4 paged"] = lambda: run_engine(engine(L4Engine, model_dir, plan), reqs, refs)
    peers["L5 paged"] = lambda: run_engine(
        engine(L5Engine, model_dir, plan, enable_prefix_caching=False), reqs, refs
    )
    results["peers"] = {"rate": plan["peer_rate"]}
    for peer, run in peers.items():
        try:
            row = run()
        except Exception as e:  # a peer that cannot run here is reported, not hidden
            row = {"error": f"{type(e).__name__}: {e}"}
        row["load"] = load()
        results["peers"][peer] = row
        s = row.get("summary")
        print(f"{peer}: " + (f"normalized {s['mean_normalized_latency']:.3f} s/token, {s['output_tokens_per_s']:.1f} "
              f"tokens/s, {row['agreement']['match']}/{len(reqs)} match" if s else row["error"]), flush=True)  # fmt: skip
    results["chunked_prefill"] = chunked(model_dir, plan, vocab, refs_of)
    for key, row in results["chunked_prefill"]["by_chunk"].items():
        print(f"chunk {key}: running gaps p50 {row['running_gap_p50']:.3f} p99 {row['running_gap_p99']:.3f} s, "
              f"long TTFT {row['long_ttft_mean']:.2f} s", flush=True)  # fmt: skip
    return finish(results, began, tag, args.out, table)


def finish(results: dict, began: float, tag: str, out: str, draw) -> int:
    """Time, plots and the JSON of a run; ``draw`` (``table`` or ``repeats_table``) prints its tables."""
    results["load"]["end"] = load()
    results["seconds"] = time.time() - began
    results["plots"] = plots(results, tag, Path(out).parent / "plots")
    path = Path(out) / f"serving{tag}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1) + "\n")
    print(draw(results))
    print(f"wrote {path} in {results['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
