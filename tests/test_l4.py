"""L4 engine: L3's engine with the paged kernel, equal to L3 and HF; its options and the smoke."""

from __future__ import annotations

import re

import pytest
from cpp_kernel import PROBLEM, needs_cpp
from smoke_runs import course_smoke, smoke_module

from kvcourse.harness.reference import hf_greedy
from L3_block_tensor.engine import Engine as L3Engine
from L4_paged_kernel.engine import Engine

PROMPTS = [[5, 17, 300, 42, 7], list(range(200, 237)), [9] * 20]

# make test runs this smoke on the course model alone, on 4 of its prompts, 8 new tokens each (make
# smoke runs both models, every prompt and 64 tokens; tests/test_smokes.py runs every smoke on the tiny Qwen3 with a long prompt file).


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"num_splits": 4},
        {"block_size": 7, "prefill_chunk_size": 8},
        {"block_size": 1, "num_blocks": 120},  # a small pool: preemption under the kernel too
        pytest.param({"kernel": "cpp"}, marks=needs_cpp),
        pytest.param(
            {"kernel": "cpp", "block_size": 7, "prefill_chunk_size": 8, "num_blocks": 40}, marks=needs_cpp
        ),
    ],
)
def test_l4_equals_l3_and_hf_on_tiny_qwen3(tiny_qwen3_dir, options):
    expected = [r.tokens for r in hf_greedy(tiny_qwen3_dir, PROMPTS, [24] * len(PROMPTS))]
    l3 = L3Engine(tiny_qwen3_dir).generate(PROMPTS, 24)
    engine = Engine(tiny_qwen3_dir, **options)
    assert engine.generate(PROMPTS, 24) == l3 == expected
    engine.allocator.check_invariants()
    assert engine.allocator.num_free == engine.allocator.num_blocks


def test_triton_kernel_engine_on_tiny_llama(tiny_llama_dir):
    pytest.importorskip(
        "triton", reason="triton is installed on Linux only; the Triton kernel is not tested here"
    )
    expected = [r.tokens for r in hf_greedy(tiny_llama_dir, PROMPTS[:2], [3, 3])]
    assert Engine(tiny_llama_dir, kernel="triton", num_splits=2).generate(PROMPTS[:2], 3) == expected


@pytest.mark.parametrize(
    "options, message",
    [
        ({"kernel": "cuda"}, "kernel must be one of"),
        ({"num_splits": 0}, "num_splits must be >= 1, got 0"),
        (
            {"kernel": "cpp", "num_splits": 2},
            "C\\+\\+ kernel has no split-KV path: num_splits must be 1, got 2",
        ),
    ],
)
def test_bad_options_are_named(tiny_llama_dir, options, message):
    with pytest.raises(ValueError, match=message):
        Engine(tiny_llama_dir, **options)


@pytest.mark.slow
def test_l4_smoke_on_the_course_model(model_dir, course_prompts_subset, capsys, monkeypatch):
    """The smoke, with its Triton run (the interpreter: ~13 s per prompt on the course model) on the one
    shortest prompt; make smoke runs it on three."""
    monkeypatch.setattr(smoke_module("L4"), "TRITON_PROMPTS", 1)
    status, out = course_smoke("L4", model_dir, capsys, course_prompts_subset)
    last = out.strip().splitlines()[-1]
    assert status == 0, last
    # 4 prompts x 4 runs + 1 (the Triton run's one prompt), less the C++ run's 4 where it cannot run
    matched = 17 if PROBLEM is None else 13
    assert last.startswith(f"L4 smoke: {matched}/{matched} prompts match L3 and HF"), last
    assert "L4 triton kernel (interpreter), 1 shortest prompts" in out
    preemptions = re.findall(
        r"  L4 torch kernel, small pool .*\n  cpu, .*\n  .*; \d+ steps, (\d+) preemptions",
        out,
    )
    assert len(preemptions) == 1 and int(preemptions[0]) >= 1, preemptions  # the small pool preempts
