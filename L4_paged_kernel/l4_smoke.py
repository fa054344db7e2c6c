"""L4 smoke check: the paged-kernel engine's greedy tokens equal L3's and Hugging Face's.

    python L4_paged_kernel/l4_smoke.py [--model DIR] [--prompts FILE.jsonl] [--max-new-tokens N]

With no --model it runs the course model and a seeded random tiny Qwen3. L4 runs four ways:

(a) the PyTorch kernel, every prompt at once, on a small pool sized from the prompts
    (``SmokeContext.tight_pool``: every prompt fits at once, their growth does not), so the
    scheduler preempts and recomputes;
(b) the PyTorch kernel with 4 KV splits and chunked prefill (chunk 8): the split-KV reduce and
    causal queries in the middle of a sequence;
(c) the C++ kernel (``paged_attention.cpp``, built by ``make setup``) with chunked prefill (chunk 8);
    skipped, saying why, on a machine where it could not be built;
(d) the Triton kernel, in Triton's interpreter on a machine without a GPU (the course switches the
    interpreter on by itself). The interpreter runs the kernel with NumPy, one program at a time,
    so this run takes the TRITON_PROMPTS shortest prompts and TRITON_TOKENS new tokens each,
    compared with the first TRITON_TOKENS tokens of L3 and HF (exact for greedy decoding).
"""

from kvcourse.cpp_kernels import build_problem
from kvcourse.smoke import SmokeContext, StageRun, run_smoke
from L3_block_tensor.engine import Engine as L3Engine
from L4_paged_kernel.cpp_paged_attention import SOURCE as CPP_SOURCE
from L4_paged_kernel.engine import Engine

TRITON_TOKENS = 4
TRITON_PROMPTS = 3


def runs(ctx: SmokeContext) -> list[StageRun]:
    """The four configurations this smoke checks."""
    small = ctx.tight_pool(16)
    return [
        StageRun(
            f"L4 torch kernel, small pool of {small} blocks",
            lambda ctx: Engine(ctx.model_dir, num_blocks=small, max_model_len=ctx.max_model_len),
        ),
        StageRun(
            "L4 torch kernel, 4 splits, chunked prefill 8",
            lambda ctx: Engine(
                ctx.model_dir, num_splits=4, prefill_chunk_size=8, max_model_len=ctx.max_model_len
            ),
        ),
        StageRun(
            "L4 C++ kernel, chunked prefill 8",
            lambda ctx: Engine(
                ctx.model_dir, kernel="cpp", prefill_chunk_size=8, max_model_len=ctx.max_model_len
            ),
            skip=build_problem(CPP_SOURCE),  # why it cannot run here (no C++ compiler), or None
        ),
        StageRun(
            f"L4 triton kernel (interpreter), {TRITON_PROMPTS} shortest prompts, {TRITON_TOKENS} tokens each",
            lambda ctx: Engine(ctx.model_dir, kernel="triton", max_model_len=ctx.max_model_len),
            cap=TRITON_TOKENS,
            only=ctx.shortest(TRITON_PROMPTS),
        ),
    ]


def previous(ctx: SmokeContext) -> StageRun:
    """The stage L4 is compared with."""
    return StageRun("L3 block-tensor", lambda ctx: L3Engine(ctx.model_dir, max_model_len=ctx.max_model_len))


if __name__ == "__main__":
    run_smoke("L4", runs, previous)
