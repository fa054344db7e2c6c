"""L2 smoke check: the paged engine's greedy tokens equal L1's and Hugging Face's, prompt by prompt.

    python L2_token_flat/l2_smoke.py [--model DIR] [--prompts FILE.jsonl] [--max-new-tokens N]
        [--device cpu|cuda]

With no --model it runs the course model and a seeded random tiny Qwen3. L2 runs three times: with
block_size 16 (the default), 1 (every token its own block) and 7 (blocks that never line up with the
powers of two the prompts and max_new_tokens tend to be), since odd sizes catch slot-index bugs.
"""

from kvcourse.harness.smoke import SmokeContext, StageRun, run_smoke
from L1_contiguous.engine import Engine as L1Engine
from L2_token_flat.engine import Engine


def runs(ctx: SmokeContext) -> list[StageRun]:
    """The configurations this smoke checks: one per block size."""
    return [
        StageRun(
            f"L2 token-flat, block_size {bs}",
            lambda ctx, bs=bs: Engine(
                ctx.model_dir, device=ctx.device, block_size=bs, max_model_len=ctx.max_model_len
            ),
        )
        for bs in (16, 1, 7)
    ]


def previous(ctx: SmokeContext) -> StageRun:
    """The stage L2 is compared with."""
    return StageRun(
        "L1 contiguous",
        lambda ctx: L1Engine(ctx.model_dir, device=ctx.device, max_model_len=ctx.max_model_len),
    )


if __name__ == "__main__":
    run_smoke("L2", runs, previous)
