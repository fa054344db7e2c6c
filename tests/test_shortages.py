"""Partial shortages, on purpose: every allocator asked for more than it has while it has some.

The rule (DESIGN.md, "Errors and invariants"): a failed allocation leaves the allocator exactly as it
was. An allocator that hands out the blocks it has before it notices it lacks the rest breaks the rule
only when 0 < free < needed; with nothing free it fails cleanly by accident, and random operations
rarely land in between. So every property test here runs once per edge (room to spare, exactly what
is free, part of it free, none free, nothing asked; L5 adds its own), 150 examples each: it builds a
state that reaches that edge, classifies the state it really built from the allocator's own counts,
records it with hypothesis's ``event`` and fails unless it is the edge asked for. No edge can go
unexercised, and a generator that stopped reaching one fails instead of passing quietly.

- L2, L3, L4 (one free list; byte-identical ``allocator.py``): a sequence grows through its stage's
  ``allocate_slots()`` by several blocks at once;
- L5 (reference counts): fresh blocks, prefix-cache hits revived from the free list (each uses up a
  free block), and clones that copy a partial last block per child;
- L6 (``allocate_for_seq``, one jit'd function): a batch of up to three sequences, each growing by up
  to two pages, beside slots that hold pages and are not in the batch.
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, event, given, settings
from hypothesis import strategies as st

from kvcourse.harness.stages import STAGES
from L5_clones.allocator import BlockAllocator as L5Allocator
from L5_clones.allocator import OutOfBlocksError as L5OutOfBlocks
from L5_clones.prefix_cache import match_prefix
from L5_clones.sequence import Sequence as L5Sequence
from L5_clones.sequence import allocate_slots as l5_allocate_slots
from L6_tpu_jax.page_table import INVALID, PageTable, SequenceTable, allocate_for_seq, cdiv

EXAMPLES = 150  # per edge
EDGES = ("room to spare", "exactly what is free", "part of it free", "none free", "nothing asked")


def edge_of(free: int, needed: int) -> str:
    """Which edge a request for ``needed`` blocks meets with ``free`` free.

    Examples: (3, 2) -> room to spare, (3, 3) -> exactly what is free, (3, 5) -> part of it free,
    (0, 2) -> none free, (3, 0) -> nothing asked.
    """
    if needed == 0:
        return "nothing asked"
    if needed <= free:
        return "room to spare" if needed < free else "exactly what is free"
    return "part of it free" if free else "none free"


def met(edge: str, reached: str) -> None:
    """Record the edge a state really reached; fail if it is not the one the test was building."""
    event(reached)
    assert reached == edge, f"built a state for {edge!r}, reached {reached!r}"


def test_edge_of_examples():
    cases = {(3, 2): EDGES[0], (3, 3): EDGES[1], (3, 5): EDGES[2], (0, 2): EDGES[3], (3, 0): EDGES[4]}
    assert {k: edge_of(*k) for k in cases} == cases


# ---------------------------------------------------------------- L2, L3, L4: one free list


def new_sequence(stage: str, seq_module):
    return seq_module.Sequence([1]) if stage == "L2" else seq_module.Sequence(0, [1], 1)


def books(a, seq) -> tuple:
    return list(a.free_blocks), set(a.owned), list(seq.block_table), list(getattr(seq, "slot_indices", []))


@pytest.mark.parametrize("edge", EDGES)
@pytest.mark.parametrize("stage", ["L2", "L3", "L4"])
def test_a_sequence_that_cannot_grow_takes_no_block(stage, edge):
    """A sequence holding some blocks asks ``allocate_slots()`` for n more while others hold the rest of the
    pool and freed blocks sit in a shuffled free list. It gets all n (fresh, distinct, from the front
    of the free list) or, if fewer are free, ``OutOfBlocksError`` naming both counts and no change at
    all: not to the free list, not to the books, not to the sequence."""
    allocator = importlib.import_module(f"{STAGES[stage]}.allocator")
    sequence = importlib.import_module(f"{STAGES[stage]}.sequence")
    least_free = {"room to spare": 2, "exactly what is free": 1, "part of it free": 1}.get(edge, 0)

    @settings(max_examples=EXAMPLES, deadline=None)
    @given(num_blocks=st.integers(least_free + 1, 12), data=st.data())
    def grow(num_blocks, data):
        bs = 4
        held = data.draw(st.integers(0, min(3, num_blocks - max(least_free, 1))))
        free = 0 if edge == "none free" else data.draw(st.integers(least_free, num_blocks - held))
        a = allocator.BlockAllocator(num_blocks, bs)
        seq = new_sequence(stage, sequence)
        sequence.allocate_slots(seq, a, held * bs)
        others = [[b] for b in a.alloc_blocks(num_blocks - held)]  # everything else, one block each
        for i in data.draw(st.permutations(range(len(others))))[:free]:  # freed in a random order
            a.free(others[i])
            others[i] = []
        n = data.draw(
            {
                "room to spare": st.integers(1, free - 1),
                "exactly what is free": st.just(free),
                "part of it free": st.integers(free + 1, free + 4),
                "none free": st.integers(1, 4),
                "nothing asked": st.just(0),
            }[edge]
        )
        met(edge, edge_of(a.num_free, n))
        target = (held + n) * bs - (data.draw(st.integers(0, bs - 1)) if n else 0)
        before = books(a, seq)
        if n <= free:
            sequence.allocate_slots(seq, a, target)
            assert seq.block_table[held:] == before[0][:n] and len(seq.block_table) == held + n
        else:
            with pytest.raises(allocator.OutOfBlocksError) as err:
                sequence.allocate_slots(seq, a, target)
            assert (err.value.needed, err.value.free) == (n, free)
            assert books(a, seq) == before, "a failed allocation changed the allocator or the sequence"
        a.check_invariants([seq.block_table, *others])

    grow()


# ---------------------------------------------------------------- L5: reference counts, revivals, clones

L5_EDGES = (
    "fresh: room to spare",
    "fresh: part of it free",
    "fresh: none free",
    "revived: room to spare",
    "revived: they tip it over",
    "clone: room for every copy",
    "clone: copies for some children only",
    "clone: on a block boundary, none free",
)


def l5_edge(kind: str, free: int, fresh: int, revived: int = 0) -> str:
    """The edge of an L5 request for ``fresh`` new blocks plus ``revived`` cached ones sitting on the
    free list (a clone's copies count as fresh), with ``free`` free.

    Examples: ("revived", 3, 2, 2) -> they tip it over (2 fit, 2 + 2 do not); ("clone", 0, 0) -> on a
    block boundary, none free; ("clone", 1, 2) -> copies for some children only.
    """
    if kind == "clone" and fresh == 0:
        return "clone: on a block boundary, none free" if free == 0 else "clone: no copies"
    if fresh + revived <= free:
        return f"{kind}: " + ("room for every copy" if kind == "clone" else "room to spare")
    if kind == "revived":
        return "revived: they tip it over" if fresh <= free else "revived: fresh blocks alone are short"
    if kind == "clone":
        return "clone: copies for some children only" if free else "clone: none free"
    return "fresh: part of it free" if free else "fresh: none free"


def test_l5_edge_examples():
    assert l5_edge("revived", 3, 2, 2) == "revived: they tip it over"
    assert l5_edge("clone", 0, 0) == "clone: on a block boundary, none free"
    assert l5_edge("clone", 1, 2) == "clone: copies for some children only"
    assert l5_edge("fresh", 2, 1) == "fresh: room to spare"


def l5_books(m: L5Allocator):
    return (
        [(b.ref_count, b.hash, b.token_ids) for b in m.blocks],
        list(m.free_blocks),
        dict(m.hash_to_block),
    )


def l5_request(m: L5Allocator, request_id: int, tokens: list[int]) -> L5Sequence:
    """A request whose tokens are all computed: prefix hits shared, the rest allocated and registered."""
    seq = L5Sequence(request_id, list(tokens), 1)
    l5_allocate_slots(seq, m, seq.num_tokens, match_prefix(seq.all_ids, m))
    seq.num_computed_tokens = seq.num_tokens
    return seq


@pytest.mark.parametrize("edge", L5_EDGES)
def test_l5_failed_allocations_and_clones_take_nothing(edge):
    """Three ways L5 takes blocks, each at its edges. ``alloc_blocks`` of fresh blocks; of prefix-cache
    hits revived from the free list, which use up free blocks too (so n fresh blocks can fit while n
    plus the revived ones do not); and ``clone``, which needs one fresh block per child when the parent
    ends mid-block (none on a boundary). Success gives exactly that; a shortage raises
    ``OutOfBlocksError`` with the counts and leaves every refcount, hash, the free list and the cache
    index as they were."""
    kind = edge.split(":")[0]

    @settings(max_examples=EXAMPLES, deadline=None)
    @given(bs=st.sampled_from([2, 3, 4]), data=st.data())
    def run(bs, data):
        m = L5Allocator(16, bs)
        stem = [data.draw(st.integers(3, 99)) for _ in range(4 * bs)]
        live, cached = [], []
        if kind == "revived":  # r full blocks of an old request, freed but still in the cache
            r = data.draw(st.integers(1, 3))
            m.free(l5_request(m, 0, stem[: r * bs] + [1]).block_table)
        elif kind == "clone":  # a parent ending mid-block, or on a boundary
            partial = 0 if "boundary" in edge else 1
            parent = l5_request(m, 0, stem[: data.draw(st.integers(1, 3)) * bs + partial])
            live.append(parent.block_table)
        if edge.endswith("none free"):
            free = 0
        elif kind == "revived":
            free = data.draw(st.integers(r + 1, m.num_free))  # the cached blocks sit at the back
        elif kind == "clone":
            free = data.draw(st.integers(1, 3))
        else:
            free = data.draw(st.integers(1 if "part" in edge else 2, m.num_free))
        live += [[b] for b in m.alloc_blocks(m.num_free - free)]  # fill the pool from the front
        if kind == "revived":
            cached = match_prefix(stem[: r * bs] + [2, 2], m)
            assert len(cached) == r and all(m.blocks[b].ref_count == 0 for b in cached)
        n = data.draw(
            {
                "fresh: room to spare": lambda: st.integers(1, free - 1),
                "fresh: part of it free": lambda: st.integers(free + 1, free + 3),
                "fresh: none free": lambda: st.integers(1, 3),
                "revived: room to spare": lambda: st.integers(0, free - r),
                "revived: they tip it over": lambda: st.integers(free - r + 1, free),
                "clone: room for every copy": lambda: st.integers(1, free),
                "clone: copies for some children only": lambda: st.integers(free + 1, free + 3),
                "clone: on a block boundary, none free": lambda: st.integers(1, 3),
            }[edge]()
        )  # blocks asked for; for a clone, children
        before = l5_books(m)
        if kind == "clone":
            met(edge, l5_edge(kind, m.num_free, n * partial))
            if n * partial > free:
                with pytest.raises(L5OutOfBlocks) as err:
                    m.clone(parent.block_table, parent.num_computed_tokens, n)
                assert (err.value.needed, err.value.free) == (n, free)
                assert l5_books(m) == before, "a failed clone changed the allocator"
            else:
                tables, copies = m.clone(parent.block_table, parent.num_computed_tokens, n)
                assert len(tables) == n and len(copies) == n * partial
                live += tables
        else:
            met(edge, l5_edge(kind, m.num_free, n, len(cached)))
            if n + len(cached) <= free:
                got = m.alloc_blocks(n, cached)
                assert got[: len(cached)] == cached and len(set(got)) == n + len(cached)
                live.append(got)
            else:
                with pytest.raises(L5OutOfBlocks) as err:
                    m.alloc_blocks(n, cached)
                assert (err.value.needed, err.value.free) == (n + len(cached), free)
                assert l5_books(m) == before, "a failed allocation changed the allocator"
        m.check_invariants(live)

    run()


# ---------------------------------------------------------------- L6: allocate_for_seq

# 3 batch slots of up to 16 tokens (4 pages of 4) beside 2 slots that only hold pages; 8 pages; a
# batch of up to 12 tokens. One shape, so the function compiles once.
BATCH_SLOTS, FILLERS, PER_SEQ, PS, PAGES, T = 3, 2, 4, 4, 8, 12
allocate = jax.jit(allocate_for_seq)


@pytest.mark.parametrize("edge", EDGES)
def test_l6_allocate_for_seq_is_all_or_nothing(edge):
    """Up to three sequences of 0-8 tokens each bring 1-4 new tokens, so each may need 0, 1 or 2 new
    pages, while other slots hold the rest of the pool but the free pages the edge wants. Enough free
    pages: every sequence gets exactly its new pages, lowest free ids first, and the info says what it
    took. Too few, even one too few: ``out_of_pages``, no KV destination, the needed and free counts,
    and both tables exactly as they were (no page granted to the sequences that would have fit)."""

    grows = st.tuples(st.integers(0, 8), st.integers(1, 4))  # (length, new tokens)
    fits = st.tuples(st.integers(0, 1), st.integers(1, PS - 1)).flatmap(  # new tokens fit the last page
        lambda t: st.tuples(st.just(t[0] * PS + t[1]), st.integers(1, PS - t[1]))
    )

    @settings(max_examples=EXAMPLES, deadline=None)
    @given(
        batch=st.lists(fits if edge == "nothing asked" else grows, min_size=1, max_size=BATCH_SLOTS),
        data=st.data(),
    )
    def run(batch, data):
        held = [cdiv(length, PS) for length, _ in batch]
        needed = sum(cdiv(length + q, PS) for length, q in batch) - sum(held)
        room = PAGES - sum(held)  # pages the batch slots do not hold: free, or held by the others
        lo, hi = {
            "room to spare": (needed + 1, room),
            "exactly what is free": (needed, needed),
            "part of it free": (1, needed - 1),
            "none free": (0, 0),
            "nothing asked": (0, room),
        }[edge]
        assume((needed == 0) == (edge == "nothing asked") and lo <= hi <= room)
        free = data.draw(st.integers(lo, hi))
        pages = data.draw(st.permutations(range(PAGES)))  # who holds which page: a random layout
        rows = np.full((BATCH_SLOTS + FILLERS, PER_SEQ), INVALID, np.int32)
        lens = np.zeros(BATCH_SLOTS + FILLERS, np.int32)
        taken = 0
        for s, ((length, _), h) in enumerate(zip(batch, held, strict=True)):
            rows[s, :h], lens[s], taken = pages[taken : taken + h], length, taken + h
        others = room - free  # pages the slots outside the batch hold, up to a full row each
        for s in range(BATCH_SLOTS, BATCH_SLOTS + FILLERS):
            h = min(others, PER_SEQ)
            rows[s, :h], lens[s], taken, others = pages[taken : taken + h], h * PS, taken + h, others - h
        refs = np.zeros(PAGES, np.int32)
        refs[rows[rows >= 0]] = 1
        met(edge, edge_of(int((refs == 0).sum()), needed))
        seqs = SequenceTable(jnp.asarray(lens), jnp.asarray(rows), jnp.ones(len(lens), bool), PS)
        slots = [s for s, (_, q) in enumerate(batch) for _ in range(q)]
        pos = [length + i for length, q in batch for i in range(q)]
        pad = T - len(slots)
        new_seqs, new_pages, info = jax.device_get(
            allocate(
                seqs,
                PageTable(jnp.asarray(refs)),
                jnp.asarray(slots + [INVALID] * pad, jnp.int32),
                jnp.asarray(pos + [0] * pad, jnp.int32),
            )
        )
        new_rows, new_refs = np.asarray(new_seqs.page_indices), np.asarray(new_pages.page_ref_counts)
        if needed <= free:
            assert not info.out_of_pages and int(info.pages_needed) == needed
            lowest = np.flatnonzero(refs == 0)[:needed].tolist()
            granted = [int(p) for s in range(len(batch)) for p in new_rows[s, held[s] :] if p >= 0]
            assert granted == lowest  # in slot order, lowest free ids first
            for s, (length, q) in enumerate(batch):
                assert (new_rows[s, : held[s]] == rows[s, : held[s]]).all()  # its old pages stay
                assert (
                    int((new_rows[s] >= 0).sum()) == cdiv(length + q, PS)
                    and new_seqs.seq_lens[s] == length + q
                )
            assert (new_rows[BATCH_SLOTS:] == rows[BATCH_SLOTS:]).all()
            assert (new_refs == refs + np.isin(np.arange(PAGES), lowest)).all()
        else:
            assert info.out_of_pages and (int(info.pages_needed), int(info.pages_free)) == (needed, free)
            assert (np.asarray(info.new_token_dests) == INVALID).all()
            assert (new_rows == rows).all() and (new_refs == refs).all(), "a failed allocation granted pages"
            assert (np.asarray(new_seqs.seq_lens) == lens).all()

    run()
