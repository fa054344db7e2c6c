"""L5 beam search: the group's choice on hand-made log-probs, the engine against Hugging Face's
``generate(num_beams=k)`` on tiny checkpoints and the course model (widths 1-6, eos, length penalty,
early stopping, tight pools that preempt whole groups, chunked prefill), the blocks the beams hold
against the blocks their common histories need, random fork/drop patterns on the allocator, the tie
rule of ``compare_beams``, and bad input."""

from __future__ import annotations

import json
import math
import random
import shutil
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcourse.harness.compare import TIE_GAP, beam_history, compare_beams
from kvcourse.harness.reference import BeamReference, hf_beams, hf_greedy
from kvcourse.sampling import BeamParams, SamplingParams
from L5_clones.allocator import BlockAllocator, OutOfBlocksError
from L5_clones.beams import BeamGroup, add_beam_request, beam_blocks, fork, fork_needs, recompute_shares
from L5_clones.engine import Engine
from L5_clones.l5_smoke import BEAM_WIDTHS
from L5_clones.sequence import Sequence, allocate_slots

_rng = random.Random(0)
PROMPTS = [[_rng.randrange(3, 49152) for _ in range(n)] for n in (1, 5, 12, 16, 17, 29, 40, 3)]
MAX_NEW = [12, 3, 10, 9, 12, 7, 11, 5]


def ideal_blocks(beams, block_size: int) -> int:
    """Blocks beams need when every full block of a common history is held once: one per distinct
    full-block prefix of their computed tokens, plus one partial block per beam. Independent of the
    block tables: it reads only the tokens."""
    full, partial = set(), 0
    for b in beams:
        computed = b.num_computed_tokens
        full |= {tuple(b.all_ids[: m * block_size]) for m in range(1, computed // block_size + 1)}
        partial += computed % block_size > 0
    return len(full) + partial


def run_checked(engine: Engine, prompts, max_new_tokens, ideal: bool = True, **beam) -> list[list[list[int]]]:
    """``generate_beams`` one step at a time: after every step the scheduler's invariants hold and,
    with ``ideal``, the pool holds exactly the blocks the beams' histories need (shared, not copied,
    and nothing a dropped beam held); at the end every block is free."""
    params = BeamParams(**beam)
    if params.num_beams == 1:  # greedy search, as in HF: a plain request
        requests = [engine.add_request(p, b) for p, b in zip(prompts, max_new_tokens, strict=True)]
    else:
        requests = [
            add_beam_request(engine, p, b, params) for p, b in zip(prompts, max_new_tokens, strict=True)
        ]
    while engine.has_unfinished():
        engine.step()
        engine.scheduler.check_invariants()
        if ideal:
            running = engine.scheduler.running
            assert engine.allocator.num_used == ideal_blocks(running, engine.allocator.block_size)
    engine.scheduler.check_invariants()
    assert engine.allocator.num_free == engine.allocator.num_blocks  # nothing leaked
    return [r.sequences() if isinstance(r, BeamGroup) else [r.output_ids] for r in requests]


# ---------------------------------------------------------------- the group's choice


def test_choose_ranks_2k_finishes_the_first_k_and_keeps_k_survivors():
    """k = 2, eos 7, beams [1] (score -1.0) and [2] (score -1.5): the 4 ranked continuations are
    a+7 -1.693, b+5 -2.011, a+3 -2.204, a+4 -2.897 (by hand); a+7 ends at rank 0 and is kept with
    -1.693 / 2; the survivors are b+5 and a+3, in that order."""
    a = torch.tensor([0.01] * 8)
    a[7], a[3], a[4] = 0.5, 0.3, 0.15
    b = torch.full((8,), 0.4 / 7)
    b[5] = 0.6
    group = BeamGroup(BeamParams(2), max_new_tokens=10, eos_ids=(7,), scores=torch.tensor([-1.0, -1.5]))
    survivors = group.choose(torch.stack([a, b]).log(), [[1], [2]])
    assert survivors == [(1, 5), (0, 3)]
    [(score, tokens)] = group.finished
    assert tokens == [1, 7] and score == pytest.approx((-1.0 + math.log(0.5)) / 2, abs=1e-6)
    assert group.scores.tolist() == pytest.approx([-1.5 + math.log(0.6), -1.0 + math.log(0.3)], abs=1e-6)
    assert not group.done  # one hypothesis of 2


def test_choose_stops_when_no_beam_can_beat_the_worst_kept_hypothesis():
    """k = 1 after a finished hypothesis fills the group: the best survivor scores lower at the same
    length, so the search is done (HF's early-stop heuristic with early_stopping=False)."""
    row = torch.tensor([0.6, 0.3, 0.1]).log()
    group = BeamGroup(BeamParams(1), max_new_tokens=10, eos_ids=(0,), scores=torch.zeros(1))
    assert group.choose(row[None], [[]]) == [(0, 1)]
    assert group.done and group.sequences() == [[0]]


# ---------------------------------------------------------------- the engine against HF


@pytest.fixture(scope="module")
def eos_dir(tiny_qwen3_dir, tmp_path_factory):
    """The tiny Qwen3 with eight eos tokens, each one HF greedy writes a few tokens into a test prompt:
    beams there finish hypotheses early, and HF ranks (1 + 8) * k candidates per step."""
    greedy = [r.tokens for r in hf_greedy(tiny_qwen3_dir, PROMPTS, [16] * len(PROMPTS))]
    eos = sorted({g[i] for g, i in zip(greedy, [3, 5, 7, 9, 11, 4, 6, 8], strict=True)})
    out = tmp_path_factory.mktemp("tiny-eos") / "qwen3"
    shutil.copytree(tiny_qwen3_dir, out)
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((out / name).read_text())
        cfg["eos_token_id"] = eos
        (out / name).write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6])
@pytest.mark.parametrize("block_size", [4, 16])
def test_widths_1_to_6_equal_hf_on_the_tiny_qwen3(tiny_qwen3_dir, k, block_size):
    ref = hf_beams(tiny_qwen3_dir, PROMPTS, MAX_NEW, BeamParams(k, num_return_sequences=k))
    engine = Engine(tiny_qwen3_dir, block_size=block_size, kernel="torch")
    got = run_checked(engine, PROMPTS, MAX_NEW, num_beams=k, num_return_sequences=k)
    assert got == [r.sequences for r in ref]
    if k > 1:
        assert engine.stats().blocks_shared > 0


@pytest.mark.parametrize(
    "beam",
    [
        {"num_beams": 4, "num_return_sequences": 4},
        {"num_beams": 3, "num_return_sequences": 2, "early_stopping": True},
        {"num_beams": 4, "num_return_sequences": 3, "early_stopping": "never", "length_penalty": 2.0},
        {"num_beams": 5, "num_return_sequences": 1, "length_penalty": -0.5},
        {"num_beams": 6, "num_return_sequences": 6, "length_penalty": 0.0},
    ],
    ids=["k4", "k3-early", "k4-never-lp2", "k5-lp-neg", "k6-lp0"],
)
def test_eos_length_penalty_and_early_stopping_equal_hf(eos_dir, beam):
    max_new_tokens = [16] * len(PROMPTS)
    ref = hf_beams(eos_dir, PROMPTS, max_new_tokens, BeamParams(**beam))
    got = run_checked(Engine(eos_dir, block_size=4, kernel="torch"), PROMPTS, max_new_tokens, **beam)
    assert got == [r.sequences for r in ref]
    if beam.get("length_penalty", 1.0) < 2:  # (a penalty of 2 favours the long ones here)
        assert any(len(s) < 16 for r in ref for s in r.sequences)  # some hypotheses did end on an eos


@pytest.mark.parametrize("chunk", [None, 5])
def test_a_tight_pool_preempts_whole_groups_and_changes_no_token(eos_dir, chunk):
    """Every prompt at once in the smallest pool ``check_fits`` allows for the largest group: groups
    are preempted (as units) and recompute, sharing again; the tokens stay HF's."""
    prompts = PROMPTS * (2 if chunk else 1)  # chunked, a group may recompute unshared: a larger pool
    max_new_tokens = [16] * len(prompts)
    options = {"block_size": 4, "kernel": "torch", "max_num_seqs": 64, "prefill_chunk_size": chunk}
    if chunk:
        options["max_num_batched_tokens"] = 40
    probe = Engine(eos_dir, **options)
    shares = recompute_shares(probe.scheduler)
    smallest = max(beam_blocks(len(p), b, 4, 4, shares) for p, b in zip(prompts, max_new_tokens, strict=True))
    engine = Engine(eos_dir, num_blocks=smallest, **options)
    got = run_checked(engine, prompts, max_new_tokens, ideal=False, num_beams=4, num_return_sequences=2)
    assert got == [r.sequences for r in hf_beams(eos_dir, prompts, max_new_tokens, BeamParams(4, 2))]
    assert engine.stats().preemptions >= 1


def test_beams_beside_greedy_and_sampled_requests(tiny_qwen3_dir):
    """One engine, requests arriving over time: beam groups, greedy requests and sampled clones share
    the pool and the batch; the beams and the greedy requests equal HF, nothing leaks."""
    engine = Engine(tiny_qwen3_dir, block_size=4, kernel="torch", max_num_seqs=16, num_blocks=60)
    params = BeamParams(3, num_return_sequences=3)
    jobs = []
    for i, (p, b) in enumerate(zip(PROMPTS, MAX_NEW, strict=True)):
        if i % 3 == 0:
            jobs.append(("beam", add_beam_request(engine, p, b, params), p, b))
        elif i % 3 == 1:
            jobs.append(("greedy", engine.add_request(p, b), p, b))
        else:
            engine.add_request(p, b, n=2, sampling=SamplingParams(temperature=1.0, seed=i))
        engine.step()
        engine.scheduler.check_invariants()
    while engine.has_unfinished():
        engine.step()
        engine.scheduler.check_invariants()
    assert engine.allocator.num_free == engine.allocator.num_blocks
    for kind, seq, p, b in jobs:
        if kind == "beam":
            assert seq.sequences() == hf_beams(tiny_qwen3_dir, [p], [b], params)[0].sequences
        else:
            assert seq.output_ids == hf_greedy(tiny_qwen3_dir, [p], [b])[0].tokens


def test_abort_a_beam_group_frees_every_beam(tiny_qwen3_dir):
    engine = Engine(tiny_qwen3_dir, block_size=4, kernel="torch")
    group = add_beam_request(engine, PROMPTS[6], 10, BeamParams(4))
    for _ in range(3):
        engine.step()
    assert len(engine.scheduler.running) == 4 and engine.scheduler.groups
    engine.abort(group.seqs[0].request_id)
    assert not engine.scheduler.groups
    engine.scheduler.check_invariants()
    assert not engine.has_unfinished() and engine.allocator.num_free == engine.allocator.num_blocks


@pytest.fixture(scope="module")
def course_ids(model_dir):
    from kvcourse.harness.prompts import encode, load_tokenizer, read_prompts

    tok = load_tokenizer(model_dir)
    ids = [encode(tok, p) for p in read_prompts(None)]
    return [ids[0], min(ids, key=len)]  # a chat prompt whose beams end on eos, and the shortest


@pytest.mark.slow
@pytest.mark.parametrize("k", [k for k in range(1, 7) if k not in BEAM_WIDTHS])
def test_widths_1_to_6_equal_hf_on_the_course_model(model_dir, course_ids, k):
    """The widths up to 6 that the L5 smoke leaves out (1, 3 and 5): its ``BEAM_WIDTHS`` run against HF
    on the course model in ``make smoke``, so the two commands cover 1-6 there once each (the tiny
    Qwen3 above runs 1-6 in make test)."""
    ref = hf_beams(model_dir, course_ids, [24, 24], BeamParams(k, num_return_sequences=min(k, 2)))
    engine = Engine(model_dir, kernel="torch")
    got = run_checked(engine, course_ids, [24, 24], num_beams=k, num_return_sequences=min(k, 2))
    assert got == [r.sequences for r in ref]


def test_length_penalty_and_early_stopping_on_the_course_model(model_dir, course_ids):
    for beam in ({"num_beams": 3, "early_stopping": True}, {"num_beams": 3, "length_penalty": 2.0}):
        ref = hf_beams(model_dir, course_ids[:1], [24], BeamParams(**beam))
        assert run_checked(Engine(model_dir, kernel="torch"), course_ids[:1], [24], **beam) == [
            r.sequences for r in ref
        ]


# ---------------------------------------------------------------- the fork's books


def forked_books():
    """``fork``'s docstring example: block_size 4, beams [3, 5, 8] and [3, 5, 9] holding 10 positions
    each (3 and 5 full, registered and held by both), blocks 1, 2, 4, 6, 7 held elsewhere, free list [0]."""
    a = BlockAllocator(10, 4)
    a.alloc_blocks(10)
    tokens = list(range(100, 110))
    a.register(3, 11, tokens[:4])
    a.register(5, 12, tokens[4:8])
    a.alloc_blocks(0, cached=[3, 5])  # the second beam's references
    a.free([0])
    return a


def test_fork_docstring_example_drops_then_clones_and_returns_the_copies():
    a = forked_books()
    tables = [[3, 5, 8], [3, 5, 9]]
    assert fork_needs(a, tables, 10, [0, 0]) == 0  # the clone's copy takes 1, the drop gives 9 back
    assert fork(a, tables, 10, [0, 0]) == ([[3, 5, 8], [3, 5, 0]], [(8, 0)])
    assert {b: a.blocks[b].ref_count for b in (3, 5, 8, 9, 0)} == {3: 2, 5: 2, 8: 1, 9: 0, 0: 1}
    assert list(a.free_blocks) == [9]
    a.check_invariants([[3, 5, 8], [3, 5, 0], [1, 2, 4, 6, 7]])


def test_fork_needs_counts_copies_beyond_what_the_drops_give_back():
    a = forked_books()
    tables = [[3, 5, 8], [3, 5, 9]]
    assert fork_needs(a, tables, 10, [0, 1, 0]) == 1  # a third beam, nothing dropped
    assert fork_needs(a, tables, 10, [1, 0]) == 0  # each continued once: nothing copied
    assert fork_needs(a, tables, 8, [0, 0]) == 0  # on a block boundary nothing is copied
    assert fork(a, tables, 10, [1, 0]) == ([[3, 5, 9], [3, 5, 8]], [])


# ---------------------------------------------------------------- random fork/drop on the allocator


@settings(max_examples=200, deadline=None)
@given(
    num_blocks=st.integers(1, 24),
    block_size=st.integers(1, 5),
    prompt=st.integers(1, 12),
    ops=st.lists(st.tuples(st.sampled_from(["grow", "fork", "drop"]), st.integers(0, 50), st.integers(1, 4))),
)
def test_random_fork_and_drop_keep_the_books(num_blocks, block_size, prompt, ops):
    """Beams grow a token at a time, fork (``clone``: full blocks shared, the partial one copied) and
    drop (``free``) in any order: the books balance after every operation, a failed one changes
    nothing, the pool holds exactly the blocks of the beams' distinct histories, and once every beam
    is dropped every block is free."""
    allocator = BlockAllocator(num_blocks, block_size)
    fresh = iter(range(10**6))  # every new token is new: equal histories come only from forks
    beams = [Sequence(0, [next(fresh) for _ in range(prompt)], 1)]
    try:
        allocate_slots(beams[0], allocator, prompt)
    except OutOfBlocksError:
        return
    beams[0].num_computed_tokens = prompt
    for op, pick, m in ops:
        if not beams:
            break
        beam = beams[pick % len(beams)]
        before = ([(b.ref_count, b.hash) for b in allocator.blocks], list(allocator.free_blocks))
        try:
            if op == "grow":
                beam.prompt_ids.append(next(fresh))
                try:
                    allocate_slots(beam, allocator, beam.num_tokens)
                except OutOfBlocksError:
                    beam.prompt_ids.pop()
                    raise
                beam.num_computed_tokens = beam.num_tokens
            elif op == "fork":
                tables, _ = allocator.clone(beam.block_table, beam.num_computed_tokens, m)
                for table in tables:
                    beams.append(Sequence(0, list(beam.prompt_ids), 1, block_table=table))
                    beams[-1].num_computed_tokens = beam.num_computed_tokens
            else:
                allocator.free(beam.block_table)
                beams.remove(beam)
        except OutOfBlocksError:
            assert ([(b.ref_count, b.hash) for b in allocator.blocks], list(allocator.free_blocks)) == before
        allocator.check_invariants(b.block_table for b in beams)
        assert allocator.num_used == ideal_blocks(beams, block_size)
    for beam in beams:
        allocator.free(beam.block_table)
    allocator.check_invariants([])
    assert allocator.num_free == num_blocks


# ---------------------------------------------------------------- the tie rule


def test_compare_beams_reports_a_tie_at_the_step_the_choice_parted_and_no_further():
    hf = BeamReference(
        sequences=[[5, 2, 8]],
        beams=[[[]], [[5], [7]], [[5, 2], [7, 1]]],
        gaps=[0.3, TIE_GAP / 2, 0.4],
    )
    steps = [[(0, 5), (0, 7)], [(0, 2), (1, 1)], [(0, 8), (1, 3)]]
    assert beam_history(steps) == hf.beams
    assert compare_beams([[5, 2, 8]], steps, hf).status == "match"
    assert compare_beams([[5, 2, 9]], steps, hf).status == "DIFF@3"  # same beams, another result
    parted_after_tie = [[(0, 5), (0, 7)], [(0, 2), (0, 4)], [(0, 9), (1, 1)]]
    c = compare_beams([[5, 4, 1]], parted_after_tie, hf)
    assert c.status == "tie@1" and c.tie_gap == TIE_GAP / 2 and c.ok
    parted_at_once = [[(0, 5), (0, 6)], [(0, 2), (1, 1)], [(0, 8), (1, 3)]]
    assert compare_beams([[6, 1, 3]], parted_at_once, hf).status == "DIFF@0"


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kwargs, call, message",
    [
        ({}, {"num_beams": 0}, "num_beams must be an integer >= 1, got 0"),
        (
            {},
            {"num_beams": 2, "num_return_sequences": 3},
            r"num_return_sequences must be in \[1, num_beams=2\], got 3",
        ),
        (
            {},
            {"num_beams": 2, "early_stopping": "soon"},
            "early_stopping must be True, False or 'never', got 'soon'",
        ),
        ({"max_num_seqs": 4}, {"num_beams": 5}, "prompt 0: num_beams=5 exceeds max_num_seqs=4"),
        (
            {"block_size": 4, "num_blocks": 7},
            {"num_beams": 6},
            r"prompt 0: beam search of width 6 may hold up to 8 blocks \(the prompt's full blocks shared, "
            r"the rest once per beam\), but the pool has only 7 blocks",
        ),
    ],
)
def test_bad_beam_requests_are_named(tiny_llama_dir, kwargs, call, message):
    engine = Engine(tiny_llama_dir, **kwargs)
    with pytest.raises(ValueError, match=message):
        engine.generate_beams(
            [[1] * 10], 2, **call
        )  # 10 tokens + 2 in blocks of 4: 2 full blocks + 6 * (3 - 2) = 8
    assert not engine.has_unfinished()


def test_beams_with_sampling_are_refused(tiny_llama_dir):
    engine = Engine(tiny_llama_dir)
    with pytest.raises(ValueError, match="num_beams=4 cannot be combined with temperature=0.8"):
        engine.generate_beams([[1, 2]], 3, num_beams=4, sampling=SamplingParams(temperature=0.8))
    assert not engine.has_unfinished()


# ---------------------------------------------------------------- the command line


def test_cli_num_beams_prints_hfs_best_hypothesis(tiny_qwen3_dir, capsys):
    from kvcourse.harness.cli import main
    from kvcourse.harness.prompts import Prompt, encode, load_tokenizer

    argv = ["generate", "--stage", "L5", "--model", str(tiny_qwen3_dir), "--max-new-tokens", "6"]
    assert main([*argv, "--num-beams", "3", "--raw", "The KV cache"]) == 0
    tok = load_tokenizer(tiny_qwen3_dir)
    ids = encode(tok, Prompt(text="The KV cache"))
    [best] = hf_beams(tiny_qwen3_dir, [ids], [6], BeamParams(3))[0].sequences
    out = capsys.readouterr().out
    assert tok.decode(best, skip_special_tokens=True).strip() in out and "L5: 6 new tokens in" in out


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--num-beams", "0"], "error: --num-beams must be >= 1, got 0"),
        (["--num-beams", "2", "--stage", "L3"], "error: --num-beams 2: stage L3 has no beam search (L5 has)"),
        (["--num-beams", "2", "--ignore-eos"], "error: --num-beams 2 stops on eos as HF's beam search does"),
    ],
)
def test_cli_bad_num_beams_is_one_error_line(tiny_llama_dir, capsys, extra, message):
    from kvcourse.harness.cli import main

    argv = ["generate", "--stage", "L5", "--model", str(tiny_llama_dir), "hi", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and len(err.strip().splitlines()) == 1


# ---------------------------------------------------------------- the memory figure's command


def test_quick_beam_memory_saves_blocks_and_copying_changes_no_token(tmp_path, capsys):
    """``python -m bench.beam_memory --quick``: every workload and width has a row; beam search saves
    blocks on the course prompts; the copying baseline returned the same tokens (the script asserts
    it) and held more blocks at its peak."""
    from bench import beam_memory

    out = tmp_path / "beam-memory.json"
    assert beam_memory.main(["--quick", "--out", str(out), "--plot", str(tmp_path / "b.png")]) == 0
    results = json.loads(out.read_text())
    assert len(results["rows"]) == 3 * 2 * len(beam_memory.WIDTHS)
    course = [r for r in results["rows"] if r["workload"] == "course" and r["mode"] == "beam search"]
    assert all(r["saved"] > 0 and r["peak_held"] < r["peak_unshared"] for r in course)
    t = results["throughput"]
    assert t["copied"]["peak_held"] > t["shared"]["peak_held"] or t["copied"]["preemptions"] > 0
    assert (
        tmp_path / "b.png"
    ).stat().st_size > 0 and "Paper (Kwon et al., SOSP 2023, Fig. 15)" in capsys.readouterr().out


def test_trace_prints_each_beams_table_with_the_refcounts_its_siblings_imply(tiny_qwen3_dir):
    """``python -m bench.beam_memory --trace`` (here on the tiny Qwen3): after every step, each beam's
    table; a block's printed count equals the number of the step's tables that list it (one request
    runs, so nothing else holds it), and the beams share the prompt's full blocks."""
    from bench import beam_memory

    engine = Engine(tiny_qwen3_dir, block_size=4, enable_prefix_caching=False)
    lines = beam_memory.trace(engine, list(range(3, 14)), 5, 3)  # 11 tokens: 2 full blocks
    steps = [i for i, line in enumerate(lines) if line.startswith("step") and "survivors" in line]
    assert steps and lines[0] == "prompt: 11 tokens, block_size 4"
    for i in steps:
        tables = [line.split("[")[1].split("]")[0].split() for line in lines[i + 1 : i + 4]]
        assert len(tables) == 3 and all(
            line.startswith(f"  beam {j}:") for j, line in enumerate(lines[i + 1 : i + 4])
        )
        held = Counter(cell.split("x")[0] for t in tables for cell in t)
        assert all(int(cell.split("x")[1]) == held[cell.split("x")[0]] for t in tables for cell in t)
        assert [t[:2] for t in tables] == [tables[0][:2]] * 3 and held[tables[0][0].split("x")[0]] == 3
