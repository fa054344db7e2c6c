"""Blocks saved by sharing (the vLLM paper's Fig. 15 at this scale), and beam search with and without
sharing at one pool size: ``python -m bench.beam_memory [--model DIR] [--quick] [--out FILE]``.

L5's engine runs, for every workload, parallel sampling with n = 2, 4, 6 (temperature 0.8, top-p 0.9,
seed 0) and beam search of width 2, 4, 6, all requests of the workload at once, with the prefix cache
off (so only the sharing inside a request counts, as in the paper's figure). After every step it
reads the blocks held (``allocator.num_used``) and the blocks the same running sequences would hold
without sharing (the sum of their block-table lengths); the saving is

    1 - sum over steps of blocks held / sum over steps of blocks without sharing

(blocks saved / blocks needed without sharing, weighted by steps). Workloads:

- ``course``: the course prompt set (chat template applied), MAX_NEW_TOKENS new tokens each;
- ``alpaca-like`` and ``sharegpt-like``: SYNTHETIC, labelled so: random in-vocabulary prompts (seed 0)
  whose prompt and output lengths are drawn from log-normal distributions with the medians and spreads
  in ``MIXES`` (short instructions and short answers; long conversations and long answers), output
  lengths capped at MAX_NEW_TOKENS for the CPU's sake. The request-stream work of issue #35 was not
  used: these mixes are this script's own.

Then beam search of width THROUGHPUT_WIDTH on the course prompts at one pool size (the larger of the
peak the shared run held and the largest single group unshared): with sharing, and with every fork
copying all its parent's blocks (``copy_everything``: what a block manager without reference counts
must do); the two must return the same tokens, and their seconds, steps and preemptions are reported
side by side from one run.

It prints a Markdown table and writes ``bench/results/beam-memory.json`` and
``bench/plots/beam_memory.png``. ``--quick`` runs a tiny random Qwen3 on two short prompts (for tests).

``--trace`` measures nothing: it runs one beam search of width TRACE_WIDTH on the first course prompt
with blocks of TRACE_BLOCK_SIZE tokens and prints, after each of its first TRACE_STEPS steps, which beam
each survivor continued and every beam's block table with each block's reference count (the chapter's
section 12 shows its output).

Left out on purpose: arrival times (every request is submitted at once), GPUs, and other stages.
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from pathlib import Path

from bench.measure import cpu_name, provenance, save_results
from kvcourse.model_store import REPO_ROOT, resolve_model_dir
from kvcourse.sampling import BeamParams, SamplingParams
from L5_clones.allocator import BlockAllocator, OutOfBlocksError
from L5_clones.beams import BeamGroup, add_beam_request, beam_blocks, recompute_shares
from L5_clones.engine import Engine

WIDTHS = (2, 4, 6)
TRACE_WIDTH, TRACE_BLOCK_SIZE, TRACE_STEPS = 3, 4, 8
MAX_NEW_TOKENS = 48
THROUGHPUT_WIDTH = 4
SAMPLING = SamplingParams(temperature=0.8, top_p=0.9, seed=0)
# name -> (requests, prompt median, output median, log-normal sigma): synthetic, not the paper's data
MIXES = {"alpaca-like": (8, 20, 40, 0.6), "sharegpt-like": (8, 160, 48, 0.6)}
PAPER = {  # Kwon et al., SOSP 2023, section 6.3 (the savings its text gives beside Fig. 15)
    "parallel sampling": {"alpaca": "6.1-9.8%", "sharegpt": "16.2-30.5%"},
    "beam search": {"alpaca": "37.6-55.2%", "sharegpt": "44.3-66.3%"},
}


def synthetic_mix(
    vocab_size: int, requests: int, prompt_median: int, output_median: int, sigma: float, cap: int
):
    """Random prompts and max_new_tokens with log-normal lengths (seed 0); SYNTHETIC data.

    Example: ``synthetic_mix(100, 2, 20, 40, 0.6, 48)`` -> two prompts of ids in [3, 100) and two
    max_new_tokens in [1, 48], the same on every run."""
    rng = random.Random(0)
    prompts, max_new = [], []
    for _ in range(requests):
        length = max(1, round(rng.lognormvariate(0, sigma) * prompt_median))
        prompts.append([rng.randrange(3, vocab_size) for _ in range(length)])
        max_new.append(min(cap, max(1, round(rng.lognormvariate(0, sigma) * output_median))))
    return prompts, max_new


def copy_everything(allocator: BlockAllocator) -> None:
    """Make this allocator's clones copy every block of the parent, sharing none (the baseline)."""

    def clone_needs(num_tokens: int, n: int) -> int:
        return n * -(-num_tokens // allocator.block_size)

    def clone(block_table: list[int], num_tokens: int, n: int):
        if clone_needs(num_tokens, n) > allocator.num_free:
            raise OutOfBlocksError(needed=clone_needs(num_tokens, n), free=allocator.num_free)
        tables = [allocator.alloc_blocks(len(block_table)) for _ in range(n)]
        return tables, [(src, dst) for t in tables for src, dst in zip(block_table, t, strict=True)]

    allocator.clone_needs, allocator.clone = clone_needs, clone


def run(engine: Engine, prompts, max_new, mode: str, width: int) -> dict:
    """Every request at once, stepped to the end; the saving and what each request returned."""
    if (
        engine.config.grows_pool
    ):  # room for every sequence unshared, as generate_beams grows it (no size given)
        engine.fit_pool([len(p) + b for p, b in zip(prompts, max_new, strict=True) for _ in range(width)])
    requests = []
    for p, b in zip(prompts, max_new, strict=True):
        if mode == "beam search":
            requests.append(add_beam_request(engine, p, b, BeamParams(width)))
        else:
            requests.append(engine.add_request(p, b, n=width, sampling=SAMPLING))
    held = unshared = peak_held = peak_unshared = steps = 0
    t0 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        steps += 1
        used = engine.allocator.num_used
        alone = sum(len(s.block_table) for s in engine.scheduler.running)
        held, unshared = held + used, unshared + alone
        peak_held, peak_unshared = max(peak_held, used), max(peak_unshared, alone)
    seconds = time.perf_counter() - t0
    outputs = [r.sequences() if isinstance(r, BeamGroup) else [r.output_ids] for r in requests]
    return {
        "saved": 1 - held / unshared if unshared else 0.0,
        "peak_held": peak_held,
        "peak_unshared": peak_unshared,
        "steps": steps,
        "seconds": seconds,
        "preemptions": engine.stats().preemptions,
        "new_tokens": sum(len(s) for out in outputs for s in out),
        "outputs": outputs,
    }


def measure(model_dir, workloads: dict, widths, throughput_width: int) -> dict:
    where = provenance()  # the commit measured: read before the runs, which take minutes
    rows = []
    for name, (prompts, max_new) in workloads.items():
        for mode in ("parallel sampling", "beam search"):
            for width in widths:
                engine = Engine(
                    model_dir, enable_prefix_caching=False, max_num_seqs=max(widths) * len(prompts)
                )
                r = run(engine, prompts, max_new, mode, width)
                rows.append(
                    {
                        "workload": name,
                        "mode": mode,
                        "width": width,
                        **{k: v for k, v in r.items() if k != "outputs"},
                    }
                )
                print(f"  {name}, {mode}, width {width}: {100 * r['saved']:.1f}% saved", flush=True)
    prompts, max_new = workloads["course"]
    options = {"enable_prefix_caching": False, "max_num_seqs": throughput_width * len(prompts)}
    probe = Engine(model_dir, **options)
    shared_peak = run(probe, prompts, max_new, "beam search", throughput_width)["peak_held"]
    pool_blocks = max(
        shared_peak,
        max(
            beam_blocks(
                len(p), b, throughput_width, probe.allocator.block_size, recompute_shares(probe.scheduler)
            )
            for p, b in zip(prompts, max_new, strict=True)
        ),
    )
    side = {}
    for label in ("shared", "copied"):
        engine = Engine(model_dir, num_blocks=pool_blocks, **options)
        if label == "copied":
            copy_everything(engine.allocator)
        side[label] = run(engine, prompts, max_new, "beam search", throughput_width)
    assert side["shared"]["outputs"] == side["copied"]["outputs"], "copying changed the tokens"
    tokens = sum(len(s) for out in side["shared"]["outputs"] for s in out)
    return {
        "command": "python -m bench.beam_memory",
        **where,
        "machine": f"{cpu_name()}, {os.cpu_count()} cores",
        "model": str(model_dir),
        "max_new_tokens": MAX_NEW_TOKENS,
        "mixes": {
            k: dict(zip(("requests", "prompt_median", "output_median", "sigma"), v, strict=True))
            for k, v in MIXES.items()
        },
        "paper": PAPER,
        "workloads": {
            name: {
                "requests": len(prompts),
                "prompt_mean": sum(map(len, prompts)) / len(prompts),
                "max_new_tokens_mean": sum(max_new) / len(max_new),
            }
            for name, (prompts, max_new) in workloads.items()
        },
        "rows": rows,
        "throughput": {
            "width": throughput_width,
            "num_blocks": pool_blocks,
            "tokens": tokens,
            **{label: {k: v for k, v in r.items() if k != "outputs"} for label, r in side.items()},
        },
    }


def table(results: dict) -> str:
    """Two Markdown tables: the blocks saved per workload and width (the workloads' mean prompt length
    and mean max_new_tokens beside them), then beam search with and without sharing at one pool size."""
    lines = [
        "| workload | requests | mean prompt / max_new_tokens (tokens) "
        "| parallel sampling n = 2 / 4 / 6 | beam search k = 2 / 4 / 6 |",
        "|---|---|---|---|---|",
    ]
    for name in dict.fromkeys(r["workload"] for r in results["rows"]):
        cells = []
        for mode in ("parallel sampling", "beam search"):
            rows = [r for r in results["rows"] if r["workload"] == name and r["mode"] == mode]
            cells.append(" / ".join(f"{100 * r['saved']:.1f}%" for r in rows))
        w = results["workloads"][name]
        label = name if name == "course" else f"{name} (synthetic)"
        lines.append(
            f"| {label} | {w['requests']} | {w['prompt_mean']:.0f} / {w['max_new_tokens_mean']:.0f} "
            f"| {cells[0]} | {cells[1]} |"
        )
    t = results["throughput"]
    lines += [
        "",
        f"| beam search k = {t['width']}, course prompts, {t['num_blocks']} blocks | seconds | steps "
        "| preemptions | peak blocks held | tokens returned | tokens/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, way in (("shared", "blocks shared by refcount"), ("copied", "every fork copies its blocks")):
        r = t[label]
        lines.append(
            f"| {way} | {r['seconds']:.1f} | {r['steps']} | {r['preemptions']} | {r['peak_held']} "
            f"| {t['tokens']} | {t['tokens'] / r['seconds']:.1f} |"
        )
    p = results["paper"]
    lines += [
        "",
        f"Paper (Kwon et al., SOSP 2023, Fig. 15), Alpaca / ShareGPT: parallel sampling "
        f"{p['parallel sampling']['alpaca']} / {p['parallel sampling']['sharegpt']}, beam search "
        f"{p['beam search']['alpaca']} / {p['beam search']['sharegpt']}.",
        f"{results['machine']}; `{results['command']}`.",
    ]
    return "\n".join(lines)


def trace(engine: Engine, prompt: list[int], steps: int, width: int, decode=str) -> list[str]:
    """One beam search of ``width`` on ``prompt``, stepped ``steps`` times (or to its end): per step,
    the survivors as ``parent->token`` and each beam's block table, every block with its reference
    count (``3x2``: block 3, held by 2 tables). ``decode`` turns a token id into text."""
    group = add_beam_request(engine, prompt, steps, BeamParams(width))
    lines = [f"prompt: {len(prompt)} tokens, block_size {engine.allocator.block_size}"]
    for step in range(1, steps + 1):
        engine.step()
        if group.done:
            lines.append(f"step {step}: the search ended")
            break
        survivors = ", ".join(f"{parent}->{decode(token)!r}" for parent, token in group.steps[-1])
        lines.append(f"step {step}: survivors (parent->token) {survivors}")
        for slot, beam in enumerate(group.seqs):
            blocks = " ".join(f"{b}x{engine.allocator.blocks[b].ref_count}" for b in beam.block_table)
            lines.append(f"  beam {slot}: [{blocks}]  {decode(beam.output_ids)!r}")
        engine.allocator.check_invariants(s.block_table for s in engine.scheduler.running)
    return lines


def plot(results: dict, path: Path) -> None:
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["workload"] for r in results["rows"]))
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), sharey=True)
    for ax, mode in zip(axes, ("parallel sampling", "beam search"), strict=True):
        for i, name in enumerate(names):
            rows = [r for r in results["rows"] if r["workload"] == name and r["mode"] == mode]
            xs = [j + (i - 1) * 0.25 for j in range(len(rows))]
            label = name if name == "course" else f"{name} (synthetic)"
            ax.bar(xs, [100 * r["saved"] for r in rows], width=0.25, label=label)
        ax.set_xticks(
            range(len(rows)), [f"{'n' if mode.startswith('p') else 'k'} = {r['width']}" for r in rows]
        )
        ax.set_title(f"{mode} (paper: {results['paper'][mode]['alpaca']} Alpaca)")
    axes[0].set_ylabel("blocks saved by sharing (%)")
    axes[1].legend(fontsize=8)
    fig.suptitle("L5: KV blocks saved by sharing (python -m bench.beam_memory)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.beam_memory", description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory (default: the course model)")
    parser.add_argument(
        "--quick", action="store_true", help="tiny random Qwen3, two short prompts (for tests)"
    )
    parser.add_argument(
        "--out", help="JSON file (default: bench/results/beam-memory.json; none with --quick)"
    )
    parser.add_argument("--plot", help="PNG file (default: bench/plots/beam_memory.png; none with --quick)")
    parser.add_argument(
        "--trace",
        action="store_true",
        help="print one beam search's block tables step by step, measure nothing",
    )
    args = parser.parse_args(argv)
    from kvcourse.config import ModelConfig
    from kvcourse.harness.prompts import encode, load_tokenizer, read_prompts

    if args.quick and not args.model:
        from kvcourse.harness.tiny import make_tiny_checkpoint

        model_dir = make_tiny_checkpoint("qwen3", tempfile.mkdtemp(prefix="kvcourse-beam-memory-"))
    else:
        model_dir = resolve_model_dir(args.model)
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    cap = 6 if args.quick else MAX_NEW_TOKENS
    tok = load_tokenizer(model_dir)
    course = [encode(tok, p) for p in read_prompts(None)]
    if args.trace:
        engine = Engine(model_dir, block_size=TRACE_BLOCK_SIZE, enable_prefix_caching=False)
        decode = lambda ids: tok.decode(ids if isinstance(ids, list) else [ids])  # noqa: E731
        print("\n".join(trace(engine, course[0], TRACE_STEPS, TRACE_WIDTH, decode)))
        return 0
    workloads = {"course": (course[:2] if args.quick else course, [cap] * (2 if args.quick else len(course)))}
    for name, (n, prompt_median, output_median, sigma) in MIXES.items():
        n = 2 if args.quick else n
        workloads[name] = synthetic_mix(
            vocab, n, prompt_median // (4 if args.quick else 1), output_median, sigma, cap
        )
    results = measure(model_dir, workloads, WIDTHS, THROUGHPUT_WIDTH)
    print(table(results))
    save_results(results, args.out, "beam-memory.json", args.quick)
    png = args.plot or (None if args.quick else REPO_ROOT / "bench" / "plots" / "beam_memory.png")
    if png:
        plot(results, Path(png))
        print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
