"""The vLLM paper's Orca baselines (``kvcourse/orca.py``): their reservations and the buddy allocator.

- ``next_pow2`` and ``held_at_admission`` on numbers worked by hand from the paper's section 6.1 (a
  true output of 25 makes Pow2 reserve 32 positions for the output; Max reserves max_model_len;
  Oracle the prompt plus the true output);
- ``BuddyAllocator`` on hand-worked pools: the first tiling, splitting, merging back, ``grow``, the
  docstring's examples (its external fragmentation included), a failed allocation and refused frees
  that change nothing, and ``check_invariants`` failing on broken books;
- ``make_allocator``: the stage's free list on demand, a buddy allocator raising the stage's error
  under each Orca policy;
- a property test: random allocations, frees and growths against an independent bitmap model, in
  which a request of n blocks fits iff some aligned range [p, p + next_pow2(n)) inside the pool is
  free (for a buddy allocator that merges eagerly the two are the same);
- the L3 and L4 engines on a tiny checkpoint, at a pool that binds under each Orca policy: HF's
  tokens, no preemption, the books balance between steps, and each sequence's blocks are one run.
"""

from __future__ import annotations

import copy
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcourse.engine_config import EngineConfig
from kvcourse.harness.reference import hf_greedy
from kvcourse.orca import ADMISSION_POLICIES, BuddyAllocator, held_at_admission, make_allocator, next_pow2
from L3_block_tensor.allocator import BlockAllocator, OutOfBlocksError
from L3_block_tensor.engine import Engine as L3Engine
from L4_paged_kernel.engine import Engine as L4Engine

ORCA = ("oracle", "pow2", "max")


def buddy(num_blocks: int) -> BuddyAllocator:
    return BuddyAllocator(num_blocks, 16, OutOfBlocksError)


def books(a: BuddyAllocator) -> tuple:
    """Everything an allocator knows, to compare before and after a refused call."""
    return copy.deepcopy((a.num_blocks, a.free_runs, a.runs))


# ---------------------------------------------------------------- what each policy reserves


def test_next_pow2():
    assert [next_pow2(n) for n in (1, 2, 3, 5, 8, 9, 25, 1024, 1025)] == [1, 2, 4, 8, 8, 16, 32, 1024, 2048]
    with pytest.raises(ValueError, match="next_pow2 needs n >= 1, got 0"):
        next_pow2(0)


def test_held_at_admission_is_the_papers_section_6_1():
    # the paper's example: a true output of 25; Pow2 reserves 32 positions for it, the prompt on top
    assert [held_at_admission(p, 20, 25, 2048) for p in ADMISSION_POLICIES] == [0, 45, 20 + 32, 2048]
    assert held_at_admission("pow2", 100, 32, 2048) == 132  # a power of two already: no rounding
    assert held_at_admission("pow2", 100, 33, 2048) == 164  # 33 -> 64
    assert held_at_admission("pow2", 100, 1, 2048) == 101
    # capped by max_model_len: 1800 + min(256, 248)
    assert held_at_admission("pow2", 1800, 200, 2048) == 2048
    assert held_at_admission("pow2", 1500, 300, 2048) == 1500 + 512
    assert held_at_admission("max", 5, 1, 64) == 64  # whatever the request's length
    assert held_at_admission("oracle", 1800, 248, 2048) == 2048
    with pytest.raises(ValueError, match=r"admission_policy must be one of .*, got 'lru'"):
        held_at_admission("lru", 20, 25, 2048)


# ---------------------------------------------------------------- the buddy allocator by hand


@pytest.mark.parametrize(
    "num_blocks, tiling",
    [
        (1, {0: 1}),
        (6, {0: 4, 4: 2}),
        (8, {0: 8}),
        (13, {0: 8, 8: 4, 12: 1}),  # 13 = 8 + 4 + 1
        (48, {0: 32, 32: 16}),
    ],
)
def test_the_pool_starts_as_the_largest_aligned_runs(num_blocks, tiling):
    a = buddy(num_blocks)
    assert a.free_runs == tiling and a.runs == {}
    assert (a.num_free, a.num_used, a.largest_free_run) == (num_blocks, 0, max(tiling.values()))
    assert BuddyAllocator.largest_run(num_blocks) == max(tiling.values())
    a.check_invariants([])


def test_the_docstrings_split():
    a = buddy(8)
    assert a.alloc_blocks(3) == [0, 1, 2]  # the run 0..3; block 3 held but unused
    assert (a.runs, a.free_runs) == ({0: 4}, {4: 4})
    assert a.alloc_blocks(1) == [4]  # 4..7 -> 4..5 + 6..7 -> 4 + 5
    assert (a.runs, a.free_runs) == ({0: 4, 4: 1}, {5: 1, 6: 2})
    assert (a.num_free, a.num_used, a.largest_free_run) == (3, 5, 2)
    a.check_invariants([[0, 1, 2], [4]])
    assert a.alloc_blocks(2) == [6, 7]
    assert a.alloc_blocks(1) == [5]
    assert a.num_free == 0 and a.largest_free_run == 0
    b = buddy(12)  # free runs 0..7 and 8..11: the smallest that fits is split, not the first one
    assert b.alloc_blocks(2) == [8, 9] and b.free_runs == {0: 8, 10: 2}


def test_the_docstrings_external_fragmentation():
    a = buddy(8)
    tables = [a.alloc_blocks(2) for _ in range(4)]
    assert tables == [[0, 1], [2, 3], [4, 5], [6, 7]]
    a.free(tables[0])
    a.free(tables[2])
    assert a.free_runs == {0: 2, 4: 2} and a.num_free == 4
    before = books(a)
    for n in (4, 3):  # 4 blocks free, none of the two requests fits
        with pytest.raises(OutOfBlocksError) as error:
            a.alloc_blocks(n)
        assert str(error.value) == (
            f"out of KV blocks: need a run of 4 contiguous blocks (for {n}), the largest free run is 2 "
            "of 4 blocks free"
        )
        assert (error.value.needed, error.value.free) == (4, 4)
        assert books(a) == before  # a failed allocation changes nothing
    a.check_invariants([tables[1], tables[3]])
    # side by side is not enough: 2..5 free, but 2..3 and 4..5 are not buddies
    b = buddy(8)
    tables = [b.alloc_blocks(2) for _ in range(4)]
    b.free(tables[1])
    b.free(tables[2])
    assert b.free_runs == {2: 2, 4: 2}
    with pytest.raises(OutOfBlocksError):
        b.alloc_blocks(4)
    b.free(tables[0])  # 0..1 merges with its buddy 2..3, then 0..3 waits for 4..7
    assert b.free_runs == {0: 4, 4: 2}
    assert b.alloc_blocks(4) == [0, 1, 2, 3]


def test_frees_merge_back_to_the_first_tiling_in_any_order():
    rng = random.Random(44)
    for num_blocks in (8, 13, 48):
        for _ in range(20):
            a = buddy(num_blocks)
            first = dict(a.free_runs)
            tables = []
            while True:
                try:
                    tables.append(a.alloc_blocks(rng.randint(1, 5)))
                except OutOfBlocksError:
                    break
            rng.shuffle(tables)
            for i, table in enumerate(tables):
                a.free(table)
                a.check_invariants(tables[i + 1 :])
            assert a.free_runs == first and a.runs == {} and a.num_free == num_blocks


def test_grow_merges_the_new_blocks_with_their_buddies():
    a = buddy(6)
    a.grow(2)  # the docstring's example
    assert a.free_runs == {0: 8} and a.num_blocks == 8
    b = buddy(6)
    assert b.alloc_blocks(4) == [0, 1, 2, 3]
    b.grow(2)  # 6..7 merges with 4..5; 4..7 waits for 0..3
    assert (b.free_runs, b.runs) == ({4: 4}, {0: 4})
    b.check_invariants([[0, 1, 2, 3]])
    b.free([0, 1, 2, 3])
    assert b.free_runs == {0: 8}
    c = buddy(5)
    c.grow(0)
    assert c.free_runs == {0: 4, 4: 1}


def test_bad_frees_are_refused_and_free_nothing():
    a = buddy(8)
    x, y = a.alloc_blocks(3), a.alloc_blocks(2)  # runs 0..3 and 4..5
    a.free(y)
    before = books(a)
    for blocks, message in [
        ([4, 5], "block 4 does not start a run handed out"),  # freed already: a double free
        ([0, 1, 2, 0], "block 0 does not start a run handed out"),  # the same run twice in one call
        ([1], "block 1 does not start a run handed out"),  # inside a run, not its start
        ([8], r"block 8 is not in this pool \(ids 0..7\)"),
        ([-1], r"block -1 is not in this pool \(ids 0..7\)"),
        ([0, 1, 2, 9], "block 9 is not in this pool"),  # a good run first: still nothing freed
        ([0, 1, 2, 6], "block 6 does not start a run handed out"),
    ]:
        with pytest.raises(ValueError, match=message):
            a.free(blocks)
        assert books(a) == before, blocks
    a.free(x)
    assert a.free_runs == {0: 8}


def test_allocation_arguments():
    a = buddy(4)
    assert a.alloc_blocks(0) == [] and a.free_runs == {0: 4}
    with pytest.raises(ValueError, match="cannot allocate -1 blocks"):
        a.alloc_blocks(-1)
    with pytest.raises(OutOfBlocksError, match="need a run of 8 contiguous blocks \\(for 5\\)"):
        a.alloc_blocks(5)
    with pytest.raises(ValueError, match="num_blocks must be >= 1, got 0"):
        buddy(0)
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        BuddyAllocator(4, 0, OutOfBlocksError)


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda a: a.free_runs.pop(6), r"blocks in no run or two: \[6, 7\]"),  # leaked
        (lambda a: a.free_runs.update({5: 1}), r"blocks in no run or two: \[5\]"),  # overlap
        (lambda a: a.free_runs.update({6: 4}), "run 6\\+4 is not aligned"),
        (lambda a: (a.free_runs.pop(6), a.free_runs.update({6: 1, 7: 1})), "are buddies and were not merged"),
    ],
)
def test_check_invariants_catches_broken_books(corrupt, message):
    a = buddy(8)
    tables = [a.alloc_blocks(3), a.alloc_blocks(2)]  # runs 0..3, 4..5; 6..7 free
    a.check_invariants(tables)
    corrupt(a)
    with pytest.raises(AssertionError, match=message):
        a.check_invariants(tables)


def test_check_invariants_checks_the_owners():
    a = buddy(8)
    x, y = a.alloc_blocks(3), a.alloc_blocks(2)
    with pytest.raises(AssertionError, match=r"sequences hold runs \[0\], handed out \[0, 4\]"):
        a.check_invariants([x])  # a run nobody holds: leaked
    with pytest.raises(AssertionError, match=r"sequences hold runs \[0, 0, 4\]"):
        a.check_invariants([x, x, y])  # a run held twice
    with pytest.raises(AssertionError, match=r"holds 6, which starts no run"):
        a.check_invariants([x, [*y, 6]])


# ---------------------------------------------------------------- a property test against a bitmap


def aligned_free_start(free: list[bool], size: int) -> int | None:
    """The model: the lowest p with p % size == 0, p + size inside the pool and p .. p + size - 1 free."""
    for p in range(0, len(free) - size + 1, size):
        if all(free[p : p + size]):
            return p
    return None


@settings(max_examples=300, deadline=None)
@given(
    num_blocks=st.integers(1, 40),
    ops=st.lists(st.tuples(st.sampled_from(["alloc", "alloc", "free", "grow"]), st.integers(0, 1000)), max_size=60),
)
def test_buddy_allocator_agrees_with_a_bitmap(num_blocks, ops):
    a = buddy(num_blocks)
    free = [True] * num_blocks  # the model: which blocks no run handed out covers
    live: list[list[int]] = []  # block tables handed out and not freed
    for op, k in ops:
        if op == "alloc":
            n = k % (len(free) + 3)  # past the pool too
            size = next_pow2(n) if n else 0
            fits = n == 0 or aligned_free_start(free, size) is not None
            try:
                table = a.alloc_blocks(n)
            except OutOfBlocksError:
                assert not fits, f"{n} blocks fit the bitmap {free}, refused"
            else:
                assert fits, f"{n} blocks do not fit the bitmap {free}, handed {table}"
                if n:
                    p = table[0]
                    assert table == list(range(p, p + n)) and p % size == 0 and p + size <= len(free)
                    assert all(free[p : p + size]), f"run {p}+{size} was not free in {free}"
                    free[p : p + size] = [False] * size
                    live.append(table)
        elif op == "free" and live:
            table = live.pop(k % len(live))
            p, size = table[0], next_pow2(len(table))
            a.free(table)
            free[p : p + size] = [True] * size
        elif op == "grow":
            a.grow(k % 9)
            free += [True] * (k % 9)
        assert a.num_blocks == len(free) and a.num_free == sum(free)
        sizes = [1 << i for i in range(len(free).bit_length())]
        largest = max((s for s in sizes if aligned_free_start(free, s) is not None), default=0)
        assert a.largest_free_run == largest
        a.check_invariants(live)
    for table in live:
        a.free(table)
    assert a.free_runs == buddy(len(free)).free_runs  # everything back: the first tiling of this pool


# ---------------------------------------------------------------- the engines under each Orca policy

_rng = random.Random(44)
PROMPTS = [[_rng.randrange(3, 49152) for _ in range(n)] for n in (2, 9, 13, 3, 22, 6, 17, 5)]
MAX_NEW = [17, 6, 11, 20, 9, 14, 3, 12]  # every request ends within 32 positions
BLOCK, MAX_LEN, NUM_BLOCKS = 4, 32, 16


@pytest.fixture(scope="module")
def expected(tiny_qwen3_dir):
    return [r.tokens for r in hf_greedy(tiny_qwen3_dir, PROMPTS, MAX_NEW)]


@pytest.mark.parametrize("policy", ORCA)
@pytest.mark.parametrize("engine_class", [L3Engine, L4Engine], ids=["L3", "L4"])
def test_each_orca_policy_at_a_pool_that_binds_changes_no_token(engine_class, policy, tiny_qwen3_dir, expected):
    """Requests join one a step into 16 blocks of 4: a request waits while fewer than max_num_seqs run
    (memory binds), nothing is preempted, the books balance between steps, every running sequence's
    blocks are the first ids of one aligned run, and every token is HF's."""
    engine = engine_class(
        tiny_qwen3_dir, block_size=BLOCK, num_blocks=NUM_BLOCKS, max_model_len=MAX_LEN, admission_policy=policy
    )
    assert isinstance(engine.allocator, BuddyAllocator)
    pending, seqs, waited = list(zip(PROMPTS, MAX_NEW, strict=True)), [], False
    for _ in range(2000):
        if pending:
            seqs.append(engine.add_request(*pending.pop(0)))
        if not (pending or engine.has_unfinished()):
            break
        engine.step()
        engine.scheduler.check_invariants()  # runs engine.allocator.check_invariants(block tables)
        s = engine.scheduler
        waited |= bool(s.waiting) and len(s.running) < engine.config.max_num_seqs
        for seq in s.running:
            table = seq.block_table
            assert table == list(range(table[0], table[0] + len(table))), table
            assert table[0] % next_pow2(len(table)) == 0, table
    assert not pending and not engine.has_unfinished()
    assert [seq.output_ids for seq in seqs] == expected
    assert waited, "the pool never held a request back"
    assert engine.stats().preemptions == 0 and engine.allocator.num_free == NUM_BLOCKS


def test_make_allocator_gives_each_policy_its_books():
    config = EngineConfig(num_blocks=12, block_size=4)
    paged = make_allocator(config, BlockAllocator, OutOfBlocksError)
    assert type(paged) is BlockAllocator and (paged.num_blocks, paged.block_size) == (12, 4)
    for policy in ORCA:
        config = EngineConfig(num_blocks=12, block_size=4, admission_policy=policy, max_model_len=32)
        books = make_allocator(config, BlockAllocator, OutOfBlocksError)
        assert type(books) is BuddyAllocator and (books.num_blocks, books.block_size) == (12, 4)
        assert books.free_runs == {0: 8, 8: 4}
        with pytest.raises(OutOfBlocksError):  # the stage's error, which its scheduler catches
            books.alloc_blocks(9)
