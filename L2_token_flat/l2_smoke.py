"""L2 smoke check: the paged engine's greedy tokens equal L1's and Hugging Face's, prompt by prompt.

    python L2_token_flat/l2_smoke.py [--model DIR] [--prompts FILE.jsonl] [--max-new-tokens N]

With no --model it runs the course model and a seeded random tiny Qwen3. L2 runs three times: with
block_size 16 (the default), 1 (every token its own block) and 7 (blocks that never line up with the
powers of two the prompts and budgets tend to be), since odd sizes catch slot-index bugs.
"""

from kvcourse.smoke import StageRun, run_smoke
from L1_contiguous.engine import Engine as L1Engine
from L2_token_flat.engine import Engine


def main_runs() -> list[StageRun]:
    """The configurations this smoke checks: one per block size."""
    return [
        StageRun(f"L2 token-flat, block_size {bs}", lambda model_dir, bs=bs: Engine(model_dir, block_size=bs))
        for bs in (16, 1, 7)
    ]


def previous() -> StageRun:
    """The stage L2 is compared with."""
    return StageRun("L1 contiguous", lambda model_dir: L1Engine(model_dir))


if __name__ == "__main__":
    run_smoke("L2", main_runs(), prev=previous())
