"""Independent answers to the L6 exercises, for the grader's hidden cases (``kvcourse/grading/hidden.py``).

Each function has the signature the notebook asks for and is written apart from the stage's own
code (``page_table.py``, ``kv_cache.py``, ``mesh/engine.py``), so a bug in the stage cannot make a wrong
answer pass: the allocation and the free step work on plain Python lists (a sorted list of free
pages, a loop over the slots), the KV write puts one token at a time into the pool in a
``lax.fori_loop`` (Levanter's first version; the stage scatters all tokens at once), and the specs
are spelled out axis by axis. The exercises beyond the stage have no stage code to differ from: their
answers here (``allocate_cow``, ``compact``) are the only implementations, held by ``exercises/L6_tpu_jax/checks.py`` to
literal values and to rules; ``test_allocate`` is L6.7's key (it catches every bug of ``CATCH_ALL``) and
``predict`` L6.8's, worked by hand.

``EXPECT`` maps each exercise to ``case -> observation``: the exercise's ``observe`` (``exercises/L6_tpu_jax/checks.py``)
run on the answer. L6.4's observation needs no devices (the specs are laid on an abstract mesh), so
the grader's process, with its one CPU device, computes it for meshes of any size. ``STAGE_ADAPTERS``
gives the stage's own code the learner's signature where the two differ, for the tests only. The
grader imports this file; a submission's sandbox cannot read it.

Left out on purpose: shortages (every hidden case has enough free pages, as the exercise says).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from exercises.L6_tpu_jax import checks
from exercises.L6_tpu_jax.checks import HIDDEN
from L6_tpu_jax.page_table import PageTable, SequenceTable, allocate_for_seq, free_pages_for_finished


def allocate(page_ref_counts, page_indices, seq_lens, slot_ids, positions, page_size):
    """Grow the slots of the batch, then hand out the free pages, lowest id first, slot by slot."""
    refs, table, lens = page_ref_counts.tolist(), page_indices.tolist(), seq_lens.tolist()
    for s, p in zip(slot_ids.tolist(), positions.tolist(), strict=True):
        lens[s] = max(lens[s], p + 1)
    free = sorted(page for page, count in enumerate(refs) if count == 0)
    for s, row in enumerate(table):
        held = sum(page >= 0 for page in row)
        for j in range(held, -(-lens[s] // page_size)):
            row[j] = free.pop(0)
            refs[row[j]] = 1
    dests = [
        table[s][p // page_size] * page_size + p % page_size for s, p in zip(slot_ids, positions, strict=True)
    ]
    i32 = np.int32
    return np.array(refs, i32), np.array(table, i32), np.array(lens, i32), np.array(dests, i32)


def free_finished(page_ref_counts, page_indices, seq_lens, used_mask, finished_mask):
    """One reference off every page a finished slot holds; its row, length and flag cleared."""
    refs, table, lens, used = (
        page_ref_counts.tolist(),
        page_indices.tolist(),
        seq_lens.tolist(),
        used_mask.tolist(),
    )
    for s, done in enumerate(finished_mask.tolist()):
        if done:
            for page in table[s]:
                if page >= 0:
                    refs[page] -= 1
            table[s], lens[s], used[s] = [-1] * len(table[s]), 0, False
    i32 = np.int32
    return np.array(refs, i32), np.array(table, i32), np.array(lens, i32), np.array(used, dtype=bool)


def write_kv_pages(kv_pages, dests, k, v):
    """One token at a time: its row of heads ``k0, v0, k1, v1, ...`` at ``dests[t]``, or, for a
    padding token (-1), row 0 written back with what it holds."""
    n_pages, page_size, two_h, dim = kv_pages.shape
    rows = jnp.zeros((k.shape[0], two_h, dim), kv_pages.dtype).at[:, 0::2].set(k).at[:, 1::2].set(v)
    flat = kv_pages.reshape(n_pages * page_size, two_h, dim)  # (P * page_size, 2 * H_kv, D)

    def put(t, flat):
        row = jnp.maximum(dests[t], 0)
        new = jnp.where(dests[t] >= 0, rows[t], flat[row])  # (2 * H_kv, D)
        return jax.lax.dynamic_update_slice(flat, new[None], (row, 0, 0))

    return jax.lax.fori_loop(0, dests.shape[0], put, flat).reshape(kv_pages.shape)


def mesh_specs():
    """Weights and tables whole on every device; each layer's pool cut along its page axis."""
    whole = PartitionSpec()
    return {"params": whole, "decode_state": whole, "kv_pages": PartitionSpec("data", None, None, None)}


def allocate_cow(page_ref_counts, page_indices, seq_lens, slot_ids, positions, page_size):
    """Slots in ascending order, each page a slot's new tokens write in ascending order: a missing
    page takes the lowest free one; a held page others hold too (refcount above 1) is swapped for the
    lowest free one and copied; a page held by this slot alone is written in place."""
    refs, table, lens = page_ref_counts.tolist(), page_indices.tolist(), seq_lens.tolist()
    writes = {}  # slot -> the logical pages its new tokens write, in order
    for s, p in zip(slot_ids.tolist(), positions.tolist(), strict=True):
        writes.setdefault(s, [])
        if p // page_size not in writes[s]:
            writes[s].append(p // page_size)
        lens[s] = max(lens[s], p + 1)
    taken, copies = [], []
    free = sorted(page for page, count in enumerate(refs) if count == 0)
    needed = 0
    trial = list(refs)  # the same walk, counting, before anything is taken
    for s in sorted(writes):
        for j in writes[s]:
            old = table[s][j]
            if old < 0 or trial[old] > 1:
                needed += 1
                if old >= 0:
                    trial[old] -= 1
    if needed > len(free):
        raise ValueError(f"the batch needs {needed} free pages and {len(free)} are free")
    for s in sorted(writes):
        for j in writes[s]:
            old = table[s][j]
            if old >= 0 and refs[old] == 1:
                continue  # this slot's own page: written in place
            new = free.pop(0)
            refs[new] = 1
            table[s][j] = new
            taken.append(new)
            if old >= 0:
                refs[old] -= 1
                copies.append((old, new))
    dests = [
        table[s][p // page_size] * page_size + p % page_size for s, p in zip(slot_ids, positions, strict=True)
    ]
    i32 = np.int32
    arrays = np.array(refs, i32), np.array(table, i32), np.array(lens, i32), np.array(dests, i32)
    return (*arrays, copies)


def compact(page_ref_counts, page_indices):
    """The pages in use, in ascending order, get ids 0, 1, ...; copying them in that order never
    overwrites a page still to be copied, since each new id is at most its old one."""
    refs, table = page_ref_counts.tolist(), page_indices.tolist()
    holders = [0] * len(refs)
    for row in table:
        for page in row:
            if page >= 0:
                holders[page] += 1
    for page, (count, held) in enumerate(zip(refs, holders, strict=True)):
        if count != held:
            raise ValueError(f"page {page}: refcount {count}, held {held} times")
    live = [page for page, count in enumerate(refs) if count > 0]
    new_id = {old: new for new, old in enumerate(live)}
    new_refs = [refs[old] for old in live] + [0] * (len(refs) - len(live))
    new_table = [[new_id[page] if page >= 0 else -1 for page in row] for row in table]
    moves = [(old, new) for new, old in enumerate(live) if old != new]
    return np.array(new_refs, np.int32), np.array(new_table, np.int32), moves


def predict():
    """Worked by hand from the notebook's five steps (page_size 4, pages 0..5, 3 slots):
    1. slot 0 takes 6 tokens: pages 0, 1;  2. slot 1 takes 3: page 2;
    3. slot 2 clones slot 0: shares page 0 (p0 = 2), a fresh page for the partial one: 3 (copy 1 -> 3);
    4. slot 0 finishes: p0 2 -> 1, p1 1 -> 0 (free);
    5. slot 1 at 3, 4 (position 4 starts a page: 1, the lowest free) and slot 2 at 6, 7, 8 (8 starts a
       page: 4): destinations 2*4+3, 1*4+0, 3*4+2, 3*4+3, 4*4+0."""
    return {
        "page_ref_counts": [1, 1, 1, 1, 1, 0],
        "page_indices": [[-1, -1, -1], [2, 1, -1], [0, 3, 4]],
        "seq_lens": [0, 5, 9],
        "new_token_dests": [11, 4, 14, 15, 16],
    }


def test_allocate(allocate_for_seq):
    """A test that catches every allocate_for_seq bug of L6.7: a decode that crosses into a page,
    a page 0 already held, a prefill from a scattered free list, and a batch the pool is short for."""
    e = -1

    def run(refs, table, lens, slots, pos, page_size=4):
        seqs = SequenceTable(
            seq_lens=jnp.asarray(lens, jnp.int32),
            page_indices=jnp.asarray(table, jnp.int32),
            used_mask=jnp.asarray([True] * len(lens)),
            page_size=page_size,
        )
        seqs, pages, info = allocate_for_seq(
            seqs,
            PageTable(jnp.asarray(refs, jnp.int32)),
            jnp.asarray(slots, jnp.int32),
            jnp.asarray(pos, jnp.int32),
        )
        return (
            pages.page_ref_counts.tolist(),
            seqs.page_indices.tolist(),
            seqs.seq_lens.tolist(),
            info.new_token_dests.tolist(),
        )

    # slot 0 holds page 0 (3 tokens), slot 1 page 2 (4 tokens); pages 1, 3, 4 free, 5 in use
    got = run([1, 0, 1, 0, 0, 1], [[0, e, e], [2, e, e]], [3, 4], [0, 1, 1, 1, 1, 1], [3, 4, 5, 6, 7, 8])
    assert got[0] == [1, 1, 1, 1, 0, 1], got  # two new pages, each refcount 1, lowest free first
    assert got[1] == [[0, e, e], [2, 1, 3]], got  # page 0 kept, slot 1 grows by pages 1 then 3
    assert got[2] == [4, 9], got
    assert got[3] == [3, 4, 5, 6, 7, 12], got
    # all or nothing: 3 pages needed, 2 free (1 and 3) -> nothing changes (same shapes: one compile)
    refs, table = [1, 0, 1, 0, 1, 1], [[0, e, e], [2, e, e]]
    got = run(refs, table, [4, 4], [0, 1, 1, 1, 1, 1], [4, 4, 5, 6, 7, 8])
    assert got[0] == refs and got[1] == table and got[2] == [4, 4], got


def tables(refs, page_indices, seq_lens, page_size, used=None) -> tuple[SequenceTable, PageTable]:
    """A ``SequenceTable`` and ``PageTable`` holding these NumPy arrays (used: slots with tokens)."""
    used = np.asarray(seq_lens) > 0 if used is None else used
    seqs = SequenceTable(
        seq_lens=jnp.asarray(seq_lens, jnp.int32),
        page_indices=jnp.asarray(page_indices, jnp.int32),
        used_mask=jnp.asarray(used, bool),
        page_size=page_size,
    )
    return seqs, PageTable(jnp.asarray(refs, jnp.int32))


def stage_allocate(page_ref_counts, page_indices, seq_lens, slot_ids, positions, page_size):
    """L6.1 by ``allocate_for_seq``, jit'd, the batch padded to 16, 32, ... tokens (padding slot -1),
    so that it compiles once per table shape and width."""
    n = len(slot_ids)
    width = max(16, 1 << (n - 1).bit_length())
    pad = np.full(width - n, -1, np.int32)
    slots, pos = np.concatenate([slot_ids, pad]), np.concatenate([positions, np.zeros(width - n, np.int32)])
    seqs, pages = tables(page_ref_counts, page_indices, seq_lens, page_size)
    seqs, pages, info = jax.jit(allocate_for_seq)(seqs, pages, jnp.asarray(slots), jnp.asarray(pos))
    return pages.page_ref_counts, seqs.page_indices, seqs.seq_lens, info.new_token_dests[:n]


def stage_free_finished(page_ref_counts, page_indices, seq_lens, used_mask, finished_mask):
    """L6.2 by ``free_pages_for_finished``, jit'd."""
    seqs, pages = tables(page_ref_counts, page_indices, seq_lens, 1, used=used_mask)
    seqs, pages = jax.jit(free_pages_for_finished)(seqs, pages, jnp.asarray(finished_mask))
    return pages.page_ref_counts, seqs.page_indices, seqs.seq_lens, seqs.used_mask


def stage_mesh_specs():
    """L6.4 by the mesh engine's own ``SPECS``."""
    from L6_tpu_jax.mesh.engine import SPECS

    return SPECS


ANSWERS = {
    "L6.1": allocate,
    "L6.2": free_finished,
    "L6.3": write_kv_pages,
    "L6.4": mesh_specs,
    "L6.5": allocate_cow,
    "L6.6": compact,
    "L6.7": test_allocate,
    "L6.8": predict,
}
EXPECT = {ex: (lambda case, ex=ex: HIDDEN[ex].observe(ANSWERS[ex], case)) for ex in ANSWERS}


def stage_test_allocate(subject):
    """L6.7 as an oracle test: the answer key's two batches on the subject and on the stage's own
    ``allocate_for_seq``, the results compared (a test the watch must refuse)."""
    for args in (
        ([1, 0, 1, 0, 0, 1], [[0, -1, -1], [2, -1, -1]], [3, 4], [0, 1, 1, 1, 1, 1], [3, 4, 5, 6, 7, 8]),
        ([1, 0, 1, 0, 1, 1], [[0, -1, -1], [2, -1, -1]], [4, 4], [0, 1, 1, 1, 1, 1], [4, 4, 5, 6, 7, 8]),
    ):
        seqs = SequenceTable(
            seq_lens=jnp.asarray(args[2], jnp.int32),
            page_indices=jnp.asarray(args[1], jnp.int32),
            used_mask=jnp.asarray([True] * len(args[2])),
            page_size=4,
        )
        pages, slots, pos = (
            PageTable(jnp.asarray(args[0], jnp.int32)),
            jnp.asarray(args[3]),
            jnp.asarray(args[4]),
        )
        mine, real = subject(seqs, pages, slots, pos), allocate_for_seq(seqs, pages, slots, pos)
        assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), mine, real))


STAGE_ADAPTERS = {
    "L6.1": stage_allocate,
    "L6.2": stage_free_finished,
    "L6.4": stage_mesh_specs,
    "L6.7": stage_test_allocate,
    "L6.8": lambda: checks.predict_steps()[-1][1],  # the five steps run on the stage
}
