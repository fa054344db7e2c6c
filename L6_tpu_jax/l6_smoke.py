"""L6 smoke check: the JAX engine's greedy tokens equal the previous stage's and Hugging Face's.

    python L6_tpu_jax/l6_smoke.py [--model DIR] [--prompts FILE.jsonl] [--max-new-tokens N]
        [--device cpu|cuda]

With no --model it runs the course model and a seeded random tiny Qwen3, against L5 and HF, each run
printing its engine's stats. Checked row by row:

(a) L6 with the JAX reference attention (16 x 16 blocks), every prompt at once, incremental cleanup;
(a') L6 with the Pallas kernel (``pallas_attention.py``) in TPU interpret mode, always on the CPU (a
    Pallas TPU kernel does not run on a GPU): slow, so only the PALLAS_PROMPTS shortest prompts,
    PALLAS_TOKENS tokens each (compared with the first PALLAS_TOKENS tokens of L5 and HF, exact for
    greedy decoding), 2 slots, a model length just holding them.

Each engine prints where and how it runs (``Engine.describe()``: the JAX device, the attention kernel).

Then, counted in the summary line through the smoke's ``extra`` hook:

(b) CLONES greedy clones of each prompt (prefilled once, full pages shared): every clone == HF,
    up to CLONE_TOKENS tokens (the row shows the clone that differs first, if any);
(c) two consecutive ``generate`` calls with logical reset == the same two with physical reset, and
    both == HF, on a pool just big enough for the longest request (``SmokeContext.longest_blocks``):
    a prompt is admitted only while the pool can hold it to its whole max_new_tokens next to what the running
    ones may still grow into, so prompts wait for pages, and decoding must never run dry.

``--device`` (or ``$KVCOURSE_DEVICE``) puts L6 on that JAX device and L5 and HF on that torch device;
without either, all of them run on the CPU.

Not run here: the Pallas kernel compiled for a real TPU (this checks it interpreted, on CPU only).
"""

from __future__ import annotations

import time

import jax

from kvcourse.harness.compare import Row, compare, format_rows
from kvcourse.harness.smoke import SmokeContext, StageRun, run_smoke
from L5_clones.engine import Engine as L5Engine
from L6_tpu_jax.engine import Engine

CLONES = 4
CLONE_TOKENS = 24
PALLAS_PROMPTS, PALLAS_TOKENS = 2, 4


def engine(ctx: SmokeContext, **options) -> Engine:
    """An L6 engine on the smoke's device (the CPU unless ``--device`` names another, as for the torch
    stages), after printing where and how it runs (its ``describe()`` line)."""
    built = Engine(ctx.model_dir, **{"device": ctx.device or "cpu", **options})
    print(f"  {built.describe()}")
    return built


def runs(ctx: SmokeContext) -> list[StageRun]:
    """The configurations compared row by row with L5 and HF."""
    chosen = ctx.shortest(PALLAS_PROMPTS)
    pallas_len = max(len(ctx.ids[i]) + min(ctx.max_new_tokens[i], PALLAS_TOKENS) for i in chosen)
    return [
        StageRun(
            "L6 JAX reference attention 16x16, incremental cleanup",
            lambda ctx: engine(ctx, max_model_len=ctx.max_model_len),
        ),
        StageRun(
            f"L6 Pallas kernel (TPU interpret mode, CPU), {PALLAS_PROMPTS} shortest prompts, {PALLAS_TOKENS} tokens each",
            lambda ctx: engine(
                ctx,
                attention="pallas",
                max_num_seqs=2,
                max_model_len=pallas_len,
                kv_pages_per_block=4,
                device="cpu",  # interpreted: the kernel is a TPU kernel
            ),
            cap=PALLAS_TOKENS,
            only=chosen,
        ),
    ]


def previous(ctx: SmokeContext) -> StageRun:
    """The stage L6 is compared with."""
    return StageRun(
        "L5 clones", lambda ctx: L5Engine(ctx.model_dir, device=ctx.device, max_model_len=ctx.max_model_len)
    )


def greedy_clones(ctx: SmokeContext) -> tuple[int, int]:
    """(b): CLONES greedy clones of each prompt, each compared with HF up to CLONE_TOKENS."""
    capped = [min(b, CLONE_TOKENS) for b in ctx.max_new_tokens]
    l6 = engine(ctx, max_num_seqs=CLONES * len(ctx.ids), max_model_len=ctx.max_model_len)
    samples = l6.generate_samples(ctx.ids, capped, n=CLONES)
    rows = []
    for prompt, ref, clones in zip(ctx.prompts, ctx.refs, samples, strict=True):
        expected = ref.tokens[:CLONE_TOKENS]
        checks = [compare(expected, c, ref) for c in clones]
        worst = min(range(CLONES), key=lambda j: (checks[j].ok, checks[j].first_diff is None))
        text = ctx.tokenizer.decode(clones[worst])
        rows.append(Row(prompt.label, checks[worst], None, text, ctx.tokenizer.decode(expected)))
    print(
        f"-- L6 {CLONES} greedy clones per prompt (prefilled once, full pages shared), first {CLONE_TOKENS} tokens"
    )
    print(f"  {l6.stats()}")
    print(format_rows(rows, None))
    return sum(r.ok for r in rows), len(rows)


def two_calls(ctx: SmokeContext) -> tuple[int, int]:
    """(c): two consecutive calls per reset mode, on a pool that holds the longest request alone;
    logical == physical == HF."""
    half = len(ctx.ids) // 2
    pages = ctx.longest_blocks(16)
    outputs = {}
    for mode in ("logical", "physical"):
        l6 = engine(ctx, reset=mode, num_pages=pages, max_model_len=ctx.max_model_len)
        first = l6.generate(ctx.ids[:half], ctx.max_new_tokens[:half])
        outputs[mode] = first + l6.generate(ctx.ids[half:], ctx.max_new_tokens[half:])
        print(f"  {mode} reset: one more took {1000 * reset_seconds(l6):.1f} ms; {l6.stats()}")
    rows = [
        Row(
            prompt.label,
            compare(ref.tokens, got, ref),
            compare(phys, got, ref),
            ctx.tokenizer.decode(got),
            ctx.tokenizer.decode(ref.tokens),
        )
        for prompt, ref, got, phys in zip(
            ctx.prompts, ctx.refs, outputs["logical"], outputs["physical"], strict=True
        )
    ]
    print(f"-- L6 two generate() calls on {pages} pages, logical reset (compared with physical reset and HF)")
    print(format_rows(rows, "physical"))
    return sum(r.ok for r in rows), len(rows)


def reset_seconds(l6: Engine) -> float:
    """Seconds one more ``reset()`` of ``l6`` takes, until the device has done it (compiled already)."""
    t0 = time.perf_counter()
    l6.reset()
    jax.block_until_ready((l6.state, l6.kv_pages))
    return time.perf_counter() - t0


def extra(ctx: SmokeContext) -> tuple[int, int]:
    """(b) and (c), counted in the summary line."""
    results = [greedy_clones(ctx), two_calls(ctx)]
    return sum(p for p, _ in results), sum(t for _, t in results)


if __name__ == "__main__":
    run_smoke("L6", runs, previous, extra=extra)
