"""A sequence through its life (waiting, running, finished), ``allocate_slots()`` and ``slots()``, with shared blocks.

``Sequence`` is one request's token stream. L2 ran one at a time; here many wait, run and finish
side by side, so a sequence carries a status, a finish reason, a priority and its submission order,
and ``num_computed_tokens`` grows by a chunk at a time during a chunked prefill and drops back to 0
when the sequence is preempted. It keeps only its block table; the slot of its position t is
computed when needed:

    slot = block_table[t // block_size] * block_size + t % block_size

(block t // block_size, row t % block_size). With block_size 4 and block table [2, 0], positions
0..5 live in slots 8, 9, 10, 11, 0, 1, exactly as in L2.

``allocate_slots()`` now shares the blocks the prefix cache found, and gives every block that fills its
prefix-cache key.

A request may also want ``n`` samples. It runs its prompt once as one sequence; when the prefill ends,
the scheduler clones it into n sequences, itself (``sample_index`` 0) and n - 1 children (1 .. n-1,
same ``request_id``), which share its full blocks. Each sequence samples with its own
``SamplingParams`` and ``generator``.

Left out on purpose: stop strings, and logprobs.
"""

from __future__ import annotations

from collections.abc import Sequence as Ids
from dataclasses import dataclass, field
from enum import Enum

import torch

from kvcourse.sampling import SamplingParams, make_generator

from .allocator import BlockAllocator, blocks_needed
from .prefix_cache import register_full_blocks


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
    preempted) -> finished. A request with n > 1 is cloned into n sequences when its prefill ends."""

    request_id: int  # unique per request (its clones share it), in submission order: the FIFO tie-break
    prompt_ids: list[int]
    max_new_tokens: int
    ignore_eos: bool = False
    priority: int = 0  # higher runs first
    num_samples: int = 1  # samples wanted (the request's ``n``); cloned when its prefill ends if > 1
    sampling: SamplingParams = field(default_factory=SamplingParams)
    sample_index: int = 0  # 0: the request's first sequence; 1 .. n-1: its clones
    generator: torch.Generator | None = None  # this sequence's random stream; default: seeded by sampling
    block_table: list[int] = field(default_factory=list)  # block ids, in position order; some shared
    num_computed_tokens: int = 0  # positions 0 .. num_computed_tokens - 1 have their K/V in the pool
    output_ids: list[int] = field(default_factory=list)  # generated tokens; the newest is not cached yet
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None

    def __post_init__(self):
        if self.generator is None:
            self.generator = make_generator(self.sampling.seed_of(self.sample_index))

    @property
    def all_ids(self) -> list[int]:
        """Prompt then generated tokens: everything a recompute after preemption has to run again."""
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_seqs(self) -> int:
        """Places this sequence takes in the running set: n until it clones, then 1."""
        return self.num_samples if not self.output_ids else 1

    def sort_key(self) -> tuple[int, int, int]:
        """Scheduling order: higher priority first, then first come, first served, then sample order."""
        return (-self.priority, self.request_id, self.sample_index)


def allocate_slots(seq: Sequence, allocator: BlockAllocator, target_len: int, cached: Ids[int] = ()) -> None:
    """Grow ``seq.block_table`` until positions 0 .. target_len - 1 have blocks, and give every block
    that positions up to target_len fill its prefix-cache key.

    ``cached``: for a sequence that holds no blocks yet, the blocks ``match_prefix`` found; they are
    shared (ref_count + 1) instead of allocated. With block_size 4, a sequence ``a`` holding [0],
    another holding [1], and the free list 2, 3, ...:

        allocate_slots(a, allocator, 4) -> a.block_table [0]      (nothing allocated; block 0 is now full:
                                                            registered under block_hash(None, a's 4 tokens))
        allocate_slots(a, allocator, 6) -> a.block_table [0, 2]

    The step that computes those positions runs right after, and in every layer it writes all new
    K/V before attention reads any, so a sequence that shares a block registered in the same step
    reads it filled. If the free list is too short, ``OutOfBlocksError`` is raised and nothing changes.
    """
    missing = blocks_needed(target_len, allocator.block_size) - len(seq.block_table) - len(cached)
    if missing > 0 or cached:
        seq.block_table.extend(allocator.alloc_blocks(max(missing, 0), cached))
    register_full_blocks(allocator, seq.block_table, seq.all_ids, seq.num_computed_tokens, target_len)


def slots(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Pool slots of positions start .. end - 1 for a sequence with this block table.

    Example with block_size 4 and block table [7, 2]: positions 2..5 -> [30, 31, 8, 9]
    (positions 2, 3 are rows 2, 3 of block 7; positions 4, 5 are rows 0, 1 of block 2).
    """
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]
