"""The L1 notebook's exercise checkers: the learner's function against this stage's own code.

- ``check_write_kv``: writing K/V into one layer's contiguous cache, against ``KvCache.write``
  (``cache.py``);
- ``check_decode_loop``: the greedy prefill-then-decode loop, against ``Engine.generate``
  (``engine.py``), which matches HF ``generate`` token for token;
- ``check_kv_bytes_per_token``: K/V bytes per token, against ``ModelConfig.kv_bytes_per_token``
  (``kvcourse/config.py``);
- beyond the stage, ``check_ring_positions`` (L1.4, a sliding-window ring buffer) against a
  position-by-position simulation, and ``check_contiguous_bytes`` (L1.5, what contiguous caches reserve
  and use) against a simulation with ``KvCache`` and ``kvcourse.limits.check_requests``.

The grading contract (see ``kvcourse/grading/cases.py``): each checker runs fixed, seeded cases and prints
one deterministic line per case (``ok``, ``WRONG — what differs``, or ``raised`` and the exception),
then ``k/n passed``. The reference notebook stores those lines as the check cell's output and
``make grade`` compares them. The references are the stage's own code, never a copy kept here (L1.4's
two huge cases, which no simulation reaches, store their expected rows as data). When a wrong answer
gives what a known mistake gives (an off-by-one, K and V swapped, the factor 2 missing), its line says
which rule it breaks.

Below the checkers, ``HIDDEN`` holds each exercise's hidden cases for ``make grade``
(``kvcourse/grading/hidden.py``): drawn from a seed per grading run and judged in the grader's process against
the independent answers of ``key/L1_contiguous/answers.py``, never against this stage's code.

Left out on purpose: partial credit and hints; a loop that never stops is cut off by a call limit.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable

import torch

from kvcourse.config import ModelConfig
from kvcourse.grading.cases import (
    CallLimit,
    Case,
    first_line,
    named_mistake,
    run_cases,
    tensor_problem,
    time_limit,
)
from kvcourse.grading.hidden import Hidden
from kvcourse.harness.prompts import Prompt, encode
from L1_contiguous.cache import KvCache


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
            before = k_cache.clone(), v_cache.clone()
            ref.write(0, start, k, v)
            write_kv(k_cache, v_cache, start, k.clone(), v.clone())
            problem = tensor_problem("K", ref.k[0], k_cache) or tensor_problem("V", ref.v[0], v_cache)
            return named_mistake(problem, (k_cache, v_cache), write_mistakes(before, start, k, v), same_pair)

        return run

    def overflow() -> str | None:
        k_cache = torch.zeros(max_model_len, heads, dim)  # (S_max, H_kv, D)
        v_cache = torch.zeros_like(k_cache)
        k = torch.ones(3, heads, dim)  # (3, H_kv, D): positions 15, 16 and 17, two past the end
        try:
            write_kv(k_cache, v_cache, max_model_len - 1, k, k.clone())
        except ValueError as e:
            return overflow_message_problem(str(e), 15, 17, max_model_len)
        return f"no ValueError for positions 15..17 with max_model_len={max_model_len}"

    run_cases(
        [
            Case("prefill: 5 tokens at start 0, empty cache", case(0, 5, 0)),
            Case("decode: 1 token at start 5 after a 5-token prefill", case(5, 1, 5)),
            Case("chunk: 3 tokens at start 9, positions 0..8 filled", case(9, 3, 9)),
            Case("last slot: 1 token at start 15 of 16", case(15, 1, 15)),
            Case("overflow: 3 tokens at start 15 of 16 must raise ValueError naming 15..17 and 16", overflow),
        ]
    )


def write_mistakes(before, start: int, k: torch.Tensor, v: torch.Tensor) -> dict:
    """What known wrong writes leave in a cache that held ``before`` (K, V), by the rule each breaks."""

    def written(at: int, new_k: torch.Tensor, new_v: torch.Tensor):
        k_cache, v_cache = before[0].clone(), before[1].clone()  # (S_max, H_kv, D) each
        end = min(at + len(new_k), len(k_cache))
        k_cache[max(at, 0) : end] = new_k[max(-at, 0) : end - at]
        v_cache[max(at, 0) : end] = new_v[max(-at, 0) : end - at]
        return k_cache, v_cache

    return {
        "off by one: the tokens land one position late (start + 1)": lambda: written(start + 1, k, v),
        "off by one: the tokens land one position early (start - 1)": lambda: written(start - 1, k, v),
        "K and V are swapped": lambda: written(start, v, k),
        "K is written into both caches": lambda: written(start, k, k),
    }


def same_pair(a, b) -> bool:
    """Two (K, V) pairs of tensors are equal."""
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def overflow_message_problem(message: str, first: int, last: int, max_model_len: int) -> str | None:
    """None if an overflow's message names the positions and the limit (as numbers), else what is
    missing. ``overflow_message_problem("positions 15..17 overflow max_model_len=16", 15, 17, 16)`` ->
    None; ``overflow_message_problem("bad", 15, 17, 16)`` -> ``"the ValueError says 'bad': name the
    positions 15..17 and max_model_len=16"``."""
    numbers = {int(n) for n in re.findall(r"\d+", message)}
    if {first, last, max_model_len} <= numbers:
        return None
    return f"the ValueError says {first_line(message)!r}: name the positions {first}..{last} and max_model_len={max_model_len}"


@functools.lru_cache(maxsize=2)
def _tokenizer(model_dir):
    from kvcourse.harness.prompts import load_tokenizer

    return load_tokenizer(model_dir)


def position_hint(pos: int, got: int, expected: int) -> str:
    """A hint for the usual slip when the prefill's token is right and a decoded one is not: a decode
    step runs at the wrong position (RoPE is relative, so a position one off may change a token only
    a few steps later). ``position_hint(2, 4, 4)`` -> the hint; ``position_hint(0, 4, 4)`` (the
    prefill's token) and ``position_hint(3, 3, 4)`` (stopped early) -> ``""``."""
    if pos < 1 or pos >= min(got, expected):
        return ""
    return "; are the decode positions right? the first decode step runs the prefill's token at position len(prompt)"


def check_decode_loop(decode_loop: Callable, engine) -> None:
    """Grade ``decode_loop(engine, prompt, max_new_tokens) -> new tokens`` against ``engine.generate``.

    ``engine`` is this stage's ``Engine``; its ``generate`` is the reference (it matches HF
    ``generate`` token for token). The learner's loop must prefill, then decode greedily one token per
    step, and stop like HF: the eos token is appended, then generation stops; otherwise stop after
    ``max_new_tokens`` tokens. Example with eos 2 and max_new_tokens 4: argmaxes 7, 9, 2 -> ``[7, 9, 2]``.
    On the course model case 1 ends with eos after 8 tokens; the learner's loop gets the engine behind
    a wrapper that raises once ``decode_step`` runs more often than max_new_tokens allows.
    """
    tok = _tokenizer(engine.model_dir)

    def case(prompt: Prompt, max_new: int) -> Callable[[], str | None]:
        def run() -> str | None:
            ids = encode(tok, prompt)
            expected = engine.generate([ids], max_new)[0]
            limited = CallLimit(engine, "decode_step", max_new, "does the loop stop at max_new_tokens?")
            got = decode_loop(limited, list(ids), max_new)
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
            hint = position_hint(pos, len(got), len(expected))
            if got == expected[:-1] and expected[-1] in engine.model.cfg.eos_token_ids:
                hint = "; the eos token is not kept: HF appends it, then stops"
            elif len(got) > len(expected) and got[: len(expected)] == expected:
                hint = "; the loop does not stop after the eos token"
            return (
                f"first difference at new token {pos} (expected {len(expected)} tokens, got {len(got)}){hint}"
            )

        return run

    run_cases(
        [
            Case(
                "chat prompt, max_new_tokens 12: stops after eos",
                case(Prompt(messages=(("user", "What is the capital of France?"),)), 12),
            ),
            Case(
                "raw text prompt, max_new_tokens 4: stops at max_new_tokens",
                case(Prompt(text="The KV cache stores"), 4),
            ),
            Case("max_new_tokens 1: the prefill's token only", case(Prompt(text="Once upon a time"), 1)),
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
            problem = None if got == expected else f"expected {expected:,} bytes, got {got!r}"
            per_vector = c.num_kv_heads * c.head_dim * dtype_bytes  # one K (or V) vector of one layer
            return named_mistake(
                problem,
                got,
                {
                    "K only: the factor 2 for K and V is missing": lambda: c.num_layers * per_vector,
                    "query heads counted: K and V are stored per KV head": lambda: (
                        2 * c.num_layers * c.num_heads * c.head_dim * dtype_bytes
                    ),
                    "numbers counted, not bytes: dtype_bytes is missing": lambda: (
                        2 * c.num_layers * per_vector // dtype_bytes
                    ),
                    "one layer only: every layer keeps its own K and V": lambda: 2 * per_vector,
                },
            )

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


# Hidden cases (kvcourse/grading/hidden.py): drawn per grading run, observed here in the learner's kernel,
# judged in the grader's process against the independent answers of key/L1_contiguous/answers.py.


def draw_writes(rng) -> list[dict]:
    """Random small caches and runs of writes into them: a prefill (now and then of 0 tokens), then
    decode tokens, chunks, a new request writing from position 0 again, writes that end exactly at
    max_model_len and writes that would run past it (in two cases or more)."""
    cases = []
    for c in range(7):
        max_model_len = rng.randint(1, 12)
        pos = rng.randint(0, max_model_len)
        writes = [[0, pos]]  # the prefill
        for _ in range(rng.randint(2, 5)):
            kind = rng.choice(["decode", "decode", "chunk", "restart", "to the end", "past the end"])
            if kind == "restart":
                start, n = 0, rng.randint(1, max_model_len)
            elif kind == "to the end":
                start = rng.randint(0, max_model_len - 1)
                n = max_model_len - start
            elif kind == "past the end":
                start = rng.choice([pos, max_model_len - 1, max_model_len])
                n = max_model_len - start + rng.randint(1, 3)
            else:
                start, n = pos, 1 if kind == "decode" else rng.randint(2, 4)
            writes.append([start, n])
            if start + n <= max_model_len:
                pos = start + n
        if c < 2 and all(start + n <= max_model_len for start, n in writes):  # two cases or more overflow
            start = rng.choice([pos, max_model_len])
            writes.insert(rng.randint(1, len(writes)), [start, max_model_len - start + rng.randint(1, 3)])
        cases.append(
            {
                "max_model_len": max_model_len,
                "heads": rng.randint(1, 3),
                "dim": rng.randint(1, 4),
                "seed": rng.randrange(10**6),
                "writes": writes,
            }
        )
    return cases


def row_labels(cache: torch.Tensor, old: torch.Tensor, written: dict[str, torch.Tensor]) -> list[str]:
    """What each position of ``cache`` (S, H_kv, D) holds, in words: ``"."`` its earlier content,
    ``"w2:0"`` token 0 of write 2 (``written`` maps such names to (H_kv, D) rows), ``"old 3"`` the
    earlier content of position 3, ``"?"`` anything else. Example: a write of 2 tokens at start 1 into
    a cache of 4 -> ``[".", "w0:0", "w0:1", "."]``."""
    labels = []
    for pos, row in enumerate(cache):
        if torch.equal(row, old[pos]):
            labels.append(".")
            continue
        names = [name for name, r in written.items() if torch.equal(row, r)]
        names += [f"old {p}" for p in range(len(old)) if torch.equal(row, old[p])]
        labels.append(names[0] if names else "?")
    return labels


def observe_writes(fn, case) -> list[dict]:
    """Run a case's writes through ``fn`` on one layer's cache; after each record whether it raised
    ValueError and what every position of K and of V holds (``row_labels``)."""
    gen = torch.Generator().manual_seed(case["seed"])
    shape = (case["max_model_len"], case["heads"], case["dim"])
    k_old, v_old = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)  # (S, H_kv, D)
    k_cache, v_cache = k_old.clone(), v_old.clone()
    written_k, written_v = {}, {}  # "w2:0" -> (H_kv, D)
    steps = []
    for w, (start, n) in enumerate(case["writes"]):
        k = torch.randn(n, *shape[1:], generator=gen)  # (T, H_kv, D)
        v = torch.randn(n, *shape[1:], generator=gen)
        call = f"write_kv(start={start}, T={n}) into max_model_len {shape[0]}"
        try:
            fn(k_cache, v_cache, start, k.clone(), v.clone())
            raised = None
        except ValueError as e:  # its message must name the positions and the limit
            named = overflow_message_problem(str(e), start, start + n - 1, shape[0]) is None
            raised = (
                "ValueError"
                if named
                else "ValueError whose message does not name the positions and the limit"
            )
        written_k.update({f"w{w}:{i}": k[i] for i in range(n)})
        written_v.update({f"w{w}:{i}": v[i] for i in range(n)})
        swapped_k = {f"V of {name}": r for name, r in written_v.items()}  # K and V mixed up
        swapped_v = {f"K of {name}": r for name, r in written_k.items()}
        steps.append(
            {
                "call": call,
                "raised": raised,
                "K": row_labels(k_cache, k_old, {**written_k, **swapped_k}),
                "V": row_labels(v_cache, v_old, {**written_v, **swapped_v}),
            }
        )
    return steps


def describe_writes(case: dict) -> str:
    writes = ", ".join(f"(start {s}, T {n})" for s, n in case["writes"])
    return f"max_model_len {case['max_model_len']}, H_kv {case['heads']}, D {case['dim']}: writes {writes}"


# L1.2: a fixed pool of prompts, each with the number of new tokens after which the course model
# ends it with eos (None: not within POOL_MAX_NEW). The lengths only aim the drawn max_new_tokens at the
# boundaries; the expected tokens come from HF (key/L1_contiguous/answers.py), up to POOL_MAX_NEW per prompt.
POOL_MAX_NEW = 14
POOL = [
    {"messages": [["user", "What is the capital of Japan?"]], "ends": 8},
    {"messages": [["user", "Hi!"]], "ends": 10},
    {"messages": [["user", "What is the capital of Italy?"]], "ends": 9},
    {"messages": [["user", "What is 2 + 2?"]], "ends": 12},
    {"text": "The", "ends": None},  # a prompt of one token
    {"text": "Hello", "ends": None},
    {"text": "The KV cache stores", "ends": None},
    {"text": "Once upon a time", "ends": None},
    {"text": "1, 2, 3, 4,", "ends": None},
]


def draw_decode(rng) -> list[dict]:
    """Six (prompt, max_new_tokens) cases from ``POOL``: a chat prompt whose answer ends with eos
    inside max_new_tokens, one whose max_new_tokens end exactly at the eos or one token before it,
    max_new_tokens 1, a one-token prompt, a raw text prompt, and one more of any kind; max_new_tokens up to
    POOL_MAX_NEW."""
    ending = [p for p in POOL if p["ends"]]
    short = [p for p in POOL if "text" in p and len(p["text"].split()) == 1]
    text = [p for p in POOL if "text" in p]
    eos, edge = rng.sample(ending, 2)
    picks = [
        (eos, rng.randint(eos["ends"] + 1, POOL_MAX_NEW)),
        (edge, edge["ends"] - rng.randint(0, 1)),
        (rng.choice(POOL), 1),
        (rng.choice(short), rng.randint(2, 6)),
        (rng.choice(text), rng.randint(2, 6)),
        (rng.choice(POOL), rng.randint(1, 5)),
    ]
    return [
        {"prompt": {k: v for k, v in p.items() if k != "ends"}, "max_new_tokens": max_new}
        for p, max_new in picks
    ]


def prompt_of(case: dict):
    """The case's prompt as a ``kvcourse.harness.prompts.Prompt``."""
    p = case["prompt"]
    if "messages" in p:
        return Prompt(messages=tuple((role, content) for role, content in p["messages"]))
    return Prompt(text=p["text"])


def decode_call(case: dict) -> str:
    """The step's name: ``decode_loop(engine, chat 'Hi!', 5)``."""
    return f"decode_loop(engine, {prompt_of(case).label!r}, {case['max_new_tokens']})"


def decode_observation(call: str, tokens) -> list[dict]:
    """One step: how many tokens came back and which (a token that is not a Python int shows as
    its repr, as the visible check refuses it too)."""
    if not isinstance(tokens, list | tuple):
        return [{"call": call, "count": None, "returned": repr(tokens)}]
    returned = [t if type(t) is int else repr(t) for t in tokens]
    return [{"call": call, "count": len(returned), "returned": returned}]


def observe_decode(fn, case, engine) -> list[dict]:
    """Run ``fn(engine, prompt ids, max_new_tokens)`` on the notebook's engine, behind a wrapper that
    stops a loop running past max_new_tokens."""
    ids = encode(_tokenizer(engine.model_dir), prompt_of(case))
    max_new = case["max_new_tokens"]
    limited = CallLimit(engine, "decode_step", max_new, "does the loop stop at max_new_tokens?")
    return decode_observation(decode_call(case), fn(limited, list(ids), max_new))


def describe_decode(case: dict) -> str:
    return f"{prompt_of(case).label}, max_new_tokens {case['max_new_tokens']}"


DTYPE_BYTES = [1, 2, 4, 8]


def draw_configs(rng) -> list[dict]:
    """Random model shapes: grouped-query (KV heads dividing the query heads), multi-query (one KV
    head) and plain multi-head attention, head_dim not always hidden_size / num_heads, a few dtype
    sizes each."""
    cases = []
    for _ in range(8):
        num_heads = rng.choice([1, 2, 4, 8, 9, 12, 16, 32, 64])
        divisors = [d for d in range(1, num_heads + 1) if num_heads % d == 0]
        num_kv_heads = rng.choice([1, num_heads, rng.choice(divisors)])
        head_dim = rng.choice([16, 32, 64, 80, 96, 128, 256])
        hidden = num_heads * head_dim * rng.choice([1, 1, 2]) // rng.choice([1, 2])
        config = {
            "model_type": rng.choice(["llama", "qwen3"]),
            "vocab_size": rng.randint(1000, 160_000),
            "hidden_size": hidden,
            "intermediate_size": 4 * hidden,
            "num_layers": rng.randint(1, 80),
            "num_heads": num_heads,
            "num_kv_heads": num_kv_heads,
            "head_dim": head_dim,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "tie_word_embeddings": rng.random() < 0.5,
            "max_position_embeddings": rng.choice([2048, 8192, 32768]),
            "eos_token_ids": [2],
        }
        cases.append({"config": config, "dtype_bytes": rng.sample(DTYPE_BYTES, rng.randint(2, 4))})
    return cases


def as_count(value):
    """An int for any whole number (``46080.0`` -> 46080, as the visible check's ``==`` accepts it),
    else the value's repr."""
    try:
        return int(value) if value == int(value) else repr(value)
    except (TypeError, ValueError, OverflowError):
        return repr(value)


def observe_config(fn, case, *context) -> list[dict]:
    """``fn(cfg, dtype_bytes)`` for each of the case's dtype sizes (the notebook's ``cfg``, passed as
    context, is not needed: the case builds its own)."""
    cfg = ModelConfig(**{**case["config"], "eos_token_ids": tuple(case["config"]["eos_token_ids"])})
    return [
        {"call": f"kv_bytes_per_token(cfg, {b})", "returned": as_count(fn(cfg, b))}
        for b in case["dtype_bytes"]
    ]


def describe_config(case: dict) -> str:
    c = case["config"]
    return (
        f"{c['num_layers']} layers, {c['num_heads']} query heads, {c['num_kv_heads']} KV heads, "
        f"head_dim {c['head_dim']}, hidden {c['hidden_size']}; dtype bytes {case['dtype_bytes']}"
    )


def draw_ring(rng) -> list[dict]:
    """Windows of 1 to 9 rows and lengths before, at and past the first wrap, two huge ones, and a bad
    window or length."""
    cases = []
    for _ in range(8):
        window = rng.randint(1, 9)
        length = rng.choice([0, rng.randint(1, window), window, window + 1, rng.randint(window, 6 * window)])
        cases.append({"window": window, "length": length})
    cases += [{"window": rng.randint(1, 64), "length": rng.randint(10**12, 10**18)} for _ in range(2)]
    cases.insert(rng.randint(0, len(cases)), rng.choice([{"window": rng.randint(-2, 0), "length": 4},
                                                          {"window": 3, "length": rng.randint(-5, -1)}]))  # fmt: skip
    return cases


def observe_ring(fn, case) -> dict:
    try:
        got = fn(case["window"], case["length"])
    except ValueError as e:
        name = "window" if case["window"] < 1 else "length"
        return {
            "raised": "ValueError",
            "names the argument and its value": names_value(str(e), name, case[name]),
        }
    return {"returned": list(got) if isinstance(got, list | tuple) else repr(got)}


def describe_ring(case: dict) -> str:
    return f"ring_positions(window={case['window']}, length={case['length']})"


SIZE_ARGS = ("max_model_len", "bytes_per_token", "block_size")  # L1.5's arguments after requests


def draw_contiguous(rng) -> list[dict]:
    """Batches of up to 6 requests under a small max_model_len: some end exactly at the limit, some one
    past it, some with an empty prompt or no new token; block sizes 1 to 16; each of the three sizes
    below 1 once."""
    cases = []
    for _ in range(7):
        limit = rng.randint(1, 64)
        requests = []
        for _ in range(rng.randint(0, 6)):
            p = rng.randint(0, limit)
            kind = rng.choice(["fits", "fits", "exact", "past", "zero"])
            n = {"fits": rng.randint(1, max(1, limit - p)), "exact": limit - p, "past": limit - p + 1,
                 "zero": 0}[kind]  # fmt: skip
            requests.append([p, n])
        cases.append({"requests": requests, "max_model_len": limit, "bytes_per_token": rng.choice([1, 8, 46_080]),
                      "block_size": rng.randint(1, 16)})  # fmt: skip
    good = cases[0]
    for bad in SIZE_ARGS:
        cases.insert(rng.randint(0, len(cases)), {**good, bad: rng.randint(-1, 0)})
    return cases


def observe_contiguous(fn, case) -> dict:
    args = (case["max_model_len"], case["bytes_per_token"], case["block_size"])
    try:
        got = fn([tuple(r) for r in case["requests"]], *args)
    except ValueError as e:
        name = next(n for n in SIZE_ARGS if case[n] < 1)
        return {
            "raised": "ValueError",
            "names the argument and its value": names_value(str(e), name, case[name]),
        }
    if not isinstance(got, dict):
        return {"returned": repr(got)}
    return {k: list(v) if isinstance(v, list | tuple) else v for k, v in got.items()}


def describe_contiguous(case: dict) -> str:
    return (
        f"requests {case['requests']}, max_model_len {case['max_model_len']}, "
        f"{plural(case['bytes_per_token'], 'byte')} per token, block_size {case['block_size']}"
    )


HIDDEN = {
    "L1.1": Hidden(
        draw_writes, observe_writes, describe_writes, answers=("L1_contiguous.cache:KvCache.write",)
    ),
    "L1.2": Hidden(
        draw_decode, observe_decode, describe_decode, answers=("L1_contiguous.engine:Engine.generate",)
    ),
    "L1.3": Hidden(
        draw_configs,
        observe_config,
        describe_config,
        answers=("kvcourse.config:ModelConfig.kv_bytes_per_token",),
    ),
    "L1.4": Hidden(draw_ring, observe_ring, describe_ring),
    "L1.5": Hidden(
        draw_contiguous,
        observe_contiguous,
        describe_contiguous,
        answers=("kvcourse.limits:check_requests",),
    ),
}


# ---------------------------------------------------------------------------------------------------
# Beyond the stage: L1.4 (a sliding-window ring buffer) and L1.5 (what contiguous caches reserve).
# Their visible references are brute-force simulations (write position after position; run the
# stage's KvCache and its request check), which the exercises ask the learner not to need.

RING_HUGE = 10**15  # a length no loop over positions can reach


def simulate_ring(window: int, length: int) -> list[int]:
    """Rows of a ring of ``window`` rows after writing positions 0 .. length - 1 one by one (small
    lengths only): the brute-force reference of L1.4."""
    rows = [-1] * window
    for p in range(length):
        rows[p % window] = p
    return rows


# L1.4's huge cases cannot be simulated: their expected rows were computed once with key/L1_contiguous/answers.py's
# ring_positions and are stored here as data (tests/test_exercises_l1_beyond.py checks them).
RING_HUGE_ROWS = {
    (5, RING_HUGE): [999_999_999_999_995, 999_999_999_999_996, 999_999_999_999_997, 999_999_999_999_998,
                     999_999_999_999_999],
    (7, RING_HUGE + 3): [1_000_000_000_000_001, 1_000_000_000_000_002, 999_999_999_999_996,
                         999_999_999_999_997, 999_999_999_999_998, 999_999_999_999_999,
                         1_000_000_000_000_000],
}  # fmt: skip


def check_ring_positions(ring_positions: Callable) -> None:
    """Grade ``ring_positions(window, length) -> list[int]``: for each row of a ring buffer of
    ``window`` rows, the position whose K/V it holds after positions 0 .. length - 1 were written in
    order (position p into row p % window), -1 for a row never written; ``ValueError`` for
    window < 1 or length < 0, its message naming the argument and its value. Two cases use a length no
    loop over positions can reach."""

    def case(window: int, length: int) -> Callable[[], str | None]:
        def run() -> str | None:
            expected = RING_HUGE_ROWS.get((window, length)) or simulate_ring(window, length)
            with seconds_limit(5, "no loop over positions can reach this length: compute each row directly"):
                got = ring_positions(window, length)
            if isinstance(got, tuple):
                got = list(got)
            if not isinstance(got, list):
                return f"returned {short_rows(got)}, expected a list of {plural(len(expected), 'row')}"
            if got == expected:
                return None
            problem = rows_problem(got, expected)
            if (window, length) in RING_HUGE_ROWS:
                return problem
            return named_mistake(
                problem,
                got,
                {
                    "each row holds the oldest position written there, not the newest": lambda: [
                        r if r < length else -1 for r in range(window)
                    ],
                    "off by one: length positions are 0 .. length - 1": lambda: simulate_ring(
                        window, length + 1
                    ),
                    "off by one: one position too few": lambda: simulate_ring(window, length - 1),
                    "a row never written must read -1": lambda: [max(p, 0) for p in expected],
                },
            )

        return run

    def refused(window: int, length: int, names: str) -> Callable[[], str | None]:
        def run() -> str | None:
            value = window if names == "window" else length
            try:
                got = ring_positions(window, length)
            except ValueError as e:
                return unnamed(str(e), names, value)
            return f"no ValueError for {names} {value}, returned {got!r}"

        return run

    run_cases(
        [
            Case("window 4, 3 positions: not yet wrapped", case(4, 3)),
            Case("window 4, 4 positions: exactly full", case(4, 4)),
            Case("window 4, 10 positions: wrapped twice", case(4, 10)),
            Case("window 1, 6 positions", case(1, 6)),
            Case("window 3, nothing written", case(3, 0)),
            Case(f"window 5, {RING_HUGE:,} positions", case(5, RING_HUGE)),
            Case(f"window 7, {RING_HUGE + 3:,} positions", case(7, RING_HUGE + 3)),
            Case("window 0 is refused with a ValueError naming it", refused(0, 5, "window")),
            Case("length -3 is refused with a ValueError naming it", refused(4, -3, "length")),
        ]
    )


def seconds_limit(seconds: int, hint: str):
    """Raise TimeoutError(hint) in the block after ``seconds`` (a learner's loop over 10**15 positions
    would otherwise hang the notebook); main thread only, elsewhere no limit."""
    return time_limit(seconds, TimeoutError(f"still running after {seconds} s: {hint}"))


def short_rows(rows) -> str:
    """A list of rows in at most 80 characters."""
    text = repr(rows)
    return text if len(text) <= 80 else text[:77] + "..."


def plural(count: int, noun: str) -> str:
    """``plural(1, "row") -> '1 row'``; ``plural(3, "row") -> '3 rows'``."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def rows_problem(got: list, expected: list[int]) -> str:
    """How returned rows differ from the expected ones, in one line: both lists when they are short,
    else the first row that differs with both values (a list cut at 80 characters could hide it).

    Examples: ``rows_problem([0, 1], [0, 2]) -> 'rows [0, 1], expected [0, 2]'``;
    ``rows_problem([0, 1], [0]) -> 'rows [0, 1], expected 1 row: [0]'``; with 15-digit positions,
    ``'row 2 is 999999999999998, expected 999999999999997 (the first of 3 rows that differ)'``.
    """
    count = plural(len(expected), "row")
    if len(repr(got)) <= 80 and len(repr(expected)) <= 80:
        shown = repr(expected) if len(got) == len(expected) else f"{count}: {expected!r}"
        return f"rows {got!r}, expected {shown}"
    differ = [r for r in range(min(len(got), len(expected))) if got[r] != expected[r]]
    first = f"row {differ[0]} is {got[differ[0]]!r}, expected {expected[differ[0]]!r}" if differ else ""
    if len(got) != len(expected):
        return f"{plural(len(got), 'row')}, expected {count}" + (f"; {first}" if first else "")
    if len(differ) != 1:
        return (
            f"{first} (the first of {len(differ)} rows that differ)" if differ else f"rows {short_rows(got)}"
        )
    return first


def names_value(message: str, name: str, value: int) -> bool:
    """Whether an error message names the argument and gives its value (as a whole number, so that 0
    is not found in 10): ``names_value("window must be >= 1, got 0", "window", 0) -> True``."""
    return (
        name in message and re.search(rf"(?<![\w.]){re.escape(str(value))}(?!\w|\.\d)", message) is not None
    )


def unnamed(message: str, name: str, value: int) -> str | None:
    """None when a ValueError's message names the argument and its value, else what it leaves out.

    Example: ``unnamed("got 0", "window", 0)`` -> ``"the ValueError says 'got 0': name the argument
    window and its value 0"``.
    """
    if names_value(message, name, value):
        return None
    return f"the ValueError says {first_line(message)!r}: name the argument {name} and its value {value}"


def simulate_contiguous(
    requests: list[tuple[int, int]], max_model_len: int, bytes_per_token: int, block_size: int
) -> dict:
    """L1.5's brute-force reference: each request goes through ``kvcourse.limits.check_requests`` (the
    engines' own refusal), gets a one-layer ``KvCache`` of its own, and writes its prompt and then one
    decode token at a time as the engine does; the written rows are counted, and the blocks of
    ``block_size`` rows they touch. Bytes scale the cache's own ``nbytes``."""
    from kvcourse.limits import check_requests

    reserved = used = paged = 0
    refused = []
    for i, (prompt_len, new_tokens) in enumerate(requests):
        try:
            check_requests([[0] * prompt_len], new_tokens, 1, max_model_len)
        except ValueError:
            refused.append(i)
            continue
        cache = KvCache(1, max_model_len, 1, 1)  # one number per position and tensor: 8 bytes a row
        ones = torch.ones(prompt_len, 1, 1)  # (P, H_kv, D)
        cache.write(0, 0, ones, ones)  # the prefill
        for pos in range(prompt_len, prompt_len + new_tokens - 1):  # decode steps feed tokens back
            cache.write(0, pos, ones[:1], ones[:1])
        rows = torch.nonzero(cache.k[0, :, 0, 0]).flatten().tolist()
        reserved += cache.nbytes // 8 * bytes_per_token
        used += len(rows) * bytes_per_token
        paged += len({r // block_size for r in rows}) * block_size * bytes_per_token
    return {"reserved": reserved, "used": used, "paged": paged, "refused": refused}


def check_contiguous_bytes(contiguous_bytes: Callable) -> None:
    """Grade ``contiguous_bytes(requests, max_model_len, bytes_per_token, block_size) -> dict`` against
    a simulation with this stage's ``KvCache`` and the engines' request check (see the notebook), and
    ``ValueError`` naming the argument and its value for each size below 1."""

    def case(requests, max_model_len: int, bytes_per_token: int, block_size: int) -> Callable[[], str | None]:
        def run() -> str | None:
            expected = simulate_contiguous(requests, max_model_len, bytes_per_token, block_size)
            got = contiguous_bytes([tuple(r) for r in requests], max_model_len, bytes_per_token, block_size)
            if not isinstance(got, dict) or set(got) != set(expected):
                return f"returned {short_rows(got)}, expected a dict with keys {sorted(expected)}"
            for key in ("refused", "reserved", "used", "paged"):
                have = list(got[key]) if key == "refused" and isinstance(got[key], list | tuple) else got[key]
                if have != expected[key]:
                    problem = f"{key} is {have!r}, expected {expected[key]!r}"
                    return named_mistake(
                        problem,
                        have,
                        contiguous_mistakes(key, requests, max_model_len, bytes_per_token, block_size),
                    )
            return None

        return run

    def refused(args, names: str) -> Callable[[], str | None]:
        def run() -> str | None:
            value = args[SIZE_ARGS.index(names) + 1]
            try:
                got = contiguous_bytes(*args)
            except ValueError as e:
                return unnamed(str(e), names, value)
            return f"no ValueError for {names} = {value}, returned {short_rows(got)}"

        return run

    run_cases(
        [
            Case("one short chat in a cache of 64", case([(10, 5)], 64, 8, 16)),
            Case(
                "three requests, one ends exactly at max_model_len",
                case([(20, 12), (30, 34), (1, 1)], 64, 8, 16),
            ),
            Case("one past max_model_len is refused", case([(40, 25), (8, 8)], 64, 100, 4)),
            Case("empty prompt and zero tokens are refused", case([(0, 5), (6, 0), (7, 3)], 32, 46_080, 16)),
            Case(
                "block_size 7, lengths across block edges", case([(7, 1), (7, 2), (13, 2), (1, 14)], 16, 3, 7)
            ),
            Case("no requests", case([], 16, 8, 4)),
            Case(
                "max_model_len 0 is refused with a ValueError naming it",
                refused(([(1, 1)], 0, 8, 4), "max_model_len"),
            ),
            Case(
                "bytes_per_token -1 is refused with a ValueError naming it",
                refused(([(1, 1)], 16, -1, 4), "bytes_per_token"),
            ),
            Case(
                "block_size 0 is refused with a ValueError naming it",
                refused(([(1, 1)], 16, 8, 0), "block_size"),
            ),
        ]
    )


def contiguous_mistakes(
    key: str, requests, max_model_len: int, bytes_per_token: int, block_size: int
) -> dict:
    """What known wrong accounts give for ``key`` on these requests, by the rule each breaks: each is
    the simulation run on a changed question (one more token per request, a limit one lower)."""

    def simulated(extra_token: int, limit: int) -> dict:
        grown = [(p, n + extra_token if n >= 1 else n) for p, n in requests]
        return simulate_contiguous(grown, limit + extra_token, bytes_per_token, block_size)

    last_token = "the last new token counted: it is never fed back, so a request fills P + N - 1 positions"
    if key == "used":
        return {last_token: lambda: simulated(1, max_model_len)["used"]}
    if key == "paged":
        return {last_token: lambda: simulated(1, max_model_len)["paged"]}
    if key == "refused":
        exact = "a request that ends exactly at max_model_len was refused: P + N <= max_model_len fits"
        return {exact: lambda: simulated(0, max_model_len - 1)["refused"]}
    return {
        "refused requests counted: a refused request gets no cache": lambda: (
            len(requests) * max_model_len * bytes_per_token
        ),
        "the used positions counted: a contiguous cache reserves max_model_len positions": lambda: simulated(
            0, max_model_len
        )["used"],
    }
