"""L3: the block-tensor pool, the scheduler (queues, max_new_tokens, chunks, priority, preemption, abort) and
the batching engine against L2 and HF, with every invariant checked after every step."""

from __future__ import annotations

import random
import re

import hypothesis
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcourse.engine_config import EngineConfig
from kvcourse.harness.reference import hf_greedy
from kvcourse.harness.workloads import staggered
from L2_token_flat.allocator import BlockAllocator as L2Allocator
from L2_token_flat.engine import Engine as L2Engine
from L2_token_flat.sequence import Sequence as L2Sequence
from L2_token_flat.sequence import allocate_slots as l2_allocate_slots
from L3_block_tensor.allocator import BlockAllocator, OutOfBlocksError, blocks_needed
from L3_block_tensor.cache import KvPool
from L3_block_tensor.engine import Engine
from L3_block_tensor.scheduler import Scheduler
from L3_block_tensor.sequence import FinishReason, Sequence, Status, allocate_slots, slots

EOS = 2
TOKEN = 7  # what the fake model of the scheduler tests always answers (not eos)

_rng = random.Random(0)
PROMPTS = [[_rng.randrange(3, 49152) for _ in range(n)] for n in (1, 5, 12, 16, 17, 29, 40, 3)]
MAX_NEW = [24, 1, 17, 9, 24, 13, 20, 5]

# make test runs each smoke on the course model alone, 8 new tokens per prompt (make smoke runs both
# models and 64 tokens; tests/test_smokes.py runs every smoke on the tiny Qwen3 with a long prompt file).


# ---------------------------------------------------------------- storage


def test_pool_writes_through_the_flat_view():
    pool = KvPool(num_layers=2, num_blocks=3, block_size=4, num_kv_heads=1, head_dim=2)
    k = torch.arange(4.0).view(2, 1, 2)  # (T, H_kv, D)
    pool.set_kv(1, torch.tensor([9, 0]), k, -k)
    assert torch.equal(pool.k[1, 2, 1], k[0]) and torch.equal(
        pool.k[1, 0, 0], k[1]
    )  # slot 9 = block 2, row 1
    assert torch.equal(pool.v[1, 2, 1], -k[0])
    assert pool.k.abs().sum() == k.abs().sum() and pool.k[0].abs().sum() == 0
    assert pool.nbytes == 2 * 2 * 3 * 4 * 1 * 2 * 4


def test_slots_docstring_example():
    assert slots([7, 2], 2, 6, 4) == [30, 31, 8, 9]


@pytest.mark.parametrize("block_size", [1, 7, 16])
def test_block_table_slots_equal_l2_slot_indices(block_size):
    """L3 computes from the block table exactly the slots L2 kept per position."""
    n = 2 * blocks_needed(60, block_size)
    a2, a3 = L2Allocator(n, block_size), BlockAllocator(n, block_size)
    r2, r3, o2, o3 = L2Sequence([1]), Sequence(0, [1], 1), L2Sequence([2]), Sequence(1, [2], 1)
    for target in range(1, 60):
        l2_allocate_slots(r2, a2, target)
        allocate_slots(r3, a3, target)
        if target % 3 == 0:  # a neighbour grows too, so the blocks are not contiguous
            l2_allocate_slots(o2, a2, target)
            allocate_slots(o3, a3, target)
        assert r3.block_table == r2.block_table
        assert slots(r3.block_table, 0, target, block_size) == r2.slot_indices[:target]


def test_reserve_and_out_of_blocks_leave_state_unchanged():
    alloc = BlockAllocator(3, block_size=4)
    a, b = Sequence(0, [1], 1), Sequence(1, [2], 1)
    allocate_slots(a, alloc, 1)
    allocate_slots(b, alloc, 1)
    allocate_slots(a, alloc, 4)
    assert a.block_table == [0]
    allocate_slots(a, alloc, 6)
    assert a.block_table == [0, 2]
    before = (list(a.block_table), list(alloc.free_blocks), set(alloc.owned))
    with pytest.raises(OutOfBlocksError, match="need 1, only 0 free") as err:
        allocate_slots(a, alloc, 9)
    assert (err.value.needed, err.value.free) == (1, 0)
    assert (a.block_table, list(alloc.free_blocks), set(alloc.owned)) == before
    alloc.check_invariants([a.block_table, b.block_table])
    with pytest.raises(ValueError, match="block 1 is already free"):
        alloc.free([2, 1, 1])
    alloc.check_invariants([a.block_table, b.block_table])


# ---------------------------------------------------------------- scheduler, with a fake model


def make_scheduler(num_blocks=64, block_size=4, **kw) -> Scheduler:
    kw = {"max_num_seqs": 8, "max_num_batched_tokens": 64, **kw}
    return Scheduler(BlockAllocator(num_blocks, block_size), EngineConfig(**kw), eos_ids=(EOS,))


def submit(
    s: Scheduler, prompt_len: int, max_new: int, priority: int = 0, ignore_eos: bool = False
) -> Sequence:
    seq = Sequence(
        len(s.waiting) + len(s.running) + len(s.finished), [TOKEN] * prompt_len, max_new, ignore_eos, priority
    )
    s.add(seq)
    return seq


def fake_step(s: Scheduler, answer=lambda seq: TOKEN):
    """One engine step without a model: schedule, 'run', answer each row that wants a next token."""
    batch = s.schedule()
    wanted = [seq for seq, n in batch if seq.num_computed_tokens + n == seq.num_tokens]
    done = s.update(batch, [answer(seq) for seq in wanted])
    s.check_invariants()
    return [(seq.request_id, n) for seq, n in batch], done


def drain(s: Scheduler, answer=lambda seq: TOKEN) -> list[int]:
    """Step until nothing is left; returns request ids in the order they finished."""
    order = []
    while s.has_unfinished():
        order += [seq.request_id for seq in fake_step(s, answer)[1]]
    return order


def test_fcfs_admission_under_the_token_budget():
    s = make_scheduler(max_num_batched_tokens=12)
    for _ in range(3):
        submit(s, 5, 3)
    assert fake_step(s)[0] == [(0, 5), (1, 5)]  # request 2 would make 15 tokens > 12: it waits
    assert fake_step(s)[0] == [(0, 1), (1, 1), (2, 5)]
    assert fake_step(s)[0] == [(0, 1), (1, 1), (2, 1)]
    assert drain(s) == [2]


def test_max_num_seqs_caps_the_running_set():
    s = make_scheduler(max_num_seqs=2)
    for _ in range(3):
        submit(s, 2, 2)
    assert fake_step(s)[0] == [(0, 2), (1, 2)]
    _, done = fake_step(s)
    assert [r.request_id for r in done] == [0, 1]
    assert fake_step(s)[0] == [(2, 2)]


def test_chunked_prefill_feeds_the_prompt_a_chunk_per_step():
    s = make_scheduler(prefill_chunk_size=4)
    a = submit(s, 10, 2)
    b = submit(s, 1, 3)
    assert fake_step(s)[0] == [(0, 4), (1, 1)]
    assert a.output_ids == [] and b.output_ids == [TOKEN]  # a's chunk did not end its prompt
    assert fake_step(s)[0] == [(0, 4), (1, 1)]
    assert fake_step(s)[0] == [(0, 2), (1, 1)]
    assert a.output_ids == [TOKEN] and b.finish_reason is FinishReason.MAX_TOKENS
    assert fake_step(s)[0] == [(0, 1)]
    assert a.status is Status.FINISHED and s.allocator.num_free == s.allocator.num_blocks


def test_priority_first_then_arrival_order():
    s = make_scheduler(max_num_seqs=1)
    for priority in (0, 5, -1, 5, 0):
        submit(s, 3, 2, priority)
    assert drain(s) == [1, 3, 0, 4, 2]


def test_finish_reasons_and_eos_kept_in_the_output():
    s = make_scheduler()
    stops = submit(s, 3, 10)
    runs_on = submit(s, 3, 4, ignore_eos=True)
    max_new = submit(s, 3, 4)
    drain(s, answer=lambda seq: EOS if seq.request_id < 2 and len(seq.output_ids) == 1 else TOKEN)
    assert stops.output_ids == [TOKEN, EOS] and stops.finish_reason is FinishReason.EOS
    assert (
        runs_on.output_ids == [TOKEN, EOS, TOKEN, TOKEN] and runs_on.finish_reason is FinishReason.MAX_TOKENS
    )
    assert len(max_new.output_ids) == 4 and max_new.finish_reason is FinishReason.MAX_TOKENS


def test_preemption_sends_the_newest_back_and_recomputes():
    s = make_scheduler(num_blocks=6, block_size=4)  # 24 slots
    old = submit(s, 8, 8)  # 2 blocks now, up to 4
    new = submit(s, 8, 8)
    assert fake_step(s)[0] == [(0, 8), (1, 8)]
    for _ in range(4):  # both decode into their third block: 6 blocks in use
        fake_step(s)
    assert s.allocator.num_free == 0 and s.num_preemptions == 0
    assert fake_step(s)[0] == [(0, 1)]  # old needs a 4th block: new is preempted, frees 3
    assert s.num_preemptions == 1 and new.status is Status.WAITING and new.block_table == []
    assert new.num_computed_tokens == 0 and len(new.output_ids) == 5
    while old.status is not Status.FINISHED:
        fake_step(s)
    batch, _ = fake_step(s)
    assert batch == [(1, 8 + 5)]  # the prompt and the 5 tokens it had generated, recomputed at once
    assert drain(s) == [1] and len(new.output_ids) == 8


def test_preemption_spares_the_higher_priority():
    s = make_scheduler(num_blocks=4, block_size=2)
    low = submit(s, 2, 6, priority=-1)
    high = submit(s, 2, 6, priority=1)
    for _ in range(4):  # prefill (1 block each), then decode: at position 4 both need a third block
        fake_step(s)  # ... and only 4 exist: the low-priority one goes, though it came first
    assert s.num_preemptions >= 1 and low.status is Status.WAITING and high.status is Status.RUNNING
    assert drain(s) == [1, 0]


def test_a_step_that_preempts_admits_nobody():
    """The chapter's rule: waiting sequences are admitted only in a step that preempted nobody, so a
    newcomer never takes the blocks a victim just gave back. A high-priority request waits while two
    others fill the pool; when one of them is preempted, the step runs the survivor alone."""
    s = make_scheduler(num_blocks=4, block_size=2, max_num_seqs=2)
    submit(s, 2, 6)
    submit(s, 2, 6)
    fake_step(s)
    urgent = submit(s, 1, 1, priority=5)  # the running set is full: it waits
    while s.num_preemptions == 0:
        batch, _ = fake_step(s)
    assert batch == [(0, 1)] and urgent.status is Status.WAITING  # 1 block is free, and stays free
    assert s.allocator.num_free == 1
    assert fake_step(s)[0] == [(0, 1), (2, 1)]  # the next step admits it
    assert drain(s) == [0, 1]


def test_abort_frees_blocks_at_once():
    s = make_scheduler(max_num_seqs=1)
    running, waiting = submit(s, 6, 5), submit(s, 6, 5)
    fake_step(s)
    assert s.abort(waiting.request_id) is waiting and waiting.finish_reason is FinishReason.ABORTED
    assert s.abort(running.request_id).status is Status.FINISHED
    assert s.allocator.num_free == s.allocator.num_blocks and not s.has_unfinished()
    s.check_invariants()
    with pytest.raises(ValueError, match="no unfinished request with id 0"):
        s.abort(0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_num_seqs": 0}, "max_num_seqs must be >= 1, got 0"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens must be >= 1, got 0"),
        ({"prefill_chunk_size": 0}, "prefill_chunk_size must be >= 1 or None"),
    ],
)
def test_scheduler_options_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_scheduler(**kwargs)


@settings(max_examples=150, deadline=None)
@given(
    num_blocks=st.integers(4, 12),
    block_size=st.sampled_from([1, 2, 3, 4]),
    max_num_seqs=st.integers(1, 5),
    chunk=st.sampled_from([None, 1, 3, 8]),
    arrivals=st.lists(
        st.tuples(
            st.integers(0, 6), st.integers(1, 12), st.integers(1, 10), st.integers(-1, 1), st.integers(0, 20)
        ),
        min_size=2,
        max_size=10,
    ),
    aborts=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 9)), max_size=2),
)
def test_scheduler_property(num_blocks, block_size, max_num_seqs, chunk, arrivals, aborts):
    """Requests (arrival step, prompt length, max_new, priority, where the fake model says eos) join at
    random steps a pool small enough to preempt; some are aborted. After every step the invariants
    hold; at the end nothing leaks, and every request that was not aborted has exactly the tokens it
    would have produced alone."""
    s = make_scheduler(
        num_blocks,
        block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=16 if chunk else 64,
        prefill_chunk_size=chunk,
    )
    capacity = num_blocks * block_size
    pending = sorted(arrivals, key=lambda a: a[0])
    seqs: list[Sequence] = []
    eos_at: dict[int, int] = {}  # request id -> index of the output the fake model makes eos
    step = 0
    while pending or s.has_unfinished():
        while pending and pending[0][0] <= step:
            _, prompt_len, max_new, priority, eos = pending.pop(0)
            prompt_len = min(
                prompt_len, capacity - 1
            )  # what EngineConfig.check_requests guarantees: it fits alone
            seqs.append(submit(s, prompt_len, min(max_new, capacity - prompt_len), priority))
            eos_at[seqs[-1].request_id] = eos
        for at, which in aborts:
            if at == step and which < len(seqs) and seqs[which].status is not Status.FINISHED:
                s.abort(seqs[which].request_id)
        fake_step(s, answer=lambda seq: EOS if len(seq.output_ids) == eos_at[seq.request_id] else TOKEN)
        step += 1
    hypothesis.target(
        float(s.num_preemptions), label="preemptions"
    )  # steer the search towards memory pressure
    assert s.allocator.num_free == num_blocks and all(r.status is Status.FINISHED for r in seqs)
    for r in seqs:
        if r.finish_reason is not FinishReason.ABORTED:
            eos = eos_at[r.request_id]
            alone = [TOKEN] * eos + [EOS] if eos < r.max_new_tokens else [TOKEN] * r.max_new_tokens
            assert r.output_ids == alone
            assert r.finish_reason is (
                FinishReason.EOS if eos < r.max_new_tokens else FinishReason.MAX_TOKENS
            )


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


@pytest.fixture(scope="module")
def expected(tiny_qwen3_dir):
    """HF greedy on the test prompts (independent), which L2 must reproduce (the previous stage)."""
    hf = [r.tokens for r in hf_greedy(tiny_qwen3_dir, PROMPTS, MAX_NEW)]
    assert L2Engine(tiny_qwen3_dir).generate(PROMPTS, MAX_NEW) == hf
    return hf


def finish_clean(engine: Engine) -> None:
    engine.scheduler.check_invariants()
    assert not engine.has_unfinished() and engine.allocator.num_free == engine.allocator.num_blocks


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"block_size": 1},
        {"block_size": 7, "max_num_seqs": 3},
        {"prefill_chunk_size": 8},
        {"prefill_chunk_size": 3, "max_num_batched_tokens": 10},
        {"prefill_chunk_size": 1},
    ],
    ids=["default", "bs1", "bs7-seqs3", "chunk8", "chunk3-budget10", "chunk1"],
)
def test_all_at_once_equals_l2_and_hf(tiny_qwen3_dir, expected, kwargs):
    eng = checked(Engine(tiny_qwen3_dir, **kwargs))
    assert eng.generate(PROMPTS, MAX_NEW) == expected
    finish_clean(eng)
    assert eng.stats().preemptions == 0


def test_staggered_arrivals_equal_l2_and_hf(tiny_qwen3_dir, expected):
    eng = checked(Engine(tiny_qwen3_dir, block_size=4))
    assert staggered(eng, PROMPTS, MAX_NEW, every=2) == expected
    finish_clean(eng)


@pytest.mark.parametrize("chunk", [None, 5])
def test_preemption_changes_no_token(tiny_qwen3_dir, expected, chunk):
    need = max(
        blocks_needed(len(p) + b, 4) for p, b in zip(PROMPTS, MAX_NEW, strict=True)
    )  # the longest request alone
    eng = checked(Engine(tiny_qwen3_dir, block_size=4, num_blocks=need, prefill_chunk_size=chunk))
    assert eng.generate(PROMPTS, MAX_NEW) == expected
    stats = eng.stats()
    assert stats.preemptions >= 1
    finish_clean(eng)
    assert stats.kv_bytes_live <= stats.kv_bytes_pool and stats.blocks_held <= need


def test_priority_decides_who_runs_first(tiny_llama_dir):
    eng = checked(Engine(tiny_llama_dir, max_num_seqs=1))
    seqs = [eng.add_request([5, 6, 7], 3, priority=p, ignore_eos=True) for p in (0, 2, 1, 2)]
    order = []
    while eng.has_unfinished():
        order += [r.request_id for r in eng.step()]
    assert order == [1, 3, 2, 0] and all(len(r.output_ids) == 3 for r in seqs)
    finish_clean(eng)


def test_abort_mid_run_leaves_the_others_untouched(tiny_qwen3_dir, expected):
    eng = checked(Engine(tiny_qwen3_dir, block_size=4))
    seqs = [eng.add_request(p, b) for p, b in zip(PROMPTS, MAX_NEW, strict=True)]
    for _ in range(3):
        eng.step()
    victim = eng.abort(seqs[6].request_id)
    assert victim.finish_reason is FinishReason.ABORTED and victim.block_table == []
    while eng.has_unfinished():
        eng.step()
    assert [r.output_ids for i, r in enumerate(seqs) if i != 6] == expected[:6] + expected[7:]
    assert {r.finish_reason for r in seqs} <= {
        FinishReason.MAX_TOKENS,
        FinishReason.EOS,
        FinishReason.ABORTED,
    }
    finish_clean(eng)


def test_stats_count_steps_blocks_and_live_positions(tiny_llama_dir):
    eng = Engine(tiny_llama_dir, block_size=4, num_blocks=8)
    eng.generate([[1, 2, 3], [4, 5, 6, 7, 8]], [4, 2], ignore_eos=True)
    per_token = eng.model.cfg.kv_bytes_per_token()
    stats = eng.stats()
    assert stats.kv_bytes_pool == 32 * per_token
    assert stats.kv_bytes_live == (3 + 5 + 2) * per_token  # step 2: both decode; 3 + 5 cached, 2 new
    assert (stats.steps, stats.tokens_run, stats.preemptions) == (4, 3 + 5 + 2 + 1 + 1, 0)
    # live / held per step: (3 + 5) / (1 + 2 blocks), (4 + 6) / (1 + 2), (5) / (2), (6) / (2)
    assert stats.kv_utilization == pytest.approx((8 + 10 + 5 + 6) / (4 * (3 + 3 + 2 + 2)))
    assert (stats.blocks_held, stats.blocks_shared, stats.num_blocks, stats.block_size) == (3, 0, 8, 4)


@pytest.mark.parametrize(
    "kwargs, prompts, max_new, message",
    [
        ({}, [[]], 4, "prompt 0 is empty"),
        ({}, [[1, 2], [1, 49152]], 4, r"prompt 1: token id 49152 is outside the vocabulary \[0, 49152\)"),
        ({}, [[1]], 0, "max_new_tokens must be an integer >= 1, got 0"),
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
    assert not eng.has_unfinished(), "a refused batch must not be half submitted"
    with pytest.raises(ValueError, match=re.sub(r"^prompt \d+", "request", message)):
        eng.add_request(prompts[-1], max_new)  # the same check, one request at a time, named so


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"block_size": 0}, "block_size must be >= 1, got 0"),
        ({"num_blocks": 0}, "num_blocks must be >= 1, got 0"),
        ({"max_model_len": 4096}, r"max_model_len must be in \[1, 2048\] .*got 4096"),
        ({"max_num_batched_tokens": 100}, "max_num_batched_tokens=100 < max_model_len=2048"),
        ({"max_num_seqs": 0}, "max_num_seqs must be >= 1, got 0"),
    ],
)
def test_bad_engine_options_are_named(tiny_llama_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        Engine(tiny_llama_dir, **kwargs)
