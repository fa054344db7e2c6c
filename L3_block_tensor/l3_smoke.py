"""L3 smoke check: the batching engine's greedy tokens equal L2's and Hugging Face's, prompt by prompt.

    python L3_block_tensor/l3_smoke.py [--model DIR] [--prompts FILE.jsonl] [--max-new-tokens N]
        [--device cpu|cuda]

With no --model it runs the course model and a seeded random tiny Qwen3. L3 runs four ways, each
printing its engine's stats (steps, preemptions, blocks held):

(a) every prompt submitted at once;
(b) staggered arrivals: a new request every 2 steps, joining a batch that is mid-generation;
(c) a small pool, sized from the prompts (``SmokeContext.tight_pool``): the longest request fits
    alone and every prompt fits at once, but not their growth, so the scheduler preempts;
(d) chunked prefill, 8 tokens per chunk, interleaved with the decode tokens of the others.
"""

from kvcourse.harness.smoke import SmokeContext, StageRun, run_smoke
from kvcourse.harness.workloads import staggered
from L2_token_flat.engine import Engine as L2Engine
from L3_block_tensor.engine import Engine


def runs(ctx: SmokeContext) -> list[StageRun]:
    """The four configurations this smoke checks."""
    small = ctx.tight_pool(16)
    return [
        StageRun(
            "L3 all at once",
            lambda ctx: Engine(ctx.model_dir, device=ctx.device, max_model_len=ctx.max_model_len),
        ),
        StageRun(
            "L3 staggered, one new request every 2 steps",
            lambda ctx: Engine(ctx.model_dir, device=ctx.device, max_model_len=ctx.max_model_len),
            staggered,
        ),
        StageRun(
            f"L3 small pool of {small} blocks (every prompt fits, their growth does not)",
            lambda ctx: Engine(
                ctx.model_dir, device=ctx.device, num_blocks=small, max_model_len=ctx.max_model_len
            ),
        ),
        StageRun(
            "L3 chunked prefill, chunk 8",
            lambda ctx: Engine(
                ctx.model_dir, device=ctx.device, prefill_chunk_size=8, max_model_len=ctx.max_model_len
            ),
        ),
    ]


def previous(ctx: SmokeContext) -> StageRun:
    """The stage L3 is compared with."""
    return StageRun(
        "L2 token-flat",
        lambda ctx: L2Engine(ctx.model_dir, device=ctx.device, max_model_len=ctx.max_model_len),
    )


if __name__ == "__main__":
    run_smoke("L3", runs, previous)
