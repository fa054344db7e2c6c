"""L6 device state: allocation, freeing, clones, the token queue, invariants and reset (unit + property)."""

from __future__ import annotations

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from L6_tpu_jax import decode_state as ds
from L6_tpu_jax.page_table import (
    PageTable,
    SequenceTable,
    allocate_for_seq,
    clone_pages_from,
    free_pages_for_finished,
    reserve_slots,
)

allocate = jax.jit(allocate_for_seq)
free = jax.jit(free_pages_for_finished)
clone = jax.jit(clone_pages_from)


def tables(refs, rows, lens, page_size=4):
    """A SequenceTable/PageTable pair from plain lists (every listed row is a used slot)."""
    seqs = SequenceTable(
        seq_lens=jnp.array(lens, jnp.int32),
        page_indices=jnp.array(rows, jnp.int32),
        used_mask=jnp.ones(len(lens), bool),
        clone_sources=jnp.full(len(lens), -1, jnp.int32),
        page_size=page_size,
    )
    return seqs, PageTable(jnp.array(refs, jnp.int32))


def as_state(seqs, pages, max_seqs=None):
    """Wrap tables in an otherwise empty DecodeState so check_invariants can read them."""
    n = seqs.max_seqs
    state = ds.DecodeState.init(n, seqs.pages_per_seq, pages.num_pages, seqs.page_size, 4, [2])
    return jax.device_get(replace(state, sequences=seqs, page_table=pages))


def test_allocate_for_seq_docstring_example():
    seqs, pages = tables([1, 0, 1, 0, 0, 0], [[0, -1, -1], [2, -1, -1]], [3, 4])
    seqs, pages, info = allocate(seqs, pages, jnp.array([0, 1]), jnp.array([3, 4]))
    assert seqs.page_indices.tolist() == [[0, -1, -1], [2, 1, -1]]
    assert seqs.seq_lens.tolist() == [4, 5]
    assert pages.page_ref_counts.tolist() == [1, 1, 1, 0, 0, 0]
    assert info.new_token_dests.tolist() == [3, 4]
    assert info.slot_ids.tolist() == [0, 1] and info.cu_q_lens.tolist() == [0, 1, 2]
    assert info.seq_lens.tolist() == [4, 5] and int(info.num_seqs) == 2
    assert (int(info.pages_needed), int(info.pages_free)) == (1, 4) and not info.out_of_pages
    ds.check_invariants(as_state(seqs, pages))


def test_allocate_prefill_with_padding_and_ragged_sequences():
    seqs, pages = tables([0] * 6, [[-1] * 3] * 3, [0, 0, 0])
    # slot 2: 5 prompt tokens, slot 0: 2 prompt tokens, then 1 padding token
    slots = jnp.array([2, 2, 2, 2, 2, 0, 0, -1])
    pos = jnp.array([0, 1, 2, 3, 4, 0, 1, 0])
    seqs, pages, info = allocate(seqs, pages, slots, pos)
    assert seqs.page_indices.tolist() == [[0, -1, -1], [-1, -1, -1], [1, 2, -1]]  # slot order: 0 first
    assert info.slot_ids.tolist() == [2, 0, -1] and info.cu_q_lens.tolist() == [0, 5, 7, 7]
    assert info.new_token_dests.tolist() == [4, 5, 6, 7, 8, 0, 1, -1]
    assert info.page_indices.tolist() == [[1, 2, -1], [0, -1, -1], [-1, -1, -1]]  # batch order


def test_out_of_pages_is_flagged_and_changes_nothing():
    seqs, pages = tables([1, 1, 0], [[0, -1, -1], [1, -1, -1]], [4, 4])
    new_seqs, new_pages, info = allocate(seqs, pages, jnp.array([0, 1]), jnp.array([4, 4]))
    assert bool(info.out_of_pages) and (int(info.pages_needed), int(info.pages_free)) == (2, 1)
    assert (info.new_token_dests == -1).all()
    assert new_seqs.page_indices.tolist() == seqs.page_indices.tolist()
    assert new_seqs.seq_lens.tolist() == [4, 4] and new_pages.page_ref_counts.tolist() == [1, 1, 0]


def test_free_and_clone_docstring_examples():
    seqs, pages = tables([0, 0, 0, 1, 0, 1, 0, 0, 0], [[3, 5], [-1, -1]], [6, 0])
    seqs = replace(seqs, used_mask=jnp.array([True, False]))
    seqs, pages, src, dst, ok = clone(seqs, pages, jnp.int32(0), jnp.int32(1))
    assert bool(ok) and (int(src), int(dst)) == (5, 0)  # argmin: the lowest free page
    assert seqs.page_indices.tolist() == [[3, 5], [3, 0]] and seqs.clone_sources.tolist() == [-1, 0]
    assert pages.page_ref_counts.tolist() == [1, 0, 0, 2, 0, 1, 0, 0, 0]
    ds.check_invariants(as_state(seqs, pages))
    seqs, pages = free(seqs, pages, jnp.array([True, False]))
    assert pages.page_ref_counts.tolist() == [1, 0, 0, 1, 0, 0, 0, 0, 0]
    assert seqs.page_indices.tolist() == [[-1, -1], [3, 0]] and not bool(seqs.used_mask[0])
    ds.check_invariants(as_state(seqs, pages))


def test_clone_of_whole_pages_copies_nothing_and_out_of_pages_changes_nothing():
    seqs, pages = tables([1, 1, 0], [[0, 1], [-1, -1]], [8, 0])
    seqs = replace(seqs, used_mask=jnp.array([True, False]))
    s2, p2, src, dst, ok = clone(seqs, pages, jnp.int32(0), jnp.int32(1))
    assert bool(ok) and (int(src), int(dst)) == (-1, -1) and s2.page_indices.tolist() == [[0, 1], [0, 1]]
    seqs, pages = tables([1, 1], [[0, 1], [-1, -1]], [6, 0])
    s3, p3, _, _, ok = clone(seqs, pages, jnp.int32(0), jnp.int32(1))
    assert not bool(ok) and p3.page_ref_counts.tolist() == [1, 1] and s3.page_indices.tolist()[1] == [-1, -1]


def test_token_queue_enqueue_and_pack_by_slot():
    q = ds.enqueue(
        ds.TokenQueue.init(4),
        jnp.array([7, 8, 9]),
        jnp.array([3, 0, 2]),
        jnp.array([5, 6, 7]),
        jnp.array([True, True, True]),
    )
    q, tokens, slots, pos = ds.pack_next(q, 2)
    assert slots.tolist() == [0, 3] and tokens.tolist() == [8, 7] and pos.tolist() == [6, 5]
    assert int(q.num_queued) == 1 and q.slot_ids.tolist() == [2, -1, -1, -1] and q.tokens[0] == 9
    q = ds.enqueue(q, jnp.array([4, 5]), jnp.array([0, 1]), jnp.array([1, 2]), jnp.array([False, True]))
    assert q.slot_ids.tolist()[:2] == [2, 1] and int(q.num_queued) == 2


def test_check_invariants_catches_leaks_and_shared_partial_pages():
    seqs, pages = tables([1, 2, 0], [[0, -1], [1, -1]], [4, 4])  # page 1 counted twice, one owner
    with pytest.raises(AssertionError, match="page 1: refcount 2 but 1 owners"):
        ds.check_invariants(as_state(seqs, pages))
    seqs, pages = tables([2, 0, 0], [[0, -1], [0, -1]], [3, 3])  # a partial page shared
    with pytest.raises(AssertionError, match="page 0 is shared but not full"):
        ds.check_invariants(as_state(seqs, pages))
    seqs, pages = tables([1, 0, 0], [[0, -1], [-1, -1]], [4, 0])  # consistent, but not a reset state
    seqs = replace(seqs, used_mask=jnp.array([True, False]))
    ds.check_invariants(as_state(seqs, pages))
    with pytest.raises(AssertionError, match=r"used slots after reset: \[0\]"):
        ds.check_invariants(as_state(seqs, pages), after_reset=True)


def test_reset_logical_returns_to_baseline():
    state = ds.DecodeState.init(3, 2, 5, 4, 4, [2])
    seqs, pages, info = allocate(
        reserve_slots(state.sequences, jnp.array([True, False, True])),
        state.page_table,
        jnp.array([0, 2, 2]),
        jnp.array([0, 0, 1]),
    )
    state = replace(state, sequences=seqs, page_table=pages)
    state = ds.update_tokens(
        ds.admit(state, jnp.zeros(3, bool), jnp.zeros(3, jnp.int32), jnp.zeros(3, bool)),
        info,
        jnp.array([5, 2, 0]),
    )
    assert ds.stats(jax.device_get(state)) == {
        "active_slots": 2,
        "pages_in_use": 2,
        "free_pages": 3,
        "max_refcount": 1,
    }
    with pytest.raises(AssertionError):
        ds.check_invariants(jax.device_get(state), after_reset=True)
    ds.check_invariants(jax.device_get(ds.reset_logical(state)), after_reset=True)


@settings(max_examples=25, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["grow", "clone", "free"]), st.integers(0, 3), st.integers(1, 7)),
        max_size=12,
    )
)
def test_random_operations_keep_invariants(ops):
    """Random growth (prefill chunks and decode), clones and frees: invariants hold after every step,
    every token gets a page of its own slot, and a failed allocation changes nothing."""
    state = jax.device_get(ds.DecodeState.init(4, 4, 9, 4, 4, [2]))
    seqs, pages = state.sequences, state.page_table
    for op, slot, n in ops:
        used = np.asarray(seqs.used_mask)
        if op == "grow":
            if not used[slot]:
                seqs = reserve_slots(seqs, jnp.arange(4) == slot)
            start = int(seqs.seq_lens[slot])
            n = min(n, 16 - start)
            slots = jnp.array([slot] * n + [-1] * (8 - n), jnp.int32)
            pos = jnp.array(list(range(start, start + n)) + [0] * (8 - n), jnp.int32)
            new_seqs, new_pages, info = allocate(seqs, pages, slots, pos)
            if bool(info.out_of_pages):
                assert np.array_equal(new_pages.page_ref_counts, pages.page_ref_counts)
                assert np.array_equal(new_seqs.page_indices, seqs.page_indices)
                continue
            seqs, pages = new_seqs, new_pages
            assert int(seqs.seq_lens[slot]) == start + n
            dests = np.asarray(info.new_token_dests)[:n]
            rows = np.asarray(seqs.page_indices)[slot]
            assert dests.tolist() == [rows[p // 4] * 4 + p % 4 for p in range(start, start + n)]
        elif op == "clone":
            child = int(np.argmin(used)) if not used.all() else -1
            if used[slot] and child >= 0:
                seqs, pages, _, _, _ = clone(seqs, pages, jnp.int32(slot), jnp.int32(child))
        elif used[slot]:
            seqs, pages = free(seqs, pages, jnp.arange(4) == slot)
        ds.check_invariants(as_state(jax.device_get(seqs), jax.device_get(pages)))
    seqs, pages = free(seqs, pages, seqs.used_mask)
    assert not np.asarray(pages.page_ref_counts).any()  # no leaks once everything is freed
