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
    NumPy, one program at a time, at a cost that grows with the square of a prompt's length and with
    the sequences in a decode step. So this run is bounded whatever the prompt file: it takes the
    shortest prompts, at most TRITON_PROMPTS of them and TRITON_PROMPT_TOKENS prompt tokens in all
    (``interpreter_prompts``), TRITON_TOKENS new tokens each, compared with the first TRITON_TOKENS
    tokens of L3 and HF (exact for greedy decoding); its name says how many prompts it covered. Where
    even the shortest prompt is over the bound, the run is skipped, saying so. At the bound, on the
    course model on a 2-core CPU, it takes about a minute;
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

TRITON_TOKENS = 8  # new tokens per prompt in the interpreter
TRITON_PROMPTS = 4  # prompts in the interpreter, at most,
TRITON_PROMPT_TOKENS = 1024  # and prompt tokens in all, at most


def interpreter_prompts(lengths: list[int]) -> list[int]:
    """The prompts (indices, in file order) the interpreted Triton run takes: the shortest first, while
    there are at most TRITON_PROMPTS of them and their lengths add up to at most TRITON_PROMPT_TOKENS.

    Examples: [345, 380, 37] -> [0, 1, 2] (762 tokens); [900, 40, 300, 2000] -> [1, 2] (340 tokens, and
    900 more would pass 1,024); [2000] -> [] (over the bound alone).
    """
    chosen, total = [], 0
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i])[:TRITON_PROMPTS]:
        if total + lengths[i] > TRITON_PROMPT_TOKENS:
            break
        chosen.append(i)
        total += lengths[i]
    return sorted(chosen)


def engine(ctx: SmokeContext, **options) -> Engine:
    """An L4 engine on the smoke's device, with room for the longest request."""
    return Engine(ctx.model_dir, device=ctx.device, max_model_len=ctx.max_model_len, **options)


def triton_run(ctx: SmokeContext) -> StageRun:
    """(d): compiled on a GPU, every prompt; interpreted on the CPU, the prompts within its bound."""
    if resolve_device(ctx.device).type == "cuda":
        return StageRun(
            "L4 triton kernel (compiled), 4 splits, chunked prefill 8",
            lambda ctx: engine(ctx, kernel="triton", num_splits=4, prefill_chunk_size=8),
        )
    lengths = [len(p) for p in ctx.ids]
    chosen = interpreter_prompts(lengths)
    covered = (
        f"{len(chosen)} of {len(lengths)} prompts, the shortest ({sum(lengths[i] for i in chosen):,} prompt "
        f"tokens; bound: {TRITON_PROMPTS} prompts, {TRITON_PROMPT_TOKENS:,} tokens), first {TRITON_TOKENS} "
        "new tokens each"
    )
    over = (
        f"its shortest prompt has {min(lengths):,} tokens, over the interpreter's bound of "
        f"{TRITON_PROMPT_TOKENS:,} (the kernel tests run prompts of up to 2,048 rows; on a GPU this run "
        "takes every prompt)"
    )
    return StageRun(
        f"L4 triton kernel (interpreter), {covered}",
        lambda ctx: engine(ctx, kernel="triton"),
        cap=TRITON_TOKENS,
        only=chosen,
        skip=None if chosen else over,
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
