"""L6's page bookkeeping as device arrays: who owns which page, and where each new token's K/V goes.

Three pytrees (plain dataclasses registered with ``jax.tree_util.register_dataclass``, so they pass
through ``jit``, ``while_loop`` and ``device_get`` like any array):

- ``PageTable``: the allocator. Only ``page_ref_counts`` i32[P]; a page is free when its count is 0,
  and a count above 1 means clones share it.
- ``SequenceTable``: one row per sequence slot (Levanter's word: a slot is a sequence's row of the
  tables, ``0 .. max_num_seqs - 1``): ``seq_lens``, ``page_indices`` (INVALID = -1 where a sequence
  has no page yet) and ``used_mask``. ``page_indices`` is the one copy of the mapping (Levanter, in
  February 2026, also kept a ``kv_pages`` mirror of it; two copies of one truth can only drift apart).
- ``PageBatchInfo``: what a forward call needs to know about its batch (which slots, their pages and
  lengths, query offsets, and ``new_token_dests = page * page_size + row`` for the KV writes, ``row``
  being the position's row within its page; Levanter calls that row a slot too).

Every function is pure (old state in, new state out), has static shapes and no Python branches on
values, so the decode loop can run entirely inside one ``jax.lax.while_loop``. The address mapping for
the token of slot ``s`` at position ``p``::

    page = page_indices[s, p // page_size]        kv_pages[page, p % page_size]  holds its K/V

Left out on purpose: eviction and preemption (L3's job; here the host admits only what fits), the
prefix cache (L5), and devices: these are one pool's tables (``mesh/tables.py`` runs them once per
device's share of the pool, side by side).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import jax
import jax.numpy as jnp

INVALID = -1


def cdiv(a, b):
    """Ceiling division: ``cdiv(17, 16) -> 2``, ``cdiv(16, 16) -> 1``, ``cdiv(0, 16) -> 0``."""
    return (a + b - 1) // b


def pages_for(prompt_len: int, max_new: int, n: int, page_size: int) -> int:
    """Pages a prompt needs to finish its max_new_tokens, with n clones sharing its full prompt pages.

    Example, page_size 16: a 20-token prompt, max_new_tokens 30, n=4 -> 4 pages for one sequence (50 tokens)
    plus 3 clones x (4 - 1 shared) = 13.
    """
    total = cdiv(prompt_len + max_new, page_size)
    return total + (n - 1) * (total - prompt_len // page_size)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PageTable:
    page_ref_counts: jax.Array  # i32[P]: owners of each page; 0 = free

    @classmethod
    def init(cls, num_pages: int) -> PageTable:
        return cls(jnp.zeros(num_pages, jnp.int32))

    @property
    def num_pages(self) -> int:
        return self.page_ref_counts.shape[0]


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SequenceTable:
    seq_lens: jax.Array  # i32[S]: tokens whose K/V are (or are being) stored, per slot
    page_indices: jax.Array  # i32[S, pages_per_seq]: physical page of each logical page, INVALID after
    used_mask: jax.Array  # bool[S]: slot holds a live sequence
    page_size: int = field(metadata=dict(static=True))

    @classmethod
    def init(cls, max_num_seqs: int, pages_per_seq: int, page_size: int) -> SequenceTable:
        return cls(
            seq_lens=jnp.zeros(max_num_seqs, jnp.int32),
            page_indices=jnp.full((max_num_seqs, pages_per_seq), INVALID, jnp.int32),
            used_mask=jnp.zeros(max_num_seqs, bool),
            page_size=page_size,
        )

    @property
    def max_num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def pages_per_seq(self) -> int:
        return self.page_indices.shape[1]


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PageBatchInfo:
    """One forward call's batch: the sequences in it (first S rows valid) and where its tokens go.

    Sequence i of the batch is slot ``slot_ids[i]``; its query tokens are rows
    ``cu_q_lens[i]:cu_q_lens[i + 1]`` of the flat batch and are the *last* tokens of its
    ``seq_lens[i]`` (causal among themselves). ``pages_needed``/``pages_free`` describe the allocation
    that built this batch; when ``pages_needed > pages_free`` nothing was allocated, every
    ``new_token_dests`` is INVALID and the caller must report the shortage, not use the outputs.
    """

    slot_ids: jax.Array  # i32[S]: slot of each batch sequence, INVALID padding after num_seqs
    page_indices: jax.Array  # i32[S, pages_per_seq]: those slots' rows of SequenceTable.page_indices
    seq_lens: jax.Array  # i32[S]: KV length of each batch sequence, new tokens included (0 padding)
    cu_q_lens: jax.Array  # i32[S + 1]: query offsets into the flat batch
    num_seqs: jax.Array  # i32[]: valid rows
    new_token_dests: jax.Array  # i32[T]: page * page_size + row for each token, INVALID = no write
    pages_needed: jax.Array  # i32[]: new pages this batch asked for
    pages_free: jax.Array  # i32[]: free pages before it asked
    page_size: int = field(metadata=dict(static=True))

    @property
    def out_of_pages(self) -> jax.Array:
        return self.pages_needed > self.pages_free


def reserve_slots(seq_table: SequenceTable, mask: jax.Array) -> SequenceTable:
    """Mark the slots in ``mask`` (bool[S]) used and empty: a new sequence starts there."""
    return replace(
        seq_table,
        seq_lens=jnp.where(mask, 0, seq_table.seq_lens),
        page_indices=jnp.where(mask[:, None], INVALID, seq_table.page_indices),
        used_mask=seq_table.used_mask | mask,
    )


def allocate_for_seq(
    seq_table: SequenceTable, page_table: PageTable, token_slot_ids: jax.Array, token_pos_ids: jax.Array
) -> tuple[SequenceTable, PageTable, PageBatchInfo]:
    """Make sure every token of a batch has a page, and describe the batch for the forward call.

    token_slot_ids, token_pos_ids: (T,) i32, the slot and absolute position of each token; tokens of
    one slot are contiguous with ascending positions; INVALID slot = padding. Each slot's length grows
    to its largest position + 1; each slot gets new pages up to ceil(length / page_size), the lowest
    free page ids first, in slot order (the same inputs always give the same pages). All or nothing:
    if the pool lacks pages, both tables come back unchanged and the info says how many were needed.

    Example, page_size 4, pages 0..5 with page_ref_counts [1, 0, 1, 0, 0, 0]:
    slot 0 holds 3 tokens on page 0 (page_indices [0, -1, -1]), slot 1 holds 4 on page 2 ([2, -1, -1]).
    Decode one token each: slot ids [0, 1], positions [3, 4].
        slot 0: position 3 still fits page 0            -> page_indices [0, -1, -1], seq_len 4
        slot 1: position 4 starts its 2nd page; page 1  -> page_indices [2, 1, -1],  seq_len 5
        page_ref_counts [1, 1, 1, 0, 0, 0]; new_token_dests [0 * 4 + 3, 1 * 4 + 0] = [3, 4]
        cu_q_lens [0, 1, 2, 2, ...], slot_ids [0, 1, -1, ...], pages_needed 1, pages_free 4.
    """
    n_seqs, per_seq = seq_table.page_indices.shape
    ps, n_pages = seq_table.page_size, page_table.num_pages
    refs = page_table.page_ref_counts  # (P,)
    valid = token_slot_ids >= 0  # (T,)
    slot = jnp.where(valid, token_slot_ids, n_seqs)  # (T,) padding -> out of range, dropped below

    # Lengths and pages: every slot with a token at position p is at least p + 1 long.
    new_lens = seq_table.seq_lens.at[slot].max(token_pos_ids + 1, mode="drop")  # (S,)
    have = jnp.sum(seq_table.page_indices >= 0, axis=1)  # (S,) pages held
    need = cdiv(new_lens, ps)  # (S,) pages needed
    j = jnp.arange(per_seq)
    want = (j[None, :] >= have[:, None]) & (j[None, :] < need[:, None])  # (S, pages_per_seq) to fill
    needed, free = jnp.sum(want), jnp.sum(refs == 0)
    ok = needed <= free  # all or nothing
    free_ids = jnp.nonzero(refs == 0, size=n_pages, fill_value=n_pages)[0]  # (P,) lowest free first
    rank = jnp.cumsum(want.reshape(-1)).reshape(want.shape) - 1  # (S, pages_per_seq) k-th wanted entry
    fresh = jnp.where(want, free_ids[jnp.clip(rank, 0, n_pages - 1)], INVALID)  # gets the k-th free page
    page_indices = jnp.where(want & ok, fresh, seq_table.page_indices)  # (S, pages_per_seq)
    refs = refs.at[jnp.where(want & ok, fresh, n_pages)].add(1, mode="drop")  # (P,)
    seq_table = replace(
        seq_table,
        seq_lens=jnp.where(ok, new_lens, seq_table.seq_lens),
        page_indices=page_indices,
    )
    info = batch_info(seq_table, token_slot_ids, token_pos_ids, ok, needed, free)
    return seq_table, replace(page_table, page_ref_counts=refs), info


def batch_info(
    seq_table: SequenceTable,
    token_slot_ids: jax.Array,
    token_pos_ids: jax.Array,
    writes: jax.Array,
    pages_needed: jax.Array,
    pages_free: jax.Array,
) -> PageBatchInfo:
    """Describe a flat batch whose pages are allocated: sequences, offsets, pages and KV destinations.

    Sequence i of the batch starts where the slot id changes. ``writes`` False (a failed allocation)
    makes every destination INVALID.
    Example, page_size 4: slot 1 holds 6 tokens on pages [4, 5]; a batch of its 2 newest tokens
    (slots [1, 1], positions [4, 5]) -> page_indices [[4, 5, ...]], seq_lens [6], cu_q_lens [0, 2, ...],
    new_token_dests [5 * 4 + 0, 5 * 4 + 1] = [20, 21].
    """
    n_seqs, ps = seq_table.max_num_seqs, seq_table.page_size
    valid = token_slot_ids >= 0  # (T,)
    slot = jnp.where(valid, token_slot_ids, n_seqs)  # (T,)
    table = seq_table.page_indices  # (S, pages_per_seq)
    prev = jnp.concatenate([jnp.array([INVALID - 1], jnp.int32), token_slot_ids[:-1]])  # (T,)
    starts = valid & (token_slot_ids != prev)  # (T,) first token of each sequence
    seg = jnp.cumsum(starts) - 1  # (T,) batch index of each token's sequence
    slot_ids = (
        jnp.full(n_seqs, INVALID, jnp.int32)
        .at[jnp.where(starts, seg, n_seqs)]
        .set(token_slot_ids, mode="drop")
    )  # (S,)
    q_lens = jnp.zeros(n_seqs, jnp.int32).at[jnp.where(valid, seg, n_seqs)].add(1, mode="drop")  # (S,)
    in_batch = slot_ids >= 0  # (S,)
    rows = jnp.maximum(slot_ids, 0)  # (S,)
    page = table[jnp.minimum(slot, n_seqs - 1), token_pos_ids // ps]  # (T,)
    return PageBatchInfo(
        slot_ids=slot_ids,
        page_indices=jnp.where(in_batch[:, None], table[rows], INVALID),
        seq_lens=jnp.where(in_batch, seq_table.seq_lens[rows], 0),
        cu_q_lens=jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(q_lens)]),
        num_seqs=jnp.sum(starts),
        new_token_dests=jnp.where(valid & writes, page * ps + token_pos_ids % ps, INVALID),
        pages_needed=pages_needed,
        pages_free=pages_free,
        page_size=ps,
    )


def free_pages_for_finished(
    seq_table: SequenceTable, page_table: PageTable, finished_mask: jax.Array
) -> tuple[SequenceTable, PageTable]:
    """Release the slots in ``finished_mask`` (bool[S]): one refcount off each of their pages.

    A page shared with a clone drops to the clone's count and stays in use; an unshared one drops to
    0, which makes it free. The slots become unused with no pages.

    Example, page_size 4: slot 0 = pages [3, 5], slot 1 = its clone [3, 6], refcounts p3=2, p5=1,
    p6=1. Free slot 0: p3=1 (slot 1 still reads it), p5=0 (free), p6=1; slot 0's row -> [-1, -1].
    """
    n_pages = page_table.num_pages
    owned = jnp.where(finished_mask[:, None], seq_table.page_indices, INVALID)  # (S, pages_per_seq)
    refs = page_table.page_ref_counts.at[jnp.where(owned >= 0, owned, n_pages)].add(-1, mode="drop")
    seq_table = replace(
        seq_table,
        seq_lens=jnp.where(finished_mask, 0, seq_table.seq_lens),
        page_indices=jnp.where(finished_mask[:, None], INVALID, seq_table.page_indices),
        used_mask=seq_table.used_mask & ~finished_mask,
    )
    return seq_table, replace(page_table, page_ref_counts=refs)


def clone_pages_from(
    seq_table: SequenceTable, page_table: PageTable, parent: jax.Array, child: jax.Array
) -> tuple[SequenceTable, PageTable, jax.Array, jax.Array, jax.Array]:
    """Start slot ``child`` as a copy of slot ``parent``: share its full pages, get its own last page.

    Full pages never change again, so the child points at the same pages (refcount + 1). The last,
    partly filled page will be written by both, so the child gets a fresh page (``argmin`` of the
    refcounts: the lowest free one if any, the page Levanter's ``argmax(refcounts == 0)`` picks) and the caller copies the K/V of its filled rows
    into it. Returns (seq_table, page_table, src_page, dst_page, ok); src/dst are INVALID when the
    parent's length is a whole number of pages (nothing to copy). ``ok`` is False (tables unchanged)
    if the fresh page was needed and none was free. An INVALID child is a no-op.

    Example, page_size 4: parent holds 6 tokens on pages [3, 5]. The child gets [3, 8] (page 8 was
    free): refcounts p3 1 -> 2, p8 0 -> 1; the caller copies page 5 into page 8.
    """
    ps, n_pages = seq_table.page_size, page_table.num_pages
    refs = page_table.page_ref_counts  # (P,)
    length = seq_table.seq_lens[parent]
    n_full = length // ps
    partial = length % ps > 0
    row = seq_table.page_indices[parent]  # (pages_per_seq,)
    fresh = jnp.argmin(refs).astype(jnp.int32)  # a free page if there is one
    ok = ~partial | (refs[fresh] == 0)
    go = ok & (child >= 0)
    shared = (jnp.arange(row.shape[0]) < n_full) & (row >= 0) & go  # (pages_per_seq,)
    take = partial & go
    child_row = jnp.where(shared, row, INVALID).at[n_full].set(jnp.where(take, fresh, INVALID), mode="drop")
    refs = refs.at[jnp.where(shared, row, n_pages)].add(1, mode="drop")
    refs = refs.at[jnp.where(take, fresh, n_pages)].add(1, mode="drop")
    keep = jnp.arange(seq_table.max_num_seqs) == jnp.where(go, child, INVALID)  # (S,) the child's row, if any
    seq_table = replace(
        seq_table,
        seq_lens=jnp.where(keep, length, seq_table.seq_lens),
        page_indices=jnp.where(keep[:, None], child_row[None, :], seq_table.page_indices),
        used_mask=seq_table.used_mask | keep,
    )
    src = jnp.where(take, row[jnp.minimum(n_full, row.shape[0] - 1)], INVALID)
    return seq_table, replace(page_table, page_ref_counts=refs), src, jnp.where(take, fresh, INVALID), ok
