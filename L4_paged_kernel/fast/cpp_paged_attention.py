"""Paged attention as a compiled CPU kernel, a fast path of L4: ``paged_attention.cpp``, built on first use.

The same algorithm as the reference ``../paged_attention.py`` and the Triton kernel (online softmax
over each sequence's blocks, read in place), as C++ loops: one work item per (query row, KV head), the
items spread over the cores by ATen's thread pool, the inner loops over ``head_dim`` vectorized by the
compiler. Where the PyTorch reference spends its time launching small tensor operations from Python,
this kernel reads a key row straight from the pool, multiplies it into a few registers and moves on.

The first call compiles the file (about 40 s here; ``kvcourse.cpp_kernels`` keeps the build in
``.cache/kernels/`` per CPU model, and later calls and processes load it at once).

Left out on purpose: split-KV (rows x heads already fill a CPU's cores; the split pays on a GPU with
few long sequences, so ``FastPath`` refuses ``num_splits`` > 1 with this kernel), any dtype but fp32,
and any device but the CPU (the loops read host memory; a GPU has the Triton kernel).
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvcourse.cpp_kernels import load_cpp_kernel

SOURCE = Path(__file__).with_name("paged_attention.cpp")


def cpp_paged_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cu_q_lens: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """``paged_attention``'s arguments and result (q: (T, H, D) -> (T, H, D)), computed in C++."""
    devices = sorted({str(t.device) for t in (q, k_pool, v_pool, block_tables, context_lens, cu_q_lens)})
    if devices != ["cpu"]:
        raise ValueError(f"the C++ kernel runs on the CPU only; its tensors are on {', '.join(devices)}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return load_cpp_kernel(SOURCE).paged_attention(
        q.contiguous(), k_pool, v_pool, block_tables, context_lens, cu_q_lens, scale
    )
