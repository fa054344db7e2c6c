"""L3 engine: many sequences in flight, one flat batch per step (continuous batching).

    step:  scheduler.schedule()  -> which sequences run, and how many tokens each (decode tokens,
                                    prefill chunks, recomputes after a preemption)
           prepare()             -> the tokens packed back to back, with positions, slots, block
                                    tables, context lengths and the rows that need logits
           model.forward()       -> one forward call for all of them
           scheduler.update()    -> append each finished row's greedy token, finish who is done

Requests join (``add_request``) and leave (eos, max_new_tokens, ``abort``) between steps; a finished
sequence's blocks go straight back to the free list. ``generate`` submits every prompt at once and
steps until all are done; ``add_request`` + ``step`` let a caller feed requests in over time.

``device`` ("cpu", "cuda", ...) is where the weights and the pool live; ``prepare`` makes the step's
tensors there. A step's one trip back to the host is its greedy tokens, which the scheduler needs.

Its options (``OPTIONS``) are checked, and the pool sized, once, in ``kvcourse.engine_config``: a pool
left to its default starts with L1's bytes, and ``generate`` grows it, if need be, to run its requests
side by side (``fit_pool``); a pool given in blocks or bytes is never grown.

Left out on purpose: sampling (greedy only), streaming outputs to callers, an attention kernel that
reads blocks in place (L4), and sharing blocks between sequences (L5).
"""

from __future__ import annotations

import functools
import itertools

import torch

from kvcourse.devices import resolve_device
from kvcourse.engine_config import ALL_OPTIONS, EngineConfig
from kvcourse.model import Transformer
from kvcourse.model_store import resolve_model_dir
from kvcourse.orca import make_allocator
from kvcourse.stats import EngineStats, UsageMeter

from .allocator import BlockAllocator, OutOfBlocksError
from .attention import ForwardMeta, attention
from .cache import KvPool
from .scheduler import Batch, Scheduler
from .sequence import Sequence, slots


class Engine:
    OPTIONS = ALL_OPTIONS  # the shared options it takes: all of them, the scheduler's included

    def __init__(self, model_dir=None, device="cpu", **options):
        self.device = resolve_device(device)
        self.model_dir = resolve_model_dir(model_dir)
        self.model = Transformer.from_dir(self.model_dir, self.device)
        self.config = config = EngineConfig.build(self.model, options, self.OPTIONS)
        cfg = self.model.cfg
        num_blocks, block_size = config.num_blocks, config.block_size  # checked; the pool sized
        self.allocator = make_allocator(config, BlockAllocator, OutOfBlocksError)  # free list, or Orca's buddy
        self.pool = KvPool(
            cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, self.device
        )
        self.scheduler = Scheduler(self.allocator, config, cfg.eos_token_ids)
        self.meter = UsageMeter()  # live vs held positions, step by step
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
        attend = functools.partial(attention, self.pool, meta)
        logits = self.model.forward(token_ids, meta.positions, attend, logits_at=meta.logits_at)  # (N, vocab)
        self._count(len(token_ids))
        return self.scheduler.update(batch, logits.argmax(-1).tolist())  # the tokens back to the host

    def _count(self, tokens: int) -> None:
        """After a forward: the step counters, and live vs held positions of the running sequences."""
        self.num_steps += 1
        self.num_tokens_run += tokens
        live = sum(seq.num_computed_tokens for seq in self.scheduler.running) + tokens
        held = self.allocator.num_used
        self.meter.step(live, held * self.allocator.block_size, held)

    def stats(self) -> EngineStats:
        """KV pool vs live, blocks held and the step counters, since the engine was built."""
        per_token = self.model.cfg.kv_bytes_per_token()
        return EngineStats(
            kv_bytes_pool=self.pool.nbytes,
            kv_bytes_live=self.meter.live_peak * per_token,
            kv_utilization=self.meter.utilization,
            block_size=self.allocator.block_size,
            num_blocks=self.allocator.num_blocks,
            blocks_held=self.meter.blocks_held_peak,
            steps=self.num_steps,
            tokens_run=self.num_tokens_run,
            preemptions=self.scheduler.num_preemptions,
            device=str(self.device),
            max_num_seqs=self.config.max_num_seqs,
            kv_sizing=self.config.sizing_line,
            admission_policy=self.config.admission_policy,
        )

    def fit_pool(self, lengths: list[int]) -> None:
        """Grow a pool left to its default, between runs, to hold requests of these total lengths
        (prompt + max_new_tokens) side by side (``EngineConfig.pool_blocks``)."""
        missing = self.config.pool_blocks(lengths) - self.allocator.num_blocks
        if self.config.grows_pool and missing > 0 and not self.has_unfinished():
            self.allocator.grow(missing)
            self.pool.grow(missing)

    def add_request(
        self, prompt_ids: list[int], max_new_tokens: int, *, priority: int = 0, ignore_eos: bool = False
    ) -> Sequence:
        """Submit one request; it joins the batch at a coming step. Its ``output_ids`` grow as it runs."""
        [max_new_tokens] = self.config.check_requests([prompt_ids], max_new_tokens, label="request")
        return self._submit(prompt_ids, max_new_tokens, priority, ignore_eos)

    def _submit(self, prompt_ids: list[int], max_new_tokens: int, priority=0, ignore_eos=False) -> Sequence:
        """Queue a request already checked."""
        seq = Sequence(next(self._ids), list(prompt_ids), max_new_tokens, ignore_eos, priority)
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: int) -> Sequence:
        return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def generate(
        self, prompts: list[list[int]], max_new_tokens: int | list[int], *, ignore_eos: bool = False
    ) -> list[list[int]]:
        """Submit every prompt at once and step until all requests finish; new tokens in input order."""
        max_new_tokens = self.config.check_requests(prompts, max_new_tokens)  # and each fits the pool
        requests = list(zip(prompts, max_new_tokens, strict=True))
        self.fit_pool([len(p) + b for p, b in requests])
        seqs = [self._submit(p, b, ignore_eos=ignore_eos) for p, b in requests]
        while self.has_unfinished():
            self.step()
        return [seq.output_ids for seq in seqs]
