"""The exercise checkers of L1, L2 and L6 fail wrong answers and pass the stages' own code.

Every exercise of these notebooks gets at least one plausible wrong solution (an off-by-one write
position, a loop that ignores eos, bytes without the factor 2 for K and V, a free list taken from the
wrong end, a double free accepted, a block missing in allocate_slots, a Python branch on a traced value, ...).
Each runs in process on its checker, with the printed lines captured: the summary must not read
``n/n passed``, and the case that should catch the mistake must say ``WRONG`` or ``raised``. Example::

    case 2 (decode: 1 token at start 5 after a 5-token prefill): WRONG — K differs at positions [5, 6] ...
    ...
    0/5 passed

The other half: each checker gets a right answer and every case must print ``ok``: the independent
answer of the stage's ``answers.py`` (``key/L1_contiguous/``, ``key/L2_token_flat/``,
``key/L6_tpu_jax/``). The checker's reference is the stage's own code (``KvCache.write``, ``Engine.generate``,
``ModelConfig.kv_bytes_per_token``, ``BlockAllocator.free``, ``allocate_slots``, ``allocate_for_seq``,
``update_kv``, ...), so the two hold each other in check, and the stage's code is held to fixed values
here and in ``test_l1.py``, ``test_l2.py``, ``test_l6_state.py`` and ``test_l6_attention.py``. Every
wrong answer also fails the hidden cases the grader draws (``kvcourse/grading/hidden.py``). L6.4's visible check
needs the notebook's 4 devices and runs only when a notebook is graded; its hidden cases need none and
run here.

L1's decode-loop checker needs an engine whose model ends case 1 with eos: the course model, built once
for this module with a short ``max_model_len``. Everything else runs on small arrays in well under a
second per checker.

Left out on purpose: the notebooks themselves (``tests/test_grading.py`` grades them) and L3 to L5.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checker_asserts import assert_fails, assert_fails_hidden, assert_passes, graded_lines, hidden_problems
from jax.sharding import PartitionSpec as P

from exercises.L1_contiguous import checks as l1
from exercises.L2_token_flat import checks as l2
from exercises.L6_tpu_jax import checks as l6
from key.L1_contiguous import answers as l1_answers
from key.L2_token_flat import answers as l2_answers
from key.L6_tpu_jax import answers as l6_answers
from kvcourse.config import ModelConfig
from kvcourse.grading import hidden
from kvcourse.harness.prompts import encode
from L1_contiguous.engine import Engine as L1Engine
from L2_token_flat.allocator import OutOfBlocksError
from L6_tpu_jax.kv_cache import update_kv
from L6_tpu_jax.mesh.multihost import DATA

# ---- L1: write_kv, the decode loop, KV bytes per token ----


def write_kv_one_too_far(k_cache, v_cache, start, k, v):
    """Every write lands one position after ``start``."""
    end = start + k.shape[0]
    if end > k_cache.shape[0]:
        raise ValueError("overflow")
    k_cache[start + 1 : end + 1] = k
    v_cache[start + 1 : end + 1] = v


def write_kv_no_overflow_check(k_cache, v_cache, start, k, v):
    """Right positions, but writing past max_model_len is not refused: torch clips the slice."""
    n = min(k.shape[0], k_cache.shape[0] - start)
    k_cache[start : start + n] = k[:n]
    v_cache[start : start + n] = v[:n]


def write_kv_vague_error(k_cache, v_cache, start, k, v):
    """Right positions, and it refuses an overflow, but its message names neither the positions nor
    the limit (the notebook asks for both)."""
    end = start + k.shape[0]
    if end > k_cache.shape[0]:
        raise ValueError("bad")
    k_cache[start:end] = k
    v_cache[start:end] = v


def test_l1_write_kv_says_what_a_vague_error_lacks(capsys):
    l1.check_write_kv(write_kv_vague_error)
    lines = graded_lines(capsys)
    assert "the ValueError says 'bad': name the positions 15..17 and max_model_len=16" in lines[4], lines


def write_kv_k_only(k_cache, v_cache, start, k, v):
    """K is stored twice, V never."""
    end = start + k.shape[0]
    if end > k_cache.shape[0]:
        raise ValueError("overflow")
    k_cache[start:end] = k
    v_cache[start:end] = k


@pytest.mark.parametrize(
    ("wrong", "case_name"),
    [
        (write_kv_one_too_far, "decode: 1 token at start 5"),
        (write_kv_no_overflow_check, "overflow: 3 tokens at start 15"),
        (write_kv_k_only, "prefill: 5 tokens at start 0"),
        (write_kv_vague_error, "overflow: 3 tokens at start 15"),
    ],
)
def test_l1_write_kv_fails_wrong_answers(capsys, wrong, case_name):
    l1.check_write_kv(wrong)
    assert_fails(graded_lines(capsys), case_name)
    assert_fails_hidden("L1_contiguous", "L1.1", wrong)


def write_kv_then_refuse(k_cache, v_cache, start, k, v):
    """Writes what fits, then raises: the ValueError the notebook's overflow case asks for, but the
    cache is already changed (its case checks the error only; the hidden cases check the cache)."""
    n = min(k.shape[0], k_cache.shape[0] - start)
    k_cache[start : start + n] = k[:n]
    v_cache[start : start + n] = v[:n]
    if n < k.shape[0]:
        raise ValueError(f"positions {start}..{start + k.shape[0] - 1} overflow max_model_len={len(k_cache)}")


def test_l1_write_kv_hidden_cases_catch_what_the_shown_ones_cannot(capsys):
    l1.check_write_kv(write_kv_then_refuse)
    assert_passes(graded_lines(capsys))
    assert_fails_hidden("L1_contiguous", "L1.1", write_kv_then_refuse)


def test_l1_write_kv_passes_the_independent_answer(capsys):
    """The checker's reference is ``KvCache.write``; the answer of ``answers.py`` is written apart from
    it, so each holds the other in check (``test_l1.py`` checks ``KvCache.write`` on fixed values)."""
    l1.check_write_kv(l1_answers.write_kv)
    assert_passes(graded_lines(capsys))


@pytest.fixture(scope="module")
def l1_engine(model_dir):
    """The course model (case 1 of the decode-loop check ends with its eos), a short cache."""
    return L1Engine(model_dir, max_model_len=256)


def decode_ignoring_eos(engine, prompt, max_new_tokens):
    """Greedy, but runs to max_new_tokens even after eos."""
    out = [int(engine.prefill(prompt).argmax())]
    pos = len(prompt)
    while len(out) < max_new_tokens:
        out.append(int(engine.decode_step(out[-1], pos).argmax()))
        pos += 1
    return out


def decode_one_step_too_many(engine, prompt, max_new_tokens):
    """Stops at eos, but the max_new_tokens test is off by one: it never stops at max_new_tokens in time."""
    eos = engine.model.cfg.eos_token_ids
    out = [int(engine.prefill(prompt).argmax())]
    pos = len(prompt)
    while len(out) <= max_new_tokens and out[-1] not in eos:
        out.append(int(engine.decode_step(out[-1], pos).argmax()))
        pos += 1
    return out


def decode_one_position_late(engine, prompt, max_new_tokens):
    """The classic slip: the first decode step runs at len(prompt) + 1, one past where it belongs."""
    eos = engine.model.cfg.eos_token_ids
    out = [int(engine.prefill(prompt).argmax())]
    pos = len(prompt) + 1
    while len(out) < max_new_tokens and out[-1] not in eos:
        out.append(int(engine.decode_step(out[-1], pos).argmax()))
        pos += 1
    return out


def test_l1_decode_loop_hints_at_the_position(capsys, l1_engine):
    l1.check_decode_loop(decode_one_position_late, l1_engine)
    lines = graded_lines(capsys)
    assert any("first difference at new token" in x and "at position len(prompt)" in x for x in lines), lines


@pytest.mark.parametrize(
    ("wrong", "case_name"),
    [
        (decode_ignoring_eos, "chat prompt, max_new_tokens 12: stops after eos"),
        (decode_one_position_late, "raw text prompt, max_new_tokens 4: stops at max_new_tokens"),
        (decode_one_step_too_many, "raw text prompt, max_new_tokens 4: stops at max_new_tokens"),
    ],
)
def test_l1_decode_loop_fails_wrong_answers(capsys, l1_engine, wrong, case_name):
    l1.check_decode_loop(wrong, l1_engine)
    assert_fails(graded_lines(capsys), case_name)
    assert_fails_hidden("L1_contiguous", "L1.2", wrong, l1_engine, seeds=(0,))  # each seed has both edges


def test_l1_decode_loop_passes_the_independent_answer(capsys, l1_engine):
    """The checker's reference is ``Engine.generate``, the answer of ``answers.py`` a loop of its own
    (``test_l1.py`` checks ``Engine.generate`` against HF on the course model)."""
    l1.check_decode_loop(l1_answers.decode_loop, l1_engine)
    assert_passes(graded_lines(capsys))


def test_l1_decode_pool_ends_where_the_draw_aims(model_dir):
    """The hidden cases aim their max_new_tokens at the eos of the pool's chat prompts (``checks.POOL``): HF
    ends each of those answers with eos after the number of tokens the pool says, and no other
    prompt within ``POOL_MAX_NEW`` tokens."""
    tok = l1._tokenizer(model_dir)
    for entry in l1.POOL:
        ids = encode(tok, l1.prompt_of({"prompt": entry}))
        tokens = l1_answers.hf_tokens(tuple(ids))
        ends = len(tokens) if tokens[-1] in ModelConfig.from_dir(model_dir).eos_token_ids else None
        assert ends == entry["ends"], (entry, tokens)


@pytest.fixture(scope="module")
def course_cfg(model_dir):
    return ModelConfig.from_dir(model_dir)


def bytes_without_v(cfg, dtype_bytes=4):
    """K only: the factor 2 for K and V is missing."""
    return cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype_bytes


def bytes_with_query_heads(cfg, dtype_bytes=4):
    """Counts query heads instead of KV heads (wrong under GQA)."""
    return 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * dtype_bytes


@pytest.mark.parametrize(
    ("wrong", "case_name"),
    [(bytes_without_v, "the course model, fp32"), (bytes_with_query_heads, "Llama-3-8B shape")],
)
def test_l1_kv_bytes_fails_wrong_answers(capsys, course_cfg, wrong, case_name):
    l1.check_kv_bytes_per_token(wrong, course_cfg)
    assert_fails(graded_lines(capsys), case_name)
    assert_fails_hidden("L1_contiguous", "L1.3", wrong, course_cfg)


def test_l1_kv_bytes_passes_the_independent_answer(capsys, course_cfg):
    """The checker's reference is ``ModelConfig.kv_bytes_per_token``, checked on fixed values below."""
    l1.check_kv_bytes_per_token(l1_answers.kv_bytes_per_token, course_cfg)
    assert_passes(graded_lines(capsys))


# ---- L2: alloc_blocks, free, allocate_slots ----


def alloc_from_the_back(self, n):
    """Hands out the free list's last blocks: the wrong end."""
    if n > len(self.free_blocks):
        raise OutOfBlocksError(needed=n, free=len(self.free_blocks))
    blocks = [self.free_blocks.pop() for _ in range(n)]
    self.owned.update(blocks)
    return blocks


def alloc_then_check(self, n):
    """Takes blocks first and finds out it is short afterwards: a failed call has taken some."""
    blocks = []
    for _ in range(n):
        if not self.free_blocks:
            raise OutOfBlocksError(needed=n, free=0)
        blocks.append(self.free_blocks.popleft())
    self.owned.update(blocks)
    return blocks


@pytest.mark.parametrize(
    ("wrong", "case_name"),
    [(alloc_from_the_back, "alloc 3 of 4 blocks"), (alloc_then_check, "OutOfBlocksError takes nothing")],
)
def test_l2_alloc_blocks_fails_wrong_answers(capsys, wrong, case_name):
    l2.check_alloc_blocks(wrong)
    assert_fails(graded_lines(capsys), case_name)
    assert_fails_hidden("L2_token_flat", "L2.1", wrong)


def test_l2_alloc_blocks_passes_the_independent_answer(capsys):
    l2.check_alloc_blocks(l2_answers.alloc_blocks)
    assert_passes(graded_lines(capsys))


def free_to_the_front(self, blocks):
    """Checks ids, but puts freed blocks at the front: they are handed out again first."""
    for b in blocks:
        if b not in range(self.num_blocks) or b not in self.owned:
            raise ValueError(f"bad block {b}")
    self.owned.difference_update(blocks)
    self.free_blocks.extendleft(blocks)


def free_trusting(self, blocks):
    """No checks at all: a double free puts a block on the list twice."""
    self.owned.difference_update(blocks)
    self.free_blocks.extend(blocks)


@pytest.mark.parametrize(
    ("wrong", "case_name"),
    [(free_to_the_front, "a freed block goes to the back"), (free_trusting, "double free is refused")],
)
def test_l2_free_fails_wrong_answers(capsys, wrong, case_name):
    l2.check_free(wrong)
    assert_fails(graded_lines(capsys), case_name)
    assert_fails_hidden("L2_token_flat", "L2.2", wrong)


def test_l2_free_passes_the_independent_answer(capsys):
    l2.check_free(l2_answers.free)
    assert_passes(graded_lines(capsys))


def reserve_floor(seq, allocator, target_len):
    """Rounds the block count down: the last, partly filled block is missing."""
    missing = target_len // allocator.block_size - len(seq.block_table)
    if missing > 0:
        new = allocator.alloc_blocks(missing)
        seq.block_table.extend(new)
        for b in new:
            seq.slot_indices.extend(range(b * allocator.block_size, (b + 1) * allocator.block_size))


def reserve_block_ids_as_slots(seq, allocator, target_len):
    """Right blocks, but the slots of block b are taken as b .. b + block_size - 1."""
    missing = -(-target_len // allocator.block_size) - len(seq.block_table)
    if missing > 0:
        new = allocator.alloc_blocks(missing)
        seq.block_table.extend(new)
        for b in new:
            seq.slot_indices.extend(range(b, b + allocator.block_size))


@pytest.mark.parametrize(
    ("wrong", "case_name"),
    [(reserve_floor, "block_size 4: 4 then 6 positions"), (reserve_block_ids_as_slots, "block_size 7")],
)
def test_l2_reserve_fails_wrong_answers(capsys, wrong, case_name):
    l2.check_allocate_slots(wrong)
    assert_fails(graded_lines(capsys), case_name)
    assert_fails_hidden("L2_token_flat", "L2.3", wrong)


def test_l2_reserve_passes_the_independent_answer(capsys):
    l2.check_allocate_slots(l2_answers.allocate_slots)
    assert_passes(graded_lines(capsys))


# ---- L6: allocate, free finished, the jit'd KV write ----


def allocate_highest_free_first(page_ref_counts, page_indices, seq_lens, slot_ids, positions, page_size):
    """Takes the highest free page id instead of the lowest."""
    refs, table, lens = page_ref_counts.copy(), page_indices.copy(), seq_lens.copy()
    for s, p in zip(slot_ids, positions, strict=True):
        lens[s] = max(lens[s], p + 1)
    for s in range(len(lens)):
        for j in range(-(-lens[s] // page_size)):
            if table[s, j] < 0:
                page = np.flatnonzero(refs == 0)[-1]
                refs[page] += 1
                table[s, j] = page
    dests = [
        table[s, p // page_size] * page_size + p % page_size for s, p in zip(slot_ids, positions, strict=True)
    ]
    return refs, table, lens, np.array(dests)


def allocate_length_off_by_one(page_ref_counts, page_indices, seq_lens, slot_ids, positions, page_size):
    """A slot grows to its largest position, not position + 1: a token on a new page gets no page."""
    refs, table, lens = page_ref_counts.copy(), page_indices.copy(), seq_lens.copy()
    for s, p in zip(slot_ids, positions, strict=True):
        lens[s] = max(lens[s], p)
    for s in range(len(lens)):
        for j in range(-(-lens[s] // page_size)):
            if table[s, j] < 0:
                page = np.flatnonzero(refs == 0)[0]
                refs[page] += 1
                table[s, j] = page
    dests = [
        table[s, p // page_size] * page_size + p % page_size for s, p in zip(slot_ids, positions, strict=True)
    ]
    return refs, table, lens, np.array(dests)


@pytest.mark.parametrize(
    ("wrong", "case_name"),
    [
        (allocate_highest_free_first, "prefill of 9 tokens: 3 pages from a scattered free list"),
        (allocate_length_off_by_one, "page_size 4, first page: empty slot 0 prefills 3 tokens"),
    ],
)
def test_l6_allocate_fails_wrong_answers(capsys, wrong, case_name):
    l6.check_allocate(wrong)
    assert_fails(graded_lines(capsys), case_name)
    assert hidden_problems("L6_tpu_jax", "L6.1", wrong)


def test_l6_allocate_passes_the_independent_answer(capsys):
    l6.check_allocate(l6_answers.allocate)
    assert_passes(graded_lines(capsys))


def free_zeroing_shared_pages(page_ref_counts, page_indices, seq_lens, used_mask, finished_mask):
    """Sets each page of a finished slot to refcount 0, though a live clone still reads it."""
    refs, table, lens = page_ref_counts.copy(), page_indices.copy(), seq_lens.copy()
    for s in np.flatnonzero(finished_mask):
        refs[table[s][table[s] >= 0]] = 0
    table[finished_mask] = -1
    lens[finished_mask] = 0
    return refs, table, lens, used_mask & ~finished_mask


def free_keeping_used(page_ref_counts, page_indices, seq_lens, used_mask, finished_mask):
    """Gives the pages back but leaves the finished slots marked used."""
    refs, table, lens = page_ref_counts.copy(), page_indices.copy(), seq_lens.copy()
    for s in np.flatnonzero(finished_mask):
        for page in table[s][table[s] >= 0]:
            refs[page] -= 1
    table[finished_mask] = -1
    lens[finished_mask] = 0
    return refs, table, lens, used_mask


@pytest.mark.parametrize(
    ("wrong", "case_name"),
    [
        (free_zeroing_shared_pages, "its clone slot 1 [3, 6] lives"),
        (free_keeping_used, "one sequence on pages [1, 3] finishes"),
    ],
)
def test_l6_free_finished_fails_wrong_answers(capsys, wrong, case_name):
    l6.check_free_finished(wrong)
    assert_fails(graded_lines(capsys), case_name)
    assert hidden_problems("L6_tpu_jax", "L6.2", wrong)


def test_l6_free_finished_passes_the_independent_answer(capsys):
    l6.check_free_finished(l6_answers.free_finished)
    assert_passes(graded_lines(capsys))


def interleaved(k, v):
    """(T, H_kv, D) K and V -> (T, 2 * H_kv, D) rows k0, v0, k1, v1, ..."""
    return jnp.stack([k, v], axis=2).reshape(k.shape[0], 2 * k.shape[1], k.shape[2])


def write_branching_on_dests(kv_pages, dests, k, v):
    """Skips padding with a Python ``if`` on a traced value: TracerBoolConversionError under jit."""
    n_pages, ps = kv_pages.shape[:2]
    flat, rows = kv_pages.reshape(n_pages * ps, *kv_pages.shape[2:]), interleaved(k, v)
    for t in range(dests.shape[0]):
        if dests[t] >= 0:
            flat = flat.at[dests[t]].set(rows[t])
    return flat.reshape(kv_pages.shape)


def write_padding_too(kv_pages, dests, k, v):
    """Scatters every token, padding included: ``.at[-1]`` is the pool's last row, not out of range."""
    n_pages, ps = kv_pages.shape[:2]
    flat = kv_pages.reshape(n_pages * ps, *kv_pages.shape[2:])
    return flat.at[dests].set(interleaved(k, v), mode="drop").reshape(kv_pages.shape)


def write_k_then_v(kv_pages, dests, k, v):
    """Rows k0, k1, ..., v0, v1, ... instead of Levanter's interleaved k0, v0, k1, v1, ..."""
    n_pages, ps = kv_pages.shape[:2]
    flat = kv_pages.reshape(n_pages * ps, *kv_pages.shape[2:])
    where = jnp.where(dests >= 0, dests, n_pages * ps)
    return flat.at[where].set(jnp.concatenate([k, v], axis=1), mode="drop").reshape(kv_pages.shape)


def write_only_real_tokens(kv_pages, dests, k, v):
    """Drops padding by boolean indexing: a shape that depends on values, refused by jit."""
    n_pages, ps = kv_pages.shape[:2]
    flat, keep = kv_pages.reshape(n_pages * ps, *kv_pages.shape[2:]), dests >= 0
    return flat.at[dests[keep]].set(interleaved(k, v)[keep]).reshape(kv_pages.shape)


@pytest.mark.parametrize(
    ("wrong", "case_name", "says"),
    [
        (write_branching_on_dests, "3 decode tokens to 3 different pages", "TracerBoolConversionError"),
        (write_padding_too, "all 4 tokens are padding", "dest -1 is padding"),
        (write_k_then_v, "5 prefill tokens cross from page 2 to page 5", "wrong order"),
        (write_only_real_tokens, "one trace: 3 batches of one shape", "NonConcreteBooleanIndexError"),
    ],
)
def test_l6_write_kv_pages_fails_wrong_answers(capsys, wrong, case_name, says):
    l6.check_write_kv_pages(wrong)
    lines = graded_lines(capsys)
    assert_fails(lines, case_name)
    assert any(case_name in line and says in line for line in lines), lines
    assert hidden_problems("L6_tpu_jax", "L6.3", wrong)


def test_l6_write_kv_pages_counts_traces(capsys):
    """A function that makes jit trace again for inputs of one shape fails the one-trace case."""

    def write_and_forget_the_compile(kv_pages, dests, k, v):
        jax.clear_caches()  # the next call of the same shape traces again
        return l6_answers.write_kv_pages(kv_pages, dests, k, v)

    l6.check_write_kv_pages(write_and_forget_the_compile)
    lines = graded_lines(capsys)
    assert_fails(lines, "one trace: 3 batches of one shape")
    assert "WRONG — traced 3 times for one shape" in lines[-2], lines
    assert lines[-1] == "5/6 passed", lines
    problems = hidden_problems("L6_tpu_jax", "L6.3", write_and_forget_the_compile)
    assert problems and all("traces is 2, expected 1" in p for p in problems), problems


def test_l6_a_jitted_update_kv_trips_though_jit_traced_every_shape_before(tmp_path):
    """``jit`` runs a function it traced before from its cache, without its code; the hidden cases
    clear that cache first, so an answer that jits the stage's ``update_kv`` is caught all the same."""
    jitted = jax.jit(update_kv)
    for case in l6.HIDDEN["L6.3"].draw(hidden.rng_for(0, "L6.3")):
        l6.HIDDEN["L6.3"].observe(jitted, case)  # every shape of seed 0 traced, nothing tripped
    out = tmp_path / "L6.3.json"
    hidden.harvest("L6_tpu_jax", "L6.3", jitted, seed=0, out=str(out))
    assert json.loads(out.read_text())["aliased"] == ["L6_tpu_jax.kv_cache:update_kv"]


def test_l6_write_kv_pages_passes_the_independent_answer(capsys):
    l6.check_write_kv_pages(l6_answers.write_kv_pages)
    assert_passes(graded_lines(capsys))


WHOLE, PAGES = P(), P(DATA)


def mesh_specs(kv_pages=PAGES, decode_state=WHOLE, params=WHOLE):
    """An L6.4 answer: a dict of the three specs (the right ones by default)."""
    return lambda: {"params": params, "decode_state": decode_state, "kv_pages": kv_pages}


@pytest.mark.parametrize(
    ("wrong", "says"),
    [
        (mesh_specs(kv_pages=P()), "after kv_pages over 4 devices: held is [24, "),  # the whole pool on each
        (mesh_specs(kv_pages=P(None, DATA)), "after kv_pages over 4 devices"),  # cut along page rows
        (mesh_specs(decode_state=P(DATA)), "after decode_state over 4 devices: raised is"),  # scalars
        (mesh_specs(params=P(DATA)), "after params over 4 devices"),  # each device a piece of the model
        (lambda: (P(), P(), P(DATA)), "raised TypeError: returned tuple"),
    ],
)
def test_l6_mesh_specs_hidden_cases_fail_wrong_answers(wrong, says):
    """L6.4's visible check needs 4 devices (the notebook's); its hidden cases lay the specs on
    abstract meshes, so they run here on one. A learner's right answer spelled otherwise passes."""
    problems = hidden_problems("L6_tpu_jax", "L6.4", wrong, seed=3)
    assert any(says in p for p in problems), problems
    assert hidden_problems("L6_tpu_jax", "L6.4", mesh_specs(kv_pages=P(DATA, None, None)), seed=3) == []


def test_l6_mesh_specs_copied_from_the_engine_is_not_credited(tmp_path):
    """An answer that hands back the mesh engine's own ``SPECS`` (or a copy) trips at run time."""
    from L6_tpu_jax.mesh import engine as mesh_engine

    out = tmp_path / "L6.4.json"
    hidden.harvest("L6_tpu_jax", "L6.4", lambda: dict(mesh_engine.SPECS), seed=0, out=str(out))
    record = json.loads(out.read_text())
    assert record["aliased"] == ["L6_tpu_jax.mesh.engine:SPECS"]
    assert hidden.judge("L6_tpu_jax", "L6.4", 0, record)
    assert mesh_engine.SPECS == {"params": P(), "decode_state": P(), "kv_pages": P(DATA)}  # put back


def test_l6_format_rows_docstring():
    assert l6.format_rows([5, 23], 4) == "[(1, 1), (5, 3)]"
    assert l6.format_rows(range(9, 15), 4) == "[(2, 1), (2, 2), ..., (3, 2)] (6 rows)"


def test_course_config_matches_the_kv_bytes_docstring(course_cfg):
    """The L1 fixture is the course model: its own answer is the checker docstring's 46,080 bytes; the
    checker's other shapes by hand: 2 x 32 layers x 8 KV heads x 128 x 2 bytes, 2 x 2 x 2 x 16 x 4."""
    assert course_cfg.kv_bytes_per_token(4) == 46_080
    assert course_cfg.kv_bytes_per_token(2) == 23_040
    llama8b = dataclasses.replace(course_cfg, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128)
    assert llama8b.kv_bytes_per_token(2) == 131_072
    tiny = dataclasses.replace(course_cfg, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    assert tiny.kv_bytes_per_token(4) == 512
