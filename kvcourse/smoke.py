"""The smoke harness every ``lN_smoke.py`` uses: run a stage, the stage before it, and HF; compare.

    python LN_x/lN_smoke.py [--model DIR] [--prompts FILE.jsonl] [--max-new-tokens N]

For each model (the given one; by default the course model and a seeded random tiny Qwen3), every
prompt is run through HF greedy ``generate`` (the independent reference, cached), the previous stage,
and each configuration of this stage. One row per prompt and configuration says whether the tokens
match HF and the previous stage, where they first differ, and what the stage wrote. The last line is

    LN smoke: K/K prompts match L(N-1) and HF (T new tokens)

and the exit status is 0 only if every row agrees (a reported numerical tie counts as agreement).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvcourse.compare import Row, compare, format_rows
from kvcourse.model_store import MODEL_ENV, resolve_model_dir
from kvcourse.prompts import budgets, encode, load_tokenizer, read_prompts
from kvcourse.reference import hf_greedy


@dataclass
class StageRun:
    """One way to run a stage: a name for the report and a factory ``make(model_dir) -> engine``.

    ``run(engine, prompt_ids, budgets)`` defaults to ``engine.generate(prompt_ids, budgets)``; a smoke
    can override it (for example to submit requests in a staggered order). For slow interpreted
    kernels, ``first`` runs only the first n prompts and ``cap`` limits every budget; the references
    are then compared up to the cap, which is exact: greedy decoding's first n tokens do not depend on
    the budget.
    """

    name: str
    make: Callable[[Path], object]
    run: Callable[[object, list[list[int]], list[int]], list[list[int]]] | None = None
    cap: int | None = None
    first: int | None = None

    def generate(self, model_dir: Path, prompt_ids: list[list[int]], budget: list[int]):
        prompt_ids, budget = prompt_ids[: self.first], budget[: self.first]
        if self.cap is not None:
            budget = [min(b, self.cap) for b in budget]
        engine = self.make(model_dir)
        t0 = time.perf_counter()
        out = self.run(engine, prompt_ids, budget) if self.run else engine.generate(prompt_ids, budget)
        seconds = time.perf_counter() - t0
        n = sum(map(len, out))
        usage = getattr(engine, "usage", None)
        print(
            f"  {self.name}: {n} new tokens in {seconds:.1f} s ({n / seconds:.1f} tok/s)"
            + (f"; {usage}" if usage else "")
        )
        return engine, out


def parse_args(stage: str, argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"{stage.lower()}_smoke.py", description=f"{stage} smoke check")
    p.add_argument(
        "--model", help=f"local HF Llama/Qwen3 directory (default: ${MODEL_ENV} or the course model)"
    )
    p.add_argument("--prompts", help="JSONL prompt file (default: the course prompt set)")
    p.add_argument(
        "--max-new-tokens", type=int, default=64, help="per-prompt budget unless the file sets one"
    )
    return p.parse_args(argv)


def smoke_main(
    stage: str,
    runs: list[StageRun],
    prev: StageRun | None,
    argv: list[str] | None = None,
    extra: Callable[[Path], tuple[int, int]] | None = None,
) -> int:
    """Run the smoke check; return the exit status.

    ``extra(model_dir) -> (passed, total)`` lets a stage add checks of its own (for example sampled
    clones); they are counted in the summary line.
    """
    args = parse_args(stage, argv)
    prompts = read_prompts(args.prompts)
    chosen = args.model or os.environ.get(MODEL_ENV)
    models: list[tuple[str, Path]] = [("model", resolve_model_dir(chosen))]
    tmp = None
    if not chosen:
        from kvcourse.tiny import make_tiny_checkpoint

        tmp = tempfile.TemporaryDirectory(prefix="kvcourse-tiny-qwen3-")
        models.append(("tiny random Qwen3 (seed 0)", make_tiny_checkpoint("qwen3", tmp.name)))

    passed = total = new_tokens = ties = 0
    try:
        for title, model_dir in models:
            print(f"== {stage} smoke on {title}: {model_dir}")
            tok = load_tokenizer(model_dir)
            ids = [encode(tok, p) for p in prompts]
            budget = budgets(prompts, args.max_new_tokens)
            refs = hf_greedy(model_dir, ids, budget)
            print(f"  HF reference: {sum(len(r.tokens) for r in refs)} new tokens")
            prev_out = prev.generate(model_dir, ids, budget)[1] if prev else None
            for run in runs:
                _, out = run.generate(model_dir, ids, budget)
                rows = []
                for i, (ref, got) in enumerate(zip(refs, out)):
                    expected = ref.tokens[: run.cap]  # a slice with cap None is the whole list
                    rows.append(
                        Row(
                            label=prompts[i].label,
                            vs_hf=compare(expected, got, ref.gaps),
                            vs_prev=compare(prev_out[i][: run.cap], got, ref.gaps) if prev_out else None,
                            text=tok.decode(got),
                            hf_text=tok.decode(expected),
                        )
                    )
                print(f"-- {run.name}")
                print(format_rows(rows, prev.name.split()[0] if prev else None))
                passed += sum(r.ok for r in rows)
                ties += sum(
                    r.ok and (r.vs_hf.tie_gap is not None or bool(r.vs_prev and r.vs_prev.tie_gap))
                    for r in rows
                )
                total += len(rows)
                new_tokens += sum(map(len, out))
            if extra:
                p, t = extra(model_dir)
                passed, total = passed + p, total + t
    finally:
        if tmp:
            tmp.cleanup()
    versus = f"{prev.name.split()[0]} and HF" if prev else "HF"
    tie_note = f"; {ties} numerical tie(s), reported above" if ties else ""
    print(f"{stage} smoke: {passed}/{total} prompts match {versus} ({new_tokens} new tokens{tie_note})")
    return 0 if passed == total else 1


def run_smoke(*args, **kwargs) -> None:
    """``smoke_main`` for a script's ``__main__``: exit with its status."""
    sys.exit(smoke_main(*args, **kwargs))
