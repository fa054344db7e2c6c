"""One config for the options the engines share, checked once (nano-vllm's ``Config``; not lesson material).

An engine takes its shared options as keywords, ``Engine(model_dir, block_size=8, max_num_seqs=4)``,
and turns them into an ``EngineConfig`` with ``EngineConfig.build(model, options, takes)``. ``takes``
names the options that stage has (L1 only ``max_model_len``; L2 adds the pool's ``block_size`` and
``num_blocks``; L3 on take them all); any other is refused. ``build`` resolves the defaults that
depend on the model and checks every value once, each error naming the option and its value:

- ``max_model_len``: the longest request (prompt + max_new_tokens); None: min(2048, the model's
  max_position_embeddings) (``kvcourse.limits.resolve_max_model_len``);
- the pool, sized once: ``num_blocks`` blocks of ``block_size`` tokens, or bytes,
  ``kv_cache_bytes`` (or ``gpu_memory_utilization``: that share of a CUDA device's memory), sized
  into blocks and never grown (``kvcourse.limits.size_pool``); with neither, L1's bytes (one
  ``max_model_len`` sequence), which a batching engine's ``generate`` grows to fit its requests
  (``grows_pool``, ``pool_blocks``);
- scheduling: at most ``max_num_seqs`` sequences and ``max_num_batched_tokens`` tokens a step (None:
  max_model_len), prompts fed ``prefill_chunk_size`` tokens a step (None: whole, so a whole prompt
  must fit one step), and ``admission_policy``, what admission holds per request: ``on_demand``
  (paging) or one of the vLLM paper's Orca baselines, a contiguous reservation from a buddy allocator
  (``kvcourse.orca``), which serve a fixed KV memory: they need the pool given.

A request meets one check on its way in, ``check_requests``: its ids and lengths, and whether the
pool could ever hold it, its reservation included. The scheduler (L3 on) is handed the config and
reads its limits there: ``Scheduler(allocator, config)``.

Left out on purpose: options only one stage has (L4's kernel choice, L5's prefix cache), which stay
keyword parameters of that stage's engine, and anything about a particular request (its
``max_new_tokens``, priority, sampling), which goes with the request.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from kvcourse.limits import KvSizing, check_blocks, check_requests, resolve_max_model_len, size_pool
from kvcourse.orca import ADMISSION_POLICIES, BuddyAllocator, held_at_admission, next_pow2


@dataclass(frozen=True)
class EngineConfig:
    """The options the engines share, checked, and the pool they size.

    An engine makes its config with ``build``, which resolves every None that depends on the model.
    Example, SmolLM2-135M (max_position_embeddings 8192): ``EngineConfig.build(model, {"block_size": 8},
    ALL_OPTIONS)`` has max_model_len 2048, max_num_batched_tokens 2048, num_blocks 256 (2048 positions
    in blocks of 8: L1's bytes) and grows_pool True; ``{"max_num_seqs": 0}`` raises ``max_num_seqs must
    be >= 1, got 0``. Made directly, as tests and exercises make one for a ``Scheduler``
    (``EngineConfig(max_num_seqs=4, max_num_batched_tokens=64)``), it is checked the same way and keeps
    what it is not given at its default.
    """

    max_model_len: int | None = None  # the longest request, prompt + max_new_tokens
    block_size: int = 16  # tokens a block
    num_blocks: int | None = None  # blocks in the pool (its first size, when it grows)
    kv_cache_bytes: int | None = None  # the pool in bytes: as many blocks as they hold
    gpu_memory_utilization: float | None = None  # the pool as a share of a CUDA device's memory
    admission_policy: str = "on_demand"  # what admission holds per request (``held_at_admission``)
    max_num_seqs: int = 32  # most sequences running at once
    max_num_batched_tokens: int | None = None  # most tokens a step
    prefill_chunk_size: int | None = None  # a prompt's tokens a step (None: the whole prompt)
    # resolved by ``build``, not options:
    vocab_size: int = 0
    sizing: KvSizing | None = None  # how kv_cache_bytes were sized into blocks (None: sized in blocks)
    grows_pool: bool = False  # the pool was left to its default: ``generate`` grows it

    def __post_init__(self):
        for name in ("block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be >= 1, got {value!r}")
        chunk = self.prefill_chunk_size
        if chunk is not None and (not isinstance(chunk, int) or chunk < 1):
            raise ValueError(f"prefill_chunk_size must be >= 1 or None (no chunking), got {chunk!r}")
        if self.admission_policy not in ADMISSION_POLICIES:
            raise ValueError(
                f"admission_policy must be one of {ADMISSION_POLICIES}, got {self.admission_policy!r}"
            )
        if self.admission_policy in ("pow2", "max") and self.max_model_len is None:
            raise ValueError(f"admission_policy {self.admission_policy!r} needs max_model_len")

    @classmethod
    def build(cls, model, options: dict, takes: tuple[str, ...]) -> EngineConfig:
        """The config of an engine running ``model`` (a ``kvcourse.model.Transformer``), made from the
        keyword ``options`` it was given, which must be among the ``takes`` it has: checked, with every
        default resolved."""
        for name, value in options.items():
            if name not in takes:
                raise TypeError(f"unknown option {name}={value!r}: this engine takes {', '.join(takes)}")
        max_model_len = resolve_max_model_len(options.get("max_model_len"), model.cfg)
        given = cls(**{**options, "max_model_len": max_model_len})
        step = given.max_num_batched_tokens or max_model_len  # a step's tokens: None means max_model_len
        if given.prefill_chunk_size is None and step < max_model_len:
            raise ValueError(
                f"without prefill_chunk_size a whole prompt must fit one step, but max_num_batched_tokens="
                f"{step} < max_model_len={max_model_len}"
            )
        if given.admission_policy != "on_demand" and not (
            given.num_blocks or given.kv_cache_bytes or given.gpu_memory_utilization
        ):
            raise ValueError(
                f"admission_policy {given.admission_policy!r} serves a fixed KV memory: give the pool "
                "(num_blocks, kv_cache_bytes or gpu_memory_utilization)"
            )
        num_blocks, sizing = size_pool(  # bytes: sized into blocks once, never grown
            given.num_blocks,
            given.kv_cache_bytes,
            given.gpu_memory_utilization,
            given.block_size,
            model,
            step,
        )
        default = -(-max_model_len // given.block_size)  # L1's bytes: one max_model_len sequence
        return replace(
            given,
            max_num_batched_tokens=step,
            num_blocks=default if num_blocks is None else num_blocks,
            vocab_size=model.cfg.vocab_size,
            sizing=sizing,
            grows_pool=num_blocks is None,
        )

    @property
    def sizing_line(self) -> str:
        """How kv_cache_bytes were sized into blocks, for ``stats()`` ("" for a pool sized in blocks)."""
        return self.sizing.line if self.sizing else ""

    def hold_len(self, prompt_len: int, max_new_tokens: int) -> int:
        """Positions a request holds blocks for from admission, under the admission policy (0 for
        on_demand): ``kvcourse.orca.held_at_admission``, its true output being ``max_new_tokens``."""
        return held_at_admission(self.admission_policy, prompt_len, max_new_tokens, self.max_model_len)

    def run_blocks(self, blocks: int) -> int:
        """Blocks a reservation of ``blocks`` takes: one buddy run of a power of two under an Orca
        policy, the blocks themselves on demand. Example, Orca: 7 -> 8; on demand: 7 -> 7."""
        return blocks if self.admission_policy == "on_demand" else next_pow2(blocks)

    def check_requests(
        self, prompts: list[list[int]], max_new_tokens: int | list[int], label: str = "prompt {i}", n: int = 1
    ) -> list[int]:
        """The one check of requests on their way in: ids, lengths (``kvcourse.limits.check_requests``)
        and the pool, which must hold each request alone, its reservation included (``check_blocks``),
        under an Orca policy as one buddy run no larger than the pool's largest (``run_blocks``); with
        ``n`` samples of each (L5's clones), n fits ``max_num_seqs`` and the clones' copies the pool.
        Returns one max_new_tokens per prompt. ``label`` names request i in errors.

        Example, blocks of 4 and a pool of 3: ``check_requests([[1] * 4, [1] * 10], 3)`` raises
        ``prompt 1: 13 tokens need 4 blocks of 4, but the pool has only 3 blocks``.
        """
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an integer >= 1, got {n!r}")
        max_new = check_requests(prompts, max_new_tokens, self.vocab_size, self.max_model_len, label)
        for i, (prompt, n_new) in enumerate(zip(prompts, max_new, strict=True)):
            total = max(len(prompt) + n_new, self.hold_len(len(prompt), n_new))  # what admission holds
            needed = -(-total // self.block_size)
            check_blocks(label.format(i=i), total, needed, self.block_size, self.num_blocks, self.sizing)
            run, largest = self.run_blocks(needed), BuddyAllocator.largest_run(self.num_blocks)
            if self.admission_policy != "on_demand" and run > largest:  # one buddy run, never in two
                raise ValueError(
                    f"{label.format(i=i)}: admission_policy {self.admission_policy!r} reserves {total} positions, "
                    f"a run of {run} blocks of {self.block_size}, but the largest run a pool of "
                    f"{self.num_blocks} blocks holds is {largest}"
                )
            if n > self.max_num_seqs:
                raise ValueError(f"{label.format(i=i)}: n={n} samples exceed max_num_seqs={self.max_num_seqs}")
            clones = -(-len(prompt) // self.block_size) + (n - 1) * (len(prompt) % self.block_size > 0)
            if clones > self.num_blocks:  # n samples of one prefill: a copy of its partial block each
                raise ValueError(
                    f"{label.format(i=i)}: cloning {n} samples needs {clones} blocks (the prompt's, plus a copy "
                    f"of its last partial block per extra sample), but the pool has only {self.num_blocks} blocks"
                )
        return max_new

    def pool_blocks(self, lengths: list[int]) -> int:
        """Blocks that hold requests of these total lengths (prompt + max_new_tokens) side by side: as many
        as ``max_num_seqs`` run at once, so the largest ``max_num_seqs`` of them.

        Example, block_size 16 and max_num_seqs 32: 40 requests of 104 positions need 7 blocks each,
        and 32 of them run at once: 224 blocks.
        """
        needed = sorted((-(-n // self.block_size) for n in lengths), reverse=True)
        return sum(needed[: self.max_num_seqs])


# every option an engine may take, in the order of the fields (the others are resolved by ``build``)
ALL_OPTIONS = tuple(
    f.name for f in fields(EngineConfig) if f.name not in ("vocab_size", "sizing", "grows_pool")
)
