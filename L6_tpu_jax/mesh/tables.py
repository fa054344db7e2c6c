"""L6's tables over a device mesh: ``../page_table.py``'s one-device tables, one per device, side by side.

Over a mesh of ``num_shards`` devices (the ``data`` axis, ``engine.py``) the pool's P pages and the
S slots are each cut into ``num_shards`` equal ranges, one per device (a shard): device k holds pages
``k * P/n ...`` and runs slots ``k * S/n ...``. A slot only ever gets pages of its own shard, so its
attention reads only pages its own device holds, and no K/V ever crosses devices. The tables stay whole
on every device (a few KB, and every device must agree on every slot's row). Seen shard by shard they
are ``n`` one-device tables whose page ids are offset by the shard's first page, so the functions here
run ``../page_table.py``'s own functions on each shard's tables, page ids made local (``on_shards``), and
put the results back together (``off_shards``):

- ``allocate_on_shards``: ``allocate_for_seq`` on every shard at once (``jax.vmap``), all or nothing
  over all of them;
- ``clone_pages_on_shard``: ``clone_pages_from`` on the child's shard, so its fresh page is its own;
- ``pack_on_shards``: ``pack_next`` with the batch laid out in one block per shard, each holding only
  that shard's slots, so each device finds its own sequences in its own block;
- ``shard_block``, ``shard_batch_info``: one device's block of a batch, with page ids local to its
  slice of the pool.

Left out on purpose: cutting the tables themselves over the devices, and moving a sequence from one
device to another.
"""

from __future__ import annotations

from dataclasses import replace

import jax
import jax.numpy as jnp

from ..decode_state import TokenQueue
from ..page_table import (
    INVALID,
    PageBatchInfo,
    PageTable,
    SequenceTable,
    allocate_for_seq,
    batch_info,
    clone_pages_from,
)


def on_shards(seq_table: SequenceTable, page_table: PageTable, num_shards: int):
    """The tables as ``num_shards`` one-device tables, stacked on a leading axis: shard k's slots and
    pages, its page ids less its first page.

    Example, 2 shards of 2 slots and 3 pages: slot 2 on pages [3, 5] -> shard 1, row 0, pages [0, 2].
    """
    per_slot, per_page = seq_table.max_num_seqs // num_shards, page_table.num_pages // num_shards
    first = (jnp.arange(num_shards) * per_page)[:, None, None]  # (n, 1, 1)
    rows = seq_table.page_indices.reshape(num_shards, per_slot, -1)  # (n, S / n, pages_per_seq)
    seqs = SequenceTable(
        seq_lens=seq_table.seq_lens.reshape(num_shards, per_slot),
        page_indices=jnp.where(rows >= 0, rows - first, INVALID),
        used_mask=seq_table.used_mask.reshape(num_shards, per_slot),
        page_size=seq_table.page_size,
    )
    return seqs, PageTable(page_table.page_ref_counts.reshape(num_shards, per_page))


def off_shards(seqs: SequenceTable, pages: PageTable) -> tuple[SequenceTable, PageTable]:
    """The whole tables again, from stacked one-device tables (the inverse of ``on_shards``)."""
    num_shards, per_page = pages.page_ref_counts.shape
    first = (jnp.arange(num_shards) * per_page)[:, None, None]  # (n, 1, 1)
    rows = jnp.where(seqs.page_indices >= 0, seqs.page_indices + first, INVALID)  # (n, S / n, pages_per_seq)
    whole = SequenceTable(
        seq_lens=seqs.seq_lens.reshape(-1),
        page_indices=rows.reshape(-1, rows.shape[-1]),
        used_mask=seqs.used_mask.reshape(-1),
        page_size=seqs.page_size,
    )
    return whole, PageTable(pages.page_ref_counts.reshape(-1))


def allocate_on_shards(
    seq_table: SequenceTable,
    page_table: PageTable,
    token_slot_ids: jax.Array,
    token_pos_ids: jax.Array,
    num_shards: int,
) -> tuple[SequenceTable, PageTable, PageBatchInfo]:
    """``allocate_for_seq`` with every slot's new pages taken from its own shard.

    Each shard allocates for its own slots from its own pages, lowest free first; the step goes ahead
    only if every shard had enough (a shortage reports the first short shard's numbers). Returns the
    whole tables and the whole batch's ``PageBatchInfo``.

    Example, page_size 4, 2 shards (slots 0-1 and pages 0-2 on shard 0, slots 2-3 and pages 3-5 on
    shard 1), refcounts [1, 0, 0, 0, 0, 0], slot 0 holding 4 tokens on page 0: slot 0 crosses into its
    2nd page and slot 2 prefills 2 tokens (slot ids [0, 2, 2], positions [4, 0, 1]) -> slot 0 gets
    page 1, slot 2 gets page 3 (shard 1's lowest, not page 2); refcounts [1, 1, 0, 1, 0, 0].
    """
    per_slot = seq_table.max_num_seqs // num_shards
    shard = jnp.arange(num_shards)[:, None]  # (n, 1)
    mine = (token_slot_ids >= 0) & (token_slot_ids // per_slot == shard)  # (n, T) each shard's tokens
    local_slots = jnp.where(mine, token_slot_ids - shard * per_slot, INVALID)  # (n, T)
    seqs, pages = on_shards(seq_table, page_table, num_shards)
    seqs, pages, each = jax.vmap(allocate_for_seq, in_axes=(0, 0, 0, None))(
        seqs, pages, local_slots, token_pos_ids
    )
    short = each.out_of_pages  # (n,)
    ok = ~jnp.any(short)  # all or nothing, over every shard
    seqs, pages = jax.tree.map(
        lambda new, old: jnp.where(ok, new, old), off_shards(seqs, pages), (seq_table, page_table)
    )
    first_short = jnp.argmax(short)  # 0 when none is
    info = batch_info(
        seqs,
        token_slot_ids,
        token_pos_ids,
        ok,
        jnp.where(ok, jnp.sum(each.pages_needed), each.pages_needed[first_short]),
        jnp.where(ok, jnp.sum(each.pages_free), each.pages_free[first_short]),
    )
    return seqs, pages, info


def clone_pages_on_shard(
    seq_table: SequenceTable, page_table: PageTable, parent: jax.Array, child: jax.Array, num_shards: int
) -> tuple[SequenceTable, PageTable, jax.Array, jax.Array, jax.Array]:
    """``clone_pages_from`` on the shard of slot ``child``, whose fresh page is then one of its own.

    Parent and child must be on the same shard (the host admits a prompt's clones together). Same
    results as ``clone_pages_from``, page ids whole. Example, page_size 4, 2 shards of 2 slots and 3
    pages, slot 2 holding 6 tokens on pages [3, 4]: its clone slot 3 gets [3, 5] (page 5, shard 1's
    lowest free page, not page 0); the caller copies page 4 into page 5.
    """
    per_slot, per_page = seq_table.max_num_seqs // num_shards, page_table.num_pages // num_shards
    shard = jnp.maximum(child, 0) // per_slot  # the child's shard
    seqs, pages = on_shards(seq_table, page_table, num_shards)
    ours = jax.tree.map(lambda x: x[shard], (seqs, pages))  # that shard's one-device tables

    def local(slot):
        return jnp.where(slot >= 0, slot - shard * per_slot, INVALID)

    mine, my_pages, src, dst, ok = clone_pages_from(*ours, local(parent), local(child))
    seqs, pages = jax.tree.map(lambda x, y: x.at[shard].set(y), (seqs, pages), (mine, my_pages))

    def whole(page):
        return jnp.where(page >= 0, page + shard * per_page, INVALID)

    return *off_shards(seqs, pages), whole(src), whole(dst), ok


def pack_on_shards(
    queue: TokenQueue, max_tokens: int, num_shards: int
) -> tuple[TokenQueue, jax.Array, jax.Array, jax.Array]:
    """``pack_next`` for a mesh: the batch is ``num_shards`` blocks of ``max_tokens / num_shards``.

    Block k takes up to that many of the queued entries (oldest first) whose slot lives on shard k
    (slot // (Q / num_shards), the queue holding one entry per slot), sorted by slot, padding after;
    the rest move to the front of the queue. Example: 2 shards of 4 slots (queue capacity 8),
    queued slots [3, 0, 5], max_tokens 4: blocks [0, 3, -1, -1] and [5, -1, -1, -1] -> packed slots
    [0, 3, 5, -1], queue empty.
    """
    capacity = queue.tokens.shape[0]
    width = max_tokens // num_shards  # tokens per shard block
    queued = jnp.arange(capacity) < queue.num_queued  # (Q,)
    shard = jnp.where(queued, queue.slot_ids // (capacity // num_shards), num_shards)  # (Q,)
    member = shard[:, None] == jnp.arange(num_shards)[None, :]  # (Q, shards)
    rank = jnp.sum((jnp.cumsum(member, axis=0) - 1) * member, axis=1)  # (Q,) place in its shard's line
    taken = queued & (rank < width)  # (Q,)
    at = jnp.where(taken, shard * width + rank, max_tokens)  # (Q,) entries not taken -> dropped

    def place(x):
        return jnp.full(max_tokens, INVALID, jnp.int32).at[at].set(x, mode="drop")  # (max_tokens,)

    slots = place(queue.slot_ids)
    key = jnp.where(slots >= 0, slots, jnp.iinfo(jnp.int32).max).reshape(num_shards, width)
    order = jnp.argsort(key, axis=1, stable=True) + width * jnp.arange(num_shards)[:, None]
    order = order.reshape(-1)  # (max_tokens,) each block sorted by slot, padding last
    left = queued & ~taken  # (Q,) entries that remain, moved to the front in order
    to = jnp.where(left, jnp.cumsum(left) - 1, capacity)

    def keep(x):
        return jnp.full(capacity, INVALID, jnp.int32).at[to].set(x, mode="drop")  # (Q,)

    rest = TokenQueue(keep(queue.tokens), keep(queue.slot_ids), keep(queue.pos_ids), jnp.sum(left))
    return rest, place(queue.tokens)[order], slots[order], place(queue.pos_ids)[order]


def shard_block(x: jax.Array, shard: jax.Array, num_shards: int) -> jax.Array:
    """Shard ``shard``'s block of a batch laid out in ``num_shards`` equal blocks along axis 0.

    Example: x = [10, 11, 12, 13], 2 shards -> shard 0 gets [10, 11], shard 1 gets [12, 13].
    """
    width = x.shape[0] // num_shards
    return jax.lax.dynamic_slice_in_dim(x, shard * width, width)


def shard_batch_info(
    seq_table: SequenceTable, page_table: PageTable, info: PageBatchInfo, token_slot_ids: jax.Array,
    token_pos_ids: jax.Array, shard: jax.Array, num_shards: int,
) -> PageBatchInfo:  # fmt: skip
    """One shard's part of a batch that ``allocate_on_shards`` described whole: its block of tokens
    (its own slots only), with page ids local to its slice of the pool.

    Example, page_size 4, pages 3-5 on shard 1: its slot 3 on pages [3, 4] writes position 6 to
    page 4, row 2 -> local page_indices [0, 1], new_token_dests 1 * 4 + 2 = 6.
    """
    mine = batch_info(
        seq_table,
        shard_block(token_slot_ids, shard, num_shards),
        shard_block(token_pos_ids, shard, num_shards),
        ~info.out_of_pages,
        info.pages_needed,
        info.pages_free,
    )
    first = shard * (page_table.num_pages // num_shards)  # my slice of the pool starts here
    return replace(
        mine,
        page_indices=jnp.where(mine.page_indices >= 0, mine.page_indices - first, INVALID),
        new_token_dests=jnp.where(
            mine.new_token_dests >= 0, mine.new_token_dests - first * mine.page_size, INVALID
        ),
    )
