"""The L4 notebook's exercise checkers: the learner's kernel pieces against this stage's own kernel.

- ``check_merge``: merging two softmax partials, against dense softmax over the union of the keys and
  against ``merge_partials`` (``fast/split_kv.py``);
- ``check_attend_blocks``: the online-softmax loop over one sequence's blocks, read in place, against
  dense masked softmax over the gathered history and against ``attend_blocks`` (``paged_attention.py``);
- ``check_kv_splits``: how the split-KV path cuts one decode query's blocks into ranges, against the
  calls ``split_kv_attention`` (``fast/split_kv.py``) makes to ``attend_decode_batch`` on the same
  block table;
- ``check_attend_window`` (beyond the stage): a sliding window that reads only the blocks some query
  sees, against dense softmax over each query's window and the blocks found by trying every
  (query, key) pair; the blocks it must not read hold NaN;
- ``check_merge_lse`` (beyond the stage): merging two partials kept as (out, lse), against dense softmax
  and ``torch.logsumexp`` over the union's raw scores;
- ``check_catch_attend_blocks`` (catch the bug): the learner's test on ``attend_blocks`` and on it with
  bugs of the mutation list put in (``kvcourse/grading/mutations.py``);
- ``check_predict`` (predict): the learner's written-down state of the block loop on a tiny input,
  against what the stage's ``attend_blocks`` and ``split_kv_attention`` give on it.

Dense softmax is the definition the float pieces must reproduce; the stage's kernel is the code
the course runs, and for the split ranges it is the only reference. Floats are compared within a
tolerance (``close_problem``), since online softmax sums in another order than dense softmax. Where a
wrong answer gives what a known mistake gives (a rescale left out, a mask one off, a wrong cut), its
line names the rule it breaks (``named_mistake``); the mistakes are computed here, wrong on purpose.

The grading contract (see ``kvcourse/grading/cases.py``): each checker runs fixed, seeded cases and prints
one deterministic line per case (``ok``, ``WRONG — what differs``, or ``raised`` and the exception),
then ``k/n passed``. The reference notebook stores those lines as the check cell's output and
``make grade`` compares them.

Below the checkers, ``HIDDEN`` holds each exercise's hidden cases for ``make grade``
(``kvcourse/grading/hidden.py``): drawn from a seed per grading run and judged in the grader's process against
the independent answers of ``key/L4_paged_kernel/answers.py``, never against this stage's code.

Left out on purpose: GQA and batches of sequences (the exercises take one sequence and one KV head;
the stage's kernel adds those axes), timing (the check cannot tell whether the learner gathered), and
the splits of a prefill chunk (``kv_splits`` is graded on decode queries; ``split_kv_attention`` cuts
a chunk's blocks the same way).
"""

from __future__ import annotations

from collections.abc import Callable
from unittest import mock

import torch

from kvcourse.grading.cases import Case, close_problem, named_mistake, run_cases
from kvcourse.grading.hidden import Hidden, unrevealed
from kvcourse.grading.mutations import catch_cases, catch_hidden
from L4_paged_kernel.fast import split_kv
from L4_paged_kernel.fast.split_kv import merge_partials
from L4_paged_kernel.paged_attention import attend_blocks as ref_attend_blocks


def _partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor):
    """Softmax partial of queries q (R, D) over keys k, v (n, D): m, l (R,) and acc (R, D).

    visible: (R, n) bool. A row that sees no key gets m = -inf, l = 0, acc = 0.
    """
    s = (q @ k.T).masked_fill(~visible, float("-inf"))  # (R, n)
    m = s.amax(dim=-1) if s.shape[1] else torch.full((q.shape[0],), float("-inf"))  # (R,)
    p = torch.exp(s - torch.where(torch.isinf(m), 0.0, m)[:, None])  # (R, n), 0 where masked
    return m, p.sum(dim=-1), p @ v


def _same_floats(a, b) -> bool:
    """Two float results equal to float rounding (NaN equal to NaN): a mistake's output and a learner's."""
    return (
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and a.shape == b.shape
        and torch.allclose(a.double(), b.double(), rtol=1e-5, atol=1e-5, equal_nan=True)
    )


# Known mistakes, each named by the rule it breaks: when a wrong answer gives what one of them gives on
# the same input, its case line says which rule (``named_mistake``). They are wrong on purpose.
ACC_NOT_RESCALED = "acc is not rescaled when the running max changes"
L_NOT_RESCALED = "l is not rescaled when the running max changes"


def _merge_mistakes(m1, l1, acc1, m2, l2, acc2) -> dict:
    """What known wrong merges give on these partials: m (R,), l (R,), acc (R, D) per side."""
    top = torch.maximum(m1, m2)  # (R,)
    w1, w2 = torch.exp(m1 - top)[:, None], torch.exp(m2 - top)[:, None]  # (R, 1)
    raw1, raw2 = torch.exp(m1)[:, None], torch.exp(m2)[:, None]  # (R, 1): inf past a score of 88
    return {
        "the two sides are added without rescaling each to the common max": lambda: (
            (acc1 + acc2) / (l1 + l2)[:, None]
        ),
        "acc is rescaled to the common max, l is not": lambda: (w1 * acc1 + w2 * acc2) / (l1 + l2)[:, None],
        "l is rescaled to the common max, acc is not": lambda: (
            (acc1 + acc2) / (w1 * l1[:, None] + w2 * l2[:, None])
        ),
        "exp(m) on its own overflows: weigh each side by exp(m - max(m1, m2))": lambda: (
            (raw1 * acc1 + raw2 * acc2) / (raw1 * l1[:, None] + raw2 * l2[:, None])
        ),
    }


def check_merge(merge: Callable) -> None:
    """Grade ``merge(m1, l1, acc1, m2, l2, acc2) -> out`` on fixed, seeded cases.

    Each side is a softmax partial of R query rows over its own keys: running max m (R,), denominator
    l (R,) and un-normalised numerator acc (R, D); a row that saw no visible key on a side has m = -inf,
    l = 0, acc = 0 there. ``out`` (R, D) must be softmax attention over the union of both sides' keys.
    Two references: dense masked softmax over the union, computed here from the raw scores, and
    ``merge_partials``. Example: one key per side, scores 0 and ln 3, values 1 and 5:
    m = (0, ln 3), l = (1, 1), acc = (1, 5) -> (1 * 1 + 3 * 5) / (1 + 3) = 4.0.
    """

    def case(rows: int, n1: int, n2: int, dim: int, seed: int, hide1=None, hide2=None, size: float = 1.0):
        """hide1 / hide2: rows that see no key on that side ("all" = every row)."""

        def run() -> str | None:
            gen = torch.Generator().manual_seed(seed)
            q = torch.randn(rows, dim, generator=gen) * size  # (R, D); size scales the scores
            k = torch.randn(n1 + n2, dim, generator=gen)  # (n1 + n2, D)
            v = torch.randn(n1 + n2, dim, generator=gen)
            visible = torch.ones(rows, n1 + n2, dtype=torch.bool)  # (R, n1 + n2)
            for hide, cols in ((hide1, slice(0, n1)), (hide2, slice(n1, n1 + n2))):
                if hide is not None:
                    visible[slice(None) if hide == "all" else hide, cols] = False
            s = (q @ k.T).masked_fill(~visible, float("-inf"))  # (R, n1 + n2) the union's scores
            dense = s.softmax(dim=-1) @ v  # (R, D)
            m1, l1, acc1 = _partial(q, k[:n1], v[:n1], visible[:, :n1])
            m2, l2, acc2 = _partial(q, k[n1:], v[n1:], visible[:, n1:])
            ref = merge_partials(torch.stack([m1, m2]), torch.stack([l1, l2]), torch.stack([acc1, acc2]))
            got = merge(m1.clone(), l1.clone(), acc1.clone(), m2.clone(), l2.clone(), acc2.clone())
            problem = close_problem("out (against dense softmax)", dense, got) or close_problem(
                "out (against merge_partials)", ref, got
            )
            return named_mistake(problem, got, _merge_mistakes(m1, l1, acc1, m2, l2, acc2), _same_floats)

        return run

    def docstring_example() -> str | None:
        m1, m2 = torch.tensor([0.0]), torch.log(torch.tensor([3.0]))
        one = torch.ones(1)
        got = merge(m1, one.clone(), torch.tensor([[1.0]]), m2, one.clone(), torch.tensor([[5.0]]))
        problem = close_problem("out", torch.tensor([[4.0]]), got)
        return named_mistake(
            problem,
            got,
            _merge_mistakes(m1, one, torch.tensor([[1.0]]), m2, one, torch.tensor([[5.0]])),
            _same_floats,
        )

    run_cases(
        [
            Case("one key per side, scores 0 and ln 3, values 1 and 5: 4.0", docstring_example),
            Case("4 rows, 5 + 7 keys, D 8", case(4, 5, 7, 8, seed=1)),
            Case("one row, 1 + 16 keys, D 16", case(1, 1, 16, 16, seed=2)),
            Case("side 2 saw no key (m2 = -inf, l2 = 0)", case(3, 6, 4, 8, seed=3, hide2="all")),
            Case("side 1 saw no key (m1 = -inf, l1 = 0)", case(3, 6, 4, 8, seed=4, hide1="all")),
            Case(
                "rows 0 and 2 see nothing on side 2, row 1 nothing on side 1",
                case(4, 5, 5, 8, seed=5, hide1=[1], hide2=[0, 2]),
            ),
            Case(
                "large scores (maxima 157 to 234): exp must not overflow",
                case(4, 6, 6, 16, seed=6, size=30.0),
            ),
        ]
    )


ATTEND_MISTAKES = {  # the first whose output matches names the rule (some give the same output)
    "stale": "the stale rows past the end of the history are not masked",
    "no mask": "every key is visible: no mask, or key positions that restart at 0 in every block",
    "acc": ACC_NOT_RESCALED,
    "l": L_NOT_RESCALED,
    "no scale": "the scores are not multiplied by scale",
    "own key": "the mask hides each query's own key (>= where > belongs)",
    "next key": "the mask lets a query see the key after it (off by one)",
    "end only": "only the rows past the history are masked, not the later keys a query must not see",
    "logical": "block j is read from pool row j, not from blocks[j] (the logical index as the physical id)",
}


def _wrong_block_loop(q, k_pool, v_pool, blocks, q_pos, scale, mistake: str) -> torch.Tensor:
    """The block loop of L4.2 with the mistake ``mistake`` (a key of ``ATTEND_MISTAKES``) put in."""
    n_q, d = q.shape
    block_size = k_pool.shape[1]
    m, l, acc = (
        torch.full((n_q,), float("-inf")),
        torch.zeros(n_q),
        torch.zeros(n_q, d),
    )  # (Tq,) (Tq,) (Tq, D)
    for j, block in enumerate(blocks):
        block = j if mistake == "logical" else block
        s = (q @ k_pool[block].T) * (1.0 if mistake == "no scale" else scale)  # (Tq, block_size)
        k_pos = j * block_size + torch.arange(block_size)  # (block_size,)
        hidden = {  # (Tq, block_size): the keys each mistake masks
            "stale": (k_pos[None, :] > q_pos[:, None]) & (k_pos[None, :] <= q_pos.max()),
            "own key": k_pos[None, :] >= q_pos[:, None],
            "next key": k_pos[None, :] > q_pos[:, None] + 1,
            "no mask": torch.zeros(n_q, block_size, dtype=torch.bool),
            "end only": (k_pos[None, :] > q_pos.max()).expand(n_q, block_size),
        }.get(mistake, k_pos[None, :] > q_pos[:, None])
        s = s.masked_fill(hidden, float("-inf"))
        m_new = torch.maximum(m, s.amax(dim=-1))  # (Tq,)
        p, alpha = torch.exp(s - m_new[:, None]), torch.exp(m - m_new)  # (Tq, block_size), (Tq,)
        l = (1.0 if mistake == "l" else alpha) * l + p.sum(dim=-1)
        acc = (1.0 if mistake == "acc" else alpha[:, None]) * acc + p @ v_pool[block]
        m = m_new
    return acc / l[:, None]  # (Tq, D)


def _attend_mistakes(q, k_pool, v_pool, blocks, q_pos, scale) -> dict:
    """What each of ``ATTEND_MISTAKES`` gives on this input, by its rule."""
    return {
        rule: (lambda mistake=mistake: _wrong_block_loop(q, k_pool, v_pool, blocks, q_pos, scale, mistake))
        for mistake, rule in ATTEND_MISTAKES.items()
    }


def check_attend_blocks(attend_blocks: Callable) -> None:
    """Grade ``attend_blocks(q, k_pool, v_pool, blocks, q_pos, scale) -> out`` on fixed, seeded cases.

    One sequence, one KV head: q (Tq, D); k_pool, v_pool (num_blocks, block_size, D) hold every
    sequence's K/V (shuffled, so ``blocks`` is not contiguous, and a few blocks belong to nobody);
    blocks: the sequence's physical block ids in position order, ceil(context_len / block_size) of them;
    q_pos: (Tq,) int64 absolute positions of the queries, the last Tq of the history (query at position p
    sees keys 0..p). ``out`` (Tq, D) must equal dense masked softmax attention over the gathered history
    (computed here the L3 way) and this stage's ``attend_blocks`` with one KV head and one query head.
    Rows of the last block past the history hold stale K/V and must be masked. Example: block_size 16,
    blocks [5, 2], q_pos [20]: the query reads 16 keys of block 5, then rows 0..4 of block 2.
    """

    def case(block_size: int, context_len: int, q_len: int, dim: int, seed: int, size: float = 1.0):
        def run() -> str | None:
            gen = torch.Generator().manual_seed(seed)
            n_blocks = -(-context_len // block_size)
            num_blocks = n_blocks + 3  # a few blocks nobody owns
            k_pool = torch.randn(num_blocks, block_size, dim, generator=gen)  # (N, B, D)
            v_pool = torch.randn(num_blocks, block_size, dim, generator=gen)
            blocks = torch.randperm(num_blocks, generator=gen)[:n_blocks].tolist()  # shuffled ids
            q = torch.randn(q_len, dim, generator=gen) * size  # (Tq, D)
            q_pos = torch.arange(context_len - q_len, context_len)  # (Tq,)
            scale = dim**-0.5
            k = k_pool[blocks].flatten(0, 1)[:context_len]  # (ctx, D): the L3 gather
            v = v_pool[blocks].flatten(0, 1)[:context_len]
            s = (q @ k.T * scale).masked_fill(
                torch.arange(context_len)[None, :] > q_pos[:, None], float("-inf")
            )
            dense = s.softmax(dim=-1) @ v  # (Tq, D)
            m, l, acc = ref_attend_blocks(  # the stage's kernel, H_kv = G = 1: (1, 1, Tq[, D])
                q[None, None], k_pool[:, :, None], v_pool[:, :, None], blocks, q_pos, scale
            )
            kernel = acc[0, 0] / l[0, 0][:, None]  # (Tq, D)
            got = attend_blocks(q.clone(), k_pool.clone(), v_pool.clone(), list(blocks), q_pos.clone(), scale)
            problem = close_problem("out", dense, got) or close_problem(
                "out (against attend_blocks)", kernel, got
            )
            mistakes = _attend_mistakes(q, k_pool, v_pool, blocks, q_pos, scale)
            return named_mistake(problem, got, mistakes, _same_floats)

        return run

    run_cases(
        [
            Case("decode: 1 query at position 20, block_size 16 (2 blocks)", case(16, 21, 1, 16, seed=1)),
            Case("decode, block_size 1: one key per block, 9 blocks", case(1, 9, 1, 8, seed=2)),
            Case("decode, block_size 7: 23 keys, the last block partly stale", case(7, 23, 1, 8, seed=3)),
            Case("decode, block_size 16: exactly 3 full blocks", case(16, 48, 1, 16, seed=4)),
            Case("a whole 16-token prompt in one block (causal)", case(16, 16, 16, 8, seed=5)),
            Case(
                "prefill chunk: positions 17..22, block_size 7; rows 17..20 see nothing in block 3",
                case(7, 23, 6, 8, seed=6),
            ),
            Case("prefill chunk: positions 30..37, block_size 16 (3 blocks)", case(16, 38, 8, 16, seed=7)),
            Case(
                "large scores (maxima 52 to 71): the running max must be used",
                case(7, 30, 3, 16, seed=8, size=30.0),
            ),
        ]
    )


def _kernel_splits(block_table: list[int], context_len: int, block_size: int, num_splits: int) -> list:
    """The splits ``split_kv_attention`` runs for one decode query: (first_block, block ids, keys) each.

    The kernel runs on a pool whose keys are all zero, so every visible score is 0 and each split's
    denominator ``l`` is the number of keys it attends; a wrapper around ``attend_decode_batch`` records
    the logical block range of each call, the physical ids it reads from the table, and that count.
    """
    num_blocks = max(block_table) + 1
    k_pool = torch.zeros(num_blocks, block_size, 1, 2)  # (num_blocks, block_size, H_kv, D): scores all 0
    v_pool = torch.ones(num_blocks, block_size, 1, 2)
    original = split_kv.attend_decode_batch
    calls = []

    def recording(q, k_pool, v_pool, tables, context_lens, first, last, scale, blocks_per_tile):
        m, l, acc = original(q, k_pool, v_pool, tables, context_lens, first, last, scale, blocks_per_tile)
        calls.append((first, tables[0, first:last].tolist(), round(float(l[0, 0, 0]))))  # l: (1, 1, 1)
        return m, l, acc

    with mock.patch.object(split_kv, "attend_decode_batch", recording):
        split_kv.split_kv_attention(
            torch.ones(1, 1, 2),  # q (T = 1, H = 1, D = 2): one decode token
            k_pool,
            v_pool,
            torch.tensor([block_table]),  # (1, len(block_table))
            torch.tensor([context_len]),
            torch.tensor([0, 1]),  # cu_q_lens: one query
            num_splits=num_splits,
        )
    return calls


def _shuffled(table_len: int, seed: int) -> list[int]:
    """A block table of ``table_len`` distinct ids, drawn in a seeded order from 0 .. table_len + 2."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(table_len + 3, generator=gen)[:table_len].tolist()


def _cut(block_table, context_len, block_size, sizes) -> list:
    """Splits of ``sizes`` blocks each, in order, from the front of ``block_table``: (first, ids, keys)."""
    splits, first = [], 0
    for size in sizes:
        last = first + size
        splits.append(
            (first, block_table[first:last], min(last * block_size, context_len) - first * block_size)
        )
        first = last
    return splits


def _splits_mistakes(want: list, block_table, context_len: int, block_size: int, num_splits: int) -> dict:
    """What known wrong cuts give, derived from the right splits ``want`` (or re-cut otherwise)."""
    n_blocks = sum(len(blocks) for _, blocks, _ in want)
    floor = max(n_blocks // num_splits, 1)
    even = [n_blocks // num_splits + (i < n_blocks % num_splits) for i in range(num_splits)]
    whole = -(-len(block_table) // num_splits)  # ceil over the whole table
    return {
        "first_block is the logical index of the split's first block, not 0": lambda: [
            (0, blocks, keys) for _, blocks, keys in want
        ],
        "the blocks are logical indices, not the table's physical ids": lambda: [
            (first, list(range(first, first + len(blocks))), keys) for first, blocks, keys in want
        ],
        "the stale rows at or past context_len are counted as keys": lambda: [
            (first, blocks, len(blocks) * block_size) for first, blocks, _ in want
        ],
        "per_split is floor(n_blocks / num_splits), not ceil: the remainder makes an extra split": lambda: (
            _cut(
                block_table,
                context_len,
                block_size,
                [min(floor, n_blocks - i) for i in range(0, n_blocks, floor)],
            )
        ),
        "blocks spread evenly over num_splits, not ceil(n_blocks / num_splits) per split": lambda: _cut(
            block_table, context_len, block_size, [size for size in even if size]
        ),
        "the whole block table is cut, not only the ceil(context_len / block_size) blocks of the history": (
            lambda: _cut(
                block_table,
                context_len,
                block_size,
                [min(whole, len(block_table) - i) for i in range(0, len(block_table), whole)],
            )
        ),
    }


def check_kv_splits(kv_splits: Callable) -> None:
    """Grade ``kv_splits(block_table, context_len, block_size, num_splits) -> list of splits``.

    One sequence's decode query with ``context_len`` tokens of history in the blocks of
    ``block_table`` (a list of physical ids, maybe longer than the history needs). Each split is a tuple
    ``(first_block, blocks, num_keys)``: the logical index of its first block, the physical ids it reads
    in order, and how many keys it attends (rows at or past ``context_len`` are masked). The answer must
    be the splits ``split_kv_attention(..., num_splits=num_splits)`` runs, in order, recorded from its calls
    to ``attend_decode_batch`` on a pool of all-zero keys (where each split's denominator counts its
    keys). Example: block table [7, 2, 9, 4, 0], context_len 18, block_size 4, num_splits 2: 5 blocks,
    ceil(5 / 2) = 3 per split -> [(0, [7, 2, 9], 12), (3, [4, 0], 6)].
    """

    def case(block_table: list[int], context_len: int, block_size: int, num_splits: int):
        def run() -> str | None:
            want = _kernel_splits(block_table, context_len, block_size, num_splits)
            got = kv_splits(list(block_table), context_len, block_size, num_splits)
            try:
                got = [(int(first), [int(b) for b in blocks], int(keys)) for first, blocks, keys in got]
            except (TypeError, ValueError):
                return f"returned {got!r}, expected a list of (first_block, blocks, num_keys) tuples"
            mistakes = _splits_mistakes(want, list(block_table), context_len, block_size, num_splits)
            if len(got) != len(want):
                return named_mistake(f"{len(got)} splits {got}, expected {len(want)}: {want}", got, mistakes)
            for i, (have, expected) in enumerate(zip(got, want, strict=True)):
                if have != expected:
                    return named_mistake(f"split {i} is {have}, expected {expected}", got, mistakes)
            return None

        return run

    run_cases(
        [
            Case("table [7, 2, 9, 4, 0], 18 keys, block_size 4, 2 splits", case([7, 2, 9, 4, 0], 18, 4, 2)),
            Case("10 blocks, 2 splits: 5 + 5 blocks, the last holds 1 key", case(_shuffled(10, 1), 37, 4, 2)),
            Case(
                "7 blocks, 3 splits: ceil(7 / 3) = 3 blocks each, the last gets 1",
                case(_shuffled(7, 2), 100, 16, 3),
            ),
            Case("5 full blocks, 4 splits: only 3 splits (2 + 2 + 1)", case(_shuffled(5, 3), 40, 8, 4)),
            Case("1 split: every block, 13 keys", case(_shuffled(4, 4), 13, 4, 1)),
            Case("more splits than blocks: one block each", case(_shuffled(2, 5), 20, 16, 4)),
            Case("block_size 1: 6 keys, 4 splits", case(_shuffled(6, 6), 6, 1, 4)),
            Case("a table longer than the history: its tail is never read", case(_shuffled(6, 7), 17, 8, 2)),
        ]
    )


# ---------------------------------------------------------------------------------------------------
# Beyond the stage. L4.4: attention over a sliding window, reading only the blocks some query sees.
# L4.5: merging two partials kept as (out, lse). Their visible references below are brute force (every
# position, every key, dense softmax); the exercises ask for a block loop and for a merge.


def _window_inputs(case: dict) -> dict:
    """One sequence for L4.4 from a case dict (block_size, context_len, q_len, dim, window, seed, size,
    spare_blocks; "blocks": fixed block ids, else shuffled ids): q, the clean pools, the block table, q_pos."""
    gen = torch.Generator().manual_seed(case["seed"])
    block_size, context_len, dim = case["block_size"], case["context_len"], case["dim"]
    n_blocks = -(-context_len // block_size)
    blocks = (
        case.get("blocks")
        or torch.randperm(n_blocks + case["spare_blocks"], generator=gen)[:n_blocks].tolist()
    )
    num_blocks = max(blocks) + 1 + case["spare_blocks"]
    k_pool = torch.randn(num_blocks, block_size, dim, generator=gen)  # (N, B, D)
    v_pool = torch.randn(num_blocks, block_size, dim, generator=gen)
    q = torch.randn(case["q_len"], dim, generator=gen) * case["size"]  # (Tq, D)
    q_pos = torch.arange(context_len - case["q_len"], context_len)  # (Tq,)
    return {"q": q, "k_pool": k_pool, "v_pool": v_pool, "blocks": blocks, "q_pos": q_pos, "scale": dim**-0.5}


def _window_seen(blocks: list[int], q_pos: torch.Tensor, window: int, block_size: int) -> list[int]:
    """The table's blocks holding a key some query sees, in order: every (query, key) pair tried."""
    seen = []
    for j, block in enumerate(blocks):
        keys = range(j * block_size, (j + 1) * block_size)
        if any(p - window < t <= p for p in q_pos.tolist() for t in keys):
            seen.append(block)
    return seen


def _poisoned(pool: torch.Tensor, keep: list[int]) -> torch.Tensor:
    """A copy of ``pool`` whose blocks not in ``keep`` hold NaN: blocks that must not be read."""
    out = torch.full_like(pool, float("nan"))  # (N, B, D)
    out[keep] = pool[keep]
    return out


def _window_dense(x: dict, context_len: int, window: int) -> torch.Tensor:
    """Dense masked softmax over the gathered history: key t visible to the query at p when p - window < t <= p."""
    k = x["k_pool"][x["blocks"]].flatten(0, 1)[:context_len]  # (ctx, D): a gather, a copy
    v = x["v_pool"][x["blocks"]].flatten(0, 1)[:context_len]
    t, p = torch.arange(context_len)[None, :], x["q_pos"][:, None]  # (1, ctx), (Tq, 1)
    s = (x["q"] @ k.T * x["scale"]).masked_fill((t > p) | (t <= p - window), float("-inf"))  # (Tq, ctx)
    return s.softmax(dim=-1) @ v  # (Tq, D)


def _window_mistakes(x: dict, case: dict, want: torch.Tensor, seen: list[int]) -> tuple[dict, dict]:
    """Known wrong answers of L4.4, for its output and for its list of blocks read."""
    block_size, window, q_pos = case["block_size"], case["window"], x["q_pos"]
    first = x["blocks"].index(seen[0])  # the logical index of the first block read
    unguarded = want.clone()  # rows that see nothing in the first block read: 0 / 0 without a guard
    unguarded[q_pos - window + 1 >= (first + 1) * block_size] = float("nan")
    wider = _window_dense(x, case["context_len"], window + 1)
    wide = "a query sees window + 1 keys: its window is positions p - window + 1 .. p"
    out_mistakes = {
        "every row is NaN: a block no query can see was read (it holds NaN here)": lambda: torch.full_like(
            want, float("nan")
        ),
        "rows that see nothing in the first block read are NaN: exp(-inf - (-inf)) needs a guard": lambda: (
            unguarded
        ),
        wide: lambda: wider,
    }
    read_mistakes = {
        "read holds blocks no query can see": lambda: list(x["blocks"]),
        "read holds logical block indices, not the table's physical ids": lambda: [
            x["blocks"].index(b) for b in seen
        ],
        wide: lambda: _window_seen(x["blocks"], q_pos, window + 1, block_size),
    }
    return out_mistakes, read_mistakes


def check_attend_window(attend_window: Callable) -> None:
    """Grade ``attend_window(q, k_pool, v_pool, blocks, q_pos, scale, window) -> (out, read)``.

    L4.2's arguments and a ``window`` >= 1: the query at position p sees the keys at positions
    p - window + 1 .. p (fewer at the start). ``out`` (Tq, D) must equal dense softmax over those keys
    (computed here from the gathered history), and ``read`` must list, in order, exactly the physical
    blocks that hold a key some query sees (found here by trying every pair). The blocks no query sees
    hold NaN in the pools handed over, as a freed block may hold anything. A window below 1 raises
    ValueError naming ``window`` and its value.
    """

    def case(block_size, context_len, q_len, window, seed, dim=8, size=1.0, blocks=None):
        spec = dict(block_size=block_size, context_len=context_len, q_len=q_len, dim=dim, window=window,
                    seed=seed, size=size, spare_blocks=2, blocks=blocks)  # fmt: skip

        def run() -> str | None:
            x = _window_inputs(spec)
            want = _window_dense(x, context_len, window)  # (Tq, D)
            seen = _window_seen(x["blocks"], x["q_pos"], window, block_size)
            k_pool, v_pool = _poisoned(x["k_pool"], seen), _poisoned(x["v_pool"], seen)
            got = attend_window(
                x["q"].clone(), k_pool, v_pool, list(x["blocks"]), x["q_pos"].clone(), x["scale"], window
            )
            try:
                out, read = got
                read = [int(b) for b in read]
            except (TypeError, ValueError):
                return f"returned {type(got).__name__}, expected a tuple (out, read)"
            out_mistakes, read_mistakes = _window_mistakes(x, spec, want, seen)
            problem = close_problem("out", want, out)
            if problem:
                return named_mistake(problem, out, out_mistakes, _same_floats)
            if read != seen:
                return named_mistake(f"read is {read}, expected {len(seen)} blocks", read, read_mistakes)
            return None

        return run

    def refused() -> str | None:
        x = _window_inputs(
            dict(block_size=4, context_len=6, q_len=1, dim=4, window=0, seed=9, size=1.0, spare_blocks=0)
        )
        try:
            attend_window(x["q"], x["k_pool"], x["v_pool"], x["blocks"], x["q_pos"], x["scale"], 0)
        except ValueError as e:
            if "window" not in str(e) or "0" not in str(e):
                return "the ValueError's message does not name window and its value 0"
            return None
        return "window 0 returned, expected ValueError"

    run_cases(
        [
            Case("block_size 4, blocks [6, 1, 3], queries at 9 and 10, window 3", case(4, 11, 2, 3, seed=1, blocks=[6, 1, 3])),
            Case("decode, the window holds the whole history: every block", case(4, 14, 1, 20, seed=2)),
            Case("decode, window 1: the query sees only itself", case(4, 14, 1, 1, seed=3)),
            Case("decode at position 29, window 5, block_size 4: 2 of 8 blocks", case(4, 30, 1, 5, seed=4)),
            Case("prefill chunk: 8 queries, window 3, block_size 4: later rows see nothing in the first block read", case(4, 21, 8, 3, seed=5)),
            Case("a whole 12-token prompt, window 6, block_size 4", case(4, 12, 12, 6, seed=6)),
            Case("block_size 1: 9 keys, 3 queries, window 2", case(1, 9, 3, 2, seed=7)),
            Case("large scores (x30), block_size 7, 40 keys, 4 queries, window 10", case(7, 40, 4, 10, seed=8, dim=16, size=30.0)),
            Case("window 0 is refused with a ValueError naming it", refused),
        ]
    )  # fmt: skip


def _lse_side(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor):
    """One side's partial as (out, lse): out (R, D) softmax attention over its visible keys, NaN in a row
    that sees none (0 / 0); lse (R,) the log of the sum of exp(score), -inf in such a row."""
    s = (q @ k.T).masked_fill(~visible, float("-inf"))  # (R, n)
    if s.shape[1] == 0:  # a side with no key at all
        return torch.full((q.shape[0], v.shape[1]), float("nan")), torch.full((q.shape[0],), float("-inf"))
    return s.softmax(dim=-1) @ v, torch.logsumexp(s, dim=-1)  # softmax of an all -inf row is NaN


def merge_tensors(case: dict):
    """q (R, D), k and v (n1 + n2, D) drawn from a merge case's seed (``draw_merges``), and which key
    each row sees, (R, n1 + n2) bool: the first n1 keys are side 1's, the rest side 2's."""
    gen = torch.Generator().manual_seed(case["seed"])
    n = case["n1"] + case["n2"]
    q = torch.randn(case["rows"], case["dim"], generator=gen) * case["size"]  # (R, D)
    k = torch.randn(n, case["dim"], generator=gen)  # (n1 + n2, D)
    v = torch.randn(n, case["dim"], generator=gen)
    visible = torch.tensor(case["visible"], dtype=torch.bool).reshape(case["rows"], n)  # (R, n1 + n2)
    return q, k, v, visible


def _lse_inputs(case: dict):
    """q, k, v and the visibility of a merge case (``draw_merges``'s dict), and each side's (out, lse)."""
    q, k, v, visible = merge_tensors(case)
    n1 = case["n1"]
    side1 = _lse_side(q, k[:n1], v[:n1], visible[:, :n1])
    side2 = _lse_side(q, k[n1:], v[n1:], visible[:, n1:])
    return q, k, v, visible, side1, side2


def _lse_mistakes(out1, lse1, out2, lse2, want_out) -> tuple[dict, dict]:
    """Known wrong answers of L4.5, for out and for lse."""
    raw1, raw2 = torch.exp(lse1)[:, None], torch.exp(lse2)[:, None]  # (R, 1): inf past 88
    empty = torch.isinf(lse1) | torch.isinf(lse2)  # (R,) rows where a side saw nothing
    leaked = want_out.clone()
    leaked[empty] = float("nan")
    overflow = "exp(lse) on its own overflows: weigh each side by exp(lse - max(lse1, lse2))"
    out_mistakes = {  # the first that matches names the rule: a NaN row left by an empty side comes first
        "an empty side's NaN leaks into the result (0 * NaN is NaN): leave that side out": lambda: leaked,
        overflow: lambda: (raw1 * out1 + raw2 * out2) / (raw1 + raw2),
        "the two outputs are averaged, not weighted by exp(lse)": lambda: (out1 + out2) / 2,
    }
    lse_mistakes = {
        overflow: lambda: torch.log(raw1 + raw2)[:, 0],
        "lse of the union is not max(lse1, lse2): both sides' sums add up": lambda: torch.maximum(lse1, lse2),
    }
    return out_mistakes, lse_mistakes


def check_merge_lse(merge_lse: Callable) -> None:
    """Grade ``merge_lse(out1, lse1, out2, lse2) -> (out, lse)``.

    Each side is a partial over its own keys as a kernel that normalises its output keeps it: out (R, D)
    softmax attention over its keys, lse (R,) the log of the sum of exp(score) over them. A row that saw
    no key on a side has lse = -inf and out NaN there (every row sees a key on one side at least).
    ``out`` must be softmax attention over the union of the keys and ``lse`` its log-sum-exp; both are
    computed here from the raw scores, densely (``torch.logsumexp``).
    """

    def case(rows, n1, n2, dim, seed, hide1=None, hide2=None, size=1.0):
        def run() -> str | None:
            visible = [[1] * (n1 + n2) for _ in range(rows)]
            for hide, cols in ((hide1, range(n1)), (hide2, range(n1, n1 + n2))):
                for r in range(rows) if hide == "all" else hide or []:
                    for c in cols:
                        visible[r][c] = 0
            spec = dict(rows=rows, n1=n1, n2=n2, dim=dim, seed=seed, size=size, visible=visible)
            q, k, v, seen, (out1, lse1), (out2, lse2) = _lse_inputs(spec)
            s = (q @ k.T).masked_fill(~seen, float("-inf"))  # (R, n1 + n2): the union's scores
            want_out, want_lse = s.softmax(dim=-1) @ v, torch.logsumexp(s, dim=-1)
            got = merge_lse(out1.clone(), lse1.clone(), out2.clone(), lse2.clone())
            try:
                out, lse = got
            except (TypeError, ValueError):
                return f"returned {type(got).__name__}, expected a tuple (out, lse)"
            out_mistakes, lse_mistakes = _lse_mistakes(out1, lse1, out2, lse2, want_out)
            problem = close_problem("out", want_out, out)
            if problem:
                return named_mistake(problem, out, out_mistakes, _same_floats)
            problem = close_problem("lse", want_lse, lse, atol=1e-4)  # lse in the hundreds: float32 rounding
            return named_mistake(problem, lse, lse_mistakes, _same_floats)

        return run

    def example() -> str | None:
        got = merge_lse(
            torch.tensor([[1.0]]), torch.tensor([0.0]), torch.tensor([[5.0]]), torch.log(torch.tensor([3.0]))
        )
        try:
            out, lse = got
        except (TypeError, ValueError):
            return f"returned {type(got).__name__}, expected a tuple (out, lse)"
        return close_problem("out", torch.tensor([[4.0]]), out) or close_problem(
            "lse", torch.log(torch.tensor([4.0])), lse
        )

    run_cases(
        [
            Case("one key per side, scores 0 and ln 3, values 1 and 5: out 4.0", example),
            Case("4 rows, 5 + 7 keys, D 8", case(4, 5, 7, 8, seed=1)),
            Case("side 2 saw no key (lse2 = -inf, out2 NaN)", case(3, 6, 4, 8, seed=2, hide2="all")),
            Case("side 1 has no key at all (0 keys)", case(3, 0, 5, 8, seed=3)),
            Case("rows 0 and 2 see nothing on side 2, row 1 nothing on side 1", case(4, 5, 5, 8, seed=4, hide1=[1], hide2=[0, 2])),
            Case("large scores (lse up to 214): exp must not overflow", case(4, 6, 6, 16, seed=5, size=30.0)),
            Case("large scores, row 3 sees nothing on side 1", case(4, 6, 6, 16, seed=6, hide1=[3], size=30.0)),
        ]
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# Catch the bug. L4.6: the learner's test of ``attend_blocks``, run on the stage's function and on it
# with a bug of the course's mutation list put in (``kvcourse/grading/mutations.py``).

ATTEND_TARGET = "L4_paged_kernel.paged_attention:attend_blocks"
CATCH_SHOWN = [
    "L4 PyTorch kernel lets a query see the key after it",
    "L4 PyTorch kernel reads block j of the pool, not the table's j-th block",
]
CATCH_ALL = CATCH_SHOWN + [
    "L4 PyTorch kernel hides a query's own key",
    "L4 PyTorch kernel counts every block's key positions from 0",
    "L4 PyTorch kernel forgets the scale",
]


def check_catch_attend_blocks(test: Callable) -> None:
    """Grade ``test(attend_blocks)``, a test that raises when the ``attend_blocks`` handed to it is wrong:
    it must pass the stage's ``attend_blocks`` and fail each of two versions with a bug put in. The hidden
    cases try more bugs than these two."""
    run_cases(catch_cases(test, ATTEND_TARGET, CATCH_SHOWN, "attend_blocks"))


# ---------------------------------------------------------------------------------------------------
# Predict. L4.7: the state of the block loop on a tiny input, predicted before running it.

# Two queries at positions 6 and 7 (a 2-token chunk), D 1, q = 1 and scale 1, so each key's score is its
# K value; block_size 3, block table [5, 2, 7]: positions 0..7, and row 2 of block 7 is stale.
PREDICT_SCORES = [2.0, 5.0, 1.0, 3.0, 7.0, 4.0, 6.0, 9.0, 12.0]  # positions 0..8; position 8 is the stale row
PREDICT_TABLE, PREDICT_BLOCK_SIZE, PREDICT_POSITIONS, PREDICT_SPLITS = [5, 2, 7], 3, [6, 7], 2


def _predict_inputs():
    """The pools of the prediction: each position's score written into its slot (K), values 1 (V)."""
    k_pool = torch.zeros(8, PREDICT_BLOCK_SIZE, 1, 1)  # (num_blocks, block_size, H_kv, D)
    for t, score in enumerate(PREDICT_SCORES):
        k_pool[PREDICT_TABLE[t // PREDICT_BLOCK_SIZE], t % PREDICT_BLOCK_SIZE] = score
    q = torch.ones(1, 1, len(PREDICT_POSITIONS), 1)  # (H_kv, G, Tq, D)
    return q, k_pool, torch.ones_like(k_pool), torch.tensor(PREDICT_POSITIONS)


def _predict_loop(positions: list[int]) -> dict:
    """The block loop of the stage (``attend_blocks``) on the prediction's input, for queries at
    ``positions``: ``m``, each query's running max after each block (the loop over the first j + 1
    blocks), ``keys``, how many keys each block lets each query see (the loop over that block alone with
    all-zero keys, whose ``l`` counts them), and ``rescaled``, the blocks j >= 1 after which acc was
    multiplied by exp(m - m_new) < 1 (where ``m`` went up)."""
    q, k_pool, v_pool, _ = _predict_inputs()
    q_pos, n, zeros = torch.tensor(positions), len(PREDICT_TABLE), torch.zeros_like(k_pool)
    m = [ref_attend_blocks(q, k_pool, v_pool, PREDICT_TABLE[: j + 1], q_pos, 1.0)[0][0, 0] for j in range(n)]
    keys = [
        ref_attend_blocks(q, zeros, v_pool, [block], q_pos - j * PREDICT_BLOCK_SIZE, 1.0)[1][0, 0]
        for j, block in enumerate(PREDICT_TABLE)
    ]  # (Tq,) each
    per_query = range(len(positions))
    return {
        "m": [[int(m[j][i]) for j in range(n)] for i in per_query],
        "keys": [[int(keys[j][i]) for j in range(n)] for i in per_query],
        "rescaled": [[j for j in range(1, n) if m[j][i] > m[j - 1][i]] for i in per_query],
    }


def predict_state() -> dict:
    """What the stage's code gives on the prediction's input: ``_predict_loop``'s three keys, and
    ``split_m``, each query's ``m`` in each split ``split_kv_attention`` runs with 2 splits, recorded
    from its calls to ``attend_blocks``."""
    q, k_pool, v_pool, _ = _predict_inputs()
    split_m = []

    def recording(*args):
        result = ref_attend_blocks(*args)
        split_m.append(result[0][0, 0].tolist())  # (Tq,) this split's m
        return result

    ctx, n_q = PREDICT_POSITIONS[-1] + 1, len(PREDICT_POSITIONS)
    with mock.patch.object(split_kv, "attend_blocks", recording):
        split_kv.split_kv_attention(
            torch.ones(n_q, 1, 1), k_pool, v_pool, torch.tensor([PREDICT_TABLE]), torch.tensor([ctx]),
            torch.tensor([0, n_q]), num_splits=PREDICT_SPLITS, scale=1.0,
        )  # fmt: skip
    split = [[int(s[i]) for s in split_m] for i in range(n_q)]
    return _predict_loop(PREDICT_POSITIONS) | {"split_m": split}


def _predict_mistakes(state: dict, key: str) -> dict:
    """Known wrong predictions of ``key``, by the rule each breaks: the loop run as if the stale row
    were visible (queries at position 8) or as if the first query saw the second's key (both at 7),
    block 0 counted as a rescale, one max over all the splits."""
    stale, uncausal = _predict_loop([8, 8]), _predict_loop([7, 7])
    mistakes = {
        "the stale row (position 8) is past the history: it is masked": lambda: stale[key],
        "the query at position 6 does not see position 7 (causal)": lambda: uncausal[key],
    }
    if key == "rescaled":
        mistakes["block 0 starts the running max: rescales count from block 1"] = lambda: [
            [0, *blocks] for blocks in state["rescaled"]
        ]
    if key == "split_m":
        mistakes["each split keeps its own max; the maxima meet only in the merge"] = lambda: [
            [row[-1]] * len(split) for row, split in zip(state["m"], state["split_m"], strict=True)
        ]
    return mistakes


PREDICT_KEYS = {
    "m": "each query's running max after each block",
    "keys": "the keys each block lets each query see",
    "rescaled": "the blocks after which each query's acc is rescaled",
    "split_m": "each query's m in each of the 2 splits",
}


def _entries_differ(want, got) -> str | None:
    """None when ``got`` equals ``want`` (one list of ints per query), else how many entries differ (or,
    where a query's list has another length, how many queries' lists differ), never the values expected."""
    if not isinstance(got, list) or len(got) != len(want) or not all(isinstance(g, list) for g in got):
        return f"expected a list of {len(want)} lists (one per query), got {type(got).__name__} {got!r}"
    if any(len(w) != len(g) for w, g in zip(want, got, strict=True)):
        rows = sum(w != g for w, g in zip(want, got, strict=True))
        return f"{rows} of {len(want)} queries' lists differ (in length or entries)"
    entries = sum(a != b for w, g in zip(want, got, strict=True) for a, b in zip(w, g, strict=True))
    return f"{entries} of {sum(map(len, want))} entries differ" if entries else None


def check_predict(predict: Callable) -> None:
    """Grade ``predict() -> dict``: one case per key, ok or how many entries differ (never the values)."""
    state = predict_state()

    def case(key: str):
        def run() -> str | None:
            got = predict()
            if not isinstance(got, dict) or key not in got:
                return f"predict() has no key {key!r}"
            return named_mistake(
                _entries_differ(state[key], got[key]), got[key], _predict_mistakes(state, key)
            )

        return run

    run_cases([Case(f"{key}: {what}", case(key)) for key, what in PREDICT_KEYS.items()])


# Hidden cases (kvcourse/grading/hidden.py): drawn per grading run, observed here in the learner's kernel,
# judged in the grader's process against the independent answers of key/L4_paged_kernel/answers.py (dense, float64) within
# a tolerance. A right float32 answer differs from them by float32 rounding: below 1e-6 in a merge
# (its inputs are the same float32 partials), and in the block loop by the rounding of scores in the
# hundreds (|s| * 2^-24): 3e-5 at most for the notebook's solution over 8,000 drawn cases with such
# scores. The tolerances leave room for that, and none for a missing rescale or mask.


def row_steps(call: str, value, row_names: list[str]) -> list[dict]:
    """A float result as steps: its shape after ``call``, then each row's values under its name (NaN
    and inf kept: they never match), so a difference is reported by the row it is in. Anything but
    a tensor is its repr. Example: ``row_steps("merge(...)", torch.ones(2, 1), ["row 0", "row 1"])`` ->
    ``[{"call": "merge(...)", "shape": [2, 1]}, {"call": "row 0", "out": [1.0]}, {"call": "row 1",
    "out": [1.0]}]``."""
    if not isinstance(value, torch.Tensor):
        return [{"call": call, "shape": f"not a tensor: {value!r}"}]
    rows = value.tolist() if value.dim() else []
    return [{"call": call, "shape": list(value.shape)}] + [
        {"call": name, "out": row} for name, row in zip(row_names, rows, strict=False)
    ]


def draw_merges(rng) -> list[dict]:
    """Eight pairs of partials: 1 to 5 query rows, D 1 to 8, 1 to 8 keys a side, each key visible to a
    row or not. In two cases every row sees keys on both sides; in four a row may see nothing on one
    side; in one a whole side sees nothing, in one a side has no keys at all (never both sides).
    Two cases or more have scores in the hundreds, where exponentiating a max on its own overflows."""
    kinds = ["both", "both", "any", "any", "any", "any", "one side blind", "one side empty"]
    sizes = [100.0, 100.0] + [rng.choice([1.0, 1.0, 3.0, 40.0]) for _ in range(6)]  # scales the scores
    rng.shuffle(kinds)
    rng.shuffle(sizes)
    cases = []
    for kind, size in zip(kinds, sizes, strict=True):
        rows, n1, n2 = rng.randint(1, 5), rng.randint(1, 8), rng.randint(1, 8)
        if kind == "one side empty":
            n1, n2 = rng.choice([(0, n2), (n1, 0)])
        keys = {1: range(n1), 2: range(n1, n1 + n2)}  # the columns of each side
        seen_by_all = {"both": (1, 2), "one side blind": (rng.choice([1, 2]),)}.get(kind)
        p = rng.choice([1.0, 0.7, 0.4])  # how often a row sees a key of a side it looks at
        visible = []
        for _ in range(rows):
            sides = seen_by_all or rng.choice([(1, 2), (1, 2), (1,), (2,)])
            sides = [side for side in sides if keys[side]] or [side for side in (1, 2) if keys[side]]
            row = [0] * (n1 + n2)
            for side in sides:
                for c in keys[side]:
                    row[c] = int(rng.random() < p)
                row[rng.choice(keys[side])] = 1  # at least one key of each side it looks at
            visible.append(row)
        cases.append(
            {
                "rows": rows,
                "n1": n1,
                "n2": n2,
                "dim": rng.randint(4 if size > 1 else 1, 8),
                "seed": rng.randrange(10**6),
                "size": size,
                "visible": visible,
            }
        )
    return cases


def observe_merge(fn, case) -> list[dict]:
    """Random q, keys and values from the case's seed; each side's partial (``_partial``) over its
    keys as the case's visibility allows; ``fn`` merges them."""
    q, k, v, visible = merge_tensors(case)
    n1 = case["n1"]
    m1, l1, acc1 = _partial(q, k[:n1], v[:n1], visible[:, :n1])
    m2, l2, acc2 = _partial(q, k[n1:], v[n1:], visible[:, n1:])
    out = fn(m1, l1, acc1, m2, l2, acc2)
    return row_steps("merge(m1, l1, acc1, m2, l2, acc2)", out, [f"row {r}" for r in range(case["rows"])])


def describe_merge(case: dict) -> str:
    return (
        f"{case['rows']} rows, {case['n1']} + {case['n2']} keys, D {case['dim']}, scores x{case['size']:g}, "
        f"visible {case['visible']}"
    )


def draw_attends(rng) -> list[dict]:
    """Random sequences in a shuffled pool: block sizes 1 to 16 (odd ones too), 1 to 6 blocks with
    the last one partly stale, decode queries, prefill chunks and whole prompts. Two cases or more
    have scores above 88 (and 8 keys or more), where exp overflows unless the running max is taken
    off."""
    cases = []
    sizes = [100.0, 100.0] + [rng.choice([1.0, 1.0, 5.0, 60.0]) for _ in range(6)]  # scales the scores
    rng.shuffle(sizes)
    for size in sizes:
        block_size, n_blocks = rng.choice([1, 2, 3, 4, 5, 7, 8, 16]), rng.randint(1, 6)
        least = max((n_blocks - 1) * block_size + 1, 8 if size > 1 else 1)
        n_blocks = max(n_blocks, -(-least // block_size))
        context_len = rng.randint(least, n_blocks * block_size)
        q_len = rng.choice([1, 1, rng.randint(1, min(8, context_len)), min(context_len, 16)])
        cases.append(
            {
                "block_size": block_size,
                "context_len": context_len,
                "q_len": q_len,
                "dim": rng.choice([1, 2, 4, 8, 16]),
                "spare_blocks": rng.randint(0, 3),
                "seed": rng.randrange(10**6),
                "size": size,
            }
        )
    return cases


def observe_attend(fn, case) -> list[dict]:
    """A pool of random K/V whose blocks the sequence holds in shuffled order (with spare blocks
    nobody holds), the last ``q_len`` positions as queries; ``fn`` attends."""
    gen = torch.Generator().manual_seed(case["seed"])
    block_size, context_len, dim = case["block_size"], case["context_len"], case["dim"]
    n_blocks = -(-context_len // block_size)
    num_blocks = n_blocks + case["spare_blocks"]
    k_pool = torch.randn(num_blocks, block_size, dim, generator=gen)  # (N, B, D)
    v_pool = torch.randn(num_blocks, block_size, dim, generator=gen)
    blocks = torch.randperm(num_blocks, generator=gen)[:n_blocks].tolist()
    q = torch.randn(case["q_len"], dim, generator=gen) * case["size"]  # (Tq, D)
    q_pos = torch.arange(context_len - case["q_len"], context_len)  # (Tq,)
    out = fn(q, k_pool, v_pool, blocks, q_pos, dim**-0.5)
    call = f"attend_blocks(q, k_pool, v_pool, {blocks}, q_pos, scale)"
    return row_steps(call, out, [f"the query at position {p}" for p in q_pos.tolist()])


def describe_positions(case: dict) -> str:
    first, last = case["context_len"] - case["q_len"], case["context_len"] - 1
    return f"{first}..{last}" if last > first else f"{last}"


def describe_attend(case: dict) -> str:
    return (
        f"block_size {case['block_size']}, {case['context_len']} keys, queries at positions "
        f"{describe_positions(case)}, D {case['dim']}, scores x{case['size']:g}"
    )


def draw_splits(rng) -> list[dict]:
    """Decode queries, one aimed and nine random. The aimed one has one block more than splits (3 to
    8 splits), so ceil(n_blocks / num_splits) = 2 and there are fewer splits than asked, and its last
    block is partly stale. The random ones: block sizes 1 to 16, 1 to 12 blocks of history (the last
    one full or not), 1 split, a few, as many as the blocks, or more. Tables hold shuffled ids and
    are sometimes longer than the history."""

    def splits(block_size: int, n_blocks: int, num_splits: int, stale: bool) -> dict:
        """``stale``: the last block is not full (needs block_size > 1)."""
        full = n_blocks * block_size
        context_len = rng.randint(full - block_size + 1, full - 1) if stale else full
        table_len = n_blocks + rng.choice([0, 0, 1, 3])
        return {
            "block_table": rng.sample(range(table_len + 4), table_len),
            "context_len": context_len,
            "block_size": block_size,
            "num_splits": num_splits,
        }

    fewer = rng.randint(3, 8)
    cases = [splits(rng.choice([3, 4, 16]), fewer + 1, fewer, stale=True)]
    for _ in range(9):
        block_size, n_blocks = rng.choice([1, 2, 3, 4, 5, 7, 8, 16]), rng.randint(1, 12)
        num_splits = rng.choice([1, 2, 3, 4, rng.randint(1, n_blocks + 3), n_blocks, n_blocks + 2])
        cases.append(splits(block_size, n_blocks, num_splits, stale=block_size > 1 and rng.random() < 0.5))
    rng.shuffle(cases)
    return cases


def observe_splits(fn, case) -> list[dict]:
    got = fn(list(case["block_table"]), case["context_len"], case["block_size"], case["num_splits"])
    try:
        returned = [[int(first), [int(b) for b in blocks], int(keys)] for first, blocks, keys in got]
    except (TypeError, ValueError):
        returned = repr(got)
    return [{"call": f"kv_splits({describe_splits(case)})", "returned": returned}]


def describe_splits(case: dict) -> str:
    return (
        f"block table {case['block_table']}, context_len {case['context_len']}, "
        f"block_size {case['block_size']}, num_splits {case['num_splits']}"
    )


def draw_windows(rng) -> list[dict]:
    """Eight sequences for L4.4: block sizes 1 to 16, 1 to 8 blocks, decode queries, chunks and whole
    prompts, windows of 1 key, a few keys, about a block, and the whole history or more. In two cases
    the chunk is longer than the window by a block or more, so its later rows see nothing in the first
    block read; two or more have scores in the hundreds."""
    sizes = [100.0, 100.0] + [rng.choice([1.0, 1.0, 5.0, 60.0]) for _ in range(6)]
    rng.shuffle(sizes)
    cases = []
    for i, size in enumerate(sizes):
        if i < 2:  # the rows that see nothing in the first block read
            block_size, window = rng.choice([1, 2, 3, 4]), rng.randint(1, 3)
            q_len = window + block_size + rng.randint(0, 4)
            context_len = q_len + rng.randint(0, 10)
        else:
            block_size, n_blocks = rng.choice([1, 2, 3, 4, 5, 7, 8, 16]), rng.randint(1, 8)
            context_len = rng.randint((n_blocks - 1) * block_size + 1, n_blocks * block_size)
            q_len = rng.choice([1, 1, rng.randint(1, min(8, context_len)), min(context_len, 16)])
            window = rng.choice(
                [
                    1,
                    rng.randint(1, context_len),
                    context_len + rng.randint(0, 3),
                    rng.randint(1, 2 * block_size),
                ]
            )
        cases.append(
            {
                "block_size": block_size,
                "context_len": context_len,
                "q_len": q_len,
                "window": window,
                "dim": rng.choice([1, 2, 4, 8]),
                "spare_blocks": rng.randint(0, 3),
                "seed": rng.randrange(10**6),
                "size": size,
            }
        )
    rng.shuffle(cases)
    return cases


def observe_window(fn, case) -> list[dict]:
    """The case's sequence in a shuffled pool whose blocks no query sees hold NaN; ``fn`` attends. Its
    list of blocks read, then each row of its output."""
    x = _window_inputs(case)
    seen = _window_seen(x["blocks"], x["q_pos"], case["window"], case["block_size"])
    k_pool, v_pool = _poisoned(x["k_pool"], seen), _poisoned(x["v_pool"], seen)
    call = f"attend_window(q, k_pool, v_pool, {x['blocks']}, q_pos, scale, {case['window']})"
    got = fn(x["q"], k_pool, v_pool, list(x["blocks"]), x["q_pos"], x["scale"], case["window"])
    try:
        out, read = got
        read = [int(b) for b in read]
    except (TypeError, ValueError):
        return [{"call": call, "returned": repr(got)}]
    rows = [f"the query at position {p}" for p in x["q_pos"].tolist()]
    return [{"call": call, "read": read}] + row_steps(call, out, rows)


def describe_window(case: dict) -> str:
    return f"{describe_attend(case)}, window {case['window']}"


def observe_lse(fn, case) -> list[dict]:
    """``draw_merges``'s case as two sides kept as (out, lse) (``_lse_side``); ``fn`` merges them. Each
    row of its out, then its lse."""
    *_, (out1, lse1), (out2, lse2) = _lse_inputs(case)
    call = "merge_lse(out1, lse1, out2, lse2)"
    got = fn(out1, lse1, out2, lse2)
    try:
        out, lse = got
    except (TypeError, ValueError):
        return [{"call": call, "returned": repr(got)}]
    lse = lse.tolist() if isinstance(lse, torch.Tensor) else repr(lse)
    return row_steps(call, out, [f"row {r}" for r in range(case["rows"])]) + [
        {"call": f"lse of {call}", "lse": lse}
    ]


def draw_predict(rng) -> list[dict]:
    """One case per key of the prediction, in an order drawn from the seed: the input is fixed (the
    notebook shows it), so the hidden cases are the prediction itself, key by key."""
    cases = [{"key": key} for key in PREDICT_KEYS]
    rng.shuffle(cases)
    return cases


def observe_predict(fn, case: dict):
    """The prediction of one key: ``predict()[key]``."""
    return [{"call": f"predict()[{case['key']!r}]", "predicted": fn()[case["key"]]}]


HIDDEN = {
    "L4.1": Hidden(
        draw_merges,
        observe_merge,
        describe_merge,
        answers=("L4_paged_kernel.fast.split_kv:merge_partials",),
        atol=2e-5,
    ),
    "L4.2": Hidden(
        draw_attends,
        observe_attend,
        describe_attend,
        answers=(
            "L4_paged_kernel.paged_attention:attend_blocks",
            "L4_paged_kernel.paged_attention:online_softmax_update",
        ),
        atol=1e-4,
    ),
    "L4.3": Hidden(
        draw_splits,
        observe_splits,
        describe_splits,
        answers=("L4_paged_kernel.fast.split_kv:split_kv_attention",),
    ),
    "L4.4": Hidden(
        draw_windows,
        observe_window,
        describe_window,
        answers=(
            "L4_paged_kernel.paged_attention:attend_blocks",
            "L4_paged_kernel.paged_attention:online_softmax_update",
        ),
        atol=1e-4,
    ),
    "L4.5": Hidden(
        draw_merges,
        observe_lse,
        describe_merge,
        answers=("L4_paged_kernel.fast.split_kv:merge_partials",),
        atol=1e-4,
    ),
    "L4.6": catch_hidden(
        ATTEND_TARGET,
        CATCH_ALL,
        watch=(
            "L4_paged_kernel.paged_attention:attend_blocks",
            "L4_paged_kernel.paged_attention:paged_attention",
            "L4_paged_kernel.fast.split_kv:split_kv_attention",
            "L4_paged_kernel.fast.split_kv:attend_decode_batch",
        ),
    ),
    "L4.7": Hidden(
        draw_predict,
        observe_predict,
        lambda case: f"the prediction of {case['key']!r}, {PREDICT_KEYS[case['key']]}",
        answers=(
            "L4_paged_kernel.paged_attention:attend_blocks",
            "L4_paged_kernel.paged_attention:online_softmax_update",
            "L4_paged_kernel.fast.split_kv:split_kv_attention",
        ),
        explain=unrevealed,  # the report names the key, never its right value
    ),
}
