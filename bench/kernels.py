"""The paged-attention kernel alone, at decode shapes against the machine's copy bandwidth, and at
prefill shapes with and without query tiles:
``python -m bench.kernels [--device auto|cpu|cuda] [--prefill] [--sweep] [--resources] [--quick] [--out FILE]``
and ``python -m bench.kernels --interpreter [--quick]``.

One decode step of attention (one query token per sequence, every sequence the same history) done
three ways, each checked against dense attention before it is timed:

- ``paged kernel``: L4's kernel reading the pool in place, the Triton one on a GPU (in its default
  launch, with splits chosen by shape; then, in ``DECODE_LAUNCHES``, the launch it had before the
  prefetch, the splits and the 3xTF32 dots, and that launch with each of the three alone, so one run
  times before and after; with ``--sweep`` in every shape of ``sweep_configs``, the fastest
  reported), the C++ one on a CPU (Triton's interpreter times nothing worth reading: it runs there
  only with ``--quick``, to check the code);
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

``--prefill``: one prefill step of attention instead (every sequence a prompt of the same length,
causal), on ``PREFILL_SHAPES``: the Triton kernel with query tiles in its grid (in its default launch,
in ``PREFILL_LAUNCHES``' launch before 8 warps and 3xTF32 dots and the default with IEEE dots, and
with ``--sweep`` in every shape of ``prefill_sweep_configs``), the same kernel as it was before
query tiles (``bench/triton_sequence_grid.py``: one program per sequence and KV head), the C++ kernel
on a CPU, and SDPA over contiguous K/V with its causal mask. A row's rate is the attention's
floating-point operations (4 x heads x head dim per visible query-key pair) over its time; the
``x before`` column is the sequence-grid kernel's time over the row's. On a GPU this is the measure
of issue 38's target: a 2,000-token prefill at least 5x faster with query tiles than without.

``--interpreter`` runs on the CPU whatever ``--device`` says: Triton's interpreter on one layer's
attention for a prompt (SmolLM2's 9/3 heads of 64), from the kernel as it was to the kernel as it is,
a step at a time: one program per sequence with combine functions of its own, query tiles with the
same combine functions, query tiles with ``tl.max``'s and ``tl.sum``'s (which the interpreter reduces
with NumPy), and query tiles in the interpreter's own launch shape (``choose_launch``). One run each,
on the longest prompt of ``INTERPRETER_PROMPTS`` that the step was given.

``--resources`` needs no GPU: it compiles the attention kernel for an H100 (``sm_90``) in each Triton
launch the table runs (``DECODE_LAUNCHES``; ``--prefill``: ``PREFILL_LAUNCHES``; with ``--sweep``,
each launch of the sweep instead) on each shape of the table, as the JIT compiles that launch
(``jit_source``): the arguments' values specialize the build (a pointer or an integer that is a
multiple of 16 is marked so, an integer equal to 1 becomes a constant), and a build without that is
another kernel (216 registers a thread at 9/3 x 64 in the launch before the prefetch, where the
JIT's build takes 62). From the binary (``cuobjdump``, shipped with Triton) it reads the registers a
thread and the bytes of local memory a thread (where spills go), the numbers the driver reports when
it loads the kernel, from the registers how many programs fit on one multiprocessor, and from the
machine code where the key loop's global loads sit among its dot instructions (``key_loop``). With
``--out`` it writes them as JSON too (``bench/results/kernel-resources.json``). On a GPU, every row
of the decode and prefill tables that ran a compiled Triton
kernel records that kernel's registers and local bytes as the driver reported them (``registers``,
``local_bytes``: the tables' last column).

Results: one JSON file (``--out``, default ``bench/results/kernels.json``, ``kernels-cuda.json`` for a
GPU's; ``kernels-prefill[-cuda].json`` with ``--prefill``, ``kernels-interpreter.json`` with
``--interpreter``) and a table on stdout. On a CPU a timed row is the median of 5 runs and keeps
every run's milliseconds (``ms_runs``), which the tables show in brackets, fastest and slowest; on a
GPU it is ``do_bench``'s median.
``make bench`` runs it (without the sweep) after ``bench.run``, in a process of its own. A wrong output fails the run
(exit status 1) after the results are written.

Left out on purpose: fp16/bf16, ragged histories and prompts (each row of a shape has one length, so
the contiguous peer needs no mask), prefill chunks after a history (the kernel tests check them;
the engines' workloads time them), and ``--resources`` for split launches (it compiles one split; a
GPU run records the kernels of its split rows).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench import OMP_WAIT_POLICY, ceilings
from bench.measure import add_device_option, chosen_device, cpu_name, package_version, provenance
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
# (sequences, prompt tokens each, query heads, KV heads, head dim): one prefill step
PREFILL_SHAPES = (
    (1, 2048, 9, 3, 64),
    (4, 512, 9, 3, 64),
    (1, 8192, 9, 3, 64),
    (1, 2048, 32, 8, 128),
    (8, 1024, 32, 8, 128),
)
CPU_PREFILL_SHAPES = PREFILL_SHAPES[:2]
QUICK_PREFILL_SHAPES = ((1, 24, 9, 3, 16), (2, 13, 8, 2, 32))
# --interpreter: prompt lengths, and the longest each step of INTERPRETER_STEPS is given (the steps
# before the NumPy reductions take minutes past a few hundred tokens)
INTERPRETER_PROMPTS = (128, 2048)
QUICK_INTERPRETER_PROMPTS = (24, 40)
TOLERANCE = 2e-5  # max |output - dense attention|, as in the kernel tests


# The Triton launches of the decode table, by row name: (launch fields, or None for choose_launch's;
# num_splits). The first is the kernel's default; "before" is the launch every GPU run had until the
# loop prefetched (one split, 16 x 32, 4 warps, 2 stages, IEEE dots); each "before +" row adds one of
# the three changes to it, alone.
BEFORE_LAUNCH = {"block_m": 16, "tile_n": 32, "num_warps": 4, "num_stages": 2, "prefetch": False,
                 "precision": "ieee"}  # fmt: skip
DECODE_LAUNCHES = {
    "paged kernel (Triton)": (None, "auto"),
    "Triton before: 1 split, 16 x 32, IEEE dots": (BEFORE_LAUNCH, 1),
    "Triton before + splits auto": (BEFORE_LAUNCH, "auto"),
    "Triton before + prefetch (16 x 16, 1 stage)": (
        BEFORE_LAUNCH | {"tile_n": 16, "num_stages": 1, "prefetch": True}, 1),
    "Triton before + tf32x3 dots": (BEFORE_LAUNCH | {"precision": "tf32x3"}, 1),
}
# The prefill table's: the default, the launch before (as above, no prefetch), the default with IEEE dots.
PREFILL_LAUNCHES = {
    "paged kernel (Triton)": (None, "auto"),
    "Triton before: 16 x 32, 4 warps, IEEE dots": (BEFORE_LAUNCH, 1),
    "Triton default with IEEE dots": ({"block_m": 16, "tile_n": 32, "num_warps": 8, "num_stages": 2,
                                       "prefetch": False, "precision": "ieee"}, "auto"),
}  # fmt: skip


def sweep_configs(quick: bool = False) -> list[dict]:
    """The launch shapes ``--sweep`` times (with ``num_splits="auto"``): tiles of 16-64 positions, 4 or 8
    warps, the loop's next tile prefetched (1 stage) or Triton's pipeline of 2 or 3 stages, IEEE or
    3xTF32 dots."""
    if quick:
        return [
            {"tile_n": 16, "num_warps": 4, "num_stages": 1, "prefetch": True, "precision": "tf32x3"},
            {"tile_n": 64, "num_warps": 8, "num_stages": 3, "prefetch": False, "precision": "ieee"},
        ]
    return [
        {"tile_n": tile, "num_warps": warps, "num_stages": stages, "prefetch": stages == 1,
         "precision": precision}
        for tile in (16, 32, 64)
        for warps in (4, 8)
        for stages in (1, 2, 3)
        for precision in ("ieee", "tf32x3")
    ]  # fmt: skip


def prefill_sweep_configs(quick: bool = False) -> list[dict]:
    """The launch shapes ``--prefill --sweep`` times: 16-128 query rows, tiles of 32 or 64 positions, 4
    or 8 warps, Triton's 2-stage pipeline (no prefetch), IEEE dots, and 3xTF32 dots at 8 warps."""
    if quick:
        return [
            {"block_m": 16, "tile_n": 16, "num_warps": 4, "num_stages": 1, "prefetch": True},
            {"block_m": 64, "tile_n": 64, "num_warps": 8, "num_stages": 2, "prefetch": False,
             "precision": "ieee"},
        ]  # fmt: skip
    return [
        {"block_m": rows, "tile_n": tile, "num_warps": warps, "num_stages": 2, "prefetch": False,
         "precision": precision}
        for rows in (16, 32, 64, 128)
        for tile in (32, 64)
        for warps in (4, 8)
        for precision in ("ieee", "tf32x3")
        if precision == "ieee" or warps == 8  # 3xTF32 at 8 warps only: 24 launches, not 32
    ]  # fmt: skip


def launch_name(config: dict) -> str:
    """A sweep row's name: ``Triton tile 16, 4 warps, 1 stages, prefetch, tf32x3`` (and ``rows 64, ``
    first where the config names its query rows)."""
    from L4_paged_kernel.fast.triton_paged_attention import LaunchConfig

    c = LaunchConfig(**config)
    rows = f"rows {c.block_m}, " if "block_m" in config else ""
    return (f"Triton {rows}tile {c.tile_n}, {c.num_warps} warps, {c.num_stages} stages, "
            f"{'prefetch' if c.prefetch else 'no prefetch'}, {c.precision}")  # fmt: skip


def kv_bytes(shape) -> int:
    """Bytes of K and V one decode step must read: ``kv_bytes((32, 512, 9, 3, 64))`` -> 25,165,824."""
    seqs, ctx, _, n_kv, head_dim = shape
    return 2 * seqs * ctx * n_kv * head_dim * 4


def prefill_flops(shape) -> int:
    """Floating-point operations of a causal prefill step: each visible (query, key) pair costs 2 x head
    dim for the score and 2 x head dim for the weighted value, per query head.
    ``prefill_flops((1, 2048, 9, 3, 64))`` -> 4,834,197,504."""
    seqs, tokens, heads, _, head_dim = shape
    return 4 * heads * head_dim * seqs * tokens * (tokens + 1) // 2


def shape_name(shape) -> str:
    seqs, ctx, heads, n_kv, head_dim = shape
    return f"{seqs} x {ctx:,} ({heads}/{n_kv} x {head_dim})"


def device_timings(fn, device: torch.device, quick: bool) -> list[float]:
    """Seconds of ``fn()``: on a GPU one number, the median of CUDA events with the L2 flushed between
    launches (Triton's ``do_bench``); on a CPU the wall time of each of 5 runs (2 with ``quick``)."""
    if device.type == "cuda":
        import triton.testing

        return [triton.testing.do_bench(fn, warmup=10, rep=20 if quick else 100, return_mode="median") / 1e3]
    return ceilings.run_seconds(fn, 2 if quick else 5)  # a CPU has ended every op when it returns


def timed_row(run, error: float, device: torch.device, quick: bool) -> tuple[float, dict]:
    """The median seconds of ``run`` (NaN when its output was wrong) and, where it ran more than once,
    ``{"ms_runs": [...]}``, every run's milliseconds, so a table can quote the spread."""
    if error >= TOLERANCE:
        return math.nan, {}
    timings = device_timings(run, device, quick)
    return statistics.median(timings), ({"ms_runs": [t * 1e3 for t in timings]} if len(timings) > 1 else {})


def ms_cell(r: dict) -> str:
    """A row's milliseconds: the median, and the fastest and slowest run where there were several:
    ``2.974 (2.901-3.120)``."""
    runs = r.get("ms_runs")
    return f"{r['ms']:.3f}" + (f" ({min(runs):.3f}-{max(runs):.3f})" if runs else "")


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


def sdpa_causal(q, k, v):
    """q, k, v: (B, H or H_kv, L, D), each sequence's prompt attending to itself, causally."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


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


def prefill_case(shape, device: torch.device) -> tuple:
    """``make_case``'s tensors for one prefill step of ``shape``: every sequence a prompt of ``tokens``
    new tokens, its K/V already in the pool."""
    seqs, tokens, heads, n_kv, head_dim = shape
    return make_case(
        BLOCK_SIZE, heads, n_kv, [tokens] * seqs, [tokens] * seqs, head_dim=head_dim, device=device
    )


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


@dataclass
class Launch:
    """One launch of a compiled Triton kernel, ``kernel[grid](*args, **kwargs)``, as ``recorded_launches``
    saw it; ``compiled`` is the ``CompiledKernel`` it ran (None where it was recorded, not run)."""

    kernel: Any  # a triton.runtime.JITFunction
    args: tuple
    kwargs: dict
    compiled: Any = None


class _Recorder:
    """Stands in for a jit'd kernel: ``recorder[grid](*args, **kwargs)`` appends the launch to
    ``launches``, after launching the kernel where ``run`` is true."""

    def __init__(self, kernel, launches: list[Launch], run: bool):
        self.kernel, self.launches, self.run = kernel, launches, run

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            compiled = self.kernel[grid](*args, **kwargs) if self.run else None
            self.launches.append(Launch(self.kernel, args, kwargs, compiled))

        return launch


@contextlib.contextmanager
def recorded_launches(run: bool = True):
    """Every launch of the compiled kernels (L4's attention and merge, ``triton_sequence_grid``'s) in the
    block, as ``Launch``es in the list it yields. ``run=False`` records without launching or compiling,
    so tensors on the ``meta`` device will do. The callers look the kernels up in their modules'
    ``KERNELS`` at each call, so swapping the entries swaps the kernels they launch (the interpreted
    ones are left alone)."""
    from bench import triton_sequence_grid as before
    from L4_paged_kernel.fast import triton_paged_attention as module

    launches: list[Launch] = []
    saved = module.KERNELS[False], before.KERNELS[False]
    module.KERNELS[False] = tuple(_Recorder(kernel, launches, run) for kernel in saved[0])
    before.KERNELS[False] = _Recorder(saved[1], launches, run)
    try:
        yield launches
    finally:
        module.KERNELS[False], before.KERNELS[False] = saved


def ran_resources(launches: list[Launch]) -> dict:
    """Registers a thread and bytes of local memory a thread (where spills go) of the first compiled kernel
    a row ran (its attention kernel; a split launch's merge comes after), as the CUDA driver reported
    them when Triton loaded it: ``{"registers": 62, "local_bytes": 0}``. Triton's ``n_spills`` is the
    driver's local memory size / 4, hence the 4. ``{}`` for a row that ran no compiled kernel (SDPA,
    the C++ kernel, Triton's interpreter)."""
    compiled = [launch.compiled for launch in launches if launch.compiled is not None]
    if not compiled:
        return {}
    return {"registers": compiled[0].n_regs, "local_bytes": 4 * compiled[0].n_spills}


def jit_source(launch: Launch, target):
    """The ``ASTSource`` and options the JIT compiles for ``launch`` on ``target`` (a ``GPUTarget``),
    made by the JIT's own steps (``JITFunction.run`` in ``triton/runtime/jit.py``, alike in Triton 3.6
    and 3.7): its binder specializes each argument's value, ``_pack_args`` turns that into the
    signature, the constants, the attributes and the options.

    The attributes are what a build without them misses: a pointer whose address, and an integer
    whose value, is a multiple of 16 gets ``tt.divisibility = 16`` (the compiler may then load 16
    bytes at once), and an integer equal to 1 becomes a constant. At 9/3 heads of 64, 16 rows x 32
    positions, 4 warps, 2 stages, the kernel built without them took 216 registers a thread, the
    JIT's build 62 (``tests/test_bench.py`` checks this function against the JIT's own request).
    """
    from triton import knobs
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    kernel, kwargs = launch.kernel, dict(launch.kwargs)
    kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug  # as JITFunction.run does
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return ASTSource(kernel, signature, constexprs, attrs), options


def meta_case(shape, prefill: bool) -> tuple:
    """``decode_case``'s tensors for ``shape`` (``prefill_case``'s with ``prefill``) on the ``meta``
    device: their shapes, strides and dtypes without their numbers (8 x 32,768 positions at 8 x 128 is
    a 1 GiB pool), which is all a launch's specialization reads of them. A meta tensor's address is
    0, a multiple of 16 as a GPU allocation's is (PyTorch's caching allocator aligns to 512 bytes)."""
    seqs, length, heads, n_kv, head_dim = shape
    blocks = -(-length // BLOCK_SIZE)
    meta = torch.device("meta")
    pool = (seqs * blocks + 5, BLOCK_SIZE, n_kv, head_dim)  # make_case's: a few blocks nobody owns
    return (
        torch.empty(seqs * (length if prefill else 1), heads, head_dim, device=meta),
        torch.empty(pool, device=meta),
        torch.empty(pool, device=meta),
        torch.empty(seqs, blocks, dtype=torch.long, device=meta),
        torch.empty(seqs, dtype=torch.long, device=meta),
        torch.empty(seqs + 1, dtype=torch.long, device=meta),
    )


def binary_resources(binary, cuobjdump: Path) -> tuple[int, int, str]:
    """(registers a thread, bytes of stack frame a thread: local memory, where spills go, SASS) of a
    compiled kernel's CUDA binary, as NVIDIA's ``cuobjdump`` reads them from it: ``-res-usage`` gives
    a line like ``REG:62 STACK:0 SHARED:0 LOCAL:0 ...``, the numbers the driver reports when it loads
    it, and ``-sass`` the machine code."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(binary.asm["cubin"])
        usage, sass = (
            subprocess.run([str(cuobjdump), flag, str(cubin)], capture_output=True, text=True, check=True).stdout
            for flag in ("-res-usage", "-sass")
        )
    return int(re.search(r"REG:(\d+)", usage)[1]), int(re.search(r"STACK:(\d+)", usage)[1]), sass


GLOBAL_LOADS = ("LDG", "LDGSTS")  # SASS: a load from global memory (LDGSTS: straight into shared memory)
DOT_MATH = ("FFMA", "HMMA", "HGMMA")  # the dots: fp32 multiply-adds, tensor-core products


def key_loop(sass: str) -> dict:
    """Where the key loop's global loads sit among its math, in the SASS of the attention kernel: the
    loop is the longest backward branch (the binary search's is a few instructions). Returns its length
    in instructions and the place (0-based, in the loop) of its first and last global load and its
    first and last dot instruction, with ``loads_before_math`` true when every load of the loop issues
    before its first dot: the next tile is in flight while this one computes (``prefetch``). Without
    the prefetch the loads of the next tile come after the math (Triton's pipeline issues them late)."""
    code = [(int(m[1], 16), m[2]) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    start, end = 0, -1
    for address, text in code:
        branch = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if branch and int(branch[1], 16) < address and address - int(branch[1], 16) > end - start:
            start, end = int(branch[1], 16), address
    ops = [re.sub(r"^@!?U?P\w+\s+", "", text).split()[0] for address, text in code if start <= address <= end]
    loads = [i for i, op in enumerate(ops) if op.split(".")[0] in GLOBAL_LOADS]
    math = [i for i, op in enumerate(ops) if op.split(".")[0] in DOT_MATH]
    if not loads or not math:
        return {"loop_instructions": len(ops)}
    kinds = [ops[i].split(".")[0] for i in math]
    return {"loop_instructions": len(ops), "global_loads_at": [loads[0], loads[-1]],
            "dot_math_at": [math[0], math[-1]], "loads_before_math": loads[-1] < math[0],
            "dot_instructions": {kind: kinds.count(kind) for kind in DOT_MATH if kind in kinds}}  # fmt: skip


def resources(launches: dict, shapes, prefill: bool = False, capability: int = 90) -> list[dict]:
    """Registers a thread, local bytes a thread (spills), shared memory, programs per multiprocessor and
    the key loop's order (``key_loop``) of the attention kernel in each launch of ``launches`` (name ->
    ``LaunchConfig`` fields, or None for ``choose_launch``'s) on each of ``shapes`` (decode steps, or
    prefill steps with ``prefill``), compiled for ``sm_<capability>`` without a GPU, as the JIT
    compiles that launch (``jit_source``): the arguments' values pick the build, so two shapes may
    compile two kernels. One split (the split count changes the last stores only). A row per kernel,
    with the launches and shapes that run it. Raises RuntimeError naming what is missing where Triton
    has no NVIDIA backend."""
    import triton
    from triton.backends.compiler import GPUTarget

    from L4_paged_kernel.fast.triton_paged_attention import LaunchConfig, triton_paged_attention

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not cuobjdump.exists():
        raise RuntimeError(f"no cuobjdump at {cuobjdump} (this triton has no NVIDIA backend)")
    target = GPUTarget("cuda", capability, 32)
    rows: dict[tuple, dict] = {}  # by the JIT's build: its source's hash and its options
    for shape in shapes:
        case = meta_case(shape, prefill)
        for name, config in launches.items():
            with recorded_launches(run=False) as recorded:
                triton_paged_attention(*case, num_splits=1, config=config and LaunchConfig(**config))
            source, options = jit_source(recorded[0], target)
            key = (source.hash(), str(options))
            if key not in rows:
                binary = triton.compile(source, target=target, options=options.__dict__)
                registers, local, sass = binary_resources(binary, cuobjdump)
                k = recorded[0].kwargs
                rows[key] = {"launches": [], "shapes": [], "block_m": k["BLOCK_M"], "tile_n": k["TILE_N"],
                             "num_warps": k["num_warps"], "num_stages": k["num_stages"],
                             "prefetch": k["PREFETCH"], "precision": k["PRECISION"],
                             "registers": registers, "local_bytes": local, "shared_bytes": binary.metadata.shared,
                             "programs_per_sm": programs_per_sm(registers, k["num_warps"], binary.metadata.shared)}
                rows[key] |= key_loop(sass)  # fmt: skip
            rows[key]["launches"] = list(dict.fromkeys(rows[key]["launches"] + [name]))
            rows[key]["shapes"] = list(dict.fromkeys(rows[key]["shapes"] + [shape_name(shape)]))
    return list(rows.values())


def checked(run, expected, record: bool) -> tuple[float, dict]:
    """``run()``'s largest error against ``expected`` (dense attention), from one untimed run; with
    ``record`` (compiled Triton kernels run here), also the registers and local bytes of the compiled
    kernel that run launched (``ran_resources``). The timed launches after it take the same
    arguments, so the JIT's cache hands them that same kernel."""
    with recorded_launches() if record else contextlib.nullcontext([]) as launches:
        error = (run() - expected).abs().max().item()
    return error, ran_resources(launches)


def triton_launches(case: tuple, launches: dict, sweep: list[dict]) -> dict:
    """Runs of the Triton kernel on ``case`` by row name: each of ``launches`` but the default (the
    ``paged kernel (Triton)`` row runs that), then each launch of ``sweep`` (``launch_name``), all with
    ``num_splits="auto"``."""
    from L4_paged_kernel.fast.triton_paged_attention import LaunchConfig, triton_paged_attention

    chosen = [(name, config, splits) for name, (config, splits) in launches.items() if config is not None]
    chosen += [(launch_name(config), config, "auto") for config in sweep]
    runs = {}
    for name, config, splits in chosen:
        launch = LaunchConfig(**config)
        runs[name] = lambda c=launch, s=splits: triton_paged_attention(*case, num_splits=s, config=c)
    return runs


def measure_shape(shape, device: torch.device, sweep: bool, quick: bool, bandwidth: float) -> list[dict]:
    """Every system on one decode shape: checked against dense attention, then timed."""
    ctx = shape[1]
    case = decode_case(shape, device)
    expected = dense_reference(*case)
    k, v = contiguous_kv(*case[1:4], ctx)
    runs = {name: (lambda fn=fn: fn(*case)) for name, fn in paged_kernels(device, quick).items()}
    runs["gather + SDPA"] = lambda: sdpa(case[0], *contiguous_kv(*case[1:4], ctx))
    runs["SDPA contiguous"] = lambda: sdpa(case[0], k, v)
    if "paged kernel (Triton)" in runs:
        runs |= triton_launches(case, DECODE_LAUNCHES, sweep_configs(quick) if sweep else [])
    rows = []
    record = device.type == "cuda" and "paged kernel (Triton)" in runs
    for name, run in runs.items():
        error, ran = checked(run, expected, record)
        seconds, spread = timed_row(run, error, device, quick)
        rows.append({"shape": shape_name(shape), "system": name, "max_error": error,
                     "ms": seconds * 1e3, "GBps": kv_bytes(shape) / seconds / 1e9,
                     "of_copy": kv_bytes(shape) / seconds / bandwidth} | spread | ran)  # fmt: skip
    return rows


BEFORE = "Triton, one program per sequence (before query tiles)"


def prefill_kernels(device: torch.device, quick: bool) -> dict:
    """The paged kernels of a prefill row: ``paged_kernels``'s, and where the Triton kernel runs, the
    same kernel as it was before query tiles (``bench/triton_sequence_grid.py``)."""
    found = paged_kernels(device, quick)
    if "paged kernel (Triton)" in found:
        from bench.triton_sequence_grid import sequence_grid_attention

        found[BEFORE] = sequence_grid_attention
    return found


def measure_prefill_shape(shape, device: torch.device, sweep: bool, quick: bool) -> list[dict]:
    """Every system on one prefill shape: checked against dense attention, then timed."""
    seqs, tokens, heads, _, head_dim = shape
    case = prefill_case(shape, device)
    expected = dense_reference(*case)
    q = case[0].view(seqs, tokens, heads, head_dim).transpose(1, 2)  # (B, H, L, D)
    k, v = contiguous_kv(*case[1:4], tokens)  # (B, H_kv, L, D)
    runs = {name: (lambda fn=fn: fn(*case)) for name, fn in prefill_kernels(device, quick).items()}
    runs["SDPA contiguous, causal"] = lambda: (
        sdpa_causal(q, k, v).transpose(1, 2).reshape(-1, heads, head_dim)
    )
    if "paged kernel (Triton)" in runs:
        runs |= triton_launches(case, PREFILL_LAUNCHES, prefill_sweep_configs(quick) if sweep else [])
    rows = []
    record = device.type == "cuda" and "paged kernel (Triton)" in runs
    for name, run in runs.items():
        error, ran = checked(run, expected, record)
        seconds, spread = timed_row(run, error, device, quick)
        rows.append({"shape": shape_name(shape), "system": name, "max_error": error, "ms": seconds * 1e3,
                     "GFLOPs": prefill_flops(shape) / seconds / 1e9} | spread | ran)  # fmt: skip
    before = next((r["ms"] for r in rows if r["system"] == BEFORE), math.nan)
    for r in rows:
        r["x_before"] = before / r["ms"]
    return rows


def measure_prefill(device: torch.device, shapes, sweep: bool, quick: bool) -> dict:
    """The prefill table: every system on every shape."""
    rows = []
    for shape in shapes:
        rows += measure_prefill_shape(shape, device, sweep, quick)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"rows": rows}


@contextlib.contextmanager
def own_combine_functions():
    """The query-tiled kernel with combine functions of its own (the sequence-grid kernel's), as it had
    before: the interpreter looks the module's names up as the kernel runs, so swapping them for the
    run swaps them in the interpreted kernel (the compiled one is not run here)."""
    from bench import triton_sequence_grid as before
    from L4_paged_kernel.fast import triton_paged_attention as module

    saved = module._maximum, module._add
    module._maximum, module._add = before._maximum, before._add
    try:
        yield
    finally:
        module._maximum, module._add = saved


def interpreter_steps(prompts) -> list[tuple[str, int, Callable]]:
    """(name, longest prompt it runs, attention) of ``--interpreter``, from the kernel as it was to the
    kernel as it is. The first three run in the compiled kernel's default launch, 16 rows x 32
    positions; the steps before the NumPy reductions run on the shortest prompt only."""
    from bench.triton_sequence_grid import sequence_grid_attention
    from L4_paged_kernel.fast.triton_paged_attention import LaunchConfig, triton_paged_attention

    gpu_launch = LaunchConfig()

    def own_combine(*case):
        with own_combine_functions():
            return triton_paged_attention(*case, config=gpu_launch)

    return [
        ("one program per (sequence, KV head), combine functions of its own", min(prompts), sequence_grid_attention),
        ("query tiles, combine functions of its own", min(prompts), own_combine),
        ("query tiles, tl.max's and tl.sum's combine functions", min(prompts),
         lambda *case: triton_paged_attention(*case, config=gpu_launch)),
        ("query tiles, the interpreter's launch shape (choose_launch)", max(prompts), triton_paged_attention),
    ]  # fmt: skip


def measure_interpreter(prompts) -> dict:
    """One layer's attention for a prompt of each length of ``prompts`` (SmolLM2's heads), on CPU
    tensors, by each step of ``interpreter_steps`` that runs it: one timed run each, checked against
    dense attention."""
    rows = []
    for tokens in prompts:
        shape = (1, tokens, 9, 3, 64)
        case = prefill_case(shape, torch.device("cpu"))
        expected = dense_reference(*case)
        for name, longest, attention in interpreter_steps(prompts):
            if tokens > longest:
                continue
            t0 = time.perf_counter()
            error = (attention(*case) - expected).abs().max().item()
            rows.append({"shape": shape_name(shape), "prompt": tokens, "system": name, "max_error": error,
                         "seconds": time.perf_counter() - t0 if error < TOLERANCE else math.nan})  # fmt: skip
    return {"rows": rows}


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


DECODE_COLUMNS = ["decode shape", "system", "ms", "K/V GB/s", "of copy bandwidth", "max error"]
PREFILL_COLUMNS = ["prefill shape (sequences x prompt)", "system", "ms", "GFLOP/s", "x before query tiles",
                   "max error"]  # fmt: skip


def ran_kernels(results: dict) -> bool:
    """Whether a table's run recorded the registers of the compiled kernels it ran (a GPU's, with Triton)."""
    return any("registers" in r for r in results["rows"])


def header(results: dict, cells: list[str]) -> list[str]:
    """A table's two header lines: ``cells``, and a last one where the run recorded the compiled
    kernels' registers (``ran_kernels``)."""
    cells = cells + ["registers / local bytes a thread"] * ran_kernels(results)
    return ["| " + " | ".join(cells) + " |", "|" + "---|" * len(cells)]


def shape_rows(results: dict, columns, sweep_prefix: str) -> list[str]:
    """Markdown rows, one per (shape, system) of ``results["rows"]``; of a sweep (systems named
    ``sweep_prefix`` ...), only its fastest launch and any wrong one. ``columns(r)`` formats a timed row's
    middle cells; a wrong row shows ``WRONG``. Where the run recorded them (``ran_kernels``), a last
    cell holds the compiled kernel's registers and local bytes a thread (``-``: no compiled kernel)."""
    ran = ran_kernels(results)

    def line(r: dict, name: str) -> str:
        timing = "WRONG | - | -" if math.isnan(r["ms"]) else columns(r)
        kernel = (f" {r['registers']} / {r['local_bytes']} |" if "registers" in r else " - |") if ran else ""
        return f"| {r['shape']} | {name} | {timing} | {r['max_error']:.1e} |{kernel}"

    lines = []
    for shape in dict.fromkeys(r["shape"] for r in results["rows"]):
        rows = [r for r in results["rows"] if r["shape"] == shape]
        swept = [r for r in rows if r["system"].startswith(sweep_prefix)]
        lines += [line(r, r["system"]) for r in rows if r not in swept or math.isnan(r["ms"])]
        timed = [r for r in swept if not math.isnan(r["ms"])]
        if timed:
            best = min(timed, key=lambda r: r["ms"])
            launch = best["system"].removeprefix("Triton ")
            lines.append(line(best, f"Triton, fastest of {len(swept)} launches: {launch}"))
    return lines


def table(results: dict) -> str:
    """Markdown, a row per (shape, system); of the sweep, its fastest launch and any wrong one."""
    return "\n".join(
        [
            f"Kernel table on {results['device_name']} (copy bandwidth {results['copy_bandwidth_GBps']:,.0f} GB/s, "
            "bytes read + written):",
            "",
            *header(results, DECODE_COLUMNS),
            *shape_rows(
                results, lambda r: f"{ms_cell(r)} | {r['GBps']:,.0f} | {r['of_copy']:.0%}", "Triton tile"
            ),
        ]
    )


def prefill_table(results: dict) -> str:
    """Markdown, a row per (shape, system); of the sweep, its fastest launch and any wrong one."""
    return "\n".join(
        [
            f"Prefill table on {results['device_name']}:",
            "",
            *header(results, PREFILL_COLUMNS),
            *shape_rows(
                results, lambda r: f"{ms_cell(r)} | {r['GFLOPs']:,.1f} | {r['x_before']:.1f}", "Triton rows"
            ),
        ]
    )


def resources_table(rows: list[dict]) -> str:
    """Markdown, a row per kernel of ``resources``, with the launches and shapes that run it, and where
    the key loop's global loads sit (``key_loop``): instructions of the loop, first-last load, first
    dot instruction, and the loop's dot instructions by kind."""
    lines = [
        "| launches | shapes | rows | tile | warps | stages | prefetch | dots | registers | local bytes (spills) "
        "| shared bytes | programs per SM | key loop: instructions, loads at, first dot at | dot instructions |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        loads, math = r.get("global_loads_at", ["-"] * 2), r.get("dot_math_at", ["-"])
        kinds = ", ".join(f"{n} {kind}" for kind, n in r.get("dot_instructions", {}).items()) or "-"
        lines.append(f"| {'; '.join(r['launches'])} | {'; '.join(r['shapes'])} | {r['block_m']} | {r['tile_n']} | "
                     f"{r['num_warps']} | {r['num_stages']} | {'yes' if r['prefetch'] else 'no'} | {r['precision']} | "
                     f"{r['registers']} | {r['local_bytes']} | {r['shared_bytes']:,} | {r['programs_per_sm']} | "
                     f"{r['loop_instructions']}, {loads[0]}-{loads[-1]}, {math[0]} | {kinds} |")  # fmt: skip
    return "\n".join(lines)


def resources_results_table(results: dict) -> str:
    """``resources_table`` of a ``--resources --out`` file, for the chapter (``kvcourse.tools.numbers``)."""
    return resources_table(results["rows"])


def interpreter_table(results: dict) -> str:
    """Markdown, a row per (prompt, step), with each step's speedup over the first step on that prompt."""
    lines = [
        f"Triton's interpreter on {results['device_name']}, one layer's attention (9/3 heads x 64), one run each:",
        "",
        "| prompt tokens | kernel | seconds | x faster than the first | max error |",
        "|---|---|---|---|---|",
    ]
    first_step = results["rows"][0]["system"]
    first = {r["prompt"]: r["seconds"] for r in results["rows"] if r["system"] == first_step}
    for r in results["rows"]:
        seconds = "WRONG" if math.isnan(r["seconds"]) else f"{r['seconds']:.2f}"
        speedup = f"{first[r['prompt']] / r['seconds']:.0f}" if r["prompt"] in first else "-"
        lines.append(f"| {r['prompt']:,} | {r['system']} | {seconds} | {speedup} | {r['max_error']:.1e} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.kernels", description=__doc__.splitlines()[0])
    add_device_option(parser, "the kernels run")
    parser.add_argument(
        "--prefill", action="store_true", help="prefill shapes: query tiles against one program per sequence"
    )
    parser.add_argument(
        "--interpreter",
        action="store_true",
        help="Triton's interpreter on the CPU, before and after (no GPU)",
    )
    parser.add_argument(
        "--sweep", action="store_true", help="also time every launch shape of the Triton kernel"
    )
    parser.add_argument(
        "--resources",
        action="store_true",
        help="registers, spills and the key loop's order of the table's launches (the sweep's with "
        "--sweep), as the JIT builds them for an H100, no GPU needed",
    )
    parser.add_argument("--quick", action="store_true", help="tiny shapes (for tests)")
    parser.add_argument(
        "--out", help="the JSON file (default: bench/results/kernels.json, kernels-cuda.json on a GPU)"
    )
    args = parser.parse_args(argv)
    load_before = os.getloadavg()[0]  # the timings depend on what else the machine runs
    if args.resources:
        if args.prefill:
            shapes = QUICK_PREFILL_SHAPES if args.quick else PREFILL_SHAPES
            table_launches, sweep = PREFILL_LAUNCHES, prefill_sweep_configs(args.quick)
        else:
            shapes = QUICK_SHAPES if args.quick else SHAPES
            table_launches, sweep = DECODE_LAUNCHES, sweep_configs(args.quick)
        launches = (
            {launch_name(config): config for config in sweep}
            if args.sweep
            else {name: config for name, (config, _) in table_launches.items()}
        )
        try:
            rows = resources(launches, shapes, prefill=args.prefill)
        except (ImportError, RuntimeError) as e:
            print(f"error: --resources needs Triton's NVIDIA backend: {e}", file=sys.stderr)
            return 2
        print(resources_table(rows))
        if args.out:
            import triton

            results = {"target": "sm_90", "prefill": args.prefill, "rows": rows, "triton": triton.__version__,
                       "device_name": f"built for sm_90 on {cpu_name()}, no GPU, Triton {triton.__version__}"}
            Path(args.out).write_text(json.dumps(results | provenance(), indent=1) + "\n")
        return 0
    if args.interpreter:
        results = measure_interpreter(QUICK_INTERPRETER_PROMPTS if args.quick else INTERPRETER_PROMPTS)
        results["load_average_before"] = load_before
        return finish(results, args.out, "kernels-interpreter.json", interpreter_table, "seconds")
    device = chosen_device(args.device)
    if device is None:
        return 2
    cuda = "-cuda" if device.type == "cuda" else ""
    if args.prefill:
        shapes = QUICK_PREFILL_SHAPES if args.quick else PREFILL_SHAPES if cuda else CPU_PREFILL_SHAPES
        results = measure_prefill(device, shapes, args.sweep, args.quick) | {
            "load_average_before": load_before
        }
        return finish(results, args.out, f"kernels-prefill{cuda}.json", prefill_table, "ms", device)
    shapes = QUICK_SHAPES if args.quick else SHAPES if cuda else CPU_SHAPES
    results = measure(device, shapes, args.sweep, args.quick) | {"load_average_before": load_before}
    return finish(results, args.out, f"kernels{cuda}.json", table, "ms", device)


def finish(results: dict, out: str | None, default: str, make_table, timed: str, device=None) -> int:
    """Name the machine (and the OpenMP wait policy and load it ran under) in ``results``, write them
    (``out``, else ``bench/results/<default>``), print ``make_table(results)``; exit status 1 when a
    row's output differed from dense attention (its ``timed`` field is NaN), else 0."""
    cuda = device is not None and device.type == "cuda"
    results["device_name"] = torch.cuda.get_device_name(device) if cuda else cpu_name()
    results["versions"] = {name: package_version(name) for name in ("torch", "triton")}
    results["when"] = time.strftime("%Y-%m-%d %H:%M:%S")
    results["omp_wait_policy"] = OMP_WAIT_POLICY  # a CPU's small kernels slow down when idle threads sleep
    results["load_average_after"] = os.getloadavg()[0]
    results.update(provenance())
    path = Path(out or REPO_ROOT / "bench" / "results" / default)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1) + "\n")
    print(make_table(results))
    wrong = [
        f"{r['shape']}: {r['system']} ({r['max_error']:.1e})" for r in results["rows"] if math.isnan(r[timed])
    ]
    if wrong:
        print("kernels FAILED: outputs differ from dense attention:\n  " + "\n  ".join(wrong))
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
