"""Independent answers to the L5 exercises, for the grader's hidden cases (``kvcourse/grading/hidden.py``).

Each function has the signature the notebook asks for and is written apart from the stage's own
code (``allocator.py``, ``prefix_cache.py``), so a bug in the stage cannot make a wrong answer pass:
the clone walks each child's table block by block (and so does a later survivor of a beam in
``fork_beams``), ``free`` first counts every reference down and
then queues the blocks that reached zero, the keys are sha256 of the documented text computed here
(not by ``block_hash``), and ``match_prefix`` computes every key first and reads the index itself.
Tests check that the stage and these answers agree on many drawn cases.

``EXPECT`` maps each exercise to ``case -> observation``: the exercise's ``observe`` (``exercises/L5_clones/checks.py``)
run on the answer. ``STAGE_ADAPTERS`` gives the stage's own code the learner's signature where the two
differ (``BlockAllocator.clone``, ``register_full_blocks``), for the tests only. The grader imports
this file; a submission's sandbox cannot read it.

Left out on purpose: error cases (the exercises hand over valid tables and enough free blocks).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque

from exercises.L5_clones import checks
from exercises.L5_clones.checks import HIDDEN
from L5_clones.allocator import BlockAllocator
from L5_clones.beams import fork
from L5_clones.prefix_cache import block_hash, register_full_blocks
from L5_clones.prefix_cache import match_prefix as stage_match_prefix


def clone_table(parent_table, num_tokens, block_size, n, ref_counts, alloc):
    """Each child's table, block by block: a full block is the parent's (one more holder), a block
    the parent has not filled is a fresh one."""
    tables = []
    for _ in range(n):
        table = []
        for i, block in enumerate(parent_table):
            if (i + 1) * block_size <= num_tokens:  # block i is full
                ref_counts[block] += 1
                table.append(block)
            else:
                table.append(alloc())
        tables.append(table)
    return tables


def free(self, blocks):
    """Count every block of the table down, then queue those that reached 0, last block first."""
    for b in blocks:
        self.blocks[b].ref_count -= 1
    self.free_blocks.extend(b for b in blocks[::-1] if self.blocks[b].ref_count == 0)


def key(prev, tokens) -> int:
    """The documented key of a full block: the first 8 bytes, little-endian, of the sha256 of
    ``"<previous key>|<token ids joined by commas>"`` (``None`` before the first block)."""
    text = str(prev) + "|" + ",".join(str(t) for t in tokens)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


def block_hashes(token_ids, block_size):
    """The chained keys of the full blocks: each block's key is taken over the one before it."""
    keys = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        keys.append(key(keys[-1] if keys else None, token_ids[start : start + block_size]))
    return keys


def match_prefix(token_ids, allocator):
    """Every key the prompt's blocks could have (the last token's block left out), then the leading
    run of them the index holds with the same tokens."""
    bs = allocator.block_size
    looked_at = token_ids[: (len(token_ids) - 1) // bs * bs] if token_ids else []
    hits = []
    for i, k in enumerate(block_hashes(looked_at, bs)):
        b = allocator.hash_to_block.get(k)
        if b is None or tuple(allocator.blocks[b].token_ids) != tuple(looked_at[i * bs : (i + 1) * bs]):
            break
        hits.append(b)
    return hits


def fork_beams(tables, num_tokens, block_size, survivors, ref_counts, alloc):
    """First every beam nobody continues gives back one reference per block; then each survivor's
    table: the first survivor of a beam takes the beam's table, a later one copies its full blocks'
    ids (one more holder each) and takes a fresh block for every block the beam has not filled."""
    for j, table in enumerate(tables):
        if j not in survivors:
            for block in table:
                ref_counts[block] -= 1
    out = []
    for i, j in enumerate(survivors):
        if j not in survivors[:i]:
            out.append(list(tables[j]))
        else:  # a later survivor: one clone of the beam's table, as in L5.1
            out.append(clone_table(tables[j], num_tokens, block_size, 1, ref_counts, alloc)[0])
    return out


def lru_hits(prompts, block_size, capacity):
    """L5.6: a cache of whole prefixes (a block is named by every token up to its end), least recently
    used first; each request counts its leading hits, then its full blocks become the most recently
    used, its last block least recent of them and its first block most recent."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    for r, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"prompt {r} is empty")
    cache: OrderedDict[tuple[int, ...], None] = OrderedDict()
    hits = []
    for prompt in prompts:
        count = 0
        while count < (len(prompt) - 1) // block_size and tuple(prompt[: (count + 1) * block_size]) in cache:
            count += 1
        hits.append(count)
        for i in range(len(prompt) // block_size - 1, -1, -1):  # the last block first: the first ends newest
            name = tuple(prompt[: (i + 1) * block_size])
            cache[name] = None
            cache.move_to_end(name)
        while len(cache) > capacity:
            cache.popitem(last=False)
    return hits


def blocks_held(prompts, block_size):
    """L5.7: each prompt takes every block it needs less the leading blocks it shares with the earlier
    prompt it agrees with longest (whole blocks only, never the block of its own last token, never
    past that prompt's full blocks)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    for r, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"prompt {r} is empty")
    held, total = [], 0
    for r, prompt in enumerate(prompts):
        shared = 0
        for earlier in prompts[:r]:
            limit = min((len(prompt) - 1) // block_size, len(earlier) // block_size)
            same = 0
            while same < limit and earlier[: (same + 1) * block_size] == prompt[: (same + 1) * block_size]:
                same += 1
            shared = max(shared, same)
        total += -(-len(prompt) // block_size) - shared
        held.append(total)
    return held


def test_allocator(BlockAllocator):
    """L5.8: the key's test. Each part provokes one rule of the allocator's books and asserts it."""
    a = BlockAllocator(8, 4)
    parent = a.alloc_blocks(3)  # a 10-token sequence: blocks 0 and 1 full, block 2 partial
    for i, b in enumerate(parent[:2]):
        a.register(b, 100 + i, [i] * 4)
    (c1, c2), copies = a.clone(parent, 10, 2)
    assert c1[:2] == c2[:2] == parent[:2], "full blocks are shared"
    assert c1[2] != parent[2] and c2[2] != parent[2] and c1[2] != c2[2], "the partial block is copied"
    assert [s for s, _ in copies] == [parent[2], parent[2]], copies
    assert [a.blocks[b].ref_count for b in parent] == [3, 3, 1], "n children are n more holders"
    a.free(c1)
    assert a.blocks[parent[0]].ref_count == 2 and a.blocks[parent[1]].ref_count == 2, "one reference each"
    a.free(parent)
    a.free(c2)
    assert list(a.free_blocks)[-3:] == [c2[2], parent[1], parent[0]], "tail first, to the back"
    # a cached block revived from the free list uses up a free block too
    b = BlockAllocator(4, 4)
    t = b.alloc_blocks(2)
    b.register(t[0], 7, [1, 2, 3, 4])
    b.free(t)
    b.alloc_blocks(2)  # the two never used; t[0] and t[1] stay free, t[0] cached
    before = list(b.free_blocks)
    try:
        b.alloc_blocks(2, cached=[t[0]])
    except Exception:  # noqa: BLE001 - any refusal will do, as long as nothing changed
        assert list(b.free_blocks) == before, "a refused allocation changes nothing"
    else:
        raise AssertionError("2 fresh blocks and a revived one need 3 free blocks, only 2 were free")
    # a clone that cannot copy for every child takes nothing
    c = BlockAllocator(3, 4)
    table = c.alloc_blocks(2)  # 6 tokens: one full block, one partial; one block free
    try:
        c.clone(table, 6, 2)
    except Exception:  # noqa: BLE001
        assert c.num_free == 1 and [c.blocks[x].ref_count for x in table] == [1, 1], "nothing taken"
    else:
        raise AssertionError("two copies with one free block")


PREDICTED = {
    "D's block table": [0, 1, 5, 6],
    "E's block table": [0, 7],
    "ref counts": [2, 1, 0, 0, 0, 1, 1, 1],
    "free list": [2, 3, 4],
}


def predict():
    """L5.9, worked out by hand (see the notebook's operations): A takes [0, 1, 2], its clones [0, 1, 3]
    and [0, 1, 4]; A, B, C give back 2, then 3, then 4, 1, 0 (tail first): free list [5, 6, 7, 2, 3, 4, 1,
    0], blocks 0 and 1 still keyed. D's 13 tokens revive 0 and 1 and take 5 and 6 off the front (6 is
    partial, 5 now keyed); E's 6 tokens revive nothing (0 is held) and share 0, then take 7."""
    return {key: list(value) for key, value in PREDICTED.items()}


def stage_clone_table(parent_table, num_tokens, block_size, n, ref_counts, alloc):
    """L5.1 by ``BlockAllocator.clone``: an allocator holding the same counts, whose fresh blocks come
    from ``alloc()``; the counts of the parent's blocks are copied back into ``ref_counts``."""
    allocator = BlockAllocator(max(ref_counts) + 1, block_size)
    for block, count in ref_counts.items():
        allocator.blocks[block].ref_count = count
    allocator.free_blocks = deque(range(n))  # clone only reads its length: fresh blocks come from alloc()
    allocator._take_free = alloc
    tables, _ = allocator.clone(list(parent_table), num_tokens, n)
    for block in parent_table[: num_tokens // block_size]:
        ref_counts[block] = allocator.blocks[block].ref_count
    return tables


def stage_block_hashes(token_ids, block_size):
    """L5.3 by ``register_full_blocks``: the keys it gives the full blocks of one table."""
    full = len(token_ids) // block_size
    allocator = BlockAllocator(max(full, 1), block_size)
    table = allocator.alloc_blocks(full)
    register_full_blocks(allocator, table, list(token_ids), 0, len(token_ids))
    return [allocator.blocks[b].hash for b in table]


def stage_fork_beams(tables, num_tokens, block_size, survivors, ref_counts, alloc):
    """L5.5 by ``beams.fork``: an allocator holding the same counts, whose fresh blocks come from
    ``alloc()``; the counts copied back."""
    before = list(ref_counts)
    allocator = BlockAllocator(max(before) + 1, block_size)
    for block, count in ref_counts.items():
        allocator.blocks[block].ref_count = count
    allocator.free_blocks = deque(
        [-1] * len(survivors)
    )  # clone only reads its length: blocks come from alloc()
    allocator._take_free = alloc
    new, _ = fork(allocator, [list(t) for t in tables], num_tokens, list(survivors))
    for block in before:  # the fresh blocks' counts are alloc()'s
        ref_counts[block] = allocator.blocks[block].ref_count
    return new


def _valid(prompts, block_size, capacity=0):
    if block_size < 1 or capacity < 0 or not all(prompts):
        raise ValueError(f"block_size {block_size}, capacity {capacity} or an empty prompt")


def stage_lru_hits(prompts, block_size, capacity):
    """L5.6 by the stage's pieces: the cache is a ``BlockAllocator`` of ``capacity`` blocks whose free
    list is the LRU order (front: least recent); ``match_prefix`` counts the hits; using a block is
    taking it and freeing it again (to the back), and a block not cached takes the front block (the
    least recent, which forgets its key) and registers it."""
    _valid(prompts, block_size, capacity)
    if capacity == 0:
        return [0] * len(prompts)
    cache, hits = BlockAllocator(capacity, block_size), []
    for prompt in prompts:
        hits.append(len(stage_match_prefix(list(prompt), cache)))
        keys, key = [], None
        for i in range(len(prompt) // block_size):
            key = block_hash(key, prompt[i * block_size : (i + 1) * block_size])
            keys.append(key)
        for i in reversed(range(len(keys))):
            tokens = prompt[i * block_size : (i + 1) * block_size]
            block = cache.lookup(keys[i], tokens)
            if block is None:
                (block,) = cache.alloc_blocks(1)
                cache.register(block, keys[i], tokens)
            else:
                cache.alloc_blocks(0, cached=[block])
            cache.free([block])
    return hits


def stage_blocks_held(prompts, block_size):
    """L5.7 by the stage: ``match_prefix`` and ``allocate_slots`` admitting every prompt (``exercises/L5_clones/checks.py``)."""
    _valid(prompts, block_size)
    return checks._held_by_stage([list(p) for p in prompts], block_size)


def stage_test_allocator(Subject):
    """L5.8 as an oracle: the same calls on the subject and on the stage's own ``BlockAllocator``, the
    books (or the exception raised, and the books after it) compared after each."""

    def books(a):
        return [b.ref_count for b in a.blocks], list(a.free_blocks)

    def both(script):
        mine, real = script(Subject), script(BlockAllocator)
        assert mine == real, (mine, real)

    def run(script_steps):
        def script(cls):
            a, seen = cls(*script_steps[0]), []
            for step in script_steps[1:]:
                try:
                    step(a)
                    seen.append(("ok", books(a)))
                except Exception as e:  # noqa: BLE001 - the oracle raises where the subject must
                    seen.append((type(e).__name__, books(a)))
            return seen

        both(script)

    run(
        [
            (8, 4),
            lambda a: a.alloc_blocks(3),
            lambda a: (a.register(0, 1, [0] * 4), a.register(1, 2, [1] * 4)),
            lambda a: a.clone([0, 1, 2], 10, 2),
            lambda a: a.free([0, 1, 3]),
            lambda a: a.free([0, 1, 2]),
            lambda a: a.free([0, 1, 4]),
        ]
    )
    run([(4, 4), lambda a: a.alloc_blocks(2), lambda a: a.register(0, 7, [1, 2, 3, 4]), lambda a: a.free([0, 1]),
         lambda a: a.alloc_blocks(2), lambda a: a.alloc_blocks(2, cached=[0])])  # fmt: skip
    run([(3, 4), lambda a: a.alloc_blocks(2), lambda a: a.clone([0, 1], 6, 2)])


STAGE_ADAPTERS_BEYOND = {
    "L5.6": stage_lru_hits,
    "L5.7": stage_blocks_held,
    "L5.8": stage_test_allocator,
    "L5.9": checks._predict_run,
}

ANSWERS = {
    "L5.1": clone_table,
    "L5.2": free,
    "L5.3": block_hashes,
    "L5.4": match_prefix,
    "L5.5": fork_beams,
    "L5.6": lru_hits,
    "L5.7": blocks_held,
    "L5.8": test_allocator,
    "L5.9": predict,
}
EXPECT = {ex: (lambda case, ex=ex: HIDDEN[ex].observe(ANSWERS[ex], case)) for ex in ANSWERS}
EXPECT["L5.9"] = lambda case: PREDICTED[case["key"]]  # written by hand: running anything is the stage again
STAGE_ADAPTERS = {
    "L5.1": stage_clone_table,
    "L5.3": stage_block_hashes,
    "L5.5": stage_fork_beams,
    **STAGE_ADAPTERS_BEYOND,
}
