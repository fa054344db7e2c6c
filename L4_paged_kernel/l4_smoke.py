"""L4 smoke check: the paged-kernel engine's greedy tokens equal L3's and Hugging Face's.

    python L4_paged_kernel/l4_smoke.py [--model DIR] [--prompts FILE.jsonl] [--max-new-tokens N]
        [--device cpu|cuda]

With no --model it runs the course model and a seeded random tiny Qwen3. L4 runs five ways:

(a) the PyTorch reference kernel (``paged_attention.py``), every prompt at once, on a small pool sized
    from the prompts (``SmokeContext.tight_pool``: every prompt fits at once, their growth does not),
    so the scheduler preempts and recomputes;
(b) the PyTorch kernel with 4 KV splits (``fast/split_kv.py``) and chunked prefill (chunk 8): the
    split-KV reduce, decode tiles, and causal queries in the middle of a sequence;
(c) the C++ kernel (``fast/paged_attention.cpp``, built by ``make setup``) with chunked prefill (chunk 8);
    skipped, saying why, on a GPU (it is a CPU kernel) or where it could not be built;
(d) the Triton kernel. On a GPU it is compiled and runs every prompt, with 4 KV splits and chunked
    prefill (chunk 8). On the CPU it runs in Triton's interpreter, which executes the kernel with
    NumPy, one program at a time, so this run takes the TRITON_PROMPTS shortest prompts and
    TRITON_TOKENS new tokens each, compared with the first TRITON_TOKENS tokens of L3 and HF (exact
    for greedy decoding);
(e) the decode-graph fast path (``cuda_graphs=True``) with the device's default kernel on the small
    pool of (a): on a GPU every decode step replays a recorded CUDA graph of the compiled Triton kernel;
    on a CPU the same padded, static-buffer steps run eagerly.
"""

from kvcourse.cpp_kernels import build_problem
from kvcourse.devices import resolve_device
from kvcourse.harness.smoke import SmokeContext, StageRun, run_smoke
from L3_block_tensor.engine import Engine as L3Engine
from L4_paged_kernel.engine import Engine
from L4_paged_kernel.fast.cpp_paged_attention import SOURCE as CPP_SOURCE

TRITON_TOKENS = 4
TRITON_PROMPTS = 3


def engine(ctx: SmokeContext, **options) -> Engine:
    """An L4 engine on the smoke's device, with room for the longest request."""
    return Engine(ctx.model_dir, device=ctx.device, max_model_len=ctx.max_model_len, **options)


def triton_run(ctx: SmokeContext) -> StageRun:
    """(d): compiled on a GPU, every prompt; interpreted on the CPU, a few short ones."""
    if resolve_device(ctx.device).type == "cuda":
        return StageRun(
            "L4 triton kernel (compiled), 4 splits, chunked prefill 8",
            lambda ctx: engine(ctx, kernel="triton", num_splits=4, prefill_chunk_size=8),
        )
    return StageRun(
        f"L4 triton kernel (interpreter), {TRITON_PROMPTS} shortest prompts, {TRITON_TOKENS} tokens each",
        lambda ctx: engine(ctx, kernel="triton"),
        cap=TRITON_TOKENS,
        only=ctx.shortest(TRITON_PROMPTS),
    )


def runs(ctx: SmokeContext) -> list[StageRun]:
    """The five configurations this smoke checks."""
    if resolve_device(ctx.device).type == "cpu":
        cpp_skip = build_problem(CPP_SOURCE)  # why it cannot be built here (no C++ compiler), or None
    else:
        cpp_skip = f"the C++ kernel runs on the CPU only, not with --device {ctx.device}"
    small = ctx.tight_pool(16)
    return [
        StageRun(
            f"L4 torch kernel, small pool of {small} blocks",
            lambda ctx: engine(ctx, kernel="torch", num_blocks=small),
        ),
        StageRun(
            "L4 torch kernel, 4 splits, chunked prefill 8",
            lambda ctx: engine(ctx, kernel="torch", num_splits=4, prefill_chunk_size=8),
        ),
        StageRun(
            "L4 C++ kernel, chunked prefill 8",
            lambda ctx: engine(ctx, kernel="cpp", prefill_chunk_size=8),
            skip=cpp_skip,
        ),
        triton_run(ctx),
        StageRun(
            f"L4 decode graphs, default kernel, small pool of {small} blocks",
            lambda ctx: engine(ctx, num_blocks=small, cuda_graphs=True),
        ),
    ]


def previous(ctx: SmokeContext) -> StageRun:
    """The stage L4 is compared with."""
    return StageRun(
        "L3 block-tensor",
        lambda ctx: L3Engine(ctx.model_dir, device=ctx.device, max_model_len=ctx.max_model_len),
    )


if __name__ == "__main__":
    run_smoke("L4", runs, previous)
