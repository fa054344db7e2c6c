"""L6 smoke check: the JAX engine's greedy tokens equal the previous stage's and Hugging Face's.

    python L6_tpu_jax/l6_smoke.py [--model DIR] [--prompts FILE.jsonl] [--max-new-tokens N]

With no --model it runs the course model and a seeded random tiny Qwen3, against L5 and HF. Checked:

(a) L6 with the JAX reference attention (16 x 16 blocks), every prompt at once, incremental cleanup;
(a') L6 with the Pallas kernel (``pallas_attention.py``) in TPU interpret mode on CPU: slow, so only the
    first PALLAS_PROMPTS prompts, PALLAS_TOKENS tokens each, 2 slots and a 64-token model length;
(b) (extra) 4 greedy clones of each prompt (prefilled once, full pages shared): every clone == HF,
    up to CLONE_TOKENS tokens;
(c) (extra) two consecutive ``generate`` calls with logical reset == the same two with physical
    reset, and both == HF.

Not run here: the Pallas kernel compiled for a real TPU (this checks it interpreted, on CPU only).
"""

from __future__ import annotations

from pathlib import Path

from kvcourse.compare import Row, compare, format_rows
from kvcourse.prompts import budgets, encode, load_tokenizer, read_prompts
from kvcourse.reference import hf_greedy
from kvcourse.smoke import StageRun, parse_args, run_smoke
from kvcourse.stages import engine_class
from L6_tpu_jax.engine import Engine

CLONES = 4
CLONE_TOKENS = 24
PALLAS_PROMPTS, PALLAS_TOKENS = 2, 4


def main_runs() -> list[StageRun]:
    """The configuration compared row by row with the previous stage and HF."""
    pallas = StageRun(
        f"L6 Pallas kernel (TPU interpret mode), first {PALLAS_PROMPTS} prompts, {PALLAS_TOKENS} tokens",
        lambda d: Engine(d, attention="pallas", max_seqs=2, max_model_len=64, kv_pages_per_block=4),
        cap=PALLAS_TOKENS,
        first=PALLAS_PROMPTS,
    )
    return [StageRun("L6 JAX reference attention 16x16, incremental cleanup", lambda d: Engine(d)), pallas]


def previous() -> StageRun:
    """The stage L6 is compared with."""
    return StageRun("L5 clones", lambda model_dir: engine_class("L5")(model_dir))


def clone_rows(model_dir: Path, tok, ids: list[list[int]], budget: list[int]) -> tuple[int, int]:
    """(b): CLONES greedy clones of each prompt, each compared with HF up to CLONE_TOKENS."""
    refs = hf_greedy(model_dir, ids, budget)
    capped = [min(b, CLONE_TOKENS) for b in budget]
    engine = Engine(model_dir, max_seqs=CLONES * len(ids))
    samples = engine.generate_samples(ids, capped, n=CLONES)
    rows = []
    for ref, clones in zip(refs, samples):
        expected = ref.tokens[:CLONE_TOKENS]
        checks = [compare(expected, c, ref.gaps) for c in clones]
        worst = min(range(CLONES), key=lambda j: (checks[j].ok, -(checks[j].first_diff or 0)))
        rows.append(Row("", checks[worst], None, tok.decode(clones[worst]), tok.decode(expected)))
    print(f"-- L6 {CLONES} greedy clones per prompt, first {CLONE_TOKENS} tokens")
    print(f"  peak pages in use {engine.peak_pages_in_use} of {engine.num_pages}")
    print(format_rows(rows, None))
    return sum(r.ok for r in rows), len(rows)


def reset_rows(model_dir: Path, tok, ids: list[list[int]], budget: list[int]) -> tuple[int, int]:
    """(c): two consecutive calls per reset mode; logical == physical == HF."""
    refs = hf_greedy(model_dir, ids, budget)
    half = len(ids) // 2
    runs = {}
    for mode in ("logical", "physical"):
        engine = Engine(model_dir, reset=mode)
        runs[mode] = engine.generate(ids[:half], budget[:half]) + engine.generate(ids[half:], budget[half:])
        print(f"  {mode} reset: last reset took {1000 * engine.reset_seconds:.1f} ms")
    rows = [
        Row(
            "",
            compare(ref.tokens, got, ref.gaps),
            compare(phys, got, ref.gaps),
            tok.decode(got),
            tok.decode(ref.tokens),
        )
        for ref, got, phys in zip(refs, runs["logical"], runs["physical"])
    ]
    print("-- L6 two generate() calls, logical reset (compared with physical reset and HF)")
    print(format_rows(rows, "physical"))
    return sum(r.ok for r in rows), len(rows)


def extra_checks(argv: list[str] | None = None):
    """The smoke's ``extra`` hook: clones and reset modes on the same prompts."""
    args = parse_args("L6", argv)
    prompts = read_prompts(args.prompts)

    def extra(model_dir: Path) -> tuple[int, int]:
        tok = load_tokenizer(model_dir)
        ids = [encode(tok, p) for p in prompts]
        budget = budgets(prompts, args.max_new_tokens)
        p1, t1 = clone_rows(model_dir, tok, ids, budget)
        p2, t2 = reset_rows(model_dir, tok, ids, budget)
        return p1 + p2, t1 + t2

    return extra


if __name__ == "__main__":
    run_smoke("L6", main_runs(), prev=previous(), extra=extra_checks())
