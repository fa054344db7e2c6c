"""CUDA graphs for decode steps: the fast path beside the engines' readable ``step()`` (L4 and L5, built
with ``cuda_graphs=True``).

On a GPU a decode step of a small model is hundreds of small kernels: per layer two norms, four
projections, RoPE, the K/V write, the attention kernel, the MLP's three products and its activation.
Python launches each one, and for kernels that read a few hundred kilobytes the launches, not the
kernels, can set the pace (on an H100, L4's decode step took about 24 ms eager and 6.8 ms with
graphs: the L4 chapter, section 6, from ``make gpu-run``'s bench (b)). A CUDA graph records the launches of one step once; replaying it is
one call, and the GPU runs the kernels back to back.

A recording fixes every tensor's address and shape, which decides the design (nano-vllm's, in its
model runner's ``capture_cudagraph``, commit bb823b3):

- one graph per batch-size bucket (1, 2, 4, 8, 16, 32, ... up to ``max_num_seqs``): a decode batch of
  27 sequences replays the graph of 32, rows 27-31 padding;
- the step's inputs are copied into static buffers the graphs read: token ids, positions, write slots,
  block tables at their widest (``max_model_len`` / block size), context lengths; the query offsets
  and the logits rows of a decode batch are always ``0, 1, 2, ...``. On a GPU the kernel's metadata
  (block tables, context lengths, query offsets) is kept as int32, the Triton kernel's type, so the
  copy into the buffer is the step's one conversion and the graph holds none (the wrapper's
  ``.to(torch.int32)`` returns its argument); on a CPU it stays int64, the C++ kernel's type;
- a padding row is a sequence of one position that lives in ``padding_block``, a block past the
  allocator's last id that the engine adds to its pool and no sequence ever owns: the row's K/V write
  lands there and its attention reads it, touching nothing real;
- the logits land in a buffer the graph owns; the engine reads its first B rows;
- a graph records the pool's address: when the pool grows (a new tensor), the graphs are recorded
  again at their next use.

Only decode steps go through a graph: a step with prompt tokens has a new shape every time. Which
kernel the graph records is the engine's: on a GPU only the Triton kernel can be recorded (the
PyTorch reference reads lengths back to the host, which a recording forbids).

On a CPU there are no CUDA graphs. There ``DecodeGraphs`` runs the same padded, static-buffer step
eagerly (``record`` keeps the step and ``replay`` calls it), so the tests here check everything but
the recording itself: buckets, padding, the padding block, re-recording after the pool grows, and
the tokens against the readable path and HF.

Left out on purpose: graphs for prefill or mixed steps, one memory pool shared by the graphs of every
bucket (nano-vllm records from the largest bucket down for that), and recording the sampler.
"""

from __future__ import annotations

import dataclasses

import torch


def buckets(max_num_seqs: int) -> list[int]:
    """The batch sizes that get a graph: powers of two below ``max_num_seqs``, then ``max_num_seqs``.

    Examples: ``buckets(32)`` -> ``[1, 2, 4, 8, 16, 32]``; ``buckets(24)`` -> ``[1, 2, 4, 8, 16, 24]``.
    """
    sizes = [1 << i for i in range(max_num_seqs.bit_length()) if 1 << i < max_num_seqs]
    return sizes + [max_num_seqs]


class DecodeGraphs:
    """Static buffers and one recorded step per batch-size bucket, for decode batches of at most
    ``max_num_seqs`` sequences whose block tables are at most ``max_blocks`` wide."""

    def __init__(self, max_num_seqs: int, max_blocks: int, block_size: int, device: torch.device):
        self.sizes = buckets(max_num_seqs)
        self.block_size = block_size
        self.device = device
        n = self.sizes[-1]
        index = torch.int32 if device.type == "cuda" else torch.long  # the kernel's metadata type
        self.token_ids = torch.zeros(n, dtype=torch.long, device=device)  # (n,)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)  # (n,)
        self.slot_mapping = torch.zeros(n, dtype=torch.long, device=device)  # (n,)
        self.block_tables = torch.full((n, max_blocks), -1, dtype=index, device=device)  # (n, max_blocks)
        self.context_lens = torch.ones(n, dtype=index, device=device)  # (n,)
        self.cu_q_lens = torch.arange(n + 1, dtype=index, device=device)  # (n + 1,): query offsets
        self.rows = torch.arange(n, device=device)  # (n,): the logits rows
        self.graphs: dict[int, tuple] = {}  # bucket -> (replay, logits buffer)
        self.recorded_for = None  # the pool tensor the graphs were recorded with
        self.memory_pool = None  # the graphs' shared CUDA allocator pool (GPU only)
        self.num_recorded = self.num_replayed = 0

    def bucket(self, batch_size: int) -> int:
        """The smallest bucket that holds ``batch_size`` rows: with buckets 1, 2, 4, ..., 27 -> 32."""
        return next(size for size in self.sizes if size >= batch_size)

    def run(
        self, forward, token_ids: torch.Tensor, meta, pool: torch.Tensor, padding_block: int
    ) -> torch.Tensor:
        """The logits of one decode step, through the graph of its bucket.

        ``forward(token_ids, meta) -> (rows, vocab)`` is the engine's step (model and attention);
        ``token_ids`` (B,) and ``meta`` (the stage's ``ForwardMeta``) describe a batch of B sequences, one
        new token each. ``pool`` is the tensor the recorded kernels write to (its address decides whether
        the graphs still hold); ``padding_block`` is the block padding rows use. Returns (B, vocab).
        """
        b, width = len(token_ids), meta.block_tables.shape[1]
        size = self.bucket(b)
        if pool is not self.recorded_for:  # a new pool tensor (it grew): record every bucket again
            self.graphs.clear()
            self.recorded_for = pool
        self.token_ids[:b] = token_ids
        self.positions[:b] = meta.positions
        self.slot_mapping[:b] = meta.slot_mapping
        self.block_tables[:b, :width] = meta.block_tables
        self.block_tables[:b, width:] = -1
        self.context_lens[:b] = meta.context_lens
        # padding rows: one token at position 0 of the padding block, which it writes and then reads
        self.token_ids[b:size] = 0
        self.positions[b:size] = 0
        self.slot_mapping[b:size] = padding_block * self.block_size
        self.block_tables[b:size] = -1
        self.block_tables[b:size, 0] = padding_block
        self.context_lens[b:size] = 1
        if size not in self.graphs:
            self.graphs[size] = self.record(forward, meta, size)
        replay, logits = self.graphs[size]
        replay()
        self.num_replayed += 1
        return logits[:b]

    def static_meta(self, meta, size: int):
        """A ``ForwardMeta`` of the stage's class whose tensors are views of the static buffers."""
        return dataclasses.replace(
            meta,
            positions=self.positions[:size],
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            context_lens=self.context_lens[:size],
            cu_q_lens=self.cu_q_lens[: size + 1],
            logits_at=self.rows[:size],
        )

    def record(self, forward, meta, size: int) -> tuple:
        """Record ``forward`` on the static buffers of bucket ``size``: (replay, logits buffer).

        On a GPU: one eager run first (it compiles the Triton kernel and warms the allocator; it computes
        what the replay then computes again, the same values into the same slots), then the recording.
        On a CPU: the step itself, run again by ``replay`` into the same logits buffer.
        """
        token_ids, static = self.token_ids[:size], self.static_meta(meta, size)
        self.num_recorded += 1
        if self.device.type != "cuda":
            logits = forward(token_ids, static).clone()  # (size, vocab): a buffer of its own, as a graph's
            return (lambda: logits.copy_(forward(token_ids, static))), logits
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            forward(token_ids, static)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.memory_pool):
            logits = forward(token_ids, static)  # (size, vocab), in the graph's memory
        self.memory_pool = graph.pool()
        return graph.replay, logits
