"""L6's layers as one ``lax.scan`` (``Engine(scan_layers=True)``): the same bits as the unrolled loop,
the same tokens as HF, the pools still donated, and a second prompt length in a bucket compiles nothing."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvcourse import jax_model
from kvcourse.harness.reference import hf_greedy
from L6_tpu_jax.engine import Engine

TOKENS = [1, 5, 17, 300, 42, 7, 9, 9, 120, 4000, 2, 77, 31, 8, 600, 12, 19, 44, 3, 250]
PROMPTS = [[5, 17, 300, 42, 7], list(range(200, 237)), [9] * 20]
BUDGET = 24


def dense(kv, layer, q, k, v):
    return jax_model.causal_self_attention(q, k, v), kv


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen3_dir", "model_dir"])
def test_scanned_forward_equals_unrolled_bit_for_bit(fixture, request):
    """Same products in the same order: the scan changes where XLA's program repeats, not one bit."""
    cfg, params = jax_model.load_params(request.getfixturevalue(fixture))
    ids = jnp.asarray(TOKENS, dtype=jnp.int32)
    run = jax.jit(lambda p, t: jax_model.forward(cfg, p, t, jnp.arange(t.shape[0]), dense)[0])
    unrolled, scanned = np.asarray(run(params, ids)), np.asarray(run(jax_model.stack_layers(params), ids))
    differ = np.flatnonzero(unrolled != scanned)
    assert differ.size == 0, (
        f"{differ.size} of {unrolled.size} logits differ, the largest by {np.abs(unrolled - scanned).max():.2e}"
    )


def test_stack_layers_stacks_every_weight_along_a_layer_axis(tiny_llama_dir):
    cfg, params = jax_model.load_params(tiny_llama_dir)
    stacked = jax_model.stack_layers(params)
    assert stacked.layers.q_proj.shape == (cfg.num_layers, *params.layers[0].q_proj.shape)
    np.testing.assert_array_equal(stacked.layers.down_proj[1], params.layers[1].down_proj)
    assert jax_model.stack_layers(stacked) is stacked


@pytest.fixture(scope="module")
def expected(tiny_qwen3_dir):
    return [r.tokens for r in hf_greedy(tiny_qwen3_dir, PROMPTS, [BUDGET] * len(PROMPTS))]


@pytest.fixture(scope="module")
def scanned(tiny_qwen3_dir):
    return Engine(tiny_qwen3_dir, max_num_seqs=8, max_rounds=8, scan_layers=True)


def test_scanned_engine_equals_hf_and_compiles_each_bucket_once(scanned, expected):
    assert scanned.describe().endswith(", 2 layers, scanned")
    assert [pool.shape[:2] for pool in scanned.kv_pages] == [(2, scanned.num_pages)]  # one stacked pool
    assert scanned.generate(PROMPTS, BUDGET) == expected
    scanned.check_invariants()
    before = dict(scanned.traces)
    # other prompt lengths in the same prefill bucket (37 -> 33 tokens of 64), other max_new_tokens
    assert scanned.generate([p[1:] for p in PROMPTS], 5) == [
        r.tokens for r in hf_greedy(scanned.model_dir, [p[1:] for p in PROMPTS], [5] * 3)
    ]
    assert dict(scanned.traces) == before == {"prefill": 1, "decode": 1}


def test_scanned_pool_is_donated_and_clones_copy_every_layer(scanned, expected):
    before = scanned.kv_pages
    buffers = [pool.unsafe_buffer_pointer() for pool in before]
    samples = scanned.generate_samples(PROMPTS, BUDGET, n=2)  # clones copy the partial page in all layers
    assert samples == [[e, e] for e in expected]
    assert all(pool.is_deleted() for pool in before)
    assert [pool.unsafe_buffer_pointer() for pool in scanned.kv_pages] == buffers


def test_scan_is_the_default_off_the_cpu_only(tiny_llama_dir):
    engine = Engine(tiny_llama_dir, max_num_seqs=2, autotune_level=0)  # a GPU flag, ignored on a CPU
    assert not engine.scan_layers and engine.describe().endswith(", 2 layers")
    assert engine.generate([[5, 6, 7]], 3) == [r.tokens for r in hf_greedy(tiny_llama_dir, [[5, 6, 7]], [3])]


def test_hlo_size_counts_operations_and_dots():
    from bench.l6_compile import hlo_size

    text = "func.func @main() {\n  %0 = stablehlo.dot_general %a, %b\n  %1 = stablehlo.add %0, %0\n}"
    assert hlo_size(text) == {"ops": 2, "dots": 1, "chars": len(text)}


@pytest.mark.slow
def test_quick_l6_compile_measures_unrolled_and_scanned_in_fresh_processes(tmp_path):
    """``bench.l6_compile --quick``: both rows, each program's size and compile seconds, nothing traced
    again for other prompt lengths, and the scan's programs hold one layer's dots, not every layer's."""
    from bench.l6_compile import main, table

    out = tmp_path / "l6-compile.json"
    assert main(["--quick", "--device", "cpu", "--out", str(out)]) == 0
    results = json.loads(out.read_text(encoding="utf-8"))
    rows = results["rows"]
    assert list(rows) == ["unrolled", "scanned"]
    for row in rows.values():
        cold = row["cold"]
        assert cold["compiles_after_other_lengths"] == cold["compiles_after_first"] == {"prefill": 1, "decode": 1}
        assert set(cold["programs"]) == set(row["cache"]["programs"])
        assert all(p["XLA compile_s"] > 0 and p["ops"] > 0 for p in cold["programs"].values())
    unrolled, scanned = (rows[r]["cold"]["programs"] for r in ("unrolled", "scanned"))
    for name in unrolled:  # the tiny model's 2 layers: 9 dots each plus the head, against 9 plus the head
        assert (unrolled[name]["dots"], scanned[name]["dots"]) == (19, 10), name
    assert "| unrolled |" in table(results)


def test_the_scanned_decode_program_never_copies_the_pool(tiny_llama_dir):
    """The stacked pool is the scan's carry, viewed flat inside each layer (a reshape): XLA's optimized
    decode program holds no copy of a pool-sized array (a copy would cost a pass over every page, every
    layer of every step)."""
    engine = Engine(tiny_llama_dir, max_num_seqs=4, num_pages=40, scan_layers=True)
    (pool,) = engine.kv_pages  # (L, P, page_size, 2 * H_kv, D)
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (engine.params, engine.state, engine.kv_pages))
    hlo = engine._decode.lower(*shapes, 4).compile().as_text()
    flat = (pool.shape[0] * pool.shape[1], *pool.shape[2:])
    pool_sized = [f"f32[{','.join(map(str, s))}]" for s in (pool.shape, flat)]
    copies = [line.strip() for line in hlo.splitlines() if " copy(" in line and any(s in line for s in pool_sized)]
    assert not copies, f"{len(copies)} pool-sized copies in the decode program, e.g. {copies[0][:200]}"


@pytest.mark.slow
def test_scanned_engine_with_the_pallas_kernel_equals_hf(tiny_llama_dir):
    """The Pallas kernel (TPU interpret mode here) reads the scanned engine's flat pool through the
    shifted page table, as the reference does. A small pool of small pages (8 of 4 tokens a layer): the
    interpreter's time grows with the pages it walks (the default, 128 pages of 16, took 2.5 times as long
    in a fresh process), and the 26-token sequence still spans 7 pages, 4 KV blocks of 2 pages."""
    prompts = [[5, 17, 300, 42, 7], list(range(200, 221))]
    expected = [r.tokens for r in hf_greedy(tiny_llama_dir, prompts, [6, 6])]
    small = dict(page_size=4, max_model_len=32, q_block=16, kv_pages_per_block=2)
    engine = Engine(tiny_llama_dir, max_num_seqs=2, scan_layers=True, attention="pallas", **small)
    assert engine.generate(prompts, 6) == expected
