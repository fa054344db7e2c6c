"""L4 smoke check: the paged-kernel engine's greedy tokens equal L3's and Hugging Face's.

    python L4_paged_kernel/l4_smoke.py [--model DIR] [--prompts FILE.jsonl] [--max-new-tokens N]

With no --model it runs the course model and a seeded random tiny Qwen3. L4 runs three ways:

(a) the PyTorch kernel, every prompt at once;
(b) the PyTorch kernel with 4 KV splits and chunked prefill (chunk 8): the split-KV reduce and
    causal queries in the middle of a sequence;
(c) the Triton kernel, in Triton's interpreter on CPU (no GPU here). The interpreter runs the kernel
    with NumPy, one program at a time (all ten prompts, 8 tokens each, took ~9 minutes here), so this
    run takes the first 3 prompts and 4 new tokens each, compared with the first 4 tokens of L3 and
    HF (exact for greedy decoding).
"""

from kvcourse.smoke import StageRun, run_smoke
from L3_block_tensor.engine import Engine as L3Engine
from L4_paged_kernel.engine import Engine

TRITON_TOKENS = 4
TRITON_PROMPTS = 3


def main_runs() -> list[StageRun]:
    """The three configurations this smoke checks."""
    return [
        StageRun("L4 torch kernel", lambda d: Engine(d)),
        StageRun(
            "L4 torch kernel, 4 splits, chunked prefill 8",
            lambda d: Engine(d, num_splits=4, prefill_chunk_size=8),
        ),
        StageRun(
            f"L4 triton kernel (interpreter), first {TRITON_PROMPTS} prompts, {TRITON_TOKENS} tokens each",
            lambda d: Engine(d, kernel="triton"),
            cap=TRITON_TOKENS,
            first=TRITON_PROMPTS,
        ),
    ]


def previous() -> StageRun:
    """The stage L4 is compared with."""
    return StageRun("L3 block-tensor", lambda model_dir: L3Engine(model_dir))


if __name__ == "__main__":
    run_smoke("L4", main_runs(), prev=previous())
