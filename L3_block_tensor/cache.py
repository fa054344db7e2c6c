"""L3's KV storage: a block-tensor pool per layer, block tables, and requests with a life cycle.

Shape per layer: (num_blocks, block_size, H_kv, D), the same bytes as L2's (num_slots, H_kv, D) with
the block axis made explicit, so that a request's block table indexes the pool directly. A request
keeps only its block table; the slot of its position t is computed when needed:

    slot = block_table[t // block_size] * block_size + t % block_size

(block t // block_size, row t % block_size). With block_size 4 and block table [2, 0], positions
0..5 live in slots 8, 9, 10, 11, 0, 1, exactly as in L2.

- ``KvPool``: the tensors; writes go through a flat (num_blocks * block_size, H_kv, D) view;
- ``BlockAllocator``: L2's free list, unchanged;
- ``Request``: now with a status (waiting / running / finished), a finish reason, a priority, its
  submission order and ``num_computed_tokens``, which grows by a chunk at a time during a chunked
  prefill and drops back to 0 when the request is preempted;
- ``ForwardMeta``: describes ONE flat batch holding the new tokens of several requests;
- ``reserve()`` and ``slots()``: grow a block table; turn it into slots.

Left out on purpose (and the stage that adds it):
- attention still gathers each request's blocks into a contiguous copy (L4 reads them in place);
- blocks are never shared between requests (L5 adds refcounts and a prefix cache).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

# L2's free list, unchanged: the allocator does not care how the pool is shaped.
from L2_token_flat.cache import BlockAllocator, OutOfBlocks, blocks_needed  # noqa: F401 (re-exported)


class KvPool:
    """Per-layer K and V blocks, each (num_layers, num_blocks, block_size, H_kv, D), fp32, zero-initialised.

    It knows nothing about which blocks belong to whom: the allocator and the requests keep those books.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int):
        self.block_size = block_size
        self.k = torch.zeros(num_layers, num_blocks, block_size, num_kv_heads, head_dim)  # (L, N, B, H_kv, D)
        self.v = torch.zeros_like(self.k)  # (L, N, B, H_kv, D)

    def set_kv(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the K/V of T new tokens: token i goes to slot ``slot_mapping[i]`` of ``layer``.

        slot_mapping: (T,) int64; k, v: (T, H_kv, D). Slot s is row s % block_size of block
        s // block_size: with block_size 4, slot 9 is row 1 of block 2.
        """
        self.k[layer].view(-1, *k.shape[1:])[slot_mapping] = k  # into a (N * B, H_kv, D) view, no copy
        self.v[layer].view(-1, *v.shape[1:])[slot_mapping] = v

    @property
    def nbytes(self) -> int:
        """Bytes reserved, whether or not they hold tokens."""
        return self.k.nbytes + self.v.nbytes


class Status(Enum):
    WAITING = "waiting"  # submitted or preempted; holds no blocks
    RUNNING = "running"  # admitted; holds the blocks of its computed positions
    FINISHED = "finished"  # done; its blocks are back on the free list


class FinishReason(Enum):
    EOS = "eos"  # generated an end-of-sequence token (kept in the output)
    MAX_TOKENS = "max_tokens"  # generated max_new_tokens tokens
    ABORTED = "aborted"  # cancelled by the caller


@dataclass
class Request:
    """One request through its life: waiting -> running (-> waiting again if preempted) -> finished."""

    request_id: int  # unique, handed out in submission order: the FIFO tie-break
    prompt_ids: list[int]
    max_new_tokens: int
    ignore_eos: bool = False
    priority: int = 0  # higher runs first
    block_table: list[int] = field(default_factory=list)  # owned block ids, in position order
    num_computed_tokens: int = 0  # positions 0 .. num_computed_tokens - 1 have their K/V in the pool
    output_ids: list[int] = field(default_factory=list)  # generated tokens; the newest is not cached yet
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None

    @property
    def all_ids(self) -> list[int]:
        """Prompt then generated tokens: everything a recompute after preemption has to run again."""
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def sort_key(self) -> tuple[int, int]:
        """Scheduling order: higher priority first, then first come, first served."""
        return (-self.priority, self.request_id)


@dataclass
class ForwardMeta:
    """Where one forward call over a flat batch writes and reads K/V.

    The batch holds the new tokens of B requests back to back: request i owns rows cu_q_lens[i] ..
    cu_q_lens[i + 1] - 1, which are the last of its context_lens[i] positions. Example: the first
    3-token chunk of a new prompt and one decode token of a request with 20 cached positions:
    positions [0, 1, 2, 20], cu_q_lens [0, 3, 4], context_lens [3, 21], logits_at [3] (the chunk
    does not end its prompt, so it needs no logits).
    """

    positions: torch.Tensor  # (T,) int64: position of each new token within its request
    slot_mapping: torch.Tensor  # (T,) int64: slot each new token's K/V is WRITTEN to
    block_tables: torch.Tensor  # (B, max_blocks) int64: each request's blocks, padded with -1
    context_lens: torch.Tensor  # (B,) int64: positions each request attends over, new ones included
    cu_q_lens: torch.Tensor  # (B + 1,) int64: offsets of each request's rows in the batch
    logits_at: torch.Tensor  # (N,) int64: rows whose next token is wanted (a request's last known token)


def reserve(req: Request, alloc: BlockAllocator, target_len: int) -> None:
    """Grow ``req.block_table`` until positions 0 .. target_len - 1 have blocks.

    A block is allocated only when a position falls past the last one. With block_size 4, a request
    ``a`` holding blocks [0], another holding [1], and the free list 2, 3, ...:

        reserve(a, alloc, 4) -> a.block_table [0]      (4 positions fit in one block; nothing allocated)
        reserve(a, alloc, 6) -> a.block_table [0, 2]

    If the free list is too short, ``OutOfBlocks`` is raised and ``req`` is left as it was.
    """
    missing = blocks_needed(target_len, alloc.block_size) - len(req.block_table)
    if missing > 0:
        req.block_table.extend(alloc.alloc_blocks(missing))


def slots(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Pool slots of positions start .. end - 1 for a request with this block table.

    Example with block_size 4 and block table [7, 2]: positions 2..5 -> [30, 31, 8, 9]
    (positions 2, 3 are rows 2, 3 of block 7; positions 4, 5 are rows 0, 1 of block 2).
    """
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]
