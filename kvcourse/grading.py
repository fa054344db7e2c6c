"""Check helpers for the notebooks' exercises: run the learner's function against the course's own code.

A notebook check cell looks like this::

    # NBVAL_CHECK_OUTPUT
    grading.check_write_kv(write_kv)

and prints one line per fixed, seeded case, then a summary::

    case 1 (prefill: 5 tokens at start 0, empty cache): ok
    case 2 (decode: 1 token at start 5 after a 5-token prefill): WRONG — V differs at positions [5] (max abs diff 1.49)
    case 3 (chunk: 3 tokens at start 9, positions 0..8 filled): raised NotImplementedError: Exercise L1.1: ...
    ...
    1/5 passed

The reference notebook stores these lines as the cell's output; ``make grade`` (nbval) re-runs the cell
and compares, so every line must be deterministic: no timings, no addresses, no random draws that are
not seeded. The reference answers come from the stage code itself (``L1_contiguous.cache.KvCache``,
``L1_contiguous.engine.Engine``, ``ModelConfig``), never from a second copy kept here, so the grader and
the course cannot drift apart. That is the tiny-llm habit: one set of checks grades learner and
reference alike.

Each stage adds its ``check_*`` functions below, built from ``Case`` objects and the shared
``run_cases`` runner. Left out on purpose: partial credit, hints and timeouts. A case passes or fails;
a learner's infinite decode loop is stopped by a step budget, not by a clock (clocks are not
deterministic).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from kvcourse.config import ModelConfig


@dataclass(frozen=True)
class Case:
    """One graded case: a fixed description and a check that returns None (ok) or what is wrong."""

    name: str
    run: Callable[[], str | None]


def run_cases(cases: Iterable[Case]) -> tuple[int, int]:
    """Run each case, print one line per case and a summary; return (passed, total).

    An exception inside a case fails that case only (its type and first line are printed) and the
    next case still runs. Example::

        >>> run_cases([Case("one plus one", lambda: None if 1 + 1 == 2 else "not 2"),
        ...            Case("stub", lambda: int("x"))])
        case 1 (one plus one): ok
        case 2 (stub): raised ValueError: invalid literal for int() with base 10: 'x'
        1/2 passed
        (1, 2)
    """
    passed = total = 0
    for total, case in enumerate(cases, start=1):
        try:
            problem = case.run()
        except Exception as e:  # the learner's code may raise anything; report it and go on
            verdict = f"raised {type(e).__name__}: {_first_line(str(e))}"
        else:
            verdict = "ok" if problem is None else f"WRONG — {problem}"
        passed += verdict == "ok"
        print(f"case {total} ({case.name}): {verdict}")
    print(f"{passed}/{total} passed")
    return passed, total


def _first_line(message: str, width: int = 100) -> str:
    line = message.strip().splitlines()[0] if message.strip() else "(no message)"
    return line if len(line) <= width else line[: width - 3] + "..."


def _positions(rows: torch.Tensor) -> str:
    """Compact list of row indices: ``tensor([5, 6, 7]) -> '[5, 6, 7]'``; ``arange(10) -> '[0, 1, ..., 9]'``."""
    idx = rows.tolist()
    return str(idx) if len(idx) <= 6 else f"[{idx[0]}, {idx[1]}, ..., {idx[-1]}]"


def tensor_problem(what: str, expected: torch.Tensor, got: torch.Tensor) -> str | None:
    """None if ``got`` equals ``expected`` exactly, else which rows (dim 0) differ and by how much.

    Example: ``tensor_problem("K", zeros(4, 2), ones(4, 2))`` ->
    ``'K differs at positions [0, 1, 2, 3] (max abs diff 1)'``.
    """
    if not isinstance(got, torch.Tensor):
        return f"{what} is a {type(got).__name__}, not a tensor"
    if got.shape != expected.shape:
        return f"{what} has shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
    if torch.equal(got, expected):
        return None
    diff = (got.float() - expected.float()).abs()  # same shape as expected
    rows = torch.nonzero(diff.flatten(1).amax(dim=1) > 0).flatten()  # rows holding a difference
    if rows.numel() == 0:  # only NaNs differ
        return f"{what} differs (NaN)"
    return f"{what} differs at positions {_positions(rows)} (max abs diff {diff.nan_to_num().max():.3g})"


# ---------------------------------------------------------------------------------------------------
# L1: contiguous cache


def check_write_kv(write_kv: Callable) -> None:
    """Grade ``write_kv(k_cache, v_cache, start, k, v)`` against ``L1_contiguous.cache.KvCache.write``.

    The learner's function gets one layer's cache, ``k_cache``/``v_cache`` of shape
    (max_seq_len, H_kv, D), and must store the T new tokens' ``k``/``v`` (T, H_kv, D) in place at
    positions start .. start + T - 1, leaving every other position untouched, and raise ``ValueError``
    when the write would run past max_seq_len. Example: start=5, T=1 writes row 5 only.
    """
    from L1_contiguous.cache import KvCache

    max_seq_len, heads, dim = 16, 3, 4

    def case(start: int, n_new: int, filled: int) -> Callable[[], str | None]:
        def run() -> str | None:
            gen = torch.Generator().manual_seed(1000 * start + n_new)
            k = torch.randn(n_new, heads, dim, generator=gen)  # (T, H_kv, D)
            v = torch.randn(n_new, heads, dim, generator=gen)  # (T, H_kv, D)
            ref = KvCache(1, max_seq_len, heads, dim)
            ref.k[0, :filled] = torch.randn(filled, heads, dim, generator=gen)  # earlier tokens' K
            ref.v[0, :filled] = torch.randn(filled, heads, dim, generator=gen)
            k_cache, v_cache = ref.k[0].clone(), ref.v[0].clone()  # (S_max, H_kv, D) each
            ref.write(0, start, k, v)
            write_kv(k_cache, v_cache, start, k.clone(), v.clone())
            return tensor_problem("K", ref.k[0], k_cache) or tensor_problem("V", ref.v[0], v_cache)

        return run

    def overflow() -> str | None:
        k_cache = torch.zeros(max_seq_len, heads, dim)  # (S_max, H_kv, D)
        v_cache = torch.zeros_like(k_cache)
        k = torch.ones(2, heads, dim)  # (2, H_kv, D): positions 15 and 16, one past the end
        try:
            write_kv(k_cache, v_cache, max_seq_len - 1, k, k.clone())
        except ValueError:
            return None
        return f"no ValueError for positions 15..16 with max_seq_len={max_seq_len}"

    run_cases(
        [
            Case("prefill: 5 tokens at start 0, empty cache", case(0, 5, 0)),
            Case("decode: 1 token at start 5 after a 5-token prefill", case(5, 1, 5)),
            Case("chunk: 3 tokens at start 9, positions 0..8 filled", case(9, 3, 9)),
            Case("last slot: 1 token at start 15 of 16", case(15, 1, 15)),
            Case("overflow: 2 tokens at start 15 of 16 must raise ValueError", overflow),
        ]
    )


class _StepLimit:
    """An engine wrapper that stops a decode loop which runs past its budget (instead of hanging)."""

    def __init__(self, engine, limit: int):
        self._engine, self._limit, self.steps = engine, limit, 0

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def decode_step(self, token: int, pos: int) -> torch.Tensor:
        self.steps += 1
        if self.steps > self._limit:
            raise RuntimeError(
                f"decode_step called more than {self._limit} times: does the loop stop at max_new_tokens?"
            )
        return self._engine.decode_step(token, pos)


@functools.lru_cache(maxsize=2)
def _tokenizer(model_dir):
    from kvcourse.prompts import load_tokenizer

    return load_tokenizer(model_dir)


def check_decode_loop(decode_loop: Callable, engine) -> None:
    """Grade ``decode_loop(engine, prompt, max_new_tokens) -> new tokens`` against ``engine.generate``.

    ``engine`` is an ``L1_contiguous.engine.Engine``; its ``generate`` is the reference (it matches
    HF ``generate`` token for token). The learner's loop must prefill, then decode greedily one token
    per step, and stop like HF: the eos token is appended, then generation stops; otherwise stop after
    ``max_new_tokens`` tokens. Example with eos 2 and budget 4: argmaxes 7, 9, 2 -> ``[7, 9, 2]``.
    On the course model case 1 ends with eos after 8 tokens; the learner's loop gets the engine behind
    a wrapper that raises once ``decode_step`` runs more often than the budget allows.
    """
    from kvcourse.prompts import Prompt, encode

    tok = _tokenizer(engine.model_dir)

    def case(prompt: Prompt, budget: int) -> Callable[[], str | None]:
        def run() -> str | None:
            ids = encode(tok, prompt)
            expected = engine.generate([ids], budget)[0]
            got = decode_loop(_StepLimit(engine, budget), list(ids), budget)
            if not isinstance(got, list | tuple):
                return f"returned a {type(got).__name__}, expected a list of token ids"
            bad = next((t for t in got if not isinstance(t, int)), None)
            if bad is not None:
                return f"a token is a {type(bad).__name__}, expected a Python int: int(logits.argmax())"
            got = list(got)
            if got == expected:
                return None
            pos = next(
                (i for i, (a, b) in enumerate(zip(expected, got)) if a != b), min(len(got), len(expected))
            )
            return f"first difference at new token {pos} (expected {len(expected)} tokens, got {len(got)})"

        return run

    run_cases(
        [
            Case(
                "chat prompt, budget 12: stops after eos",
                case(Prompt(messages=(("user", "What is the capital of France?"),)), 12),
            ),
            Case(
                "raw text prompt, budget 4: stops at the budget", case(Prompt(text="The KV cache stores"), 4)
            ),
            Case("budget 1: the prefill's token only", case(Prompt(text="Once upon a time"), 1)),
        ]
    )


def check_kv_bytes_per_token(kv_bytes_per_token: Callable, cfg: ModelConfig) -> None:
    """Grade ``kv_bytes_per_token(cfg, dtype_bytes) -> int`` against ``ModelConfig.kv_bytes_per_token``.

    ``cfg`` is the course model's config; the other cases reshape it. Every layer keeps a K and a V
    vector per KV head per token. Example: SmolLM2-135M in fp32 needs 46,080 bytes per token.
    """

    def case(c: ModelConfig, dtype_bytes: int) -> Callable[[], str | None]:
        def run() -> str | None:
            expected, got = c.kv_bytes_per_token(dtype_bytes), kv_bytes_per_token(c, dtype_bytes)
            return None if got == expected else f"expected {expected:,} bytes, got {got!r}"

        return run

    llama8b = dataclasses.replace(cfg, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128)
    tiny = dataclasses.replace(cfg, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    run_cases(
        [
            Case("the course model, fp32", case(cfg, 4)),
            Case("the course model, bf16", case(cfg, 2)),
            Case("Llama-3-8B shape (32 layers, 8 KV heads, head_dim 128), bf16", case(llama8b, 2)),
            Case("tiny test model (2 layers, 2 KV heads, head_dim 16), fp32", case(tiny, 4)),
        ]
    )


# ---------------------------------------------------------------------------------------------------
# L2: token-flat pool


def _outcome(fn: Callable, *args) -> tuple[str, object]:
    """("ok", return value) or ("raised", exception type name) for one call; never raises."""
    try:
        return "ok", fn(*args)
    except Exception as e:  # compared with what the reference raised
        return "raised", e


def _describe(outcome: tuple[str, object]) -> str:
    kind, value = outcome
    return f"raised {type(value).__name__}" if kind == "raised" else f"returned {value!r}"


def check_block_allocator(allocator_cls: Callable) -> None:
    """Grade a free-list class against ``L2_token_flat.cache.BlockAllocator`` on fixed op sequences.

    ``allocator_cls(num_blocks, block_size)`` must keep its free list in ``free_blocks`` (front = next
    handed out) and offer ``alloc_blocks(n) -> list of ids`` and ``free(blocks)``. After every call the
    return value (or the exception type: ``OutOfBlocks``, ``ValueError``) and the free list must match
    the reference's. Example: 4 blocks; alloc_blocks(3) -> [0, 1, 2]; free([1]); alloc_blocks(2) -> [3, 1].
    """
    from L2_token_flat.cache import BlockAllocator, OutOfBlocks

    def case(num_blocks: int, ops: list[tuple[str, object]]) -> Callable[[], str | None]:
        def run() -> str | None:
            ref, got = BlockAllocator(num_blocks, 4), allocator_cls(num_blocks, 4)
            for op, arg in ops:
                call = f"{op}({arg!r})" if op == "free" else f"alloc_blocks({arg})"
                want = _outcome(getattr(ref, op), list(arg) if op == "free" else arg)
                have = _outcome(getattr(got, op), list(arg) if op == "free" else arg)
                if want[0] == "raised":
                    expected = OutOfBlocks if isinstance(want[1], OutOfBlocks) else ValueError
                    if have[0] != "raised" or not isinstance(have[1], expected):
                        return f"{call}: expected {expected.__name__}, {_describe(have)}"
                elif have[0] == "raised":
                    return f"{call}: expected {want[1]!r}, raised {type(have[1]).__name__}: {have[1]}"
                elif op == "alloc_blocks" and (not isinstance(have[1], list) or have[1] != want[1]):
                    return f"{call}: expected {want[1]!r}, {_describe(have)}"
                if list(got.free_blocks) != list(ref.free_blocks):
                    return (
                        f"after {call}: free list {list(got.free_blocks)}, expected {list(ref.free_blocks)}"
                    )
            return None

        return run

    run_cases(
        [
            Case("alloc 3 of 4 blocks", case(4, [("alloc_blocks", 3)])),
            Case(
                "a freed block goes to the back",
                case(4, [("alloc_blocks", 3), ("free", [1]), ("alloc_blocks", 2)]),
            ),
            Case("alloc 0 blocks", case(4, [("alloc_blocks", 0), ("alloc_blocks", 1)])),
            Case(
                "OutOfBlocks takes nothing",
                case(4, [("alloc_blocks", 2), ("alloc_blocks", 3), ("alloc_blocks", 2)]),
            ),
            Case("double free is refused", case(4, [("alloc_blocks", 2), ("free", [0]), ("free", [0])])),
            Case(
                "a repeated id in one call frees nothing",
                case(4, [("alloc_blocks", 3), ("free", [2, 1, 2]), ("free", [2])]),
            ),
            Case("an id outside the pool is refused", case(4, [("alloc_blocks", 4), ("free", [1, 7])])),
            Case(
                "interleaved allocs and frees, 6 blocks",
                case(
                    6,
                    [
                        ("alloc_blocks", 2),
                        ("alloc_blocks", 3),
                        ("free", [3, 0]),
                        ("alloc_blocks", 3),
                        ("free", [1, 4]),
                        ("alloc_blocks", 2),
                    ],
                ),
            ),
        ]
    )


def check_reserve(reserve: Callable) -> None:
    """Grade ``reserve(req, alloc, target_len)`` against ``L2_token_flat.cache.reserve``.

    Both get an ``L2_token_flat.cache.Request`` and ``BlockAllocator`` in the same state (another
    request has taken and returned blocks, so free ids are not in order); after each call
    ``req.blocks``, ``req.slot_indices`` and the free list must match, and a call that needs more
    blocks than are free must raise ``OutOfBlocks`` leaving request and free list as they were.
    Example with block_size 4, blocks [0] and free list 2, 3: target_len 6 -> blocks [0, 2],
    slot_indices [0, 1, 2, 3, 8, 9, 10, 11].
    """
    from L2_token_flat.cache import BlockAllocator, OutOfBlocks, Request
    from L2_token_flat.cache import reserve as ref_reserve

    def case(block_size: int, num_blocks: int, taken: int, returned: list[int], targets: list[int]):
        def state():
            alloc = BlockAllocator(num_blocks, block_size)
            alloc.alloc_blocks(taken)  # another request's blocks ...
            alloc.free(returned)  # ... some given back: the free list is no longer in id order
            return Request(prompt_ids=[1]), alloc

        def run() -> str | None:
            (ref_req, ref_alloc), (req, alloc) = state(), state()
            for target in targets:
                want = _outcome(ref_reserve, ref_req, ref_alloc, target)
                have = _outcome(reserve, req, alloc, target)
                call = f"reserve(target_len={target})"
                if want[0] == "raised":
                    if have[0] != "raised" or not isinstance(have[1], OutOfBlocks):
                        return f"{call}: expected OutOfBlocks, {_describe(have)}"
                elif have[0] == "raised":
                    return f"{call}: raised {type(have[1]).__name__}: {_first_line(str(have[1]))}"
                for what in ("blocks", "slot_indices"):
                    if getattr(req, what) != getattr(ref_req, what):
                        return f"after {call}: {what} {getattr(req, what)}, expected {getattr(ref_req, what)}"
                if list(alloc.free_blocks) != list(ref_alloc.free_blocks):
                    return f"after {call}: free list {list(alloc.free_blocks)}, expected {list(ref_alloc.free_blocks)}"
            return None

        return run

    run_cases(
        [
            Case("block_size 4: 4 then 6 positions", case(4, 8, 2, [0], [4, 6])),
            Case("block_size 4: target 0 allocates nothing", case(4, 8, 0, [], [0, 1])),
            Case("block_size 1: a block per position", case(1, 8, 5, [3, 1], [2, 3, 5])),
            Case("block_size 7: 15, 21, 22 positions", case(7, 6, 3, [2, 0], [15, 21, 22])),
            Case("block_size 4: a prompt of 9 in one call", case(4, 8, 4, [1, 3], [9, 10])),
            Case("OutOfBlocks leaves request and free list alone", case(4, 4, 2, [], [4, 13, 8])),
        ]
    )


# ---------------------------------------------------------------------------------------------------
# L3: block tensor, continuous batching


def check_slots(slots: Callable) -> None:
    """Grade ``slots(block_table, start, end, block_size) -> list of slot ids`` against
    ``L3_block_tensor.cache.slots``. Example: block table [7, 2], block_size 4, positions 2..5 ->
    [30, 31, 8, 9]."""
    from L3_block_tensor.cache import slots as ref_slots

    def case(block_table: list[int], start: int, end: int, block_size: int) -> Callable[[], str | None]:
        def run() -> str | None:
            expected = ref_slots(block_table, start, end, block_size)
            got = slots(list(block_table), start, end, block_size)
            if not isinstance(got, list | tuple):
                return f"returned {got!r}, expected a list of {len(expected)} slot ids"
            got = [int(s) for s in got]
            return None if got == expected else f"expected {expected}, got {got}"

        return run

    run_cases(
        [
            Case("block table [7, 2], block_size 4, positions 2..5", case([7, 2], 2, 6, 4)),
            Case("a whole prefill: [3, 0, 5], block_size 4, positions 0..9", case([3, 0, 5], 0, 10, 4)),
            Case("one decode token at position 16, block_size 16", case([4, 9], 16, 17, 16)),
            Case("block_size 1: the table is the slot list", case([5, 2, 8], 0, 3, 1)),
            Case("block_size 7: positions 6..8 cross a block edge", case([1, 4], 6, 9, 7)),
            Case("no positions (start == end)", case([0], 3, 3, 4)),
        ]
    )


def check_plan_step(plan_step: Callable) -> None:
    """Grade ``plan_step(running, waiting, max_num_batched_tokens, prefill_chunk_size, max_num_seqs)``
    against what ``L3_block_tensor.scheduler.Scheduler.schedule`` does with plenty of free blocks.

    ``running`` and ``waiting`` give, for each request in scheduling order, the tokens it has not
    computed yet (1 for a request that is decoding). The answer is two lists of the same lengths: the
    tokens each request runs this step, 0 for one that does not run. Example with budget 8, chunk 4,
    max_num_seqs 4: running [1, 1], waiting [10, 3] -> ([1, 1], [4, 2]).
    """
    from L3_block_tensor.cache import BlockAllocator, Request, Status, reserve
    from L3_block_tensor.scheduler import Scheduler

    def expected(running, waiting, budget, chunk, max_seqs):
        sched = Scheduler(
            BlockAllocator(256, 4),
            max_num_seqs=max_seqs,
            max_num_batched_tokens=budget,
            prefill_chunk_size=chunk,
        )
        reqs = []
        for i, todo in enumerate(running):  # a running request: prompt of 20, todo left to compute
            req = Request(i, [1] * 20, 8)
            req.num_computed_tokens = 20 - todo
            reserve(req, sched.allocator, req.num_computed_tokens)
            req.status = Status.RUNNING
            sched.running.append(req)
            reqs.append(req)
        for j, todo in enumerate(waiting):
            req = Request(len(running) + j, [1] * todo, 8)
            sched.add(req)
            reqs.append(req)
        planned = {req.request_id: n for req, n in sched.schedule()}
        counts = [planned.get(r.request_id, 0) for r in reqs]
        return counts[: len(running)], counts[len(running) :]

    def case(running, waiting, budget, chunk, max_seqs) -> Callable[[], str | None]:
        def run() -> str | None:
            want = expected(running, waiting, budget, chunk, max_seqs)
            got = plan_step(list(running), list(waiting), budget, chunk, max_seqs)
            if not isinstance(got, tuple | list) or len(got) != 2:
                return f"returned {got!r}, expected two lists (running, waiting)"
            got = (list(got[0]), list(got[1]))
            return (
                None
                if got == want
                else f"expected running {want[0]}, waiting {want[1]}; got {got[0]}, {got[1]}"
            )

        return run

    run_cases(
        [
            Case("decodes and a chunked prompt: budget 8, chunk 4", case([1, 1], [10, 3], 8, 4, 4)),
            Case("no chunking: a prompt runs whole or waits", case([1, 1, 1], [6, 2], 8, None, 8)),
            Case("no chunking: nobody jumps the queue", case([1], [9, 2], 8, None, 8)),
            Case("a running prefill continues by chunks", case([7, 1], [5], 6, 4, 4)),
            Case("max_num_seqs stops admission", case([1, 1, 1], [2, 2], 16, 8, 4)),
            Case("the budget runs out among running requests", case([5, 5, 1], [3], 6, 5, 8)),
        ]
    )


# ---------------------------------------------------------------------------------------------------
# L4: paged-attention kernel


def close_problem(what: str, expected: torch.Tensor, got: torch.Tensor, atol: float = 2e-5) -> str | None:
    """None if ``got`` is within ``atol`` of ``expected`` everywhere, else which rows (dim 0) are off.

    For float results whose summation order may differ from the reference's (online softmax against
    dense softmax). NaN counts as wrong. Example: ``close_problem("out", zeros(3, 2), full((3, 2), 1e-6))``
    -> None; with ``ones(3, 2)`` -> ``'out differs at positions [0, 1, 2] (max abs diff 1)'``.
    """
    if not isinstance(got, torch.Tensor):
        return f"{what} is a {type(got).__name__}, not a tensor"
    if got.shape != expected.shape:
        return f"{what} has shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
    diff = (got.float() - expected.float()).abs().nan_to_num(nan=float("inf"))  # NaN -> inf: always off
    per_row = diff.flatten(1).amax(dim=1) if diff.dim() > 1 else diff.reshape(-1)  # (rows,)
    rows = torch.nonzero(per_row > atol).flatten()
    if rows.numel() == 0:
        return None
    worst = diff.max()
    shown = "NaN or inf" if torch.isinf(worst) else f"{worst:.3g}"
    return f"{what} differs at positions {_positions(rows)} (max abs diff {shown})"


def _partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor):
    """Softmax partial of queries q (R, D) over keys k, v (n, D): m, l (R,) and acc (R, D).

    visible: (R, n) bool. A row that sees no key gets m = -inf, l = 0, acc = 0.
    """
    s = (q @ k.T).masked_fill(~visible, float("-inf"))  # (R, n)
    m = s.amax(dim=-1) if s.shape[1] else torch.full((q.shape[0],), float("-inf"))  # (R,)
    p = torch.exp(s - torch.where(torch.isinf(m), 0.0, m)[:, None])  # (R, n), 0 where masked
    return m, p.sum(dim=-1), p @ v


def check_merge(merge: Callable) -> None:
    """Grade ``merge(m1, l1, acc1, m2, l2, acc2) -> out`` on fixed, seeded cases.

    Each side is a softmax partial of R query rows over its own keys: running max m (R,), denominator
    l (R,) and un-normalised numerator acc (R, D); a row that saw no visible key on a side has m = -inf,
    l = 0, acc = 0 there. ``out`` (R, D) must be softmax attention over the union of both sides' keys.
    Two references: dense masked softmax over the union, computed here from the raw scores, and
    ``L4_paged_kernel.paged_attention.merge_partials``. Example: one key per side, scores 0 and ln 3,
    values 1 and 5: m = (0, ln 3), l = (1, 1), acc = (1, 5) -> (1 * 1 + 3 * 5) / (1 + 3) = 4.0.
    """
    from L4_paged_kernel.paged_attention import merge_partials

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
            return close_problem("out (against dense softmax)", dense, got) or close_problem(
                "out (against merge_partials)", ref, got
            )

        return run

    def docstring_example() -> str | None:
        m1, m2 = torch.tensor([0.0]), torch.log(torch.tensor([3.0]))
        one = torch.ones(1)
        got = merge(m1, one.clone(), torch.tensor([[1.0]]), m2, one.clone(), torch.tensor([[5.0]]))
        return close_problem("out", torch.tensor([[4.0]]), got)

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


def check_attend_blocks(attend_blocks: Callable) -> None:
    """Grade ``attend_blocks(q, k_pool, v_pool, blocks, q_pos, scale) -> out`` on fixed, seeded cases.

    One sequence, one KV head: q (Tq, D); k_pool, v_pool (num_blocks, block_size, D) hold every
    sequence's K/V (shuffled, so ``blocks`` is not contiguous, and a few blocks belong to nobody);
    blocks: the sequence's physical block ids in position order, ceil(context_len / block_size) of them;
    q_pos: (Tq,) int64 absolute positions of the queries, the last Tq of the history (query at position p
    sees keys 0..p). ``out`` (Tq, D) must equal dense masked softmax attention over the gathered history,
    computed here the L3 way. Rows of the last block past the history hold stale K/V and must be masked.
    Example: block_size 16, blocks [5, 2], q_pos [20]: the query reads 16 keys of block 5, then rows
    0..4 of block 2.
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
            got = attend_blocks(q.clone(), k_pool.clone(), v_pool.clone(), list(blocks), q_pos.clone(), scale)
            return close_problem("out", dense, got)

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


# ---------------------------------------------------------------------------------------------------
# L5: shared blocks (forks, copy-on-write, the prefix cache)


def _fork_setup(block_size: int, num_tokens: int, shared_first: bool):
    """A ``BlockManager`` holding one sequence of ``num_tokens`` positions, and its block table.

    Blocks 0 and 2 belong to another sequence and block 1 was freed, so the table does not start at 0
    and the free list does not run in order. With ``shared_first`` the table's first (full) block is also
    held by a second sequence (a prefix-cache hit): its ref_count is 2 before the fork.
    """
    from L5_clones.cache import BlockManager, blocks_needed

    m = BlockManager(64, block_size)
    m.alloc_blocks(3)  # [0, 1, 2]: another sequence
    m.free([1])  # free list 3, 4, ..., 63, 1
    table = m.alloc_blocks(blocks_needed(num_tokens, block_size))
    if shared_first:
        m.alloc_blocks(0, cached=table[:1])
    return m, table


def check_fork_table(fork_table: Callable) -> None:
    """Grade ``fork_table(parent_table, num_tokens, block_size, n, ref_counts, alloc) -> n block tables``
    against ``L5_clones.cache.BlockManager.fork``.

    ``parent_table`` holds the parent's ``num_tokens`` positions; ``ref_counts`` is a dict
    {block id: ref_count} of every block in use, to update in place; ``alloc()`` hands out one fresh
    block id and sets its count to 1 in ``ref_counts``. Every full block is shared by the n children
    (its count + n); a partial last block gets a fresh block per child (its K/V copy is the next
    exercise). Example, block_size 4, parent [3, 5, 8] holding 10 tokens, n = 2, fresh blocks 0, 1:
    -> [[3, 5, 0], [3, 5, 1]]; counts 3 -> 3, 5 -> 3, 8 -> 1, 0 -> 1, 1 -> 1.
    """
    from L5_clones.cache import KvPool

    def case(
        block_size: int, num_tokens: int, n: int, shared_first: bool = False
    ) -> Callable[[], str | None]:
        def run() -> str | None:
            ref, table = _fork_setup(block_size, num_tokens, shared_first)
            expected = ref.fork(list(table), num_tokens, n, KvPool(1, ref.num_blocks, block_size, 1, 1))
            want_counts = {b.block_id: b.ref_count for b in ref.blocks if b.ref_count}

            mine, _ = _fork_setup(block_size, num_tokens, shared_first)
            counts = {b.block_id: b.ref_count for b in mine.blocks if b.ref_count}

            def alloc() -> int:
                block = mine._take_free()  # the front of the free list, as the reference takes
                counts[block] = 1
                return block

            got = fork_table(list(table), num_tokens, block_size, n, counts, alloc)
            if not isinstance(got, list | tuple) or not all(isinstance(t, list | tuple) for t in got):
                return f"returned {got!r}, expected a list of {n} block table(s)"
            got = [[int(b) for b in t] for t in got]
            if got != expected:
                return f"block tables {got}, expected {expected}"
            if counts != want_counts:
                diff = {
                    b: (counts.get(b, 0), want_counts.get(b, 0))
                    for b in sorted(set(counts) | set(want_counts))
                }
                wrong = ", ".join(f"block {b}: {c} (expected {w})" for b, (c, w) in diff.items() if c != w)
                return f"ref counts wrong: {wrong}"
            return None

        return run

    run_cases(
        [
            Case("block_size 4, 10 tokens (partial last block), n = 2", case(4, 10, 2)),
            Case("block_size 4, 8 tokens (last block exactly full), n = 3: nothing copied", case(4, 8, 3)),
            Case("block_size 4, 3 tokens (only a partial block), n = 1", case(4, 3, 1)),
            Case("block_size 1: every block is full, n = 4", case(1, 5, 4)),
            Case("block_size 16, 37 tokens, n = 4", case(16, 37, 4)),
            Case("block_size 16, 32 tokens (exactly full), n = 2", case(16, 32, 2)),
            Case(
                "block_size 4, 9 tokens, first block already shared (ref_count 2), n = 3", case(4, 9, 3, True)
            ),
        ]
    )


def check_copy_block(copy_block: Callable) -> None:
    """Grade ``copy_block(k, v, src, dst)`` against ``L5_clones.cache.KvPool.copy_block``.

    ``k`` and ``v`` are a pool's tensors, (L, num_blocks, block_size, H_kv, D); block ``src``'s K and V
    must be copied into block ``dst`` in place, in every layer, leaving every other block (and ``src``)
    untouched. Example: 2 layers, src 3, dst 0: k[0, 0] and k[1, 0] become k[0, 3] and k[1, 3].
    """
    from L5_clones.cache import KvPool

    def block_problem(what: str, expected: torch.Tensor, got: torch.Tensor) -> str | None:
        problem = tensor_problem(what, expected.transpose(0, 1), got.transpose(0, 1))  # rows = blocks
        return problem and problem.replace(" at positions ", " in blocks ")

    def case(layers: int, num_blocks: int, block_size: int, heads: int, src: int, dst: int, seed: int):
        def run() -> str | None:
            gen = torch.Generator().manual_seed(seed)
            ref = KvPool(layers, num_blocks, block_size, heads, 4)
            ref.k.copy_(torch.randn(ref.k.shape, generator=gen))  # (L, N, B, H_kv, D)
            ref.v.copy_(torch.randn(ref.v.shape, generator=gen))
            k, v = ref.k.clone(), ref.v.clone()
            ref.copy_block(src, dst)
            copy_block(k, v, src, dst)
            return block_problem("K", ref.k, k) or block_problem("V", ref.v, v)

        return run

    run_cases(
        [
            Case("1 layer, 6 blocks of 4, block 3 -> block 0", case(1, 6, 4, 2, 3, 0, seed=1)),
            Case("2 layers, 8 blocks of 4, block 1 -> block 6", case(2, 8, 4, 3, 1, 6, seed=2)),
            Case(
                "4 layers, 5 blocks of 16, block 4 -> block 2 (every layer)", case(4, 5, 16, 3, 4, 2, seed=3)
            ),
            Case("3 layers, block_size 1, block 0 -> block 9", case(3, 10, 1, 1, 0, 9, seed=4)),
        ]
    )


def check_block_hashes(block_hashes: Callable) -> None:
    """Grade ``block_hashes(token_ids, block_size) -> keys of the full blocks`` against the keys
    ``L5_clones.cache.reserve`` registers in the ``BlockManager`` for a sequence of those tokens.

    Block i (tokens i*block_size .. (i+1)*block_size - 1) is keyed ``block_hash(key of block i - 1,
    its tokens)``, the first block with ``None`` before it; a partial last block has no key yet.
    Example, block_size 2: [1, 2, 3, 4, 5] -> [block_hash(None, [1, 2]), block_hash(that, [3, 4])].
    """
    from L5_clones.cache import BlockManager, Request, reserve

    def case(token_ids: list[int], block_size: int) -> Callable[[], str | None]:
        def run() -> str | None:
            m = BlockManager(64, block_size)
            req = Request(0, list(token_ids), 1)
            reserve(req, m, len(token_ids))  # registers every block full at len(token_ids)
            expected = [m.blocks[b].hash for b in req.block_table[: len(token_ids) // block_size]]
            got = block_hashes(list(token_ids), block_size)
            if not isinstance(got, list | tuple):
                return f"returned {got!r}, expected a list of {len(expected)} keys"
            if len(got) != len(expected):
                return f"{len(got)} keys, expected {len(expected)} (one per full block)"
            bad = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), None)
            return None if bad is None else f"the key of block {bad} differs (blocks before it agree)"

        return run

    gen = torch.Generator().manual_seed(5)
    system = torch.randint(3, 49152, (32,), generator=gen).tolist()
    run_cases(
        [
            Case(
                "block_size 2, [1, 2, 3, 4, 5]: 2 full blocks, the tail [5] has no key",
                case([1, 2, 3, 4, 5], 2),
            ),
            Case("block_size 4, 8 tokens: both blocks full", case(list(range(10, 18)), 4)),
            Case("block_size 4, 3 tokens: no full block, no key", case([7, 8, 9], 4)),
            Case("block_size 1: every token is a block", case([5, 5, 5, 6], 1)),
            Case(
                "block_size 4, the same 4 tokens twice: the second key is chained", case([1, 2, 3, 4] * 2, 4)
            ),
            Case(
                "block_size 16, a 32-token system prompt + 5 tokens", case(system + [11, 12, 13, 14, 15], 16)
            ),
        ]
    )


# ---------------------------------------------------------------------------------------------------
# L6: the paged cache as device arrays (JAX)


def _arrays_problem(names, expected, got) -> str | None:
    """The first problem in a returned tuple of arrays, compared name by name; None when all match.

    Example: ``_arrays_problem(("a",), [np.zeros(2)], 5)`` -> ``"returned int, expected 1 arrays"``.
    """
    if not isinstance(got, list | tuple) or len(got) != len(names):
        return f"returned {type(got).__name__}, expected {len(names)} arrays"
    for name, want, have in zip(names, expected, got):
        problem = _array_problem(name, want, have)
        if problem:
            return problem
    return None


def _array_problem(what: str, expected, got) -> str | None:
    """None if ``got`` (any array-like) equals ``expected`` (a NumPy array) exactly, else what differs."""
    import numpy as np

    if got is None:
        return f"{what} is None"
    try:
        got = np.asarray(got)
    except Exception:  # noqa: BLE001 - anything that is not array-like
        return f"{what} is a {type(got).__name__}, not an array"
    if got.shape != expected.shape:
        return f"{what} has shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
    if np.array_equal(got.astype(expected.dtype), expected):
        return None
    return f"{what} is {got.tolist()}, expected {expected.tolist()}"


def _l6_tables(refs, page_indices, seq_lens, page_size, used=None):
    """Real L6 ``SequenceTable`` and ``PageTable`` holding these NumPy arrays."""
    import jax.numpy as jnp
    import numpy as np

    from L6_tpu_jax.page_table import INVALID, PageTable, SequenceTable

    page_indices = np.asarray(page_indices, np.int32)
    n_seqs = page_indices.shape[0]
    used = np.asarray(seq_lens) > 0 if used is None else np.asarray(used, bool)
    seqs = SequenceTable(
        seq_lens=jnp.asarray(seq_lens, jnp.int32),
        page_indices=jnp.asarray(page_indices),
        used_mask=jnp.asarray(used),
        clone_sources=jnp.full(n_seqs, INVALID, jnp.int32),
        page_size=page_size,
    )
    return seqs, PageTable(jnp.asarray(refs, jnp.int32))


def check_allocate(allocate: Callable) -> None:
    """Grade ``allocate(page_ref_counts, page_indices, seq_lens, slot_ids, positions, page_size)
    -> (page_ref_counts, page_indices, seq_lens, new_token_dests)`` against
    ``L6_tpu_jax.page_table.allocate_for_seq``.

    NumPy in, arrays out (NumPy or jax.numpy), inputs left unchanged. ``slot_ids``/``positions`` (T,)
    are each new token's slot and absolute position (one slot's tokens contiguous, ascending). Each
    slot grows to its largest position + 1 and gets new pages up to ceil(length / page_size), the
    lowest free page ids first, in slot order; ``new_token_dests[t] = page * page_size + pos % page_size``.
    Every case has enough free pages.
    """
    import numpy as np

    from L6_tpu_jax.page_table import allocate_for_seq

    def case(refs, table, lens, slots, pos, page_size) -> Callable[[], str | None]:
        def run() -> str | None:
            refs_a = np.asarray(refs, np.int32)
            table_a = np.asarray(table, np.int32)
            lens_a = np.asarray(lens, np.int32)
            slots_a, pos_a = np.asarray(slots, np.int32), np.asarray(pos, np.int32)
            seqs, pages = _l6_tables(refs_a, table_a, lens_a, page_size)
            seqs, pages, info = allocate_for_seq(seqs, pages, slots_a, pos_a)
            expected = (
                np.asarray(pages.page_ref_counts),
                np.asarray(seqs.page_indices),
                np.asarray(seqs.seq_lens),
                np.asarray(info.new_token_dests),
            )
            inputs = [a.copy() for a in (refs_a, table_a, lens_a, slots_a, pos_a)]
            got = allocate(*inputs, page_size)
            return _arrays_problem(
                ("page_ref_counts", "page_indices", "seq_lens", "new_token_dests"), expected, got
            )

        return run

    e = -1
    run_cases(
        [
            Case(
                "page_size 4, first page: empty slot 0 prefills 3 tokens, pages 0..5 free",
                case([0] * 6, [[e, e, e]], [0], [0, 0, 0], [0, 1, 2], 4),
            ),
            Case(
                "page_size 4, decode: slot 0 stays on its page, slot 1 crosses into a 2nd page",
                case([1, 0, 1, 0, 0, 0], [[0, e, e], [2, e, e]], [3, 4], [0, 1], [3, 4], 4),
            ),
            Case(
                "page_size 4, prefill of 9 tokens: 3 pages from a scattered free list",
                case([1, 0, 1, 0, 1, 0, 0, 0], [[0, 2, 4], [e, e, e]], [12, 0], [1] * 9, list(range(9)), 4),
            ),
            Case(
                "page_size 1: every token needs its own page, 3 sequences",
                case(
                    [0, 1, 0, 0, 1, 0, 0, 0],
                    [[1, e, e], [4, e, e], [e, e, e]],
                    [1, 1, 0],
                    [0, 1, 2, 2],
                    [1, 1, 0, 1],
                    1,
                ),  # fmt: skip
            ),
            Case(
                "page_size 4, mixed: prefill of slot 2 and decodes of slots 0 and 3",
                case(
                    [1, 1, 0, 1, 0, 0, 0, 0, 0],
                    [[0, 1, e], [e, e, e], [e, e, e], [3, e, e]],
                    [8, 0, 0, 4],
                    [0, 2, 2, 2, 2, 2, 3],
                    [8, 0, 1, 2, 3, 4, 4],
                    4,
                ),  # fmt: skip
            ),
            Case(
                "page_size 16, slot 1 decodes at position 31 (last slot of its 2nd page)",
                case([1, 1, 0, 0], [[e, e], [0, 1]], [0, 31], [1], [31], 16),
            ),
        ]
    )


def check_free_finished(free_finished: Callable) -> None:
    """Grade ``free_finished(page_ref_counts, page_indices, seq_lens, used_mask, finished_mask)
    -> (page_ref_counts, page_indices, seq_lens, used_mask)`` against
    ``L6_tpu_jax.page_table.free_pages_for_finished``.

    Each finished slot gives one refcount back per page it holds (a page shared with a live clone
    stays in use), its row becomes all -1, its length 0 and its used flag False; other slots keep
    everything. NumPy in, arrays out, inputs left unchanged.
    """
    import numpy as np

    from L6_tpu_jax.page_table import free_pages_for_finished

    def case(refs, table, lens, used, finished, page_size=4) -> Callable[[], str | None]:
        def run() -> str | None:
            arrays = (
                np.asarray(refs, np.int32),
                np.asarray(table, np.int32),
                np.asarray(lens, np.int32),
                np.asarray(used, bool),
                np.asarray(finished, bool),
            )
            seqs, pages = _l6_tables(*arrays[:3], page_size, used=arrays[3])
            seqs, pages = free_pages_for_finished(seqs, pages, arrays[4])
            expected = (
                np.asarray(pages.page_ref_counts),
                np.asarray(seqs.page_indices),
                np.asarray(seqs.seq_lens),
                np.asarray(seqs.used_mask),
            )
            got = free_finished(*[a.copy() for a in arrays])
            return _arrays_problem(
                ("page_ref_counts", "page_indices", "seq_lens", "used_mask"), expected, got
            )

        return run

    e, T, F = -1, True, False
    run_cases(
        [
            Case(
                "one sequence on pages [1, 3] finishes, the other keeps page 0",
                case([1, 1, 0, 1], [[0, e], [1, 3]], [2, 7], [T, T], [F, T]),
            ),
            Case(
                "slot 0 [3, 5] finishes, its clone slot 1 [3, 6] lives: page 3 stays (refcount 2 -> 1)",
                case([0, 0, 0, 2, 0, 1, 1], [[3, 5], [3, 6]], [6, 6], [T, T], [T, F]),
            ),
            Case(
                "parent and clone finish together: the shared page 3 is freed too",
                case([0, 0, 0, 2, 0, 1, 1], [[3, 5], [3, 6]], [6, 6], [T, T], [T, T]),
            ),
            Case(
                "nothing finished: nothing changes",
                case([1, 1, 1, 0], [[0, 2], [1, e]], [5, 3], [T, T], [F, F]),
            ),
            Case(
                "5 slots, one unused: 3 clones share page 0, two of them and slot 3 finish",
                case(
                    [3, 1, 1, 1, 1, 0],
                    [[0, 1], [0, 2], [0, 3], [4, e], [e, e]],
                    [6, 6, 6, 2, 0],
                    [T, T, T, T, F],
                    [F, T, T, T, F],
                ),  # fmt: skip
            ),
        ]
    )
