"""L5 smoke check: sharing blocks changes no token (L5 == L4 == HF), and shows in memory.

    python L5_clones/l5_smoke.py [--model DIR] [--prompts FILE.jsonl] [--max-new-tokens N]
        [--device cpu|cuda]

With no --model it runs the course model and a seeded random tiny Qwen3. Checked row by row against
L4 and HF, each run printing its engine's stats (blocks held and shared, clones, prefix-cache hits):

(a) every prompt at once, prefix cache on, with the device's default kernel (``kernel="auto"``: the
    C++ kernel on a CPU where ``make setup`` built it, Triton on a GPU), on a small pool sized from the
    prompts (``SmokeContext.tight_pool``: every prompt fits at once, their growth does not), so the
    scheduler preempts. SmolLM2's chat template adds the same system prompt to every chat prompt that
    has none, so the prompts share their first block, in the same step, and a preempted request finds
    it again;
(b) one request at a time, prefix cache on: each request finds the blocks the ones before it freed
    (a freed block keeps its key until it is handed out again);
(c) as (a), with the PyTorch reference kernel; and as (a) on the decode-graph fast path
    (``cuda_graphs=True``): recorded CUDA graphs on a GPU, the same padded steps run eagerly on a CPU.

Then, counted in the summary line through the smoke's ``extra`` hook:

(d) SAMPLES greedy clones of each prompt (one request each, prefilled once, then cloned), the first
    CLONE_TOKENS tokens: every clone == HF (the row shows the clone that differs first, if any);
(e) SAMPLES sampled clones (temperature 0.8, top-p 0.9, top-k 50, seed 1234) of the SAMPLED_PROMPTS
    shortest prompts, CLONE_TOKENS tokens each: == SAMPLES independent requests seeded 1234 ..,
    with nothing shared, token for token. Sampling has no HF reference: these rows compare L5 with
    itself, cloned against unshared;
(f) the prefix-cache prompt file (``kvcourse/harness/prompts_prefix.jsonl``, its own max_new_tokens): the same
    16-token blocks after different prefixes, one request at a time and then all at once, against HF.
    A cache key that forgot the blocks before its block would hit there and change the tokens;
(g) beam search of widths BEAM_WIDTHS on the BEAM_PROMPTS shortest prompts, BEAM_TOKENS tokens, all
    prompts of a width at once, against HF ``generate(num_beams=k, num_return_sequences=2)``: both
    hypotheses, token for token. A row is a width and a prompt; where the beams part from HF's on a
    numerical tie (HF's candidate scores closer than the tie rule's 1e-3 at that step) the row says
    ``tie@step`` and compares no further, and the summary line counts it with the other ties.
"""

from __future__ import annotations

from kvcourse.harness.compare import Row, compare, compare_beams, first_difference, format_rows
from kvcourse.harness.prompts import PREFIX_PROMPTS, read_prompts
from kvcourse.harness.reference import hf_beams
from kvcourse.harness.smoke import SmokeContext, StageRun, blocks_for, compare_run, prepare, run_smoke
from kvcourse.sampling import BeamParams, SamplingParams
from L4_paged_kernel.engine import Engine as L4Engine
from L5_clones.beams import add_beam_request
from L5_clones.engine import Engine

SAMPLES = 4
CLONE_TOKENS = 24
SAMPLED_PROMPTS = 3
PREFIX_TOKENS = 16  # max_new_tokens of a prefix-cache file line that sets none (the course's set them all)
SAMPLING = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=1234)
BEAM_WIDTHS = (2, 4, 6)  # width 1 is greedy decoding, in HF as here: the rows above
BEAM_PROMPTS = 2
BEAM_TOKENS = 24


def one_at_a_time(engine, prompts: list[list[int]], max_new_tokens: list[int]) -> list[list[int]]:
    """Each request runs alone, after the one before it has finished and freed its blocks."""
    return [engine.generate([p], [b])[0] for p, b in zip(prompts, max_new_tokens, strict=True)]


def runs(ctx: SmokeContext) -> list[StageRun]:
    """The configurations compared row by row with L4 and HF."""
    small = ctx.tight_pool(16)
    return [
        StageRun(
            f"L5 all at once, prefix cache on, small pool of {small} blocks",
            lambda ctx: engine(ctx, num_blocks=small),
        ),
        StageRun("L5 one request at a time, prefix cache on", lambda ctx: engine(ctx), one_at_a_time),
        StageRun("L5 torch kernel, all at once, prefix cache on", lambda ctx: engine(ctx, kernel="torch")),
        StageRun(
            f"L5 decode graphs, all at once, prefix cache on, small pool of {small} blocks",
            lambda ctx: engine(ctx, num_blocks=small, cuda_graphs=True),
        ),
    ]


def engine(ctx: SmokeContext, **options) -> Engine:
    """An L5 engine on the smoke's device, with room for the longest request."""
    return Engine(ctx.model_dir, device=ctx.device, max_model_len=ctx.max_model_len, **options)


def previous(ctx: SmokeContext) -> StageRun:
    """The stage L5 is compared with."""
    return StageRun(
        "L4 paged kernel",
        lambda ctx: L4Engine(ctx.model_dir, device=ctx.device, max_model_len=ctx.max_model_len),
    )


def clone_engine(ctx: SmokeContext, prompts: list[list[int]], max_new: list[int], **options) -> Engine:
    """An engine whose pool holds SAMPLES unshared copies of every request at once: no preemption."""
    room = sum(SAMPLES * blocks_for(len(p) + b, 16) for p, b in zip(prompts, max_new, strict=True))
    return engine(ctx, max_num_seqs=SAMPLES * len(prompts), num_blocks=room, **options)


def greedy_clones(ctx: SmokeContext) -> tuple[int, int]:
    """(d): SAMPLES greedy clones per prompt, each compared with HF up to CLONE_TOKENS."""
    capped = [min(b, CLONE_TOKENS) for b in ctx.max_new_tokens]
    engine = clone_engine(ctx, ctx.ids, capped)
    clones = engine.generate_samples(ctx.ids, capped, n=SAMPLES)
    rows = []
    for prompt, ref, samples in zip(ctx.prompts, ctx.refs, clones, strict=True):
        expected = ref.tokens[:CLONE_TOKENS]
        checks = [compare(expected, s, ref) for s in samples]
        worst = min(range(SAMPLES), key=lambda j: (checks[j].ok, checks[j].first_diff is None))
        text = ctx.tokenizer.decode(samples[worst])
        rows.append(Row(prompt.label, checks[worst], None, text, ctx.tokenizer.decode(expected)))
    print(f"-- L5 {SAMPLES} greedy clones per prompt (one request each, cloned), first {CLONE_TOKENS} tokens")
    print(f"  {engine.stats()}")
    print(format_rows(rows, None))
    return sum(r.ok for r in rows), len(rows)


def sampled_clones(ctx: SmokeContext) -> tuple[int, int]:
    """(e): cloned sampled clones == independent requests with nothing shared."""
    chosen = ctx.shortest(SAMPLED_PROMPTS)
    prompts = [ctx.ids[i] for i in chosen]
    max_new = [CLONE_TOKENS] * len(prompts)
    cloned = clone_engine(ctx, prompts, max_new)
    unshared = clone_engine(ctx, prompts, max_new, enable_prefix_caching=False)
    a = cloned.generate_samples(prompts, max_new, n=SAMPLES, sampling=SAMPLING)
    b = unshared.generate_samples(prompts, max_new, n=SAMPLES, sampling=SAMPLING, share=False)
    print(
        f"-- L5 {SAMPLES} sampled clones (temperature {SAMPLING.temperature}, top-p {SAMPLING.top_p}, top-k "
        f"{SAMPLING.top_k}, seed {SAMPLING.seed}) of the {len(prompts)} shortest prompts, {CLONE_TOKENS} tokens: "
        "cloned vs independent requests (no HF reference for sampling)"
    )
    print(f"  cloned:      {cloned.stats()}")
    print(f"  independent: {unshared.stats()}")
    passed = 0
    for i, (mine, theirs) in enumerate(zip(a, b, strict=True), start=1):
        diffs = [
            (j, pos)
            for j, (x, y) in enumerate(zip(mine, theirs, strict=True))
            if (pos := first_difference(x, y)) is not None
        ]
        passed += not diffs
        status = "match" if not diffs else f"DIFF@{diffs[0][1]} (sample {diffs[0][0]})"
        distinct = len({tuple(s) for s in mine})
        print(
            f"{i:>3}  {status:<9}{distinct} distinct samples; sample 0: {ctx.tokenizer.decode(mine[0])[:60]!r}"
        )
    return passed, len(prompts)


def prefix_prompts(ctx: SmokeContext) -> tuple[int, int]:
    """(f): the prefix-cache prompt file, one request at a time and all at once, against HF."""
    prefix = prepare(ctx.model_dir, read_prompts(PREFIX_PROMPTS), PREFIX_TOKENS)
    passed = total = 0
    for run in (
        StageRun(
            "L5 prefix-cache prompts (equal blocks after different prefixes), one at a time",
            lambda ctx: Engine(ctx.model_dir, device=ctx.device, max_model_len=ctx.max_model_len),
            one_at_a_time,
        ),
        StageRun(
            "L5 prefix-cache prompts (equal blocks after different prefixes), all at once",
            lambda ctx: Engine(ctx.model_dir, device=ctx.device, max_model_len=ctx.max_model_len),
        ),
    ):
        p, t, _, _ = compare_run(prefix, run, None, None)
        passed, total = passed + p, total + t
    return passed, total


def beam_search(ctx: SmokeContext) -> tuple[int, int, int]:
    """(g): beam search against HF, a row per width and prompt; (passed, total, ties)."""
    chosen = ctx.shortest(BEAM_PROMPTS)
    prompts = [ctx.ids[i] for i in chosen]
    max_new = [min(ctx.max_new_tokens[i], BEAM_TOKENS) for i in chosen]
    rows = []
    print(
        f"-- L5 beam search, widths {', '.join(map(str, BEAM_WIDTHS))}, 2 hypotheses each, of the "
        f"{len(prompts)} shortest prompts, up to {BEAM_TOKENS} tokens (vs HF generate(num_beams=k))"
    )
    for k in BEAM_WIDTHS:
        params = BeamParams(k, num_return_sequences=2)
        refs = hf_beams(ctx.model_dir, prompts, max_new, params, ctx.device)
        eng = engine(ctx)
        groups = [add_beam_request(eng, p, b, params) for p, b in zip(prompts, max_new, strict=True)]
        while eng.has_unfinished():
            eng.step()
        print(f"  width {k}: {eng.stats()}")
        for i, group, ref in zip(chosen, groups, refs, strict=True):
            got = group.sequences()
            check = compare_beams(got, group.steps, ref)
            text, hf_text = ctx.tokenizer.decode(got[0]), ctx.tokenizer.decode(ref.sequences[0])
            rows.append(Row(f"k={k} {ctx.prompts[i].label}", check, None, text, hf_text, unit="step"))
    print(format_rows(rows, None))
    return sum(r.ok for r in rows), len(rows), sum(r.tie for r in rows)


def extra(ctx: SmokeContext) -> tuple[int, int, int]:
    """(d), (e), (f) and (g), counted in the summary line, with (g)'s numerical ties."""
    results = [greedy_clones(ctx), sampled_clones(ctx), prefix_prompts(ctx)]
    passed, total, ties = beam_search(ctx)
    return passed + sum(p for p, _ in results), total + sum(t for _, t in results), ties


if __name__ == "__main__":
    run_smoke("L5", runs, previous, extra=extra)
