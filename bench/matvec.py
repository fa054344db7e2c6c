"""Why batch-1 decode stays below the bandwidth ceiling: ``python -m bench.matvec [--model DIR] [--quick]``.

A batch-1 decode step multiplies one row by every weight matrix of the model, so the fastest it can
be is the time to read the weights once (the batch-1 ceiling of ``bench/ceilings.py``). This script
times those matrix-vector products alone, one group per weight name (``q_proj`` ... ``lm_head``),
in the two libraries the stages use: PyTorch's ``F.linear`` (L1-L5, ``kvcourse/model.py``) and
XLA's jit'd ``x @ w`` (L6, ``kvcourse/jax_model.linear``). For each group it prints how many such
products one token makes, the microseconds each takes, the rate it reads its weights at, and the
cores busy while it runs (process CPU time over wall time). The last row is the whole token, next to
the copy bandwidth measured in the same run. ``make bench`` runs it too, as part (f).

Each group's products run one after another, each input depending on the previous output
(``x + 1e-30 * y.sum()``), so neither library can skip, merge or overlap them: they run as the
layers of a decode step do. The chain's sum and add read ``out + in`` floats against the product's
``out x in`` weights (arithmetic: 0.35% for ``q_proj``'s 576 x 576), so they add little.

Left out on purpose: the model's other work (norms, RoPE, attention, the engines' bookkeeping), which
``python -m bench.profile`` times inside the engines.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
import torch
import torch.nn.functional as F

from bench.ceilings import copy_bandwidth
from kvcourse.config import ModelConfig
from kvcourse.jax_model import linear
from kvcourse.model import Weights, load_weights
from kvcourse.model_store import resolve_model_dir

LAYER_WEIGHTS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def weight_groups(weights: Weights) -> dict[str, list[torch.Tensor]]:
    """Every matrix a decode token multiplies by, grouped by name, in torch's (out, in) layout.

    Example, a 2-layer model: ``{"q_proj": [layer 0's, layer 1's], ..., "lm_head": [the head]}``.
    """
    groups = {name: [getattr(layer, name) for layer in weights.layers] for name in LAYER_WEIGHTS}
    return groups | {"lm_head": [weights.lm_head]}


def timed(fn, repeats: int) -> tuple[float, float]:
    """(median wall seconds, cores busy) of ``repeats`` runs of ``fn()`` after one untimed warm-up run.

    Cores busy is the process's CPU time over the wall time, summed over the runs: 1.0 means one core
    busy throughout, 2.0 two.
    """
    fn()
    walls, cpu = [], 0.0
    for _ in range(repeats):
        wall0, cpu0 = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - wall0)
        cpu += time.process_time() - cpu0
    return statistics.median(walls), cpu / sum(walls)


def torch_chain(ws: list[torch.Tensor]):
    """Run ``F.linear`` with every matrix of ``ws`` (out, in) in turn on one row."""
    x0 = torch.randn(1, ws[0].shape[1])  # (1, in)

    def run():
        x = x0
        for w in ws:
            x = x + 1e-30 * F.linear(x, w).sum()  # (1, in)
        return x

    return run


def xla_chain(ws: list[torch.Tensor]):
    """The same products as ``torch_chain``, jit'd, on (in, out) copies as L6 stores them."""
    ws_t = tuple(jnp.asarray(w.numpy().T) for w in ws)  # each (in, out)
    x0 = jnp.asarray(torch.randn(1, ws[0].shape[1]).numpy())  # (1, in)

    @jax.jit
    def chain(x, ws_t):
        for w in ws_t:
            x = x + 1e-30 * linear(x, w).sum()  # (1, in)
        return x

    return lambda: chain(x0, ws_t).block_until_ready()


def measure(weights: Weights, repeats: int) -> list[dict]:
    """One row per weight group, then the whole token: products, MB read, and each library's time."""
    rows = []
    for name, ws in weight_groups(weights).items():
        row = {"weight": name, "shape": tuple(ws[0].shape), "products": len(ws),
               "MB": sum(w.nbytes for w in ws) / 1e6}  # fmt: skip
        for lib, chain in (("torch", torch_chain), ("XLA", xla_chain)):
            seconds, cores = timed(chain(ws), repeats)
            row[lib] = {"seconds": seconds, "cores": cores}
        rows.append(row)
    whole = {"weight": "whole token", "shape": None, "products": sum(r["products"] for r in rows),
             "MB": sum(r["MB"] for r in rows)}  # fmt: skip
    for lib in ("torch", "XLA"):
        seconds = sum(r[lib]["seconds"] for r in rows)
        cpu = sum(r[lib]["seconds"] * r[lib]["cores"] for r in rows)
        whole[lib] = {"seconds": seconds, "cores": cpu / seconds}
    return rows + [whole]


def table(rows: list[dict], copy_GBps: float) -> str:
    """Markdown: per group, microseconds per product, GB/s read and cores busy in each library."""
    lines = [
        "| weight | shape (out x in) | products per token | MB read | torch us each | torch GB/s | torch cores "
        "| XLA us each | XLA GB/s | XLA cores |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        shape = "-" if r["shape"] is None else " x ".join(map(str, r["shape"]))
        cells = [r["weight"], shape, str(r["products"]), f"{r['MB']:.1f}"]
        for lib in ("torch", "XLA"):
            s, cores = r[lib]["seconds"], r[lib]["cores"]
            cells += [f"{1e6 * s / r['products']:.1f}", f"{r['MB'] / 1e3 / s:.1f}", f"{cores:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    whole = rows[-1]
    lines.append(
        f"\nOne token's products: torch {1e3 * whole['torch']['seconds']:.1f} ms, XLA "
        f"{1e3 * whole['XLA']['seconds']:.1f} ms; reading {whole['MB']:.0f} MB at the copy bandwidth "
        f"measured in the same run ({copy_GBps:.1f} GB/s) takes {whole['MB'] / copy_GBps:.1f} ms."
    )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.matvec", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, two timed runs (for tests)")
    parser.add_argument("--model", help="model directory (default: the course model)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per group (default 9, quick 2)")
    args = parser.parse_args(argv)
    repeats = (2 if args.quick else 9) if args.repeats is None else args.repeats
    if repeats < 1:
        parser.error(f"--repeats must be >= 1, got {repeats}")
    if args.quick and not args.model:
        import tempfile

        from kvcourse.harness.tiny import make_tiny_checkpoint

        model_dir = make_tiny_checkpoint("llama", tempfile.mkdtemp(prefix="kvcourse-matvec-"))
    else:
        model_dir = resolve_model_dir(args.model)
    torch.manual_seed(0)
    weights = load_weights(model_dir, ModelConfig.from_dir(model_dir))
    rows = measure(weights, repeats)
    copy_GBps = copy_bandwidth(64 if args.quick else 512, 2 if args.quick else 5) / 1e9
    print(table(rows, copy_GBps) + f" This machine has {os.cpu_count()} cores.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
