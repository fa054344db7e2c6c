"""L5: the refcounted block allocator (refcounts, clones that copy the partial block, the chained-hash prefix cache, LRU reuse),
the scheduler's clones and prefix hits with a fake model, and the engine on tiny models: greedy clones
and prefix hits equal HF, cloned samples equal independent runs, every invariant after every step."""

from __future__ import annotations

import random
import re

import hypothesis
import pytest
import torch
from cpp_kernel import needs_cpp
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcourse.engine_config import EngineConfig
from kvcourse.harness.reference import hf_greedy
from kvcourse.sampling import SamplingParams
from L4_paged_kernel.engine import Engine as L4Engine
from L5_clones import prefix_cache
from L5_clones.allocator import BlockAllocator, OutOfBlocksError, blocks_needed
from L5_clones.cache import KvPool
from L5_clones.engine import Engine
from L5_clones.prefix_cache import block_hash, match_prefix
from L5_clones.scheduler import Scheduler
from L5_clones.sequence import FinishReason, Sequence, Status, allocate_slots, slots

EOS = 2
TOKEN = 7  # what the fake model of the scheduler tests always answers (not eos)
VOCAB = 16

_rng = random.Random(0)
PROMPTS = [[_rng.randrange(3, 49152) for _ in range(n)] for n in (1, 5, 12, 16, 17, 29, 40, 3)]
MAX_NEW = [24, 1, 17, 9, 24, 13, 20, 5]
SYSTEM = [_rng.randrange(3, 49152) for _ in range(37)]  # a shared "system prompt"
SAMPLED = SamplingParams(temperature=5.0, top_k=40, top_p=0.95, seed=11)  # hot: the tiny model is peaked

# make test runs this smoke on the course model alone, on 4 of its prompts, 8 new tokens each (make
# smoke runs both models, every prompt and 64 tokens; tests/test_smokes.py runs every smoke on the tiny Qwen3 with a long prompt file).


def snapshot(m: BlockAllocator, pool: KvPool | None = None):
    """Everything a failed operation must leave as it was."""
    books = (
        [(b.ref_count, b.hash, b.token_ids) for b in m.blocks],
        list(m.free_blocks),
        dict(m.hash_to_block),
    )
    return books if pool is None else (books, pool.k.clone(), pool.v.clone())


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, tuple) and len(a) == 3 and isinstance(a[1], torch.Tensor):
        return a[0] == b[0] and torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])
    return a == b


def full_request(m: BlockAllocator, request_id: int, tokens: list[int]) -> Sequence:
    """A request whose ``tokens`` are all computed: prefix hits shared, the rest allocated and registered."""
    seq = Sequence(request_id, list(tokens), 1)
    cached = match_prefix(seq.all_ids, m)
    allocate_slots(seq, m, len(tokens), cached)
    seq.num_computed_tokens = len(tokens)
    return seq


# ---------------------------------------------------------------- refcounted block allocator


def test_block_hash_chain_examples():
    first = block_hash(None, [1, 2])
    assert first == 10878768257076693884  # the same on every run: sha256, not Python's salted hash
    assert block_hash(first, [3, 4]) == 11438315679022258796
    assert block_hash(None, [3, 4]) == 3412362716378171258  # same tokens, another prefix: another key
    assert block_hash(None, (1, 2)) == first  # lists and tuples alike


def test_refcounts_through_alloc_share_and_free():
    m = BlockAllocator(4, block_size=2)
    assert m.alloc_blocks(2) == [0, 1]
    m.register(0, block_hash(None, [5, 6]), [5, 6])
    assert m.alloc_blocks(1, cached=[0]) == [0, 2]  # share block 0, plus a fresh one
    assert [b.ref_count for b in m.blocks] == [2, 1, 1, 0]
    m.check_invariants([[0, 1], [0, 2]])
    m.free([0, 1])
    assert [b.ref_count for b in m.blocks] == [1, 0, 1, 0] and list(m.free_blocks) == [3, 1]
    m.check_invariants([[0, 2]])
    m.free([0, 2])
    assert list(m.free_blocks) == [3, 1, 2, 0]  # the table goes back tail first
    assert m.blocks[0].hash is not None  # ... keeping its hash: still in the cache
    m.check_invariants([])


def test_double_free_and_unknown_ids_are_rejected_unchanged():
    m = BlockAllocator(3, block_size=2)
    m.alloc_blocks(2)
    before = snapshot(m)
    for bad, message in (
        ([1, 1], "block 1 is already free"),
        ([2], "block 2 is already free"),
        ([0, 7], "block 7 is not in this pool"),
    ):
        with pytest.raises(ValueError, match=message):
            m.free(bad)
        assert snapshot(m) == before
    m.free([0, 1])
    with pytest.raises(ValueError, match="block 0 is already free"):
        m.free([0])
    m.check_invariants([])


def test_out_of_blocks_leaves_everything_unchanged():
    m = BlockAllocator(4, block_size=2)
    a = full_request(m, 0, [1, 2, 3, 4, 5])  # blocks 0, 1 (full, registered), 2
    m.free(a.block_table)  # all free again, 0 and 1 still cached
    b = Sequence(1, [9], 1)
    allocate_slots(b, m, 1)  # takes block 3
    c = Sequence(2, [1, 2, 3, 4, 5, 6, 7], 1)
    cached = match_prefix(c.all_ids, m)
    assert cached == [0, 1]
    before = snapshot(m)
    with pytest.raises(OutOfBlocksError, match="need 4, only 3 free") as err:
        allocate_slots(c, m, 7, cached)  # reviving 0 and 1 uses up two free blocks, and 2 more are needed
    assert (err.value.needed, err.value.free) == (4, 3)
    assert snapshot(m) == before and c.block_table == []
    allocate_slots(c, m, 5, cached)  # 2 revived + 1 fresh, and the fresh one is not a revived one
    assert c.block_table == [0, 1, 2] and m.num_free == 0
    m.check_invariants([b.block_table, c.block_table])


def test_reserve_registers_the_blocks_a_step_fills():
    """The docstring example: with block_size 4, a request reaching 4 positions registers its block."""
    m = BlockAllocator(8, block_size=4)
    other = Sequence(1, [9], 1)
    a = Sequence(0, [10, 11, 12, 13, 14, 15], 1)
    allocate_slots(a, m, 1)
    allocate_slots(other, m, 1)
    assert a.block_table == [0] and m.blocks[0].hash is None
    allocate_slots(a, m, 4)
    assert a.block_table == [0] and m.blocks[0].hash == block_hash(None, [10, 11, 12, 13])
    assert m.hash_to_block == {m.blocks[0].hash: 0} and m.blocks[0].token_ids == (10, 11, 12, 13)
    a.num_computed_tokens = 4
    allocate_slots(a, m, 6)
    assert a.block_table == [0, 2] and m.blocks[2].hash is None  # 2 of 4 rows: not full, not cached
    m.check_invariants([a.block_table, other.block_table])


def test_match_prefix_never_takes_the_block_of_the_last_token():
    m = BlockAllocator(8, block_size=4)
    tokens = list(range(20, 29))  # 9 tokens: blocks 0, 1 full, block 2 partial
    a = full_request(m, 0, tokens)
    assert match_prefix(tokens, m) == a.block_table[:2]  # the 9th token runs
    assert match_prefix(tokens[:4] + [99], m) == a.block_table[:1]
    assert match_prefix(tokens[:8], m) == a.block_table[:1]  # ends on a boundary
    assert match_prefix([99] + tokens[1:], m) == []  # the chain breaks at block 0
    assert match_prefix(tokens[4:], m) == []  # same tokens, another prefix


def test_a_hash_hit_with_other_tokens_is_a_miss(monkeypatch):
    m = BlockAllocator(8, block_size=4)
    a = full_request(m, 0, [1, 2, 3, 4, 5])
    monkeypatch.setattr(prefix_cache, "block_hash", lambda prev, tokens: 42)  # every block collides
    a2 = full_request(m, 1, [1, 2, 3, 4, 5])  # misses a's real key; its block 0 is registered as 42
    assert match_prefix([1, 2, 3, 4, 5], m) == a2.block_table[:1]
    assert match_prefix([1, 2, 3, 9, 5], m) == []  # key 42 found, tokens differ
    assert m.lookup(42, [1, 2, 3, 9]) is None and m.lookup(42, [1, 2, 3, 4]) == a2.block_table[0]
    m.check_invariants([a.block_table, a2.block_table])


def test_freed_blocks_keep_their_hash_and_serve_a_later_prefix():
    m = BlockAllocator(6, block_size=4)
    a = full_request(m, 0, list(range(10)))  # blocks 0, 1 full; 2 partial
    m.free(a.block_table)
    assert m.num_free == 6 and m.blocks[0].hash is not None
    b = full_request(m, 1, list(range(8)) + [50, 51])  # same first 8 tokens, then others
    assert b.block_table[:2] == [0, 1] and m.blocks[0].ref_count == 1  # revived from the free list
    m.check_invariants([b.block_table])


def test_lru_allocation_forgets_the_oldest_freed_blocks_first():
    m = BlockAllocator(4, block_size=2)
    old = full_request(m, 0, [1, 2, 3, 4, 5])  # blocks 0, 1 full; 2
    new = full_request(m, 1, [6, 7])  # block 3, full; the pool is full
    m.free(old.block_table)  # free list 2, 1, 0 (tail first)
    m.free(new.block_table)  # ... 2, 1, 0, 3
    assert list(m.free_blocks) == [2, 1, 0, 3]
    assert match_prefix([1, 2, 3, 4, 5], m) == [0, 1]
    assert m.alloc_blocks(2) == [2, 1]  # block 1 is evicted: its key leaves the index
    assert m.blocks[1].hash is None and 1 not in m.hash_to_block.values()
    assert match_prefix([1, 2, 3, 4, 5], m) == [0]  # block 0 still hits
    assert match_prefix([6, 7, 8], m) == [3]  # the last freed survives longest
    m.check_invariants([[2], [1]])


def test_clone_docstring_example_and_copy_on_write_of_every_layer():
    m = BlockAllocator(9, block_size=4)
    pool = KvPool(num_layers=3, num_blocks=9, block_size=4, num_kv_heads=2, head_dim=3)
    pool.k.copy_(torch.randn(pool.k.shape, generator=torch.Generator().manual_seed(0)))
    pool.v.copy_(-pool.k)
    m.alloc_blocks(9)
    for b in (0, 1, 2):
        m.free([b])  # free list 0, 1, 2
    tokens = list(range(100, 110))
    m.register(3, block_hash(None, tokens[:4]), tokens[:4])
    m.register(5, block_hash(m.blocks[3].hash, tokens[4:8]), tokens[4:8])
    parent, other = [3, 5, 8], [4, 6, 7]
    before = pool.k.clone()
    children, copies = m.clone(parent, 10, 2)
    assert children == [[3, 5, 0], [3, 5, 1]] and copies == [(8, 0), (8, 1)]
    for src, dst in copies:
        pool.copy_block(src, dst)
    assert {b: m.blocks[b].ref_count for b in (3, 5, 8, 0, 1, 2)} == {3: 3, 5: 3, 8: 1, 0: 1, 1: 1, 2: 0}
    assert list(m.free_blocks) == [2]
    for copy in (0, 1):  # the partial block, K and V, in every layer
        assert torch.equal(pool.k[:, copy], pool.k[:, 8]) and torch.equal(pool.v[:, copy], pool.v[:, 8])
    untouched = [b for b in range(9) if b not in (0, 1)]
    assert torch.equal(pool.k[:, untouched], before[:, untouched])  # nothing else moved
    m.check_invariants([parent, other, *children])
    m.free(children[0])
    assert [m.blocks[b].ref_count for b in (3, 5, 0)] == [2, 2, 0]
    m.check_invariants([parent, other, children[1]])


def test_clone_on_a_block_boundary_copies_nothing_and_a_failed_clone_takes_nothing():
    m = BlockAllocator(3, block_size=2)
    pool = KvPool(1, 3, 2, 1, 1)
    a = full_request(m, 0, [1, 2, 3, 4])  # two full blocks, one free
    assert m.clone(a.block_table, 4, 3) == ([[0, 1]] * 3, [])  # everything shared, nothing copied
    assert m.num_free == 1 and m.blocks[0].ref_count == 4
    m.free([0, 1])
    m.free([0, 1])
    m.free([0, 1])
    b = full_request(m, 1, [1, 2, 3])  # block 0 hit; block 2 partial; the pool is full
    before = snapshot(m, pool)
    with pytest.raises(OutOfBlocksError, match="need 2, only 0 free"):
        m.clone(b.block_table, 3, 2)
    assert same(snapshot(m, pool), before)
    with pytest.raises(ValueError, match="2 blocks do not hold exactly 5 tokens"):
        m.clone(b.block_table, 5, 1)
    m.check_invariants([a.block_table, b.block_table])


def kv_value(tokens: list[int]) -> float:
    """What the fake model writes for the last of ``tokens``: a function of the whole prefix, exact
    in fp32 (below 2**24)."""
    v = 0
    for t in tokens:
        v = (v * 31 + t + 1) % 1_000_003
    return float(v)


@settings(max_examples=150, deadline=None)
@given(
    num_blocks=st.integers(2, 12),
    block_size=st.sampled_from([1, 2, 3, 4]),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["new", "append", "clone", "free"]),
            st.integers(0, 7),
            st.integers(1, 9),
            st.integers(0, 3),
        ),
        max_size=30,
    ),
)
def test_block_allocator_property(num_blocks, block_size, ops):
    """Random new requests (from three prompts with common prefixes, so the prefix cache hits, live
    or freed), appends, clones and frees on a small pool. A fake model writes into each computed
    position a value determined by the whole prefix. After every operation: the invariants hold,
    every live sequence reads back exactly its own prefix values (so no shared block was written
    and every hit and copy was right), and a failed operation changed nothing. At the end nothing
    leaks."""
    m = BlockAllocator(num_blocks, block_size)
    pool = KvPool(1, num_blocks, block_size, 1, 1)
    stems = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 9, 9, 9, 9, 9], [5, 5, 5, 5, 5, 5, 5, 5, 5]]
    live: list[Sequence] = []
    ids = iter(range(10**6))
    most_hits = most_shared = 0  # steer the search towards prefix hits and sharing

    def compute(seq: Sequence, start: int) -> None:
        """Run positions start .. num_tokens - 1 of ``seq`` through the fake model."""
        tokens = seq.all_ids
        where = torch.tensor(slots(seq.block_table, start, len(tokens), block_size))
        values = torch.tensor([kv_value(tokens[: p + 1]) for p in range(start, len(tokens))])
        pool.set_kv(0, where, values.view(-1, 1, 1), values.view(-1, 1, 1))
        seq.num_computed_tokens = len(tokens)

    for op, a, b, c in ops:
        before = (snapshot(m, pool), [list(r.block_table) for r in live])
        try:
            if op == "new":
                seq = Sequence(next(ids), stems[a % 3][:b] + ([10 + c] if c else []), 1)
                cached = match_prefix(seq.all_ids, m)
                allocate_slots(seq, m, seq.num_tokens, cached)
                compute(seq, len(cached) * block_size)
                live.append(seq)
                most_hits = max(most_hits, len(cached))
            elif op == "append" and live:
                seq = live[a % len(live)]
                new = [20 + c] * (b % 3 + 1)
                if seq.num_tokens + len(new) <= num_blocks * block_size:
                    seq.output_ids += new
                    try:
                        allocate_slots(seq, m, seq.num_tokens)
                    except OutOfBlocksError:
                        del seq.output_ids[-len(new) :]
                        raise
                    compute(seq, seq.num_computed_tokens)
            elif op == "clone" and live:
                parent = live[a % len(live)]
                tables, copies = m.clone(parent.block_table, parent.num_computed_tokens, c % 3 + 1)
                for src, dst in copies:
                    pool.copy_block(src, dst)
                for t in tables:
                    child = Sequence(
                        next(ids), parent.prompt_ids, 1, block_table=t, output_ids=list(parent.output_ids)
                    )
                    child.num_computed_tokens = parent.num_computed_tokens
                    live.append(child)
                most_shared = max(most_shared, m.num_shared)
            elif op == "free" and live:
                m.free(live.pop(a % len(live)).block_table)
        except OutOfBlocksError:
            assert same(snapshot(m, pool), before[0]) and [r.block_table for r in live] == before[1]
        m.check_invariants(r.block_table for r in live)
        for r in live:
            got = pool.k[0].view(-1)[torch.tensor(slots(r.block_table, 0, r.num_computed_tokens, block_size))]
            assert got.tolist() == [kv_value(r.all_ids[: p + 1]) for p in range(r.num_computed_tokens)]
    for r in live:
        m.free(r.block_table)
    m.check_invariants([])
    assert m.num_free == num_blocks
    hypothesis.target(float(most_hits), label="prefix hits")
    hypothesis.target(float(most_shared), label="shared blocks")


# ---------------------------------------------------------------- scheduler, with a fake model


def make_scheduler(num_blocks=64, block_size=4, **kw) -> Scheduler:
    kw = {"max_num_seqs": 8, "max_num_batched_tokens": 64, **kw}
    return Scheduler(BlockAllocator(num_blocks, block_size), EngineConfig(**kw), eos_ids=(EOS,))


def submit(s: Scheduler, prompt: list[int] | int, max_new: int, n: int = 1, priority: int = 0) -> Sequence:
    prompt = [TOKEN] * prompt if isinstance(prompt, int) else prompt
    seq = Sequence(
        len({r.request_id for r in s.waiting + s.running + s.finished}),
        prompt,
        max_new,
        priority=priority,
        num_samples=n,
    )
    s.add(seq)
    return seq


def fake_step(s: Scheduler):
    """One engine step without a model: schedule, 'run', answer TOKEN to every row that wants one."""
    batch = s.schedule()
    rows = sum(seq.num_computed_tokens + n == seq.num_tokens for seq, n in batch)
    logits = torch.zeros(rows, VOCAB)
    logits[:, TOKEN] = 1.0  # (rows, vocab): greedy picks TOKEN
    done, _ = s.update(batch, logits)  # the block copies: the engine's to make (no pool here)
    s.check_invariants()
    return [(seq.request_id, n) for seq, n in batch], done


def drain(s: Scheduler) -> None:
    while s.has_unfinished():
        fake_step(s)


def test_a_request_with_n_samples_prefills_once_then_clones():
    s = make_scheduler(block_size=4)
    seq = submit(s, 6, 3, n=3)
    assert fake_step(s)[0] == [(0, 6)]  # one prefill
    seqs = s.running
    assert [r.sample_index for r in seqs] == [0, 1, 2] and seqs[0] is seq and s.num_clones == 1
    assert [r.output_ids for r in seqs] == [[TOKEN]] * 3 and {r.request_id for r in seqs} == {0}
    shared, own = seqs[0].block_table[0], [r.block_table[1] for r in seqs]
    assert all(r.block_table[0] == shared for r in seqs) and len(set(own)) == 3
    assert s.allocator.blocks[shared].ref_count == 3
    assert fake_step(s)[0] == [(0, 1)] * 3  # then three separate decodes
    drain(s)
    assert [r.output_ids for r in s.finished] == [[TOKEN] * 3] * 3
    assert s.allocator.num_free == s.allocator.num_blocks


def test_the_scheduler_returns_a_clones_block_copies_and_holds_no_tensor():
    """The scheduler keeps the books and the engine the tensors: cloning a 6-token prompt (block_size 4)
    into 3 samples, ``update()`` returns the partial block's copies into the children's fresh blocks."""
    s = make_scheduler(block_size=4)
    seq = submit(s, 6, 3, n=3)
    batch = s.schedule()
    logits = torch.zeros(1, VOCAB)
    done, copies = s.update(batch, logits)
    children = s.running[1:]
    assert not done and [c.sample_index for c in children] == [1, 2]
    assert copies == [(seq.block_table[1], child.block_table[1]) for child in children]
    assert not any(isinstance(value, torch.Tensor) for value in vars(s).values())


def test_samples_count_against_max_num_seqs():
    s = make_scheduler(max_num_seqs=4)
    submit(s, 3, 2, n=3)
    submit(s, 3, 2, n=2)
    submit(s, 3, 2)
    assert fake_step(s)[0] == [(0, 3)]  # 3 + 2 seats > 4: request 1 waits, and so does 2 (FIFO)
    assert s.num_running_seqs() == 3
    fake_step(s)  # request 0's three samples finish
    assert fake_step(s)[0] == [(1, 3), (2, 3)]
    drain(s)


def test_same_step_admission_shares_blocks_registered_in_that_step():
    s = make_scheduler(block_size=4)
    a = submit(s, list(range(10, 20)), 2)  # 10 tokens: blocks 0, 1 full, 2 partial
    b = submit(s, list(range(10, 20)), 2)
    assert fake_step(s)[0] == [(0, 10), (1, 2)]  # b runs only its last partial block
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert s.allocator.num_used == 4 and s.prefix_cache_hits == 2
    drain(s)
    assert a.output_ids == b.output_ids == [TOKEN, TOKEN]


def test_clone_preempts_the_newest_request_to_find_room_for_its_copies():
    s = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=4)
    parent = submit(s, 3, 3, n=3)  # 1 partial block; its clone needs 2 copies
    other = submit(s, 7, 3)  # 2 blocks: 1 block left, so the clone must preempt
    assert fake_step(s)[0] == [(0, 3), (1, 7)]
    assert other.status is Status.WAITING and s.num_preemptions == 1 and s.num_clones == 1
    assert len(s.running) == 3 and parent.output_ids == [TOKEN] and other.output_ids == []
    drain(s)
    assert [len(r.output_ids) for r in s.finished] == [3, 3, 3, 3]


def test_a_parent_that_cannot_clone_goes_back_and_clones_after_its_recompute():
    s = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=4)
    other = submit(s, 7, 3)  # older: 2 blocks
    parent = submit(s, 3, 2, n=3)  # newest: its clone finds 1 free block of 2, so it goes itself
    fake_step(s)
    assert parent.status is Status.WAITING and parent.output_ids == [] and s.num_clones == 0
    while other.status is not Status.FINISHED:
        fake_step(s)
    drain(s)
    assert s.num_clones == 1 and [r.output_ids for r in s.finished if r.request_id == 1] == [[TOKEN] * 2] * 3


def test_a_step_that_preempts_admits_nobody():
    """Nothing is admitted in a step that preempted someone (so a block registered in the prefix cache
    this step is filled by this step): a high-priority request waits while two others fill the pool,
    and the step that preempts one of them runs the survivor alone."""
    s = make_scheduler(num_blocks=4, block_size=2, max_num_seqs=2)
    submit(s, 2, 6)
    submit(s, 2, 6)
    fake_step(s)
    urgent = submit(s, [9], 1, priority=5)  # the running set is full: it waits
    while s.num_preemptions == 0:
        batch, _ = fake_step(s)
    assert batch == [(0, 1)] and urgent.status is Status.WAITING and s.allocator.num_free == 1
    assert fake_step(s)[0] == [(0, 1), (2, 1)]  # the next step admits it
    drain(s)


def test_abort_cancels_every_sample_and_frees_their_blocks():
    s = make_scheduler()
    seq = submit(s, 6, 5, n=3)
    fake_step(s)
    seqs = s.abort(seq.request_id)
    assert len(seqs) == 3 and all(r.finish_reason is FinishReason.ABORTED for r in seqs)
    assert s.allocator.num_free == s.allocator.num_blocks and not s.has_unfinished()
    s.check_invariants()


# ---------------------------------------------------------------- the engine on a tiny model


def checked(engine: Engine) -> Engine:
    """Make every ``engine.step()`` end with the scheduler's (and allocator's) invariant checks."""
    step = engine.step

    def checked_step():
        done = step()
        engine.scheduler.check_invariants()
        return done

    engine.step = checked_step
    return engine


def finish_clean(engine: Engine) -> None:
    engine.scheduler.check_invariants()
    assert not engine.has_unfinished() and engine.allocator.num_free == engine.allocator.num_blocks


@pytest.fixture(scope="module")
def expected(tiny_qwen3_dir):
    """HF greedy on the test prompts (independent), which L4 must reproduce (the previous stage)."""
    hf = [r.tokens for r in hf_greedy(tiny_qwen3_dir, PROMPTS, MAX_NEW)]
    assert L4Engine(tiny_qwen3_dir).generate(PROMPTS, MAX_NEW) == hf
    return hf


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"block_size": 4},
        {"block_size": 7, "prefill_chunk_size": 5, "max_num_batched_tokens": 12},
        pytest.param(
            {"kernel": "cpp", "block_size": 7, "prefill_chunk_size": 5, "max_num_batched_tokens": 12},
            marks=needs_cpp,
        ),
    ],
    ids=["default", "bs4", "bs7-chunk5", "cpp-bs7-chunk5"],
)
def test_greedy_and_greedy_clones_equal_l4_and_hf(tiny_qwen3_dir, expected, kwargs):
    eng = checked(Engine(tiny_qwen3_dir, **kwargs))
    assert eng.generate(PROMPTS, MAX_NEW) == expected
    clones = checked(Engine(tiny_qwen3_dir, max_num_seqs=32, **kwargs)).generate_samples(
        PROMPTS, MAX_NEW, n=4
    )
    assert clones == [[e] * 4 for e in expected]
    finish_clean(eng)


def test_prefix_cache_skips_a_shared_system_prompt(tiny_qwen3_dir):
    """Two prompts sharing 37 tokens, block_size 8: the second request, alone or in the same step,
    shares the 4 full blocks of the shared part and computes 32 tokens less; outputs equal HF."""
    prompts = [SYSTEM + [101, 102, 103], SYSTEM + [201, 202]]
    ref = [r.tokens for r in hf_greedy(tiny_qwen3_dir, prompts, [6, 6])]
    uncached = checked(Engine(tiny_qwen3_dir, block_size=8, enable_prefix_caching=False))
    assert [uncached.generate([p], 6)[0] for p in prompts] == ref
    one_by_one = checked(Engine(tiny_qwen3_dir, block_size=8))
    assert [one_by_one.generate([p], 6)[0] for p in prompts] == ref  # the first one's blocks are free
    assert one_by_one.stats().prefix_cache_hits == 4  # 4 blocks of 8: 32 prompt tokens not run
    assert one_by_one.stats().tokens_run == uncached.stats().tokens_run - 32
    together = checked(Engine(tiny_qwen3_dir, block_size=8))
    assert together.generate(prompts, 6) == ref
    assert together.stats().prefix_cache_hits == 4 and together.stats().blocks_shared == 4
    finish_clean(together)


def test_identical_prompts_in_one_step_allocate_no_duplicate_blocks(tiny_llama_dir):
    prompt = SYSTEM[:35]  # block_size 8: 4 full blocks, then 3 tokens
    eng = checked(Engine(tiny_llama_dir, block_size=8))
    seqs = [eng.add_request(prompt, 4) for _ in range(3)]
    eng.step()  # all three admitted in this step
    assert seqs[1].block_table[:4] == seqs[2].block_table[:4] == seqs[0].block_table[:4]
    assert eng.allocator.num_used == 4 + 3 and eng.stats().prefix_cache_hits == 8
    assert eng.stats().tokens_run == 35 + 3 + 3
    while eng.has_unfinished():
        eng.step()
    ref = hf_greedy(tiny_llama_dir, [prompt], [4])[0].tokens
    assert [r.output_ids for r in seqs] == [ref] * 3
    finish_clean(eng)


@pytest.mark.parametrize(
    "kwargs", [{}, {"block_size": 5, "prefill_chunk_size": 7}], ids=["default", "bs5-chunk7"]
)
def test_sampled_clones_equal_independent_runs(tiny_qwen3_dir, kwargs):
    cloned = checked(Engine(tiny_qwen3_dir, max_num_seqs=24, **kwargs))
    shared = cloned.generate_samples(PROMPTS, MAX_NEW, n=3, sampling=SAMPLED)
    alone = checked(Engine(tiny_qwen3_dir, max_num_seqs=24, enable_prefix_caching=False, **kwargs))
    assert alone.generate_samples(PROMPTS, MAX_NEW, n=3, sampling=SAMPLED, share=False) == shared
    assert sum(len({tuple(s) for s in samples}) > 1 for samples in shared) >= 4  # the samples do differ
    assert cloned.stats().clones == len(PROMPTS) and cloned.stats().blocks_held < alone.stats().blocks_held
    finish_clean(cloned)


@pytest.mark.parametrize("chunk", [None, 5])
def test_preemption_with_clones_changes_no_token(tiny_qwen3_dir, expected, chunk):
    need = max(
        blocks_needed(len(p) + b, 4) for p, b in zip(PROMPTS, MAX_NEW, strict=True)
    )  # the longest alone
    small = dict(block_size=4, num_blocks=need, prefill_chunk_size=chunk, max_num_seqs=24)
    greedy = checked(Engine(tiny_qwen3_dir, **small))
    assert greedy.generate_samples(PROMPTS, MAX_NEW, n=3) == [[e] * 3 for e in expected]
    assert greedy.stats().preemptions >= 1
    finish_clean(greedy)
    sampled = checked(Engine(tiny_qwen3_dir, **small))
    reference = Engine(tiny_qwen3_dir, max_num_seqs=24).generate_samples(
        PROMPTS, MAX_NEW, n=3, sampling=SAMPLED
    )
    assert sampled.generate_samples(PROMPTS, MAX_NEW, n=3, sampling=SAMPLED) == reference
    assert sampled.stats().preemptions >= 1
    finish_clean(sampled)


def test_stats_count_a_shared_block_once(tiny_llama_dir):
    eng = Engine(tiny_llama_dir, block_size=4, num_blocks=16)
    eng.generate_samples([[5, 6, 7, 8, 9, 10, 11, 12]], 2, n=3, ignore_eos=True)
    # step 1: the 8-token prompt (2 full blocks); the clone shares both; step 2: each sample's first
    # token in a block of its own: 8 + 3 positions in 5 blocks, 2 of them shared
    stats = eng.stats()
    assert (stats.blocks_held, stats.blocks_shared, stats.clones, stats.steps) == (5, 2, 1, 2)
    assert stats.kv_bytes_live == 11 * eng.model.cfg.kv_bytes_per_token()
    assert stats.kv_utilization == pytest.approx((8 + 11) / (4 * (2 + 5)))


def test_staggered_arrivals_with_prefix_hits(tiny_qwen3_dir):
    from kvcourse.harness.workloads import staggered

    prompts = [SYSTEM + [300 + i] * (i + 1) for i in range(5)]
    ref = [r.tokens for r in hf_greedy(tiny_qwen3_dir, prompts, [8] * 5)]
    eng = checked(Engine(tiny_qwen3_dir, block_size=4))
    assert staggered(eng, prompts, [8] * 5, every=3) == ref
    assert eng.stats().prefix_cache_hits == 4 * 9  # each later request shares the 9 full blocks of SYSTEM
    finish_clean(eng)


@pytest.mark.parametrize(
    "kwargs, n, message",
    [
        ({}, 0, "n must be an integer >= 1, got 0"),
        ({"max_num_seqs": 4}, 5, "prompt 0: n=5 samples exceed max_num_seqs=4"),
        (
            {"block_size": 4, "num_blocks": 4},
            3,
            r"prompt 0: cloning 3 samples needs 5 blocks \(the prompt's, plus a copy of its last partial "
            r"block per extra sample\), but the pool has only 4 blocks",
        ),
    ],
)
def test_bad_sample_requests_are_named(tiny_llama_dir, kwargs, n, message):
    eng = Engine(tiny_llama_dir, **kwargs)
    with pytest.raises(ValueError, match=message):
        eng.generate_samples([[1] * 10], 2, n=n)
    with pytest.raises(ValueError, match=re.sub(r"^prompt \d+: ", "", message)):
        eng.add_request([1] * 10, 2, n=n)  # the same check, one request at a time
    assert not eng.has_unfinished()
    if n < 1:
        with pytest.raises(ValueError, match=message):
            eng.generate_samples([[1] * 10], 2, n=n, share=False)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"kernel": "cuda"}, "kernel must be one of"),
        ({"num_splits": 0}, "num_splits must be >= 1, got 0"),
        (
            {"kernel": "cpp", "num_splits": 2},
            "C\\+\\+ kernel has no split-KV path: num_splits must be 1, got 2",
        ),
        ({"block_size": 0}, "block_size must be >= 1, got 0"),
        ({"num_blocks": 0}, "num_blocks must be >= 1, got 0"),
        ({"max_model_len": 0}, r"max_model_len must be in \[1, 2048\] .*got 0"),
    ],
)
def test_bad_engine_options_are_named(tiny_llama_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        Engine(tiny_llama_dir, **kwargs)
