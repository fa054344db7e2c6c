"""The prefix cache: full blocks named by the chain of tokens that leads to them, and found again.

A full block's K/V depend on its own tokens and on every token before it, so its key chains the
previous block's key with its tokens (``block_hash``): the key names the whole prefix up to the end of
the block. ``register_full_blocks`` gives each block a sequence fills its key, as soon as the step that
fills it is scheduled; ``match_prefix`` walks a new request's tokens block by block and returns the
leading blocks the pool already holds, which the request then shares instead of computing.

The index itself (key -> block, and what a freed block keeps) lives in ``allocator.py``: it changes
whenever a block is handed out.

Left out on purpose: partial-block matches (only whole blocks are shared), cache salts that keep
tenants apart, and a smarter eviction order than the free list's.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence as Ids

from .allocator import BlockAllocator


def block_hash(prev_hash: int | None, token_ids: Ids[int]) -> int:
    """The prefix-cache key of a full block: sha256 of the previous block's key and this block's
    tokens, cut to 64 bits. The same on every run and machine (Python's ``hash`` is not).

    Examples: ``block_hash(None, [1, 2]) -> 10878768257076693884`` (a first block: no previous
    key), ``block_hash(10878768257076693884, [3, 4]) -> 11438315679022258796``, while
    ``block_hash(None, [3, 4]) -> 3412362716378171258``: the same tokens after another prefix get
    another key, because a block's K/V depend on every token before it.
    """
    text = f"{prev_hash}|{','.join(map(str, token_ids))}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


def match_prefix(token_ids: list[int], allocator: BlockAllocator) -> list[int]:
    """The cached blocks holding the leading full blocks of ``token_ids``, as far as they match; takes
    nothing.

    Walks the tokens one full block at a time, chaining the keys, and stops at the first block that
    is not in the cache. It never matches the block holding the last token, i.e. at most
    (len(token_ids) - 1) // block_size blocks: that token must run (its logits give the next token),
    and running it must not write into a shared block. Example, block_size 4, a cached 9-token prompt
    in blocks [6, 2, 7]: the same 9 tokens match [6, 2] (8 tokens skipped, the 9th runs); the first
    5 of them plus another token match [6]; a prompt of exactly 8 of them matches [6] only.
    """
    bs = allocator.block_size
    hits: list[int] = []
    key = None
    for i in range((len(token_ids) - 1) // bs):
        tokens = token_ids[i * bs : (i + 1) * bs]
        key = block_hash(key, tokens)
        block = allocator.lookup(key, tokens)
        if block is None:
            break
        hits.append(block)
    return hits


def register_full_blocks(
    allocator: BlockAllocator, block_table: list[int], token_ids: list[int], start: int, end: int
) -> None:
    """Register, under its chained key, every block of ``block_table`` that positions start .. end - 1
    fill (blocks start // block_size .. end // block_size - 1) and that has no key yet.

    Example, block_size 4, 10 tokens in blocks [3, 5, 8], start 0, end 10: blocks 3 and 5 are full
    and get keys ``block_hash(None, tokens[0:4])`` and ``block_hash(<block 3's key>, tokens[4:8])``;
    block 8 holds 2 of 4 positions and stays unregistered. A block found by ``match_prefix`` already
    has its key and is skipped.
    """
    bs = allocator.block_size
    for i in range(start // bs, end // bs):
        block = block_table[i]
        if allocator.blocks[block].hash is None:
            prev = allocator.blocks[block_table[i - 1]].hash if i else None
            tokens = token_ids[i * bs : (i + 1) * bs]
            allocator.register(block, block_hash(prev, tokens), tokens)
