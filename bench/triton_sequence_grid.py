"""L4's Triton kernel as it was before query tiles (commit 679fbf8), kept for ``bench.kernels`` to time
against: ``python -m bench.kernels --prefill`` (on a GPU) and ``--interpreter`` (on the CPU).

Its grid is ``(num_seqs, H_kv)``: one program per sequence and KV head, which loops over its
sequence's query rows ``BLOCK_M`` at a time, one chunk after another, and for each chunk walks the
history a tile of ``TILE_N`` positions at a time. A 2,000-token prompt of SmolLM2 (3 KV heads) is 3
programs however many multiprocessors the GPU has. It reduces with ``tl.reduce`` and combine functions
of its own, which Triton's interpreter calls in Python once per element. The algorithm, the masks and
the arithmetic are those of ``L4_paged_kernel/fast/triton_paged_attention.py``; only the grid and the
combine functions differ.

Left out on purpose: split-KV (the query-tiled kernel is timed with one split against it), and any
use outside the bench.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from L4_paged_kernel.fast.triton_paged_attention import LaunchConfig, jit


def _maximum(a, b):
    """Combine function of a max reduction: ``tl.reduce(x, axis, _maximum)`` is ``tl.max(x, axis)``."""
    return tl.maximum(a, b)


def _add(a, b):
    """Combine function of a sum: ``tl.reduce(x, axis, _add)`` is ``tl.sum(x, axis)``."""
    return a + b


# Called from inside the kernel, compiled in both: the interpreter calls their Python function.
_maximum, _add = jit(_maximum, interpret=False), jit(_add, interpret=False)


def _sequence_grid_kernel(
    q_ptr, k_ptr, v_ptr, block_tables_ptr, context_lens_ptr, cu_q_lens_ptr, out_ptr,
    scale,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_bt,
    G: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, TILE_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    q0 = tl.load(cu_q_lens_ptr + seq)
    q_len = tl.load(cu_q_lens_ptr + seq + 1) - q0
    ctx = tl.load(context_lens_ptr + seq)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    offs_t = tl.arange(0, TILE_N)
    for row0 in range(0, q_len * G, BLOCK_M):  # query rows = (new token, head of this group) pairs
        rows = row0 + tl.arange(0, BLOCK_M)
        row_mask = rows < q_len * G
        tok = rows // G
        head = kv_head * G + rows % G
        q_pos = ctx - q_len + tok  # absolute position of each query row
        row_off = (q0 + tok)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
        q = tl.load(
            q_ptr + row_off, mask=row_mask[:, None] & d_mask[None, :], other=0.0
        )  # (BLOCK_M, BLOCK_D)
        m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l = tl.full((BLOCK_M,), 0.0, tl.float32)
        acc = tl.full((BLOCK_M, BLOCK_D), 0.0, tl.float32)
        last_pos = ctx - q_len + tl.minimum((row0 + BLOCK_M - 1) // G, q_len - 1)  # newest query here
        for t0 in range(0, last_pos + 1, TILE_N):  # later tiles: all masked
            pos = t0 + offs_t  # (TILE_N,) positions of this tile
            pos_mask = pos < ctx
            block = tl.load(block_tables_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=pos_mask, other=0)
            kv_row = block * stride_kb + (pos % BLOCK_SIZE) * stride_ks  # (TILE_N,) in place
            kv_off = kv_row[:, None] + kv_head * stride_kh + offs_d[None, :]
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
        tl.store(out_ptr + row_off, acc / l[:, None], mask=row_mask[:, None] & d_mask[None, :])


KERNELS = {interpret: jit(_sequence_grid_kernel, interpret) for interpret in (False, True)}


def sequence_grid_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cu_q_lens: torch.Tensor,
    config: LaunchConfig | None = None,
) -> torch.Tensor:
    """The reference ``paged_attention``'s contract, one program per (sequence, KV head), one split;
    ``config`` as the query-tiled kernel's (``LaunchConfig()``, 16 rows x 32 positions, when None)."""
    config = config or LaunchConfig()
    n_tok, n_heads, d = q.shape
    block_size, n_kv = k_pool.shape[1], k_pool.shape[2]
    q, k_pool, v_pool = q.contiguous(), k_pool.contiguous(), v_pool.contiguous()
    block_tables = block_tables.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    KERNELS[q.device.type == "cpu"][(block_tables.shape[0], n_kv)](
        q, k_pool, v_pool, block_tables, context_lens.to(torch.int32), cu_q_lens.to(torch.int32), out,
        d**-0.5,
        q.stride(0), q.stride(1),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        block_tables.stride(0),
        G=n_heads // n_kv, BLOCK_SIZE=block_size, HEAD_DIM=d,
        BLOCK_M=config.block_m, TILE_N=config.tile_n, BLOCK_D=max(16, triton.next_power_of_2(d)),
        num_warps=config.num_warps, num_stages=config.num_stages, enable_fp_fusion=False,
    )  # fmt: skip
    return out
