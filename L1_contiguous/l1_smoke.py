"""L1 smoke check: the contiguous-cache engine's greedy tokens equal Hugging Face's, prompt by prompt.

    python L1_contiguous/l1_smoke.py [--model DIR] [--prompts FILE.jsonl] [--max-new-tokens N]
        [--device cpu|cuda]

With no --model it runs the course model and a seeded random tiny Qwen3. L1 is the first stage, so
it is compared with HF only.
"""

from kvcourse.harness.smoke import SmokeContext, StageRun, run_smoke
from L1_contiguous.engine import Engine


def runs(ctx: SmokeContext) -> list[StageRun]:
    """The configurations this smoke checks (one: L1 has no options worth varying)."""
    return [
        StageRun(
            "L1 contiguous",
            lambda ctx: Engine(ctx.model_dir, device=ctx.device, max_model_len=ctx.max_model_len),
        )
    ]


if __name__ == "__main__":
    run_smoke("L1", runs)
