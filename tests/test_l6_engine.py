"""L6 engine: equal to HF on a tiny Qwen3 in every cleanup/reset mode, clones, the reset at the start of
every generate(), stats counted on the device, compile counts, buffer donation, errors."""

from __future__ import annotations

from dataclasses import replace

import jax
import jax.numpy as jnp
import pytest

from kvcourse.harness.reference import hf_greedy
from L6_tpu_jax import decode_state as ds
from L6_tpu_jax.engine import Engine, OutOfPagesError, bucket
from L6_tpu_jax.page_table import pages_for

PROMPTS = [[5, 17, 300, 42, 7], list(range(200, 237)), [9] * 20]
BUDGET = 24


@pytest.fixture(scope="module")
def expected(tiny_qwen3_dir):
    return [r.tokens for r in hf_greedy(tiny_qwen3_dir, PROMPTS, [BUDGET] * len(PROMPTS))]


@pytest.fixture(scope="module")
def engine(tiny_qwen3_dir):
    """Defaults: incremental cleanup, logical reset, reference attention 16x16."""
    return Engine(tiny_qwen3_dir, max_num_seqs=8, max_rounds=8)


@pytest.fixture(scope="module")
def small_engine(tiny_qwen3_dir):
    """Two slots and 4-token pages: prompts wait for slots, cleanup only between host calls."""
    return Engine(
        tiny_qwen3_dir,
        page_size=4,
        max_num_seqs=2,
        cleanup="end",
        reset="physical",
        q_block=1,
        kv_pages_per_block=2,
    )


def test_equals_hf_without_recompiling(engine, expected):
    assert engine.generate(PROMPTS, BUDGET) == expected
    engine.check_invariants()
    assert engine.occupancy() == {
        "active_slots": 0,
        "pages_in_use": 0,
        "free_pages": engine.num_pages,
        "max_refcount": 0,
    }
    before = dict(engine.traces)
    # new prompts and lengths in the same bucket, other max_new_tokens: no new compile
    again = engine.generate([p[::-1] for p in PROMPTS], 5)
    assert [len(x) for x in again] == [5, 5, 5] and dict(engine.traces) == before == {
        "prefill": 1,
        "decode": 1,
    }
    assert engine.generate(PROMPTS, BUDGET) == expected  # after a logical reset over stale pages


def test_the_pools_are_donated_and_updated_in_place(engine, expected):
    """The prefill and decode calls donate the pools (``donate_argnums``): after a generate the arrays
    the engine held before it are deleted, and the new pools live in the same buffers."""
    before = engine.kv_pages  # a logical reset leaves them as they are, so the first prefill gets these
    buffers = [pool.unsafe_buffer_pointer() for pool in before]
    assert engine.generate(PROMPTS, 5) == [e[:5] for e in expected]  # the buckets and width of the test above
    assert all(pool.is_deleted() for pool in before)
    assert not any(pool.is_deleted() for pool in engine.kv_pages)
    assert [pool.unsafe_buffer_pointer() for pool in engine.kv_pages] == buffers


def test_waiting_prompts_end_cleanup_physical_reset(small_engine, expected):
    assert small_engine.generate(PROMPTS, BUDGET) == expected
    small_engine.check_invariants()
    assert small_engine.occupancy()["pages_in_use"] == 0
    # one compile per decode width: 2 rows, then 1 for the last prompt alone
    assert small_engine.traces["decode"] == 2


def test_cleanup_none_keeps_pages_until_the_next_generate(tiny_qwen3_dir, expected):
    """With cleanup="none" every finished sequence keeps its slot and pages, and there are only as many
    slots as prompts: the second call (no reset by hand in between) runs, and equals HF, only because
    generate() starts with a reset. Every call's first prefill starts from the baseline state."""
    engine = Engine(tiny_qwen3_dir, max_num_seqs=len(PROMPTS), cleanup="none", max_rounds=64)
    entering = []  # the state each prefill call starts from
    prefill = engine._prefill

    def spy(params, state, kv_pages, work):
        entering.append(jax.device_get(state))
        return prefill(params, state, kv_pages, work)

    engine._prefill = spy
    assert engine.generate(PROMPTS, BUDGET) == expected
    engine.check_invariants()
    with pytest.raises(AssertionError, match="used slots after reset"):
        engine.check_invariants(after_reset=True)
    held = sum(pages_for(len(p), BUDGET, 1, 16) for p in PROMPTS)
    assert engine.occupancy() == {
        "active_slots": 3,
        "pages_in_use": held,
        "free_pages": engine.num_pages - held,
        "max_refcount": 1,
    }
    first_calls = len(entering)
    assert engine.generate(PROMPTS[::-1], BUDGET) == expected[::-1]
    for state in (entering[0], entering[first_calls]):
        ds.check_invariants(state, after_reset=True)
    with pytest.raises(RuntimeError, match="cannot be admitted: .* cleanup='none'"):
        engine.generate([[5]] * 4, 2)  # 4 prompts, 3 slots, nothing ever freed
    engine.reset()
    engine.check_invariants(after_reset=True)


def test_logical_reset_equals_physical_reset(engine, small_engine):
    first, second = [[7, 8, 9, 10, 11]], [[300, 301, 302]]
    logical = [engine.generate(first, 12), engine.generate(second, 12)]
    physical = [small_engine.generate(first, 12), small_engine.generate(second, 12)]
    assert logical == physical


def test_clones_share_full_pages(engine, expected):
    samples = engine.generate_samples(PROMPTS, BUDGET, n=3)
    assert samples == [[e] * 3 for e in expected]
    engine.check_invariants()
    independent = sum(pages_for(len(p), BUDGET, 1, 16) for p in PROMPTS) * 3
    assert int(engine.host_state().stats.peak_pages_in_use) < independent
    assert engine.occupancy()["pages_in_use"] == 0


def test_out_of_pages_is_an_error_naming_the_counts(engine):
    host = replace(engine.host_state(), pages_needed=jnp.int32(3), pages_free=jnp.int32(1))
    with pytest.raises(OutOfPagesError, match="needed 3 new pages but only 1 of 128 were free"):
        engine.raise_if_short(host)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"cleanup": "sometimes"}, "cleanup must be one of"),
        ({"reset": "skip"}, "reset must be one of"),
        ({"page_size": 0}, "page_size must be >= 1, got 0"),
        ({"attention": "triton"}, "attention must be one of"),
    ],
)
def test_bad_options_are_named(tiny_llama_dir, options, message):
    with pytest.raises(ValueError, match=message):
        Engine(tiny_llama_dir, **options)


def test_bad_requests_are_named(small_engine):
    with pytest.raises(ValueError, match="exceeds max_model_len=2048"):
        small_engine.generate([[5] * 2000], 100)
    with pytest.raises(ValueError, match="n=3 sequences exceed max_num_seqs=2"):
        small_engine.generate_samples([[5]], 2, n=3)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        small_engine.generate([[]], 2)
    assert small_engine.check_fits([5, 6], 3) == 3
    with pytest.raises(ValueError, match="request: n=3 sequences exceed max_num_seqs=2"):
        small_engine.check_fits([5], 2, n=3)
    with pytest.raises(ValueError, match="prompt 4: needs 3 pages of 4 tokens, but the pool has only 2"):
        Engine(small_engine.model_dir, page_size=4, num_pages=2).check_fits([5] * 9, 1, "prompt 4")


def test_bucket_and_pages_for_examples():
    assert [bucket(5), bucket(17), bucket(64)] == [16, 32, 64]
    assert pages_for(20, 30, 4, 16) == 13


def test_incremental_cleanup_frees_sequences_that_finish_at_prefill(tiny_llama_dir):
    """Budget 1: every sequence finishes on its prefill token, so no decode round ever frees it."""
    engine = Engine(tiny_llama_dir, max_num_seqs=2, cleanup="incremental")
    expected = [r.tokens for r in hf_greedy(tiny_llama_dir, [[5], [6], [7]], [1, 1, 1])]
    assert engine.generate([[5], [6], [7]], 1) == expected
    occupancy = engine.occupancy()
    assert occupancy["active_slots"] == 0 and occupancy["pages_in_use"] == 0


def test_stats_count_every_step_on_the_device_since_the_engine_was_built(tiny_llama_dir):
    """One 10-token prompt, 6 new tokens, pages of 4: a prefill call and 5 decode rounds (one host
    call: the device counts each round). Live = the sequence's length; held = its pages x 4."""
    engine = Engine(tiny_llama_dir, page_size=4, max_num_seqs=4, max_model_len=64, max_rounds=64)
    prompt, per_token = list(range(30, 40)), engine.cfg.kv_bytes_per_token()
    for _ in range(2):  # the second call resets the device counters; stats() keeps counting
        engine.generate([prompt], 6, ignore_eos=True)
    live, held = [10, 11, 12, 13, 14, 15], [12, 12, 12, 16, 16, 16]
    stats = engine.stats()
    assert stats.kv_utilization == pytest.approx(sum(live) / sum(held))
    assert (stats.steps, stats.tokens_run) == (2 * 6, 2 * (10 + 5))
    assert (stats.blocks_held, stats.blocks_shared, stats.clones, stats.preemptions) == (4, 0, 0, 0)
    assert stats.kv_bytes_live == 15 * per_token
    assert stats.kv_bytes_pool == 16 * 4 * per_token  # 16 pages: one 64-token sequence
    assert (stats.block_size, stats.num_blocks) == (4, 16)
    assert stats.compiles == {"prefill": 1, "decode": 1}

    # 3 clones: 2 full pages shared, each clone's private rows 2 + k after decode round k.
    engine = Engine(tiny_llama_dir, page_size=4, max_num_seqs=4, max_model_len=64, max_rounds=64)
    engine.generate_samples([prompt], 6, n=3, ignore_eos=True)
    live = [10] + [8 + 3 * (2 + k) for k in range(1, 6)]  # 10, 17, 20, 23, 26, 29
    held = [12] + [4 * (2 + 3 * -(-(2 + k) // 4)) for k in range(1, 6)]  # 12, 20, 20, 32, 32, 32
    stats = engine.stats()
    assert stats.kv_utilization == pytest.approx(sum(live) / sum(held))
    assert (stats.steps, stats.tokens_run) == (6, 10 + 5 * 3)
    assert (stats.blocks_held, stats.blocks_shared, stats.clones) == (8, 2, 1)
    assert stats.kv_bytes_live == 29 * per_token


def test_device_is_where_everything_lives(tiny_llama_dir):
    """device="cpu" puts the weights, the state and the pages on JAX's CPU device, and says so."""
    engine = Engine(tiny_llama_dir, max_num_seqs=2, max_model_len=32, device="cpu")
    cpu = jax.devices("cpu")[0]
    for leaf in jax.tree.leaves((engine.params, engine.state, engine.kv_pages)):
        assert leaf.devices() == {cpu}
    assert engine.describe().startswith("L6 on cpu:0 (cpu), JAX ")
    assert engine.describe().endswith(": reference attention, 2 layers")


@pytest.mark.parametrize(
    "device, message",
    [
        ("cuda", r"device 'cuda': JAX has no 'cuda' backend here \(it has: .*cpu"),
        ("cpu:7", r"device 'cpu:7': JAX has 1 cpu device\(s\), numbered from 0"),
        ("abacus", r"device 'abacus': JAX has no 'abacus' backend here"),
    ],
)
def test_a_device_jax_does_not_have_is_named(tiny_llama_dir, device, message):
    if device == "cuda" and jax.default_backend() == "gpu":
        pytest.skip("this machine's JAX has a GPU backend: 'cuda' is a device it has")
    with pytest.raises(ValueError, match=message):
        Engine(tiny_llama_dir, device=device)


def test_the_pallas_tpu_kernel_is_refused_on_a_gpu():
    """TPU: compiled by Mosaic; CPU: TPU interpret mode; a GPU: a clear error (it cannot run there)."""
    from L6_tpu_jax.pallas_attention import interpret_mode

    assert interpret_mode("tpu") is False
    assert interpret_mode("cpu") is not False
    with pytest.raises(ValueError, match="attention='pallas' is a Pallas TPU kernel: .* not on 'gpu'"):
        interpret_mode("gpu")
