"""Serving at a fixed KV memory, measured as the vLLM paper measures it, at this course's scale.

    python -m bench.serving [--quick] [--out DIR] [--model DIR]

One command (part of ``make bench``), on the CPU, SmolLM2-135M-Instruct in fp32. Every system serves
the same request stream (``kvcourse.harness.stream``: Poisson arrivals from a seed, lengths from the
synthetic Alpaca-like mix with the paper's means, or a quarter of them with ``--quick``) in real
time at the same KV pool size, and every output is checked against HF greedy one request at a time (eos
disabled, as ``ignore_eos``; ``bench.systems.hf_batch1``), with the course's tie rule.

- (a) KV memory holding live tokens, per admission policy: on demand, Oracle, Pow2, Max (``admission_policy=``, L3);
- (b) mean normalized latency (end-to-end / output tokens) against request rate, per policy, at one
  pool size; the highest rate each sustains under a latency bound stated in the JSON (twice on
  demand's normalized latency at the lowest rate, measured in the same run), and on_demand/oracle and
  on_demand/max;
- (c) peers on the same stream at one rate: HF ``generate`` in static batches (collect what has
  arrived, left-pad, run to the longest max_new_tokens; a batch only as large as the pool holds at the
  longest length, as a server reserving per request must; its tokens come back when the batch ends,
  so its TTFT is the batch's end), transformers' continuous batching (``ContinuousBatchingManager``,
  ``add_request`` + ``get_result`` with streaming, its paged cache given the pool's blocks), and
  L4 and L5 (paged); L6 is left out: it has no ``add_request`` + ``step`` to feed in real time;
- (d) chunked prefill's payoff: short requests decoding while long prompts arrive; the running
  requests' inter-token gaps (p50, p99) and the long prompts' TTFT, without chunking and for a few
  chunk sizes (L3, on demand).

Timing is noisy: this VM has 2 cores shared with other work; the JSON records ``os.getloadavg()``
before and after each part. Writes ``bench/results/serving[_quick].json`` and
``bench/plots/serving_*.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from bench.measure import agreement, cpu_name, package_version, provenance
from bench.systems import fixed_length_model, hf_batch1
from kvcourse.config import ModelConfig
from kvcourse.engine_config import ADMISSION_POLICIES
from kvcourse.harness.reference import Reference
from kvcourse.harness.serving import Timeline, request_metrics, serve, summary
from kvcourse.harness.stream import MIXES, Request, at_rate, describe, synthetic_stream
from kvcourse.model_store import resolve_model_dir
from L3_block_tensor.engine import Engine as L3Engine
from L4_paged_kernel.engine import Engine as L4Engine
from L5_clones.engine import Engine as L5Engine

ROOT = Path(__file__).resolve().parent
BLOCK = 16
PLANS = {  # sizes: what --quick runs, and what the full run does (under 30 minutes here)
    "quick": {"n": 5, "scale": 0.25, "rates": [1.0, 4.0], "max_len": 128, "blocks": 24, "peer_rate": 2.0,
              "chunks": [None, 32], "short": 3, "short_new": 32, "long": 2, "long_prompt": 256},
    "tiny": {"n": 4, "scale": 0.1, "rates": [2.0, 8.0], "max_len": 64, "blocks": 12, "peer_rate": 2.0,
             "chunks": [None, 16], "short": 2, "short_new": 16, "long": 1, "long_prompt": 40},  # tests only
    "full": {"n": 16, "scale": 1.0, "rates": [0.25, 0.5, 1.0, 2.0], "max_len": 256, "blocks": 48,
             "peer_rate": 0.5, "chunks": [None, 32, 64, 128], "short": 4, "short_new": 96, "long": 3, "long_prompt": 768},
}  # fmt: skip
SEED = 35


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


def sustained(rows: dict, bound: float) -> dict:
    """Per policy, the highest rate of the sweep whose mean normalized latency is within ``bound``."""
    best = {}
    for policy, by_rate in rows.items():
        ok = [float(r) for r, row in by_rate.items() if row["summary"]["mean_normalized_latency"] <= bound]
        best[policy] = max(ok) if ok else None
    return best


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


def plots(results: dict, tag: str, folder: Path) -> list[str]:
    import matplotlib.pyplot as plt

    out = []
    policies = results["policies"]
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
    for policy, by_rate in policies.items():
        rates = sorted(by_rate, key=float)
        ax[0].plot([float(r) for r in rates], [by_rate[r]["summary"]["mean_normalized_latency"] for r in rates],
                   marker="o", label=policy)  # fmt: skip
    ax[0].axhline(results["latency_bound"], color="grey", linestyle=":", label="bound")
    ax[0].set_xlabel("request rate (req/s)")
    ax[0].set_ylabel("mean normalized latency (s/token)")
    ax[0].set_yscale("log")
    ax[0].legend(fontsize=8)
    rate = str(results["plan"]["rates"][-1])
    names = list(policies)
    ax[1].bar(names, [100 * policies[p][rate]["summary"]["kv_utilization"] for p in names])
    ax[1].set_ylabel(f"% of held KV holding tokens (rate {rate})")
    fig.suptitle(f"L3 at a {results['kv_cache_bytes'] / 2**20:.0f} MiB KV pool, {results['stream']['label']}",
                 fontsize=9)  # fmt: skip
    fig.tight_layout()
    path = folder / f"serving_policies{tag}.png"
    folder.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    out.append(path.name)
    plt.close(fig)
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small run, under 3 minutes")
    parser.add_argument("--plan", choices=sorted(PLANS), help="sizes by name (tiny: the tests')")
    parser.add_argument("--out", default=str(ROOT / "results"))
    parser.add_argument("--model", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    name = args.plan or ("quick" if args.quick else "full")
    plan, tag = PLANS[name], "" if name == "full" else f"_{name}"
    model_dir = resolve_model_dir(args.model)
    began = time.time()
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    base = synthetic_stream("alpaca", plan["n"], plan["rates"][0], SEED, vocab_size=vocab,
                            max_model_len=plan["max_len"], scale=plan["scale"])  # fmt: skip
    hf = hf_batch1(model_dir)

    def refs_of(reqs):
        hf.run([r.prompt_ids for r in reqs], [r.max_new_tokens for r in reqs])
        return list(hf.references)

    refs = refs_of(base)
    results = {
        "command": "python -m bench.serving"
        + ("" if name == "full" else f" --plan {name}" if args.plan else " --quick"),
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
        "stream": {"label": MIXES["alpaca"]["label"] + f", means x {plan['scale']}", **describe(base)},
        "policies": {},
        "load": {"start": load()},
    }
    results["policies"] = {policy: {} for policy in ADMISSION_POLICIES}
    for rate in plan["rates"]:  # rate by rate, the policies side by side: a drift falls on all alike
        reqs = at_rate(base, rate, SEED + 1)
        for policy in ADMISSION_POLICIES:
            row = run_engine(engine(L3Engine, model_dir, plan, admission_policy=policy), reqs, refs)
            row["load"] = load()
            results["policies"][policy][str(rate)] = row
            s = row["summary"]
            print(f"{policy:6s} rate {rate:5.2f}: normalized {s['mean_normalized_latency']:.3f} s/token, "
                  f"live {100 * s['kv_utilization']:.1f}% of held, {s['preemptions']} preemptions, "
                  f"{row['agreement']['match']}/{len(reqs)} match", flush=True)  # fmt: skip
    low = str(plan["rates"][0])
    results["latency_bound"] = 2 * results["policies"]["on_demand"][low]["summary"]["mean_normalized_latency"]
    best = sustained(results["policies"], results["latency_bound"])
    results["sustained_rate"] = best
    results["ratios"] = {
        "on_demand/oracle": best["on_demand"] / best["oracle"]
        if best["on_demand"] and best["oracle"]
        else None,
        "on_demand/max": best["on_demand"] / best["max"] if best["on_demand"] and best["max"] else None,
        "paper": {
            "on_demand/oracle": [1.7, 2.7],
            "on_demand/max": [2.7, 8.0],
            "kv_utilization_reserving": [0.204, 0.382],
        },
    }
    reqs = at_rate(base, plan["peer_rate"], SEED + 1)
    peers = {"HF static batches": lambda: hf_static(model_dir, reqs, refs, plan["blocks"] * BLOCK)}
    peers["HF continuous batching"] = lambda: hf_continuous(model_dir, reqs, refs, plan["blocks"])
    swept = results["policies"]["on_demand"].get(str(plan["peer_rate"]))  # the same run, if the sweep had the rate
    peers["L3 paged"] = lambda: dict(swept) if swept else run_engine(engine(L3Engine, model_dir, plan), reqs, refs)
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
    results["load"]["end"] = load()
    results["seconds"] = time.time() - began
    results["plots"] = plots(results, tag, Path(args.out).parent / "plots")
    out = Path(args.out) / f"serving{tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {out} in {results['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
