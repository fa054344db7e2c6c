"""L6's decode state: the work queue, per-slot outputs and stopping rules, cloning, reset, and checks.

``DecodeState`` is the single source of truth on the device: the ``SequenceTable`` and ``PageTable``
(``page_table.py``), the ``TokenQueue`` of tokens waiting to run, each slot's generated tokens and
max_new_tokens, a ``finished`` flag per slot, and the counters behind ``Engine.stats()`` (``stats``, kept by
``device_stats.py``). It is one pytree, so a whole decode round (pack the queue, allocate pages,
forward, pick tokens, count, update, free what finished) runs inside ``jax.lax.while_loop`` without
the host.

The host reads it back (a NumPy copy, ``Engine.host_state``) only between calls, for outputs,
``occupancy``, the counters, and ``check_invariants``: the allocation, clone/refcount and reset
invariants Levanter's engine relies on, checked on plain NumPy copies.

Left out on purpose: sampling (greedy only: clones of one prompt therefore produce the same tokens;
what they show is the sharing), stop strings, logprobs, and a scheduler that mixes prefill chunks
into decode rounds.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, fields, replace

import jax
import jax.numpy as jnp
import numpy as np

from .device_stats import DeviceStats
from .kv_cache import copy_page
from .page_table import (
    INVALID,
    PageBatchInfo,
    PageTable,
    SequenceTable,
    cdiv,
    clone_pages_from,
    free_pages_for_finished,
    reserve_slots,
)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class TokenQueue:
    """A flat queue of tokens to run: ``(token, slot, position)`` triples, the first ``num_queued`` valid."""

    tokens: jax.Array  # i32[Q]
    slot_ids: jax.Array  # i32[Q], INVALID past num_queued
    pos_ids: jax.Array  # i32[Q]
    num_queued: jax.Array  # i32[]

    @classmethod
    def init(cls, capacity: int) -> TokenQueue:
        empty = jnp.full(capacity, INVALID, jnp.int32)
        return cls(empty, empty, empty, jnp.zeros((), jnp.int32))


def enqueue(queue: TokenQueue, tokens, slot_ids, pos_ids, mask) -> TokenQueue:
    """Append the entries where ``mask`` (bool[N]) is set, in order, after the queued ones.

    Example: queue [(7, slot 2, pos 9)], enqueue tokens [4, 5], slots [0, 1], mask [False, True]
    -> [(7, 2, 9), (5, 1, pos_ids[1])].
    """
    capacity = queue.tokens.shape[0]
    at = jnp.where(mask, queue.num_queued + jnp.cumsum(mask) - 1, capacity)  # (N,) masked-off -> dropped
    return TokenQueue(
        tokens=queue.tokens.at[at].set(tokens, mode="drop"),
        slot_ids=queue.slot_ids.at[at].set(slot_ids, mode="drop"),
        pos_ids=queue.pos_ids.at[at].set(pos_ids, mode="drop"),
        num_queued=queue.num_queued + jnp.sum(mask),
    )


def pack_next(queue: TokenQueue, max_tokens: int) -> tuple[TokenQueue, jax.Array, jax.Array, jax.Array]:
    """Take the oldest ``max_tokens`` queued entries (at most), sorted by slot; the rest move to the front.

    Returns (queue, tokens, slot_ids, pos_ids), each (max_tokens,) with INVALID slots as padding
    (``max_tokens`` at most the queue's capacity). Sorting by slot keeps each slot's tokens
    contiguous, which ``allocate_for_seq`` relies on.
    Example: queued slots [3, 0, 5], max_tokens 2 -> packed slots [0, 3], queue left with [5].
    """
    capacity = queue.tokens.shape[0]
    taken = jnp.minimum(queue.num_queued, max_tokens)  # entries packed now
    i = jnp.arange(max_tokens)

    def first(x):
        return jnp.where(i < taken, x[i], INVALID)  # (max_tokens,) the oldest entries, padding after

    slots = first(queue.slot_ids)
    order = jnp.argsort(jnp.where(slots >= 0, slots, jnp.iinfo(jnp.int32).max), stable=True)  # by slot
    rest = jnp.arange(capacity) + taken  # (Q,) the entries that remain, moved to the front in order

    def keep(x):
        return jnp.where(rest < queue.num_queued, x[jnp.minimum(rest, capacity - 1)], INVALID)  # (Q,)

    left = TokenQueue(keep(queue.tokens), keep(queue.slot_ids), keep(queue.pos_ids), queue.num_queued - taken)
    return left, first(queue.tokens)[order], slots[order], first(queue.pos_ids)[order]


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class DecodeState:
    sequences: SequenceTable
    page_table: PageTable
    tqueue: TokenQueue
    tokens: jax.Array  # i32[S, max_new]: generated tokens of each slot
    num_generated: jax.Array  # i32[S]
    max_new_tokens: jax.Array  # i32[S]: each slot's max_new_tokens
    ignore_eos: jax.Array  # bool[S]
    finished: jax.Array  # bool[S]
    stop_tokens: jax.Array  # i32[E]: eos ids, INVALID padding
    pages_needed: jax.Array  # i32[]: > 0 once an allocation failed (the host raises)
    pages_free: jax.Array  # i32[]: free pages at that failure
    stats: DeviceStats  # counters since the last reset (device_stats.py)

    @classmethod
    def init(
        cls, max_num_seqs: int, pages_per_seq: int, num_pages: int, page_size: int, max_new: int, stop_tokens
    ) -> DecodeState:
        return cls(
            sequences=SequenceTable.init(max_num_seqs, pages_per_seq, page_size),
            page_table=PageTable.init(num_pages),
            tqueue=TokenQueue.init(max_num_seqs),
            tokens=jnp.full((max_num_seqs, max_new), INVALID, jnp.int32),
            num_generated=jnp.zeros(max_num_seqs, jnp.int32),
            max_new_tokens=jnp.zeros(max_num_seqs, jnp.int32),
            ignore_eos=jnp.zeros(max_num_seqs, bool),
            finished=jnp.zeros(max_num_seqs, bool),
            stop_tokens=jnp.asarray(stop_tokens, jnp.int32),
            pages_needed=jnp.zeros((), jnp.int32),
            pages_free=jnp.zeros((), jnp.int32),
            stats=DeviceStats.init(),
        )


def reset_logical(state: DecodeState) -> DecodeState:
    """Back to the baseline: no used slots, zero refcounts, empty queue, no finished flags, no outputs,
    zero counters.

    Metadata only: the KV pages keep their stale contents, which is safe because attention reads only
    positions below each sequence's length, and a page is written before those positions cover it.
    """
    seqs = state.sequences
    return DecodeState.init(
        seqs.max_num_seqs,
        seqs.pages_per_seq,
        state.page_table.num_pages,
        seqs.page_size,
        state.tokens.shape[1],
        state.stop_tokens,
    )


def admit(state: DecodeState, slot_mask, max_new, ignore_eos) -> DecodeState:
    """Start new sequences in the slots of ``slot_mask`` (bool[S]) with their max_new_tokens (i32[S])."""
    return replace(
        state,
        sequences=reserve_slots(state.sequences, slot_mask),
        tokens=jnp.where(slot_mask[:, None], INVALID, state.tokens),
        num_generated=jnp.where(slot_mask, 0, state.num_generated),
        max_new_tokens=jnp.where(slot_mask, max_new, state.max_new_tokens),
        ignore_eos=jnp.where(slot_mask, ignore_eos, state.ignore_eos),
        finished=state.finished & ~slot_mask,
    )


def update_tokens(state: DecodeState, info: PageBatchInfo, sampled: jax.Array) -> DecodeState:
    """Append each batch sequence's new token, apply HF's stopping rule, and queue what continues.

    sampled: (S,) the token picked for batch sequence i (slot ``info.slot_ids[i]``). A slot finishes
    when it reaches its max_new_tokens or (unless it ignores eos) produces a stop token, which is kept. A
    continuing slot's token is queued at position ``info.seq_lens[i]``, the next one.
    """
    n_seqs = state.finished.shape[0]
    in_batch = info.slot_ids >= 0  # (S,)
    slot = jnp.where(in_batch, info.slot_ids, n_seqs)  # (S,) padding -> dropped
    row = jnp.minimum(slot, n_seqs - 1)
    tokens = state.tokens.at[slot, state.num_generated[row]].set(sampled, mode="drop")  # (S, max_new)
    num_generated = state.num_generated.at[slot].add(1, mode="drop")  # (S,)
    is_stop = jnp.any(sampled[:, None] == state.stop_tokens[None, :], axis=1) & ~state.ignore_eos[row]
    done = in_batch & ((num_generated[row] >= state.max_new_tokens[row]) | is_stop)  # (S,)
    finished = state.finished.at[jnp.where(done, slot, n_seqs)].set(True, mode="drop")
    tqueue = enqueue(state.tqueue, sampled, info.slot_ids, info.seq_lens, in_batch & ~done)
    return replace(state, tokens=tokens, num_generated=num_generated, finished=finished, tqueue=tqueue)


def clone_sequence(state: DecodeState, kv_pages: tuple, parent, child) -> tuple[DecodeState, tuple]:
    """Slot ``child`` becomes a clone of slot ``parent`` (a no-op when ``child`` is INVALID).

    It shares the parent's full pages and gets a copy of the partial last page, K/V copied in every
    layer (``clone_pages_from``, ``copy_page``); ``start_clone`` gives it the rest.
    """
    seqs, pages, src, dst, ok = clone_pages_from(state.sequences, state.page_table, parent, child)
    return start_clone(state, seqs, pages, parent, child, ok), copy_page(kv_pages, src, dst)


def start_clone(state: DecodeState, seqs: SequenceTable, pages: PageTable, parent, child, ok) -> DecodeState:
    """The state once slot ``child``'s pages are decided (``seqs``, ``pages``; ``ok`` False: none was free).

    The child gets the parent's outputs and max_new_tokens and, unless the parent already finished, a queued
    copy of the parent's next token. Out of pages: nothing changes and the shortage is recorded.
    """
    active = child >= 0
    child_row = jnp.maximum(child, 0)
    go = active & ok
    pick = jnp.arange(state.finished.shape[0]) == jnp.where(go, child, INVALID)  # (S,)

    def inherit(x):
        return jnp.where(pick.reshape(-1, *([1] * (x.ndim - 1))), x[parent][None], x)

    q = state.tqueue
    queued = (q.slot_ids == parent) & (jnp.arange(q.tokens.shape[0]) < q.num_queued)  # (Q,) parent's entry
    k = jnp.argmax(queued)
    tqueue = enqueue(q, q.tokens[k][None], child_row[None], q.pos_ids[k][None], (go & jnp.any(queued))[None])
    failed = active & ~ok
    return replace(
        state,
        sequences=seqs,
        page_table=pages,
        tqueue=tqueue,
        tokens=inherit(state.tokens),
        num_generated=inherit(state.num_generated),
        max_new_tokens=inherit(state.max_new_tokens),
        ignore_eos=inherit(state.ignore_eos),
        finished=inherit(state.finished),
        pages_needed=jnp.where(failed, 1, state.pages_needed),
        pages_free=jnp.where(failed, jnp.sum(state.page_table.page_ref_counts == 0), state.pages_free),
    )


def keep_if(ok, new, old):
    """``new`` where ``ok`` else ``old``, leaf by leaf (a step whose allocation failed changes nothing)."""
    return jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)


def record_shortage(state: DecodeState, info: PageBatchInfo) -> DecodeState:
    """Record a failed allocation's counts in the state (the host raises ``OutOfPagesError`` on them)."""
    short = info.out_of_pages
    return replace(
        state,
        pages_needed=jnp.where(short, info.pages_needed, state.pages_needed),
        pages_free=jnp.where(short, info.pages_free, state.pages_free),
    )


def free_finished(state: DecodeState) -> DecodeState:
    """Release every finished slot's pages (``free_pages_for_finished``); outputs stay readable."""
    mask = state.finished & state.sequences.used_mask
    seqs, pages = free_pages_for_finished(state.sequences, state.page_table, mask)
    return replace(state, sequences=seqs, page_table=pages)


def occupancy(state) -> dict[str, int]:
    """Active slots, pages in use, free pages and the largest refcount, from a host copy of the state.

    Example after prefilling one 20-token prompt with page_size 16 in a 10-page pool:
    ``{"active_slots": 1, "pages_in_use": 2, "free_pages": 8, "max_refcount": 1}``.
    """
    refs = np.asarray(state.page_table.page_ref_counts)
    return {
        "active_slots": int(np.sum(state.sequences.used_mask)),
        "pages_in_use": int(np.sum(refs > 0)),
        "free_pages": int(np.sum(refs == 0)),
        "max_refcount": int(refs.max(initial=0)),
    }


def check_invariants(state, *, after_reset: bool = False) -> None:
    """Raise AssertionError if a host copy of the state (``Engine.host_state``) breaks an invariant.

    Allocation: a used slot holds exactly ceil(seq_len / page_size) pages, as a prefix of its row;
    an unused slot holds none. Refcounts: never negative, and equal to the number of rows that hold
    the page (so a free page is in no row). Clones: a page held by several rows is full in each of
    them. Queue: at most one queued token per slot, for a used, unfinished slot, at its next position.
    Reset (``after_reset``): no used slots, zero refcounts, empty queue, no finished flags, zero
    counters.
    """
    seqs, refs, q = state.sequences, np.asarray(state.page_table.page_ref_counts), state.tqueue
    ps = seqs.page_size
    used, lens, table = np.asarray(seqs.used_mask), np.asarray(seqs.seq_lens), np.asarray(seqs.page_indices)
    assert (refs >= 0).all(), f"negative refcounts: pages {np.flatnonzero(refs < 0).tolist()}"
    owners: Counter[int] = Counter()
    full_owners: Counter[int] = Counter()
    for s in range(len(used)):
        row = table[s]
        held = int((row >= 0).sum())
        if not used[s]:
            assert held == 0 and lens[s] == 0, f"unused slot {s} holds {held} pages, length {lens[s]}"
            continue
        assert 0 <= lens[s] <= len(row) * ps, f"slot {s}: length {lens[s]} outside [0, {len(row) * ps}]"
        assert held == cdiv(int(lens[s]), ps), f"slot {s}: {held} pages for {lens[s]} tokens"
        assert (row[:held] >= 0).all(), f"slot {s}: pages are not a prefix of its row: {row.tolist()}"
        assert len(set(row[:held].tolist())) == held, f"slot {s} holds a page twice: {row.tolist()}"
        owners.update(row[:held].tolist())
        full_owners.update(row[: lens[s] // ps].tolist())
    for page, count in enumerate(refs.tolist()):
        assert count == owners[page], f"page {page}: refcount {count} but {owners[page]} owners"
        if owners[page] > 1:
            assert full_owners[page] == owners[page], f"page {page} is shared but not full in every owner"
    n = int(q.num_queued)
    assert 0 <= n <= len(np.asarray(q.tokens)), f"queue holds {n} entries"
    queued = np.asarray(q.slot_ids)[:n].tolist()
    assert len(set(queued)) == n, f"a slot is queued twice: {queued}"
    for s, pos in zip(queued, np.asarray(q.pos_ids)[:n].tolist(), strict=True):
        assert used[s] and not state.finished[s], f"queued token for unused or finished slot {s}"
        assert pos == lens[s], f"slot {s}: queued position {pos}, but its next position is {lens[s]}"
    if after_reset:
        assert not used.any(), f"used slots after reset: {np.flatnonzero(used).tolist()}"
        assert not refs.any(), f"nonzero refcounts after reset: pages {np.flatnonzero(refs).tolist()}"
        assert n == 0, f"{n} queued tokens after reset"
        assert not np.asarray(state.finished).any(), "finished flags set after reset"
        counts = {f.name: getattr(state.stats, f.name).item() for f in fields(state.stats)}
        assert not any(counts.values()), f"counters not zero after reset: {counts}"
