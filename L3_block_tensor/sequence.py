"""A sequence through its life (waiting, running, finished), ``allocate_slots()`` and ``slots()``.

``Sequence`` is one request's token stream. L2 ran one at a time; here many wait, run and finish
side by side, so a sequence carries a status, a finish reason, a priority and its submission order,
and ``num_computed_tokens`` grows by a chunk at a time during a chunked prefill and drops back to 0
when the sequence is preempted. It keeps only its block table; the slot of its position t is
computed when needed:

    slot = block_table[t // block_size] * block_size + t % block_size

(block t // block_size, row t % block_size). With block_size 4 and block table [2, 0], positions
0..5 live in slots 8, 9, 10, 11, 0, 1, exactly as in L2.

Left out on purpose (and the stage that adds it): several sequences of one request (L5 clones a
request into n samples), and sampling (greedy only).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from .allocator import BlockAllocator, blocks_needed


class Status(Enum):
    WAITING = "waiting"  # submitted or preempted; holds no blocks
    RUNNING = "running"  # admitted; holds the blocks of its computed positions
    FINISHED = "finished"  # done; its blocks are back on the free list


class FinishReason(Enum):
    EOS = "eos"  # generated an end-of-sequence token (kept in the output)
    MAX_TOKENS = "max_tokens"  # generated max_new_tokens tokens
    ABORTED = "aborted"  # cancelled by the caller


@dataclass(eq=False)  # compared by identity: a sequence is itself, whatever its fields hold
class Sequence:
    """One request's token stream through its life: waiting -> running (-> waiting again if
    preempted) -> finished."""

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


def allocate_slots(seq: Sequence, allocator: BlockAllocator, target_len: int) -> None:
    """Grow ``seq.block_table`` until positions 0 .. target_len - 1 have blocks.

    A block is allocated only when a position falls past the last one. With block_size 4, a sequence
    ``a`` holding blocks [0], another holding [1], and the free list 2, 3, ...:

        allocate_slots(a, allocator, 4) -> a.block_table [0]      (4 positions fit in one block; nothing allocated)
        allocate_slots(a, allocator, 6) -> a.block_table [0, 2]

    If the free list is too short, ``OutOfBlocksError`` is raised and ``seq`` is left as it was.
    """
    missing = blocks_needed(target_len, allocator.block_size) - len(seq.block_table)
    if missing > 0:
        seq.block_table.extend(allocator.alloc_blocks(missing))


def slots(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Pool slots of positions start .. end - 1 for a sequence with this block table.

    Example with block_size 4 and block table [7, 2]: positions 2..5 -> [30, 31, 8, 9]
    (positions 2, 3 are rows 2, 3 of block 7; positions 4, 5 are rows 0, 1 of block 2).
    """
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]
