"""The L6 notebook's exercise checkers: the learner's NumPy page bookkeeping against this stage's JAX code.

- ``check_allocate``: pages for a batch of new tokens and their KV destinations, against
  ``allocate_for_seq`` (``page_table.py``);
- ``check_free_finished``: giving back the pages of finished sequences, against
  ``free_pages_for_finished`` (``page_table.py``).

The learner writes plain NumPy on small arrays; each case builds a real ``SequenceTable`` and
``PageTable`` holding the same arrays, runs the stage's function on them, and compares the arrays
that come back, name by name (``arrays_problem``).

The grading contract (see ``kvcourse/grading.py``): each checker runs fixed cases and prints one
deterministic line per case (``ok``, ``WRONG — what differs``, or ``raised`` and the exception), then
``k/n passed``. The reference notebook stores those lines as the check cell's output and ``make grade``
compares them. The references are the stage's own code, never a copy kept here.

Left out on purpose: the all-or-nothing path when the pool is short (every case has enough free pages),
padding tokens (slot -1), and jit: the learner's function runs eagerly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import jax.numpy as jnp
import numpy as np

from kvcourse.grading import Case, arrays_problem, run_cases

from .page_table import PageTable, SequenceTable, allocate_for_seq, free_pages_for_finished


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
            seqs, pages, info = allocate_for_seq(seqs, pages, slots_a, pos_a)
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
            seqs, pages = free_pages_for_finished(seqs, pages, arrays[4])
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
