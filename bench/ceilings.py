"""What this machine can do at best, measured in the same run as the engines.

- copy bandwidth: ``dst.copy_(src)`` over a buffer far larger than the caches, counted as bytes read
  plus bytes written (the STREAM "copy" convention);
- fp32 matmul rate: a square ``torch.mm`` big enough to run at the BLAS library's full speed.

From these, two ceilings for a decoder (each decode token must read every weight once; each token
costs about 2 FLOPs per parameter):

    batch-1 ceiling (tokens/s)      = copy bandwidth / bytes of weights read per token
    large-batch ceiling (tokens/s)  = matmul FLOP/s / (2 * parameters)

and one per batched workload, which also pays for its prompts (``workload_ceiling``): on (u), 32
prompts of 128 tokens for 64 new tokens each, prefill is two thirds of the products.

Left out on purpose: cache-resident working sets, the attention's own reads (small next to the
weights at these lengths) and any overlap of compute with memory traffic.
"""

from __future__ import annotations

import statistics
import time

import torch


def run_seconds(fn, repeats: int) -> list[float]:
    """Wall time of each of ``repeats`` runs of ``fn()``, after one untimed warm-up run."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def median_seconds(fn, repeats: int) -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs, after one warm-up run."""
    return statistics.median(run_seconds(fn, repeats))


def copy_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes per second moved by a large tensor copy (read + write)."""
    src = torch.ones(megabytes * 2**20 // 4)
    dst = torch.empty_like(src)
    return 2 * src.nbytes / median_seconds(lambda: dst.copy_(src), repeats)


def matmul_flops(n: int = 2048, repeats: int = 5) -> float:
    """fp32 FLOP/s of an n x n by n x n matrix product (2 n^3 FLOPs)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n**3 / median_seconds(lambda: torch.mm(a, b), repeats)


def model_size(weights) -> tuple[int, int]:
    """(parameters, bytes) of a ``kvcourse.model.Weights``, a tied head counted once."""
    tensors = [weights.embed, weights.final_norm, weights.lm_head]
    tensors += [t for layer in weights.layers for t in vars(layer).values() if t is not None]
    unique = {id(t): t for t in tensors}.values()
    return sum(t.numel() for t in unique), sum(t.nbytes for t in unique)


def workload_ceiling(weights, prompts: list[list[int]], budgets: list[int], flops: float) -> dict:
    """The fewest matmul FLOPs a workload needs, and the tokens/s they allow at ``flops`` FLOP/s.

    Every prompt token and every new token but the last goes once through the layers (2 FLOPs per
    layer parameter); every new token needs one row of the head (2 FLOPs per head parameter). The
    attention's own products are left out, so the ceiling is generous. For one request of 3 prompt
    tokens and 2 new ones: 4 rows through the layers, 2 through the head.
    """
    layer_params = sum(t.numel() for layer in weights.layers for t in vars(layer).values() if t is not None)
    layer_rows = sum(len(p) + b - 1 for p, b in zip(prompts, budgets, strict=True))
    need = 2 * (layer_params * layer_rows + weights.lm_head.numel() * sum(budgets))
    return {"GFLOP": need / 1e9, "ceiling_tok_s": sum(budgets) * flops / need}


def measure(weights, quick: bool = False) -> dict:
    """Both machine rates and the two ceilings they imply for this model."""
    params, nbytes = model_size(weights)
    bandwidth = copy_bandwidth(64 if quick else 512, 2 if quick else 5)
    flops = matmul_flops(512 if quick else 2048, 2 if quick else 5)
    return {
        "copy_bandwidth_GBps": bandwidth / 1e9,
        "matmul_GFLOPs": flops / 1e9,
        "parameters": params,
        "weight_bytes": nbytes,
        "batch1_ceiling_tok_s": bandwidth / nbytes,
        "large_batch_ceiling_tok_s": flops / (2 * params),
    }
