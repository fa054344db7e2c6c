"""L1: the contiguous-cache engine against HF, its errors, the smoke script and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from smoke_runs import course_smoke

from kvcourse.model import Transformer, causal_attention
from kvcourse.model_store import REPO_ROOT
from L1_contiguous.cache import KvCache
from L1_contiguous.engine import Engine

# make test runs each smoke on the course model alone, 8 new tokens per prompt (make smoke runs both
# models and 64 tokens; tests/test_smokes.py runs every smoke on the tiny Qwen3 with a long prompt file).


@pytest.fixture(scope="module")
def engine(model_dir):
    return Engine(model_dir)


def test_cache_write_read_positions():
    cache = KvCache(num_layers=2, max_model_len=8, num_kv_heads=1, head_dim=2)
    cache.write(1, 0, torch.ones(3, 1, 2), 2 * torch.ones(3, 1, 2))
    cache.write(1, 3, 5 * torch.ones(1, 1, 2), 6 * torch.ones(1, 1, 2))
    k, v = cache.read(1, 4)
    assert k[:, 0, 0].tolist() == [1, 1, 1, 5] and v[:, 0, 0].tolist() == [2, 2, 2, 6]
    assert cache.k[0].abs().sum() == 0, "layer 0 was never written"
    with pytest.raises(ValueError, match="overflows max_model_len=8"):
        cache.write(0, 7, torch.ones(2, 1, 2), torch.ones(2, 1, 2))


def test_cached_decode_equals_recompute_without_cache(tiny_qwen3_dir):
    """Each cached decode step gives the same greedy token as re-running the whole prefix."""
    eng = Engine(tiny_qwen3_dir)
    model = Transformer.from_dir(tiny_qwen3_dir)
    prompt = [5, 17, 300, 42, 7]
    out = eng.generate([prompt], 12, ignore_eos=True)[0]
    seq = list(prompt)
    for _ in range(12):
        logits = model.forward(
            torch.tensor(seq), torch.arange(len(seq)), lambda layer, q, k, v: causal_attention(q, k, v, 0)
        )
        seq.append(int(logits[-1].argmax()))
    assert out == seq[len(prompt) :]


def test_requests_do_not_leak_into_each_other(tiny_llama_dir):
    """The cache is reused between requests; a longer earlier request must not change a later one."""
    eng = Engine(tiny_llama_dir)
    alone = eng.generate([[9, 8, 7]], 10, ignore_eos=True)
    after = eng.generate([list(range(100, 160)), [9, 8, 7]], 10, ignore_eos=True)
    assert after[1] == alone[0]


def test_ignore_eos_gives_fixed_length(engine):
    outs = engine.generate([[1, 4093, 198, 57]], 7, ignore_eos=True)
    assert len(outs[0]) == 7


@pytest.mark.parametrize(
    "prompts, max_new, message",
    [
        ([[]], 4, "prompt 0 is empty"),
        ([[1, 2], [1, 49152]], 4, r"prompt 1: token id 49152 is outside the vocabulary \[0, 49152\)"),
        ([[1, -1]], 4, "token id -1 is outside"),
        ([[1, 2]], 0, "max_new_tokens must be an integer >= 1, got 0"),
        ([[1] * 2000], 100, "2000 prompt tokens \\+ max_new_tokens 100 = 2100 exceeds max_model_len=2048"),
    ],
)
def test_bad_input_is_named(engine, prompts, max_new, message):
    with pytest.raises(ValueError, match=message):
        engine.generate(prompts, max_new)


def test_max_model_len_over_model_limit(tiny_llama_dir):
    with pytest.raises(ValueError, match=r"max_model_len must be in \[1, 2048\] .*got 4096"):
        Engine(tiny_llama_dir, max_model_len=4096)


def test_stats_report_pool_live_and_utilization(tiny_llama_dir):
    eng = Engine(tiny_llama_dir, max_model_len=64)
    eng.generate([[1, 2, 3, 4]], 4, ignore_eos=True)
    per_token = eng.model.cfg.kv_bytes_per_token()
    stats = eng.stats()
    assert stats.kv_bytes_pool == 64 * per_token
    assert stats.kv_bytes_live == (4 + 3) * per_token  # the last token's K/V is never written
    assert (stats.steps, stats.tokens_run) == (4, 4 + 3)  # a prefill of 4, then 3 decode steps
    assert stats.kv_utilization == pytest.approx((4 + 5 + 6 + 7) / (4 * 64))  # cached after each step
    assert stats.num_blocks == 0 and stats.preemptions == 0 and stats.compiles == {}


@pytest.mark.slow
def test_l1_smoke_on_the_course_model(model_dir, capsys):
    """The smoke check itself on the course model: every prompt equal to HF greedy."""
    status, out = course_smoke("L1", model_dir, capsys)
    last = out.strip().splitlines()[-1]
    assert status == 0, last
    assert last.startswith("L1 smoke: 10/10 prompts match HF")


def test_l1_smoke_with_model_and_prompt_file(tiny_llama_dir, tmp_path):
    """The documented command line, on any local checkpoint and any prompt file, in a fresh process."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        json.dumps({"messages": [{"role": "user", "content": "Hello"}], "max_new_tokens": 5})
        + "\n"
        + json.dumps({"text": "abc"})
        + "\n"
    )
    res = subprocess.run(
        [
            sys.executable,
            "L1_contiguous/l1_smoke.py",
            "--model",
            str(tiny_llama_dir),
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "9",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.strip().splitlines()[-1] == "L1 smoke: 2/2 prompts match HF (14 new tokens)"


CLI_ARGS = ["--max-new-tokens", "6", "--ignore-eos", "Hello there"]


@pytest.mark.parametrize("stage", ["L1", "L2", "L3", "L4", "L5", "L6"])
def test_cli_generate(tiny_llama_dir, stage, capsys):
    """``python -m kvcourse generate`` for every stage (in process; the entry point is run once below)."""
    from kvcourse.harness.cli import main

    assert main(["generate", "--stage", stage, "--model", str(tiny_llama_dir), *CLI_ARGS]) == 0
    out = capsys.readouterr().out
    assert "> chat: Hello there" in out
    assert f"{stage}: 6 new tokens in" in out and "KV pool" in out and "% utilized" in out


def test_cli_entry_point(tiny_llama_dir):
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvcourse",
            "generate",
            "--stage",
            "L1",
            "--model",
            str(tiny_llama_dir),
            *CLI_ARGS,
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    assert "> chat: Hello there" in res.stdout and "L1: 6 new tokens in" in res.stdout


def test_cli_refuses_unknown_stage():
    res = subprocess.run(
        [sys.executable, "-m", "kvcourse", "generate", "--stage", "L9", "x"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2 and "invalid choice: 'L9'" in res.stderr


@pytest.mark.parametrize("stage", ["L1", "L2", "L3", "L4", "L5", "L6"])
def test_zero_length_limit_is_refused_not_defaulted(tiny_llama_dir, stage):
    from kvcourse.harness.stages import engine_class

    with pytest.raises(ValueError, match=r"max_model_len must be in \[1, 2048\] .*got 0"):
        engine_class(stage)(tiny_llama_dir, max_model_len=0)
