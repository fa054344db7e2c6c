"""L5 engine: L4's engine with blocks shared between sequences.

    step:  scheduler.schedule()  -> which sequences run, and how many tokens each (decode tokens,
                                    prefill chunks, recomputes after a preemption); a new request first
                                    shares the leading blocks the prefix cache holds, and skips them
           prepare()             -> the tokens packed back to back, with positions, slots, block
                                    tables, context lengths and the rows that need logits
           model.forward()       -> one forward call for all of them; each layer's attention is one
                                    kernel call over the whole batch (``attention.py``)
           scheduler.update()    -> sample each row's next token (n samples: cloned first), finish who is done

Requests join (``add_request``) and leave (eos, max_new_tokens, ``abort``) between steps; a finished
sequence's blocks go straight back to the free list. ``generate`` submits every prompt at once and
steps until all are done; ``add_request`` + ``step`` let a caller feed requests in over time.

``device`` ("cpu", "cuda", ...) is where the weights and the pool live; ``prepare`` makes the step's
tensors there. A step's one trip back to the host is its sampled tokens, which the scheduler needs.

Its options (``OPTIONS``) are checked, and the pool sized, once, in ``kvcourse.engine_config``: a pool
left to its default starts with L1's bytes, and ``generate`` grows it, if need be, to run its requests
side by side (``fit_pool``); a pool given in blocks or bytes is never grown.

``kernel``, ``num_splits`` and ``cuda_graphs`` choose a fast path (``fast/``: compiled kernels,
split-KV, decode graphs); ``kernel="torch"`` with one split is the readable path, and the defaults,
``"auto"`` and ``None``, take the fastest this device has (on a GPU: the Triton kernel, decode graphs).

``enable_prefix_caching=False`` turns the prefix cache off; ``stats()`` shows the sharing.

``generate_samples`` asks for ``n`` samples of each prompt, cloned from one prefill (or as n requests
seeded as the clones are); ``step`` makes the block copies the scheduler names for them.
``generate_beams`` is beam search, an optional wing beside the lesson (``beams/``).

Left out on purpose: streaming outputs to callers, stop strings, and returning logprobs.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import replace

import torch

from kvcourse.devices import resolve_device
from kvcourse.engine_config import ALL_OPTIONS, EngineConfig
from kvcourse.model import Transformer
from kvcourse.model_store import resolve_model_dir
from kvcourse.sampling import BeamParams, SamplingParams
from kvcourse.stats import EngineStats, UsageMeter

from . import beams
from .allocator import BlockAllocator
from .attention import ForwardMeta, attention
from .cache import KvPool
from .fast import FastPath
from .scheduler import Batch, Scheduler
from .sequence import Sequence, slots


class Engine:
    # the shared options it takes: all but admission_policy (the vLLM paper's Orca baselines reserve one
    # run of blocks per request, where L5 shares blocks between sequences: they are L3's and L4's)
    OPTIONS = tuple(name for name in ALL_OPTIONS if name != "admission_policy")

    def __init__(
        self,
        model_dir=None,
        device="cpu",
        *,
        enable_prefix_caching: bool = True,
        kernel: str = "auto",
        num_splits: int | str = "auto",
        cuda_graphs: bool | None = None,
        **options,
    ):
        self.device = resolve_device(device)
        self.model_dir = resolve_model_dir(model_dir)
        self.model = Transformer.from_dir(self.model_dir, self.device)
        self.config = config = EngineConfig.build(self.model, options, self.OPTIONS)
        cfg = self.model.cfg
        num_blocks, block_size = config.num_blocks, config.block_size  # checked; the pool sized
        self.allocator = BlockAllocator(num_blocks, block_size)
        max_num_seqs, max_model_len = config.max_num_seqs, config.max_model_len  # what sizes decode graphs
        self.fast = FastPath(  # fast/: the kernel attention calls, and decode graphs
            self.device, kernel, num_splits, cuda_graphs, max_num_seqs, max_model_len, block_size
        )
        padding = self.fast.padding_blocks  # blocks past the allocator's last id (decode graphs' padding)
        self.pool = KvPool(
            cfg.num_layers, num_blocks + padding, block_size, cfg.num_kv_heads, cfg.head_dim, self.device
        )
        self.scheduler = Scheduler(self.allocator, config, cfg.eos_token_ids, enable_prefix_caching)
        self.meter = UsageMeter()  # live vs held positions (a shared block's rows once), step by step
        self.num_steps = self.num_tokens_run = 0
        self._ids = itertools.count()

    def prepare(self, batch: Batch) -> tuple[torch.Tensor, ForwardMeta]:
        """Pack the scheduled tokens of every sequence into one flat batch, and describe it."""
        block_size = self.allocator.block_size
        token_ids, positions, slot_mapping, logits_at = [], [], [], []
        cu_q_lens, context_lens = [0], []
        for seq, num_new in batch:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
            token_ids += seq.all_ids[start:end]
            positions += range(start, end)
            slot_mapping += slots(seq.block_table, start, end, block_size)
            cu_q_lens.append(cu_q_lens[-1] + num_new)
            context_lens.append(end)
            if end == seq.num_tokens:  # its last known token runs: that row's logits give the next one
                logits_at.append(cu_q_lens[-1] - 1)
        width = max(len(seq.block_table) for seq, _ in batch)
        block_tables = [seq.block_table + [-1] * (width - len(seq.block_table)) for seq, _ in batch]
        device = self.device  # every tensor of the step is made there, once
        meta = ForwardMeta(
            positions=torch.tensor(positions, device=device),  # (T,)
            slot_mapping=torch.tensor(slot_mapping, device=device),  # (T,)
            block_tables=torch.tensor(block_tables, device=device),  # (B, width)
            context_lens=torch.tensor(context_lens, device=device),  # (B,)
            cu_q_lens=torch.tensor(cu_q_lens, device=device),  # (B + 1,)
            logits_at=torch.tensor(logits_at, dtype=torch.long, device=device),  # (N,), N may be 0
        )
        return torch.tensor(token_ids, device=device), meta

    def step(self) -> list[Sequence]:
        """Run one forward call over the scheduled batch. Returns the sequences it finished."""
        batch = self.scheduler.schedule()
        if not batch:
            return []
        token_ids, meta = self.prepare(batch)
        logits = self.fast.run(self.forward, token_ids, meta, self.pool)  # (N, vocab): forward, or a graph
        self._count(batch, len(token_ids))
        done, copies = self.scheduler.update(batch, logits)  # sampled there: the tokens come back to the host
        for src, dst in copies:  # a clone's partial block: the scheduler names it, the pool copies it
            self.pool.copy_block(src, dst)
        return done

    def forward(self, token_ids: torch.Tensor, meta: ForwardMeta) -> torch.Tensor:
        """The model over one packed batch, attention through the kernel: (N, vocab) logits of the rows
        ``meta.logits_at`` names."""
        attend = functools.partial(attention, self.pool, meta, kernel=self.fast.kernel)
        return self.model.forward(token_ids, meta.positions, attend, logits_at=meta.logits_at)

    def _count(self, batch: Batch, tokens: int) -> None:
        """After a forward: the step counters, and live vs held positions of the running sequences,
        each position of a shared block counted once."""
        self.num_steps += 1
        self.num_tokens_run += tokens
        block_size = self.allocator.block_size
        scheduled = dict(batch)  # sequence -> tokens it just computed
        filled: dict[int, int] = {}  # block id -> rows holding K/V
        for seq in self.scheduler.running:
            length = seq.num_computed_tokens + scheduled.get(seq, 0)
            for i, block in enumerate(seq.block_table):
                filled[block] = max(filled.get(block, 0), min(block_size, length - i * block_size))
        held = self.allocator.num_used
        self.meter.step(sum(filled.values()), held * block_size, held, self.allocator.num_shared)

    def stats(self) -> EngineStats:
        """KV pool vs live, blocks held and shared, and the scheduler's counters, since the engine was built."""
        per_token = self.model.cfg.kv_bytes_per_token()
        return EngineStats(
            kv_bytes_pool=self.pool.nbytes,
            kv_bytes_live=self.meter.live_peak * per_token,
            kv_utilization=self.meter.utilization,
            block_size=self.allocator.block_size,
            num_blocks=self.allocator.num_blocks,
            blocks_held=self.meter.blocks_held_peak,
            blocks_shared=self.meter.blocks_shared_peak,
            steps=self.num_steps,
            tokens_run=self.num_tokens_run,
            prefix_cache_hits=self.scheduler.prefix_cache_hits,
            preemptions=self.scheduler.num_preemptions,
            clones=self.scheduler.num_clones,
            device=str(self.device),
            kernel=self.fast.name,
            max_num_seqs=self.config.max_num_seqs,
            kv_sizing=self.config.sizing_line,
        )

    def fit_pool(self, lengths: list[int]) -> None:
        """Grow a pool left to its default, between runs, to hold requests of these total lengths
        (prompt + max_new_tokens) side by side (``EngineConfig.pool_blocks``)."""
        missing = self.config.pool_blocks(lengths) - self.allocator.num_blocks
        if self.config.grows_pool and missing > 0 and not self.has_unfinished():
            self.allocator.grow(missing)
            self.pool.grow(missing)

    def add_request(
        self, prompt_ids, max_new_tokens, *, priority=0, ignore_eos=False, n=1, sampling=None
    ) -> Sequence:
        """Submit one request for ``n`` samples (greedy by default); it joins the batch at a coming step.
        Its ``output_ids`` grow as it runs; with n > 1 it is sample 0, and its clones (same request_id)
        appear in the scheduler's queues when its prefill ends."""
        [max_new_tokens] = self.config.check_requests([prompt_ids], max_new_tokens, label="request", n=n)
        return self._submit(prompt_ids, max_new_tokens, priority, ignore_eos, n, sampling)

    def _submit(self, prompt_ids, max_new_tokens, priority=0, ignore_eos=False, n=1, sampling=None, group=None):
        """Queue a request already checked; with a ``group``, its sequences run as one (``beams/``)."""
        sampling = sampling or SamplingParams()  # greedy
        seq = Sequence(next(self._ids), list(prompt_ids), max_new_tokens, ignore_eos, priority, n, sampling)
        self.scheduler.add(seq, group)
        return seq

    def abort(self, request_id: int) -> list[Sequence]:
        return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def generate(
        self, prompts: list[list[int]], max_new_tokens: int | list[int], *, ignore_eos: bool = False
    ) -> list[list[int]]:
        """Submit every prompt at once and step until all requests finish; new tokens in input order
        (greedy, one sample per prompt)."""
        return [s[0] for s in self.generate_samples(prompts, max_new_tokens, ignore_eos=ignore_eos)]

    def generate_samples(self, prompts, max_new_tokens, *, n=1, sampling=None, share=True, ignore_eos=False):
        """``n`` samples of every prompt: result[i][j] is the new tokens of sample j of prompt i. share=True:
        one request per prompt, prefilled once and cloned; share=False: n requests per prompt, request j
        seeded ``sampling.seed_of(j)`` as a clone seeds sample j, so both ways give the same tokens."""
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an integer >= 1, got {n!r}")
        max_new_tokens = self.config.check_requests(prompts, max_new_tokens, n=n if share else 1)  # and the pool
        self.fit_pool([len(p) + b for p, b in zip(prompts, max_new_tokens, strict=True)] * n)
        sampling = sampling or SamplingParams()
        params = [sampling] if share else [replace(sampling, seed=sampling.seed_of(j)) for j in range(n)]
        requests = [  # per prompt: one request cloned into n, or n requests seeded apart
            [self._submit(p, b, ignore_eos=ignore_eos, n=n if share else 1, sampling=s) for s in params]
            for p, b in zip(prompts, max_new_tokens, strict=True)
        ]
        while self.has_unfinished():
            self.step()
        done = sorted(self.scheduler.finished, key=Sequence.sort_key)  # each request's samples in order
        return [[d.output_ids for r in rs for d in done if d.request_id == r.request_id] for rs in requests]

    def generate_beams(self, prompts, max_new_tokens, *, sampling=None, **beam):
        """Beam search (``BeamParams``), as HF's ``generate(num_beams=k)``: ``beams/``, an optional wing."""
        return beams.generate_beams(self, prompts, max_new_tokens, sampling, BeamParams(**beam))
