"""Paged attention as a Triton kernel, a fast path of L4: the algorithm of the reference
``../paged_attention.py``, one program per (sequence, KV head, split).

Each program loads its sequence's query rows for one KV head (the G query heads that share it, for
every new token of the sequence), walks that sequence's positions a tile of ``TILE_N`` at a time,
finding each position's block through the block table, and keeps the online-softmax state (m, l, acc)
in registers. With one split it writes the output; with several, each program writes its partial
(m, l, acc) and a second small kernel merges them (the flash-decoding reduce of ``split_kv.py``).

A tile may span several blocks: the program loads the tile's block ids from the table (one per
position, ``position // BLOCK_SIZE``) and reads every position's K/V row where it lies. Loading a whole
tile per step instead of one block keeps more memory requests in flight on a GPU; the block size stops
mattering to the kernel's shapes (a block of 7 and one of 16 read through the same 32-position tile).

``LaunchConfig`` holds a launch's sizes: query rows per chunk (``tl.dot`` needs 16 at least, so a
decode token's G heads are padded to 16 rows), positions per tile, warps, and pipeline stages.
``choose_splits`` picks the split count for ``num_splits="auto"``: enough programs to fill a GPU's
multiprocessors when there are few sequences and long histories. The defaults were chosen without a
GPU to time them, from what NVIDIA's assembler reports for each shape (``python -m bench.kernels
--resources``, no GPU needed): a 32-position tile with 4 warps spills nothing and needs 128 registers
a thread at head dim 64, where the kernel that read one 16-position block per step needed 96. On a
GPU, ``python -m bench.kernels`` times the alternatives, and its table, not this docstring, says which
is fastest.

Compiled or interpreted, by the tensor. ``triton.jit`` turns a Python function into a kernel compiled
for the GPU or, when the environment variable ``TRITON_INTERPRET`` is 1 at that moment, into one that
Triton's interpreter runs with NumPy on the CPU. This module decorates each kernel function both ways
(``jit``) and ``triton_paged_attention`` launches the compiled kernel for GPU tensors and the
interpreted one for CPU tensors: in one process, on any machine, whatever it has installed or plugged
in. The interpreter executes the same source one program at a time, slowly, so tests use small shapes.

That choice shapes the source a little. Triton's library functions written in Triton (``tl.max``,
``tl.sum``, ``tl.zeros``) exist only in the mode Triton was imported in, so the kernels reduce with
the primitive ``tl.reduce`` and two combine functions of their own, and fill with ``tl.full``. On a
GPU ``tl.reduce`` compiles to the same reduction ``tl.max`` does; the interpreter runs it element by
element, a few times slower than its NumPy ``tl.max``.

Verified here (no GPU): the interpreted kernel against dense attention, and the compiled kernel's
build for NVIDIA GPUs (Triton's compiler down to a GPU binary, which needs no GPU). Running the compiled
kernel needs a CUDA GPU: ``python -m kvcourse.tools.gpu_check`` does it.

Left out on purpose: autotuning at run time (the bench sweeps instead, and the chosen shapes are plain
code), fp16/bf16 inputs, and the vLLM-style tricks that matter only for speed (persistent programs,
splitting query tiles across programs).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


def jit(fn, interpret: bool):
    """``triton.jit(fn)``: compiled for a GPU (``interpret=False``) or run by Triton's interpreter
    (``True``), whatever ``TRITON_INTERPRET`` says around the call: ``triton.jit`` reads that variable
    when it decorates, so it is set for the call and put back."""
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        return triton.jit(fn)
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before


def _maximum(a, b):
    """Combine function of a max reduction: ``tl.reduce(x, axis, _maximum)`` is ``tl.max(x, axis)``."""
    return tl.maximum(a, b)


def _add(a, b):
    """Combine function of a sum: ``tl.reduce(x, axis, _add)`` is ``tl.sum(x, axis)``."""
    return a + b


# Called from inside the kernels, compiled in both: the interpreter calls their Python function.
_maximum, _add = jit(_maximum, interpret=False), jit(_add, interpret=False)


def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, block_tables_ptr, context_lens_ptr, cu_q_lens_ptr,
    out_ptr, m_ptr, l_ptr, acc_ptr,
    scale,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_bt,
    stride_ms, stride_mt,
    stride_as, stride_at, stride_ah,
    G: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr, TILE_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q0 = tl.load(cu_q_lens_ptr + seq)
    q_len = tl.load(cu_q_lens_ptr + seq + 1) - q0
    ctx = tl.load(context_lens_ptr + seq)
    per_split = (ctx + TILE_N * NUM_SPLITS - 1) // (TILE_N * NUM_SPLITS) * TILE_N  # whole tiles per split
    t_start = split * per_split
    t_end = tl.minimum(t_start + per_split, ctx)

    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    offs_t = tl.arange(0, TILE_N)
    for row0 in range(0, q_len * G, BLOCK_M):  # query rows = (new token, head of this group) pairs
        rows = row0 + tl.arange(0, BLOCK_M)
        row_mask = rows < q_len * G
        tok = rows // G
        head = kv_head * G + rows % G
        q_pos = ctx - q_len + tok  # absolute position of each query row
        q = tl.load(
            q_ptr + (q0 + tok)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
            mask=row_mask[:, None] & d_mask[None, :],
            other=0.0,
        )  # (BLOCK_M, BLOCK_D)
        m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l = tl.full((BLOCK_M,), 0.0, tl.float32)
        acc = tl.full((BLOCK_M, BLOCK_D), 0.0, tl.float32)
        last_pos = ctx - q_len + tl.minimum((row0 + BLOCK_M - 1) // G, q_len - 1)  # newest query here
        for t0 in range(t_start, tl.minimum(t_end, last_pos + 1), TILE_N):  # later tiles: all masked
            pos = t0 + offs_t  # (TILE_N,) positions of this tile
            pos_mask = pos < t_end
            block = tl.load(block_tables_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=pos_mask, other=0)
            row_off = block * stride_kb + (pos % BLOCK_SIZE) * stride_ks  # (TILE_N,) in place
            kv_off = row_off[:, None] + kv_head * stride_kh + offs_d[None, :]
            kv_mask = pos_mask[:, None] & d_mask[None, :]
            k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)  # (TILE_N, BLOCK_D)
            v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # (BLOCK_M, TILE_N)
            s = tl.where((pos[None, :] <= q_pos[:, None]) & pos_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.reduce(s, 1, _maximum))
            base = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - base[:, None])
            alpha = tl.exp(m - base)
            l = alpha * l + tl.reduce(p, 1, _add)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            m = m_new
        row_off = (q0 + tok)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
        out_mask = row_mask[:, None] & d_mask[None, :]
        if NUM_SPLITS == 1:
            tl.store(out_ptr + row_off, acc / l[:, None], mask=out_mask)
        else:
            ml_off = split * stride_ms + (q0 + tok) * stride_mt + head
            tl.store(m_ptr + ml_off, m, mask=row_mask)
            tl.store(l_ptr + ml_off, l, mask=row_mask)
            a_off = split * stride_as + (q0 + tok)[:, None] * stride_at + head[:, None] * stride_ah
            tl.store(acc_ptr + a_off + offs_d[None, :], acc, mask=out_mask)


def _merge_splits_kernel(
    m_ptr, l_ptr, acc_ptr, out_ptr,
    stride_ms, stride_mt, stride_as, stride_at, stride_ah, stride_ot, stride_oh,
    NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One program per (token, head): out = sum_i exp(m_i - M) acc_i / sum_i exp(m_i - M) l_i."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    m = tl.load(m_ptr + offs_s * stride_ms + t * stride_mt + h)  # (NUM_SPLITS,)
    l = tl.load(l_ptr + offs_s * stride_ms + t * stride_mt + h)
    acc = tl.load(
        acc_ptr + offs_s[:, None] * stride_as + t * stride_at + h * stride_ah + offs_d[None, :],
        mask=d_mask[None, :],
        other=0.0,
    )  # (NUM_SPLITS, BLOCK_D)
    w = tl.exp(m - tl.reduce(m, 0, _maximum))  # splits that saw no key have m = -inf -> weight 0
    out = tl.reduce(w[:, None] * acc, 0, _add) / tl.reduce(w * l, 0, _add)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d, out, mask=d_mask)


# (compiled, interpreted) pair of each kernel, by "are the tensors on the CPU?"
KERNELS = {
    interpret: (jit(_paged_attention_kernel, interpret), jit(_merge_splits_kernel, interpret))
    for interpret in (False, True)
}


@dataclass(frozen=True)
class LaunchConfig:
    """The shape of one launch of the attention kernel: Triton's compile-time sizes and launch options.

    ``block_m``: query rows a program takes at a time. ``tile_n``: history positions per step of the
    loop. Both are powers of two, 16 or more (``tl.dot``'s smallest size). ``num_warps``: 32-thread warps
    per program. ``num_stages``: how many steps ahead Triton's software pipeline issues the loop's loads.
    The interpreter ignores the last two. Example: ``LaunchConfig(tile_n=64, num_warps=8)``.
    """

    block_m: int = 16
    tile_n: int = 32
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_m", "tile_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16 (tl.dot's smallest size), got {value}")
        if self.num_warps < 1 or self.num_warps & (self.num_warps - 1):
            raise ValueError(f"num_warps must be a power of two >= 1, got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {self.num_stages}")


def choose_splits(n_programs: int, max_positions: int, tile_n: int, processors: int) -> int:
    """The split count of ``num_splits="auto"``: 1 when the grid's (sequence, KV head) programs already
    fill the GPU's ``processors`` (streaming multiprocessors), else the power of two that brings the grid
    nearest four programs per processor from below, while every split keeps at least 4 tiles of the
    longest history (``max_positions``).

    Examples, an H100 (132 processors): 256 sequences x 3 KV heads -> 1; 32 x 3 over 4,096 positions,
    32-position tiles -> 4 (6 wanted, 32 allowed); 32 x 3 over 256 positions -> 2 (8 tiles allow 2).
    """
    if n_programs >= processors:
        return 1
    want = -(-4 * processors // n_programs)  # ceil
    allowed = max(1, max_positions // (4 * tile_n))
    splits = 1
    while splits * 2 <= min(want, allowed):
        splits *= 2
    return splits


def triton_paged_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cu_q_lens: torch.Tensor,
    num_splits: int | str = 1,
    scale: float | None = None,
    config: LaunchConfig | None = None,
) -> torch.Tensor:
    """The reference ``paged_attention``'s contract (shapes documented there). Every tensor must
    be on one device: a GPU's run the compiled kernels, the CPU's the interpreted ones.

    ``num_splits`` must be a power of two (it is a ``tl.arange`` length in the reduce kernel), or
    ``"auto"``: ``choose_splits`` on a GPU, 1 on the CPU (the interpreter runs one program at a time, so
    splitting only adds the merge), from shapes alone (the table's width bounds the longest history):
    nothing here reads a tensor back to the host. ``config`` shapes the launch (``LaunchConfig()`` when
    None). The kernel addresses a layer's pool with 32-bit offsets, so a pool must hold fewer than 2**31
    floats per layer.
    """
    if num_splits != "auto" and (
        not isinstance(num_splits, int) or num_splits < 1 or num_splits & (num_splits - 1)
    ):
        raise ValueError(f"num_splits must be a power of two >= 1 or 'auto', got {num_splits!r}")
    devices = sorted({str(t.device) for t in (q, k_pool, v_pool, block_tables, context_lens, cu_q_lens)})
    if len(devices) != 1:
        raise ValueError(f"the Triton kernel's tensors must be on one device, got {', '.join(devices)}")
    if k_pool.numel() >= 2**31:
        raise ValueError(
            f"the Triton kernel takes a pool of at most 2**31 - 1 floats per layer, got {k_pool.numel()}"
        )
    on_cpu = q.device.type == "cpu"
    attend, merge = KERNELS[on_cpu]
    n_tok, n_heads, d = q.shape
    block_size, n_kv = k_pool.shape[1], k_pool.shape[2]
    n_seqs = block_tables.shape[0]
    config = config or LaunchConfig()
    if num_splits == "auto":
        processors = 1 if on_cpu else torch.cuda.get_device_properties(q.device).multi_processor_count
        num_splits = choose_splits(
            n_seqs * n_kv, block_tables.shape[1] * block_size, config.tile_n, processors
        )
    q, k_pool, v_pool = q.contiguous(), k_pool.contiguous(), v_pool.contiguous()
    block_tables = block_tables.to(torch.int32).contiguous()
    context_lens, cu_q_lens = context_lens.to(torch.int32), cu_q_lens.to(torch.int32)
    out = torch.empty_like(q)
    m = torch.empty(num_splits, n_tok, n_heads, device=q.device)  # split partials (unused with 1 split)
    l = torch.empty_like(m)
    acc = torch.empty(num_splits, n_tok, n_heads, d, device=q.device)
    block_d = max(16, triton.next_power_of_2(d))
    grid = (n_seqs, n_kv, num_splits)
    attend[grid](
        q, k_pool, v_pool, block_tables, context_lens, cu_q_lens,
        out, m, l, acc,
        d**-0.5 if scale is None else scale,
        q.stride(0), q.stride(1),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        block_tables.stride(0),
        m.stride(0), m.stride(1),
        acc.stride(0), acc.stride(1), acc.stride(2),
        G=n_heads // n_kv, BLOCK_SIZE=block_size, HEAD_DIM=d, NUM_SPLITS=num_splits,
        BLOCK_M=config.block_m, TILE_N=config.tile_n, BLOCK_D=block_d,
        num_warps=config.num_warps, num_stages=config.num_stages,
        enable_fp_fusion=False,  # no fused multiply-add: every fp32 operation rounds as written
    )  # fmt: skip
    if num_splits > 1:
        merge[(n_tok, n_heads)](
            m, l, acc, out,
            m.stride(0), m.stride(1), acc.stride(0), acc.stride(1), acc.stride(2), out.stride(0), out.stride(1),
            NUM_SPLITS=num_splits, HEAD_DIM=d, BLOCK_D=block_d, enable_fp_fusion=False,
        )  # fmt: skip
    return out
