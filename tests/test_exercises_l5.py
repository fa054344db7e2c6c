"""The L5 exercise checkers and hidden cases fail wrong answers and pass independent ones.

Every exercise of ``key/notebooks/L5_clones.ipynb`` (L5.1 clone, L5.2 refcounted free, L5.3 block keys,
L5.4 match_prefix, L5.5 beams' block tables after a step) gets plausible wrong solutions: the partial block shared by a clone, a count raised
by 1 instead of n, a shared block freed at once, a missing decrement, a table freed head first or
into the front of the free list, a freed block that forgets its key, keys that do not chain, a key
for the partial tail, the block of the prompt's last token matched, a match that goes on past a miss,
a hash hit taken without comparing tokens, a match that takes references, a dropped beam that keeps
its blocks or frees shared ones outright, a survivor that copies every block or shares the partial
one, every survivor cloned (the beam's own table leaked). Each runs in process on its
checker, with the printed lines captured: the summary must not read ``n/n passed``, and the case that
should catch the mistake must say ``WRONG`` or ``raised``. Example::

    case 3 (exactly its first 8 tokens: block 2 holds the last token, only [6]): WRONG — matched blocks [6, 2], expected [6]
    ...
    6/9 passed

Each wrong solution must also fail the exercise's hidden cases, as ``make grade`` judges them.

The other half: each checker gets the independent answer of ``key/L5_clones/answers.py`` (written apart
from the stage; the checker compares it with the stage's own code, so the two hold each other in
check) and the reference notebook's solution cells; every case must print ``ok``. The stage's own
functions are held to hard-coded examples in ``tests/test_l5.py``. Everything runs on small
allocators, well under a second per checker.

Left out on purpose: running the notebook (``tests/test_grading.py`` grades it).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from checker_asserts import assert_fails, assert_passes, graded_lines, hidden_problems

from exercises.L5_clones import checks
from key.L5_clones import answers
from kvcourse.grading.exercises import read
from L5_clones import prefix_cache
from L5_clones.allocator import BlockAllocator
from L5_clones.prefix_cache import block_hash, register_full_blocks

NOTEBOOK = Path(__file__).resolve().parent.parent / "key" / "notebooks" / "L5_clones.ipynb"


# ---- L5.1: clone_table(parent_table, num_tokens, block_size, n, ref_counts, alloc) ----


def clone_shares_partial(parent_table, num_tokens, block_size, n, ref_counts, alloc):
    """Shares every block, the partial last one too: the children would write into the parent's block."""
    for block in parent_table:
        ref_counts[block] += n
    return [list(parent_table) for _ in range(n)]


def clone_counts_one(parent_table, num_tokens, block_size, n, ref_counts, alloc):
    """Raises each shared block's count by 1, not by n: n children are n more holders."""
    full = num_tokens // block_size
    for block in parent_table[:full]:
        ref_counts[block] += 1
    return [parent_table[:full] + [alloc() for _ in parent_table[full:]] for _ in range(n)]


def clone_always_copies_last(parent_table, num_tokens, block_size, n, ref_counts, alloc):
    """Treats the last block as partial even when the sequence ends on a block boundary."""
    for block in parent_table[:-1]:
        ref_counts[block] += n
    return [parent_table[:-1] + [alloc()] for _ in range(n)]


@pytest.mark.parametrize(
    "wrong, case_name",
    [
        (clone_shares_partial, "10 tokens (partial last block), n = 2"),
        (clone_counts_one, "every block is full, n = 4"),
        (clone_always_copies_last, "last block exactly full"),
    ],
    ids=lambda x: getattr(x, "__name__", "case"),
)
def test_clone_table_fails_wrong_answers(capsys, wrong, case_name):
    checks.check_clone_table(wrong)
    assert_fails(graded_lines(capsys), case_name)
    assert hidden_problems("L5_clones", "L5.1", wrong)


def test_clone_table_passes_the_independent_answer(capsys):
    checks.check_clone_table(answers.clone_table)
    assert_passes(graded_lines(capsys))


# ---- L5.2: free(self, blocks), a BlockAllocator method ----


def free_at_once(self, blocks):
    """Frees every block of the table, shared or not: the other tables keep blocks on the free list."""
    for b in reversed(blocks):
        self.blocks[b].ref_count = 0
        self.free_blocks.append(b)


def free_no_decrement(self, blocks):
    """Frees a block when this is its last holder, but never lowers a count."""
    for b in reversed(blocks):
        if self.blocks[b].ref_count == 1:
            self.free_blocks.append(b)


def free_head_first(self, blocks):
    """Walks the table from its first block: the prefix is reused before its tail."""
    for b in blocks:
        self.blocks[b].ref_count -= 1
        if self.blocks[b].ref_count == 0:
            self.free_blocks.append(b)


def free_to_front(self, blocks):
    """Puts freed blocks at the front of the free list: the newest freed is reused first."""
    for b in reversed(blocks):
        self.blocks[b].ref_count -= 1
        if self.blocks[b].ref_count == 0:
            self.free_blocks.appendleft(b)


def free_forgets_keys(self, blocks):
    """Clears a freed block's hash and tokens: a later identical prefix can no longer hit it."""
    for b in reversed(blocks):
        block = self.blocks[b]
        block.ref_count -= 1
        if block.ref_count == 0:
            block.hash, block.token_ids = None, ()
            self.free_blocks.append(b)


@pytest.mark.parametrize(
    "wrong, case_name",
    [
        (free_at_once, "a clone: blocks 3 and 5 are in three tables"),
        (free_at_once, "the shared prefix outlives the request that filled it"),
        (free_no_decrement, "one holder per block"),
        (free_head_first, "[4, 7, 9] goes back tail first"),
        (free_to_front, "behind block 0"),
        (free_forgets_keys, "freed blocks keep their keys"),
    ],
    ids=lambda x: getattr(x, "__name__", "case"),
)
def test_free_fails_wrong_answers(capsys, wrong, case_name):
    checks.check_free(wrong)
    assert_fails(graded_lines(capsys), case_name)
    assert hidden_problems("L5_clones", "L5.2", wrong)


def test_free_passes_the_independent_answer(capsys):
    checks.check_free(answers.free)
    assert_passes(graded_lines(capsys))


# ---- L5.3: block_hashes(token_ids, block_size) ----


def hashes_unchained(token_ids, block_size):
    """Keys each block by its own tokens only: the same tokens after another prefix get the same key."""
    full = len(token_ids) // block_size
    return [block_hash(None, token_ids[i * block_size : (i + 1) * block_size]) for i in range(full)]


def hashes_with_tail(token_ids, block_size):
    """Keys the partial last block too, though more tokens will land in it."""
    keys, prev = [], None
    for i in range(0, len(token_ids), block_size):
        prev = block_hash(prev, token_ids[i : i + block_size])
        keys.append(prev)
    return keys


@pytest.mark.parametrize(
    "wrong, case_name",
    [
        (hashes_unchained, "the second key is chained"),
        (hashes_with_tail, "the tail [5] has no key"),
        (hashes_with_tail, "no full block, no key"),
    ],
    ids=lambda x: getattr(x, "__name__", "case"),
)
def test_block_hashes_fails_wrong_answers(capsys, wrong, case_name):
    checks.check_block_hashes(wrong)
    assert_fails(graded_lines(capsys), case_name)
    assert hidden_problems("L5_clones", "L5.3", wrong)


def test_block_hashes_passes_the_independent_answer(capsys):
    checks.check_block_hashes(answers.block_hashes)
    assert_passes(graded_lines(capsys))


def test_register_full_blocks_gives_the_documented_chained_keys():
    """The stage's own chain, on hard-coded keys (``block_hash``'s docstring): block_size 2, tokens
    [1, 2, 3, 4, 5] in blocks [3, 5, 8] -> blocks 3 and 5 keyed, the partial block 8 not."""
    allocator = BlockAllocator(9, 2)
    register_full_blocks(allocator, [3, 5, 8], [1, 2, 3, 4, 5], 0, 5)
    assert [allocator.blocks[b].hash for b in (3, 5, 8)] == [10878768257076693884, 11438315679022258796, None]
    assert answers.block_hashes([1, 2, 3, 4, 5], 2) == [10878768257076693884, 11438315679022258796]


# ---- L5.4: match_prefix(token_ids, allocator) ----


def match_with_last_block(token_ids, allocator):
    """Looks at every full block, the one holding the last token too: that token would not run."""
    bs, hits, key = allocator.block_size, [], None
    for i in range(len(token_ids) // bs):
        tokens = token_ids[i * bs : (i + 1) * bs]
        key = block_hash(key, tokens)
        block = allocator.lookup(key, tokens)
        if block is None:
            break
        hits.append(block)
    return hits


def match_past_a_miss(token_ids, allocator):
    """Skips a missing block and goes on: the hits no longer are the prompt's leading blocks."""
    bs, hits, key = allocator.block_size, [], None
    for i in range((len(token_ids) - 1) // bs):
        tokens = token_ids[i * bs : (i + 1) * bs]
        key = block_hash(key, tokens)
        block = allocator.lookup(key, tokens)
        if block is not None:
            hits.append(block)
    return hits


def match_unchained(token_ids, allocator):
    """Keys each block by its own tokens only, so a block can hit after another prefix."""
    bs, hits = allocator.block_size, []
    for i in range((len(token_ids) - 1) // bs):
        tokens = token_ids[i * bs : (i + 1) * bs]
        block = allocator.lookup(block_hash(None, tokens), tokens)
        if block is None:
            break
        hits.append(block)
    return hits


def match_trusts_the_key(token_ids, allocator):
    """Reads the index directly: a key collision with other tokens counts as a hit."""
    bs, hits, key = allocator.block_size, [], None
    for i in range((len(token_ids) - 1) // bs):
        key = block_hash(key, token_ids[i * bs : (i + 1) * bs])
        block = allocator.hash_to_block.get(key)
        if block is None:
            break
        hits.append(block)
    return hits


def match_and_take(token_ids, allocator):
    """Takes a reference on each hit itself: the caller would take a second one."""
    return allocator.alloc_blocks(0, cached=prefix_cache.match_prefix(token_ids, allocator))


@pytest.mark.parametrize(
    "wrong, case_name",
    [
        (match_with_last_block, "block 2 holds the last token"),
        (match_with_last_block, "its only block holds the last token"),
        (match_past_a_miss, "stop at the first miss"),
        (match_unchained, "the repeat follows another prefix"),
        (match_trusts_the_key, "a collision"),
        (match_and_take, "the cached 9 tokens again"),
    ],
    ids=lambda x: getattr(x, "__name__", "case"),
)
def test_match_prefix_fails_wrong_answers(capsys, wrong, case_name):
    checks.check_match_prefix(wrong)
    assert_fails(graded_lines(capsys), case_name)
    assert hidden_problems("L5_clones", "L5.4", wrong)


def test_match_prefix_passes_the_independent_answer(capsys):
    checks.check_match_prefix(answers.match_prefix)
    assert_passes(graded_lines(capsys))


# ---- L5.5: fork_beams(tables, num_tokens, block_size, survivors, ref_counts, alloc) ----


def _fork_with(tables, num_tokens, block_size, survivors, ref_counts, alloc, drop, later, first_clones=False):
    """A re-pointing whose dropped beams go through ``drop(table)`` and whose later survivors (and, with
    ``first_clones``, the first ones too) get ``later(table)``."""
    for j, table in enumerate(tables):
        if j not in survivors:
            drop(table)
    out = []
    for i, j in enumerate(survivors):
        first = j not in survivors[:i]
        out.append(list(tables[j]) if first and not first_clones else later(tables[j]))
    return out


def fork_keeps_dropped(tables, num_tokens, block_size, survivors, ref_counts, alloc):
    """Never gives a dropped beam's blocks back: they leak."""

    def later(t):
        full = num_tokens // block_size
        for b in t[:full]:
            ref_counts[b] += 1
        return t[:full] + [alloc() for _ in t[full:]]

    return _fork_with(tables, num_tokens, block_size, survivors, ref_counts, alloc, lambda t: None, later)


def fork_frees_outright(tables, num_tokens, block_size, survivors, ref_counts, alloc):
    """Frees every block of a dropped beam, shared or not: its siblings' prefix goes on the free list."""

    def drop(t):
        for b in t:
            ref_counts.pop(b, None)

    def later(t):
        full = num_tokens // block_size
        for b in t[:full]:
            ref_counts[b] += 1
        return t[:full] + [alloc() for _ in t[full:]]

    return _fork_with(tables, num_tokens, block_size, survivors, ref_counts, alloc, drop, later)


def _drop(ref_counts):
    def drop(t):
        for b in t:
            ref_counts[b] -= 1

    return drop


def fork_copies_everything(tables, num_tokens, block_size, survivors, ref_counts, alloc):
    """A later survivor copies every block of its parent, full ones too: nothing is shared."""
    later = lambda t: [alloc() for _ in t]  # noqa: E731
    return _fork_with(tables, num_tokens, block_size, survivors, ref_counts, alloc, _drop(ref_counts), later)


def fork_shares_partial(tables, num_tokens, block_size, survivors, ref_counts, alloc):
    """A later survivor shares the partial last block too: two beams would write into one block."""

    def later(t):
        for b in t:
            ref_counts[b] += 1
        return list(t)

    return _fork_with(tables, num_tokens, block_size, survivors, ref_counts, alloc, _drop(ref_counts), later)


def fork_clones_every_survivor(tables, num_tokens, block_size, survivors, ref_counts, alloc):
    """Clones for the first survivor of a beam too, and keeps the beam's own table: it leaks."""

    def later(t):
        full = num_tokens // block_size
        for b in t[:full]:
            ref_counts[b] += 1
        return t[:full] + [alloc() for _ in t[full:]]

    return _fork_with(
        tables, num_tokens, block_size, survivors, ref_counts, alloc, _drop(ref_counts), later, True
    )


@pytest.mark.parametrize(
    "wrong, case_name",
    [
        (fork_keeps_dropped, "a dropped beam gives back its own block"),
        (fork_frees_outright, "every survivor continues one beam"),
        (fork_copies_everything, "one beam forks into three"),
        (fork_shares_partial, "one beam forks into three"),
        (fork_clones_every_survivor, "nothing copied"),
    ],
    ids=lambda x: getattr(x, "__name__", "case"),
)
def test_fork_beams_fails_wrong_answers(capsys, wrong, case_name):
    checks.check_fork_beams(wrong)
    assert_fails(graded_lines(capsys), case_name)
    assert hidden_problems("L5_clones", "L5.5", wrong)


def test_fork_beams_passes_the_independent_answer(capsys):
    checks.check_fork_beams(answers.fork_beams)
    assert_passes(graded_lines(capsys))


# ---- the reference notebook's own solutions ----


def notebook_solutions() -> dict:
    """The functions the reference notebook's solution cells define, run with what its setup imports."""
    namespace = {"block_hash": block_hash}
    for cell in read(NOTEBOOK).cells:
        if cell.cell_type == "code" and "# BEGIN SOLUTION" in cell.source:
            exec(cell.source, namespace)  # the course's own notebook: defines the solved functions
    return namespace


@pytest.mark.parametrize(
    "checker, name",
    [
        (checks.check_clone_table, "clone_table"),
        (checks.check_free, "free"),
        (checks.check_block_hashes, "block_hashes"),
        (checks.check_match_prefix, "match_prefix"),
        (checks.check_fork_beams, "fork_beams"),
    ],
    ids=["L5.1", "L5.2", "L5.3", "L5.4", "L5.5"],
)
def test_notebook_solutions_pass(capsys, checker, name):
    checker(notebook_solutions()[name])
    assert_passes(graded_lines(capsys))
