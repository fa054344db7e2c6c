"""``make bench``: every stage against Hugging Face and against the machine's ceilings, in one run.

    python -m bench.run [--quick] [--out DIR] [--model DIR]

Workloads (fixed-length: every request produces exactly its budget of tokens):

- (a) batch-1 decode: one chat prompt, 128 new tokens;
- (b) 32 mixed requests: prompt lengths 10-300, budgets 16-128 (seeded), all submitted at once;
- (c) 8 samples of one 200-token prompt, 64 tokens each: L5 and L6 prefill it once and fork (sharing
  its full blocks), the others run 8 requests; on fresh L5/L6 engines, the most blocks held at once
  against 8 private copies;
- (d) decode latency against context length (128 .. 2048), per stage: the time of 16 extra decode
  steps after a prompt of that length, divided by 16.
- (e) L6 alone: its reference attention, jit'd, per block size (``q_block`` x ``kv_pages_per_block``)
  on a 32-sequence decode batch and a 512-token prefill; and the time of a logical reset (metadata)
  against a physical one (also zeroes every page of the pool).

KV utilization on (b) and the blocks held on (c) come from each engine's ``stats()`` after the
workload runs on a fresh engine: live positions / positions held, summed over every step (L6 counts
them on the device, inside its decode loop).

An engine whose stats report compiles (L6) runs (a), (b) and (c) twice and the second run is timed;
the first run's time is kept as ``first_run_seconds``. The torch stages and HF have nothing to compile.

Ceilings (``bench/ceilings.py``) are measured in the same run, and every speed is also reported as a
ratio to HF and to the ceilings, because this machine is shared and noisy: only ratios measured side
by side mean anything. Results go to ``OUT/results/*.json`` and ``OUT/plots/*.png`` (OUT defaults to
``bench/``). ``--quick`` runs every part on a tiny random model with tiny sizes, so that the test suite
can check the benchmark code without paying for it.

Left out on purpose: sampling cost (every run is greedy, the clones of (c) too), latency
percentiles under load, and any GPU/TPU numbers (there is no accelerator here).
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import platform
import random
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from bench import ceilings
from bench.systems import System, hf_batch1, hf_batched, present_stages, stage
from kvcourse.model import Transformer
from kvcourse.model_store import REPO_ROOT, resolve_model_dir
from kvcourse.prompts import Prompt, encode, load_tokenizer
from kvcourse.stages import engine_class

FULL = {"a_tokens": 128, "b_requests": 32, "b_prompt": (10, 300), "b_new": (16, 128), "c_n": 8,
        "c_prompt": 200, "c_new": 64, "d_contexts": [128, 256, 512, 1024, 2048], "d_steps": 16,
        "e_decode_seqs": 32, "e_context": 512, "e_prefill": 512,
        "e_blocks": [(1, 1), (1, 4), (1, 16), (16, 4), (16, 16), (32, 32)]}  # fmt: skip
QUICK = {"a_tokens": 8, "b_requests": 4, "b_prompt": (4, 24), "b_new": (2, 6), "c_n": 2,
         "c_prompt": 20, "c_new": 4, "d_contexts": [16, 48], "d_steps": 2,
         "e_decode_seqs": 2, "e_context": 40, "e_prefill": 24, "e_blocks": [(1, 1), (16, 16)]}  # fmt: skip


def mixed_workload(vocab: int, n: int, prompt_range, new_range, seed: int = 0):
    """n requests of seeded random token ids: ([prompt ids], [budgets]).

    Random ids are fine for speed: with ``ignore_eos`` the text never changes what is computed.
    """
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_range))] for _ in range(n)]
    return prompts, [rng.randint(*new_range) for _ in range(n)]


def timed(system: System, prompts, budgets) -> dict:
    t0 = time.perf_counter()
    outs = system.run(prompts, budgets)
    seconds = time.perf_counter() - t0
    useful = sum(budgets)
    assert [len(o) for o in outs] == budgets, f"{system.name} did not produce fixed-length outputs"
    return {"seconds": seconds, "new_tokens": useful, "tok_s": useful / seconds}


def timed_samples(system: System, prompt, budget: int, n: int) -> dict:
    t0 = time.perf_counter()
    outs = system.run_samples(prompt, budget, n)
    seconds = time.perf_counter() - t0
    assert [len(o) for o in outs] == [budget] * n, f"{system.name} did not produce {n} x {budget} tokens"
    return {"seconds": seconds, "new_tokens": n * budget, "tok_s": n * budget / seconds}


def kv_stats(engine, run) -> dict:
    """Run a workload on a fresh engine and keep what its ``stats()`` says about the KV memory.

    Every engine reports the same ``EngineStats``: utilization (live / held positions, summed over
    its steps), the most blocks held and shared at once, preemptions. L1 has no blocks (0).
    """
    run(engine)
    s = engine.stats()
    return {
        "utilization": s.kv_utilization,
        "preemptions": s.preemptions,
        "block_size": s.block_size,
        "blocks_held": s.blocks_held,
        "blocks_shared": s.blocks_shared,
        "steps": s.steps,
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
    for work, (n_tok, kv_lens, cu) in batches.items():
        q = jnp.asarray(rng.standard_normal((n_tok, n_heads, d), np.float32))
        args = (q, pool, kv_lens, pages, cu, jnp.int32(n_seq if work == "decode" else 1))
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
    from L6_tpu_jax.engine import Engine

    out = {}
    for mode in ("logical", "physical"):
        engine = Engine(model_dir, reset=mode, **options)
        engine.reset()  # compile
        out[mode] = 1000 * ceilings.median_seconds(engine.reset, 5)
        out["pool_MB"] = sum(pool.nbytes for pool in engine.kv_pages) / 1e6
    return out


def decode_latency(system: System, vocab: int, context: int, steps: int) -> float:
    """Seconds per decode step at ``context``: (time for 1 + steps tokens - time for 1) / steps.

    Both runs prefill the same prompt, so the difference is the decode steps alone.
    """
    prompt = mixed_workload(vocab, 1, (context, context), (1, 1), seed=context)[0]
    short = ceilings.median_seconds(lambda: system.run(prompt, [1]), 2)
    long = ceilings.median_seconds(lambda: system.run(prompt, [1 + steps]), 2)
    return max(long - short, 0.0) / steps


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what ``platform`` knows."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.processor() or platform.machine()


def stage_options(engine_cls, sizes: dict, max_len: int) -> dict:
    """Pool and batch sizes large enough that (b), (c) and (d) run without preemption in every stage,
    and no larger (every block is allocated up front: 3.8 GB per engine if sized for 40 x 2048 tokens).

    Read from the constructor's signature, so no stage is named here: L2-L5 take ``num_blocks`` and
    L3-L5 ``max_num_seqs``; L6 uses Levanter's names, ``num_pages`` and ``max_seqs``.
    """
    params = inspect.signature(engine_cls).parameters
    size = params["block_size"].default if "block_size" in params else 16
    size = params["page_size"].default if "page_size" in params else size
    blocks = max(
        sizes["b_requests"] * -(-(sizes["b_prompt"][1] + sizes["b_new"][1]) // size),  # (b), all at once
        sizes["c_n"] * -(-(sizes["c_prompt"] + sizes["c_new"]) // size),  # (c) without sharing
        -(-max_len // size),  # (d), one long sequence
    )
    options = {"max_model_len": max_len}
    options |= {name: blocks for name in ("num_blocks", "num_pages") if name in params}
    options |= {name: sizes["b_requests"] for name in ("max_num_seqs", "max_seqs") if name in params}
    return options


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model and sizes (for tests)")
    parser.add_argument("--out", default=str(REPO_ROOT / "bench"), help="folder for results/ and plots/")
    parser.add_argument("--model", help="model directory (default: the course model)")
    parser.add_argument("--stages", help="comma-separated stages to run (default: every stage present)")
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    tmp = None
    if args.quick and not args.model:
        from kvcourse.tiny import make_tiny_checkpoint

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
    stages = args.stages.split(",") if args.stages else present_stages()
    results = {
        "machine": {"platform": platform.platform(), "processor": cpu_name(), "threads": torch.get_num_threads(),
                    "torch": torch.__version__},
        "quick": args.quick,
        "sizes": sizes,
        "ceilings": ceilings.measure(model.w, quick=args.quick),
    }  # fmt: skip
    tok = load_tokenizer(model_dir)
    chat = encode(tok, Prompt(messages=(("user", "Tell me a long story about a lighthouse keeper."),)))
    b_prompts, b_budgets = mixed_workload(vocab, sizes["b_requests"], sizes["b_prompt"], sizes["b_new"])
    c_prompt = mixed_workload(vocab, 1, (sizes["c_prompt"],) * 2, (1, 1), seed=7)[0][0]

    # One system at a time, built when its turn comes and dropped after: engines allocate their pools.
    makers = [("HF batch 1", lambda: hf_batch1(model_dir)), ("HF batched", lambda: hf_batched(model_dir))]
    options = {n: stage_options(engine_class(n), sizes, max_len) for n in stages}
    makers += [(n, lambda n=n: stage(n, model_dir, **options[n])) for n in stages]
    works = {name: ("a", "b", "c", "d") if name != "HF batched" else ("a", "b", "c") for name, _ in makers}
    rows: dict[str, dict] = {name: {} for name, _ in makers}
    with tqdm(total=sum(map(len, works.values())), desc="bench", unit="run") as progress:
        for name, make in makers:
            system, row = make(), rows[name]
            for work in works[name]:
                progress.set_postfix_str(f"{name} ({work})")
                runs = {
                    "a": lambda system=system: timed(system, [chat], [sizes["a_tokens"]]),
                    "b": lambda system=system: timed(system, b_prompts, b_budgets),
                    "c": lambda system=system: timed_samples(system, c_prompt, sizes["c_new"], sizes["c_n"]),
                }
                if work in runs:
                    row[work] = runs[work]()
                    if system.engine is not None and system.engine.stats().compiles:  # timed again, warm
                        row[work] = runs[work]() | {"first_run_seconds": row[work]["seconds"]}
                else:
                    row["d"] = {
                        str(c): decode_latency(system, vocab, c, sizes["d_steps"])
                        for c in sizes["d_contexts"]
                    }
                progress.update()
            del system
    for name in stages:  # KV memory on fresh engines, from the stats every engine reports
        fresh = lambda name=name: stage(name, model_dir, **options[name]).engine  # noqa: E731
        rows[name]["b_kv"] = kv_stats(fresh(), lambda e: e.generate(b_prompts, b_budgets, ignore_eos=True))
        if hasattr(engine_class(name), "generate_samples"):
            rows[name]["c_kv"] = kv_stats(
                fresh(),
                lambda e: e.generate_samples([c_prompt], sizes["c_new"], n=sizes["c_n"], ignore_eos=True),
            )
            size = rows[name]["c_kv"]["block_size"]
            rows[name]["c_kv"]["private_copies_blocks"] = sizes["c_n"] * -(
                -(sizes["c_prompt"] + sizes["c_new"]) // size
            )
    results["systems"] = rows
    if "L6" in stages:
        results["e"] = {
            "block_sizes_ms": block_size_sweep(model.cfg, sizes),
            "reset_ms": reset_times(model_dir, options["L6"]),
        }
    add_ratios(results)
    (out / "results" / "bench.json").write_text(json.dumps(results, indent=1) + "\n")
    plot(results, out / "plots")
    print(summary_table(results))
    if tmp:
        tmp.cleanup()
    return 0


def add_ratios(results: dict) -> None:
    """tokens/s as multiples of HF and as fractions of the ceilings, for (a) and (b)."""
    ceil = results["ceilings"]
    systems = results["systems"]
    for row in systems.values():
        row["a"]["vs_hf_batch1"] = row["a"]["tok_s"] / systems["HF batch 1"]["a"]["tok_s"]
        row["a"]["of_batch1_ceiling"] = row["a"]["tok_s"] / ceil["batch1_ceiling_tok_s"]
        row["b"]["vs_hf_batched"] = row["b"]["tok_s"] / systems["HF batched"]["b"]["tok_s"]
        row["b"]["of_large_batch_ceiling"] = row["b"]["tok_s"] / ceil["large_batch_ceiling_tok_s"]


def summary_table(results: dict) -> str:
    """The Markdown table README shows."""
    c, m = results["ceilings"], results["machine"]
    lines = [
        f"machine: {m['processor']}, {m['threads']} threads, {m['platform']}, torch {m['torch']}",
        f"ceilings: copy {c['copy_bandwidth_GBps']:.1f} GB/s over {c['weight_bytes'] / 1e6:.0f} MB of weights -> "
        f"batch-1 {c['batch1_ceiling_tok_s']:.1f} tok/s; matmul {c['matmul_GFLOPs']:.1f} GFLOP/s -> "
        f"large-batch {c['large_batch_ceiling_tok_s']:.1f} tok/s",
        "",
        f"| system | (a) batch-1 tok/s | vs HF b1 | of b1 ceiling | (b) {results['sizes']['b_requests']} mixed tok/s "
        f"| vs HF batched | of large-batch ceiling | (b) KV utilization | (c) n={results['sizes']['c_n']} tok/s "
        "| (c) blocks held / private copies |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in results["systems"].items():
        kv = f"{100 * row['b_kv']['utilization']:.1f}%" if "b_kv" in row else "-"
        c_kv = row.get("c_kv")
        shared = f"{c_kv['blocks_held']} / {c_kv['private_copies_blocks']}" if c_kv else "-"
        lines.append(
            f"| {name} | {row['a']['tok_s']:.1f} | {row['a']['vs_hf_batch1']:.2f}x | "
            f"{100 * row['a']['of_batch1_ceiling']:.0f}% | {row['b']['tok_s']:.1f} | "
            f"{row['b']['vs_hf_batched']:.2f}x | {100 * row['b']['of_large_batch_ceiling']:.0f}% | {kv} | "
            f"{row['c']['tok_s']:.1f} | {shared} |"
        )
    if "e" in results:
        e = results["e"]
        lines += ["", "| (e) L6 attention alone | ms per call |", "|---|---|"]
        lines += [f"| {name} | {ms:.2f} |" for name, ms in e["block_sizes_ms"].items()]
        r = e["reset_ms"]
        lines += [
            "",
            f"(e) reset of a {r['pool_MB']:.0f} MB pool: logical {r['logical']:.2f} ms, physical {r['physical']:.1f} ms",
        ]
    return "\n".join(lines)


def plot(results: dict, folder: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems, ceil = results["systems"], results["ceilings"]
    names = list(systems)
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, work, ceiling, title in (
        (axes[0], "a", ceil["batch1_ceiling_tok_s"], "(a) batch-1 decode"),
        (axes[1], "b", ceil["large_batch_ceiling_tok_s"], "(b) 32 mixed requests"),
    ):
        ax.bar(names, [systems[n][work]["tok_s"] for n in names], color="tab:blue")
        ax.axhline(ceiling, color="tab:red", linestyle="--", label=f"ceiling {ceiling:.0f} tok/s")
        ax.set_title(title)
        ax.set_ylabel("output tokens/s")
        ax.tick_params(axis="x", rotation=30)
        ax.legend()
    fig.tight_layout()
    fig.savefig(folder / "throughput.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for name, row in systems.items():
        if "d" in row:
            contexts = [int(c) for c in row["d"]]
            ax.plot(contexts, [1000 * s for s in row["d"].values()], "o-", label=name)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("decode step (ms)")
    ax.set_title("(d) decode latency vs context, batch 1")
    ax.legend()
    fig.tight_layout()
    fig.savefig(folder / "decode_latency.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
