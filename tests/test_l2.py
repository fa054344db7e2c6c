"""L2: the block allocator, allocate_slots() and the slot mapping, the token-flat pool, the engine against L1 and HF."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcourse.harness.reference import hf_greedy
from L1_contiguous.engine import Engine as L1Engine
from L2_token_flat.allocator import BlockAllocator, OutOfBlocksError, blocks_needed
from L2_token_flat.cache import KvPool
from L2_token_flat.engine import Engine
from L2_token_flat.sequence import Sequence, allocate_slots

PROMPTS = [[5, 17, 300, 42, 7], list(range(100, 137)), [9], [4093, 198] * 8]
MAX_NEW = [20, 9, 30, 17]

# make test runs this smoke on the course model alone, on 4 of its prompts, 8 new tokens each (make
# smoke runs both models, every prompt and 64 tokens; tests/test_smokes.py runs every smoke on the tiny Qwen3 with a long prompt file).


def books(alloc: BlockAllocator) -> tuple[list[int], set[int]]:
    """Everything an allocator knows, to check that a failed call changed none of it."""
    return list(alloc.free_blocks), set(alloc.owned)


def test_blocks_needed_docstring():
    assert [blocks_needed(n, 16) for n in (1, 16, 17, 0)] == [1, 1, 2, 0]


def test_alloc_and_free_follow_the_free_list():
    a = BlockAllocator(4, block_size=16)
    assert a.alloc_blocks(3) == [0, 1, 2]
    a.free([1])
    assert a.alloc_blocks(2) == [3, 1]  # a freed block goes to the back of the list
    assert a.num_free == 0 and a.alloc_blocks(0) == []
    a.check_invariants([[0, 2], [3, 1]])
    a.free([2, 0, 3, 1])
    assert a.num_free == 4
    a.check_invariants([])


def test_out_of_blocks_names_the_counts_and_changes_nothing():
    a = BlockAllocator(5, block_size=4)
    held = a.alloc_blocks(3)
    before = books(a)
    with pytest.raises(OutOfBlocksError, match="need 3, only 2 free") as err:
        a.alloc_blocks(3)
    assert isinstance(err.value, RuntimeError)
    assert (err.value.needed, err.value.free) == (3, 2)
    assert books(a) == before
    a.check_invariants([held])


@pytest.mark.parametrize(
    "blocks, message",
    [
        ([7], r"block 7 is not in this pool \(ids 0..3\)"),
        ([-1], "block -1 is not in this pool"),
        ([1], r"block 1 is already free \(double free\)"),
        ([0, 0], "block 0 is already free"),
        ([0, 9], "block 9 is not in this pool"),  # block 0 is valid, and must not be freed either
    ],
)
def test_free_rejects_unknown_ids_and_double_frees(blocks, message):
    a = BlockAllocator(4, block_size=2)
    assert a.alloc_blocks(1) == [0]
    before = books(a)
    with pytest.raises(ValueError, match=message):
        a.free(blocks)
    assert books(a) == before
    a.check_invariants([[0]])


def test_check_invariants_catches_broken_books():
    a = BlockAllocator(4, block_size=2)
    held = a.alloc_blocks(2)
    with pytest.raises(AssertionError, match="two owners"):
        a.check_invariants([held, held[:1]])
    with pytest.raises(AssertionError, match="sequences hold"):
        a.check_invariants([held[:1]])  # a block handed out that no request holds: a leak
    a.free_blocks.append(held[0])
    with pytest.raises(AssertionError, match="both free and owned"):
        a.check_invariants()
    a = BlockAllocator(4, block_size=2)
    a.free_blocks.popleft()
    with pytest.raises(AssertionError, match=r"blocks leaked: \[0\]"):
        a.check_invariants()
    a.free_blocks.extend([1, 9])
    with pytest.raises(AssertionError, match="twice"):
        a.check_invariants()


@pytest.mark.parametrize(
    "num_blocks, block_size, message",
    [(4, 0, "block_size must be >= 1, got 0"), (0, 4, "num_blocks must be >= 1, got 0")],
)
def test_allocator_sizes_are_checked(num_blocks, block_size, message):
    with pytest.raises(ValueError, match=message):
        BlockAllocator(num_blocks, block_size)


@settings(max_examples=150, deadline=None)
@given(
    num_blocks=st.integers(1, 10),
    ops=st.lists(
        st.tuples(st.sampled_from(["alloc", "free", "double_free", "unknown"]), st.integers(0, 12)),
        max_size=40,
    ),
)
def test_allocator_property(num_blocks, ops):
    """Random alloc/free sequences, good and bad: invariants hold throughout; failures change nothing."""
    a = BlockAllocator(num_blocks, block_size=3)
    owners: list[list[int]] = []
    freed: list[int] = []
    for op, x in ops:
        before = books(a)
        if op == "alloc":
            if x > a.num_free:
                with pytest.raises(OutOfBlocksError):
                    a.alloc_blocks(x)
                assert books(a) == before
            else:
                got = a.alloc_blocks(x)
                assert len(got) == x and not set(got) & {b for o in owners for b in o}
                owners.append(got)
        elif op == "free" and owners:
            blocks = owners.pop(x % len(owners))
            a.free(blocks)
            freed = blocks
        elif op == "double_free" and freed and not set(freed) & a.owned:
            with pytest.raises(ValueError, match="already free"):
                a.free(freed)
            assert books(a) == before
        elif op == "unknown":
            with pytest.raises(ValueError, match="not in this pool"):
                a.free([num_blocks + x])
            assert books(a) == before
        a.check_invariants(owners)
    for blocks in owners:
        a.free(blocks)
    assert a.num_free == num_blocks
    a.check_invariants([])


def test_reserve_docstring_example():
    alloc = BlockAllocator(8, block_size=4)
    a, b = Sequence([1]), Sequence([2])
    allocate_slots(a, alloc, 1)
    allocate_slots(b, alloc, 1)
    assert (a.block_table, b.block_table) == ([0], [1])
    allocate_slots(a, alloc, 4)
    assert a.block_table == [0]
    allocate_slots(a, alloc, 6)
    assert a.block_table == [0, 2] and a.slot_indices == [0, 1, 2, 3, 8, 9, 10, 11]


@pytest.mark.parametrize("block_size", [1, 7, 16])
def test_reserve_grows_block_by_block(block_size):
    """Token by token to 40: a new block exactly when a position crosses a block boundary."""
    alloc = BlockAllocator(2 * blocks_needed(40, block_size), block_size)
    seq, other = Sequence([1]), Sequence([2])
    for target in range(1, 41):
        before = list(seq.block_table)
        allocate_slots(seq, alloc, target)
        allocate_slots(other, alloc, target)  # interleaved, so the two requests' blocks are not contiguous
        assert len(seq.block_table) == blocks_needed(target, block_size)
        assert seq.block_table[: len(before)] == before
        assert seq.slot_indices == [b * block_size + w for b in seq.block_table for w in range(block_size)]
        assert all(
            seq.slot_indices[t] // block_size == seq.block_table[t // block_size] for t in range(target)
        )
    allocate_slots(seq, alloc, 3)  # shrinking never frees
    assert len(seq.block_table) == blocks_needed(40, block_size)
    assert not set(seq.slot_indices) & set(other.slot_indices)
    alloc.check_invariants([seq.block_table, other.block_table])


def test_reserve_out_of_blocks_leaves_request_and_allocator_unchanged():
    alloc = BlockAllocator(3, block_size=7)
    seq = Sequence([1])
    allocate_slots(seq, alloc, 14)  # 2 blocks
    alloc.alloc_blocks(1)  # someone else takes the last one
    before = (list(seq.block_table), list(seq.slot_indices), books(alloc))
    with pytest.raises(OutOfBlocksError, match="need 1, only 0 free"):
        allocate_slots(seq, alloc, 15)
    assert (seq.block_table, seq.slot_indices, books(alloc)) == before


def test_pool_writes_each_token_to_its_slot():
    pool = KvPool(num_layers=2, num_slots=12, num_kv_heads=1, head_dim=2)
    k = torch.arange(6.0).view(3, 1, 2)  # (T, H_kv, D)
    pool.set_kv(1, torch.tensor([8, 9, 0]), k, -k)
    assert torch.equal(pool.k[1, [8, 9, 0]], k) and torch.equal(pool.v[1, [8, 9, 0]], -k)
    assert pool.k[0].abs().sum() == 0 and pool.k[1, 1:8].abs().sum() == 0
    assert pool.nbytes == 2 * 2 * 12 * 1 * 2 * 4


@pytest.fixture(scope="module")
def references(tiny_qwen3_dir):
    """HF greedy and L1 on the test prompts: the independent expectations."""
    hf = [r.tokens for r in hf_greedy(tiny_qwen3_dir, PROMPTS, MAX_NEW)]
    l1 = L1Engine(tiny_qwen3_dir).generate(PROMPTS, MAX_NEW)
    assert hf == l1
    return hf


@pytest.mark.parametrize("block_size", [16, 1, 7])
def test_l2_equals_l1_and_hf(tiny_qwen3_dir, references, block_size):
    eng = Engine(tiny_qwen3_dir, block_size=block_size)
    assert eng.generate(PROMPTS, MAX_NEW) == references
    assert eng.allocator.num_free == eng.allocator.num_blocks
    eng.allocator.check_invariants([])


def test_invariants_hold_at_every_step_and_blocks_are_reused(tiny_llama_dir):
    eng = Engine(tiny_llama_dir, block_size=3, num_blocks=12)  # 36 slots: enough for one request at a time
    decode_step, steps = eng.decode_step, []

    def checked_decode_step(seq, token):
        eng.allocator.check_invariants([seq.block_table])
        assert len(seq.block_table) == blocks_needed(seq.num_computed_tokens, 3)
        steps.append(seq.num_computed_tokens)
        return decode_step(seq, token)

    eng.decode_step = checked_decode_step
    out = eng.generate([[1, 2, 3] * 5, [4], [7] * 20], [20, 30, 15], ignore_eos=True)
    assert [len(o) for o in out] == [20, 30, 15] and len(steps) == 19 + 29 + 14
    assert eng.allocator.num_free == 12
    eng.allocator.check_invariants([])
    per_token = eng.model.cfg.kv_bytes_per_token()
    stats = eng.stats()
    assert stats.kv_bytes_pool == 36 * per_token
    assert stats.kv_bytes_live == (20 + 14) * per_token  # the longest: 20 prompt + 15 new - 1 uncached
    assert stats.blocks_held == blocks_needed(20 + 14, 3) and stats.num_blocks == 12 and stats.block_size == 3
    assert stats.steps == 20 + 30 + 15  # a prefill and max_new_tokens - 1 decode steps per request
    assert 0.5 < stats.kv_utilization <= 1.0  # whole blocks of 3: at most 2 positions wasted per step


@pytest.mark.parametrize(
    "kwargs, prompts, max_new, message",
    [
        ({}, [[]], 4, "prompt 0 is empty"),
        ({}, [[1, 2], [1, 49152]], 4, r"prompt 1: token id 49152 is outside the vocabulary \[0, 49152\)"),
        (
            {"max_model_len": 64},
            [[1] * 60],
            5,
            r"prompt 0: 60 prompt tokens \+ max_new_tokens 5 = 65 exceeds max_model_len=64",
        ),
        (
            {"block_size": 4, "num_blocks": 3},
            [[1] * 4, [1] * 10],
            3,
            "prompt 1: 13 tokens need 4 blocks of 4, but the pool has only 3 blocks",
        ),
    ],
)
def test_bad_requests_are_named(tiny_llama_dir, kwargs, prompts, max_new, message):
    eng = Engine(tiny_llama_dir, **kwargs)
    with pytest.raises(ValueError, match=message):
        eng.generate(prompts, max_new)
    assert eng.allocator.num_free == eng.allocator.num_blocks


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"block_size": 0}, "block_size must be >= 1, got 0"),
        ({"block_size": -3}, "block_size must be >= 1, got -3"),
        ({"max_model_len": 4096}, r"max_model_len must be in \[1, 2048\] .*got 4096"),
        ({"num_blocks": 0}, "num_blocks must be >= 1, got 0"),
    ],
)
def test_bad_engine_options_are_named(tiny_llama_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        Engine(tiny_llama_dir, **kwargs)
