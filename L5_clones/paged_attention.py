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
context_len_s tokens, causal among themselves. The split-KV ("flash-decoding") path cuts each
sequence's blocks into ``num_splits`` ranges, runs the loop above on each range independently (on a
GPU: in parallel) and merges the partial (m, l, acc) results in a reduce step.

This file is the readable reference; ``triton_paged_attention.py`` is the same algorithm as a GPU
kernel. It runs on the device of its inputs, but its Python loops read lengths and block ids back
(``nonzero``, ``int``, ``tolist``): on a GPU each read is a trip to the host, which the Triton kernel
never makes. Left out on purpose: speed (Python loops over sequences and blocks), sliding windows,
ALiBi, soft-capping, and quantized KV.
"""

from __future__ import annotations

import torch


def merge_partials(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """Combine softmax partials computed over disjoint key ranges (the split-KV reduce step).

    m, l: (S, ...) running max and denominator of each of S splits; acc: (S, ..., D) numerators.
    A split that saw no visible key has m = -inf, l = 0, acc = 0 and drops out.
    Example: one key per split with scores 0 and ln(3), values 1 and 5: m=[0, ln 3], l=[1, 1],
    acc=[1, 5] -> (1 * 1 + 3 * 5) / (1 + 3) = 4.0, the softmax-weighted mean of the two values.
    """
    m_all = m.amax(dim=0)  # (...)
    w = torch.exp(m - m_all)  # (S, ...) rescale each split to the common max; -inf -> 0
    return (w[..., None] * acc).sum(dim=0) / (w * l).sum(dim=0)[..., None]


def online_softmax_update(m, l, acc, s, v, pv: str):
    """Fold one block's scores ``s`` (..., keys) and values ``v`` into the running (m, l, acc).

    ``pv`` is the einsum that multiplies the block's probabilities by its values. Rows whose keys are
    all masked so far keep m = -inf; they exponentiate against 0 (``base``), since exp(-inf - -inf)
    would be NaN. Returns the new (m, l, acc).
    """
    m_new = torch.maximum(m, s.amax(dim=-1))  # running max
    base = torch.where(torch.isinf(m_new), 0.0, m_new)  # rows with nothing visible yet stay at 0
    p = torch.exp(s - base[..., None])  # masked entries are 0
    alpha = torch.exp(m - base)  # rescales what was accumulated under the old max
    return m_new, alpha * l + p.sum(dim=-1), alpha[..., None] * acc + torch.einsum(pv, p, v)


def attend_blocks(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    blocks: list[int],
    first_block: int,
    q_pos: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Online softmax of one sequence's queries over a run of its KV blocks, read in place.

    q: (H_kv, G, Tq, D) queries grouped by the KV head they read; blocks: physical block ids of logical
    blocks first_block, first_block + 1, ...; q_pos: (Tq,) absolute position of each query (it may see
    keys 0..q_pos). Returns the partials m, l: (H_kv, G, Tq) and acc: (H_kv, G, Tq, D).
    """
    n_kv, g, n_q, d = q.shape
    block_size = k_pool.shape[1]
    m = torch.full((n_kv, g, n_q), float("-inf"), device=q.device)
    l = torch.zeros(n_kv, g, n_q, device=q.device)
    acc = torch.zeros(n_kv, g, n_q, d, device=q.device)
    for j, block in enumerate(blocks, start=first_block):
        k = k_pool[block].permute(1, 0, 2)  # (H_kv, block_size, D): a view of the pool, no copy
        v = v_pool[block].permute(1, 0, 2)  # (H_kv, block_size, D)
        s = torch.einsum("hgqd,hkd->hgqk", q, k) * scale  # (H_kv, G, Tq, block_size)
        k_pos = j * block_size + torch.arange(block_size, device=q.device)  # (block_size,)
        s = s.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))  # causal (and beyond the end)
        m, l, acc = online_softmax_update(m, l, acc, s, v, "hgqk,hkd->hgqd")
    return m, l, acc


def attend_decode_batch(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    first_block: int,
    last_block: int,
    scale: float,
    blocks_per_tile: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Online softmax of B decode queries (one per sequence) over logical blocks first..last - 1, all
    sequences at once, ``blocks_per_tile`` blocks per step.

    On a GPU every (sequence, head) is its own program and they run side by side; here the sequences
    are a batch axis instead of a Python loop. Each step gathers a tile of every sequence's blocks,
    ``k_pool[ids]`` (B, tile blocks, block_size, H_kv, D): the copy a GPU program makes when it loads
    blocks into on-chip memory, one tile at a time, never the whole history. Keys at or past a
    sequence's context length are masked (a decode query sees every earlier key), so table padding
    may name any block.

    q: (B, H_kv, G, D); block_tables: (B, >= last_block), entries clamped into the pool;
    context_lens: (B,). Returns m, l: (B, H_kv, G) and acc: (B, H_kv, G, D).
    """
    n_seq, n_kv, g, d = q.shape
    block_size = k_pool.shape[1]
    m = torch.full((n_seq, n_kv, g), float("-inf"), device=q.device)
    l = torch.zeros(n_seq, n_kv, g, device=q.device)
    acc = torch.zeros(n_seq, n_kv, g, d, device=q.device)
    for j in range(first_block, last_block, blocks_per_tile):
        ids = block_tables[:, j : min(j + blocks_per_tile, last_block)]  # (B, n) physical blocks
        k = k_pool[ids].flatten(1, 2)  # (B, n * block_size, H_kv, D): the tile, gathered
        v = v_pool[ids].flatten(1, 2)
        s = torch.einsum("bhgd,bkhd->bhgk", q, k) * scale  # (B, H_kv, G, n * block_size)
        k_pos = j * block_size + torch.arange(k.shape[1], device=q.device)  # (n * block_size,)
        s = s.masked_fill((k_pos[None, :] >= context_lens[:, None])[:, None, None, :], float("-inf"))
        m, l, acc = online_softmax_update(m, l, acc, s, v, "bhgk,bkhd->bhgd")
    return m, l, acc


def paged_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cu_q_lens: torch.Tensor,
    num_splits: int = 1,
    scale: float | None = None,
    blocks_per_tile: int = 16,
) -> torch.Tensor:
    """Attention of a flat batch of new tokens over their sequences' paged KV history.

    q: (T, H, D), the new tokens of all sequences back to back; k_pool, v_pool: (num_blocks,
    block_size, H_kv, D), already holding these tokens' K/V; block_tables: (S, max_blocks) int, row s
    lists sequence s's physical blocks in order (padding past its length is never used);
    context_lens: (S,) tokens of history including the new ones; cu_q_lens: (S + 1,) query offsets,
    sequence s owns q rows cu_q_lens[s]:cu_q_lens[s + 1]. num_splits > 1 takes the split-KV path.
    Returns (T, H, D).

    Sequences with one new token (decode) go through ``attend_decode_batch`` together, a tile of
    ``blocks_per_tile`` blocks per step; the others (prefill, chunks) one by one through
    ``attend_blocks``, a block per step.

    Example: a decode batch of two sequences with 5 and 20 tokens of history, block_size 16:
    block_tables [[7, 0], [2, 9]], context_lens [5, 20], cu_q_lens [0, 1, 2]; the first query reads
    block 7 (5 keys), the second reads blocks 2 and 9 (16 + 4 keys).
    """
    n_tok, n_heads, d = q.shape
    num_blocks, block_size, n_kv = k_pool.shape[:3]
    g = n_heads // n_kv
    scale = d**-0.5 if scale is None else scale
    out = torch.empty_like(q)
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]  # (S,)

    decode = (q_lens == 1).nonzero().flatten()  # (B,) sequences with one new token
    if len(decode):
        rows, ctx = cu_q_lens[decode], context_lens[decode]  # (B,) each
        n_blocks = (int(ctx.max()) + block_size - 1) // block_size
        tables = block_tables[decode, :n_blocks].clamp(0, num_blocks - 1)  # (B, n_blocks)
        per_split = -(-n_blocks // num_splits)  # ceil: blocks handled by each split
        partials = [
            attend_decode_batch(q[rows].view(-1, n_kv, g, d), k_pool, v_pool, tables, ctx, i,
                                min(i + per_split, n_blocks), scale, blocks_per_tile)
            for i in range(0, n_blocks, per_split)
        ]  # fmt: skip
        m, l, acc = (torch.stack(t) for t in zip(*partials, strict=True))  # (splits, B, H_kv, G[, D])
        out[rows] = merge_partials(m, l, acc).reshape(-1, n_heads, d)

    for s in (q_lens != 1).nonzero().flatten().tolist():
        q0, q1, ctx = int(cu_q_lens[s]), int(cu_q_lens[s + 1]), int(context_lens[s])
        qs = q[q0:q1].view(q1 - q0, n_kv, g, d).permute(1, 2, 0, 3)  # (H_kv, G, Tq, D)
        q_pos = torch.arange(ctx - (q1 - q0), ctx, device=q.device)  # (Tq,) the last Tq positions
        blocks = block_tables[s, : (ctx + block_size - 1) // block_size].tolist()
        per_split = -(-len(blocks) // num_splits)
        partials = [
            attend_blocks(qs, k_pool, v_pool, blocks[i : i + per_split], i, q_pos, scale)
            for i in range(0, len(blocks), per_split)
        ]
        m, l, acc = (torch.stack(t) for t in zip(*partials, strict=True))  # (splits, H_kv, G, Tq[, D])
        o = merge_partials(m, l, acc)  # (H_kv, G, Tq, D)
        out[q0:q1] = o.permute(2, 0, 1, 3).reshape(q1 - q0, n_heads, d)
    return out
