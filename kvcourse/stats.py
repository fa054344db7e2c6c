"""The statistics every engine reports the same way: ``Engine.stats() -> EngineStats``.

One interface for every stage, so that tools (the CLI, the smoke report, the benchmarks) never ask
which stage they hold. A field a stage has no use for stays 0 (L1 has no blocks; only L3+ preempt;
only L5/L6 clone; only engines that compile count compiles). Counters cover everything since the
engine was built; ``kv_bytes_live``, ``blocks_held`` and ``blocks_shared`` are peaks. ``device``,
``kernel`` and the sizes say how the engine was set up, which ``describe()`` puts in one line.

Four words for KV memory, as the vLLM paper (Kwon et al., SOSP 2023) uses them:

- pool: all the memory set aside for K/V, whether in use or not (``kv_bytes_pool``: L1's cache,
  the paged stages' block pool);
- held: positions of that memory given to running sequences: L1 holds ``max_model_len`` per
  request; a paged stage holds whole blocks (blocks held x ``block_size``);
- live: held positions whose K/V are in the cache, a shared block's rows counted once;
- reserved: held positions not yet live, kept for tokens a request will produce later (the paper's
  "reservation"; held positions no token will ever fill are its "internal fragmentation").

``kv_utilization`` = (live summed over steps) / (held summed over steps): 1.0 wastes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def format_bytes(n: float) -> str:
    """Human-readable size in binary units.

    Examples: ``format_bytes(512) -> '512 B'``, ``format_bytes(46080) -> '45.0 KiB'``.
    """
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class EngineStats:
    kv_bytes_pool: int  # bytes set aside for K/V: the whole cache or pool
    kv_bytes_live: int  # most bytes holding live tokens' K/V at once
    kv_utilization: float  # live positions / held positions, summed over steps (0.0 before any step)
    block_size: int = 0  # tokens per block (0: the stage has no blocks)
    num_blocks: int = 0  # blocks in the pool
    blocks_held: int = 0  # most blocks held at once
    blocks_shared: int = 0  # most blocks held by two or more sequences at once
    steps: int = 0  # forward calls
    tokens_run: int = 0  # tokens through the model (prefill the prefix cache skipped is not run)
    preemptions: int = 0
    clones: int = 0  # requests split into their n samples (clones sharing their prompt blocks)
    prefix_cache_hits: int = 0  # blocks shared at admission instead of computed
    compiles: dict[str, int] = field(default_factory=dict)  # traces per compiled function
    device: str = "cpu"  # where the weights and the cache live
    kernel: str = ""  # the attention kernel, where a stage has a choice
    max_num_seqs: int = 0  # most sequences run at once (0: one request at a time)
    kv_sizing: str = ""  # how kv_cache_bytes were sized into blocks ("": a pool sized in blocks)
    admission_policy: str = ""  # what admission holds per request ("" or "on_demand": blocks on demand)

    def describe(self) -> str:
        """How the engine was set up, in one line, e.g. ``cpu, kernel cpp, 864 blocks of 16 (637.9 MiB
        of KV), at most 32 sequences at once``; with a pool sized in bytes, its sizing (``describe_sizing``) before
        the blocks."""
        kv = f"{format_bytes(self.kv_bytes_pool)} of KV"
        if self.num_blocks:
            kv = f"{self.num_blocks} blocks of {self.block_size} ({kv})"
        if self.kv_sizing:
            kv = f"{self.kv_sizing}: {kv}"
        if self.admission_policy not in ("", "on_demand"):
            kv += f", admission_policy {self.admission_policy}"
        kernel = [f"kernel {self.kernel}"] if self.kernel else []
        batch = "one request at a time"
        if self.max_num_seqs:
            batch = f"at most {self.max_num_seqs} sequences at once"
        return ", ".join([self.device, *kernel, kv, batch])

    def __str__(self) -> str:
        """One line, e.g. ``KV pool 90.0 MiB, live 1.2 MiB at peak, 96.3% utilized; 34/130 blocks
        held at peak, 0 shared; 87 steps, 0 preemptions``."""
        parts = [
            f"KV pool {format_bytes(self.kv_bytes_pool)}, live {format_bytes(self.kv_bytes_live)} "
            f"at peak, {100 * self.kv_utilization:.1f}% utilized"
        ]
        if self.num_blocks:
            parts.append(
                f"{self.blocks_held}/{self.num_blocks} blocks held at peak, {self.blocks_shared} shared"
            )
        counts = f"{self.steps} steps, {self.preemptions} preemptions"
        if self.clones or self.prefix_cache_hits:
            counts += f", {self.clones} clones, {self.prefix_cache_hits} prefix-cache block hits"
        if self.compiles:
            counts += ", compiles " + ", ".join(f"{k} {v}" for k, v in sorted(self.compiles.items()))
        return "; ".join([*parts, counts])


@dataclass
class UsageMeter:
    """The running sums behind ``EngineStats``' utilization and peaks; each engine feeds it per step.

    Example: two steps with (live, held) = (3, 16) and (13, 16) -> utilization 16 / 32 = 0.5.
    """

    live_sum: int = 0
    held_sum: int = 0
    live_peak: int = 0  # positions
    blocks_held_peak: int = 0
    blocks_shared_peak: int = 0

    def step(self, live: int, held: int, blocks_held: int = 0, blocks_shared: int = 0) -> None:
        self.live_sum += live
        self.held_sum += held
        self.live_peak = max(self.live_peak, live)
        self.blocks_held_peak = max(self.blocks_held_peak, blocks_held)
        self.blocks_shared_peak = max(self.blocks_shared_peak, blocks_shared)

    @property
    def utilization(self) -> float:
        return self.live_sum / self.held_sum if self.held_sum else 0.0
