"""L4's fast paths, kept apart from the lesson: faster kernels and decode graphs, behind ``FastPath``.

The lesson's engine runs the readable path: ``attention.py`` hands each layer's attention to the
reference kernel, ``paged_attention.py``. Everything here computes the same tokens faster, and the
engine meets it through one object, ``FastPath``: its ``kernel`` is the kernel attention calls, its
``run`` runs a step (the engine's forward, or a decode graph), its ``padding_blocks`` the blocks the
graphs add to the pool and its ``name`` what ``stats().kernel`` says.

    kernel="torch"     the reference kernel (``../paged_attention.py``); with num_splits > 1 its
                       split-KV extension, decode rows batched in tiles (``split_kv.py``)
    kernel="cpp"       the same algorithm compiled for this CPU (``cpp_paged_attention.py`` and
                       ``paged_attention.cpp``): built on first use, refused with the reason where no
                       compiler can build it, and on a GPU; no split-KV path
    kernel="triton"    the same algorithm as a Triton program (``triton_paged_attention.py``), query
                       tiles in its grid: compiled for a GPU's tensors, run in Triton's interpreter
                       for a CPU's (slowly: small runs)
    kernel="auto"      the fastest this device has (``choose_kernel``): the engines' default
    num_splits="auto"  the engines' default: on a GPU the Triton kernel's ``choose_splits`` (about one
                       wave of programs, chosen per call from shapes), elsewhere one split
    cuda_graphs=True   each decode step replays a CUDA graph recorded once per batch-size bucket
                       (``kvcourse.decode_graphs``), padded to its bucket; prompt steps keep the
                       readable path. On a GPU it needs the Triton kernel; on a CPU it runs the same
                       padded steps eagerly, which is how the tests check it
    cuda_graphs=None   the engines' default: decode graphs where they pay, a GPU running the Triton
                       kernel (a step there is launch-bound without them); off on a CPU

Left out on purpose: choosing a kernel per batch shape (a GPU engine picks a decode or a prefill
kernel), graphs for prompt steps, and a persistent kernel.
"""

from __future__ import annotations

import functools

import torch

from kvcourse.cpp_kernels import build_problem, load_cpp_kernel
from kvcourse.decode_graphs import DecodeGraphs

from ..paged_attention import paged_attention
from .cpp_paged_attention import SOURCE as CPP_SOURCE
from .split_kv import split_kv_attention

KERNELS = ("auto", "torch", "cpp", "triton")


def choose_kernel(device: torch.device, num_splits: int | str = 1) -> str:
    """What ``kernel="auto"`` runs: the Triton kernel on a GPU (the PyTorch reference where Triton is not
    installed); on a CPU the C++ kernel where it builds and no split is asked for (1 or ``"auto"``),
    else the reference.

    Example: ``choose_kernel(torch.device("cpu"))`` -> ``"cpp"`` after ``make setup`` built it.
    """
    if device.type == "cuda":
        try:
            import triton  # noqa: F401  (installed with the course on Linux; optional elsewhere)
        except ImportError:
            return "torch"
        return "triton"
    return "cpp" if num_splits in (1, "auto") and build_problem(CPP_SOURCE) is None else "torch"


def load_kernel(name: str, device: torch.device, num_splits: int | str = 1):
    """The kernel called ``name`` for tensors on ``device``, taking the reference's arguments (q, k_pool,
    v_pool, block_tables, context_lens, cu_q_lens), with ``num_splits`` bound in (``"auto"``: the
    Triton kernel's only, chosen per call). The C++ and Triton kernels are loaded only when asked for.

    Example: ``load_kernel("torch", cpu)`` -> ``paged_attention``; ``load_kernel("torch", cpu, 2)`` ->
    ``split_kv_attention`` with ``num_splits=2``.
    """
    if name == "torch":
        return (
            paged_attention
            if num_splits == 1
            else functools.partial(split_kv_attention, num_splits=num_splits)
        )
    if name == "cpp":
        if device.type != "cpu":
            raise ValueError(
                f"kernel='cpp' runs on the CPU only, not on {device}: use kernel='triton' or 'torch' there"
            )
        if num_splits != 1:
            raise ValueError(f"the C++ kernel has no split-KV path: num_splits must be 1, got {num_splits}")
        from .cpp_paged_attention import cpp_paged_attention

        load_cpp_kernel(CPP_SOURCE)  # builds it now if need be, or raises CppKernelUnavailable saying why
        return cpp_paged_attention
    if name == "triton":
        from .triton_paged_attention import triton_paged_attention

        return functools.partial(triton_paged_attention, num_splits=num_splits)
    raise ValueError(f"kernel must be one of {KERNELS}, got {name!r}")


class FastPath:
    """The engine's seam to the fast paths: the kernel its attention calls, and how a step runs.

    ``max_num_seqs``, ``max_model_len`` and ``block_size`` size the decode graphs' buffers. Example:
    ``FastPath(torch.device("cpu"), "torch", 2, False, 32, 2048, 16)`` has ``name`` ``"torch, 2 splits"``,
    ``kernel`` ``split_kv_attention`` with 2 splits, ``padding_blocks`` 0, and its ``run`` calls the
    engine's forward; with ``cuda_graphs=True`` its name ends ``", decode graphs"`` and it pads the pool
    with 1 block. ``cuda_graphs=None`` turns them on for the Triton kernel on a GPU only.
    """

    def __init__(
        self,
        device: torch.device,
        kernel: str,
        num_splits: int | str,
        cuda_graphs: bool | None,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
    ):
        if num_splits != "auto" and (not isinstance(num_splits, int) or num_splits < 1):
            raise ValueError(f"num_splits must be >= 1, got {num_splits!r} (or 'auto')")
        name = choose_kernel(device, num_splits) if kernel == "auto" else kernel
        if num_splits == "auto" and (name != "triton" or device.type == "cpu"):  # one split there
            num_splits = 1
        self.kernel = load_kernel(name, device, num_splits)
        if cuda_graphs is None:  # the default: on where a step would be launch-bound without them
            cuda_graphs = device.type == "cuda" and name == "triton"
        if cuda_graphs and device.type == "cuda" and name != "triton":
            raise ValueError(
                f"cuda_graphs=True needs kernel='triton' on a GPU (a graph cannot record the {name} "
                "kernel's reads back to the host)"
            )
        splits = f", {num_splits} splits" if num_splits != 1 else ""
        self.name = name + splits + (", decode graphs" if cuda_graphs else "")  # what stats().kernel says
        self.padding_blocks = int(cuda_graphs)  # the graphs' padding block: past the allocator's last id
        self.graphs = None
        if cuda_graphs:
            max_blocks = -(-max_model_len // block_size)  # the widest block table
            self.graphs = DecodeGraphs(max_num_seqs, max_blocks, block_size, device)

    def run(self, forward, token_ids: torch.Tensor, meta, pool) -> torch.Tensor:
        """A step's (N, vocab) logits: ``forward(token_ids, meta)``, the readable path, or, with decode
        graphs on and one new token per sequence, the graph of its batch-size bucket, replayed on
        ``pool``. Padding rows use the pool's last block, which the engine keeps past the allocator's
        ids (``padding_blocks``), also after the pool grows.
        """
        if self.graphs is None or not len(meta.logits_at) == len(token_ids) == len(meta.context_lens):
            return forward(token_ids, meta)
        return self.graphs.run(forward, token_ids, meta, pool.k, padding_block=pool.k.shape[1] - 1)
