"""The L6 notebook's exercise checkers: the learner's page bookkeeping and KV write against this stage's JAX code.

- ``check_allocate``: pages for a batch of new tokens and their KV destinations, against
  ``allocate_for_seq`` (``page_table.py``);
- ``check_free_finished``: giving back the pages of finished sequences, against
  ``free_pages_for_finished`` (``page_table.py``);
- ``check_write_kv_pages``: the vectorized KV write into the page pool, run under ``jax.jit``, against
  ``update_kv`` (``kv_cache.py``);
- ``check_mesh_specs``: the ``PartitionSpec``s of the engine's inputs over a ``data`` mesh, by sharded
  runs against the engine on one device (``engine.py``, ``SPECS``).

For the first two the learner writes plain NumPy on small arrays; each case builds a real
``SequenceTable`` and ``PageTable`` holding the same arrays, runs the stage's function on them, and
compares the arrays that come back, name by name (``arrays_problem``). The stage's functions run
under ``jax.jit``: one compile per case's shapes, ~4x faster here than dispatching each op eagerly.
The third is JAX: the checker jits the learner's function behind a Python-side trace counter (as
``Engine`` counts its compiles in ``Engine.traces``), feeds it fixed-shape batches whose padding tokens
have destination -1, compares the pool with ``update_kv``'s, and fails a case that needs more than one
trace for one shape. A Python branch on a traced value (``if dests[t] >= 0``) cannot run under jit at
all: its ``ConcretizationTypeError`` (or another tracer error) is reported as that case's ``WRONG``
line. The fourth runs the whole engine over a simulated mesh with the learner's ``PartitionSpec``s.

The grading contract (see ``kvcourse/grading.py``): each checker runs fixed cases and prints one
deterministic line per case (``ok``, ``WRONG — what differs``, or ``raised`` and the exception), then
``k/n passed``. The reference notebook stores those lines as the check cell's output and ``make grade``
compares them. The references are the stage's own code, never a copy kept here.

Left out on purpose: the all-or-nothing path when the pool is short (every allocation case has enough
free pages), padding tokens (slot -1) in the NumPy exercises, jit for the NumPy exercises (they run
eagerly), and duplicate destinations in the KV write (two tokens never share a row).
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np

from kvcourse.grading import Case, arrays_problem, run_cases

from .kv_cache import update_kv
from .page_table import INVALID, PageTable, SequenceTable, allocate_for_seq, free_pages_for_finished

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


def check_allocate(allocate: Callable) -> None:
    """Grade ``allocate(page_ref_counts, page_indices, seq_lens, slot_ids, positions, page_size)
    -> (page_ref_counts, page_indices, seq_lens, new_token_dests)`` against ``allocate_for_seq``.

    NumPy in, arrays out (NumPy or jax.numpy), inputs left unchanged. ``slot_ids``/``positions`` (T,)
    are each new token's slot and absolute position (one slot's tokens contiguous, ascending). Each
    slot grows to its largest position + 1 and gets new pages up to ceil(length / page_size), the
    lowest free page ids first, in slot order; ``new_token_dests[t] = page * page_size + pos % page_size``.
    Every case has enough free pages.
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
            return arrays_problem(
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
    -> (page_ref_counts, page_indices, seq_lens, used_mask)`` against ``free_pages_for_finished``.

    Each finished slot gives one refcount back per page it holds (a page shared with a live clone
    stays in use), its row becomes all -1, its length 0 and its used flag False; other slots keep
    everything. NumPy in, arrays out, inputs left unchanged.
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
            return arrays_problem(("page_ref_counts", "page_indices", "seq_lens", "used_mask"), expected, got)

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


MESH_DEVICES = 4  # CPU devices the notebook asks XLA for, before JAX starts (its first cell)


def check_mesh_specs(mesh_specs: Callable) -> None:
    """Grade ``mesh_specs() -> {"params": P, "decode_state": P, "kv_pages": P}`` with sharded runs.

    Each case builds the engine over a ``data`` mesh of 2 or 4 simulated CPU devices with the learner's
    ``PartitionSpec``s, runs a tiny seeded Llama on a few prompts, and compares the tokens with the
    single-device engine (``Engine`` without a mesh). The engine's per-device program indexes its own
    slice of the pool with page ids local to it, so a pool that is copied whole (``P()``) or split along
    another axis gives wrong tokens or an error, and a state split over devices cannot be built.
    A case also fails if a device holds more than its share of the pages.

    Example: ``{"params": P(), "decode_state": P(), "kv_pages": P()}`` -> on 2 devices each holds the
    whole pool: "each device holds 16 of 16 pages per layer (its share is 8)".
    """
    from kvcourse.tiny import make_tiny_checkpoint

    from .engine import Engine
    from .multihost import data_mesh

    if len(jax.devices()) < MESH_DEVICES:
        raise RuntimeError(
            f"this check needs {MESH_DEVICES} CPU devices and JAX started with {len(jax.devices())}: restart "
            "the kernel and run the first cell first (it sets XLA_FLAGS before JAX starts)"
        )
    import tempfile

    tiny = make_tiny_checkpoint("llama", tempfile.mkdtemp(prefix="kvcourse-mesh-check-"))
    prompts = [[5 + i + 3 * j for j in range(4 + 12 * i)] for i in range(3)]  # 4, 16 and 28 tokens
    budgets = [6, 9, 5]

    @functools.cache
    def one_device() -> list[list[list[int]]]:
        """The engine on one device, 2 greedy clones of each prompt (clone 0 is the n=1 answer)."""
        return Engine(tiny, max_seqs=8, max_model_len=48, num_pages=16).generate_samples(
            prompts, budgets, n=2
        )

    def case(devices: int, n: int) -> Callable[[], str | None]:
        def run() -> str | None:
            specs = mesh_specs()
            if not isinstance(specs, dict) or set(specs) != {"params", "decode_state", "kv_pages"}:
                return f"returned {specs!r}, expected a dict with keys params, decode_state, kv_pages"
            options = dict(max_seqs=8, max_model_len=48, num_pages=8 * devices)
            engine = Engine(tiny, **options, mesh=data_mesh(jax.devices()[:devices]), specs=specs)
            held = engine.kv_pages[0].addressable_shards[0].data.shape[0]
            share = engine.num_pages // devices
            if held != share:
                return (
                    f"each device holds {held} of {engine.num_pages} pages per layer (its share is {share})"
                )
            got = engine.generate_samples(prompts, budgets, n=n)
            expected = [clones[:n] for clones in one_device()]
            wrong = [i for i, (a, b) in enumerate(zip(expected, got, strict=True)) if a != b]
            if wrong:
                return f"prompts {wrong} differ from one device, first: {got[wrong[0]]} instead of {expected[wrong[0]]}"
            return None

        return run

    run_cases(
        [
            Case("2 devices, 3 prompts of 4 to 28 tokens: the tokens of one device", case(2, 1)),
            Case("4 devices, 2 clones of each prompt sharing their full pages", case(4, 2)),
        ]
    )
