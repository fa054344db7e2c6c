"""What L5's sharing saves, counted: ``python -m bench.sharing [--model DIR] [--quick] [--out FILE]``.

L5 chapter, section 8. Three workloads on L5's engine with the course model, block size 16, fp32,
greedy unless said, every run on a fresh engine whose default pool grows to hold its requests side by
side (no preemption):

1. **Sampled clones**: the 3 shortest default prompts (chat template applied), 4 samples of each,
   24 new tokens (temperature 0.8, top-p 0.9, top-k 50, seed 1234), run three ways: cloned (one
   request per prompt, prefilled once, then cloned), 12 independent requests with the prefix cache on,
   and 12 independent requests with nothing shared. The three must give the same tokens.
2. **A shared system prompt**: 4 questions under one 74-token system prompt (``SYSTEM``), 8 new
   tokens each: all at once with the prefix cache, all at once without it, one after another with
   it. The three must give the same tokens.
3. **Greedy**: the 10 default prompts, all at once (the default system prompt their template adds is
   a block they share through the prefix cache), and 4 greedy clones of each, 24 new tokens.

Counters, from ``engine.stats()`` (``kvcourse.stats.EngineStats``): blocks held and shared at the peak,
tokens through the model, prefix-cache hits, and live KV at the peak (a shared block's positions
counted once). They count, they do not time: a run gives the same numbers on any machine and load.
The results go to ``bench/results/sharing.json``; ``make numbers`` draws the chapter's tables from it.
``--quick`` runs the same on a tiny random Qwen3 with short max_new_tokens and writes nothing (for the tests).

Left out on purpose: time (``make bench`` part (c) times sharing against L4), and beam search.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench.measure import cpu_name, provenance, save_results
from kvcourse.harness.prompts import Prompt, encode, load_tokenizer, read_prompts
from kvcourse.model_store import resolve_model_dir
from kvcourse.sampling import SamplingParams
from kvcourse.stats import format_bytes
from L5_clones.engine import Engine

SAMPLES = 4
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
SYSTEM_TOKENS = 8
COUNTERS = ("blocks_held", "blocks_shared", "tokens_run", "prefix_cache_hits", "kv_bytes_live")


def counters(engine: Engine, prompts: list[list[int]]) -> dict:
    """The run's counters, with the prompt tokens the prefix cache skipped (hits x block size)."""
    s = engine.stats()
    row = {name: getattr(s, name) for name in COUNTERS}
    row["prefill_skipped"] = s.prefix_cache_hits * s.block_size
    row["prompt_tokens"] = sum(map(len, prompts))
    return row


def same(runs: dict[str, list], what: str) -> None:
    """Raise unless every run gave the same tokens: sharing must change none."""
    first, *rest = runs.items()
    for name, out in rest:
        if out != first[1]:
            raise AssertionError(f"{what}: '{name}' gave other tokens than '{first[0]}'")


def sampled(model_dir: Path, ids: list[list[int]], tokens: int) -> dict:
    """Workload 1: cloned samples against independent requests, with and without the prefix cache."""
    shortest = sorted(range(len(ids)), key=lambda i: len(ids[i]))[:SAMPLED_PROMPTS]
    prompts = [ids[i] for i in sorted(shortest)]
    engines = {
        "cloned (one request per prompt, n = 4)": (Engine(model_dir), True),
        "12 independent requests, prefix cache on": (Engine(model_dir), False),
        "12 independent requests, nothing shared": (Engine(model_dir, enable_prefix_caching=False), False),
    }
    outs = {
        name: engine.generate_samples(prompts, tokens, n=SAMPLES, sampling=SAMPLING, share=share)
        for name, (engine, share) in engines.items()
    }
    same(outs, "sampled clones")
    return {
        "prompt_lengths": [len(p) for p in prompts],
        "rows": {name: counters(engine, prompts) for name, (engine, _) in engines.items()},
    }


def system_prompt(model_dir: Path, tokenizer, tokens: int) -> dict:
    """Workload 2: the prefix cache on prompts that share a system prompt, at once and one by one."""
    prompts = [encode(tokenizer, Prompt(messages=(("system", SYSTEM), ("user", q)))) for q in QUESTIONS]
    common = next(
        (i for i, col in enumerate(zip(*prompts, strict=False)) if len(set(col)) > 1), min(map(len, prompts))
    )
    at_once, uncached, one_by_one = (
        Engine(model_dir),
        Engine(model_dir, enable_prefix_caching=False),
        Engine(model_dir),
    )
    outs = {
        "all at once, prefix cache": at_once.generate(prompts, tokens),
        "all at once, no prefix cache": uncached.generate(prompts, tokens),
        "one after another, prefix cache": [one_by_one.generate([p], tokens)[0] for p in prompts],
    }
    same(outs, "system prompt")
    engines = dict(zip(outs, (at_once, uncached, one_by_one), strict=True))
    return {
        "common_prefix_tokens": common,
        "prompt_tokens": sum(map(len, prompts)),
        "rows": {name: counters(engine, prompts) for name, engine in engines.items()},
    }


def greedy(model_dir: Path, ids: list[list[int]], tokens: int) -> dict:
    """Workload 3: the default prompts all at once, and 4 greedy clones of each."""
    at_once, clones = Engine(model_dir), Engine(model_dir)
    at_once.generate(ids, tokens)
    clones.generate_samples(ids, tokens, n=SAMPLES)
    return {
        "rows": {
            f"{len(ids)} prompts, all at once": counters(at_once, ids),
            f"{len(ids)} prompts x {SAMPLES} greedy clones": counters(clones, ids),
        }
    }


def measure(model_dir: Path, quick: bool = False) -> dict:
    tokenizer = load_tokenizer(model_dir)
    ids = [encode(tokenizer, p) for p in read_prompts()]
    tokens = 4 if quick else SAMPLED_TOKENS
    return {
        "command": "python -m bench.sharing",
        **provenance(),
        "machine": cpu_name(),
        "model": model_dir.name,
        "sampled": sampled(model_dir, ids, tokens),
        "system_prompt": system_prompt(model_dir, tokenizer, 2 if quick else SYSTEM_TOKENS),
        "greedy": greedy(model_dir, ids, tokens),
    }


def table(results: dict) -> str:
    """Markdown: the three workloads' counters, one table each."""

    def rows(block: dict, columns: tuple[str, ...]) -> list[str]:
        def cell(row, c):
            return format_bytes(row[c]) if c == "kv_bytes_live" else str(row[c])

        head = {
            "blocks_held": "blocks held at peak",
            "blocks_shared": "shared",
            "tokens_run": "tokens run",
            "prefix_cache_hits": "prefix-cache hits",
            "prefill_skipped": "prefill tokens skipped",
            "kv_bytes_live": "live KV at peak",
        }
        lines = ["| run | " + " | ".join(head[c] for c in columns) + " |", "|---" * (len(columns) + 1) + "|"]
        lines += [
            f"| {n} | " + " | ".join(cell(r, c) for c in columns) + " |" for n, r in block["rows"].items()
        ]
        return lines

    s, p, g = results["sampled"], results["system_prompt"], results["greedy"]
    return "\n".join(
        [
            f"Sampled clones, prompts of {', '.join(map(str, s['prompt_lengths']))} tokens:",
            "",
            *rows(s, ("blocks_held", "blocks_shared", "tokens_run", "prefix_cache_hits", "kv_bytes_live")),
            "",
            f"A {p['common_prefix_tokens']}-token common prefix, {p['prompt_tokens']} prompt tokens:",
            "",
            *rows(p, ("prefix_cache_hits", "prefill_skipped", "tokens_run", "blocks_held")),
            "",
            "Greedy:",
            "",
            *rows(
                g, ("blocks_held", "blocks_shared", "prefix_cache_hits", "prefill_skipped", "kv_bytes_live")
            ),
        ]
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sharing", description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory (default: the course model)")
    parser.add_argument(
        "--quick", action="store_true", help="tiny random Qwen3, short max_new_tokens (for tests)"
    )
    parser.add_argument("--out", help="JSON file (default: bench/results/sharing.json; none with --quick)")
    args = parser.parse_args(argv)
    if args.quick and not args.model:
        from kvcourse.harness.tiny import make_tiny_checkpoint

        model_dir = make_tiny_checkpoint("qwen3", tempfile.mkdtemp(prefix="kvcourse-sharing-"))
    else:
        model_dir = resolve_model_dir(args.model)
    results = measure(Path(model_dir), args.quick)
    save_results(results, args.out, "sharing.json", args.quick)
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
