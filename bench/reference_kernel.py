"""L3's gather against L4's readable kernel and its decode tiles, one layer's attention on the CPU (the
L4 chapter's table, section 9): ``python -m bench.reference_kernel [--quick] [--out FILE]``.

For each decode shape (sequences x context) it builds one layer's pool with the course model's head
shapes (H=9, H_kv=3, D=64, block 16), every sequence's blocks shuffled over the pool, and a decode step
of one new token per sequence, then times three ways of running that layer's attention, each including
the write of the new K/V:

- L3: ``L3_block_tensor.attention.attention``, every sequence's history gathered (``index_select``)
  and handed to SDPA;
- L4 reference: ``L4_paged_kernel.attention.attention`` with ``paged_attention.py``, one sequence and
  one block at a time;
- L4 decode tiles: the same with ``fast/split_kv.py``'s ``split_kv_attention`` (one split), every
  sequence's decode query at once, 16 blocks a step.

Each output is first checked against L3's (a wrong one fails the run); then the median of ``REPEATS``
timed calls after a warm-up. It prints a Markdown table and writes ``bench/results/reference-kernel-cpu.json``.

Left out on purpose: the compiled kernels (``python -m bench.kernels`` times the C++ and Triton kernels
against SDPA and the copy bandwidth) and any device but the CPU.
"""

from __future__ import annotations

import argparse
import os

import torch

from bench import OMP_WAIT_POLICY
from bench.ceilings import median_seconds
from bench.measure import cpu_name, provenance, save_results
from L3_block_tensor.attention import ForwardMeta
from L3_block_tensor.attention import attention as l3_attention
from L3_block_tensor.cache import KvPool
from L4_paged_kernel.attention import attention as l4_attention
from L4_paged_kernel.fast.split_kv import split_kv_attention

H, H_KV, D, BLOCK_SIZE = 9, 3, 64, 16
SHAPES = ((1, 128), (1, 2048), (8, 2048), (32, 512))  # (sequences, context)
QUICK_SHAPES = ((1, 40), (3, 70))
REPEATS = 7


def decode_batch(batch: int, context: int, seed: int = 0):
    """One layer's pool holding ``batch`` sequences of ``context`` tokens on shuffled blocks, and a
    decode step for each: (pool, meta, q, k, v)."""
    g = torch.Generator().manual_seed(seed)
    n = -(-context // BLOCK_SIZE)
    pool = KvPool(1, batch * n, BLOCK_SIZE, H_KV, D)  # (1, num_blocks, block_size, H_kv, D)
    pool.k.normal_(generator=g)
    pool.v.normal_(generator=g)
    tables = torch.randperm(batch * n, generator=g).view(batch, n)  # (B, n): shuffled block ids
    meta = ForwardMeta(
        positions=torch.full((batch,), context - 1),
        slot_mapping=tables[:, -1] * BLOCK_SIZE + (context - 1) % BLOCK_SIZE,  # each new token's slot
        block_tables=tables,
        context_lens=torch.full((batch,), context),
        cu_q_lens=torch.arange(batch + 1),  # one query per sequence
        logits_at=torch.arange(batch),
    )
    q = torch.randn(batch, H, D, generator=g)  # (B, H, D)
    k, v = (torch.randn(batch, H_KV, D, generator=g) for _ in range(2))  # (B, H_kv, D) each
    return pool, meta, q, k, v


def measure(shapes, repeats: int) -> dict:
    """Median ms of each way per shape, each output checked against L3's first."""
    ways = {
        "L3 gather + SDPA": lambda pool, meta, q, k, v: l3_attention(pool, meta, 0, q, k, v),
        "L4 reference": lambda pool, meta, q, k, v: l4_attention(pool, meta, 0, q, k, v),
        "L4 decode tiles (fast/)": lambda pool, meta, q, k, v: l4_attention(
            pool, meta, 0, q, k, v, kernel=split_kv_attention
        ),
    }
    rows = []
    for batch, context in shapes:
        args = decode_batch(batch, context)
        expected = ways["L3 gather + SDPA"](*args)
        row = {"shape": f"{batch} x {context}"}
        for name, way in ways.items():
            error = (way(*args) - expected).abs().max().item()
            if error > 1e-5:
                raise AssertionError(f"{name} differs from L3 by {error:.1e} at {row['shape']}")
            row[name] = 1e3 * median_seconds(lambda way=way, args=args: way(*args), repeats)
        rows.append(row)
    return {
        "command": "python -m bench.reference_kernel",
        **provenance(),
        "machine": f"{cpu_name()}, {os.cpu_count()} cores",
        "torch": torch.__version__,
        "omp_wait_policy": OMP_WAIT_POLICY,
        "repeats": repeats,
        "load_average": os.getloadavg()[0],
        "rows": rows,
    }


def table(results: dict) -> str:
    """Markdown: a row per shape, each L4 way with its multiple of L3's time."""
    names = [k for k in results["rows"][0] if k != "shape"]
    lines = [f"| sequences x context | {' | '.join(names)} |", "|---" * (len(names) + 1) + "|"]
    for r in results["rows"]:
        base = r[names[0]]
        cells = [f"{base:.2f} ms"] + [f"{r[n]:.2f} ms ({r[n] / base:.1f}x)" for n in names[1:]]
        lines.append(f"| {r['shape']} | {' | '.join(cells)} |")
    lines += [
        "",
        f"{results['machine']}, torch {results['torch']} (OMP_WAIT_POLICY {results['omp_wait_policy']}), "
        f"median of {results['repeats']}; load average {results['load_average']:.1f} at the end.",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.reference_kernel", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--quick", action="store_true", help="two small shapes, two timed runs (for tests)")
    parser.add_argument(
        "--out", help="JSON file (default: bench/results/reference-kernel-cpu.json; none with --quick)"
    )
    args = parser.parse_args(argv)
    results = measure(QUICK_SHAPES if args.quick else SHAPES, 2 if args.quick else REPEATS)
    print(table(results))
    save_results(results, args.out, "reference-kernel-cpu.json", args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
