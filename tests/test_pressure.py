"""What the engines promise, end to end and under pressure (issue 29).

Each test runs an engine on a tiny seeded checkpoint where a promise matters, and checks tokens
against HF greedy (``kvcourse.harness.reference``, cached) or a run that must finish:

- pools just big enough for the longest request, several requests of mixed lengths: L3 and L4 preempt
  and recompute, L5 too with its prefix cache on, L6 admits a prompt only while the pool can hold it
  to its whole max_new_tokens next to what the running sequences may still grow into (the issue's case: 3
  prompts x 20 tokens on 8 pages of 4 and 2 slots ran dry when admission forgot the running ones);
- a prompt set in which the same block of tokens, block-aligned, follows different prefixes: a prefix
  cache whose keys forgot the blocks before a block would share K/V computed after another prefix;
- sampled clones that share blocks, compared with independent requests: greedy clones write the same
  K/V into a wrongly shared block and cannot see it;
- two ``generate()`` calls in a row under every L6 cleanup and reset mode, the reset checked by the
  state the second call starts from (not by comparing two runs that could skip the same reset).

``python -m kvcourse.tools.mutants`` breaks each of these promises on purpose and checks that a test here
(or next to the stage's own tests) fails.
"""

from __future__ import annotations

import random

import jax
import numpy as np
import pytest
from cpp_kernel import needs_cpp

from kvcourse.harness.prompts import PREFIX_PROMPTS, encode, load_tokenizer, read_prompts
from kvcourse.harness.reference import hf_greedy
from kvcourse.harness.smoke import blocks_for
from kvcourse.sampling import SamplingParams
from L3_block_tensor.engine import Engine as L3Engine
from L4_paged_kernel.engine import Engine as L4Engine
from L5_clones.engine import Engine as L5Engine
from L6_tpu_jax import decode_state as ds
from L6_tpu_jax.engine import Engine as L6Engine
from L6_tpu_jax.page_table import pages_for

_rng = random.Random(29)
PROMPTS = [[_rng.randrange(3, 49152) for _ in range(n)] for n in (2, 9, 13, 3, 22, 6, 17, 5)]
MAX_NEW = [17, 6, 11, 20, 9, 14, 3, 12]
BLOCK = 4
LONGEST = max(blocks_for(len(p) + b, BLOCK) for p, b in zip(PROMPTS, MAX_NEW, strict=True))  # 8 blocks
HOT = SamplingParams(temperature=5.0, top_k=40, top_p=0.95, seed=29)  # the tiny models are peaked


@pytest.fixture(scope="module")
def expected(tiny_qwen3_dir):
    return [r.tokens for r in hf_greedy(tiny_qwen3_dir, PROMPTS, MAX_NEW)]


def drained(engine) -> None:
    """Nothing left to run, and every block back on the free list."""
    engine.scheduler.check_invariants()
    assert not engine.has_unfinished() and engine.allocator.num_free == engine.allocator.num_blocks


def run_checked(engine, prompts, max_new_tokens, every: int = 0, limit: int = 2000) -> list[list[int]]:
    """Submit every prompt at once (``every`` 0) or one before every ``every``-th step, and step until
    all finish, checking the scheduler's invariants after each step. A scheduler that stops making
    progress (say, one that lost blocks and can admit nobody) fails after ``limit`` steps instead of
    looping forever. Returns the new tokens of each prompt."""
    pending, seqs = list(zip(prompts, max_new_tokens, strict=True)), []
    for step in range(limit):
        if pending and (not every or step % every == 0):
            take = pending[: len(pending) if not every else 1]
            seqs += [engine.add_request(p, b) for p, b in take]
            del pending[: len(take)]
        if not pending and not engine.has_unfinished():
            return [seq.output_ids for seq in seqs]
        engine.step()
        engine.scheduler.check_invariants()
    raise AssertionError(
        f"{len(pending)} prompts waiting, {engine.has_unfinished()} unfinished after {limit} steps"
    )


# ---------------------------------------------------------------- L3-L5: the smallest pool


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda d: L3Engine(d, block_size=BLOCK, num_blocks=LONGEST), id="L3"),
        pytest.param(
            lambda d: L3Engine(d, block_size=BLOCK, num_blocks=LONGEST, prefill_chunk_size=5), id="L3-chunk5"
        ),
        pytest.param(
            lambda d: L4Engine(d, block_size=BLOCK, num_blocks=LONGEST, num_splits=3), id="L4-splits3"
        ),
        pytest.param(
            lambda d: L4Engine(d, block_size=BLOCK, num_blocks=LONGEST, kernel="cpp", prefill_chunk_size=5),
            id="L4-cpp-chunk5",
            marks=needs_cpp,
        ),
        pytest.param(lambda d: L5Engine(d, block_size=BLOCK, num_blocks=LONGEST), id="L5"),
        pytest.param(
            lambda d: L5Engine(d, block_size=BLOCK, num_blocks=LONGEST, prefill_chunk_size=5), id="L5-chunk5"
        ),
    ],
)
def test_the_smallest_pool_preempts_and_changes_no_token(make, tiny_qwen3_dir, expected):
    """A pool that holds the longest request alone: eight requests of mixed lengths, all at once and
    then joining every 2 steps. The scheduler preempts and recomputes, its books balance after every
    step, and every token is HF's."""
    engine = make(tiny_qwen3_dir)
    assert run_checked(engine, PROMPTS, MAX_NEW) == expected
    assert engine.stats().preemptions >= 1 and engine.stats().blocks_held <= LONGEST
    drained(engine)
    assert run_checked(engine, PROMPTS, MAX_NEW, every=2) == expected
    drained(engine)


def test_sampled_clones_sharing_blocks_equal_independent_requests(tiny_qwen3_dir):
    """Every prompt ends inside a block, so each clone shares the full blocks and copies the partial
    one; hot sampling makes the clones write different K/V from their first token on. Cloned, on a
    roomy pool and on the smallest one (clones and preemptions together), they must equal independent
    requests that share nothing. No invariant check runs here: the tokens alone must tell."""
    prompts = [p for p in PROMPTS if len(p) % BLOCK and len(p) > BLOCK]
    max_new_tokens = [12] * len(prompts)
    alone = L5Engine(tiny_qwen3_dir, block_size=BLOCK, max_num_seqs=16, enable_prefix_caching=False)
    want = alone.generate_samples(prompts, max_new_tokens, n=3, sampling=HOT, share=False)
    assert sum(len({tuple(s) for s in samples}) == 3 for samples in want) >= 3  # they do differ
    smallest = max(blocks_for(len(p) + 12, BLOCK) + 2 for p in prompts)  # the longest, plus 2 copies
    for num_blocks in (None, smallest):
        cloned = L5Engine(tiny_qwen3_dir, block_size=BLOCK, num_blocks=num_blocks, max_num_seqs=16)
        assert cloned.generate_samples(prompts, max_new_tokens, n=3, sampling=HOT) == want
        stats = cloned.stats()
        assert stats.clones == len(prompts) and stats.blocks_shared >= 1
        drained(cloned)
    assert stats.preemptions >= 1  # the smallest pool


# ---------------------------------------------------------------- L5: equal blocks after other prefixes


def blocks_after_other_prefixes(prompts: list[list[int]], block_size: int) -> int:
    """How many (block, earlier block) pairs hold the same tokens, block-aligned, after different
    prefixes: the hits a prefix cache keyed by a block's tokens alone would wrongly make.

    Example, block_size 2: [1, 2, 3, 4, 9] and [3, 4, 9] -> 1 (block [3, 4] at 2 and at 0).
    """
    seen: dict[tuple[int, ...], set[tuple[int, ...]]] = {}  # block -> the prefixes it followed
    pairs = 0
    for p in prompts:
        for i in range((len(p) - 1) // block_size):
            block = tuple(p[i * block_size : (i + 1) * block_size])
            prefix = tuple(p[: i * block_size])
            pairs += len(seen.get(block, set()) - {prefix})
            seen.setdefault(block, set()).add(prefix)
    return pairs


def test_blocks_after_other_prefixes_example():
    assert blocks_after_other_prefixes([[1, 2, 3, 4, 9], [3, 4, 9]], 2) == 1
    assert blocks_after_other_prefixes([[1, 2, 3, 4, 9], [1, 2, 3, 4, 8]], 2) == 0  # the same prefix


def test_the_prefix_prompt_file_repeats_blocks_after_other_prefixes(model_dir):
    """``kvcourse/harness/prompts_prefix.jsonl``, as the L5 smoke runs it: with the course tokenizer its
    prompts repeat 16-token blocks after other prefixes, and also share leading blocks."""
    tok = load_tokenizer(model_dir)
    ids = [encode(tok, p) for p in read_prompts(PREFIX_PROMPTS)]
    assert blocks_after_other_prefixes(ids, 16) == 6  # as in the tiny test below, blocks of 16
    assert any(a[:16] == b[:16] for i, a in enumerate(ids) for b in ids[:i])  # a real hit, too


def test_equal_blocks_after_other_prefixes_do_not_hit(tiny_qwen3_dir):
    """Blocks P, Q, R of 4 tokens in the orders P Q R, Q R, P R, Q P, each then the same 3 tokens. The
    chained keys hit only a block whose whole prefix matches: P in P R, Q in Q P, once each. A key of
    a block's tokens alone would also hit Q and R after other prefixes, and their K/V (computed at
    other positions, after other tokens) would change the answers."""
    p, q, r = ([_rng.randrange(3, 49152) for _ in range(BLOCK)] for _ in range(3))
    tail = [_rng.randrange(3, 49152) for _ in range(3)]
    prompts = [p + q + r + tail, q + r + tail, p + r + tail, q + p + tail]
    assert blocks_after_other_prefixes(prompts, BLOCK) == 6
    want = [x.tokens for x in hf_greedy(tiny_qwen3_dir, prompts, [10] * 4)]
    one_by_one = L5Engine(tiny_qwen3_dir, block_size=BLOCK)
    assert [one_by_one.generate([x], 10)[0] for x in prompts] == want
    together = L5Engine(tiny_qwen3_dir, block_size=BLOCK)
    assert together.generate(prompts, 10) == want  # same-step admissions share what the step registers
    for engine in (one_by_one, together):
        assert engine.stats().prefix_cache_hits == 2
        drained(engine)


# ---------------------------------------------------------------- L6: admission under pressure


def test_l6_admission_keeps_room_for_what_running_sequences_will_grow_into(tiny_qwen3_dir):
    """The issue's case: 3 prompts x 20 new tokens on 8 pages of 4 and 2 slots. A prompt's 23 tokens
    need 6 of the 8 pages, so only one runs at a time; admitting a second while the first still has
    pages to take runs the pool dry mid-decode (``OutOfPagesError``). It must finish, equal to HF."""
    prompts = [[5, 17, 300], [9, 9, 9, 9, 9], [42] * 7]
    want = [x.tokens for x in hf_greedy(tiny_qwen3_dir, prompts, [20] * 3)]
    engine = L6Engine(tiny_qwen3_dir, page_size=4, num_pages=8, max_num_seqs=2, max_model_len=64)
    assert engine.generate(prompts, 20) == want
    engine.check_invariants()
    assert engine.occupancy()["pages_in_use"] == 0


@pytest.mark.parametrize("cleanup", ["incremental", "end"])
def test_l6_on_the_smallest_pool_changes_no_token(cleanup, tiny_qwen3_dir, expected):
    """Mixed lengths on a pool that holds the longest request alone, 4 slots: prompts wait for
    pages as well as for slots, clones included; every token is HF's."""
    pages = max(pages_for(len(p), b, 1, BLOCK) for p, b in zip(PROMPTS, MAX_NEW, strict=True))
    engine = L6Engine(
        tiny_qwen3_dir, page_size=BLOCK, num_pages=pages, max_num_seqs=4, max_model_len=64, cleanup=cleanup
    )
    assert engine.generate(PROMPTS, MAX_NEW) == expected
    assert engine.stats().blocks_held <= pages
    engine.check_invariants()
    assert engine.occupancy()["pages_in_use"] == 0
    fit = [i for i, p in enumerate(PROMPTS) if pages_for(len(p), 6, 2, BLOCK) <= pages]  # 2 clones, 6 tokens
    assert len(fit) >= 6
    clones = engine.generate_samples([PROMPTS[i] for i in fit], [min(6, MAX_NEW[i]) for i in fit], n=2)
    assert clones == [[expected[i][:6]] * 2 for i in fit]  # greedy: the first tokens of HF's answer


# ---------------------------------------------------------------- L6: reset, checked by the state it leaves


@pytest.mark.parametrize("reset", ["logical", "physical"])
@pytest.mark.parametrize("cleanup", ["incremental", "end", "none"])
def test_l6_two_calls_in_a_row_start_from_a_reset_state(cleanup, reset, tiny_llama_dir):
    """Two ``generate()`` calls on one engine. The state each call's first prefill starts from must be
    the baseline (no used slots, zero refcounts, empty queue, no finished flags, zero counters), and
    under physical reset the KV pages must be zero; logical reset keeps the stale pages. Both calls
    equal HF, and the pages are back after each (except with cleanup "none", which keeps them)."""
    first, second = [[7, 8, 9, 10, 11], [12] * 9], [[300, 301, 302], [40, 41] * 3]
    want = [[x.tokens for x in hf_greedy(tiny_llama_dir, ps, [6] * len(ps))] for ps in (first, second)]
    engine = L6Engine(
        tiny_llama_dir, page_size=4, max_num_seqs=2, max_model_len=32, cleanup=cleanup, reset=reset
    )
    entering = []  # (state, kv pages) each prefill call starts from, copied before the call donates them
    prefill = engine._prefill

    def spy(params, state, kv_pages, work):
        entering.append((jax.device_get(state), [np.array(pool) for pool in kv_pages]))
        return prefill(params, state, kv_pages, work)

    engine._prefill = spy
    for prompts, tokens in zip((first, second), want, strict=True):
        start = len(entering)
        assert engine.generate(prompts, 6) == tokens
        state, kv_pages = entering[start]
        ds.check_invariants(state, after_reset=True)
        if reset == "physical":
            assert not any(pool.any() for pool in kv_pages), "physical reset left K/V in the pages"
        elif start:
            assert any(pool.any() for pool in kv_pages), "logical reset zeroed the pages"
        engine.check_invariants()
        held = engine.occupancy()["pages_in_use"]
        assert held > 0 if cleanup == "none" else held == 0
