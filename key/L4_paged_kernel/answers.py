"""Independent answers to the L4 exercises, for the grader's hidden cases (``kvcourse/grading/hidden.py``).

Each function has the signature the notebook asks for and is written apart from the stage's own
code (``paged_attention.py``, ``fast/split_kv.py``), so a bug in the stage cannot make a wrong answer pass. The two float
answers are dense and in float64, the definition rather than the kernel's algorithm: ``merge`` puts
the two partials back together row by row with ``math.exp``, ``attend_blocks`` gathers each query's
visible keys position by position and takes one softmax over them. ``kv_splits`` counts each split's
keys row by row. Tests check that the stage and these answers agree on many drawn cases, within the
tolerance of ``checks.HIDDEN`` (the stage sums in float32, in another order).

The exercises beyond the stage have no stage code to agree with: ``attend_window`` finds the blocks
read in closed form (a range) and attends per query in float64, and ``merge_lse`` merges row by row
with ``math.exp``; ``exercises/L4_paged_kernel/checks.py`` grades the visible cases by brute force instead. ``test_attend_blocks``
is the catch-the-bug exercise's test, and ``PREDICTION`` the prediction, worked out by hand. Their
``STAGE_ADAPTERS`` run the stage's code instead (its update, ``merge_partials``, an oracle test, the
stage's run), for the tests that hold each exercise's answer and the stage together.

``EXPECT`` maps each exercise to ``case -> observation``: the exercise's ``observe`` (``exercises/L4_paged_kernel/checks.py``)
run on the answer. ``STAGE_ADAPTERS`` give the stage's own implementations the learner's signatures
(``merge_partials`` as ``merge``, ``attend_blocks`` with one KV head as the exercise's, the splits
``split_kv_attention`` runs as ``kv_splits``), for the tests. The grader imports this file; a
submission's sandbox cannot read it.

Left out on purpose: speed (Python loops over rows, positions and keys).
"""

from __future__ import annotations

import math

import torch

from exercises.L4_paged_kernel.checks import HIDDEN, _kernel_splits, predict_state
from L4_paged_kernel.fast.split_kv import merge_partials
from L4_paged_kernel.paged_attention import attend_blocks as stage_attend_blocks
from L4_paged_kernel.paged_attention import online_softmax_update


def merge(m1, l1, acc1, m2, l2, acc2):
    """Per row: weigh each side that saw a key by exp(its max - the larger max), then divide."""
    rows = []
    for r in range(len(m1)):
        sides = [
            (float(m[r]), float(l[r]), acc[r].double()) for m, l, acc in ((m1, l1, acc1), (m2, l2, acc2))
        ]
        sides = [side for side in sides if side[0] != -math.inf]  # a side with no key drops out
        top = max(m for m, _, _ in sides)
        numerator = sum(math.exp(m - top) * acc for m, _, acc in sides)  # (D,)
        denominator = sum(math.exp(m - top) * l for m, l, _ in sides)
        rows.append(numerator / denominator)
    return torch.stack(rows)  # (R, D) float64


def attend_blocks(q, k_pool, v_pool, blocks, q_pos, scale):
    """Per query at position p: the keys and values of positions 0..p, fetched one by one from
    their blocks, and a dense softmax over them, in float64."""
    block_size = k_pool.shape[1]
    out = []
    for i, p in enumerate(q_pos.tolist()):
        where = [(blocks[t // block_size], t % block_size) for t in range(p + 1)]  # (block id, row)
        k = torch.stack([k_pool[b, row] for b, row in where]).double()  # (p + 1, D)
        v = torch.stack([v_pool[b, row] for b, row in where]).double()
        weights = torch.softmax(k @ q[i].double() * scale, dim=0)  # (p + 1,)
        out.append(weights @ v)  # (D,)
    return torch.stack(out)  # (Tq, D) float64


def kv_splits(block_table, context_len, block_size, num_splits):
    """ceil(n_blocks / num_splits) blocks a split, the last what is left; keys counted row by row."""
    n_blocks = (context_len + block_size - 1) // block_size
    per_split = (n_blocks + num_splits - 1) // num_splits
    splits = []
    for first in range(0, n_blocks, per_split):
        logical = range(first, min(first + per_split, n_blocks))
        keys = sum(1 for j in logical for row in range(block_size) if j * block_size + row < context_len)
        splits.append((first, [block_table[j] for j in logical], keys))
    return splits


def attend_window(q, k_pool, v_pool, blocks, q_pos, scale, window):
    """The blocks read are a range: the chunk's positions are consecutive, so the union of its windows
    runs from the first query's window start to the last query. Per query, its window's keys fetched
    one by one and a dense softmax over them, in float64."""
    if window < 1:
        raise ValueError(f"window must be at least 1, got {window}")
    block_size = k_pool.shape[1]
    first_key, last_key = max(0, int(q_pos[0]) - window + 1), int(q_pos[-1])
    read = [blocks[j] for j in range(first_key // block_size, last_key // block_size + 1)]
    out = []
    for i, p in enumerate(q_pos.tolist()):
        where = [(blocks[t // block_size], t % block_size) for t in range(max(0, p - window + 1), p + 1)]
        k = torch.stack([k_pool[b, row] for b, row in where]).double()  # (keys, D)
        v = torch.stack([v_pool[b, row] for b, row in where]).double()
        out.append(torch.softmax(k @ q[i].double() * scale, dim=0) @ v)  # (D,)
    return torch.stack(out), read  # (Tq, D) float64, physical ids


def merge_lse(out1, lse1, out2, lse2):
    """Per row: each side that saw a key weighs exp(its lse - the larger lse); the union's lse is the
    larger lse plus the log of the weights' sum."""
    outs, lses = [], []
    for r in range(len(lse1)):
        sides = [(float(lse[r]), out[r].double()) for lse, out in ((lse1, out1), (lse2, out2))]
        sides = [side for side in sides if side[0] != -math.inf]  # a side with no key drops out, NaN and all
        top = max(lse for lse, _ in sides)
        weights = [math.exp(lse - top) for lse, _ in sides]
        outs.append(sum(w * out for w, (_, out) in zip(weights, sides, strict=True)) / sum(weights))
        lses.append(top + math.log(sum(weights)))
    return torch.stack(outs), torch.tensor(lses, dtype=torch.float64)  # (R, D), (R,)


def test_attend_blocks(attend_blocks):
    """A 5-token chunk at positions 5..9 over a shuffled 3-block history (block_size 4) whose last block
    has 2 stale rows, 2 KV heads with 2 query heads each, scale 0.3: out = acc / l against a softmax over
    each query's keys 0..p, fetched position by position."""
    gen = torch.Generator().manual_seed(0)
    block_size, context_len, n_q, d, scale = 4, 10, 5, 3, 0.3
    k_pool = torch.randn(6, block_size, 2, d, generator=gen)  # (num_blocks, block_size, H_kv, D)
    v_pool = torch.randn(6, block_size, 2, d, generator=gen)
    blocks = [4, 0, 5]  # not 0, 1, 2: the table must be followed
    q = torch.randn(2, 2, n_q, d, generator=gen)  # (H_kv, G, Tq, D)
    q_pos = torch.arange(context_len - n_q, context_len)  # (Tq,)
    m, l, acc = attend_blocks(q, k_pool, v_pool, blocks, q_pos, scale)
    out = acc / l[..., None]  # (H_kv, G, Tq, D)
    for h in range(2):
        for g in range(2):
            for i, p in enumerate(q_pos.tolist()):
                keys = torch.stack([k_pool[blocks[t // block_size], t % block_size, h] for t in range(p + 1)])
                values = torch.stack(
                    [v_pool[blocks[t // block_size], t % block_size, h] for t in range(p + 1)]
                )
                want = torch.softmax(keys @ q[h, g, i] * scale, dim=0) @ values  # (D,)
                assert torch.allclose(out[h, g, i], want, atol=1e-5), (h, g, p)


PREDICTION = {  # worked out by hand from the scores 2 5 1 | 3 7 4 | 6 9 (12 stale), queries at 6 and 7
    "m": [[5, 7, 7], [5, 7, 9]],
    "keys": [[3, 3, 1], [3, 3, 2]],
    "rescaled": [[1], [1, 2]],
    "split_m": [[7, 6], [7, 9]],
}


def predict():
    return PREDICTION


def stage_merge(m1, l1, acc1, m2, l2, acc2):
    """``merge_partials`` as ``merge``: the two sides stacked as two splits."""
    return merge_partials(torch.stack([m1, m2]), torch.stack([l1, l2]), torch.stack([acc1, acc2]))


def stage_attend(q, k_pool, v_pool, blocks, q_pos, scale):
    """The stage's ``attend_blocks`` with one KV head and one query head, normalized."""
    m, l, acc = stage_attend_blocks(
        q[None, None], k_pool[:, :, None], v_pool[:, :, None], blocks, q_pos, scale
    )  # (1, 1, Tq) and (1, 1, Tq, D)
    return acc[0, 0] / l[0, 0][:, None]  # (Tq, D)


def stage_window(q, k_pool, v_pool, blocks, q_pos, scale, window):
    """The window through the stage's ``online_softmax_update``, a block at a time, from the first
    block a query sees: the stage's update in the exercise's signature."""
    block_size = k_pool.shape[1]
    m, l, acc = torch.full((len(q),), -math.inf), torch.zeros(len(q)), torch.zeros(q.shape)
    read = []
    for j in range(max(0, int(q_pos[0]) - window + 1) // block_size, int(q_pos[-1]) // block_size + 1):
        read.append(blocks[j])
        k_pos = j * block_size + torch.arange(block_size)  # (block_size,)
        outside = (k_pos[None, :] > q_pos[:, None]) | (k_pos[None, :] <= q_pos[:, None] - window)
        s = (q @ k_pool[blocks[j]].T * scale).masked_fill(outside, -math.inf)  # (Tq, block_size)
        m, l, acc = online_softmax_update(m, l, acc, s, v_pool[blocks[j]])
    return acc / l[:, None], read


def stage_merge_lse(out1, lse1, out2, lse2):
    """``merge_partials`` on (m = lse, l = 1, acc = out) per side, an empty side's NaN zeroed; the
    union's lse by ``torch.logsumexp``."""
    lse = torch.stack([lse1, lse2])  # (2, R)
    out = merge_partials(lse, torch.ones_like(lse), torch.stack([out1, out2]).nan_to_num())  # (R, D)
    return out, torch.logsumexp(lse, dim=0)


def stage_test(attend_blocks):
    """An oracle test: the function handed over against the stage's own ``attend_blocks``, on the
    inputs of ``test_attend_blocks``."""
    gen = torch.Generator().manual_seed(0)
    k_pool, v_pool = torch.randn(6, 4, 2, 3, generator=gen), torch.randn(6, 4, 2, 3, generator=gen)
    args = (torch.randn(2, 2, 5, 3, generator=gen), k_pool, v_pool, [4, 0, 5], torch.arange(5, 10), 0.3)
    for got, want in zip(attend_blocks(*args), stage_attend_blocks(*args), strict=True):
        assert torch.allclose(got, want, atol=1e-5)


def stage_predict():
    """The prediction read off the stage's run (``checks.predict_state``)."""
    return predict_state()


ANSWERS = {
    "L4.1": merge,
    "L4.2": attend_blocks,
    "L4.3": kv_splits,
    "L4.4": attend_window,
    "L4.5": merge_lse,
    "L4.6": test_attend_blocks,
    "L4.7": predict,
}
EXPECT = {ex: (lambda case, ex=ex: HIDDEN[ex].observe(ANSWERS[ex], case)) for ex in ANSWERS}
STAGE_ADAPTERS = {
    "L4.1": stage_merge,
    "L4.2": stage_attend,
    "L4.3": _kernel_splits,
    "L4.4": stage_window,
    "L4.5": stage_merge_lse,
    "L4.6": stage_test,
    "L4.7": stage_predict,
}
