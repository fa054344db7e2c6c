"""L3 smoke check: the batching engine's greedy tokens equal L2's and Hugging Face's, prompt by prompt.

    python L3_block_tensor/l3_smoke.py [--model DIR] [--prompts FILE.jsonl] [--max-new-tokens N]

With no --model it runs the course model and a seeded random tiny Qwen3. L3 runs four ways, each
printing its scheduler counters (steps, preemptions):

(a) every prompt submitted at once;
(b) staggered arrivals: a new request every 2 steps, joining a batch that is mid-generation;
(c) a pool of 16 blocks (256 tokens): the longest default request fits, all of them at once do not,
    so the scheduler preempts (a prompt file with a request over 256 tokens is refused by name);
(d) chunked prefill, 8 tokens per chunk, interleaved with the decode tokens of the others.
"""

from kvcourse.smoke import StageRun, run_smoke
from kvcourse.workloads import all_at_once, staggered
from L2_token_flat.engine import Engine as L2Engine
from L3_block_tensor.engine import Engine

SMALL_POOL_BLOCKS = 16


def with_counters(workload):
    """Wrap a workload so that it prints the engine's scheduler counters after running."""

    def run(engine, prompts, budgets):
        out = workload(engine, prompts, budgets)
        print(f"  scheduler: {engine.num_steps} steps, {engine.num_preemptions} preemptions")
        return out

    return run


def main_runs() -> list[StageRun]:
    """The four configurations this smoke checks."""
    return [
        StageRun("L3 all at once", lambda d: Engine(d), with_counters(all_at_once)),
        StageRun(
            "L3 staggered, one new request every 2 steps", lambda d: Engine(d), with_counters(staggered)
        ),
        StageRun(
            f"L3 small pool of {SMALL_POOL_BLOCKS} blocks",
            lambda d: Engine(d, num_blocks=SMALL_POOL_BLOCKS),
            with_counters(all_at_once),
        ),
        StageRun(
            "L3 chunked prefill, chunk 8",
            lambda d: Engine(d, prefill_chunk_size=8),
            with_counters(all_at_once),
        ),
    ]


def previous() -> StageRun:
    """The stage L3 is compared with."""
    return StageRun("L2 token-flat", lambda model_dir: L2Engine(model_dir))


if __name__ == "__main__":
    run_smoke("L3", main_runs(), prev=previous())
