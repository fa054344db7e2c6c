"""The L1 notebook's exercise checkers: the learner's function against this stage's own code.

- ``check_write_kv``: writing K/V into one layer's contiguous cache, against ``KvCache.write``
  (``cache.py``);
- ``check_decode_loop``: the greedy prefill-then-decode loop, against ``Engine.generate``
  (``engine.py``), which matches HF ``generate`` token for token;
- ``check_kv_bytes_per_token``: K/V bytes per token, against ``ModelConfig.kv_bytes_per_token``
  (``kvcourse/config.py``).

The grading contract (see ``kvcourse/grading.py``): each checker runs fixed, seeded cases and prints
one deterministic line per case (``ok``, ``WRONG — what differs``, or ``raised`` and the exception),
then ``k/n passed``. The reference notebook stores those lines as the check cell's output and
``make grade`` compares them. The references are the stage's own code, never a copy kept here.

Left out on purpose: partial credit and hints; a loop that never stops is cut off by a call budget.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch

from kvcourse.config import ModelConfig
from kvcourse.grading import CallLimit, Case, run_cases, tensor_problem

from .cache import KvCache


def check_write_kv(write_kv: Callable) -> None:
    """Grade ``write_kv(k_cache, v_cache, start, k, v)`` against ``KvCache.write``.

    The learner's function gets one layer's cache, ``k_cache``/``v_cache`` of shape
    (max_model_len, H_kv, D), and must store the T new tokens' ``k``/``v`` (T, H_kv, D) in place at
    positions start .. start + T - 1, leaving every other position untouched, and raise ``ValueError``
    when the write would run past max_model_len. Example: start=5, T=1 writes row 5 only.
    """
    max_model_len, heads, dim = 16, 3, 4

    def case(start: int, n_new: int, filled: int) -> Callable[[], str | None]:
        def run() -> str | None:
            gen = torch.Generator().manual_seed(1000 * start + n_new)
            k = torch.randn(n_new, heads, dim, generator=gen)  # (T, H_kv, D)
            v = torch.randn(n_new, heads, dim, generator=gen)  # (T, H_kv, D)
            ref = KvCache(1, max_model_len, heads, dim)
            ref.k[0, :filled] = torch.randn(filled, heads, dim, generator=gen)  # earlier tokens' K
            ref.v[0, :filled] = torch.randn(filled, heads, dim, generator=gen)
            k_cache, v_cache = ref.k[0].clone(), ref.v[0].clone()  # (S_max, H_kv, D) each
            ref.write(0, start, k, v)
            write_kv(k_cache, v_cache, start, k.clone(), v.clone())
            return tensor_problem("K", ref.k[0], k_cache) or tensor_problem("V", ref.v[0], v_cache)

        return run

    def overflow() -> str | None:
        k_cache = torch.zeros(max_model_len, heads, dim)  # (S_max, H_kv, D)
        v_cache = torch.zeros_like(k_cache)
        k = torch.ones(2, heads, dim)  # (2, H_kv, D): positions 15 and 16, one past the end
        try:
            write_kv(k_cache, v_cache, max_model_len - 1, k, k.clone())
        except ValueError:
            return None
        return f"no ValueError for positions 15..16 with max_model_len={max_model_len}"

    run_cases(
        [
            Case("prefill: 5 tokens at start 0, empty cache", case(0, 5, 0)),
            Case("decode: 1 token at start 5 after a 5-token prefill", case(5, 1, 5)),
            Case("chunk: 3 tokens at start 9, positions 0..8 filled", case(9, 3, 9)),
            Case("last slot: 1 token at start 15 of 16", case(15, 1, 15)),
            Case("overflow: 2 tokens at start 15 of 16 must raise ValueError", overflow),
        ]
    )


@functools.lru_cache(maxsize=2)
def _tokenizer(model_dir):
    from kvcourse.prompts import load_tokenizer

    return load_tokenizer(model_dir)


def check_decode_loop(decode_loop: Callable, engine) -> None:
    """Grade ``decode_loop(engine, prompt, max_new_tokens) -> new tokens`` against ``engine.generate``.

    ``engine`` is this stage's ``Engine``; its ``generate`` is the reference (it matches HF
    ``generate`` token for token). The learner's loop must prefill, then decode greedily one token per
    step, and stop like HF: the eos token is appended, then generation stops; otherwise stop after
    ``max_new_tokens`` tokens. Example with eos 2 and budget 4: argmaxes 7, 9, 2 -> ``[7, 9, 2]``.
    On the course model case 1 ends with eos after 8 tokens; the learner's loop gets the engine behind
    a wrapper that raises once ``decode_step`` runs more often than the budget allows.
    """
    from kvcourse.prompts import Prompt, encode

    tok = _tokenizer(engine.model_dir)

    def case(prompt: Prompt, budget: int) -> Callable[[], str | None]:
        def run() -> str | None:
            ids = encode(tok, prompt)
            expected = engine.generate([ids], budget)[0]
            limited = CallLimit(engine, "decode_step", budget, "does the loop stop at max_new_tokens?")
            got = decode_loop(limited, list(ids), budget)
            if not isinstance(got, list | tuple):
                return f"returned a {type(got).__name__}, expected a list of token ids"
            bad = next((t for t in got if not isinstance(t, int)), None)
            if bad is not None:
                return f"a token is a {type(bad).__name__}, expected a Python int: int(logits.argmax())"
            got = list(got)
            if got == expected:
                return None
            pos = next(
                (i for i, (a, b) in enumerate(zip(expected, got, strict=False)) if a != b),
                min(len(got), len(expected)),
            )
            return f"first difference at new token {pos} (expected {len(expected)} tokens, got {len(got)})"

        return run

    run_cases(
        [
            Case(
                "chat prompt, budget 12: stops after eos",
                case(Prompt(messages=(("user", "What is the capital of France?"),)), 12),
            ),
            Case(
                "raw text prompt, budget 4: stops at the budget", case(Prompt(text="The KV cache stores"), 4)
            ),
            Case("budget 1: the prefill's token only", case(Prompt(text="Once upon a time"), 1)),
        ]
    )


def check_kv_bytes_per_token(kv_bytes_per_token: Callable, cfg: ModelConfig) -> None:
    """Grade ``kv_bytes_per_token(cfg, dtype_bytes) -> int`` against ``ModelConfig.kv_bytes_per_token``.

    ``cfg`` is the course model's config; the other cases reshape it. Every layer keeps a K and a V
    vector per KV head per token. Example: SmolLM2-135M in fp32 needs 46,080 bytes per token.
    """

    def case(c: ModelConfig, dtype_bytes: int) -> Callable[[], str | None]:
        def run() -> str | None:
            expected, got = c.kv_bytes_per_token(dtype_bytes), kv_bytes_per_token(c, dtype_bytes)
            return None if got == expected else f"expected {expected:,} bytes, got {got!r}"

        return run

    llama8b = dataclasses.replace(cfg, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128)
    tiny = dataclasses.replace(cfg, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    run_cases(
        [
            Case("the course model, fp32", case(cfg, 4)),
            Case("the course model, bf16", case(cfg, 2)),
            Case("Llama-3-8B shape (32 layers, 8 KV heads, head_dim 128), bf16", case(llama8b, 2)),
            Case("tiny test model (2 layers, 2 KV heads, head_dim 16), fp32", case(tiny, 4)),
        ]
    )
