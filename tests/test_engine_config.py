"""``EngineConfig`` (``kvcourse/engine_config.py``): the options L1-L4 share, checked once, and the pool
they size, on a tiny seeded checkpoint's config (no weights are loaded).

- ``build`` resolves what depends on the model (max_model_len, a step's tokens, the default pool of
  one max_model_len sequence, which grows; a pool given in blocks or in bytes, which does not);
- an option a stage does not take is refused, naming it and what the stage takes; a bad value is
  refused naming the option and the value; without chunking a whole prompt must fit one step;
- ``check_requests`` is the one check on the way in: ids and lengths, then the pool, a reservation
  policy's length included, and under an Orca policy the buddy run it takes, each error naming
  ``prompt i`` (or ``request``, for one submitted alone); an Orca policy needs the pool given;
- ``pool_blocks``, ``hold_len`` and ``run_blocks`` on the docstrings' examples;
- ``engine_options`` (the harness) lists what each stage's engine takes, with its defaults.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvcourse.config import ModelConfig
from kvcourse.engine_config import ALL_OPTIONS, EngineConfig
from kvcourse.harness.stages import engine_class, engine_options

L2_OPTIONS = ("max_model_len", "block_size", "num_blocks")


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    """What ``build`` reads of a model: its config (the tiny Llama: 512 bytes of KV a token, max 2048)."""
    return SimpleNamespace(cfg=ModelConfig.from_dir(tiny_llama_dir), device="cpu")


def test_build_resolves_the_defaults_and_sizes_the_pool(model):
    config = EngineConfig.build(model, {}, ALL_OPTIONS)
    assert (config.max_model_len, config.max_num_batched_tokens, config.block_size) == (2048, 2048, 16)
    assert (config.num_blocks, config.grows_pool, config.sizing) == (128, True, None)  # L1's bytes
    assert config.vocab_size == model.cfg.vocab_size and config.max_num_seqs == 32
    given = EngineConfig.build(model, {"block_size": 4, "num_blocks": 6, "max_model_len": 64}, ALL_OPTIONS)
    assert (given.num_blocks, given.grows_pool, given.max_num_batched_tokens) == (6, False, 64)
    in_bytes = EngineConfig.build(model, {"block_size": 4, "kv_cache_bytes": 10 * 2048 + 5}, ALL_OPTIONS)
    assert (in_bytes.num_blocks, in_bytes.grows_pool) == (10, False)
    assert in_bytes.sizing_line.endswith("= 10 blocks") and given.sizing_line == ""


@pytest.mark.parametrize(
    "options, error, message",
    [
        ({"max_num_seqs": 4}, TypeError, "unknown option max_num_seqs=4: this engine takes max_model_len, "),
        ({"block_size": 0}, ValueError, "block_size must be >= 1, got 0"),
        ({"num_blocks": 0}, ValueError, "num_blocks must be >= 1, got 0"),
        ({"num_blocks": 2.5}, ValueError, "num_blocks must be >= 1, got 2.5"),
        ({"max_model_len": 4096}, ValueError, r"max_model_len must be in \[1, 2048\] .*got 4096"),
    ],
)
def test_l2s_options_are_checked_and_no_other_is_taken(model, options, error, message):
    with pytest.raises(error, match=message):
        EngineConfig.build(model, options, L2_OPTIONS)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"max_num_seqs": 0}, "max_num_seqs must be >= 1, got 0"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens must be >= 1, got 0"),
        ({"prefill_chunk_size": 0}, r"prefill_chunk_size must be >= 1 or None \(no chunking\), got 0"),
        (
            {"admission_policy": "lru"},
            r"admission_policy must be one of \('on_demand', 'oracle', 'pow2', 'max'\), got 'lru'",
        ),
        (
            {"max_num_batched_tokens": 100},
            "a whole prompt must fit one step, but max_num_batched_tokens=100 <",
        ),
        ({"num_blocks": 4, "kv_cache_bytes": 4096}, "give num_blocks or kv_cache_bytes, not both"),
        ({"block_size": 4, "kv_cache_bytes": 2047}, "kv_cache_bytes=2,047 holds no block"),
    ],
)
def test_every_option_is_checked_once_by_name(model, options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.build(model, options, ALL_OPTIONS)


def test_a_chunked_step_may_be_shorter_than_a_prompt(model):
    config = EngineConfig.build(model, {"max_num_batched_tokens": 100, "prefill_chunk_size": 8}, ALL_OPTIONS)
    assert (config.max_num_batched_tokens, config.prefill_chunk_size) == (100, 8)


def test_check_requests_names_the_request_and_counts_a_reservation(model):
    small = EngineConfig.build(model, {"block_size": 4, "num_blocks": 3, "max_model_len": 32}, ALL_OPTIONS)
    assert small.check_requests([[1] * 4, [1] * 5], [3, 7]) == [3, 7]  # 12 positions: 3 blocks
    with pytest.raises(ValueError, match="prompt 1: 13 tokens need 4 blocks of 4, but the pool has only 3"):
        small.check_requests([[1] * 4, [1] * 10], 3)
    with pytest.raises(ValueError, match="^request is empty$"):
        small.check_requests([[]], 3, label="request")
    with pytest.raises(ValueError, match="request: token id -1 is outside the vocabulary"):
        small.check_requests([[-1]], 3, label="request")
    maxed = EngineConfig.build(
        model, {"block_size": 4, "num_blocks": 6, "max_model_len": 32, "admission_policy": "max"}, ALL_OPTIONS
    )
    with pytest.raises(ValueError, match="request: 32 tokens need 8 blocks of 4, but the pool has only 6"):
        maxed.check_requests([[5]], 1, label="request")  # one token, but Max holds max_model_len


def test_an_orca_policy_refuses_a_run_the_pool_never_holds(model):
    """6 blocks are a run of 4 and one of 2: 17 positions fit 5 blocks, but Oracle's run is 8."""
    options = {"block_size": 4, "num_blocks": 6, "max_model_len": 32}
    oracle = EngineConfig.build(model, options | {"admission_policy": "oracle"}, ALL_OPTIONS)
    assert oracle.check_requests([[5] * 10], 6) == [6]  # 16 positions: 4 blocks, a run of 4
    with pytest.raises(
        ValueError,
        match=r"^prompt 0: admission_policy 'oracle' reserves 17 positions, a run of 8 blocks of 4, but the "
        r"largest run a pool of 6 blocks holds is 4$",
    ):
        oracle.check_requests([[5] * 10], 7)
    pow2 = EngineConfig.build(model, options | {"admission_policy": "pow2"}, ALL_OPTIONS)
    with pytest.raises(ValueError, match="^prompt 1: admission_policy 'pow2' reserves 18 positions, a run of 8 "):
        pow2.check_requests([[5] * 6, [5] * 10], 5)  # 6 + 8 = 14: a run of 4; 10 + 8 = 18: 5 blocks, a run of 8
    on_demand = EngineConfig.build(model, options, ALL_OPTIONS)
    assert on_demand.check_requests([[5] * 10], 7) == [7]  # scattered blocks: 5 of 6


@pytest.mark.parametrize("policy", ["oracle", "pow2", "max"])
def test_an_orca_policy_needs_the_pool_given(model, policy):
    with pytest.raises(
        ValueError,
        match=rf"admission_policy '{policy}' serves a fixed KV memory: give the pool \(num_blocks, "
        r"kv_cache_bytes or gpu_memory_utilization\)",
    ):
        EngineConfig.build(model, {"admission_policy": policy, "max_model_len": 32}, ALL_OPTIONS)
    given = EngineConfig.build(model, {"admission_policy": policy, "num_blocks": 8, "block_size": 4}, ALL_OPTIONS)
    assert (given.num_blocks, given.grows_pool) == (8, False)


def test_pool_blocks_hold_len_and_run_blocks_are_the_docstrings_arithmetic():
    assert EngineConfig(block_size=16, max_num_seqs=32).pool_blocks([104] * 40) == 224
    assert EngineConfig(block_size=4, max_num_seqs=2).pool_blocks([5, 17, 9]) == 5 + 3
    pow2 = EngineConfig(admission_policy="pow2", max_model_len=64)
    assert pow2.hold_len(20, 25) == 20 + 32  # the output rounded up to a power of two, the prompt not
    assert pow2.hold_len(40, 20) == 64  # 40 + 32 would pass max_model_len
    assert EngineConfig(admission_policy="oracle", max_model_len=64).hold_len(20, 25) == 45
    assert EngineConfig(admission_policy="max", max_model_len=64).hold_len(20, 25) == 64
    assert EngineConfig().hold_len(20, 25) == 0
    assert [pow2.run_blocks(b) for b in (1, 5, 7, 8, 9)] == [1, 8, 8, 8, 16]
    assert [EngineConfig().run_blocks(b) for b in (1, 5, 7)] == [1, 5, 7]
    with pytest.raises(ValueError, match="admission_policy 'pow2' needs max_model_len"):
        EngineConfig(admission_policy="pow2")


def test_engine_options_lists_what_each_stage_takes():
    assert engine_options(engine_class("L1")) == {"max_model_len": None}
    assert engine_options(engine_class("L2")) == {"max_model_len": None, "block_size": 16, "num_blocks": None}
    l3, l4 = engine_options(engine_class("L3")), engine_options(engine_class("L4"))
    assert (
        list(l3) == list(ALL_OPTIONS) and l3["max_num_seqs"] == 32 and l3["admission_policy"] == "on_demand"
    )
    assert l4 == {"kernel": "auto", "num_splits": "auto", "cuda_graphs": None} | l3
    l5 = engine_options(engine_class("L5"))  # the Orca baselines are L3's and L4's
    assert "admission_policy" not in l5 and set(l5) == set(l4) - {"admission_policy"} | {"enable_prefix_caching"}
    assert {"num_pages", "page_size", "max_num_seqs"} <= set(engine_options(engine_class("L6")))
