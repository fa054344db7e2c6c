"""L6 engine: equal to HF on a tiny Qwen3 in every cleanup/reset mode, clones, compile counts, errors."""

from __future__ import annotations

from dataclasses import replace

import jax.numpy as jnp
import pytest

from kvcourse.reference import hf_greedy
from L6_tpu_jax.engine import Engine, OutOfPagesError, bucket, pages_for

PROMPTS = [[5, 17, 300, 42, 7], list(range(200, 237)), [9] * 20]
BUDGET = 24


@pytest.fixture(scope="module")
def expected(tiny_qwen3_dir):
    return [r.tokens for r in hf_greedy(tiny_qwen3_dir, PROMPTS, [BUDGET] * len(PROMPTS))]


@pytest.fixture(scope="module")
def engine(tiny_qwen3_dir):
    """Defaults: incremental cleanup, logical reset, reference attention 16x16."""
    return Engine(tiny_qwen3_dir, max_seqs=8, max_rounds=8)


@pytest.fixture(scope="module")
def small_engine(tiny_qwen3_dir):
    """Two slots and 4-token pages: prompts wait for slots, cleanup only between host calls."""
    return Engine(
        tiny_qwen3_dir,
        page_size=4,
        max_seqs=2,
        cleanup="end",
        reset="physical",
        q_block=1,
        kv_pages_per_block=2,
    )


def test_equals_hf_without_recompiling(engine, expected):
    assert engine.generate(PROMPTS, BUDGET) == expected
    engine.check_invariants()
    assert engine.stats() == {
        "active_slots": 0,
        "pages_in_use": 0,
        "free_pages": engine.num_pages,
        "max_refcount": 0,
    }
    before = dict(engine.traces)
    # new prompts and lengths in the same bucket, another budget: no new compile
    again = engine.generate([p[::-1] for p in PROMPTS], 5)
    assert [len(x) for x in again] == [5, 5, 5] and dict(engine.traces) == before == {
        "prefill": 1,
        "decode": 1,
    }
    assert engine.generate(PROMPTS, BUDGET) == expected  # after a logical reset over stale pages


def test_waiting_prompts_end_cleanup_physical_reset(small_engine, expected):
    assert small_engine.generate(PROMPTS, BUDGET) == expected
    small_engine.check_invariants()
    assert small_engine.stats()["pages_in_use"] == 0
    # one compile per decode width: 2 rows, then 1 for the last prompt alone
    assert small_engine.traces["decode"] == 2


def test_cleanup_none_keeps_pages_until_reset(tiny_qwen3_dir, expected):
    engine = Engine(tiny_qwen3_dir, max_seqs=4, cleanup="none", max_rounds=64)
    assert engine.generate(PROMPTS, BUDGET) == expected
    engine.check_invariants()
    held = sum(pages_for(len(p), BUDGET, 1, 16) for p in PROMPTS)
    assert engine.stats() == {
        "active_slots": 3,
        "pages_in_use": held,
        "free_pages": engine.num_pages - held,
        "max_refcount": 1,
    }
    engine.reset()
    engine.check_invariants(after_reset=True)
    with pytest.raises(RuntimeError, match="cannot be admitted: .* cleanup='none'"):
        engine.generate([[5]] * 5, 2)  # 5 prompts, 4 slots, nothing ever freed


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
    assert engine.peak_pages_in_use < independent
    assert engine.stats()["pages_in_use"] == 0


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
    with pytest.raises(ValueError, match="n=3 sequences exceed max_seqs=2"):
        small_engine.generate_samples([[5]], 2, n=3)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        small_engine.generate([[]], 2)


def test_bucket_and_pages_for_examples():
    assert [bucket(5), bucket(17), bucket(64)] == [16, 32, 64]
    assert pages_for(20, 30, 4, 16) == 13


def test_incremental_cleanup_frees_sequences_that_finish_at_prefill(tiny_llama_dir):
    """Budget 1: every sequence finishes on its prefill token, so no decode round ever frees it."""
    from L6_tpu_jax import decode_state as ds

    engine = Engine(tiny_llama_dir, max_seqs=2, cleanup="incremental")
    expected = [r.tokens for r in hf_greedy(tiny_llama_dir, [[5], [6], [7]], [1, 1, 1])]
    assert engine.generate([[5], [6], [7]], 1) == expected
    stats = ds.stats(engine.host_state())
    assert stats["active_slots"] == 0 and stats["pages_in_use"] == 0
