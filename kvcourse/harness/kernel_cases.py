"""Paged-attention test cases and the dense attention they are checked against (L4 and L5's kernels).

Shared by ``tests/test_l4_kernels.py`` (on the CPU, and on a GPU where there is one) and
``python -m kvcourse.tools.gpu_check``. A case is a pool with shuffled, non-contiguous block ids holding
random K/V, block tables padded with an id outside the pool, and queries for sequences with the given
history and new-token counts::

    q, k_pool, v_pool, block_tables, context_lens, cu_q_lens = make_case(16, 9, 3, [1, 48, 23], [1, 1, 6])

Everything is drawn on the CPU from a seeded generator, so a case is the same numbers on every machine,
and then moved to ``device``. ``dense_reference`` is attention done the obvious way: gather each
sequence's history, repeat the KV heads, mask, softmax.
"""

from __future__ import annotations

import torch

GQA = [(4, 4), (9, 3), (8, 2)]  # (query heads, KV heads): ratios 1, 3, 4


def make_case(block_size, n_heads, n_kv, context_lens, q_lens, head_dim=16, seed=0, device="cpu"):
    """Random pool + block tables for sequences with the given history and new-token counts."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    blocks_needed = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(blocks_needed) + 5  # a few blocks nobody owns
    k_pool = torch.randn(num_blocks, block_size, n_kv, head_dim, generator=g, device="cpu")
    v_pool = torch.randn(num_blocks, block_size, n_kv, head_dim, generator=g, device="cpu")
    free = torch.randperm(num_blocks, generator=g, device="cpu").tolist()  # shuffled: not contiguous
    block_tables = torch.full((len(context_lens), max(blocks_needed)), 10**6, dtype=torch.long, device="cpu")
    for s, n in enumerate(blocks_needed):  # past its blocks, a row keeps the junk padding
        block_tables[s, :n] = torch.tensor([free.pop() for _ in range(n)], device="cpu")
    cu_q_lens = torch.tensor([0, *torch.tensor(q_lens, device="cpu").cumsum(0).tolist()], device="cpu")
    q = torch.randn(int(cu_q_lens[-1]), n_heads, head_dim, generator=g, device="cpu")
    case = q, k_pool, v_pool, block_tables, torch.tensor(context_lens, device="cpu"), cu_q_lens
    return tuple(t.to(device) for t in case)


def dense_reference(q, k_pool, v_pool, block_tables, context_lens, cu_q_lens):
    """Gather each sequence's history, repeat KV heads, masked softmax: the obvious way (on q's device)."""
    out = torch.empty_like(q)
    n_heads, n_kv, bs = q.shape[1], k_pool.shape[2], k_pool.shape[1]
    for s, ctx in enumerate(context_lens.tolist()):
        q0, q1 = int(cu_q_lens[s]), int(cu_q_lens[s + 1])
        ids = block_tables[s, : -(-ctx // bs)]
        k = k_pool[ids].flatten(0, 1)[:ctx].repeat_interleave(n_heads // n_kv, dim=1)  # (ctx, H, D)
        v = v_pool[ids].flatten(0, 1)[:ctx].repeat_interleave(n_heads // n_kv, dim=1)
        pos = torch.arange(ctx - (q1 - q0), ctx, device=q.device)
        scores = torch.einsum("thd,khd->htk", q[q0:q1], k) / q.shape[-1] ** 0.5
        future = torch.arange(ctx, device=q.device)[None, None, :] > pos[None, :, None]
        out[q0:q1] = torch.einsum("htk,khd->thd", scores.masked_fill(future, float("-inf")).softmax(-1), v)
    return out


def cases():
    """(block_size, n_heads, n_kv, context_lens, q_lens): block sizes 1, 7, 16 x GQA ratios 1, 3, 4, each
    with lengths 1, an exact multiple of block_size and ragged ones, decode rows and prefill chunks."""
    for block_size in (1, 7, 16):
        for n_heads, n_kv in GQA:
            yield block_size, n_heads, n_kv, [1, 3 * block_size, 23, 9], [1, 1, 6, 9]


# Fewer and smaller cases, for the Triton interpreter (it runs each program in Python). Each has a
# history longer than the compiled kernel's 32-position tile, so in that launch one program rescales
# across tiles (with 4 splits, the tiles of the 70-position history go to three programs and the merge
# combines them).
TRITON_CASES = [
    (1, 4, 4, [1, 40], [1, 5]),
    (7, 9, 3, [1, 45, 10], [1, 1, 4]),
    (16, 8, 2, [1, 70, 21], [1, 1, 21]),
]

# Prefill shapes for the Triton kernel's query tiles: prompts of 1 to 2,048 rows, GQA 1:1 to 4:1 (and
# 32:1, more heads than 16 rows hold), prefill chunks after a history (chunked prefill), histories
# longer than one key tile, and decode tokens in the same batch as prompts.
QUERY_TILE_CASES = [
    (16, 4, 4, [1], [1]),  # one row
    (16, 9, 3, [300], [300]),  # one prompt, many query tiles
    (16, 8, 2, [2048], [2048]),  # 2,048 rows
    (7, 9, 3, [70, 45, 1, 200], [70, 1, 1, 37]),  # a prompt, two decode tokens, a chunk after 163 tokens
    (16, 8, 2, [129, 5, 600], [64, 5, 8]),  # chunks after 65 and 592 tokens, a whole 5-token prompt
    (16, 4, 4, [33, 100], [33, 100]),  # two prompts, back to back
    (16, 32, 1, [40, 3], [17, 1]),  # 32 query heads on one KV head
]
