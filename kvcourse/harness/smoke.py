"""The smoke harness every ``lN_smoke.py`` uses: run a stage, the stage before it, and HF; compare.

    python LN_x/lN_smoke.py [--model DIR] [--prompts FILE.jsonl] [--max-new-tokens N] [--device cpu|cuda]

For each model (the ones given, ``--model DIR`` once each; by default the course model and a seeded
random tiny Qwen3), every prompt is run through HF greedy ``generate`` (the independent reference,
cached), the previous stage, and each configuration of this stage. One row per prompt and
configuration says whether the tokens match HF and the previous stage, where they first differ, and
what the stage wrote, after a line saying how the engine was set up (device, kernel, pool and batch
sizes). The last line is

    LN smoke: K/K prompts match L(N-1) and HF (T new tokens)

and the exit status is 0 only if every row agrees (a reported numerical tie counts as agreement), 1 if
a row disagrees, and 2 for bad input (a malformed prompt file, a missing model folder, a prompt longer
than the model's context, max_new_tokens below 1, a device this machine does not have), which is reported as
one ``error: ...`` line.

``--device`` (default ``$KVCOURSE_DEVICE``, else the CPU) runs the stage, the previous stage and HF on
that device; HF's answers are cached per device (``kvcourse.harness.reference``).

A smoke script describes its configurations as functions of a ``SmokeContext``: the prompts, their
max_new_tokens and HF's answers for one model. So configurations that need a tight pool size it from the
prompts they are given (the longest request fits, all of them at once do not), and every engine gets
a ``max_model_len`` that holds the longest request.

Left out on purpose: sampling (no HF reference can check a random draw; L5 compares its sampled
clones with independent requests instead), and timing claims (the tok/s printed are for orientation;
``make bench`` measures).
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
from typing import Any

from kvcourse.config import ModelConfig
from kvcourse.devices import add_device_argument, describe, device_argument, resolve_device
from kvcourse.harness.compare import Row, compare, format_rows
from kvcourse.harness.prompts import Prompt, encode, load_tokenizer, max_new_tokens_of, read_prompts
from kvcourse.harness.reference import Reference, hf_greedy
from kvcourse.limits import DEFAULT_MAX_MODEL_LEN, check_context
from kvcourse.model_store import MODEL_ENV, resolve_model_dir


def blocks_for(num_tokens: int, block_size: int) -> int:
    """ceil(num_tokens / block_size), for sizing pools from prompts: ``blocks_for(17, 16) -> 2``."""
    return -(-num_tokens // block_size)


@dataclass
class SmokeContext:
    """What every configuration of one smoke run shares, for one model."""

    model_dir: Path
    tokenizer: Any
    prompts: list[Prompt]
    ids: list[list[int]]  # token ids of each prompt
    max_new_tokens: list[int]  # max_new_tokens of each prompt
    refs: list[Reference]  # HF greedy's answer for each prompt
    context_limit: int  # the model's max_position_embeddings
    device: str | None = None  # --device: where every engine and HF run (None: the torch stages' CPU)

    @property
    def max_model_len(self) -> int:
        """A length limit that holds every request: the engines' default, or the longest request."""
        longest = max(len(p) + b for p, b in zip(self.ids, self.max_new_tokens, strict=True))
        return max(min(DEFAULT_MAX_MODEL_LEN, self.context_limit), longest)

    def tight_pool(self, block_size: int) -> int:
        """A pool under pressure: the longest request fits alone, and every prompt (with its first new
        token) fits at once, but nothing more. All prompts are admitted in the first step and the
        pool is then full: when a sequence grows into a new block before another one has finished
        and freed its blocks, the scheduler must preempt. That happens whenever two or more
        sequences run past their prompt's last block, which max_new_tokens above ``block_size`` guarantee;
        with max_new_tokens too small to grow any sequence by a block there is nothing to preempt.

        Example, block_size 16, prompts of 365, 32 and 34 tokens with max_new_tokens 12, 8, 5: the longest
        needs 24 blocks; the prompts need 23 + 3 + 3 = 29; the pool gets 29 and the three sequences,
        which grow to 24 + 3 + 3 = 30 blocks, cannot all stay.
        """
        return max(self.longest_blocks(block_size), sum(blocks_for(len(p) + 1, block_size) for p in self.ids))

    def longest_blocks(self, block_size: int) -> int:
        """Blocks the longest request needs to finish: the smallest pool that can run every prompt.

        Example, block_size 16, prompts of 365, 32 and 34 tokens with max_new_tokens 12, 8, 5 -> 24.
        """
        return max(
            blocks_for(len(p) + b, block_size) for p, b in zip(self.ids, self.max_new_tokens, strict=True)
        )

    def shortest(self, n: int) -> list[int]:
        """Indices of the n shortest prompts, in file order (for slow interpreted kernels)."""
        return sorted(sorted(range(len(self.ids)), key=lambda i: len(self.ids[i]))[:n])


@dataclass
class StageRun:
    """One way to run a stage: a name for the report and a factory ``make(ctx) -> engine``.

    ``run(engine, prompt_ids, max_new_tokens)`` defaults to ``engine.generate(prompt_ids, max_new_tokens)``; a smoke
    can override it (for example to submit requests in a staggered order). For slow interpreted
    kernels, ``only`` picks which prompts run (indices) and ``cap`` caps every max_new_tokens; the
    references are then compared up to the cap, which is exact: greedy decoding's first n tokens do
    not depend on max_new_tokens. ``skip``, when set, is why this configuration cannot run on this machine
    (the C++ kernel without a compiler): the run is reported as skipped, with the reason, and not counted.
    """

    name: str
    make: Callable[[SmokeContext], Any]
    run: Callable[[Any, list[list[int]], list[int]], list[list[int]]] | None = None
    cap: int | None = None
    only: list[int] | None = None
    skip: str | None = None

    def generate(self, ctx: SmokeContext) -> tuple[list[int], list[list[int]] | None]:
        """Run this configuration; return (the prompt indices it ran, its outputs or None if the
        engine returned a different number of outputs than prompts)."""
        chosen = list(range(len(ctx.ids))) if self.only is None else self.only
        ids = [ctx.ids[i] for i in chosen]
        max_new = [min(ctx.max_new_tokens[i], self.cap or ctx.max_new_tokens[i]) for i in chosen]
        engine = self.make(ctx)
        t0 = time.perf_counter()
        out = self.run(engine, ids, max_new) if self.run else engine.generate(ids, max_new)
        seconds = time.perf_counter() - t0
        n = sum(map(len, out))
        stats = engine.stats()
        print(f"  {self.name}: {n} new tokens in {seconds:.1f} s ({n / seconds:.1f} tok/s)")
        print(f"  {stats.describe()}")
        print(f"  {stats}")
        if len(out) != len(ids):
            print(f"  !! {len(out)} outputs for {len(ids)} prompts")
            return chosen, None
        return chosen, out


def parse_args(stage: str, argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"{stage.lower()}_smoke.py", description=f"{stage} smoke check")
    p.add_argument(
        "--model",
        action="append",
        help=f"local HF Llama/Qwen3 directory, repeatable (default: ${MODEL_ENV} or the course model)",
    )
    p.add_argument("--prompts", help="JSONL prompt file (default: the course prompt set)")
    p.add_argument(
        "--max-new-tokens", type=int, default=64, help="per-prompt max_new_tokens unless the file sets one"
    )
    add_device_argument(p)
    return p.parse_args(argv)


def prepare(
    model_dir: Path, prompts: list[Prompt], default_max_new: int, device: str | None = None
) -> SmokeContext:
    """Tokenize and check every prompt for one model, then fetch HF's answers on ``device`` (cached).

    Raises ValueError naming the prompt, the value and the limit for a request the model cannot run.
    """
    cfg = ModelConfig.from_dir(model_dir)
    tok = load_tokenizer(model_dir)
    ids = [encode(tok, p) for p in prompts]
    max_new = max_new_tokens_of(prompts, default_max_new)
    check_context(ids, max_new, cfg)
    refs = hf_greedy(model_dir, ids, max_new, device)
    return SmokeContext(model_dir, tok, prompts, ids, max_new, refs, cfg.max_position_embeddings, device)


def compare_run(ctx: SmokeContext, run: StageRun, prev: dict[int, list[int]] | None, prev_name: str | None):
    """Run one configuration and print its rows; return (passed, total, ties, new tokens)."""
    chosen, out = run.generate(ctx)
    print(f"-- {run.name}")
    if out is None:
        return 0, len(chosen), 0, 0
    rows = []
    for i, got in zip(chosen, out, strict=True):
        ref = ctx.refs[i]
        expected = ref.tokens[: run.cap]  # a slice with cap None is the whole list
        rows.append(
            Row(
                label=ctx.prompts[i].label,
                vs_hf=compare(expected, got, ref),
                vs_prev=compare(prev[i][: run.cap], got, ref) if prev is not None else None,
                text=ctx.tokenizer.decode(got),
                hf_text=ctx.tokenizer.decode(expected),
            )
        )
    print(format_rows(rows, prev_name))
    return sum(r.ok for r in rows), len(rows), sum(r.tie for r in rows), sum(map(len, out))


def prepare_models(
    model: str | list[str] | None,
    prompts_file: str | None,
    max_new_tokens: int,
    tiny_dir: str | Path,
    device: str | None = None,
) -> list[tuple[str, SmokeContext]]:
    """(title, context) for each model a smoke runs: ``model`` (one folder or a list of them), else
    ``$KVCOURSE_MODEL_DIR``, else the course model plus a seeded random tiny Qwen3 written into
    ``tiny_dir`` (the caller deletes it).

    Raises ValueError or OSError, naming the value and the limit, for bad input: max_new_tokens below 1, a
    device this machine lacks, a malformed or missing prompt file, a missing model folder, a request
    over the context limit.
    """
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    device = device_argument(device)
    prompts = read_prompts(prompts_file)
    chosen = model or os.environ.get(MODEL_ENV)
    folders = chosen if isinstance(chosen, list) else [chosen]
    models: list[tuple[str, Path]] = [("model", resolve_model_dir(folder)) for folder in folders]
    if not chosen:
        from kvcourse.harness.tiny import make_tiny_checkpoint

        models.append(("tiny random Qwen3 (seed 0)", make_tiny_checkpoint("qwen3", tiny_dir)))
    return [(title, prepare(model_dir, prompts, max_new_tokens, device)) for title, model_dir in models]


def smoke_main(
    stage: str,
    runs: Callable[[SmokeContext], list[StageRun]],
    previous: Callable[[SmokeContext], StageRun] | None = None,
    argv: list[str] | None = None,
    extra: Callable[[SmokeContext], tuple[int, int]] | None = None,
) -> int:
    """Run the smoke check; return the exit status (0 all agree, 1 a disagreement, 2 bad input).

    ``runs(ctx)`` lists this stage's configurations and ``previous(ctx)`` the previous stage's
    engine; ``extra(ctx) -> (passed, total)`` or ``(passed, total, ties)`` lets a stage add checks of
    its own (for example sampled clones, beam search), printed by itself and counted in the summary
    line, its numerical ties with the others.
    """
    args = parse_args(stage, argv)
    with tempfile.TemporaryDirectory(prefix="kvcourse-tiny-qwen3-") as tiny_dir:
        try:
            contexts = prepare_models(args.model, args.prompts, args.max_new_tokens, tiny_dir, args.device)
        except (ValueError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return run_contexts(stage, contexts, runs, previous, extra)


def run_contexts(
    stage: str,
    contexts: list[tuple[str, SmokeContext]],
    runs: Callable[[SmokeContext], list[StageRun]],
    previous: Callable[[SmokeContext], StageRun] | None,
    extra: Callable[[SmokeContext], tuple[int, int]] | None,
) -> int:
    """Every configuration on every model, then the summary line; the exit status (0 or 1)."""
    passed = total = new_tokens = ties = skipped = 0
    prev_name = previous(contexts[0][1]).name.split()[0] if previous else None
    for title, ctx in contexts:
        print(f"== {stage} smoke on {title}: {ctx.model_dir} ({describe(resolve_device(ctx.device))})")
        print(f"  HF reference: {sum(len(r.tokens) for r in ctx.refs)} new tokens")
        prev = None
        if previous:
            chosen, prev_out = previous(ctx).generate(ctx)
            prev = dict(zip(chosen, prev_out or [[]] * len(chosen), strict=True))
        for run in runs(ctx):
            if run.skip:
                print(f"-- {run.name}: SKIPPED, {run.skip}")
                skipped += 1
                continue
            p, t, tie, n = compare_run(ctx, run, prev, prev_name)
            passed, total, ties, new_tokens = passed + p, total + t, ties + tie, new_tokens + n
        if extra:
            p, t, *tie = extra(ctx)
            passed, total, ties = passed + p, total + t, ties + sum(tie)
    versus = f"{prev_name} and HF" if previous else "HF"
    tie_note = f"; {ties} numerical tie(s), reported above" if ties else ""
    tie_note += f"; {skipped} run(s) skipped on this machine, said above" if skipped else ""
    print(f"{stage} smoke: {passed}/{total} prompts match {versus} ({new_tokens} new tokens{tie_note})")
    return 0 if passed == total else 1


def run_smoke(*args, **kwargs) -> None:
    """``smoke_main`` for a script's ``__main__``: exit with its status."""
    sys.exit(smoke_main(*args, **kwargs))
