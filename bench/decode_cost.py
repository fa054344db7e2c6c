"""What one cached decode step costs as the context grows (the L1 chapter's table, section 6):
``python -m bench.decode_cost [--model DIR] [--quick] [--out FILE]``.

L1's engine on the course model prefills random in-vocabulary token ids (seed 0) up to the last of
``POSITIONS``, then times ``Engine.decode_step(ids[p], p)`` at each position of ``POSITIONS``. Feeding ``ids[p]`` at ``p``
writes back the K/V the prefill stored there, so the cache stays consistent however often a position
is revisited. The positions are timed round-robin (a pass over all of them, ``ROUNDS`` times, after a
warm-up pass), so a burst of load on a shared machine spreads over every row; each row is the median.
Beside each step it times:

- the attention alone: the step's 30 ``causal_attention`` calls, one query over the ``p + 1`` cached
  keys and values (random, the model's head shapes);
- no cache: a forward over the whole prefix ``ids[: p + 1]``, what every step would cost without a
  cache (median of 3; the first position is left out, where it is hardly a prefix);
- the prefill of those tokens once, and the machine's copy bandwidth
  (``bench.ceilings.copy_bandwidth``).

It prints a Markdown table (KV bytes each step reads, from the model's config) and writes the numbers
to ``bench/results/decode-cost-cpu.json``. ``--quick`` runs a tiny random Llama over a few short
positions (for tests).

Left out on purpose: the other stages (``make bench``'s workload (d) times decode latency against
context for every stage) and any device but the CPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from bench import OMP_WAIT_POLICY
from bench.ceilings import copy_bandwidth, median_seconds
from bench.measure import cpu_name, provenance, save_results
from kvcourse.model import causal_attention
from kvcourse.model_store import resolve_model_dir
from L1_contiguous.engine import Engine

POSITIONS = (8, 64, 256, 512, 1024, 1536, 2000)
ROUNDS = 7
QUICK_POSITIONS = (4, 16, 40)


def step_ms(engine: Engine, ids: list[int], positions: tuple[int, ...], rounds: int) -> dict[int, float]:
    """Median ms of ``decode_step(ids[p], p)`` per position, timed round-robin after a warm-up pass.

    Example: positions (8, 64), rounds 7 -> 7 samples of each, taken 8, 64, 8, 64, ...
    """
    samples: dict[int, list[float]] = {p: [] for p in positions}
    for round_ in range(rounds + 1):
        for p in positions:
            t0 = time.perf_counter()
            engine.decode_step(ids[p], p)
            if round_:  # the first pass warms up
                samples[p].append(time.perf_counter() - t0)
    return {p: 1e3 * statistics.median(s) for p, s in samples.items()}


def attention_ms(cfg, position: int, repeats: int) -> float:
    """Median ms of the step's ``num_layers`` attention calls: one query over ``position + 1`` keys."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, cfg.num_heads, cfg.head_dim, generator=g)  # (1, H, D)
    k = torch.randn(position + 1, cfg.num_kv_heads, cfg.head_dim, generator=g)  # (p + 1, H_kv, D)
    v = torch.randn_like(k)

    def layers():
        for _ in range(cfg.num_layers):
            causal_attention(q, k, v, q_start=position)

    return 1e3 * median_seconds(layers, repeats)


def measure(model_dir, positions: tuple[int, ...], rounds: int, no_cache_repeats: int) -> dict:
    """Every number of the table, on the CPU."""
    last = max(positions)
    engine = Engine(model_dir, max_model_len=last + 1)
    cfg = engine.model.cfg
    ids = torch.randint(0, cfg.vocab_size, (last + 1,), generator=torch.Generator().manual_seed(0)).tolist()
    t0 = time.perf_counter()
    engine.prefill(ids[:last])  # positions 0..last-1 cached; decode_step(ids[last], last) adds the last
    prefill_s = time.perf_counter() - t0
    engine.decode_step(ids[last], last)
    steps = step_ms(engine, ids, positions, rounds)
    rows = []
    for p in positions:
        no_cache = None
        if p != positions[0]:
            no_cache = 1e3 * median_seconds(lambda p=p: engine.prefill(ids[: p + 1]), no_cache_repeats)
        rows.append(
            {
                "position": p,
                "kv_read_bytes": cfg.kv_bytes_per_token() * (p + 1),
                "step_ms": steps[p],
                "attention_ms": attention_ms(cfg, p, rounds),
                "no_cache_ms": no_cache,
            }
        )
    return {
        "command": "python -m bench.decode_cost",
        **provenance(),
        "machine": f"{cpu_name()}, {os.cpu_count()} cores",
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "omp_wait_policy": OMP_WAIT_POLICY,
        "num_layers": cfg.num_layers,
        "rounds": rounds,
        "prefill_tokens": last,
        "prefill_s": prefill_s,
        "copy_GBps": copy_bandwidth() / 1e9,
        "rows": rows,
    }


def mib(n: int) -> str:
    """Bytes as the chapter writes them: ``mib(414720) -> '405 KiB'``, ``mib(3 * 2**20) -> '3.0 MiB'``."""
    return f"{n / 1024:.0f} KiB" if n < 2**20 else f"{n / 2**20:.1f} MiB"


def table(results: dict) -> str:
    """The chapter's table: a row per position, no-cache time with its multiple of the cached step."""
    lines = [
        "| position `t` | KV read per step | cached decode step "
        f"| of which attention ({results['num_layers']} layers) "
        "| no cache: full forward over the prefix |",
        "|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        no_cache = ""
        if r["no_cache_ms"] is not None:
            no_cache = f"{r['no_cache_ms']:,.0f} ms ({r['no_cache_ms'] / r['step_ms']:.0f}x)"
        lines.append(
            f"| {r['position']} | {mib(r['kv_read_bytes'])} | {r['step_ms']:.1f} ms "
            f"| {r['attention_ms']:.2f} ms | {no_cache} |"
        )
    lines.append("")
    lines.append(
        f"{results['machine']}, torch {results['torch']} ({results['torch_threads']} threads, "
        f"OMP_WAIT_POLICY {results['omp_wait_policy']}); median of {results['rounds']} rounds. Prefill of "
        f"{results['prefill_tokens']} tokens: {results['prefill_s']:.2f} s; copy bandwidth "
        f"{results['copy_GBps']:.1f} GB/s."
    )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.decode_cost", description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory (default: the course model)")
    parser.add_argument("--quick", action="store_true", help="tiny random Llama, short positions (for tests)")
    parser.add_argument(
        "--out", help="JSON file (default: bench/results/decode-cost-cpu.json; none with --quick)"
    )
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    if args.quick and not args.model:
        from kvcourse.harness.tiny import make_tiny_checkpoint

        model_dir = make_tiny_checkpoint("llama", tempfile.mkdtemp(prefix="kvcourse-decode-cost-"))
    else:
        model_dir = resolve_model_dir(args.model)
    positions = QUICK_POSITIONS if args.quick else POSITIONS
    results = measure(model_dir, positions, 2 if args.quick else ROUNDS, 1 if args.quick else 3)
    print(table(results))
    save_results(results, args.out, "decode-cost-cpu.json", args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
