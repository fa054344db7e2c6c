"""What this machine can do at best, measured in the same run as the engines, on the bench's device.

- copy bandwidth: ``dst.copy_(src)`` over a buffer far larger than the caches, counted as bytes read
  plus bytes written (the STREAM "copy" convention); on a GPU, a 2 GiB buffer in the GPU's memory;
- fp32 matmul rate: a square ``torch.mm`` big enough to run at the BLAS library's full speed (on a GPU
  in full fp32: ``kvcourse.devices`` turns TF32 off).

On a GPU every timed call is bracketed by ``torch.cuda.synchronize()`` (``synchronizer``): a launch
returns before its kernel ends, so a host timer alone would time the launch.

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


def synchronizer(device: torch.device | str):
    """What waits until the device has finished the work queued on it: ``torch.cuda.synchronize`` on
    a GPU; on a CPU nothing (every op has ended when it returns). E.g. ``synchronizer("cpu")()`` -> None."""
    if torch.device(device).type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def run_seconds(fn, repeats: int, sync=lambda: None) -> list[float]:
    """Wall time of each of ``repeats`` runs of ``fn()``, after one untimed warm-up run; ``sync()``
    (``synchronizer``) is called before each run starts and before its clock stops."""
    fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return times


def median_seconds(fn, repeats: int, sync=lambda: None) -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs, after one warm-up run."""
    return statistics.median(run_seconds(fn, repeats, sync))


def copy_bandwidth(megabytes: int = 512, repeats: int = 5, device="cpu") -> float:
    """Bytes per second moved by a large tensor copy on ``device`` (read + write)."""
    src = torch.ones(megabytes * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * src.nbytes / median_seconds(lambda: dst.copy_(src), repeats, synchronizer(device))


def matmul_flops(n: int = 2048, repeats: int = 5, device="cpu") -> float:
    """fp32 FLOP/s of an n x n by n x n matrix product (2 n^3 FLOPs) on ``device``."""
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    return 2 * n**3 / median_seconds(lambda: torch.mm(a, b), repeats, synchronizer(device))


def model_size(weights) -> tuple[int, int]:
    """(parameters, bytes) of a ``kvcourse.model.Weights``, a tied head counted once."""
    tensors = [weights.embed, weights.final_norm, weights.lm_head]
    tensors += [t for layer in weights.layers for t in vars(layer).values() if t is not None]
    unique = {id(t): t for t in tensors}.values()
    return sum(t.numel() for t in unique), sum(t.nbytes for t in unique)


def workload_ceiling(weights, prompts: list[list[int]], max_new_tokens: list[int], flops: float) -> dict:
    """The fewest matmul FLOPs a workload needs, and the tokens/s they allow at ``flops`` FLOP/s.

    Every prompt token and every new token but the last goes once through the layers (2 FLOPs per
    layer parameter); every new token needs one row of the head (2 FLOPs per head parameter). The
    attention's own products are left out, so the ceiling is generous. For one request of 3 prompt
    tokens and 2 new ones: 4 rows through the layers, 2 through the head.
    """
    layer_params = sum(t.numel() for layer in weights.layers for t in vars(layer).values() if t is not None)
    layer_rows = sum(len(p) + b - 1 for p, b in zip(prompts, max_new_tokens, strict=True))
    need = 2 * (layer_params * layer_rows + weights.lm_head.numel() * sum(max_new_tokens))
    return {"GFLOP": need / 1e9, "ceiling_tok_s": sum(max_new_tokens) * flops / need}


# (copy MiB, matmul n, repeats) per device type. A GPU copies 2 GiB in about a millisecond and a half
# (arithmetic: 2 GiB read and 2 GiB written at the 2,993 GB/s quoted from the H100), long enough that a launch and a synchronize are noise; its
# fp32 rate needs a product far larger than a CPU's.
SIZES = {"cpu": (512, 2048, 5), "cuda": (2048, 8192, 10)}
QUICK_SIZES = (64, 512, 2)


def measure(weights, quick: bool = False, device="cpu") -> dict:
    """Both rates of ``device`` and the two ceilings they imply for this model."""
    params, nbytes = model_size(weights)
    gpu = torch.device(device).type == "cuda"
    megabytes, n, repeats = QUICK_SIZES if quick else SIZES["cuda" if gpu else "cpu"]
    bandwidth = copy_bandwidth(megabytes, repeats, device)
    flops = matmul_flops(n, repeats, device)
    return {
        "device": str(device),
        "copy_bandwidth_GBps": bandwidth / 1e9,
        "copy_convention": f"bytes read + bytes written (STREAM copy) of a {megabytes} MiB fp32 tensor",
        "matmul_GFLOPs": flops / 1e9,
        "matmul_convention": f"fp32 {n} x {n} by {n} x {n}, 2 n^3 FLOPs" + (", TF32 off" if gpu else ""),
        "parameters": params,
        "weight_bytes": nbytes,
        "batch1_ceiling_tok_s": bandwidth / nbytes,
        "large_batch_ceiling_tok_s": flops / (2 * params),
    }
