"""L4 engine: L3's continuous-batching engine with the gather-then-attend step replaced by a kernel.

Everything else (pool, allocator, scheduler, preemption, chunked prefill) is L3's, unchanged, so
this file only chooses the attention: ``kernel="torch"`` (the PyTorch reference, default) or
``kernel="triton"`` (the Triton kernel; in the interpreter on CPU, slow: use it on small runs), and
``num_splits`` for the split-KV path.

Left out on purpose: anything that is not the attention kernel (see L3), and CUDA graphs or other
launch-overhead tricks a GPU engine would add around the kernel.
"""

from __future__ import annotations

import functools

from L3_block_tensor.engine import Engine as L3Engine

from .attention import attention
from .paged_attention import paged_attention

KERNELS = ("torch", "triton")


def load_kernel(name: str):
    """The kernel function called ``name``; Triton is imported only when asked for."""
    if name == "torch":
        return paged_attention
    if name == "triton":
        from .triton_paged_attention import triton_paged_attention

        return triton_paged_attention
    raise ValueError(f"kernel must be one of {KERNELS}, got {name!r}")


class Engine(L3Engine):
    def __init__(self, model_dir=None, kernel: str = "torch", num_splits: int = 1, **l3_options):
        if num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {num_splits}")
        super().__init__(model_dir, **l3_options)
        self.kernel = kernel
        self.attention = functools.partial(attention, kernel=load_kernel(kernel), num_splits=num_splits)
