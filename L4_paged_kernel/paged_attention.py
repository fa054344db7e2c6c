"""L4's paged attention, in PyTorch: attention that walks each sequence's block table in place.

L3 gathered every request's history into a fresh contiguous tensor before attending (a copy of
context_len x H_kv x D floats per layer, per step). This kernel reads the KV blocks where they lie in
the pool, one block at a time, and keeps a running softmax ("online softmax") so it never needs the
whole row of scores at once:

    for each block j of the sequence:         s_j = q . K_j * scale          (scores of this block)
        m_new = max(m, max(s_j))                                              (running max)
        l     = l * exp(m - m_new) + sum(exp(s_j - m_new))                    (running denominator)
        acc   = acc * exp(m - m_new) + exp(s_j - m_new) . V_j                 (running numerator)
        m     = m_new
    out = acc / l

It handles a flat batch of several sequences with ragged lengths, GQA (G query heads share one KV
head), and mixed prefill/decode: sequence s brings q_len_s new query tokens, the last q_len_s of its
context_len_s tokens, causal among themselves.

This file is the readable reference, and exact: one sequence at a time, one block at a time. It runs on
the device of its inputs, but its Python loop reads lengths and block ids back (``tolist``): on a GPU
each read is a trip to the host. The fast versions of the same algorithm live apart, in ``fast/``:
decode rows batched in tiles and split-KV (``fast/split_kv.py``), a C++ kernel for the CPU and a
Triton kernel for the GPU.

Left out on purpose: speed (Python loops over sequences and blocks), split-KV, sliding windows,
ALiBi, soft-capping, and quantized KV.
"""

from __future__ import annotations

import torch


def online_softmax_update(m, l, acc, s, v):
    """Fold one block's scores ``s`` (..., Tq, keys) and values ``v`` (..., keys, D) into the running
    (m, l, acc): m, l (..., Tq), acc (..., Tq, D). Returns the new (m, l, acc).

    Rows whose keys are all masked so far keep m = -inf; they exponentiate against 0 (``base``), since
    exp(-inf - -inf) would be NaN. In this file that never happens (block 0 holds position 0, which
    every query sees); a key range that starts later can see nothing (split-KV, ``fast/split_kv.py``).
    """
    m_new = torch.maximum(m, s.amax(dim=-1))  # running max
    base = torch.where(torch.isinf(m_new), 0.0, m_new)  # rows with nothing visible yet stay at 0
    p = torch.exp(s - base[..., None])  # masked entries are 0
    alpha = torch.exp(m - base)  # rescales what was accumulated under the old max
    return m_new, alpha * l + p.sum(dim=-1), alpha[..., None] * acc + p @ v


def attend_blocks(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    blocks: list[int],
    q_pos: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Online softmax of one sequence's queries over its KV blocks, read in place.

    q: (H_kv, G, Tq, D) queries grouped by the KV head they read; blocks: physical block ids of
    logical blocks 0, 1, ...; q_pos: (Tq,) absolute position of each query (it sees keys 0..q_pos).
    Returns the partials m, l: (H_kv, G, Tq) and acc: (H_kv, G, Tq, D); out = acc / l.

    Example, block_size 16, blocks [5, 2], q_pos [20]: the query reads the 16 keys of block 5, then
    rows 0..4 of block 2 (positions 16..20); rows 5..15 are masked.
    """
    n_kv, g, n_q, d = q.shape
    block_size = k_pool.shape[1]
    m = torch.full((n_kv, g, n_q), float("-inf"), device=q.device)
    l = torch.zeros(n_kv, g, n_q, device=q.device)
    acc = torch.zeros(n_kv, g, n_q, d, device=q.device)
    for j, block in enumerate(blocks):
        k = k_pool[block].permute(1, 0, 2)  # (H_kv, block_size, D): a view of the pool, no copy
        v = v_pool[block].permute(1, 0, 2)  # (H_kv, block_size, D)
        s = torch.einsum("hgqd,hkd->hgqk", q, k) * scale  # (H_kv, G, Tq, block_size)
        k_pos = j * block_size + torch.arange(block_size, device=q.device)  # (block_size,)
        s = s.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))  # causal (and beyond the end)
        m, l, acc = online_softmax_update(m, l, acc, s, v[:, None])  # v: (H_kv, 1, block_size, D)
    return m, l, acc


def paged_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cu_q_lens: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of a flat batch of new tokens over their sequences' paged KV history.

    q: (T, H, D), the new tokens of all sequences back to back; k_pool, v_pool: (num_blocks,
    block_size, H_kv, D), already holding these tokens' K/V; block_tables: (S, max_blocks) int, row s
    lists sequence s's physical blocks in order (padding past its length is never read);
    context_lens: (S,) tokens of history including the new ones; cu_q_lens: (S + 1,) query offsets,
    sequence s owns q rows cu_q_lens[s]:cu_q_lens[s + 1]. Returns (T, H, D).

    Example: a decode batch of two sequences with 5 and 20 tokens of history, block_size 16:
    block_tables [[7, 0], [2, 9]], context_lens [5, 20], cu_q_lens [0, 1, 2]; the first query reads
    block 7 (5 keys), the second reads blocks 2 and 9 (16 + 4 keys).
    """
    n_tok, n_heads, d = q.shape
    block_size, n_kv = k_pool.shape[1:3]
    g = n_heads // n_kv
    scale = d**-0.5 if scale is None else scale
    out = torch.empty_like(q)
    for s, ctx in enumerate(context_lens.tolist()):
        q0, q1 = int(cu_q_lens[s]), int(cu_q_lens[s + 1])
        qs = q[q0:q1].view(q1 - q0, n_kv, g, d).permute(1, 2, 0, 3)  # (H_kv, G, Tq, D)
        q_pos = torch.arange(ctx - (q1 - q0), ctx, device=q.device)  # (Tq,) the last Tq positions
        blocks = block_tables[s, : (ctx + block_size - 1) // block_size].tolist()
        m, l, acc = attend_blocks(qs, k_pool, v_pool, blocks, q_pos, scale)
        o = acc / l[..., None]  # (H_kv, G, Tq, D)
        out[q0:q1] = o.permute(2, 0, 1, 3).reshape(q1 - q0, n_heads, d)
    return out
