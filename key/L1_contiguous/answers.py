"""Independent answers to the L1 exercises, for the grader's hidden cases (``kvcourse/grading/hidden.py``).

Each function has the signature the notebook asks for and is written apart from the stage's own
code (``cache.py``, ``engine.py``, ``kvcourse/config.py``), so a bug in the stage cannot make a wrong
answer pass: ``write_kv`` copies one token's row at a time, ``decode_loop`` keeps its position as
the length of prompt plus output, ``kv_bytes_per_token`` adds up the K and V vectors layer by layer,
``ring_positions`` counts whole laps of the ring, and ``contiguous_bytes`` adds up each request's
positions.
Tests check that the stage and these answers agree on many drawn cases.

``EXPECT`` maps each exercise to ``case -> observation``. For L1.1, L1.3, L1.4 and L1.5 it is the exercise's
``observe`` (``exercises/L1_contiguous/checks.py``) run on the answer. L1.2's observation needs the notebook's engine, which
the grader does not build: its expected tokens are Hugging Face's greedy output
(``kvcourse/harness/reference.py``, cached on disk) for the same prompt on the same checkpoint. HF runs each
pool prompt once, to ``POOL_MAX_NEW`` new tokens, and a case with a smaller max_new_tokens takes the first
``max_new_tokens`` of them: greedy decoding with a smaller max_new_tokens is a prefix of the longer run. The
grader imports this file; a submission's sandbox cannot read it.

``STAGE_ADAPTERS`` give the stage's own implementations the learner's signatures (``KvCache.write``
as ``write_kv``, ``Engine.generate`` as ``decode_loop``, the request check and ``KvCache`` as
``contiguous_bytes``; L1.4 has no stage implementation); ``CONTEXT`` builds what L1.2's check cell
passes after the function, an engine on the course model. Both are for the tests.

Left out on purpose: error messages, beyond L1.4's and L1.5's naming the argument and its value (the
rest is graded by the error's type only).
"""

from __future__ import annotations

import functools
import math

from exercises.L1_contiguous.checks import (
    HIDDEN,
    POOL_MAX_NEW,
    SIZE_ARGS,
    _tokenizer,
    decode_call,
    decode_observation,
    prompt_of,
)
from kvcourse.harness.prompts import encode
from kvcourse.model_store import resolve_model_dir


def write_kv(k_cache, v_cache, start, k, v):
    """Copy token i's K and V rows to position start + i, after checking the last one fits."""
    last = start + len(k) - 1
    if last >= len(k_cache):
        raise ValueError(f"positions {start}..{last} do not fit max_model_len={len(k_cache)}")
    for i in range(len(k)):
        k_cache[start + i].copy_(k[i])  # (H_kv, D)
        v_cache[start + i].copy_(v[i])


def decode_loop(engine, prompt, max_new_tokens):
    """Greedy: the prefill's pick, then one decode step per token until eos or max_new_tokens."""
    out = [int(engine.prefill(prompt).argmax())]
    while out[-1] not in engine.model.cfg.eos_token_ids and len(out) < max_new_tokens:
        pos = len(prompt) + len(out) - 1  # the newest token's position; it is not cached yet
        out.append(int(engine.decode_step(out[-1], pos).argmax()))
    return out


def kv_bytes_per_token(cfg, dtype_bytes=4):
    """Every layer keeps a K vector and a V vector per KV head for the token."""
    total = 0
    for _layer in range(cfg.num_layers):
        for _kind in ("K", "V"):
            total += cfg.num_kv_heads * cfg.head_dim * dtype_bytes
    return total


def ring_positions(window, length):
    """Row r holds the newest position p < length with p % window == r: r plus whole laps of window."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if length < 0:
        raise ValueError(f"length must be >= 0, got {length}")
    rows = []
    for r in range(window):
        laps = (length - 1 - r) // window  # full turns of the ring after position r
        rows.append(r + laps * window if r < length else -1)
    return rows


def contiguous_bytes(requests, max_model_len, bytes_per_token, block_size):
    """Accepted requests each hold max_model_len positions, fill P + N - 1 of them, and would hold
    ceil((P + N - 1) / block_size) blocks in a paged pool."""
    for name, value in (("max_model_len", max_model_len), ("bytes_per_token", bytes_per_token),
                        ("block_size", block_size)):  # fmt: skip
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    out = {"reserved": 0, "used": 0, "paged": 0, "refused": []}
    for i, (prompt_len, new_tokens) in enumerate(requests):
        if prompt_len < 1 or new_tokens < 1 or prompt_len + new_tokens > max_model_len:
            out["refused"].append(i)
            continue
        cached = prompt_len + new_tokens - 1
        out["reserved"] += max_model_len * bytes_per_token
        out["used"] += cached * bytes_per_token
        out["paged"] += math.ceil(cached / block_size) * block_size * bytes_per_token
    return out


@functools.lru_cache(maxsize=64)
def hf_tokens(prompt_ids: tuple[int, ...]) -> tuple[int, ...]:
    """HF's greedy new tokens for a prompt, up to ``POOL_MAX_NEW`` (eos included when HF stops on it)."""
    from kvcourse.harness.reference import hf_greedy

    return tuple(hf_greedy(resolve_model_dir(), [list(prompt_ids)], [POOL_MAX_NEW])[0].tokens)


def expect_decode(case: dict) -> list[dict]:
    """L1.2's observation of a right loop: HF's tokens for the case's prompt, cut to its max_new_tokens."""
    ids = encode(_tokenizer(resolve_model_dir()), prompt_of(case))
    return decode_observation(decode_call(case), list(hf_tokens(tuple(ids))[: case["max_new_tokens"]]))


def kvcache_write(k_cache, v_cache, start, k, v):
    """``KvCache.write`` as ``write_kv``: a one-layer cache whose storage is the given tensors."""
    from L1_contiguous.cache import KvCache

    cache = KvCache(1, k_cache.shape[0], *k_cache.shape[1:])
    cache.k, cache.v = k_cache[None], v_cache[None]  # views: the write lands in the caller's tensors
    cache.write(0, start, k, v)


def engine_generate(engine, prompt, max_new_tokens):
    """``Engine.generate`` as ``decode_loop``."""
    return engine.generate([prompt], max_new_tokens)[0]


def contiguous_by_simulation(requests, max_model_len, bytes_per_token, block_size):
    """The stage's ``KvCache`` and ``check_requests`` run request by request (``simulate_contiguous``
    of ``exercises/L1_contiguous/checks.py``), as ``contiguous_bytes``."""
    from exercises.L1_contiguous.checks import simulate_contiguous

    for name, value in zip(SIZE_ARGS, (max_model_len, bytes_per_token, block_size), strict=True):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    return simulate_contiguous(requests, max_model_len, bytes_per_token, block_size)


def course_engine() -> tuple:
    """The L1.2 check cell's context: an engine on the course model (a short cache is enough)."""
    from L1_contiguous.engine import Engine

    return (Engine(max_model_len=256),)


ANSWERS = {
    "L1.1": write_kv,
    "L1.2": decode_loop,
    "L1.3": kv_bytes_per_token,
    "L1.4": ring_positions,
    "L1.5": contiguous_bytes,
}
EXPECT = {
    "L1.1": lambda case: HIDDEN["L1.1"].observe(write_kv, case),
    "L1.2": expect_decode,
    "L1.3": lambda case: HIDDEN["L1.3"].observe(kv_bytes_per_token, case),
    "L1.4": lambda case: HIDDEN["L1.4"].observe(ring_positions, case),
    "L1.5": lambda case: HIDDEN["L1.5"].observe(contiguous_bytes, case),
}
STAGE_ADAPTERS = {"L1.1": kvcache_write, "L1.2": engine_generate, "L1.5": contiguous_by_simulation}
CONTEXT = {"L1.2": course_engine}
