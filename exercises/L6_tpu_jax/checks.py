"""The L6 notebook's exercise checkers: the learner's page bookkeeping and KV write against this stage's JAX code.

- ``check_allocate``: pages for a batch of new tokens and their KV destinations, against
  ``allocate_for_seq`` (``page_table.py``);
- ``check_free_finished``: giving back the pages of finished sequences, against
  ``free_pages_for_finished`` (``page_table.py``);
- ``check_write_kv_pages``: the vectorized KV write into the page pool, run under ``jax.jit``, against
  ``update_kv`` (``kv_cache.py``);
- ``check_mesh_specs``: the ``PartitionSpec``s of the mesh engine's inputs over a ``data`` mesh, by
  sharded runs against the engine on one device (``mesh/engine.py``, ``SPECS``; ``engine.py``);
- ``check_allocate_cow`` (beyond the stage): copy-on-write allocation, against expected values stored
  here as data (computed once with the answer key, which does not ship) and rules checked from the
  output alone (``cow_rules``);
- ``check_compact`` (beyond the stage): compaction of the pool, by its rules alone (``compact_rules``:
  ids, order, refcounts, and the moves run on a labelled pool);
- ``check_catch_allocate`` (catch the bug): a learner's test of ``allocate_for_seq``, run on the stage's
  version and on versions with a bug of the mutation list put in (``kvcourse/grading/mutations.py``);
- ``check_predict`` (predict): the tables after five operations, against those operations run on the
  stage (``predict_steps``), one line per array that never shows the expected values.

Where a warm-up's wrong answer gives what a known mistake gives (a destination one row off, the highest
free page first, a shared page freed to 0, ...), its line names the rule (``allocate_mistakes``,
``free_mistakes``, ``mesh_rules``); right values in the wrong dtype are told the dtype.

For the first two the learner writes plain NumPy on small arrays; each case builds a real
``SequenceTable`` and ``PageTable`` holding the same arrays, runs the stage's function on them, and
compares the arrays that come back, name by name (``arrays_problem``). The stage's functions run
under ``jax.jit``: one compile per case's shapes, ~4x faster here than dispatching each op eagerly.
The third is JAX: the checker jits the learner's function behind a Python-side trace counter (as
``Engine`` counts its compiles in ``Engine.traces``), feeds it fixed-shape batches whose padding tokens
have destination -1, compares the pool with ``update_kv``'s, and fails a case that needs more than one
trace for one shape. A Python branch on a traced value (``if dests[t] >= 0``) cannot run under jit at
all: its ``ConcretizationTypeError`` (or another tracer error) is reported as that case's ``WRONG``
line. The fourth runs the mesh engine over a simulated mesh with the learner's ``PartitionSpec``s.

The grading contract (see ``kvcourse/grading/cases.py``): each checker runs fixed cases and prints one
deterministic line per case (``ok``, ``WRONG — what differs``, or ``raised`` and the exception), then
``k/n passed``. The reference notebook stores those lines as the check cell's output and ``make grade``
compares them. The warm-ups' references are the stage's own code, never a copy kept here.

The hidden cases (``HIDDEN``, at the end; ``kvcourse/grading/hidden.py``) run the learner's function on cases
drawn per grading run (batches in a row on tables of a few shapes, KV writes through one jit, specs
laid on abstract meshes of 1 to 16 devices) and are judged in the grader's process against the
independent answers of ``key/L6_tpu_jax/answers.py``.

Left out on purpose: the all-or-nothing path when the pool is short (every allocation case has enough
free pages), padding tokens (slot -1) in the NumPy exercises, jit for the NumPy exercises (they run
eagerly), and duplicate destinations in the KV write (two tokens never share a row).
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

from kvcourse.grading.cases import Case, arrays_problem, first_line, named_mistake, run_cases
from kvcourse.grading.hidden import Hidden, unrevealed
from kvcourse.grading.mutations import catch_cases, catch_hidden, outcome_of, version
from L6_tpu_jax.kv_cache import update_kv
from L6_tpu_jax.page_table import (
    INVALID,
    PageTable,
    SequenceTable,
    allocate_for_seq,
    cdiv,
    clone_pages_from,
    free_pages_for_finished,
)

# What JAX raises when Python code needs the value of a traced array: ``if x > 0``, ``int(x)``,
# ``np.asarray(x)``, ``x[x >= 0]``. Under jit each one is a case failure, named, not a crash.
TRACER_ERRORS = (
    jax.errors.ConcretizationTypeError,  # includes TracerBoolConversionError: ``if`` / ``while`` on a value
    jax.errors.TracerIntegerConversionError,
    jax.errors.TracerArrayConversionError,
    jax.errors.NonConcreteBooleanIndexError,
)


def _tables(refs, page_indices, seq_lens, page_size, used=None) -> tuple[SequenceTable, PageTable]:
    """A real ``SequenceTable`` and ``PageTable`` holding these NumPy arrays; ``used`` defaults to
    "every slot with tokens". Example: refs [1, 0], page_indices [[0, -1]], seq_lens [3], page_size 4
    -> one used slot of 3 tokens on page 0, page 1 free."""
    page_indices = np.asarray(page_indices, np.int32)
    used = np.asarray(seq_lens) > 0 if used is None else np.asarray(used, bool)
    n_seqs, pages_per_seq = page_indices.shape
    seqs = replace(
        SequenceTable.init(n_seqs, pages_per_seq, page_size),
        seq_lens=jnp.asarray(seq_lens, jnp.int32),
        page_indices=jnp.asarray(page_indices),
        used_mask=jnp.asarray(used),
    )
    return seqs, PageTable(jnp.asarray(refs, jnp.int32))


def dtype_problem(names: tuple[str, ...], got, dtypes: tuple) -> str | None:
    """None when each returned array has its dtype, else the first that does not, with the rule.

    Example: ``dtype_problem(("new_token_dests",), [np.zeros(2)], (np.int32,))`` ->
    ``'new_token_dests is float64, expected int32: page ids, lengths and destinations are int32 (an
    index array; JAX's default integer)'``.
    """
    for name, have, want in zip(names, got, dtypes, strict=True):
        have = np.asarray(have).dtype
        if have != want:
            rule = (
                "used flags are bool"
                if want is bool
                else "page ids, lengths and destinations are int32 (an index array; JAX's default integer)"
            )
            return f"{name} is {have}, expected {np.dtype(want).name}: {rule}"
    return None


def _matches_mistake(expected) -> Callable:
    """``same(mistake, got)`` for ``named_mistake``: a mistake is a tuple of arrays, None where it says
    nothing (``(None, table)``: only the second array); it matches when every array it gives equals
    what was returned, and it gives something other than the right answer (else it names nothing)."""

    def same(mistake, got) -> bool:
        pairs = [
            (np.asarray(m), np.asarray(g), e)
            for m, g, e in zip(mistake, got, expected, strict=False)
            if m is not None
        ]
        return any(not np.array_equal(m, e) for m, _, e in pairs) and all(
            m.shape == g.shape and np.array_equal(g.astype(m.dtype), m) for m, g, _ in pairs
        )

    return same


def _stage_allocate(refs, table, lens, slots, pos, page_size) -> tuple[np.ndarray, ...]:
    """``allocate_for_seq`` on NumPy arrays, jit'd: (page_ref_counts, page_indices, seq_lens, dests)."""
    seqs, pages = _tables(refs, table, lens, page_size)
    seqs, pages, info = jax.jit(allocate_for_seq)(seqs, pages, jnp.asarray(slots), jnp.asarray(pos))
    arrays = (pages.page_ref_counts, seqs.page_indices, seqs.seq_lens, info.new_token_dests)
    return tuple(np.asarray(a) for a in arrays)


def allocate_mistakes(refs, table, lens, slots, pos, page_size, expected) -> dict[str, Callable]:
    """What known mistakes of L6.1 return on this input, each by the rule it breaks (for
    ``named_mistake``). Each is the right answer changed, or ``allocate_for_seq`` run on relabelled
    inputs (pages numbered backwards: the highest free page first; slots renumbered in batch order:
    pages handed out in batch order), so no second allocator is written here.
    Example: page_size 4, a token at position 3 of an empty slot -> "one row off" gives destination
    page * 4 + 0 where the right one is page * 4 + 3."""
    n_pages = len(refs)
    dests = expected[3]

    def highest_free_first():
        back = np.where(table >= 0, n_pages - 1 - table, -1)  # page p is called n_pages - 1 - p
        r, tb, ln, d = _stage_allocate(refs[::-1].copy(), back, lens, slots, pos, page_size)
        page, row = d // page_size, d % page_size
        return r[::-1], np.where(tb >= 0, n_pages - 1 - tb, -1), ln, (n_pages - 1 - page) * page_size + row

    def in_batch_order():
        first = list(dict.fromkeys(slots.tolist()))
        order = np.array(
            first + [s for s in range(len(lens)) if s not in first]
        )  # new slot i is old order[i]
        rename = np.argsort(order).astype(np.int32)  # old slot -> new slot
        r, tb, ln, d = _stage_allocate(refs, table[order], lens[order], rename[slots], pos, page_size)
        return r, tb[rename], ln[rename], d

    return {
        "a token's row is pos % page_size: new_token_dests is one row off": lambda: (
            None, None, None, dests // page_size * page_size + (dests % page_size + 1) % page_size
        ),
        "a slot grows to its largest position + 1, not to the position": lambda: _stage_allocate(
            refs, table, lens, slots, pos - 1, page_size
        )[:3],
        "each new page's refcount becomes 1": lambda: (refs,),
        "free pages go out lowest id first": highest_free_first,
        "pages go to the slots in ascending slot order, not in batch order": in_batch_order,
    }  # fmt: skip


def check_allocate(allocate: Callable) -> None:
    """Grade ``allocate(page_ref_counts, page_indices, seq_lens, slot_ids, positions, page_size)
    -> (page_ref_counts, page_indices, seq_lens, new_token_dests)`` against ``allocate_for_seq``.

    NumPy in, arrays out (NumPy or jax.numpy, all four int32), inputs left unchanged.
    ``slot_ids``/``positions`` (T,) are each new token's slot and absolute position (one slot's tokens
    contiguous, ascending). Each slot grows to its largest position + 1 and gets new pages up to
    ceil(length / page_size), the lowest free page ids first, in slot order;
    ``new_token_dests[t] = page * page_size + pos % page_size``. Every case has enough free pages. A
    wrong answer that gives what a known mistake gives (``allocate_mistakes``) is told the rule it
    breaks; right values in another dtype are told the dtype.
    """

    def case(refs, table, lens, slots, pos, page_size) -> Callable[[], str | None]:
        def run() -> str | None:
            refs_a = np.asarray(refs, np.int32)
            table_a = np.asarray(table, np.int32)
            lens_a = np.asarray(lens, np.int32)
            slots_a, pos_a = np.asarray(slots, np.int32), np.asarray(pos, np.int32)
            seqs, pages = _tables(refs_a, table_a, lens_a, page_size)
            seqs, pages, info = jax.jit(allocate_for_seq)(seqs, pages, slots_a, pos_a)
            expected = (
                np.asarray(pages.page_ref_counts),
                np.asarray(seqs.page_indices),
                np.asarray(seqs.seq_lens),
                np.asarray(info.new_token_dests),
            )
            inputs = [a.copy() for a in (refs_a, table_a, lens_a, slots_a, pos_a)]
            got = allocate(*inputs, page_size)
            names = ("page_ref_counts", "page_indices", "seq_lens", "new_token_dests")
            problem = arrays_problem(names, expected, got)
            if problem:
                mistakes = allocate_mistakes(refs_a, table_a, lens_a, slots_a, pos_a, page_size, expected)
                return named_mistake(problem, got, mistakes, same=_matches_mistake(expected))
            return dtype_problem(names, got, (np.int32,) * 4)

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
            Case(
                "page_size 2, the batch lists slot 2 before slot 0: pages still go in slot order",
                case([0, 1, 0, 0, 0, 0], [[e, e], [1, e], [e, e]], [0, 1, 0], [2, 2, 2, 0], [0, 1, 2, 0], 2),
            ),
        ]
    )


def free_mistakes(refs, table, lens, used, finished, expected) -> dict[str, Callable]:
    """What known mistakes of L6.2 return on this input, by the rule each breaks (for ``named_mistake``),
    each the right answer changed. Example: slot 0 [3, 5] finishes, its clone [3, 6] lives, p3 = 2:
    "shared page set to 0" gives p3 = 0 where the right answer keeps p3 = 1."""
    rows = table[finished]  # (finished slots, pages_per_seq)

    def shared_to_zero():
        r = expected[0].copy()
        r[rows[rows >= 0]] = 0
        return (r,)

    def minus_one_is_a_page():
        r = expected[0].copy()
        r[-1] -= np.sum(rows < 0)  # refs[-1] is the last page's count
        return (r,)

    return {
        "each finished slot gives back one reference per page it holds": lambda: (refs,),
        "a page a live clone still holds drops by one, not to 0": shared_to_zero,
        "-1 in a row is no page (refs[-1] is the last page's count)": minus_one_is_a_page,
        "a finished slot's row becomes all -1": lambda: (None, table),
        "a finished slot's length becomes 0": lambda: (None, None, lens),
        "a finished slot's used flag becomes False": lambda: (None, None, None, used),
    }


def check_free_finished(free_finished: Callable) -> None:
    """Grade ``free_finished(page_ref_counts, page_indices, seq_lens, used_mask, finished_mask)
    -> (page_ref_counts, page_indices, seq_lens, used_mask)`` against ``free_pages_for_finished``.

    Each finished slot gives one refcount back per page it holds (a page shared with a live clone
    stays in use), its row becomes all -1, its length 0 and its used flag False; other slots keep
    everything. NumPy in, arrays out (int32, and bool for ``used_mask``), inputs left unchanged. A
    wrong answer that gives what a known mistake gives (``free_mistakes``) is told the rule it breaks.
    """

    def case(refs, table, lens, used, finished, page_size=4) -> Callable[[], str | None]:
        def run() -> str | None:
            arrays = (
                np.asarray(refs, np.int32),
                np.asarray(table, np.int32),
                np.asarray(lens, np.int32),
                np.asarray(used, bool),
                np.asarray(finished, bool),
            )
            seqs, pages = _tables(*arrays[:3], page_size, used=arrays[3])
            seqs, pages = jax.jit(free_pages_for_finished)(seqs, pages, arrays[4])
            expected = (
                np.asarray(pages.page_ref_counts),
                np.asarray(seqs.page_indices),
                np.asarray(seqs.seq_lens),
                np.asarray(seqs.used_mask),
            )
            got = free_finished(*[a.copy() for a in arrays])
            names = ("page_ref_counts", "page_indices", "seq_lens", "used_mask")
            problem = arrays_problem(names, expected, got)
            if problem:
                mistakes = free_mistakes(*arrays, expected)
                return named_mistake(problem, got, mistakes, same=_matches_mistake(expected))
            return dtype_problem(names, got, (np.int32, np.int32, np.int32, bool))

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


def counted_jit(fn: Callable) -> tuple[Callable, Counter[str]]:
    """``jax.jit`` of ``fn`` and a counter of its traces, as ``Engine.traces`` counts the engine's.

    The counter sits in the Python wrapper, which runs only while jit traces (once per new input shape
    and dtype); calls served from jit's cache do not touch it. Example: three calls with inputs of one
    shape -> ``traces["write"] == 1``; a fourth with a longer ``dests`` -> 2.
    """
    traces: Counter[str] = Counter()

    def traced(*args):
        traces["write"] += 1
        return fn(*args)

    return jax.jit(traced), traces


def format_rows(rows, page_size: int) -> str:
    """Flat pool rows as (page, row) pairs, at most four shown.

    Examples, page_size 4: ``[5, 23] -> '[(1, 1), (5, 3)]'``; ``range(9, 15)`` ->
    ``'[(2, 1), (2, 2), ..., (3, 2)] (6 rows)'``.
    """
    pairs = [(int(r) // page_size, int(r) % page_size) for r in rows]
    if len(pairs) <= 4:
        return str(pairs)
    return f"[{pairs[0]}, {pairs[1]}, ..., {pairs[-1]}] ({len(pairs)} rows)"


def pool_problem(expected: np.ndarray, got, dests: np.ndarray) -> str | None:
    """None if the returned pool equals ``expected`` exactly, else which (page, row)s are wrong and a hint.

    Rows a token writes (``dests >= 0``) and rows no token writes are told apart, since the usual
    mistakes differ: a destination off by one changes a row nobody writes, a padding token written
    through ``.at[-1]`` changes the pool's last row, and K and V stacked as ``k0, k1, v0, v1`` put the
    right numbers in the wrong order. Example, 6 pages of 4 rows, dests [9, -1], a learner who writes the
    padding token too: ``'changed (page, row) [(5, 3)], which no token writes: dest -1 is padding
    (skip it; .at[-1] is the last row)'``.
    """
    try:
        got = np.asarray(got)
    except Exception:  # noqa: BLE001 - a tuple of arrays, None, anything that is not one array
        return f"returned a {type(got).__name__}, expected the updated pool (one array)"
    if got.shape != expected.shape:
        return f"the pool has shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
    n_pages, ps = expected.shape[:2]
    want, have = expected.reshape(n_pages * ps, -1), got.reshape(n_pages * ps, -1).astype(expected.dtype)
    differs = np.flatnonzero(np.any(want != have, axis=1))  # NaN != anything, so NaN counts as wrong
    if differs.size == 0:
        return None
    written = set(int(d) for d in dests if d >= 0)
    bad = [r for r in differs if r in written]
    stray = [r for r in differs if r not in written]
    parts = []
    if bad:
        text = f"wrong K/V at (page, row) {format_rows(bad, ps)}"
        if all(np.array_equal(np.sort(want[r]), np.sort(have[r])) for r in bad):
            text += ": the right numbers in the wrong order (a row holds k0, v0, k1, v1, ...)"
        parts.append(text)
    if stray:
        text = f"changed (page, row) {format_rows(stray, ps)}, which no token writes"
        if n_pages * ps - 1 in stray and np.any(dests < 0):
            text += ": dest -1 is padding (skip it; .at[-1] is the last row)"
        parts.append(text)
    return "; ".join(parts)


def check_write_kv_pages(write_kv_pages: Callable) -> None:
    """Grade ``write_kv_pages(kv_pages, dests, k, v) -> kv_pages`` under ``jax.jit`` against ``update_kv``.

    ``kv_pages`` (P, page_size, 2 * H_kv, D) is one layer's pool; ``dests`` (T,) i32 the flat row of
    each new token, ``page * page_size + row``, INVALID (-1) for padding; ``k``, ``v`` (T, H_kv, D). The
    function returns the new pool: token t's heads interleaved ``k0, v0, k1, v1, ...`` at row
    ``dests[t]``, every other row (padding included) unchanged. Each case jits the learner's function
    afresh behind a trace counter and runs one or more batches of one shape, each against
    ``update_kv`` on the same seeded pool and K/V; a case also fails if jit traced more than once.

    Example, page_size 4, H_kv 1, D 1: dests [5, -1], k [[[1.]], [[2.]]], v [[[3.]], [[4.]]] -> page 1
    row 1 holds [[1.], [3.]] (k0, v0); the padding token's K/V (2, 4) are written nowhere.
    """

    def batch(seed: int, shape: tuple[int, int, int, int], dests: list[int]):
        n_pages, ps, n_kv, dim = shape
        rng = np.random.default_rng(seed)
        pool = rng.standard_normal((n_pages, ps, 2 * n_kv, dim)).astype(np.float32)  # old K/V everywhere
        k = rng.standard_normal((len(dests), n_kv, dim)).astype(np.float32)  # (T, H_kv, D)
        v = rng.standard_normal((len(dests), n_kv, dim)).astype(np.float32)  # (T, H_kv, D)
        return jnp.asarray(pool), jnp.asarray(dests, jnp.int32), jnp.asarray(k), jnp.asarray(v)

    def case(seed: int, shape: tuple[int, int, int, int], *batches: list[int]) -> Callable[[], str | None]:
        def run() -> str | None:
            jitted, traces = counted_jit(write_kv_pages)
            for b, dests in enumerate(batches):
                args = batch(seed + b, shape, dests)
                expected = np.asarray(jax.jit(update_kv)(*args))
                try:
                    got = jitted(*args)
                except TRACER_ERRORS as e:
                    return (
                        f"{type(e).__name__} under jax.jit: the code needs a traced array's values in "
                        "Python (`if`, `int()`, `np.asarray`, `x[mask]`); keep shapes fixed, use jnp.where"
                    )
                problem = pool_problem(expected, got, np.asarray(dests))
                if problem:
                    return problem if len(batches) == 1 else f"batch {b + 1}: {problem}"
            if traces["write"] != 1:
                return f"traced {traces['write']} times for one shape (jit should compile it once)"
            return None

        return run

    e = INVALID
    run_cases(
        [
            Case(
                "page_size 4, H_kv 2: 3 decode tokens to 3 different pages, no padding",
                case(11, (6, 4, 2, 3), [1 * 4 + 3, 4 * 4 + 0, 0 * 4 + 2]),
            ),
            Case(
                "page_size 4, H_kv 2: 5 prefill tokens cross from page 2 to page 5, then 3 padding",
                case(12, (6, 4, 2, 3), [9, 10, 11, 20, 21, e, e, e]),
            ),
            Case(
                "page_size 4, H_kv 2: all 4 tokens are padding, the pool is unchanged",
                case(13, (6, 4, 2, 3), [e] * 4),
            ),
            Case(
                "page_size 1, H_kv 3: one row per page, pages out of order, 1 padding",
                case(14, (5, 1, 3, 2), [3, 0, 2, e]),
            ),
            Case(
                "page_size 16, H_kv 1: a 20-token prefill on pages 3 and 0, padded to 32 like the engine",
                case(15, (5, 16, 1, 4), [3 * 16 + i for i in range(16)] + list(range(4)) + [e] * 12),
            ),
            Case(
                "one trace: 3 batches of one shape (8 tokens; 0, 3 and 8 of them padding)",
                case(
                    16,
                    (6, 4, 2, 3),
                    [0, 1, 2, 3, 12, 13, 14, 15],
                    [20, 21, 4, 5, 6, e, e, e],
                    [e] * 8,
                ),
            ),
        ]
    )


def mesh_rules(specs: dict) -> str:
    """The rules of L6.4 a dict of ``PartitionSpec``s breaks, in words ('' when it keeps them all).

    Example: ``{"params": P(), "decode_state": P(), "kv_pages": P()}`` -> ``'kv_pages: each device
    holds one range of pages, so the pool is cut along axis 0 (the pages) over data'``.
    """
    from L6_tpu_jax.mesh.multihost import DATA

    def axes(spec) -> tuple:
        spec = tuple(spec) if isinstance(spec, PartitionSpec) else (spec,)
        while spec and spec[-1] is None:  # P("data") == P("data", None, None, None)
            spec = spec[:-1]
        return spec

    broken = []
    if axes(specs["params"]):
        broken.append("params: every device runs the whole model, so the weights are whole (P())")
    if axes(specs["decode_state"]):
        broken.append(
            "decode_state: every device computes the whole batch's allocation, so the tables are whole (P())"
        )
    if axes(specs["kv_pages"]) != (DATA,):
        broken.append(
            "kv_pages: each device holds one range of pages, so the pool is cut along axis 0 (the pages) over data"
        )
    return "; ".join(broken)


MESH_DEVICES = 4  # CPU devices the notebook asks XLA for, before JAX starts (its first cell)


def check_mesh_specs(mesh_specs: Callable) -> None:
    """Grade ``mesh_specs() -> {"params": P, "decode_state": P, "kv_pages": P}`` with sharded runs.

    Each case builds the mesh engine over a ``data`` mesh of 2 or 4 simulated CPU devices with the
    learner's ``PartitionSpec``s, runs a tiny seeded Llama on a few prompts, and compares the tokens with
    the single-device engine (``Engine``). The mesh engine's per-device program indexes its own
    slice of the pool with page ids local to it, so a pool that is copied whole (``P()``) or split along
    another axis gives wrong tokens or an error, and a state split over devices cannot be built.
    A case also fails if a device holds more than its share of the pages.

    Example: ``{"params": P(), "decode_state": P(), "kv_pages": P()}`` -> on 2 devices each holds the
    whole pool: "each device holds 16 of 16 pages per layer (its share is 8)".
    """
    from kvcourse.harness.tiny import make_tiny_checkpoint
    from L6_tpu_jax.engine import Engine
    from L6_tpu_jax.mesh.engine import MeshEngine
    from L6_tpu_jax.mesh.multihost import data_mesh

    if len(jax.devices()) < MESH_DEVICES:
        raise RuntimeError(
            f"this check needs {MESH_DEVICES} CPU devices and JAX started with {len(jax.devices())}: restart "
            "the kernel and run the first cell first (it sets XLA_FLAGS before JAX starts)"
        )
    import tempfile

    tiny = make_tiny_checkpoint("llama", tempfile.mkdtemp(prefix="kvcourse-mesh-check-"))
    prompts = [[5 + i + 3 * j for j in range(4 + 12 * i)] for i in range(3)]  # 4, 16 and 28 tokens
    max_new_tokens = [6, 9, 5]

    @functools.cache
    def one_device() -> list[list[list[int]]]:
        """The engine on one device, 2 greedy clones of each prompt (clone 0 is the n=1 answer)."""
        return Engine(tiny, max_num_seqs=8, max_model_len=48, num_pages=16).generate_samples(
            prompts, max_new_tokens, n=2
        )

    def case(devices: int, n: int) -> Callable[[], str | None]:
        def run() -> str | None:
            specs = mesh_specs()
            if not isinstance(specs, dict) or set(specs) != {"params", "decode_state", "kv_pages"}:
                return f"returned {specs!r}, expected a dict with keys params, decode_state, kv_pages"
            rules = mesh_rules(specs)
            options = dict(max_num_seqs=8, max_model_len=48, num_pages=8 * devices)
            try:
                engine = MeshEngine(tiny, data_mesh(jax.devices()[:devices]), **options, specs=specs)
            except Exception as e:
                if not rules:
                    raise
                return f"the engine could not be built ({type(e).__name__}): {rules}"
            held = engine.kv_pages[0].addressable_shards[0].data.shape[0]
            share = engine.num_pages // devices
            if held != share:
                return (
                    f"each device holds {held} of {engine.num_pages} pages per layer (its share is {share})"
                    + (f": {rules}" if rules else "")
                )
            got = engine.generate_samples(prompts, max_new_tokens, n=n)
            expected = [clones[:n] for clones in one_device()]
            wrong = [i for i, (a, b) in enumerate(zip(expected, got, strict=True)) if a != b]
            if wrong:
                return (
                    f"prompts {wrong} differ from one device, first: {got[wrong[0]]} instead of {expected[wrong[0]]}"
                    + (f": {rules}" if rules else "")
                )
            return None

        return run

    run_cases(
        [
            Case("2 devices, 3 prompts of 4 to 28 tokens: the tokens of one device", case(2, 1)),
            Case("4 devices, 2 clones of each prompt sharing their full pages", case(4, 2)),
        ]
    )


# ---- beyond the stage: copy-on-write (L6.5) and compaction (L6.6); catch the bug (L6.7); predict (L6.8)

COW_NAMES = ("page_ref_counts", "page_indices", "seq_lens", "new_token_dests")


def cow_rules(refs, table, slots, pos, page_size, got) -> str | None:
    """The first copy-on-write rule a returned ``(refs, table, lens, dests, copies)`` breaks, found from
    the input and the output alone (no answer): refcounts that are not the number of holders, a token
    written into a page another slot still holds, a page copied by every holder (the last one writes in
    place), a held page replaced without a copy. None when it keeps them all. Example: clones slot 0
    and 1 on [3, 5], p5 = 2, slot 1 writes position 6 into page 5 with no copy -> "slot 1 writes page
    5, which 2 slots hold: a shared page is copied before it is written"."""
    new_refs, new_table, _, dests = (np.asarray(a) for a in got[:4])
    copies = list(got[4])
    holders = Counter(int(p) for p in new_table.reshape(-1) if p >= 0)
    for page, count in enumerate(new_refs.tolist()):
        if count != holders[page]:
            held = f"{holders[page]} slot{'' if holders[page] == 1 else 's'} hold{'s' if holders[page] == 1 else ''}"
            return f"page_ref_counts[{page}] is {count} but {held} page {page}"
    for s, d in zip(slots.tolist(), dests.tolist(), strict=True):
        if d >= 0 and holders[d // page_size] > 1:
            return (
                f"slot {s} writes page {d // page_size}, which {holders[d // page_size]} slots hold: "
                "a shared page is copied before it is written"
            )
    pairs = {(int(a), int(b)) for a, b in copies}
    for src, _ in sorted(pairs):
        if refs[src] > 0 and holders[src] == 0:
            return (
                f"page {src} was copied by every slot that held it and is now free: once a page's "
                "refcount is 1, its last holder writes in place"
            )
    for s, j in zip(*np.nonzero((table >= 0) & (new_table != table)), strict=True):
        old, new = int(table[s, j]), int(new_table[s, j])
        if (old, new) not in pairs:
            return (
                f"slot {s}'s page {j} changed from {old} to {new} with no copy ({old}, {new}): "
                "the rows it already holds would be lost"
            )
    return None


def check_allocate_cow(allocate_cow: Callable) -> None:
    """Grade ``allocate_cow(page_ref_counts, page_indices, seq_lens, slot_ids, positions, page_size)
    -> (page_ref_counts, page_indices, seq_lens, new_token_dests, copies)`` on fixed cases.

    The expected values below were computed once with the answer key (``key/L6_tpu_jax/answers.py``, which does not
    ship with the exercises) and are stored here as data: this file holds no copy-on-write allocator.
    A wrong answer is first held to the rules it can be checked against without one (``cow_rules``),
    and a line names the rule it breaks; then the values are compared; then the dtypes (int32).
    """

    def case(refs, table, lens, slots, pos, page_size, want) -> Callable[[], str | None]:
        def run() -> str | None:
            arrays = [np.asarray(a, np.int32) for a in (refs, table, lens, slots, pos)]
            copies_in = [a.copy() for a in arrays]
            try:
                got = allocate_cow(*copies_in, page_size)
            except ValueError as e:
                if isinstance(want, tuple):
                    raise
                named = all(re.search(rf"\b{n}\b", str(e)) for n in want["names"])
                return None if named else f"the ValueError says {first_line(str(e), 60)!r}: {want['says']}"
            if not isinstance(want, tuple):
                return f"returned, but the batch needs more pages than are free: {want['says']}"
            if any(not np.array_equal(a, b) for a, b in zip(arrays, copies_in, strict=True)):
                return "changed its inputs (return new arrays)"
            if not isinstance(got, list | tuple) or len(got) != 5:
                return f"returned {type(got).__name__}, expected 4 arrays and a list of copies"
            expected = tuple(np.asarray(w, np.int32) for w in want[:4])
            problem = arrays_problem(COW_NAMES, expected, got[:4])
            copies = [tuple(int(x) for x in pair) for pair in got[4]]
            if not problem and copies != [tuple(c) for c in want[4]]:
                problem = f"copies is {copies}, expected {[tuple(c) for c in want[4]]}"
            if problem:
                rule = cow_rules(arrays[0], arrays[1], arrays[3], arrays[4], page_size, got)
                return f"{problem} ({rule})" if rule else problem
            return dtype_problem(COW_NAMES, got[:4], (np.int32,) * 4)

        return run

    e = -1
    short = {"names": (3, 1), "says": "raise ValueError naming what it needs (3 pages) and what is free (1)"}
    run_cases(
        [
            Case(
                "page_size 4, slot 1 (a lazy clone of slot 0, both on [3, 5]) decodes at 6",
                case([0, 0, 0, 2, 0, 2, 0], [[3, 5], [3, 5]], [6, 6], [1], [6], 4,
                     ([1, 0, 0, 2, 0, 1, 0], [[3, 5], [3, 0]], [6, 7], [2], [(5, 0)])),
            ),
            Case(
                "page_size 4, both clones on [3, 5] decode at 6 in one batch",
                case([0, 0, 0, 2, 0, 2, 0], [[3, 5], [3, 5]], [6, 6], [0, 1], [6, 6], 4,
                     ([1, 0, 0, 2, 0, 1, 0], [[3, 0], [3, 5]], [7, 7], [2, 22], [(5, 0)])),
            ),
            Case(
                "page_size 4, both clones on [3, 5] decode at 6 with one page free: one copy is enough",
                case([1, 1, 1, 2, 1, 2, 0], [[3, 5], [3, 5]], [6, 6], [0, 1], [6, 6], 4,
                     ([1, 1, 1, 2, 1, 1, 1], [[3, 6], [3, 5]], [7, 7], [26, 22], [(5, 6)])),
            ),
            Case(
                "page_size 4, clones of 8 tokens on [1, 2]: slot 1's token 8 starts a page",
                case([0, 2, 2, 0], [[1, 2, e], [1, 2, e]], [8, 8], [1], [8], 4,
                     ([1, 2, 2, 0], [[1, 2, e], [1, 2, 0]], [8, 9], [0], [])),
            ),
            Case(
                "page_size 4, three slots share page 2; slots 0, 1 and 3 write, slot 2 waits",
                case([1, 0, 3, 0, 0, 0, 0], [[0, e], [2, e], [2, e], [2, e]], [3, 2, 2, 2],
                     [0, 1, 1, 3], [3, 2, 3, 2], 4,
                     ([1, 1, 1, 1, 0, 0, 0], [[0, e], [1, e], [2, e], [3, e]], [4, 4, 2, 3],
                      [3, 6, 7, 14], [(2, 1), (2, 3)])),
            ),
            Case(
                "page_size 2, slot 1 (a clone on [4, 1]) writes 3 tokens: a copy, then a new page",
                case([0, 2, 0, 0, 2, 0], [[4, 1, e, e], [4, 1, e, e]], [3, 3], [1, 1, 1], [3, 4, 5], 2,
                     ([1, 1, 1, 0, 2, 0], [[4, 1, e, e], [4, 0, 2, e]], [3, 6], [1, 4, 5], [(1, 0)])),
            ),
            Case(
                "page_size 4, the batch needs 3 pages and 1 is free: all or nothing",
                case([2, 1, 1, 0], [[0, e, e], [0, e, e], [1, e, e], [2, e, e]], [2, 2, 4, 4],
                     [0, 2, 3], [2, 4, 4], 4, short),
            ),
        ]
    )  # fmt: skip


def compact_rules(refs, table, got) -> str | None:
    """Whether a returned ``(page_ref_counts, page_indices, moves)`` is the compaction of these tables,
    checked rule by rule (no answer needed): None when right, else the first rule broken.

    The pages in use must get ids 0 .. n - 1 in their old order, every entry of a page the same new
    id, -1 kept, refcounts moved with their pages, each page that changes id moved once, and the moves,
    run one after the other on a pool whose page p holds "p", must leave each new page holding its
    old page's K/V. Example: refs [0, 1, 1], table [[1, 2]], moves [(2, 1), (1, 0)] -> "after the moves
    page 0 holds old page 2's K/V, not old page 1's: a move overwrote page 1 before it was copied
    away (order the moves)".
    """
    if not isinstance(got, list | tuple) or len(got) != 3:
        return f"returned {type(got).__name__}, expected 2 arrays and a list of moves"
    new_refs, new_table = np.asarray(got[0]), np.asarray(got[1])
    if new_refs.shape != refs.shape or new_table.shape != table.shape:
        return f"shapes {new_refs.shape} and {new_table.shape}, expected {refs.shape} and {table.shape}"
    if not np.array_equal(new_table < 0, table < 0) or np.any(new_table[table < 0] != -1):
        return "page_indices: -1 (no page) stays -1, and every page stays a page"
    live = [p for p, count in enumerate(refs.tolist()) if count > 0]
    became = {}
    for old, new in zip(table[table >= 0].tolist(), new_table[table >= 0].tolist(), strict=True):
        if became.setdefault(old, new) != new:
            return f"page {old} became both {became[old]} and {new}: every entry of a page gets one new id"
    ids = [became.get(old) for old in live]
    if sorted(i for i in ids if i is not None) != list(range(len(live))):
        return f"the {len(live)} pages in use have ids {sorted(set(ids) - {None})}, expected 0 .. {len(live) - 1}"
    if ids != sorted(ids):
        return "the pages in use keep their order (the lowest old id gets 0)"
    want_refs = [int(refs[old]) for old in live] + [0] * (len(refs) - len(live))
    if new_refs.tolist() != want_refs:
        return f"page_ref_counts is {new_refs.tolist()}: each refcount moves with its page, free pages 0"
    moves = [tuple(int(x) for x in move) for move in got[2]]
    if sorted(moves) != sorted((old, became[old]) for old in live if became[old] != old):
        return f"moves {moves}: move each page whose id changes, once, from its old id to its new one"
    pool = list(range(len(refs)))  # page p holds the K/V of old page p
    for src, dst in moves:
        pool[dst] = pool[src]
    for old in live:
        if pool[became[old]] != old:
            return (
                f"after the moves page {became[old]} holds old page {pool[became[old]]}'s K/V, not old "
                f"page {old}'s: a move overwrote page {old} before it was copied away (order the moves)"
            )
    return dtype_problem(("page_ref_counts", "page_indices"), got[:2], (np.int32, np.int32))


def check_compact(compact: Callable) -> None:
    """Grade ``compact(page_ref_counts, page_indices) -> (page_ref_counts, page_indices, moves)`` by its
    rules (``compact_rules``): this file holds no compaction, only what a right one must satisfy. A
    table whose refcounts disagree with its holders must raise ValueError naming the page."""

    def case(refs, table, bad_page=None) -> Callable[[], str | None]:
        def run() -> str | None:
            refs_a, table_a = np.asarray(refs, np.int32), np.asarray(table, np.int32)
            copies = [refs_a.copy(), table_a.copy()]
            try:
                got = compact(*copies)
            except ValueError as e:
                if bad_page is None:
                    raise
                if re.search(rf"\b{bad_page}\b", str(e)):
                    return None
                return f"the ValueError says {first_line(str(e), 60)!r}: name the page ({bad_page})"
            if bad_page is not None:
                return (
                    f"returned, but page {bad_page}'s refcount is not its number of holders: raise ValueError"
                )
            if not (np.array_equal(copies[0], refs_a) and np.array_equal(copies[1], table_a)):
                return "changed its inputs (return new arrays)"
            return compact_rules(refs_a, table_a, got)

        return run

    e = -1
    run_cases(
        [
            Case("pages 1, 3 and 4 in use, 0 and 2 free", case([0, 1, 0, 1, 1], [[1, 3], [4, e]])),
            Case("pages 0 and 1 in use: already compact, nothing moves", case([1, 1, 0, 0], [[0, 1]])),
            Case("clones share page 2 (refcount 2): both rows follow it", case([0, 0, 2, 1, 0, 1], [[2, 3], [2, 5]])),
            Case("pages 1, 2, 3 in one row: each moves down by one", case([0, 1, 1, 1], [[1, 2, 3]])),
            Case("no page in use", case([0, 0, 0], [[e, e], [e, e]])),
            Case("page 2 has refcount 1 and two holders: ValueError", case([1, 0, 1], [[0, 2], [2, e]], bad_page=2)),
        ]
    )  # fmt: skip


ALLOCATE = "L6_tpu_jax.page_table:allocate_for_seq"
CATCH_VISIBLE = [
    "L6 allocate_for_seq grants the pages it can (not all or nothing)",
    "L6 allocate_for_seq takes no reference on a new page",
]
CATCH_ALL = [
    *CATCH_VISIBLE,
    "L6 allocate_for_seq grows a slot to its last position, one token short",
    "L6 allocate_for_seq hands out the highest free page first",
    "L6 allocate_for_seq does not count page 0 among the pages a slot holds",
    "L6 allocate_for_seq counts the pages a slot needs with floor division",
]


def check_catch_allocate(test: Callable) -> None:
    """Grade a learner's ``test(allocate_for_seq)``: it must pass the stage's ``allocate_for_seq`` and
    fail it with each bug of ``CATCH_VISIBLE`` put in (``kvcourse/grading/mutations.py``); the hidden cases
    hand it every bug of ``CATCH_ALL``."""
    run_cases(catch_cases(test, ALLOCATE, CATCH_VISIBLE, "allocate_for_seq"))


def observe_catch(test: Callable, case: dict) -> str:
    """``"passes"`` or ``"fails"``: the learner's test on one version of ``allocate_for_seq`` (the bug
    ``case["bug"]`` put in; None: the stage's; written differently with ``case["salt"]``), jit'd. The grader clears JAX's caches before each hidden
    case, and one jit of the whole function compiles several times faster than its ~40 ops run eagerly
    for the first time, so the seven cases fit their time on a busy 2-core machine."""
    return outcome_of(test, jax.jit(version(ALLOCATE, case["bug"], case.get("salt"))))


def predict_steps() -> list[tuple[str, dict]]:
    """The five operations of exercise L6.8 run on the stage's functions, with the state after each:
    ``[(what was done, {"page_ref_counts": [...], "page_indices": [...], "seq_lens": [...],
    "new_token_dests": [...]}), ...]`` (``new_token_dests`` of the step's allocation; [] otherwise)."""
    seqs = replace(SequenceTable.init(3, 3, 4), used_mask=jnp.ones(3, bool))
    pages = PageTable.init(6)
    steps = []

    def state(dests) -> dict:
        return {
            "page_ref_counts": np.asarray(pages.page_ref_counts).tolist(),
            "page_indices": np.asarray(seqs.page_indices).tolist(),
            "seq_lens": np.asarray(seqs.seq_lens).tolist(),
            "new_token_dests": dests,
        }

    def allocate(what, slots, pos):
        nonlocal seqs, pages
        seqs, pages, info = allocate_for_seq(
            seqs, pages, jnp.asarray(slots, jnp.int32), jnp.asarray(pos, jnp.int32)
        )
        steps.append((what, state(np.asarray(info.new_token_dests).tolist())))

    allocate("1. slot 0 prefills 6 tokens", [0] * 6, list(range(6)))
    allocate("2. slot 1 prefills 3 tokens", [1] * 3, list(range(3)))
    seqs, pages, *_ = clone_pages_from(seqs, pages, jnp.int32(0), jnp.int32(2))
    steps.append(("3. slot 2 starts as a clone of slot 0", state([])))
    seqs, pages = free_pages_for_finished(seqs, pages, jnp.array([True, False, False]))
    steps.append(("4. slot 0 finishes", state([])))
    allocate("5. slot 1 at positions 3, 4 and slot 2 at 6, 7, 8", [1, 1, 2, 2, 2], [3, 4, 6, 7, 8])
    return steps


PREDICT_KEYS = ("page_ref_counts", "page_indices", "seq_lens", "new_token_dests")


def check_predict(predict: Callable) -> None:
    """Grade ``predict() -> {"page_ref_counts": [...], "page_indices": [...], "seq_lens": [...],
    "new_token_dests": [...]}`` against the state after the last of ``predict_steps()``, one line per
    key. A line never shows the expected value, only how many entries differ: ``page_indices: WRONG —
    2 of 9 entries differ``."""
    want = predict_steps()[-1][1]

    def case(key: str) -> Callable[[], str | None]:
        def run() -> str | None:
            got = predict()
            if not isinstance(got, dict) or key not in got:
                return f"predict() returned no {key!r} (a dict with keys {', '.join(PREDICT_KEYS)})"
            expected = np.asarray(want[key])
            try:
                have = np.asarray(got[key], dtype=np.int64)
            except (TypeError, ValueError):
                return f"{key} is not a list of ints"
            if have.shape != expected.shape:
                return f"{key} has shape {tuple(have.shape)}, expected {tuple(expected.shape)}"
            wrong = int(np.sum(have != expected))
            return None if wrong == 0 else f"{wrong} of {expected.size} entries differ"

        return run

    run_cases([Case(f"{key} after step 5", case(key)) for key in PREDICT_KEYS])


# Hidden cases (kvcourse/grading/hidden.py): drawn per grading run, observed here in the learner's kernel,
# judged in the grader's process against the independent answers of key/L6_tpu_jax/answers.py.

# (max_num_seqs, pages_per_seq, num_pages, page_size) of the NumPy exercises' hidden cases: a few shapes,
# so that the stage's jit'd functions, which the tests hold them against, compile a few times only.
TABLE_SHAPES = ((2, 3, 8, 4), (3, 4, 12, 1), (4, 3, 12, 3), (3, 2, 8, 16), (5, 3, 16, 2))


def _draw_pages(rng, shape: tuple[int, int, int, int], clone: bool = False) -> dict:
    """Slots in use on scattered pages (an empty slot, a partly filled last page, a clone sharing a
    slot's full pages with a page of its own; with ``clone``, slot 1 is slot 0's), each with room to
    grow, and some pages left free. ``shape`` is one of ``TABLE_SHAPES``.

    Example, page_size 4: slot 0 holds 6 tokens on pages [5, 2], slot 1 is its clone on [5, 7]:
    refs of pages 5, 2, 7 are 2, 1, 1.
    """
    max_num_seqs, pages_per_seq, num_pages, page_size = shape
    order = rng.sample(range(num_pages), num_pages)  # pages taken in this order: scattered ids
    table, lens = [[INVALID] * pages_per_seq for _ in range(max_num_seqs)], [0] * max_num_seqs
    spare = rng.randint(2, max(2, num_pages // 2))  # free pages kept for the batches
    for s in range(max_num_seqs):
        kind = ["long", "clone"][s] if clone and s < 2 else rng.choice(["empty", "used", "used", "clone"])
        parents = [p for p in range(s) if lens[p] >= page_size]
        if kind == "clone" and parents:
            parent = rng.choice(parents)
            full = lens[parent] // page_size
            shared, own = table[parent][:full], cdiv(lens[parent], page_size) - full
            length = lens[parent]
        elif kind == "empty":
            continue
        else:
            length = rng.randint(page_size if kind == "long" else 1, pages_per_seq * page_size - 1)
            shared, own = [], cdiv(length, page_size)
        if own > len(order) - spare:
            continue
        table[s][: len(shared) + own] = shared + [order.pop() for _ in range(own)]
        lens[s] = length
    refs = [sum(row.count(page) for row in table) for page in range(num_pages)]
    return {"page_size": page_size, "refs": refs, "table": table, "lens": lens}


def draw_allocate(rng) -> list[dict]:
    """Tables from ``_draw_pages``, then 1 .. 3 batches in a row: decodes, chunks and prefills of
    several slots (a page boundary crossed or not, pages taken from a scattered free list, now and
    then the slots out of order or an empty batch), always with enough free pages."""
    cases = []
    for k in range(8):
        max_num_seqs, pages_per_seq, num_pages, page_size = shape = TABLE_SHAPES[k % len(TABLE_SHAPES)]
        case = _draw_pages(rng, shape, clone=k % 3 == 1)
        lens, free = list(case["lens"]), case["refs"].count(0)
        batches = []
        for _ in range(rng.randint(1, 3)):
            slots, pos = [], []
            chosen = rng.sample(
                range(max_num_seqs), rng.randint(0 if k == 0 and not batches else 1, max_num_seqs)
            )
            for s in chosen if rng.random() < 0.25 else sorted(chosen):  # the order of the slots
                room = pages_per_seq * page_size - lens[s]
                grow = min(room, rng.choice([1, 1, rng.randint(1, max(1, room))]))  # decode, chunk, prefill
                while grow > 0 and cdiv(lens[s] + grow, page_size) - cdiv(lens[s], page_size) > free:
                    grow -= 1
                if grow:
                    free -= cdiv(lens[s] + grow, page_size) - cdiv(lens[s], page_size)
                    slots += [s] * grow
                    pos += range(lens[s], lens[s] + grow)
                    lens[s] += grow
            batches.append({"slots": slots, "pos": pos})
        cases.append({**case, "batches": batches})
    return cases


def _ints(arrays, names: tuple[str, ...], dtypes: tuple) -> dict:
    """What a NumPy exercise returned, as plain lists in the stage's dtypes (as ``arrays_problem``
    compares them), by name, and the dtypes it returned them in (``"dtypes"``); a return value that is
    not one array per name raises TypeError."""
    if not isinstance(arrays, list | tuple) or len(arrays) != len(names):
        raise TypeError(f"returned {type(arrays).__name__}, expected {len(names)} arrays")
    values = {
        name: np.asarray(a).astype(dtype).tolist()
        for name, a, dtype in zip(names, arrays, dtypes, strict=True)
    }
    return {**values, "dtypes": [np.asarray(a).dtype.name for a in arrays]}


def _batch_words(slots: list[int], pos: list[int]) -> str:
    """``_batch_words([0, 2, 2, 2], [3, 0, 1, 2]) -> 'slot 0 at 3, slot 2 at 0..2'``."""
    runs = []
    for s, p in zip(slots, pos, strict=True):
        if runs and runs[-1][0] == s:
            runs[-1][2] = p
        else:
            runs.append([s, p, p])
    return ", ".join(f"slot {s} at {a}" + (f"..{b}" if b > a else "") for s, a, b in runs) or "no tokens"


def observe_allocate(fn, case) -> list[dict]:
    """Each batch in turn through ``fn``, which gets the tables ``fn`` itself returned for the batch
    before; after each, the four arrays it returned and whether it left its inputs alone."""
    names = ("page_ref_counts", "page_indices", "seq_lens", "new_token_dests")
    refs, table, lens = (np.asarray(case[key], np.int32) for key in ("refs", "table", "lens"))
    steps = []
    for batch in case["batches"]:
        slots, pos = np.asarray(batch["slots"], np.int32), np.asarray(batch["pos"], np.int32)
        inputs = (refs, table, lens, slots, pos)
        copies = [a.copy() for a in inputs]
        got = _ints(fn(*copies, case["page_size"]), names, (np.int32,) * 4)
        unchanged = all(np.array_equal(a, b) for a, b in zip(inputs, copies, strict=True))
        steps.append({"call": f"allocate({_batch_words(batch['slots'], batch['pos'])})", **got,
                      "inputs unchanged": unchanged})  # fmt: skip
        refs, table, lens = (np.asarray(got[name], np.int32) for name in names[:3])
    return steps


def describe_tables(case: dict) -> str:
    ps, rows = case["page_size"], case["table"]
    held = [f"slot {s}: {n} tokens on {rows[s][: cdiv(n, ps)]}" for s, n in enumerate(case["lens"]) if n]
    return f"page_size {ps}, {len(case['refs'])} pages, {', '.join(held) or 'no slot holds tokens'}"


def describe_allocate(case: dict) -> str:
    batches = "; ".join(_batch_words(b["slots"], b["pos"]) for b in case["batches"])
    return f"{describe_tables(case)}; batches: {batches}"


def draw_free_finished(rng) -> list[dict]:
    """Tables from ``_draw_pages`` (clones share pages), then 1 .. 3 steps in a row, each finishing
    some slots: none, all, one of the slots sharing a page (the page stays), a slot not in use."""
    cases = []
    for k in range(8):
        shape = TABLE_SHAPES[k % len(TABLE_SHAPES)]
        case = _draw_pages(rng, shape, clone=k % 2 == 1)
        case["used"] = [n > 0 or rng.random() < 0.2 for n in case["lens"]]  # used, no tokens yet
        sharing = [
            s for s, row in enumerate(case["table"]) if any(case["refs"][p] > 1 for p in row if p >= 0)
        ]
        steps = []
        for step in range(rng.randint(1, 3)):
            pick = rng.choice(["some", "some", "none", "all", "one sharing"])
            if sharing and (pick == "one sharing" or step == 0 and k % 2):  # its shared pages stay
                one = rng.choice(sharing)
                steps.append([s == one for s in range(shape[0])])
            else:
                steps.append(
                    [pick == "all" or pick == "some" and rng.random() < 0.5 for _ in range(shape[0])]
                )
        cases.append({**case, "finished": steps})
    return cases


def observe_free_finished(fn, case) -> list[dict]:
    """Each finished mask in turn through ``fn``, which gets the tables it returned the step before;
    after each, the four arrays it returned and whether it left its inputs alone."""
    names = ("page_ref_counts", "page_indices", "seq_lens", "used_mask")
    arrays = [np.asarray(case[key], np.int32) for key in ("refs", "table", "lens")]
    arrays.append(np.asarray(case["used"], bool))
    steps = []
    for mask in case["finished"]:
        inputs = (*arrays, np.asarray(mask, bool))
        copies = [a.copy() for a in inputs]
        got = _ints(fn(*copies), names, (np.int32, np.int32, np.int32, bool))
        unchanged = all(np.array_equal(a, b) for a, b in zip(inputs, copies, strict=True))
        finished = [s for s, f in enumerate(mask) if f]
        steps.append(
            {"call": f"free_finished(slots {finished} finished)", **got, "inputs unchanged": unchanged}
        )
        arrays = [
            np.asarray(got[name], dtype) for name, dtype in zip(names, (np.int32,) * 3 + (bool,), strict=True)
        ]
    return steps


def describe_free_finished(case: dict) -> str:
    finished = "; ".join(str([s for s, f in enumerate(mask) if f]) for mask in case["finished"])
    return f"{describe_tables(case)}, used {case['used']}; finished in turn: {finished}"


# (num_pages, page_size, H_kv, D) of the KV write's hidden cases: page sizes 1, 3 (odd), 4 and 16.
POOL_SHAPES = ((6, 4, 2, 3), (5, 1, 3, 2), (3, 16, 1, 4), (7, 3, 2, 2))


def draw_write_kv_pages(rng) -> list[dict]:
    """Batches of one shape per case, 1 to 3 of them through one jit: distinct rows in any order
    (the pool's first and last rows too), padding (-1) anywhere among them, no padding, all padding."""
    cases = []
    for k in range(6):
        shape = POOL_SHAPES[k % len(POOL_SHAPES)]
        rows = shape[0] * shape[1]
        width = rng.choice([1, 3, 4, 8, 16])
        batches = []
        for _ in range(rng.randint(1, 3)):
            real = rng.choice([width, rng.randint(0, width), 0 if k == 2 else width])
            real = min(real, rows)
            ends = [0, rows - 1] if real >= 2 and rng.random() < 0.5 else []
            dests = ends + rng.sample([r for r in range(rows) if r not in ends], real - len(ends))
            dests += [INVALID] * (width - real)
            rng.shuffle(dests)
            batches.append(dests)
        cases.append({"seed": rng.randint(0, 2**31 - 1), "shape": list(shape), "batches": batches})
    return cases


def observe_write_kv_pages(fn, case) -> list[dict]:
    """Every batch of a case through one jit of ``fn`` behind a trace counter (as the visible check
    does), each on a fresh seeded pool; after each, the pool's shape, the rows that changed and the
    values of the first two, a digest of the whole pool (float32), the traces so far, and the jit
    error's type if it refused."""
    jitted, traces = counted_jit(fn)
    n_pages, ps, n_kv, dim = case["shape"]
    rng = np.random.default_rng(case["seed"])
    steps = []
    for b, dests in enumerate(case["batches"]):
        pool = rng.standard_normal((n_pages, ps, 2 * n_kv, dim)).astype(np.float32)  # old K/V everywhere
        k = rng.standard_normal((len(dests), n_kv, dim)).astype(np.float32)  # (T, H_kv, D)
        v = rng.standard_normal((len(dests), n_kv, dim)).astype(np.float32)  # (T, H_kv, D)
        step = {"call": f"batch {b + 1}: dests {dests}", "raised": None, "shape": None, "changed rows": None,
                "first rows": None, "pool": None}  # fmt: skip
        try:
            got = np.asarray(
                jitted(jnp.asarray(pool), jnp.asarray(dests, jnp.int32), jnp.asarray(k), jnp.asarray(v))
            )
        except TRACER_ERRORS as e:
            steps.append({**step, "raised": type(e).__name__, "traces": traces["write"]})
            break
        step["shape"] = list(got.shape)
        if got.shape == pool.shape:
            got = got.astype(np.float32)
            flat_old, flat_new = pool.reshape(n_pages * ps, -1), got.reshape(n_pages * ps, -1)
            step["changed rows"] = np.flatnonzero(np.any(flat_old != flat_new, axis=1)).tolist()
            step["first rows"] = flat_new[step["changed rows"][:2]].tolist()  # their K/V, for the report
            step["pool"] = hashlib.sha256(got.tobytes()).hexdigest()[:16]
        steps.append({**step, "traces": traces["write"]})
    return steps


def describe_write_kv_pages(case: dict) -> str:
    n_pages, ps, n_kv, dim = case["shape"]
    return f"{n_pages} pages of {ps} rows, H_kv {n_kv}, D {dim}, batches of dests {case['batches']}"


def draw_mesh(rng) -> list[dict]:
    """Meshes of 1, 2 and 4 devices (the notebook's), 3, 8 and 16 too, and pools, tables and models of
    several shapes (vocabularies up to 49152, Qwen3's q/k norms, biases): shapes only, no arrays."""
    devices = [1, 2, 4, *rng.sample([2, 3, 4, 8, 16], 3)]
    rng.shuffle(devices)
    cases = []
    for d in devices:
        n_heads = rng.choice([1, 2, 4, 9])
        n_kv = rng.choice([h for h in (1, 2, 3, 4) if n_heads % h == 0])
        model = {
            "vocab": rng.choice([97, 128, 49152]), "hidden": rng.choice([8, 24, 64, 576]), "heads": n_heads,
            "kv_heads": n_kv, "head_dim": rng.choice([2, 4, 16, 64]), "inter": rng.choice([16, 48, 1536]),
            "layers": rng.randint(1, 3), "max_positions": rng.choice([64, 2048]),
            "qk_norm": rng.random() < 0.5, "bias": rng.random() < 0.3,
        }  # fmt: skip
        page_size = rng.choice([1, 4, 16])
        cases.append(
            {"devices": d, "num_pages": d * rng.randint(1, 8), "max_num_seqs": d * rng.randint(1, 4),
             "page_size": page_size, "max_model_len": page_size * rng.randint(1, 6), "model": model}
        )  # fmt: skip
    return cases


def _model_shapes(m: dict):
    """The engine's ``Params`` pytree for a model of these sizes, as shapes (``jax.ShapeDtypeStruct``)."""
    from kvcourse.jax_model import LayerParams, Params

    def shape(*dims):
        return jax.ShapeDtypeStruct(dims, jnp.float32)

    q, kv, h, inter = m["heads"] * m["head_dim"], m["kv_heads"] * m["head_dim"], m["hidden"], m["inter"]
    norm = shape(m["head_dim"]) if m["qk_norm"] else None
    layer = LayerParams(
        input_norm=shape(h), q_proj=shape(h, q), k_proj=shape(h, kv), v_proj=shape(h, kv),
        o_proj=shape(q, h), post_norm=shape(h), gate_proj=shape(h, inter), up_proj=shape(h, inter),
        down_proj=shape(inter, h), q_norm=norm, k_norm=norm, q_bias=shape(q) if m["bias"] else None,
        k_bias=shape(kv) if m["bias"] else None, v_bias=shape(kv) if m["bias"] else None, o_bias=None,
    )  # fmt: skip
    rope = shape(m["max_positions"], m["head_dim"])
    return Params(
        embed=shape(m["vocab"], h), layers=(layer,) * m["layers"], final_norm=shape(h),
        lm_head=shape(h, m["vocab"]), rope_cos=rope, rope_sin=rope,
    )  # fmt: skip


def _held(mesh, spec, tree) -> str | list:
    """What one device of ``mesh`` holds of ``tree`` laid out as ``NamedSharding(mesh, spec)`` (as
    ``MeshEngine`` lays out its inputs): ``"whole"`` when it holds every leaf whole, else the leaves it
    holds a piece of, as ``"path: piece of shape"`` (at most 3)."""
    sharding = NamedSharding(mesh, spec)
    pieces = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        piece = tuple(sharding.shard_shape(leaf.shape))
        if piece != tuple(leaf.shape):
            pieces.append(f"{jax.tree_util.keystr(path)}: {piece} of {tuple(leaf.shape)}")
    return pieces[:3] or "whole"


def observe_mesh(fn, case) -> list[dict]:
    """The learner's specs on an abstract mesh of ``case["devices"]`` devices (no devices needed):
    what one device holds of the params, of the decode state and of one layer's KV pool."""
    from L6_tpu_jax.decode_state import DecodeState
    from L6_tpu_jax.mesh.multihost import DATA

    specs = fn()
    if not isinstance(specs, dict) or set(specs) != {"params", "decode_state", "kv_pages"}:
        raise TypeError(
            f"returned {type(specs).__name__}, expected a dict with keys params, decode_state, kv_pages"
        )
    d, m, ps = case["devices"], case["model"], case["page_size"]
    mesh = AbstractMesh((d,), (DATA,))
    pages_per_seq = cdiv(case["max_model_len"], ps)
    state = jax.eval_shape(
        lambda: DecodeState.init(
            case["max_num_seqs"], pages_per_seq, case["num_pages"], ps, case["max_model_len"], [2]
        )
    )
    pool = jax.ShapeDtypeStruct((case["num_pages"], ps, 2 * m["kv_heads"], m["head_dim"]), jnp.float32)
    inputs = {"params": _model_shapes(m), "decode_state": state, "kv_pages": pool}
    steps = []
    for name, tree in inputs.items():
        step = {"call": f"{name} over {d} devices", "raised": None, "held": None}
        try:
            if name == "kv_pages":  # the piece of the pool each device holds, by its shape
                step["held"] = list(NamedSharding(mesh, specs[name]).shard_shape(pool.shape))
            else:
                step["held"] = _held(mesh, specs[name], tree)
        except Exception as e:  # noqa: BLE001 - a spec JAX refuses for these shapes: named, not a crash
            step["raised"] = type(e).__name__
        steps.append(step)
    return steps


def describe_mesh(case: dict) -> str:
    m = case["model"]
    return (
        f"{case['devices']} devices, {case['num_pages']} pages of {case['page_size']}, "
        f"{case['max_num_seqs']} slots, a {m['layers']}-layer model (vocab {m['vocab']}, hidden {m['hidden']}, "
        f"{m['heads']} heads, {m['kv_heads']} KV heads of {m['head_dim']})"
    )


def draw_cow(rng) -> list[dict]:
    """Tables of parents and their lazy clones (a clone holds its parent's whole row, the partial last
    page too, every page's refcount raised), other slots alone or empty; then 1 or 2 batches in a row,
    each appending 1 to 5 tokens to some slots (decodes and chunks). Cases 4 and 8 have a tight pool
    (no free page, or one) and one batch of page_size tokens per slot: case 4's always needs a page it
    cannot have, case 8's often (the answer raises). Case 9 has twins: a slot and its clone both write
    their shared partial page in one batch, with one free page, which is all they need."""
    cases = []
    for k in range(8):
        page_size = rng.choice([1, 2, 3, 4, 4])  # a partial page to share, mostly
        n_seqs, per_seq = rng.randint(2, 5), rng.randint(2, 4)
        n_pages = rng.randint(n_seqs + 2, 3 * n_seqs + 3)
        order = rng.sample(range(n_pages), n_pages)
        table, lens = [[INVALID] * per_seq for _ in range(n_seqs)], [0] * n_seqs
        for s in range(n_seqs):
            parents = [p for p in range(s) if lens[p] > 0]
            kind = rng.choice(["alone", "clone", "clone", "empty"]) if s else "alone"
            if kind == "clone" and parents:
                parent = rng.choice(parents)
                table[s], lens[s] = list(table[parent]), lens[parent]
            elif kind == "alone" and len(order) > per_seq:
                lens[s] = rng.randint(1, (per_seq - 1) * page_size)
                table[s][: cdiv(lens[s], page_size)] = [order.pop() for _ in range(cdiv(lens[s], page_size))]
        if k % 4 == 3:  # a tight pool: the pages in use, renumbered, and no free page (k = 3) or one
            used = sorted({page for row in table for page in row if page >= 0})
            n_pages = len(used) + k // 7
            ids = dict(zip(used, rng.sample(range(n_pages), len(used)), strict=True))
            table = [[ids.get(page, INVALID) for page in row] for row in table]
        refs = [sum(row.count(page) for row in table) for page in range(n_pages)]
        batches, grown, spare = [], list(lens), refs.count(0)
        for _ in range(1 if k % 4 == 3 else rng.randint(1, 2)):
            slots, pos = [], []
            chosen = (
                range(n_seqs) if k % 4 == 3 else sorted(rng.sample(range(n_seqs), rng.randint(1, n_seqs)))
            )
            for s in chosen:
                grow = min(rng.choice([1, 1, rng.randint(1, 5)]), per_seq * page_size - grown[s])
                if k % 4 == 3:  # slot 0 holds no more than pages_per_seq - 1 pages: it takes a new one
                    grow = min(page_size, per_seq * page_size - grown[s])
                if k % 4 != 3:  # enough pages for sure: a slot takes at most ceil(grow / page_size) + 1
                    while grow and cdiv(grow, page_size) + 2 > spare:
                        grow -= 1
                    spare -= cdiv(grow, page_size) + 2 if grow else 0
                slots += [s] * grow
                pos += range(grown[s], grown[s] + grow)
            batches.append({"slots": slots, "pos": pos})
            for s, p in zip(slots, pos, strict=True):
                grown[s] = max(grown[s], p + 1)
        cases.append({"page_size": page_size, "refs": refs, "table": table, "lens": lens, "batches": batches})
    cases.append(draw_twins(rng))
    return cases


def draw_twins(rng) -> dict:
    """A slot and its lazy clone on the same pages, the last one partial, both writing their next
    token; every other page of the pool in use, but one. Example (page_size 4, 6 tokens on pages
    [3, 5], pool of 7): refs [1, 1, 1, 2, 1, 2, 0], one batch: slot 0 and slot 1 at position 6."""
    page_size = rng.randint(2, 4)
    length = rng.randint(1, 3) * page_size + rng.randint(1, page_size - 1)  # ends inside a page
    n_pages = cdiv(length, page_size) + rng.randint(1, 4)
    ids = rng.sample(range(n_pages), n_pages)
    row = ids[: cdiv(length, page_size)]
    per_seq = len(row) + 1
    table = [row + [INVALID] * (per_seq - len(row))] * 2
    refs = [2 if page in row else 1 for page in range(n_pages)]
    refs[ids[-1]] = 0  # the one free page
    batch = {"slots": [0, 1], "pos": [length, length]}
    return {
        "page_size": page_size,
        "refs": refs,
        "table": table,
        "lens": [length, length],
        "batches": [batch],
    }


def observe_cow(fn, case) -> list[dict]:
    """Each batch in turn through ``fn``, which gets the tables it returned for the batch before; after
    each, what it returned (or that it raised ValueError), the dtypes, and whether it left its inputs
    alone."""
    refs, table, lens = (np.asarray(case[key], np.int32) for key in ("refs", "table", "lens"))
    steps = []
    for batch in case["batches"]:
        slots, pos = np.asarray(batch["slots"], np.int32), np.asarray(batch["pos"], np.int32)
        inputs = (refs, table, lens, slots, pos)
        copies = [a.copy() for a in inputs]
        step = {"call": f"allocate_cow({_batch_words(batch['slots'], batch['pos'])})", "raised": None}
        try:
            got = fn(*copies, case["page_size"])
        except ValueError:
            got = None
            step["raised"] = "ValueError"
        step["inputs unchanged"] = all(np.array_equal(a, b) for a, b in zip(inputs, copies, strict=True))
        if got is not None:
            if not isinstance(got, list | tuple) or len(got) != 5:
                raise TypeError(f"returned {type(got).__name__}, expected 4 arrays and a list of copies")
            step.update(_ints(got[:4], COW_NAMES, (np.int32,) * 4))
            step["copies"] = [[int(x) for x in pair] for pair in got[4]]
            refs, table, lens = (np.asarray(step[name], np.int32) for name in COW_NAMES[:3])
        steps.append(step)
    return steps


def describe_cow(case: dict) -> str:
    batches = "; ".join(_batch_words(b["slots"], b["pos"]) for b in case["batches"])
    return f"{describe_tables(case)}, refcounts {case['refs']}; batches: {batches}"


def draw_compact(rng) -> list[dict]:
    """Tables of 1 to 5 slots over 3 to 12 pages, clones sharing pages, pages in use anywhere (none,
    all, already compact, scattered); now and then a refcount one off its number of holders."""
    cases = []
    for k in range(8):
        n_pages, n_seqs, per_seq = rng.randint(3, 12), rng.randint(1, 5), rng.randint(1, 4)
        pool = rng.sample(range(n_pages), rng.randint(0, n_pages)) if k != 1 else list(range(n_pages))
        table = []
        for s in range(n_seqs):
            if s and table[-1][0] >= 0 and rng.random() < 0.4:  # a clone: shares its neighbour's first pages
                row = table[-1][: rng.randint(1, per_seq)]
            else:
                row = [pool.pop() for _ in range(min(len(pool), rng.randint(0, per_seq)))]
            table.append(row + [INVALID] * (per_seq - len(row)))
        refs = [sum(row.count(page) for row in table) for page in range(n_pages)]
        if k % 4 == 3:
            page = rng.randrange(n_pages)
            refs[page] += rng.choice([-1, 1]) if refs[page] else 1
        cases.append({"refs": refs, "table": table})
    return cases


def observe_compact(fn, case) -> dict:
    """What ``fn`` returned on one table: the refcounts and table, the moves (sorted: any safe order is
    right), which old page each slot's pages hold after the moves are run in ``fn``'s order on a pool
    whose page p holds "p", the dtypes, and the exception's type if it raised ValueError."""
    refs, table = np.asarray(case["refs"], np.int32), np.asarray(case["table"], np.int32)
    copies = [refs.copy(), table.copy()]
    try:
        got = fn(*copies)
    except ValueError:
        return {"raised": "ValueError", "inputs unchanged": True}
    if not isinstance(got, list | tuple) or len(got) != 3:
        raise TypeError(f"returned {type(got).__name__}, expected 2 arrays and a list of moves")
    moves = [[int(x) for x in move] for move in got[2]]
    pool = list(range(len(refs)))
    for src, dst in moves:
        pool[dst] = pool[src]
    new_table = np.asarray(got[1]).astype(np.int32)
    return {
        "raised": None,
        **_ints(got[:2], ("page_ref_counts", "page_indices"), (np.int32, np.int32)),
        "moves": sorted(moves),
        "pages hold after the moves": [
            [pool[p] if 0 <= p < len(pool) else None for p in row] for row in new_table.tolist()
        ],
        "inputs unchanged": bool(np.array_equal(copies[0], refs) and np.array_equal(copies[1], table)),
    }


def describe_compact(case: dict) -> str:
    return f"refcounts {case['refs']}, page_indices {case['table']}"


HIDDEN = {
    "L6.1": Hidden(
        draw_allocate,
        observe_allocate,
        describe_allocate,
        answers=("L6_tpu_jax.page_table:allocate_for_seq",),
    ),
    "L6.2": Hidden(
        draw_free_finished,
        observe_free_finished,
        describe_free_finished,
        answers=("L6_tpu_jax.page_table:free_pages_for_finished",),
    ),
    "L6.3": Hidden(
        draw_write_kv_pages,
        observe_write_kv_pages,
        describe_write_kv_pages,
        answers=("L6_tpu_jax.kv_cache:update_kv",),
    ),
    "L6.4": Hidden(draw_mesh, observe_mesh, describe_mesh, answers=("L6_tpu_jax.mesh.engine:SPECS",)),
    "L6.5": Hidden(draw_cow, observe_cow, describe_cow, answers=(ALLOCATE,)),
    "L6.6": Hidden(draw_compact, observe_compact, describe_compact),
    "L6.7": replace(catch_hidden(ALLOCATE, CATCH_ALL, watch=(ALLOCATE,)), observe=observe_catch),
    "L6.8": Hidden(
        draw=lambda rng: [{}],
        observe=lambda fn, case: fn(),
        describe=lambda case: "the five steps of the notebook",
        answers=(
            ALLOCATE,
            "L6_tpu_jax.page_table:clone_pages_from",
            "L6_tpu_jax.page_table:free_pages_for_finished",
        ),
        explain=unrevealed,  # the report says which arrays are wrong, never their right values
    ),
}
