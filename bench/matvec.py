"""Why batch-1 decode stays below the bandwidth ceiling: ``python -m bench.matvec [--model DIR] [--quick]
[--rows N] [--out FILE]``.

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

``--rows N`` multiplies N rows at once instead of one (32: a decode step of 32 sequences; 4096: the
prefill of 32 prompts of 128 tokens), the products a batched step makes; the table then adds each
library's rate in GFLOP/s (2 x N x out x in FLOPs a product) and XLA's time over torch's. Where one
library's matrix products are faster than the other's on a processor, every stage built on it is too:
this is the measurement behind "L6 trails L3 on one CPU and leads on another" (#47). ``--out FILE``
also writes the rows, the copy bandwidth, the machine and the commit as JSON.

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
from bench.measure import cpu_name, cpu_ticks, provenance, save_results, stolen
from kvcourse.config import ModelConfig
from kvcourse.jax_model import linear
from kvcourse.model import Weights, load_weights
from kvcourse.model_store import resolve_model_dir

MAX_ROWS = 16384  # rows a product may take: 16,384 x 1,536 fp32 is 100 MB, the head's output 3.2 GB
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


def torch_chain(ws: list[torch.Tensor], rows: int = 1):
    """Run ``F.linear`` with every matrix of ``ws`` (out, in) in turn on ``rows`` rows."""
    x0 = torch.randn(rows, ws[0].shape[1])  # (rows, in)

    def run():
        x = x0
        for w in ws:
            x = x + 1e-30 * F.linear(x, w).sum()  # (rows, in)
        return x

    return run


def xla_chain(ws: list[torch.Tensor], rows: int = 1):
    """The same products as ``torch_chain``, jit'd, on (in, out) copies as L6 stores them."""
    ws_t = tuple(jnp.asarray(w.numpy().T) for w in ws)  # each (in, out)
    x0 = jnp.asarray(torch.randn(rows, ws[0].shape[1]).numpy())  # (rows, in)

    @jax.jit
    def chain(x, ws_t):
        for w in ws_t:
            x = x + 1e-30 * linear(x, w).sum()  # (rows, in)
        return x

    return lambda: chain(x0, ws_t).block_until_ready()


def measure(weights: Weights, repeats: int, rows: int = 1) -> list[dict]:
    """One row per weight group, then the whole token (or step of ``rows`` tokens): products, MB read,
    GFLOPs, and each library's time."""
    groups = []
    for name, ws in weight_groups(weights).items():
        row = {"weight": name, "shape": tuple(ws[0].shape), "products": len(ws),
               "MB": sum(w.nbytes for w in ws) / 1e6, "GFLOP": 2 * rows * sum(w.numel() for w in ws) / 1e9}  # fmt: skip
        for lib, chain in (("torch", torch_chain), ("XLA", xla_chain)):
            seconds, cores = timed(chain(ws, rows), repeats)
            row[lib] = {"seconds": seconds, "cores": cores}
        groups.append(row)
    whole = {"weight": "whole token" if rows == 1 else f"whole step of {rows} rows",
             "shape": None, "products": sum(r["products"] for r in groups), "MB": sum(r["MB"] for r in groups),
             "GFLOP": sum(r["GFLOP"] for r in groups)}  # fmt: skip
    for lib in ("torch", "XLA"):
        seconds = sum(r[lib]["seconds"] for r in groups)
        cpu = sum(r[lib]["seconds"] * r[lib]["cores"] for r in groups)
        whole[lib] = {"seconds": seconds, "cores": cpu / seconds}
    return groups + [whole]


def table(rows: list[dict], copy_GBps: float) -> str:
    """Markdown: per group, microseconds per product, GB/s read and cores busy in each library; for
    products of several rows (``--rows``), milliseconds per product, GFLOP/s and cores busy, and XLA's
    time over torch's (above 1: XLA is slower)."""
    batched = rows[-1]["weight"] != "whole token"
    if batched:
        head = ("| weight | shape (out x in) | products per step | torch ms each | torch GFLOP/s | torch cores "
                "| XLA ms each | XLA GFLOP/s | XLA cores | XLA / torch time |")  # fmt: skip
    else:
        head = ("| weight | shape (out x in) | products per token | MB read | torch us each | torch GB/s | torch cores "
                "| XLA us each | XLA GB/s | XLA cores |")  # fmt: skip
    lines = [head, "|---" * head.count(" | ") + "|---|"]
    for r in rows:
        shape = "-" if r["shape"] is None else " x ".join(map(str, r["shape"]))
        cells = [r["weight"], shape, str(r["products"])] + ([] if batched else [f"{r['MB']:.1f}"])
        for lib in ("torch", "XLA"):
            s, cores = r[lib]["seconds"], r[lib]["cores"]
            each, rate = (1e3 * s, r["GFLOP"] / s) if batched else (1e6 * s, r["MB"] / 1e3 / s)
            cells += [f"{each / r['products']:.{2 if batched else 1}f}", f"{rate:.1f}", f"{cores:.2f}"]
        if batched:
            cells.append(f"{r['XLA']['seconds'] / r['torch']['seconds']:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    if batched:
        return "\n".join(lines)
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
    parser.add_argument("--rows", type=int, default=1, help="rows each product multiplies (default 1: a decode token)")
    parser.add_argument("--out", help="also write the rows as JSON to this file")
    args = parser.parse_args(argv)
    repeats = (2 if args.quick else 9) if args.repeats is None else args.repeats
    if repeats < 1:
        parser.error(f"--repeats must be >= 1, got {repeats}")
    if not 1 <= args.rows <= MAX_ROWS:
        parser.error(f"--rows must be between 1 and {MAX_ROWS}, got {args.rows}")
    if args.quick and not args.model:
        import tempfile

        from kvcourse.harness.tiny import make_tiny_checkpoint

        model_dir = make_tiny_checkpoint("llama", tempfile.mkdtemp(prefix="kvcourse-matvec-"))
    else:
        model_dir = resolve_model_dir(args.model)
    torch.manual_seed(0)
    weights = load_weights(model_dir, ModelConfig.from_dir(model_dir))
    ticks = cpu_ticks()
    rows = measure(weights, repeats, args.rows)
    steal = stolen(ticks, cpu_ticks())
    copy_GBps = copy_bandwidth(64 if args.quick else 512, 2 if args.quick else 5) / 1e9
    print(table(rows, copy_GBps) + f"\n\nThis machine has {os.cpu_count()} cores.")
    if args.out:
        command = "python -m bench.matvec" + (f" --rows {args.rows}" if args.rows > 1 else "")
        results = {"command": command + f" --out {args.out}", **provenance(),
                   "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "torch": torch.__version__,
                               "jax": jax.__version__, "torch_threads": torch.get_num_threads()},
                   "steal": steal, "rows": args.rows, "repeats": repeats, "copy_bandwidth_GBps": copy_GBps,
                   "groups": rows}  # fmt: skip
        save_results(results, args.out, "", args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
