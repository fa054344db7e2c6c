"""Two extensions of the reference kernel (``../paged_attention.py``), for speed: split-KV and decode tiles.

**Split-KV** ("flash decoding"). During decode there is one query per sequence; on a GPU one program
per (sequence, KV head) leaves most of the chip idle when the batch is small and the context long.
Split-KV cuts each sequence's blocks into ``num_splits`` ranges, runs the block loop on each range
independently (on a GPU: in parallel) and merges the partial (m, l, acc) results in a reduce step
(``merge_partials``).

**Decode tiles.** The reference loops over sequences in Python: at 32 decode sequences x 30 layers that
is ~1,000 trips of a dozen tiny ops per step. ``attend_decode_batch`` takes every sequence with one new
token at once, the sequences a batch axis, a tile of ``blocks_per_tile`` blocks of each per step.

``split_kv_attention`` is the reference's contract with both: ``kernel="torch"`` runs it when
``num_splits`` > 1 (``num_splits=1`` runs the reference itself). The split and tile boundaries change
the order of the sums only: the result equals the reference's to float rounding.

Left out on purpose: choosing ``num_splits`` by shape (the Triton kernel's ``choose_splits`` does), and
splitting a prefill chunk's queries across programs.
"""

from __future__ import annotations

import torch

from ..paged_attention import attend_blocks, online_softmax_update


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
        m, l, acc = online_softmax_update(m, l, acc, s, v.permute(0, 2, 1, 3))  # v: (B, H_kv, n * bs, D)
    return m, l, acc


def split_kv_attention(
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
    """``paged_attention``'s arguments and result (q: (T, H, D) -> (T, H, D)), each sequence's blocks cut
    into ``num_splits`` ranges of ceil(n_blocks / num_splits) blocks whose partials are merged.

    Sequences with one new token (decode) go through ``attend_decode_batch`` together, a tile of
    ``blocks_per_tile`` blocks per step; the others (prefill, chunks) one by one through the
    reference's ``attend_blocks``, a block per step, each range with its queries' positions counted
    from the range's first key.

    Example: 5 blocks in 2 splits are blocks 0..2 and 3..4; in 4 splits, 0..1, 2..3 and 4 (never an
    empty split).
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
        partials = [  # a range's keys start at position i * block_size: its queries count from there
            attend_blocks(qs, k_pool, v_pool, blocks[i : i + per_split], q_pos - i * block_size, scale)
            for i in range(0, len(blocks), per_split)
        ]
        m, l, acc = (torch.stack(t) for t in zip(*partials, strict=True))  # (splits, H_kv, G, Tq[, D])
        o = merge_partials(m, l, acc)  # (H_kv, G, Tq, D)
        out[q0:q1] = o.permute(2, 0, 1, 3).reshape(q1 - q0, n_heads, d)
    return out
