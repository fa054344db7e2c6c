"""L4 engine: L3's engine with the paged kernel, equal to L3 and HF; its options and the smoke."""

from __future__ import annotations

import re

import pytest
from cpp_kernel import needs_cpp
from smoke_runs import run_smoke_in_process, smoke_module

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


def test_interpreter_prompts_docstring_examples():
    smoke = smoke_module("L4")
    assert smoke.interpreter_prompts([345, 380, 37]) == [0, 1, 2]
    assert smoke.interpreter_prompts([900, 40, 300, 2000]) == [1, 2]
    assert smoke.interpreter_prompts([2000]) == []
    assert smoke.interpreter_prompts([5] * 9) == [0, 1, 2, 3]  # TRITON_PROMPTS of them


def test_the_interpreter_run_is_bounded_and_says_what_it_covered(
    tiny_qwen3_dir, tmp_path, monkeypatch, capsys
):
    """The smoke's interpreted Triton run takes the prompts within its bound and names them; where even
    the shortest prompt is over it, the run is skipped with the reason, and the rest of the smoke runs."""
    prompts = tmp_path / "three.jsonl"
    prompts.write_text(
        "".join(f'{{"text": "{" ".join(["word"] * n)}"}}\n' for n in (30, 3, 12)), encoding="utf-8"
    )
    argv = ["--model", str(tiny_qwen3_dir), "--prompts", str(prompts), "--max-new-tokens", "2"]
    smoke = smoke_module("L4")
    monkeypatch.setattr(smoke, "TRITON_PROMPTS", 2)
    assert run_smoke_in_process("L4", argv) == 0
    out = capsys.readouterr().out
    assert re.search(r"-- L4 triton kernel \(interpreter\), 2 of 3 prompts, the shortest \(\d+ prompt tokens; "
                     r"bound: 2 prompts, 1,024 tokens\), first 8 new tokens each\n", out), out  # fmt: skip
    monkeypatch.setattr(smoke, "TRITON_PROMPT_TOKENS", 2)
    assert run_smoke_in_process("L4", argv) == 0
    out = capsys.readouterr().out
    assert re.search(
        r"SKIPPED, its shortest prompt has \d+ tokens, over the interpreter's bound of 2 ", out
    ), out
    assert "1 run(s) skipped on this machine" in out.strip().splitlines()[-1]
