"""The vLLM paper's Orca baselines: what each reserves per request, and the buddy allocator it reserves from.

Kwon et al. (SOSP 2023) compare vLLM with Orca, which is not public, so they built Orca's memory
management into their own engine (section 6.1, "Baseline 2: Orca"): "We assume Orca uses the buddy
allocation algorithm to determine the memory address to store KV cache. We implement three versions
of Orca based on how much it over-reserves the space for request outputs":

- Orca (Oracle) knows each request's true output length and reserves exactly the prompt plus it;
- Orca (Pow2) "over-reserves the space for outputs by at most 2x. For example, if the true output
  length is 25, it reserves 32 positions for outputs": the prompt plus the output rounded up to a
  power of two;
- Orca (Max) "reserves the space up to the maximum sequence length of the model, i.e., 2048 tokens".

Each reservation is one contiguous run, taken at admission and kept until the request finishes, so a
running request never needs more memory and nothing is preempted; a request waits until a run of its
size is free. A buddy allocator hands out runs of a power-of-two size (section 6.5: "Due to the buddy
allocation algorithm, the Orca baselines reserve the space for 1024 tokens for the request outputs,
regardless of how they predict the output lengths"), so a reservation of 100 positions takes 128.

Here the runs are runs of consecutive block ids in the same pool the paged engine uses, so the same
attention kernels read them: ``held_at_admission`` says how many positions a policy reserves,
``BuddyAllocator`` hands out the runs, and ``make_allocator`` gives an engine (L3, L4) the books its
policy keeps. ``on_demand`` (vLLM's paging) reserves nothing ahead and takes any free block from the
free list (the stage's ``BlockAllocator``).

Left out on purpose: positions smaller than a block (the buddy works in blocks, so a run is at least
one block of ``block_size`` positions where Orca's would be a power of two of tokens; from a block up,
with a block_size that is a power of two, the two agree), and the memory Orca would spend on anything
but KV.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvcourse.engine_config import EngineConfig

ADMISSION_POLICIES = ("on_demand", "oracle", "pow2", "max")


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (n >= 1). Examples: 1 -> 1, 5 -> 8, 8 -> 8, 25 -> 32."""
    if n < 1:
        raise ValueError(f"next_pow2 needs n >= 1, got {n}")
    return 1 << (n - 1).bit_length()


def held_at_admission(policy: str, prompt_len: int, output_len: int, max_model_len: int) -> int:
    """Positions a request holds from the step it is admitted, under each policy of the vLLM paper
    (section 6.1); ``output_len`` is its true output length (``max_new_tokens``, run with ignore_eos):

    - ``on_demand``: none ahead; a block comes when a position falls past the last one (vLLM);
    - ``oracle``: the prompt plus the true output, known in advance (Orca (Oracle));
    - ``pow2``: the prompt plus the output rounded up to a power of two, at most max_model_len in all
      (Orca (Pow2));
    - ``max``: max_model_len, whatever its length (Orca (Max)).

    Example, a prompt of 20 and a true output of 25, max_model_len 2048: on_demand 0, oracle 45,
    pow2 52 (20 + 32), max 2048. The buddy allocator then rounds each to a power of two of blocks.
    """
    if policy == "on_demand":
        return 0
    if policy == "oracle":
        return prompt_len + output_len
    if policy == "pow2":
        return prompt_len + min(next_pow2(output_len), max_model_len - prompt_len)
    if policy == "max":
        return max_model_len
    raise ValueError(f"admission_policy must be one of {ADMISSION_POLICIES}, got {policy!r}")


class BuddyAllocator:
    """Runs of consecutive block ids, each a power of two of blocks, from a pool of ``num_blocks``.

    The pool starts as the largest aligned runs that tile it (48 blocks: a run of 32 at 0 and one of
    16 at 32). ``alloc_blocks(n)`` takes the smallest free run of at least ``next_pow2(n)`` blocks
    (the lowest id among equals), halves it until it is that size (each half that is not taken becomes
    a free run: the taken half's *buddy*), and returns its first n ids; the rest of the run is held
    too, unused (internal fragmentation). ``free`` returns the run, which merges with its buddy
    (the run at ``start ^ size``) while that buddy is free and whole, and so on up.

    Example, 8 blocks: ``alloc_blocks(3) -> [0, 1, 2]`` (8 halves into 0..3 and 4..7; the run 0..3 is
    taken, block 3 unused), ``alloc_blocks(1) -> [4]`` (4..7 halves into 4..5 and 6..7, then 4..5 into
    4 and 5; 5 and 6..7 stay free). Then, on a fresh pool of 8, four ``alloc_blocks(2)`` take 0..1,
    2..3, 4..5 and 6..7; free the first and the third: 4 blocks are free, but as two runs of 2, so
    ``alloc_blocks(4)`` fails (and ``alloc_blocks(3)``, which needs a run of 4, too). That is
    **external fragmentation**: free memory a request cannot use because it is not in one piece. Even
    free blocks side by side may not serve: had the second and the third been freed, 2..5 would be
    free, but 2..3 and 4..5 are not buddies (2's buddy is 0, 4's is 6), so they stay two runs of 2.

    It offers what a scheduler asks of the stage's free list (``alloc_blocks``, ``free``,
    ``num_free``, ``num_used``, ``grow``, ``check_invariants``). A failed allocation raises
    ``out_of_blocks(needed, free)`` (the stage's ``OutOfBlocksError``, which its scheduler catches),
    with a message naming the run it needed and the largest one free, and changes nothing.
    """

    def __init__(self, num_blocks: int, block_size: int, out_of_blocks: type[Exception]):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks, self.block_size, self.out_of_blocks = 0, block_size, out_of_blocks
        self.free_runs: dict[int, int] = {}  # start -> size of every free run
        self.runs: dict[int, int] = {}  # start -> size of every run handed out
        self.grow(num_blocks)

    @property
    def num_free(self) -> int:
        return sum(self.free_runs.values())

    @property
    def num_used(self) -> int:
        """Blocks held, whole runs (the unused tail of each run included)."""
        return self.num_blocks - self.num_free

    @property
    def largest_free_run(self) -> int:
        """Blocks in the largest free run (0 when none is free): the largest request that fits now."""
        return max(self.free_runs.values(), default=0)

    @staticmethod
    def largest_run(num_blocks: int) -> int:
        """The largest run a pool of ``num_blocks`` blocks ever holds: the largest power of two <= it.
        Example: 48 -> 32."""
        return 1 << (num_blocks.bit_length() - 1)

    def grow(self, n: int) -> None:
        """Add blocks num_blocks .. num_blocks + n - 1, each merged with its free buddies.

        Example: ``BuddyAllocator(6, 16, OutOfBlocksError)`` has free runs {0: 4, 4: 2}; ``grow(2)``
        makes one free run {0: 8}.
        """
        first = self.num_blocks
        self.num_blocks += n
        for block in range(first, first + n):
            self._release(block, 1)

    def alloc_blocks(self, n: int) -> list[int]:
        """The first ``n`` ids of a run of ``next_pow2(n)`` blocks (none for n = 0)."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n == 0:
            return []
        size = next_pow2(n)
        fits = [(run, start) for start, run in self.free_runs.items() if run >= size]
        if not fits:
            error = self.out_of_blocks(size, self.num_free)
            error.args = (
                f"out of KV blocks: need a run of {size} contiguous blocks (for {n}), the largest free "
                f"run is {self.largest_free_run} of {self.num_free} blocks free",
            )
            raise error
        run, start = min(fits)
        del self.free_runs[start]
        while run > size:  # halve it, freeing the upper half (the buddy of the half kept)
            run //= 2
            self.free_runs[start + run] = run
        self.runs[start] = size
        return list(range(start, start + n))

    def free(self, blocks: list[int]) -> None:
        """Give back the runs whose first ids ``blocks`` holds (a block table made of whole calls to
        ``alloc_blocks``). Every id is checked before anything changes: an id outside the pool, or
        blocks that are not the start of runs handed out, raise ValueError naming it and nothing is freed.
        """
        starts = []
        for start, _ in self._runs_of(blocks):
            if start not in range(self.num_blocks):
                raise ValueError(f"block {start!r} is not in this pool (ids 0..{self.num_blocks - 1})")
            if start not in self.runs or start in starts:
                raise ValueError(f"block {start} does not start a run handed out (a double free?)")
            starts.append(start)
        for start in starts:
            self._release(start, self.runs.pop(start))

    def _runs_of(self, table: list[int]) -> list[tuple[int, int]]:
        """(first id, length) of each run of consecutive ids in a block table, none longer than the
        run handed out at its first id. Example: runs {0: 4, 4: 2} handed out, [0, 1, 2, 3, 4] ->
        [(0, 4), (4, 1)]."""
        pieces, i = [], 0
        while i < len(table):
            start, n = table[i], 1
            while i + n < len(table) and n < self.runs.get(start, 0) and table[i + n] == start + n:
                n += 1
            pieces.append((start, n))
            i += n
        return pieces

    def _release(self, start: int, size: int) -> None:
        """Put a run back, merging it with its buddy (the run at ``start ^ size``) while the buddy is a
        free run of the same size; both lie inside the pool, so the merged run does too."""
        while self.free_runs.get(start ^ size) == size:
            del self.free_runs[start ^ size]
            start, size = min(start, start ^ size), 2 * size
        self.free_runs[start] = size

    def check_invariants(self, owners: Iterable[Iterable[int]] | None = None) -> None:
        """Raise AssertionError unless the books balance.

        Always: every run, free or handed out, is a power of two aligned to its size and inside the
        pool; runs do not overlap and together tile the pool (nothing leaked); no free run could
        merge with its buddy. Given ``owners`` (the block table of every live sequence): each table is
        the first ids of runs handed out, and together they hold every run handed out, once.
        """
        covered = [0] * self.num_blocks
        for start, size in [*self.free_runs.items(), *self.runs.items()]:
            assert size & (size - 1) == 0 and start % size == 0, f"run {start}+{size} is not aligned"
            assert 0 <= start and start + size <= self.num_blocks, f"run {start}+{size} leaves the pool"
            for b in range(start, start + size):
                covered[b] += 1
        assert all(c == 1 for c in covered), f"blocks in no run or two: {[b for b, c in enumerate(covered) if c != 1]}"
        for start, size in self.free_runs.items():
            assert self.free_runs.get(start ^ size) != size, (
                f"free runs {start} and {start ^ size} of {size} are buddies and were not merged"
            )
        if owners is not None:
            starts = []
            for table in owners:
                for start, _ in self._runs_of(list(table)):
                    assert start in self.runs, f"block table {list(table)} holds {start}, which starts no run"
                    starts.append(start)
            assert sorted(starts) == sorted(self.runs), (
                f"sequences hold runs {sorted(starts)}, handed out {sorted(self.runs)}"
            )


def make_allocator(config: EngineConfig, free_list: type, out_of_blocks: type[Exception]):
    """The pool's books under ``config.admission_policy``: the stage's free list (``free_list``, its
    ``BlockAllocator``) on demand, else a ``BuddyAllocator`` that raises the stage's ``out_of_blocks``
    (its ``OutOfBlocksError``, which its scheduler catches). Both over ``config.num_blocks`` blocks of
    ``config.block_size``. Example: L3's engine calls ``make_allocator(config, BlockAllocator,
    OutOfBlocksError)``."""
    if config.admission_policy == "on_demand":
        return free_list(config.num_blocks, config.block_size)
    return BuddyAllocator(config.num_blocks, config.block_size, out_of_blocks)
