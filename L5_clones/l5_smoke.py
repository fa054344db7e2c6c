"""L5 smoke check: sharing blocks changes no token (L5 == L4 == HF), and shows in memory.

    python L5_clones/l5_smoke.py [--model DIR] [--prompts FILE.jsonl] [--max-new-tokens N]

With no --model it runs the course model and a seeded random tiny Qwen3. Four parts:

(a) L5 greedy, every prompt at once, with the prefix cache on: == L4 (torch kernel) == HF. Eight
    of the chat prompts start with SmolLM2's default system prompt (its template adds one when
    the prompt has none), so seven share the first one's first block, in the same step;
(b) n=4 greedy clones of each prompt (one request each, prefilled once, then forked), the first
    CLONE_TOKENS tokens: every clone == HF (the row shows the clone that differs first, if any);
(c) n=4 sampled clones (temperature 0.8, top-p 0.9, top-k 50, seed 1234) of the first
    SAMPLED_PROMPTS prompts, SAMPLED_TOKENS tokens each: == 4 independent requests seeded
    1234 .. 1237, once with nothing shared (no fork, no prefix cache) and once through the prefix
    cache alone, token for token. Sampling has no HF reference: these rows compare L5 with itself;
(d) memory: peak KV blocks in use for (c) forked vs independent; and the prefix cache on prompts
    that share a long system prompt, all at once and one after another (a finished request's
    blocks keep their hash on the free list) and without the cache, each run's outputs == HF.

(b), (c) and (d) are counted in the summary line through the smoke's ``extra`` hook.
"""

from __future__ import annotations

from os.path import commonprefix
from pathlib import Path

from kvcourse.compare import Comparison, Row, compare, first_difference, format_rows
from kvcourse.prompts import Prompt, budgets, encode, load_tokenizer, read_prompts
from kvcourse.reference import hf_greedy
from kvcourse.sampling import SamplingParams
from kvcourse.smoke import StageRun, parse_args, run_smoke
from kvcourse.workloads import all_at_once
from L4_paged_kernel.engine import Engine as L4Engine
from L5_clones.cache import blocks_needed
from L5_clones.engine import Engine

SAMPLES = 4
CLONE_TOKENS = 24
SAMPLED_PROMPTS = 3
SAMPLED_TOKENS = 24
SAMPLING = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=1234)
SYSTEM = (
    "You are a careful teaching assistant for a course on how large language models generate text. "
    "Answer in plain words, in at most three sentences, without lists or headings. When a question "
    "mentions memory, speak about the key-value cache, and when it mentions speed, speak about "
    "batching. Never invent numbers you were not given."
)
QUESTIONS = (
    "Why does a model keep keys and values?",
    "What is a block table?",
    "Why batch several requests together?",
    "What happens when memory runs out?",
)
PREFIX_BUDGET = 8


def with_counters(workload):
    """Wrap a workload so that it prints the engine's sharing counters after running."""

    def run(engine, prompts, budgets):
        out = workload(engine, prompts, budgets)
        print(
            f"  scheduler: {engine.num_steps} steps, {engine.num_preemptions} preemptions; prefix cache "
            f"{engine.num_cached_blocks} block hits ({engine.num_cached_tokens} prefill tokens skipped); "
            f"peak blocks {engine.peak_blocks_used} in use, {engine.peak_blocks_shared} shared"
        )
        return out

    return run


def main_runs() -> list[StageRun]:
    """The configuration compared row by row with L4 and HF."""
    return [StageRun("L5 all at once, prefix cache on", lambda d: Engine(d), with_counters(all_at_once))]


def previous() -> StageRun:
    """The stage L5 is compared with."""
    return StageRun("L4 torch kernel", lambda model_dir: L4Engine(model_dir))


def worst_first(c: Comparison) -> tuple[bool, bool, int]:
    """Sort key putting a difference before a tie before a match, earliest position first."""
    return (c.ok, c.first_diff is None, c.first_diff or 0)


def greedy_clones(model_dir: Path, tok, ids: list[list[int]], budget: list[int]) -> tuple[int, int]:
    """(b): n greedy clones per prompt, each compared with HF up to CLONE_TOKENS."""
    refs = hf_greedy(model_dir, ids, budget)  # the same call as the main rows: read from the cache
    capped = [min(b, CLONE_TOKENS) for b in budget]
    room = sum(SAMPLES * blocks_needed(len(p) + b, 16) for p, b in zip(ids, capped))  # even unshared
    engine = Engine(model_dir, max_num_seqs=SAMPLES * len(ids), num_blocks=room)
    clones = engine.generate_samples(ids, capped, n=SAMPLES)
    rows = []
    for ref, samples in zip(refs, clones):
        expected = ref.tokens[:CLONE_TOKENS]
        checks = [compare(expected, s, ref.gaps) for s in samples]
        worst = min(range(SAMPLES), key=lambda j: worst_first(checks[j]))
        rows.append(Row("", checks[worst], None, tok.decode(samples[worst]), tok.decode(expected)))
    print(f"-- L5 {SAMPLES} greedy clones per prompt (one request each, forked), first {CLONE_TOKENS} tokens")
    print(
        f"  {engine.num_forks} forks, {engine.num_preemptions} preemptions; peak blocks {engine.peak_blocks_used}"
        f" in use, {engine.peak_blocks_shared} shared"
    )
    print(format_rows(rows, None))
    return sum(r.ok for r in rows), len(rows)


def sampled_clones(model_dir: Path, tok, ids: list[list[int]]) -> tuple[int, int]:
    """(c) and the first half of (d): forked sampled clones == independent requests."""
    ids = ids[:SAMPLED_PROMPTS]
    runs = {
        "forked": Engine(model_dir),
        "independent, nothing shared": Engine(model_dir, enable_prefix_caching=False),
        "independent, prefix cache": Engine(model_dir),
    }
    out = {
        name: engine.generate_samples(
            ids, SAMPLED_TOKENS, n=SAMPLES, sampling=SAMPLING, share=name == "forked"
        )
        for name, engine in runs.items()
    }
    print(
        f"-- L5 {SAMPLES} sampled clones (temperature {SAMPLING.temperature}, top-p {SAMPLING.top_p}, "
        f"top-k {SAMPLING.top_k}, seed {SAMPLING.seed}) of the first {len(ids)} prompts, "
        f"{SAMPLED_TOKENS} tokens: forked vs independent requests (no HF reference for sampling)"
    )
    passed = 0
    for i, forked in enumerate(out["forked"]):
        diffs = [
            (name, j, pos)
            for name in list(runs)[1:]
            for j, (a, b) in enumerate(zip(out[name][i], forked))
            if (pos := first_difference(a, b)) is not None
        ]
        passed += not diffs
        status = "match" if not diffs else f"DIFF@{diffs[0][2]} (sample {diffs[0][1]}, {diffs[0][0]})"
        distinct = len({tuple(s) for s in forked})
        print(f"{i + 1:>3}  {status:<9}{distinct} distinct samples; sample 0: {tok.decode(forked[0])[:60]!r}")
    print("  peak KV blocks in use for these samples:")
    for name, engine in runs.items():
        print(
            f"    {name:<28} {engine.peak_blocks_used:>4} ({engine.peak_blocks_shared} shared; "
            f"{engine.num_forks} forks, {engine.num_cached_blocks} prefix-cache block hits); "
            f"{engine.num_tokens_run} tokens run; {engine.usage}"
        )
    return passed, len(ids)


def system_prompt_cache(model_dir: Path, tok, budget: int) -> tuple[int, int]:
    """The second half of (d): the prefix cache on prompts sharing a long system prompt."""
    if tok.chat_template is None:
        ids = [encode(tok, Prompt(text=f"{SYSTEM}\n\nQuestion: {q}\nAnswer:")) for q in QUESTIONS]
    else:
        ids = [encode(tok, Prompt(messages=(("system", SYSTEM), ("user", q)))) for q in QUESTIONS]
    budget = min(budget, PREFIX_BUDGET)
    refs = hf_greedy(model_dir, ids, [budget] * len(ids))
    at_once, one_by_one, uncached = (
        Engine(model_dir),
        Engine(model_dir),
        Engine(model_dir, enable_prefix_caching=False),
    )
    outs = {
        "all at once": at_once.generate(ids, budget),
        "one after another": [one_by_one.generate([p], budget)[0] for p in ids],
        "no prefix cache": uncached.generate(ids, budget),
    }
    print(
        f"-- L5 prefix cache: {len(ids)} prompts whose first {len(commonprefix(ids))} tokens are the same "
        f"(a system prompt), {sum(map(len, ids))} prompt tokens in all, {budget} new tokens each"
    )
    passed = 0
    for i, ref in enumerate(refs):
        checks = [compare(ref.tokens, got[i], ref.gaps) for got in outs.values()]
        worst = min(checks, key=worst_first)
        passed += worst.ok
        print(f"{i + 1:>3}  {worst.status:<9}{tok.decode(outs['all at once'][i])[:70]!r}")
    for name, engine in (
        ("all at once", at_once),
        ("one after another", one_by_one),
        ("no prefix cache", uncached),
    ):
        print(
            f"  {name:<18} {engine.num_cached_blocks:>3} block hits, {engine.num_cached_tokens:>4} of "
            f"{sum(map(len, ids))} prompt tokens skipped, {engine.num_tokens_run} tokens run; peak blocks "
            f"{engine.peak_blocks_used} in use, {engine.peak_blocks_shared} shared"
        )
    return passed, len(ids)


def extra_checks(argv: list[str] | None = None):
    """(b), (c) and (d) as the smoke's ``extra(model_dir) -> (passed, total)`` hook, on the same prompt
    file and budgets as the main rows."""
    args = parse_args("L5", argv)
    prompts = read_prompts(args.prompts)

    def extra(model_dir: Path) -> tuple[int, int]:
        tok = load_tokenizer(model_dir)
        ids = [encode(tok, p) for p in prompts]
        results = [
            greedy_clones(model_dir, tok, ids, budgets(prompts, args.max_new_tokens)),
            sampled_clones(model_dir, tok, ids),
            system_prompt_cache(model_dir, tok, args.max_new_tokens),
        ]
        return sum(p for p, _ in results), sum(t for _, t in results)

    return extra


if __name__ == "__main__":
    run_smoke("L5", main_runs(), prev=previous(), extra=extra_checks())
