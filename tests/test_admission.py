"""A pool sized in bytes and the vLLM paper's admission policies (issues 35, 44), on tiny seeded checkpoints.

- ``held_at_admission``: each policy's reservation on hand-worked lengths (``tests/test_orca.py`` has
  the paper's own example and the buddy allocator);
- each policy's admission rule, with a fake model: how many requests one step admits to a pool,
  worked out by hand from the policy's definition (on_demand: a prompt's blocks; Oracle: its whole length;
  Pow2: the prompt plus the output rounded up to a power of two; Max: max_model_len; each Orca policy's
  blocks one buddy run of a power of two), and no preemption under a reserving policy;
- a pool given in bytes is sized into blocks as 2 x H_kv x D x layers x 4 bytes a token (the set-up line
  shows the sum), is never grown, never has more blocks in use than it holds, and bytes too few
  for one request is refused naming the bytes needed and given; in L3-L5 and in L6 (one device and a
  one-device mesh);
- under pressure (a pool just big enough for the longest reservation, requests arriving over
  time), every policy in L3 and L4, and on_demand in L5, produces HF's greedy tokens; L5 takes no
  ``admission_policy``.
"""

from __future__ import annotations

import random

import jax
import pytest

from kvcourse.config import ModelConfig
from kvcourse.engine_config import EngineConfig
from kvcourse.harness.reference import hf_greedy
from kvcourse.limits import blocks_for_bytes
from kvcourse.orca import ADMISSION_POLICIES, held_at_admission, make_allocator
from L3_block_tensor.allocator import BlockAllocator, OutOfBlocksError
from L3_block_tensor.engine import Engine as L3Engine
from L3_block_tensor.scheduler import Scheduler
from L3_block_tensor.sequence import Sequence
from L4_paged_kernel.engine import Engine as L4Engine
from L5_clones.engine import Engine as L5Engine
from L6_tpu_jax.engine import Engine as L6Engine
from L6_tpu_jax.mesh.engine import MeshEngine

_rng = random.Random(35)
PROMPTS = [[_rng.randrange(3, 49152) for _ in range(n)] for n in (2, 9, 13, 3, 22, 6, 17, 5)]
MAX_NEW = [17, 6, 11, 20, 9, 14, 3, 12]  # every request ends within 32 positions
BLOCK, MAX_LEN = 4, 32
TOKEN_BYTES = 2 * 2 * 16 * 2 * 4  # the tiny checkpoints: 2 (K, V) x 2 KV heads x 16 dims x 2 layers x fp32
BLOCK_BYTES = BLOCK * TOKEN_BYTES  # 2,048
KV_BYTES = 10 * BLOCK_BYTES + 1000  # 10 blocks: Max's 8 for one request, and 2 to spare


@pytest.fixture(scope="module")
def expected(tiny_qwen3_dir):
    return [r.tokens for r in hf_greedy(tiny_qwen3_dir, PROMPTS, MAX_NEW)]


def test_held_at_admission_of_each_policy():
    # prompt 60 + output 40: Oracle 100; Pow2 60 + 64 (40 rounded up); Max max_model_len
    assert [held_at_admission(p, 60, 40, 2048) for p in ADMISSION_POLICIES] == [0, 100, 124, 2048]
    assert [held_at_admission(p, 64, 64, 2048) for p in ADMISSION_POLICIES] == [0, 128, 128, 2048]
    assert held_at_admission("pow2", 1500, 300, 1800) == 1800  # 1500 + 512 would pass max_model_len
    assert held_at_admission("pow2", 1, 1, 2048) == 2


# ---------------------------------------------------------------- the admission rule, with a fake model


def scheduler(policy: str, **limits) -> Scheduler:
    """L3's scheduler over the allocator the engine gives ``policy``: blocks of 4, max_model_len 32."""
    config = EngineConfig(block_size=4, admission_policy=policy, max_model_len=32, **limits)
    return Scheduler(make_allocator(config, BlockAllocator, OutOfBlocksError), config)


def admitted_at_first_step(policy: str) -> tuple[int, list[int]]:
    """20 requests of prompt 2 + max_new_tokens 5 on 16 blocks of 4, max_model_len 32, with the
    engine's allocator for the policy: how many the first step admits, and the blocks each holds."""
    s = scheduler(policy, num_blocks=16, max_num_seqs=32, max_num_batched_tokens=256)
    for i in range(20):
        s.add(Sequence(i, [7] * 2, 5, ignore_eos=True))
    batch = s.schedule()
    return len(batch), [len(seq.block_table) for seq, _ in batch]


@pytest.mark.parametrize(
    "policy, count, blocks",
    [
        ("on_demand", 16, 1),  # a 2-token prompt fills 1 block of 4: 16 blocks admit 16 requests
        ("oracle", 8, 2),  # 2 + 5 = 7 positions: 2 blocks, a run of 2; 16 / 2 = 8
        ("pow2", 4, 3),  # 2 + 8 (5 rounded up) = 10 positions: 3 blocks, a run of 4; 16 / 4 = 4
        ("max", 2, 8),  # max_model_len 32: 8 blocks, a run of 8; 16 / 8 = 2
    ],
)
def test_each_policy_admits_what_its_reservation_allows(policy, count, blocks):
    assert admitted_at_first_step(policy) == (count, [blocks] * count)


@pytest.mark.parametrize("policy", ADMISSION_POLICIES)
def test_reserving_policies_never_preempt_and_drain_clean(policy):
    """Stepped to the end with a fake model: the books balance after every step (a running sequence
    holds its reservation), blocks in use never pass the pool, and only on_demand ever preempts."""
    s = scheduler(policy, num_blocks=12, max_num_seqs=8, max_num_batched_tokens=64)
    for i, (p, b) in enumerate(zip(PROMPTS, MAX_NEW, strict=True)):
        s.add(Sequence(i, list(p), b, ignore_eos=True))
    while s.has_unfinished():
        batch = s.schedule()
        assert s.allocator.num_used <= 12
        wanted = [seq for seq, n in batch if seq.num_computed_tokens + n == seq.num_tokens]
        s.update(batch, [5] * len(wanted))
        s.check_invariants()
    assert s.allocator.num_free == 12 and len(s.finished) == len(PROMPTS)
    assert (s.num_preemptions > 0) == (policy == "on_demand")


def test_unknown_policy_and_max_without_a_length_are_refused():
    with pytest.raises(
        ValueError,
        match=r"admission_policy must be one of \('on_demand', 'oracle', 'pow2', 'max'\), got 'lru'",
    ):
        EngineConfig(max_num_seqs=1, max_num_batched_tokens=8, admission_policy="lru")
    with pytest.raises(ValueError, match="admission_policy 'max' needs max_model_len"):
        EngineConfig(max_num_seqs=1, max_num_batched_tokens=8, admission_policy="max")


# ---------------------------------------------------------------- a pool in bytes


def test_blocks_for_bytes_is_the_course_arithmetic(tiny_qwen3_dir):
    cfg = ModelConfig.from_dir(tiny_qwen3_dir)
    assert cfg.kv_bytes_per_token() == TOKEN_BYTES
    assert blocks_for_bytes(KV_BYTES, BLOCK, cfg) == 10
    assert blocks_for_bytes(BLOCK_BYTES, BLOCK, cfg) == 1
    with pytest.raises(
        ValueError, match="kv_cache_bytes=2,047 holds no block: one block of 4 tokens takes 2,048 bytes"
    ):
        blocks_for_bytes(BLOCK_BYTES - 1, BLOCK, cfg)
    with pytest.raises(ValueError, match="give num_blocks or kv_cache_bytes, not both"):
        blocks_for_bytes(KV_BYTES, BLOCK, cfg, num_blocks=4)


@pytest.mark.parametrize("engine_class", [L3Engine, L4Engine, L5Engine], ids=["L3", "L4", "L5"])
def test_bytes_size_the_pool_show_their_sum_and_refuse_a_request_it_cannot_hold(
    engine_class, tiny_qwen3_dir
):
    engine = engine_class(tiny_qwen3_dir, block_size=BLOCK, kv_cache_bytes=KV_BYTES, max_model_len=MAX_LEN)
    assert engine.allocator.num_blocks == 10
    assert engine.pool.k.shape[1] == 10 and engine.pool.nbytes == 10 * BLOCK_BYTES <= KV_BYTES
    assert (
        "kv_cache_bytes 21,480 / (2 x 2 KV heads x 16 dims x 2 layers x 4 bytes = 512 bytes a token, "
        "x 4 a block) = 10 blocks: 10 blocks of 4 (20.0 KiB of KV)"
    ) in engine.stats().describe()
    with pytest.raises(
        ValueError,
        match=r"prompt 0: 31 tokens need 8 blocks of 4, but the pool has only 6 blocks: 16,384 bytes of KV "
        r"needed, kv_cache_bytes=12,288 given",
    ):
        small = engine_class(
            tiny_qwen3_dir, block_size=BLOCK, kv_cache_bytes=6 * BLOCK_BYTES, max_model_len=MAX_LEN
        )
        small.generate([PROMPTS[4]], [9])


@pytest.mark.parametrize("engine_class", [L3Engine, L4Engine], ids=["L3", "L4"])
def test_max_holds_max_model_len_and_says_so(engine_class, tiny_qwen3_dir):
    maxed = engine_class(
        tiny_qwen3_dir,
        block_size=BLOCK,
        kv_cache_bytes=6 * BLOCK_BYTES,
        max_model_len=MAX_LEN,
        admission_policy="max",
    )
    with pytest.raises(
        ValueError, match="request: 32 tokens need 8 blocks of 4, but the pool has only 6 blocks"
    ):
        maxed.add_request([5], 1)  # one token, but Max holds max_model_len
    assert "admission_policy max" in maxed.stats().describe()


@pytest.mark.parametrize(
    "engine_class, policy",
    [(e, p) for e in (L3Engine, L4Engine) for p in ADMISSION_POLICIES] + [(L5Engine, "on_demand")],
    ids=[f"{e}-{p}" for e in ("L3", "L4") for p in ADMISSION_POLICIES] + ["L5-on_demand"],
)
def test_every_policy_in_a_tight_pool_changes_no_token(engine_class, policy, tiny_qwen3_dir, expected):
    """Requests join one every 2 steps (and all at once) in a 10-block pool: the pool is never
    grown, blocks in use never pass it, the books balance after every step, and every token is HF's.
    Under an Orca policy 10 blocks are a run of 8 and one of 2, and every request here needs a run of
    4 or 8: one runs at a time. (L5 takes no admission_policy: it allocates on demand.)"""
    policy_option = {"admission_policy": policy} if "admission_policy" in engine_class.OPTIONS else {}
    engine = engine_class(
        tiny_qwen3_dir, block_size=BLOCK, kv_cache_bytes=KV_BYTES, max_model_len=MAX_LEN, **policy_option
    )
    for every in (2, 0):
        pending, seqs, step = list(zip(PROMPTS, MAX_NEW, strict=True)), [], 0
        while pending or engine.has_unfinished():
            if pending and (not every or step % every == 0):
                take = 1 if every else len(pending)
                seqs += [engine.add_request(p, b) for p, b in pending[:take]]
                del pending[:take]
            engine.step()
            step += 1
            engine.scheduler.check_invariants()
            assert engine.allocator.num_used <= 10
            assert step < 2000, "no progress"
        assert [s.output_ids for s in seqs] == expected
    assert engine.allocator.num_blocks == 10 and engine.pool.k.shape[1] == 10  # never grown
    assert engine.generate(PROMPTS, MAX_NEW) == expected and engine.allocator.num_blocks == 10
    assert engine.stats().blocks_held <= 10
    assert (engine.stats().preemptions > 0) == (policy == "on_demand")


def test_l5_takes_no_admission_policy(tiny_qwen3_dir):
    """The Orca baselines are L3's and L4's: L5 (clones, shared blocks) refuses the option by name."""
    with pytest.raises(TypeError, match=r"unknown option admission_policy='oracle': this engine takes max_model_len, "):
        L5Engine(tiny_qwen3_dir, block_size=BLOCK, kv_cache_bytes=KV_BYTES, admission_policy="oracle")
    with pytest.raises(TypeError, match="unknown option admission_policy='on_demand'"):
        L5Engine(tiny_qwen3_dir, block_size=BLOCK, admission_policy="on_demand")


# ---------------------------------------------------------------- L6: a pool in bytes, sized in pages; admission waits


def test_l6_bytes_size_the_pages_and_admission_waits(tiny_qwen3_dir, expected):
    engine = L6Engine(
        tiny_qwen3_dir, page_size=BLOCK, kv_cache_bytes=KV_BYTES, max_model_len=MAX_LEN, max_num_seqs=4
    )
    assert engine.num_pages == 10
    assert sum(pool.nbytes for pool in engine.kv_pages) == 10 * BLOCK_BYTES
    assert "= 10 blocks: 10 blocks of 4" in engine.stats().describe()
    assert engine.generate(PROMPTS, MAX_NEW) == expected
    assert engine.stats().blocks_held <= 10
    small = L6Engine(tiny_qwen3_dir, page_size=BLOCK, kv_cache_bytes=6 * BLOCK_BYTES, max_model_len=MAX_LEN)
    with pytest.raises(
        ValueError,
        match=r"prompt 0: needs 8 pages of 4 tokens, but the pool has only 6: 16,384 bytes of KV needed, "
        r"kv_cache_bytes=12,288 given",
    ):
        small.generate([PROMPTS[4]], [9])


def test_l6_mesh_pool_is_split_over_its_devices(tiny_qwen3_dir):
    mesh = jax.sharding.Mesh(jax.devices()[:1], ("data",))
    engine = MeshEngine(
        tiny_qwen3_dir, mesh, page_size=BLOCK, kv_cache_bytes=KV_BYTES, max_model_len=MAX_LEN, max_num_seqs=4
    )
    assert engine.num_pages == 10 and "= 10 blocks" in engine.stats().describe()
    with pytest.raises(ValueError, match="16,384 bytes of KV needed, kv_cache_bytes=12,288 given"):
        small = MeshEngine(
            tiny_qwen3_dir, mesh, page_size=BLOCK, kv_cache_bytes=6 * BLOCK_BYTES, max_model_len=MAX_LEN
        )
        small.generate([PROMPTS[4]], [9])
