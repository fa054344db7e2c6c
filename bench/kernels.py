"""The paged-attention kernel alone, at decode shapes, against the machine's copy bandwidth:
``python -m bench.kernels [--device auto|cpu|cuda] [--sweep] [--resources] [--quick] [--out FILE]``.

One decode step of attention (one query token per sequence, every sequence the same history) done
three ways, each checked against dense attention before it is timed:

- ``paged kernel``: L4's kernel reading the pool in place, the Triton one on a GPU (in its default
  launch shape, and with ``--sweep`` in every shape of ``SWEEP``, the fastest reported), the C++ one
  on a CPU (Triton's interpreter times nothing worth reading: it runs there only with ``--quick``, to
  check the code);
- ``gather + SDPA``: L3's way: copy each sequence's blocks into contiguous K/V (``k_pool[tables]``),
  then PyTorch's ``scaled_dot_product_attention``;
- ``SDPA contiguous``: K/V already contiguous per sequence, as a dense cache keeps them: the peer a
  paged kernel has to beat on a GPU.

A row's bandwidth is the K/V bytes the attention must read (sequences x history x KV heads x head dim x
4 bytes, for K and for V) over its time, also as a share of the copy bandwidth measured in the same run
(``bench.ceilings``: bytes read plus bytes written, the STREAM convention, so 100% is not a hard
limit for a read-only kernel). Times on a GPU come from ``triton.testing.do_bench`` (the median of
repeated launches timed with CUDA events, the L2 cache flushed between them); on a CPU, the median of
wall times. The shapes (``SHAPES``) are DESIGN.md's: SmolLM2's 9 query / 3 KV heads of 64, an 8B
model's 32 / 8 of 128, up to 256 sequences x 4,096 positions and 8 x 32,768, blocks of 16.

``--resources`` needs no GPU: it compiles each launch shape of ``SWEEP`` for an H100 (``sm_90``) and
asks NVIDIA's assembler (``ptxas -v``, shipped with Triton) how many registers a thread needs and how
many bytes spill to memory, and from the registers how many programs fit on one multiprocessor.

Results: one JSON file (``--out``, default ``bench/results/kernels.json``, ``kernels-cuda.json`` for a GPU's)
and a table on stdout.
``make bench`` runs it (without the sweep) after ``bench.run``, in a process of its own. A wrong output fails the run
(exit status 1) after the results are written.

Left out on purpose: prefill shapes (compute-bound; the engines' workloads time them), fp16/bf16,
and ragged histories (each row of a shape has one length, so the contiguous peer needs no mask).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench import ceilings
from bench.measure import add_device_option, bench_device, cpu_name, package_version
from kvcourse.harness.kernel_cases import dense_reference, make_case
from kvcourse.model_store import REPO_ROOT

BLOCK_SIZE = 16
# (sequences, positions of history each, query heads, KV heads, head dim)
SHAPES = (
    (32, 512, 9, 3, 64),
    (32, 4096, 9, 3, 64),
    (256, 4096, 9, 3, 64),
    (64, 4096, 32, 8, 128),
    (8, 32768, 32, 8, 128),
)
CPU_SHAPES = SHAPES[:2] + ((64, 4096, 32, 8, 128),)  # the CPU has the bandwidth for these in seconds
QUICK_SHAPES = ((4, 48, 9, 3, 16), (2, 70, 8, 2, 32))
TOLERANCE = 2e-5  # max |output - dense attention|, as in the kernel tests


def sweep_configs(quick: bool = False) -> list[dict]:
    """The launch shapes ``--sweep`` times: tiles of 16-64 positions, 4 or 8 warps, 1-3 pipeline stages."""
    if quick:
        return [
            {"tile_n": 16, "num_warps": 4, "num_stages": 1},
            {"tile_n": 64, "num_warps": 8, "num_stages": 3},
        ]
    return [
        {"tile_n": tile, "num_warps": warps, "num_stages": stages}
        for tile in (16, 32, 64)
        for warps in (4, 8)
        for stages in (1, 2, 3)
    ]


def kv_bytes(shape) -> int:
    """Bytes of K and V one decode step must read: ``kv_bytes((32, 512, 9, 3, 64))`` -> 25,165,824."""
    seqs, ctx, _, n_kv, head_dim = shape
    return 2 * seqs * ctx * n_kv * head_dim * 4


def shape_name(shape) -> str:
    seqs, ctx, heads, n_kv, head_dim = shape
    return f"{seqs} x {ctx:,} ({heads}/{n_kv} x {head_dim})"


def device_seconds(fn, device: torch.device, quick: bool) -> float:
    """Median seconds of ``fn()``: CUDA events with the L2 flushed between launches on a GPU (Triton's
    ``do_bench``), wall time on a CPU."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=10, rep=20 if quick else 100, return_mode="median") / 1e3
    return ceilings.median_seconds(fn, 2 if quick else 5)  # a CPU has ended every op when it returns


def contiguous_kv(k_pool, v_pool, block_tables, ctx: int):
    """(B, H_kv, ctx, D) K and V of every sequence of length ``ctx``, gathered from the pool (L3's copy)."""
    tables = block_tables[:, : -(-ctx // BLOCK_SIZE)]  # (B, blocks)
    k = k_pool[tables].flatten(1, 2)[:, :ctx].transpose(1, 2)  # (B, blocks, bs, H_kv, D) -> (B, H_kv, ctx, D)
    v = v_pool[tables].flatten(1, 2)[:, :ctx].transpose(1, 2)
    return k, v


def sdpa(q, k, v):
    """q: (B, H, D), one decode token per sequence; k, v: (B, H_kv, ctx, D). Returns (B, H, D)."""
    out = F.scaled_dot_product_attention(q[:, :, None, :], k, v, enable_gqa=True)  # (B, H, 1, D)
    return out[:, :, 0, :]


def paged_kernels(device: torch.device, quick: bool) -> dict:
    """L4's paged kernels worth timing on ``device``, by row name: Triton on a GPU (and on the CPU with
    ``--quick``, interpreted, to check the code), C++ on a CPU where ``make setup`` built it."""
    found = {}
    if device.type == "cuda" or quick:
        try:
            from L4_paged_kernel.fast.triton_paged_attention import triton_paged_attention
        except ImportError:  # no triton on this platform
            pass
        else:
            found["paged kernel (Triton)"] = triton_paged_attention
    if device.type == "cpu":
        from kvcourse.cpp_kernels import build_problem
        from L4_paged_kernel.fast.cpp_paged_attention import SOURCE, cpp_paged_attention

        if build_problem(SOURCE) is None:
            found["paged kernel (C++)"] = cpp_paged_attention
    return found


def decode_case(shape, device: torch.device) -> tuple:
    """``make_case``'s tensors for one decode step of ``shape``: a random pool with shuffled blocks, every
    sequence ``ctx`` positions long, one query token each."""
    seqs, ctx, heads, n_kv, head_dim = shape
    return make_case(BLOCK_SIZE, heads, n_kv, [ctx] * seqs, [1] * seqs, head_dim=head_dim, device=device)


def programs_per_sm(registers: int, warps: int, shared_bytes: int) -> int:
    """Programs one H100 multiprocessor can hold at once: 65,536 registers handed out to warps 256 at a
    time, 64 warps, 32 programs, 228 KiB of shared memory. Example: 128 registers a thread, 4 warps ->
    4096 registers a warp, 16 warps -> 4 programs."""
    per_warp = -(-registers * 32 // 256) * 256
    by_registers = 65536 // per_warp // warps
    by_shared = 228 * 1024 // shared_bytes if shared_bytes else 32
    return min(by_registers, 64 // warps, 32, by_shared)


def resources(
    configs: list[dict], head_shapes=((9, 3, 64), (32, 8, 128)), capability: int = 90
) -> list[dict]:
    """Registers a thread, spilled bytes and programs per multiprocessor of each launch shape, compiled for
    ``sm_<capability>`` without a GPU. Raises RuntimeError naming what is missing where Triton has no
    NVIDIA backend or no ``ptxas``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from L4_paged_kernel.fast.triton_paged_attention import KERNELS

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        raise RuntimeError(f"no ptxas at {ptxas} (this triton has no NVIDIA backend)")
    kernel = KERNELS[False][0]
    pointers = {"q_ptr", "k_ptr", "v_ptr", "out_ptr", "m_ptr", "l_ptr", "acc_ptr"}
    ints = {"block_tables_ptr", "context_lens_ptr", "cu_q_lens_ptr"}

    def arg_type(name: str) -> str:
        if name in pointers:
            return "*fp32"
        if name in ints:
            return "*i32"
        return "fp32" if name == "scale" else "constexpr" if name.isupper() else "i32"

    rows = []
    for heads, n_kv, head_dim in head_shapes:
        for config in configs:
            constants = {"G": heads // n_kv, "BLOCK_SIZE": BLOCK_SIZE, "HEAD_DIM": head_dim, "NUM_SPLITS": 1,
                         "BLOCK_M": 16, "TILE_N": config["tile_n"], "BLOCK_D": head_dim}  # fmt: skip
            source = ASTSource(
                kernel, signature={n: arg_type(n) for n in kernel.arg_names}, constexprs=constants
            )
            options = {
                "enable_fp_fusion": False,
                "num_warps": config["num_warps"],
                "num_stages": config["num_stages"],
            }
            binary = triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options)
            with tempfile.TemporaryDirectory() as tmp:
                ptx = Path(tmp) / "kernel.ptx"
                ptx.write_text(binary.asm["ptx"])
                report = subprocess.run(
                    [
                        str(ptxas),
                        "-v",
                        f"--gpu-name=sm_{capability}a",
                        str(ptx),
                        "-o",
                        str(Path(tmp) / "k.cubin"),
                    ],
                    capture_output=True,
                    text=True,
                    check=True,
                ).stderr
            registers = int(re.search(r"Used (\d+) registers", report)[1])
            warps = config["num_warps"]
            rows.append(
                {
                    "heads": f"{heads}/{n_kv} x {head_dim}",
                    **config,
                    "registers": registers,
                    "spill_bytes": int(re.search(r"(\d+) bytes spill stores", report)[1]),
                    "programs_per_sm": programs_per_sm(registers, warps, binary.metadata.shared),
                    "shared_bytes": binary.metadata.shared,
                }
            )
    return rows


def measure_shape(shape, device: torch.device, sweep: bool, quick: bool, bandwidth: float) -> list[dict]:
    """Every system on one decode shape: checked against dense attention, then timed."""
    ctx = shape[1]
    case = decode_case(shape, device)
    expected = dense_reference(*case)
    k, v = contiguous_kv(*case[1:4], ctx)
    runs = {name: (lambda fn=fn: fn(*case)) for name, fn in paged_kernels(device, quick).items()}
    runs["gather + SDPA"] = lambda: sdpa(case[0], *contiguous_kv(*case[1:4], ctx))
    runs["SDPA contiguous"] = lambda: sdpa(case[0], k, v)
    if sweep and "paged kernel (Triton)" in runs:
        from L4_paged_kernel.fast.triton_paged_attention import LaunchConfig, triton_paged_attention

        for config in sweep_configs(quick):
            for splits in (1, "auto"):
                name = "Triton tile {tile_n}, {num_warps} warps, {num_stages} stages".format(**config)
                launch = LaunchConfig(**config)
                runs[f"{name}, splits {splits}"] = lambda c=launch, s=splits: triton_paged_attention(
                    *case, num_splits=s, config=c
                )
    rows = []
    for name, run in runs.items():
        error = (run() - expected).abs().max().item()
        seconds = device_seconds(run, device, quick) if error < TOLERANCE else math.nan
        rows.append({"shape": shape_name(shape), "system": name, "max_error": error,
                     "ms": seconds * 1e3, "GBps": kv_bytes(shape) / seconds / 1e9,
                     "of_copy": kv_bytes(shape) / seconds / bandwidth})  # fmt: skip
    return rows


def measure(device: torch.device, shapes, sweep: bool, quick: bool) -> dict:
    """The kernel table: every system on every shape, and the copy bandwidth of the same run."""
    megabytes, _, repeats = ceilings.QUICK_SIZES if quick else ceilings.SIZES[device.type]
    bandwidth = ceilings.copy_bandwidth(megabytes, repeats, device)
    rows = []
    for shape in shapes:
        rows += measure_shape(shape, device, sweep, quick, bandwidth)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the next shape's pool may need the memory this one held
    return {"copy_bandwidth_GBps": bandwidth / 1e9, "rows": rows}


def table(results: dict) -> str:
    """Markdown, a row per (shape, system); of the sweep, its fastest launch and any wrong one."""
    lines = [
        f"Kernel table on {results['device_name']} (copy bandwidth {results['copy_bandwidth_GBps']:,.0f} GB/s, "
        "bytes read + written):",
        "",
        "| decode shape | system | ms | K/V GB/s | of copy bandwidth | max error |",
        "|---|---|---|---|---|---|",
    ]

    def line(r: dict, name: str) -> str:
        timing = (
            "WRONG | - | -"
            if math.isnan(r["ms"])
            else f"{r['ms']:.3f} | {r['GBps']:,.0f} | {r['of_copy']:.0%}"
        )
        return f"| {r['shape']} | {name} | {timing} | {r['max_error']:.1e} |"

    for shape in dict.fromkeys(r["shape"] for r in results["rows"]):
        rows = [r for r in results["rows"] if r["shape"] == shape]
        swept = [r for r in rows if r["system"].startswith("Triton tile")]
        lines += [line(r, r["system"]) for r in rows if r not in swept or math.isnan(r["ms"])]
        timed = [r for r in swept if not math.isnan(r["ms"])]
        if timed:
            best = min(timed, key=lambda r: r["ms"])
            launch = best["system"].removeprefix("Triton ")
            lines.append(line(best, f"Triton, fastest of {len(swept)} launches: {launch}"))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.kernels", description=__doc__.splitlines()[0])
    add_device_option(parser, "the kernels run")
    parser.add_argument(
        "--sweep", action="store_true", help="also time every launch shape of the Triton kernel"
    )
    parser.add_argument(
        "--resources", action="store_true", help="registers and spills per launch shape (no GPU)"
    )
    parser.add_argument("--quick", action="store_true", help="tiny shapes (for tests)")
    parser.add_argument(
        "--out", help="the JSON file (default: bench/results/kernels.json, kernels-cuda.json on a GPU)"
    )
    args = parser.parse_args(argv)
    if args.resources:
        try:
            rows = resources(sweep_configs(args.quick))
        except (ImportError, RuntimeError) as e:
            print(f"error: --resources needs Triton's NVIDIA backend: {e}", file=sys.stderr)
            return 2
        print("| heads | tile | warps | stages | registers | spilled bytes | programs per SM |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['heads']} | {r['tile_n']} | {r['num_warps']} | {r['num_stages']} | {r['registers']} | "
                  f"{r['spill_bytes']} | {r['programs_per_sm']} |")  # fmt: skip
        return 0
    try:
        device = bench_device(args.device)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    shapes = QUICK_SHAPES if args.quick else SHAPES if device.type == "cuda" else CPU_SHAPES
    results = measure(device, shapes, args.sweep, args.quick)
    results["device_name"] = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    results["versions"] = {name: package_version(name) for name in ("torch", "triton")}
    results["when"] = time.strftime("%Y-%m-%d %H:%M:%S")
    default = "kernels-cuda.json" if device.type == "cuda" else "kernels.json"
    out = Path(args.out or REPO_ROOT / "bench" / "results" / default)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))
    wrong = [
        f"{r['shape']}: {r['system']} ({r['max_error']:.1e})" for r in results["rows"] if math.isnan(r["ms"])
    ]
    if wrong:
        print("kernels FAILED: outputs differ from dense attention:\n  " + "\n  ".join(wrong))
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
