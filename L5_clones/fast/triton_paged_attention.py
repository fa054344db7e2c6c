"""Paged attention as a Triton kernel, a fast path of L4: the algorithm of the reference
``../paged_attention.py``, one program per (tile of query tokens, KV head, split).

The grid puts tiles of query rows side by side, as FlashAttention's varlen kernel (v2.8.3) and vLLM's
Triton attention (commit 001ceb3e98e7) do. A program takes ``BLOCK_Q`` consecutive new tokens of one sequence and the G query heads
of one KV head that each token brings: ``BLOCK_M = BLOCK_Q x G`` rows (a decode token is a tile of one
token). It walks its sequence's positions a tile of ``TILE_N`` at a time, finding each position's
block through the block table, and keeps the online-softmax state (m, l, acc) of its rows in
registers. With one split it writes the output; with several, each program writes its partial (m, l,
acc) and a second small kernel merges them (the flash-decoding reduce of ``split_kv.py``). So a
2,000-token prompt of SmolLM2 (G = 3: 5 tokens a tile) runs as 400 tiles x 3 KV heads = 1,200
programs on an H100's 132 multiprocessors, where one program per (sequence, KV head) would run 3, each looping
over the 2,000 tokens one chunk after another.

The grid is sized from shapes alone: ``T // BLOCK_Q + S`` tiles for T new tokens in S sequences, an
upper bound on the ``sum_s ceil(q_len_s / BLOCK_Q)`` tiles there are (reading the lengths back to the
host would cost a GPU a wait). Sequence s's tiles are numbered from ``cu_q_lens[s] // BLOCK_Q + s``
on; a program finds its sequence by a binary search over those first numbers, and a number past its
sequence's last tile (at most one per sequence) exits at once. This is vLLM's scheme
(``vllm/attention/ops/triton_unified_attention.py``, read at commit 001ceb3e98e7: ``find_seq_idx``
and ``total_num_q_blocks``).

A key tile may span several blocks: the program loads the tile's block ids from the table (one per
position, ``position // BLOCK_SIZE``) and reads every position's K/V row where it lies. Loading a whole
tile per step instead of one block keeps more memory requests in flight on a GPU; the block size stops
mattering to the kernel's shapes (a block of 7 and one of 16 read through the same 32-position tile).

``LaunchConfig`` holds a launch's sizes and options: query rows per program (``tl.dot`` needs 16 at
least, so a decode token's G heads are padded to 16 rows), positions per key tile, warps, pipeline
stages, whether the loop prefetches, and the dots' precision; ``choose_launch`` picks them from shapes
when none is given. Three choices make a decode step read K/V faster on a GPU (none changes a result
beyond float rounding):

- **Prefetch** (``PREFETCH``). The plain loop loads a tile's block ids, then its K/V, then computes:
  each waits for the one before, and the next tile's loads issue only after this tile's math, so
  every tile pays the memory's full latency. The prefetching loop keeps the next tile's K/V in
  registers as loop-carried values and the block ids one tile further ahead: while tile i computes,
  tile i + 1 is on its way and the ids of tile i + 2 too. In the sm_90 machine code every global load
  of the loop comes before its first dot instruction (``python -m bench.kernels --resources``). The
  cost is registers: 16-position tiles keep it without spills at head dims 64 and 128.
- **Splits** (``num_splits="auto"``, the default). ``choose_splits`` cuts each history into enough
  splits for about one wave of resident programs on the GPU: 32 decode sequences x 3 KV heads are
  96 programs on an H100's 132 multiprocessors, each of which holds 4.
- **3xTF32 dots** (``PRECISION="tf32x3"``). An fp32 IEEE dot runs on the ordinary units, with a
  decode token's 3 or 4 real rows padded to 16 (most of its multiply-adds are padding) and its
  operands staged through shared memory. ``tf32x3`` runs the same dot on tensor cores as three TF32
  products (the high and low parts of each operand: hi x hi + hi x lo + lo x hi), about as accurate
  as fp32 (plain TF32 keeps 10 bits of mantissa: too few for the 2e-5 bound).

The GPU defaults were chosen without a GPU to time them, from what the build for an H100 says
(registers, spills, the loop's order; ``bench.kernels --resources``). On a GPU,
``python -m bench.kernels`` times the launch before these changes, each change alone and all
together, and ``--sweep`` the alternatives: its table, not this docstring, says which is fastest.

Compiled or interpreted, by the tensor. ``triton.jit`` turns a Python function into a kernel compiled
for the GPU or, when the environment variable ``TRITON_INTERPRET`` is 1 at that moment, into one that
Triton's interpreter runs with NumPy on the CPU. This module decorates each kernel function both ways
(``jit``) and ``triton_paged_attention`` launches the compiled kernel for GPU tensors and the
interpreted one for CPU tensors: in one process, on any machine, whatever it has installed or plugged
in. The interpreter executes the same source one program at a time, paying Python's price for every
operation on a tile, the same however many elements the tile holds, so on CPU tensors
``choose_launch`` takes few, large tiles (up to 512 rows x 512 positions).

That choice shapes the source a little. Triton's library functions written in Triton (``tl.max``,
``tl.sum``, ``tl.zeros``) are decorated once, when Triton is imported, in whichever mode that was, so
an interpreted kernel cannot call them where Triton was imported for compiling. The kernels reduce
with the primitive ``tl.reduce``, which both modes provide, and fill with ``tl.full``. ``tl.reduce``
takes a combine function; the kernels pass the two that ``tl.max`` and ``tl.sum`` pass,
``tl.standard._elementwise_max`` and ``tl.standard._sum_combine``: compiled, they are the same
reduction as ``tl.max`` and ``tl.sum``; interpreted, Triton recognizes them and reduces with NumPy
(``np.nanmax``, ``np.sum``), where a combine function of our own would be called in Python once per
pair of elements (7 times slower on a 128-token prompt: ``python -m bench.kernels --interpreter``).
Where Triton was imported with ``TRITON_INTERPRET=1``, ``combine_function`` falls back to our own.

Verified here (no GPU): the interpreted kernel against dense attention (prompts of 1 to 2,048 rows,
GQA 1:1 to 4:1, chunked prefill, histories of many tiles, every output row written by exactly one
program of its own sequence), and the compiled kernel's build for NVIDIA GPUs (Triton's compiler down
to a GPU binary, which needs no GPU). Running the compiled kernel needs a CUDA GPU:
``python -m kvcourse.tools.gpu_check`` does it.

Left out on purpose: autotuning at run time (the bench sweeps instead, and the chosen shapes are plain
code), fp16/bf16 inputs, a separate decode kernel without the 16-row padding (decode tokens are tiles
of one token in the same launch, padded to 16 rows, as vLLM's one-kernel path does), a ring of shared
buffers for the prefetch (Triton allocates shared memory itself: registers are what the source can
name), and persistent programs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

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


def _max_of_two(a, b):
    """Combine function of a max reduction: ``tl.reduce(x, axis, _max_of_two)`` is ``tl.max(x, axis)``."""
    return tl.maximum(a, b)


def _sum_of_two(a, b):
    """Combine function of a sum: ``tl.reduce(x, axis, _sum_of_two)`` is ``tl.sum(x, axis)``."""
    return a + b


def combine_function(triton_s, ours):
    """What the kernels reduce with: Triton's own combine function (``tl.max``'s or ``tl.sum``'s), which
    the interpreter recognizes and runs with NumPy, where Triton was imported for compiling. Where it
    was imported with ``TRITON_INTERPRET=1``, Triton's are interpreted functions the compiled kernel
    cannot call: ours, compiled, then serve both kernels (the interpreter calls their Python code once
    per pair of elements: right, and slow)."""
    return triton_s if isinstance(triton_s, triton.runtime.JITFunction) else jit(ours, interpret=False)


_maximum = combine_function(tl.standard._elementwise_max, _max_of_two)
_add = combine_function(tl.standard._sum_combine, _sum_of_two)


def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, block_tables_ptr, context_lens_ptr, cu_q_lens_ptr,
    out_ptr, m_ptr, l_ptr, acc_ptr,
    scale, num_seqs,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_bt,
    stride_ms, stride_mt,
    stride_as, stride_at, stride_ah,
    G: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PREFETCH: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One program: BLOCK_Q new tokens of one sequence x the G query heads of one KV head (BLOCK_M rows),
    over one split of the sequence's history (all of it with one split). ``PREFETCH``: load each key
    tile one step ahead (module docstring); ``PRECISION``: ``tl.dot``'s, "ieee" or "tf32x3"."""
    q_tile = tl.program_id(0)  # a tile of BLOCK_Q new tokens of one sequence, numbered over the batch
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # This tile's sequence: the last s whose first tile number, cu_q_lens[s] // BLOCK_Q + s, is at most
    # q_tile (the numbers grow with s, so a binary search finds it)
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(cu_q_lens_ptr + mid) // BLOCK_Q + mid <= q_tile:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    q0 = tl.load(cu_q_lens_ptr + seq)
    q_len = tl.load(cu_q_lens_ptr + seq + 1) - q0
    tile = q_tile - (q0 // BLOCK_Q + seq)  # the tile's place in its sequence: tokens tile * BLOCK_Q, ...
    if tile * BLOCK_Q >= q_len:  # a spare number of the grid's upper bound: no tokens
        return
    ctx = tl.load(context_lens_ptr + seq)
    per_split = (ctx + TILE_N * NUM_SPLITS - 1) // (TILE_N * NUM_SPLITS) * TILE_N  # whole tiles per split
    t_start = split * per_split
    t_end = tl.minimum(t_start + per_split, ctx)

    rows = tl.arange(0, BLOCK_M)  # (BLOCK_M,) a row = (token of the tile, query head of this group)
    tok = tile * BLOCK_Q + rows // G  # the row's new token, counted from the sequence's first
    head = kv_head * G + rows % G
    row_mask = (rows < BLOCK_Q * G) & (tok < q_len)  # padding rows, and rows past the sequence's end
    last_pos = ctx - q_len + tl.minimum(tile * BLOCK_Q + BLOCK_Q, q_len) - 1  # the tile's newest token
    t_stop = tl.minimum(t_end, last_pos + 1)  # later tiles: all masked
    ml_off = split * stride_ms + (q0 + tok) * stride_mt + head  # this split's partial m and l
    if t_start >= t_stop:  # a split with no visible key (a short history): m = -inf tells the merge
        tl.store(m_ptr + ml_off, tl.full((BLOCK_M,), float("-inf"), tl.float32), mask=row_mask)
        return
    q_pos = ctx - q_len + tok  # absolute position of each row's token: it sees keys 0..q_pos
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    row_off = (q0 + tok)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]  # q and out
    q = tl.load(q_ptr + row_off, mask=row_mask[:, None] & d_mask[None, :], other=0.0)  # (BLOCK_M, BLOCK_D)
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l = tl.full((BLOCK_M,), 0.0, tl.float32)
    acc = tl.full((BLOCK_M, BLOCK_D), 0.0, tl.float32)
    offs_t = tl.arange(0, TILE_N)
    table = block_tables_ptr + seq * stride_bt  # this sequence's row of the block table
    head_d = kv_head * stride_kh + offs_d[None, :]  # (1, BLOCK_D) this KV head's floats of a position
    if PREFETCH:  # before the loop: the first tile's K/V, and the block ids of the second
        pos_next = t_start + offs_t
        block = tl.load(table + pos_next // BLOCK_SIZE, mask=pos_next < t_stop, other=0)
        off_next = (block * stride_kb + (pos_next % BLOCK_SIZE) * stride_ks)[:, None] + head_d
        mask_next = (pos_next < t_stop)[:, None] & d_mask[None, :]
        k_next = tl.load(k_ptr + off_next, mask=mask_next, other=0.0)  # (TILE_N, BLOCK_D)
        v_next = tl.load(v_ptr + off_next, mask=mask_next, other=0.0)
        pos_after = pos_next + TILE_N
        block_next = tl.load(table + pos_after // BLOCK_SIZE, mask=pos_after < t_stop, other=0)
    for t0 in range(t_start, t_stop, TILE_N):
        pos = t0 + offs_t  # (TILE_N,) positions of this key tile
        pos_mask = pos < t_end
        if PREFETCH:  # this tile arrived during the last step; ask for the next one before computing
            k = k_next
            v = v_next
            pos_next = pos + TILE_N
            off_next = (block_next * stride_kb + (pos_next % BLOCK_SIZE) * stride_ks)[:, None] + head_d
            mask_next = (pos_next < t_stop)[:, None] & d_mask[None, :]
            k_next = tl.load(k_ptr + off_next, mask=mask_next, other=0.0)
            v_next = tl.load(v_ptr + off_next, mask=mask_next, other=0.0)
            pos_after = pos + 2 * TILE_N  # and the block ids of the tile after that
            block_next = tl.load(table + pos_after // BLOCK_SIZE, mask=pos_after < t_stop, other=0)
        else:  # ids, then K/V, then the math: each waits for the one before
            block = tl.load(table + pos // BLOCK_SIZE, mask=pos_mask, other=0)
            kv_off = (block * stride_kb + (pos % BLOCK_SIZE) * stride_ks)[:, None] + head_d
            kv_mask = pos_mask[:, None] & d_mask[None, :]
            k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)  # (TILE_N, BLOCK_D)
            v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # (BLOCK_M, TILE_N)
        s = tl.where((pos[None, :] <= q_pos[:, None]) & pos_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.reduce(s, 1, _maximum))  # (BLOCK_M,)
        base = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - base[:, None])  # (BLOCK_M, TILE_N)
        alpha = tl.exp(m - base)
        l = alpha * l + tl.reduce(p, 1, _add)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)  # (BLOCK_M, BLOCK_D)
        m = m_new
    out_mask = row_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + row_off, acc / l[:, None], mask=out_mask)
    else:
        tl.store(m_ptr + ml_off, m, mask=row_mask)
        tl.store(l_ptr + ml_off, l, mask=row_mask)
        a_off = split * stride_as + (q0 + tok)[:, None] * stride_at + head[:, None] * stride_ah
        tl.store(acc_ptr + a_off + offs_d[None, :], acc, mask=out_mask)


def _merge_splits_kernel(
    m_ptr, l_ptr, acc_ptr, out_ptr,
    stride_ms, stride_mt, stride_as, stride_at, stride_ah, stride_ot, stride_oh,
    NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One program per (token, head): out = sum_i exp(m_i - M) acc_i / sum_i exp(m_i - M) l_i, over the
    splits that saw a key (m_i > -inf): an empty split wrote its m only."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    m = tl.load(m_ptr + offs_s * stride_ms + t * stride_mt + h)  # (NUM_SPLITS,)
    seen = m > float("-inf")
    l = tl.load(l_ptr + offs_s * stride_ms + t * stride_mt + h, mask=seen, other=0.0)
    acc = tl.load(
        acc_ptr + offs_s[:, None] * stride_as + t * stride_at + h * stride_ah + offs_d[None, :],
        mask=seen[:, None] & d_mask[None, :],
        other=0.0,
    )  # (NUM_SPLITS, BLOCK_D)
    w = tl.exp(m - tl.reduce(m, 0, _maximum))  # an empty split: m = -inf -> weight 0
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

    ``block_m``: query rows a program takes, ``block_m // G`` whole tokens x the G query heads of its
    KV head (16 rows with G = 3: 5 tokens, one row of padding). ``tile_n``: history positions per step
    of the loop. Both are powers of two, 16 or more (``tl.dot``'s smallest size), and ``block_m`` holds
    one token's G rows at least. ``num_warps``: 32-thread warps per program. ``num_stages``: how many
    steps ahead Triton's software pipeline issues the loop's loads. ``prefetch``: the loop loads key
    tile i + 1 (and the block ids of tile i + 2) before it computes tile i, holding the next tile in
    registers. ``precision``: the dots' ``input_precision``, ``"ieee"`` (fp32 on the ordinary units) or
    ``"tf32x3"`` (three TF32 tensor-core products per dot, about as accurate as fp32). The interpreter
    ignores the last four (it computes in fp32, one program at a time). Example:
    ``LaunchConfig(block_m=64, tile_n=64, num_warps=8)``.
    """

    block_m: int = 16
    tile_n: int = 16
    num_warps: int = 4
    num_stages: int = 1
    prefetch: bool = True
    precision: str = "tf32x3"

    def __post_init__(self):
        for name in ("block_m", "tile_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16 (tl.dot's smallest size), got {value}")
        if self.num_warps < 1 or self.num_warps & (self.num_warps - 1):
            raise ValueError(f"num_warps must be a power of two >= 1, got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {self.num_stages}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")


PRECISIONS = ("ieee", "tf32x3")


def _power_of_two(n: int, low: int, high: int) -> int:
    """The power of two at or above n, kept within [low, high]: ``_power_of_two(45, 16, 512)`` -> 64."""
    return min(high, max(low, triton.next_power_of_2(n)))


def choose_launch(n_tok: int, n_seqs: int, group: int, max_positions: int, interpreted: bool) -> LaunchConfig:
    """The launch shape ``triton_paged_attention`` takes when it is given none, from shapes alone: a
    batch of ``n_tok`` new tokens in ``n_seqs`` sequences, ``group`` query heads per KV head, histories
    of at most ``max_positions``.

    Compiled (a GPU), a decode batch (one new token a sequence): ``LaunchConfig()``, 16 rows x 16
    positions, 4 warps, the next tile prefetched, 3xTF32 dots: no spill at head dim 64 or 128 (128 and
    162 registers a thread with IEEE dots, ``python -m bench.kernels --resources``). A batch with
    prompt tokens: 16 rows x 32 positions, 8 warps, Triton's 2-stage pipeline instead of the prefetch
    (60 registers at 128, where 4 warps spilled). Rows are raised to one token's heads where ``group``
    > 16. ``bench.kernels --sweep`` times others.
    Interpreted (a CPU): the fewest, largest tiles, since the interpreter pays per operation, not per
    element: rows for every token one sequence can bring (``n_tok - n_seqs + 1``: a decode batch 1, a
    lone prompt all of its tokens), positions for the longest history, each at most 512; no prefetch
    (one program at a time: nothing to overlap).

    Examples, G = 3: compiled, a decode batch -> 16 x 16, a prompt -> 16 x 32 with 8 warps;
    interpreted, a decode batch of 8 over 300 positions -> 16 x 512; one 300-token prompt over 320
    positions -> 512 rows (170 tokens) x 512; 2 prompts of 20 tokens over 48 positions -> 128 x 64.
    """
    rows = max(16, triton.next_power_of_2(group))  # one token's heads, 16 at least
    if not interpreted:
        if n_tok == n_seqs:  # decode
            return LaunchConfig(block_m=rows)
        return LaunchConfig(block_m=rows, tile_n=32, num_warps=8, num_stages=2, prefetch=False)
    most_tokens = n_tok - n_seqs + 1  # one sequence's share when every other brings a single token
    return LaunchConfig(
        block_m=max(rows, _power_of_two(group * most_tokens, 16, 512)),
        tile_n=_power_of_two(max_positions, 16, 512),
        prefetch=False,
    )


# The decode launch where the grid fills the GPU without splits (many sequences, or many KV heads):
# there the programs' own number hides the loads' latency, and the prefetch's smaller tile only adds
# loop steps. Measured on an H200 (bench/results/kernels-cuda.json, commit 3e0e7d2), its row "Triton
# before + tf32x3 dots": 87% of the copy bandwidth at 256 x 4,096 and 77% at 64 x 4,096, against 57%
# and 44% for the prefetching launch, which stays the default where splits are needed (32 x 4,096:
# 49% against 29%).
FULL_GRID_DECODE = LaunchConfig(tile_n=32, num_stages=2, prefetch=False)


def choose_splits(
    n_programs: int, max_positions: int, tile_n: int, processors: int, resident: int = 4
) -> int:
    """The split count of ``num_splits="auto"``: about one full wave of programs. A GPU with
    ``processors`` streaming multiprocessors holds ``resident`` programs on each at once (what the
    compiled kernel's registers allow: 4 at head dim 64, 2-3 at 128 in the decode launch,
    ``python -m bench.kernels --resources``), so the grid's ``n_programs`` (query tile, KV head)
    programs are multiplied by the largest power of two that keeps them within ``processors x
    resident``, at most ``MAX_SPLITS``, and leaves every split at least 4 tiles of the longest history
    (``max_positions``). One split when the grid fills the wave already.

    The count follows from shapes alone, so a decode graph, whose block table is always
    ``max_model_len`` wide, records one count per batch-size bucket; a split that gets no key of a
    shorter history writes m = -inf and exits, and the merge skips it.

    Examples, an H100 (132 processors), 4 resident: 256 decode tokens x 3 KV heads -> 1 (768 >= 528);
    a 2,000-token prompt in tiles of 5 tokens, 400 x 3 -> 1; 32 decode tokens x 3 over 4,096 positions,
    16-position tiles -> 4 (5.5 fit); 32 x 3 over 128 positions -> 2 (8 tiles allow 2); 8 tokens x 8
    KV heads over 32,768 positions, 2 resident -> 4.
    """
    wave = processors * resident
    allowed = min(MAX_SPLITS, wave // n_programs, max_positions // (4 * tile_n))
    splits = 1
    while splits * 2 <= allowed:
        splits *= 2
    return splits


MAX_SPLITS = 16  # more splits: more partial states to write and merge, for at most a wave's worth of programs


def triton_paged_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cu_q_lens: torch.Tensor,
    num_splits: int | str = "auto",
    scale: float | None = None,
    config: LaunchConfig | None = None,
) -> torch.Tensor:
    """The reference ``paged_attention``'s contract (shapes documented there). Every tensor must
    be on one device: a GPU's run the compiled kernels, the CPU's the interpreted ones.

    ``num_splits`` must be a power of two (it is a ``tl.arange`` length in the reduce kernel), or
    ``"auto"`` (the default): ``choose_splits`` on a GPU, 1 on the CPU (the interpreter runs one program
    at a time, so splitting only adds the merge). ``config`` shapes the launch (``choose_launch`` when None;
    on a GPU a decode batch whose grid fills the GPU with one split takes ``FULL_GRID_DECODE``). Both are
    chosen from shapes alone (the table's width bounds the longest history): nothing here reads a
    tensor back to the host. The kernel addresses a layer's pool with 32-bit offsets, so a pool must
    hold fewer than 2**31 floats per layer.
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
    n_seqs, max_positions = block_tables.shape[0], block_tables.shape[1] * block_size
    g = n_heads // n_kv
    chosen = config is None
    config = config or choose_launch(n_tok, n_seqs, g, max_positions, interpreted=on_cpu)
    if config.block_m < g:
        raise ValueError(f"block_m must hold one token's {g} query heads, got {config.block_m}")
    block_q = config.block_m // g  # whole tokens per query tile
    if num_splits == "auto" and on_cpu:
        num_splits = 1
    elif num_splits == "auto":
        processors = torch.cuda.get_device_properties(q.device).multi_processor_count
        busy = max(n_seqs, -(-n_tok // block_q)) * n_kv  # programs that have rows, at least
        resident = 4 if d <= 64 else 2  # programs a multiprocessor holds (choose_splits)
        num_splits = choose_splits(busy, max_positions, config.tile_n, processors, resident)
        if chosen and num_splits == 1 and n_tok == n_seqs:  # a decode grid that fills the GPU alone
            config = replace(FULL_GRID_DECODE, block_m=config.block_m)
    q, k_pool, v_pool = q.contiguous(), k_pool.contiguous(), v_pool.contiguous()
    block_tables = block_tables.to(torch.int32).contiguous()
    context_lens, cu_q_lens = context_lens.to(torch.int32), cu_q_lens.to(torch.int32)
    out = torch.empty_like(q)
    m = torch.empty(num_splits, n_tok, n_heads, device=q.device)  # split partials (unused with 1 split)
    l = torch.empty_like(m)
    acc = torch.empty(num_splits, n_tok, n_heads, d, device=q.device)
    block_d = max(16, triton.next_power_of_2(d))
    grid = (n_tok // block_q + n_seqs, n_kv, num_splits)  # query tiles: an upper bound (module docstring)
    attend[grid](
        q, k_pool, v_pool, block_tables, context_lens, cu_q_lens,
        out, m, l, acc,
        d**-0.5 if scale is None else scale, n_seqs,
        q.stride(0), q.stride(1),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        block_tables.stride(0),
        m.stride(0), m.stride(1),
        acc.stride(0), acc.stride(1), acc.stride(2),
        G=g, BLOCK_SIZE=block_size, HEAD_DIM=d, NUM_SPLITS=num_splits,
        BLOCK_Q=block_q, BLOCK_M=config.block_m, TILE_N=config.tile_n, BLOCK_D=block_d,
        PREFETCH=config.prefetch, PRECISION=config.precision,
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
