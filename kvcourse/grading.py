"""Check helpers for the notebooks' exercises: run the learner's function against the course's own code.

A notebook check cell looks like this::

    # NBVAL_CHECK_OUTPUT
    grading.check_write_kv(write_kv)

and prints one line per fixed, seeded case, then a summary::

    case 1 (prefill: 5 tokens at start 0, empty cache): ok
    case 2 (decode: 1 token at start 5 after a 5-token prefill): WRONG — V differs at positions [5] (max abs diff 1.49)
    case 3 (chunk: 3 tokens at start 9, positions 0..8 filled): raised NotImplementedError: Exercise L1.1: ...
    ...
    1/5 passed

The reference notebook stores these lines as the cell's output; ``make grade`` (nbval) re-runs the cell
and compares, so every line must be deterministic: no timings, no addresses, no random draws that are
not seeded. The reference answers come from the stage code itself (``L1_contiguous.cache.KvCache``,
``L1_contiguous.engine.Engine``, ``ModelConfig``), never from a second copy kept here, so the grader and
the course cannot drift apart. That is the tiny-llm habit: one set of checks grades learner and
reference alike.

Each stage adds its ``check_*`` functions below, built from ``Case`` objects and the shared
``run_cases`` runner. Left out on purpose: partial credit, hints and timeouts. A case passes or fails;
a learner's infinite decode loop is stopped by a step budget, not by a clock (clocks are not
deterministic).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from kvcourse.config import ModelConfig


@dataclass(frozen=True)
class Case:
    """One graded case: a fixed description and a check that returns None (ok) or what is wrong."""

    name: str
    run: Callable[[], str | None]


def run_cases(cases: Iterable[Case]) -> tuple[int, int]:
    """Run each case, print one line per case and a summary; return (passed, total).

    An exception inside a case fails that case only (its type and first line are printed) and the
    next case still runs. Example::

        >>> run_cases([Case("one plus one", lambda: None if 1 + 1 == 2 else "not 2"),
        ...            Case("stub", lambda: int("x"))])
        case 1 (one plus one): ok
        case 2 (stub): raised ValueError: invalid literal for int() with base 10: 'x'
        1/2 passed
        (1, 2)
    """
    passed = total = 0
    for total, case in enumerate(cases, start=1):
        try:
            problem = case.run()
        except Exception as e:  # the learner's code may raise anything; report it and go on
            verdict = f"raised {type(e).__name__}: {_first_line(str(e))}"
        else:
            verdict = "ok" if problem is None else f"WRONG — {problem}"
        passed += verdict == "ok"
        print(f"case {total} ({case.name}): {verdict}")
    print(f"{passed}/{total} passed")
    return passed, total


def _first_line(message: str, width: int = 100) -> str:
    line = message.strip().splitlines()[0] if message.strip() else "(no message)"
    return line if len(line) <= width else line[: width - 3] + "..."


def _positions(rows: torch.Tensor) -> str:
    """Compact list of row indices: ``tensor([5, 6, 7]) -> '[5, 6, 7]'``; ``arange(10) -> '[0, 1, ..., 9]'``."""
    idx = rows.tolist()
    return str(idx) if len(idx) <= 6 else f"[{idx[0]}, {idx[1]}, ..., {idx[-1]}]"


def tensor_problem(what: str, expected: torch.Tensor, got: torch.Tensor) -> str | None:
    """None if ``got`` equals ``expected`` exactly, else which rows (dim 0) differ and by how much.

    Example: ``tensor_problem("K", zeros(4, 2), ones(4, 2))`` ->
    ``'K differs at positions [0, 1, 2, 3] (max abs diff 1)'``.
    """
    if not isinstance(got, torch.Tensor):
        return f"{what} is a {type(got).__name__}, not a tensor"
    if got.shape != expected.shape:
        return f"{what} has shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
    if torch.equal(got, expected):
        return None
    diff = (got.float() - expected.float()).abs()  # same shape as expected
    rows = torch.nonzero(diff.flatten(1).amax(dim=1) > 0).flatten()  # rows holding a difference
    if rows.numel() == 0:  # only NaNs differ
        return f"{what} differs (NaN)"
    return f"{what} differs at positions {_positions(rows)} (max abs diff {diff.nan_to_num().max():.3g})"


# ---------------------------------------------------------------------------------------------------
# L1: contiguous cache


def check_write_kv(write_kv: Callable) -> None:
    """Grade ``write_kv(k_cache, v_cache, start, k, v)`` against ``L1_contiguous.cache.KvCache.write``.

    The learner's function gets one layer's cache, ``k_cache``/``v_cache`` of shape
    (max_seq_len, H_kv, D), and must store the T new tokens' ``k``/``v`` (T, H_kv, D) in place at
    positions start .. start + T - 1, leaving every other position untouched, and raise ``ValueError``
    when the write would run past max_seq_len. Example: start=5, T=1 writes row 5 only.
    """
    from L1_contiguous.cache import KvCache

    max_seq_len, heads, dim = 16, 3, 4

    def case(start: int, n_new: int, filled: int) -> Callable[[], str | None]:
        def run() -> str | None:
            gen = torch.Generator().manual_seed(1000 * start + n_new)
            k = torch.randn(n_new, heads, dim, generator=gen)  # (T, H_kv, D)
            v = torch.randn(n_new, heads, dim, generator=gen)  # (T, H_kv, D)
            ref = KvCache(1, max_seq_len, heads, dim)
            ref.k[0, :filled] = torch.randn(filled, heads, dim, generator=gen)  # earlier tokens' K
            ref.v[0, :filled] = torch.randn(filled, heads, dim, generator=gen)
            k_cache, v_cache = ref.k[0].clone(), ref.v[0].clone()  # (S_max, H_kv, D) each
            ref.write(0, start, k, v)
            write_kv(k_cache, v_cache, start, k.clone(), v.clone())
            return tensor_problem("K", ref.k[0], k_cache) or tensor_problem("V", ref.v[0], v_cache)

        return run

    def overflow() -> str | None:
        k_cache = torch.zeros(max_seq_len, heads, dim)  # (S_max, H_kv, D)
        v_cache = torch.zeros_like(k_cache)
        k = torch.ones(2, heads, dim)  # (2, H_kv, D): positions 15 and 16, one past the end
        try:
            write_kv(k_cache, v_cache, max_seq_len - 1, k, k.clone())
        except ValueError:
            return None
        return f"no ValueError for positions 15..16 with max_seq_len={max_seq_len}"

    run_cases(
        [
            Case("prefill: 5 tokens at start 0, empty cache", case(0, 5, 0)),
            Case("decode: 1 token at start 5 after a 5-token prefill", case(5, 1, 5)),
            Case("chunk: 3 tokens at start 9, positions 0..8 filled", case(9, 3, 9)),
            Case("last slot: 1 token at start 15 of 16", case(15, 1, 15)),
            Case("overflow: 2 tokens at start 15 of 16 must raise ValueError", overflow),
        ]
    )


class _StepLimit:
    """An engine wrapper that stops a decode loop which runs past its budget (instead of hanging)."""

    def __init__(self, engine, limit: int):
        self._engine, self._limit, self.steps = engine, limit, 0

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def decode_step(self, token: int, pos: int) -> torch.Tensor:
        self.steps += 1
        if self.steps > self._limit:
            raise RuntimeError(
                f"decode_step called more than {self._limit} times: does the loop stop at max_new_tokens?"
            )
        return self._engine.decode_step(token, pos)


@functools.lru_cache(maxsize=2)
def _tokenizer(model_dir):
    from kvcourse.prompts import load_tokenizer

    return load_tokenizer(model_dir)


def check_decode_loop(decode_loop: Callable, engine) -> None:
    """Grade ``decode_loop(engine, prompt, max_new_tokens) -> new tokens`` against ``engine.generate``.

    ``engine`` is an ``L1_contiguous.engine.Engine``; its ``generate`` is the reference (it matches
    HF ``generate`` token for token). The learner's loop must prefill, then decode greedily one token
    per step, and stop like HF: the eos token is appended, then generation stops; otherwise stop after
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
            got = decode_loop(_StepLimit(engine, budget), list(ids), budget)
            if not isinstance(got, list | tuple):
                return f"returned a {type(got).__name__}, expected a list of token ids"
            bad = next((t for t in got if not isinstance(t, int)), None)
            if bad is not None:
                return f"a token is a {type(bad).__name__}, expected a Python int: int(logits.argmax())"
            got = list(got)
            if got == expected:
                return None
            pos = next(
                (i for i, (a, b) in enumerate(zip(expected, got)) if a != b), min(len(got), len(expected))
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
