"""L6 device state: allocation, freeing, clones, the token queue, invariants and reset (unit + property)."""

from __future__ import annotations

import functools
from dataclasses import replace

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from L6_tpu_jax import decode_state as ds
from L6_tpu_jax import device_stats as dstats
from L6_tpu_jax.kv_cache import update_kv
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
        page_size=page_size,
    )
    return seqs, PageTable(jnp.array(refs, jnp.int32))


def as_state(seqs, pages):
    """Wrap tables in an otherwise empty DecodeState so check_invariants can read them."""
    n = seqs.max_num_seqs
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
    assert seqs.page_indices.tolist() == [[3, 5], [3, 0]] and seqs.seq_lens.tolist() == [6, 6]
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
    assert ds.occupancy(jax.device_get(state)) == {
        "active_slots": 2,
        "pages_in_use": 2,
        "free_pages": 3,
        "max_refcount": 1,
    }
    with pytest.raises(AssertionError):
        ds.check_invariants(jax.device_get(state), after_reset=True)
    ds.check_invariants(jax.device_get(ds.reset_logical(state)), after_reset=True)


def test_kv_usage_and_count_step_docstring_examples():
    seqs, pages = tables([0, 0, 0, 2, 0, 1, 0, 0, 1], [[3, 5], [3, 8]], [6, 5])
    state = as_state(seqs, pages)
    ds.check_invariants(state)
    assert [int(x) for x in dstats.kv_usage(state)] == [7, 3, 1]  # page 3's rows once
    assert int(dstats.kv_usage(replace(state, finished=np.array([False, True])))[0]) == 6  # slot 1 is done
    info = allocate(seqs, pages, jnp.array([0, 1, -1]), jnp.array([5, 4, 0]))[2]  # 2 real tokens, no new page
    counted = dstats.count_step(state, info).stats
    assert (int(counted.steps), int(counted.tokens_run)) == (1, 2)
    assert (float(counted.live_sum), float(counted.held_sum)) == (7.0, 12.0)
    assert (int(counted.peak_live), int(counted.peak_pages_in_use), int(counted.peak_pages_shared)) == (
        7,
        3,
        1,
    )


# ---- the property test: random engine operations on the whole DecodeState, without a model

# One small layout, so every operation compiles once: 4 slots of up to 16 tokens (4 pages of 4) on a
# pool of 9 pages, which runs out; prompts of 1-7 tokens padded to 8; max_new_tokens of 1-6; token 2 stops.
S, PAGE, PER_SEQ, PAGES, T, MAX_NEW, STOP = 4, 4, 4, 9, 8, 6, 2


def fake_kv(state, kv_pages, info, slots, pos, roots):
    """Write a value naming each token's sequence family and position where its K/V belong."""
    value = (pos + 1000 * roots[jnp.maximum(slots, 0)]).astype(jnp.float32)[:, None, None]  # (T, 1, 1)
    return (update_kv(kv_pages[0], info.new_token_dests, value, value),)


def model_free_step(state, fallback, kv_pages, slots, pos, sampled, roots):
    """The engine's step without a model: allocate, count, write fake K/V, update; all or nothing.

    Returns (state, kv_pages, info, tables right after allocate_for_seq)."""
    seqs, pages, info = allocate_for_seq(state.sequences, state.page_table, slots, pos)
    new = dstats.count_step(replace(state, sequences=seqs, page_table=pages), info)
    new = ds.update_tokens(new, info, sampled)
    kv_pages = fake_kv(new, kv_pages, info, slots, pos, roots)
    return ds.keep_if(~info.out_of_pages, new, fallback), kv_pages, info, (seqs, pages)


@jax.jit
def op_admit(state, kv_pages, slot, length, max_new, token, roots):
    """Start a sequence in ``slot`` and prefill its ``length`` prompt tokens (the rest is padding)."""
    mask = jnp.arange(S) == slot
    admitted = ds.admit(state, mask, jnp.where(mask, max_new, 0), jnp.zeros(S, bool))
    i = jnp.arange(T)
    slots, pos = jnp.where(i < length, slot, -1), jnp.where(i < length, i, 0)
    return model_free_step(admitted, state, kv_pages, slots, pos, jnp.full(S, token), roots)


@functools.partial(jax.jit, static_argnums=2)
def op_decode(state, kv_pages, width, token, roots):
    """One decode round of up to ``width`` (2: maybe not all; 4: all) queued tokens; row i samples
    (token + i) % 4."""
    queue, _, slots, pos = ds.pack_next(state.tqueue, width)
    sampled = (token + jnp.arange(S)) % 4
    return model_free_step(replace(state, tqueue=queue), state, kv_pages, slots, pos, sampled, roots)


@jax.jit
def op_clone(state, kv_pages, parent, child):
    """Slot ``child`` becomes a clone of slot ``parent``; the peaks see its pages (as in the engine)."""
    state, kv_pages = ds.clone_sequence(state, kv_pages, parent, child)
    return dstats.record_peaks(state), kv_pages


op_free = jax.jit(ds.free_finished)
op_reset = jax.jit(ds.reset_logical)
usage = jax.jit(dstats.kv_usage)


def tables_of(state):
    return [
        np.asarray(x)
        for x in (state.sequences.seq_lens, state.sequences.page_indices, state.page_table.page_ref_counts)
    ]


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["admit"] * 3 + ["decode"] * 4 + ["clone"] * 2 + ["free", "reset"]),
            st.integers(0, 3),
            st.integers(1, 7),
            st.integers(0, 5),
        ),
        min_size=30,
        max_size=40,
    ),
)
def test_random_operations_keep_invariants(ops):
    """Random admissions (prefill), decode rounds, clones, frees and resets of the engine's device
    state, with fake K/V naming each token's sequence family and position. After every operation:
    the invariants hold, every used slot reads back its own values through its page table (so no
    shared page was written, every clone copied the right partial page, and no stale page is read),
    every token got a page of its own slot, a failed allocation changed nothing, ``kv_usage`` counts
    what a host count finds, and the step counters add up. At the end nothing leaks."""
    ps = PAGE
    state = ds.DecodeState.init(S, PER_SEQ, PAGES, ps, MAX_NEW, [STOP])
    kv_pages = (jnp.full((PAGES, ps, 2, 1), -1.0),)  # one layer, H_kv = D = 1
    roots = np.zeros(S, np.int32)  # the family of each slot: admissions get new ones, clones inherit
    families = iter(range(1, 10**6))
    steps = tokens = most_shared = 0
    host = jax.device_get(state)
    for op, a, b, c in ops:
        used = np.flatnonzero(host.sequences.used_mask).tolist()
        free_slots = [s for s in range(S) if s not in used]
        if op in ("admit", "decode"):
            if op == "admit" and free_slots:
                slot = free_slots[a % len(free_slots)]
                roots[slot] = next(families)
                new, kv_pages, info, raw = op_admit(state, kv_pages, slot, b, c + 1, c % 4, roots)
            elif op == "decode" and int(host.tqueue.num_queued):
                new, kv_pages, info, raw = op_decode(state, kv_pages, (2, 4)[a % 2], c, roots)
            else:
                continue
            info, (seqs, pages) = jax.device_get((info, raw))
            if bool(info.out_of_pages):  # all or nothing: the allocation changed no table
                assert np.array_equal(seqs.seq_lens, host.sequences.seq_lens)
                assert np.array_equal(seqs.page_indices, host.sequences.page_indices)
                assert np.array_equal(pages.page_ref_counts, host.page_table.page_ref_counts)
                assert all(np.array_equal(x, y) for x, y in zip(tables_of(new), tables_of(host), strict=True))
            else:
                steps, tokens = steps + 1, tokens + int(info.cu_q_lens[-1])
                for i in range(info.num_seqs):  # each token's K/V goes to a page of its own slot
                    s, lo, hi = info.slot_ids[i], info.cu_q_lens[i], info.cu_q_lens[i + 1]
                    row, end = seqs.page_indices[s], seqs.seq_lens[s]
                    dests = [row[p // ps] * ps + p % ps for p in range(end - (hi - lo), end)]
                    assert info.new_token_dests[lo:hi].tolist() == dests
            state = new
        elif op == "clone" and used and free_slots:
            parent, child = used[a % len(used)], free_slots[b % len(free_slots)]
            new, kv_pages = op_clone(state, kv_pages, jnp.int32(parent), jnp.int32(child))
            if int(new.pages_needed):  # no free page for the copy of the partial last page
                assert all(np.array_equal(x, y) for x, y in zip(tables_of(new), tables_of(host), strict=True))
            else:
                state, roots[child] = new, roots[parent]
        elif op == "free":
            state = op_free(state)
        elif op == "reset":
            state, steps, tokens = op_reset(state), 0, 0
            ds.check_invariants(jax.device_get(state), after_reset=True)
        host = jax.device_get(state)
        ds.check_invariants(host)
        table, kv = host.sequences, np.asarray(kv_pages[0])[:, :, 0, 0]  # (P, page_size) K values
        live = set()  # (page, row) of every live position
        for s in np.flatnonzero(table.used_mask):
            p = np.arange(table.seq_lens[s])
            page = table.page_indices[s, p // ps]
            assert kv[page, p % ps].tolist() == (p + 1000 * roots[s]).tolist(), f"slot {s} reads wrong K/V"
            if not host.finished[s]:
                live |= set(zip(page.tolist(), (p % ps).tolist(), strict=True))
        refs = host.page_table.page_ref_counts
        assert [int(x) for x in usage(state)] == [len(live), int((refs > 0).sum()), int((refs > 1).sum())]
        counted = host.stats
        assert (int(counted.steps), int(counted.tokens_run)) == (steps, tokens)
        assert counted.live_sum <= counted.held_sum and counted.peak_pages_in_use >= (refs > 0).sum()
        most_shared = max(most_shared, int((refs > 1).sum()))
    state = op_free(replace(state, finished=state.finished | state.sequences.used_mask))
    assert not np.asarray(state.page_table.page_ref_counts).any()  # no leaks once everything is freed
    hypothesis.target(float(most_shared), label="shared pages")
