"""L3 engine: many requests in flight, one flat batch per step (continuous batching).

    step:  scheduler.schedule()  -> which requests run, and how many tokens each (decode tokens,
                                    prefill chunks, recomputes after a preemption)
           prepare()             -> the tokens packed back to back, with positions, slots, block
                                    tables, context lengths and the rows that need logits
           model.forward()       -> one forward call for all of them
           scheduler.update()    -> append each finished row's greedy token, finish who is done

Requests join (``add_request``) and leave (eos, max_new_tokens, ``abort``) between steps; a finished
request's blocks go straight back to the free list. ``generate`` submits every prompt at once and
steps until all are done; ``add_request`` + ``step`` let a caller feed requests in over time.

Left out on purpose: sampling (greedy only), streaming outputs to callers, an attention kernel that
reads blocks in place (L4), and sharing blocks between requests (L5).
"""

from __future__ import annotations

import functools
import itertools

import torch

from kvcourse.model import Transformer
from kvcourse.model_store import resolve_model_dir
from kvcourse.requests import check_requests
from kvcourse.stats import KvUsage

from .attention import attention
from .cache import BlockAllocator, ForwardMeta, KvPool, Request, blocks_needed, slots
from .scheduler import Batch, Scheduler


class Engine:
    def __init__(
        self,
        model_dir=None,
        block_size: int = 16,
        num_blocks: int | None = None,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int | None = None,
        prefill_chunk_size: int | None = None,
        max_model_len: int | None = None,
    ):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.model_dir = resolve_model_dir(model_dir)
        self.model = Transformer.from_dir(self.model_dir)
        cfg = self.model.cfg
        self.max_model_len = (
            min(2048, cfg.max_position_embeddings) if max_model_len is None else max_model_len
        )
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_model_len > cfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's max_position_embeddings="
                f"{cfg.max_position_embeddings}"
            )
        if max_num_batched_tokens is None:
            max_num_batched_tokens = self.max_model_len
        if prefill_chunk_size is None and max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without prefill_chunk_size a whole prompt must fit one step, but max_num_batched_tokens="
                f"{max_num_batched_tokens} < max_model_len={self.max_model_len}"
            )
        if num_blocks is None:  # L1's bytes (one max_model_len request), now shared by every request
            num_blocks = blocks_needed(self.max_model_len, block_size)
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.pool = KvPool(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.scheduler = Scheduler(
            self.allocator,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            prefill_chunk_size=prefill_chunk_size,
            eos_ids=cfg.eos_token_ids,
        )
        self.attention = attention  # the attend step; L4 swaps in a kernel that reads blocks in place
        self.num_steps = 0
        self.peak_live_tokens = 0  # most positions whose K/V were in the pool at once
        self._ids = itertools.count()

    @property
    def usage(self) -> KvUsage:
        """Pool bytes versus the peak bytes holding live tokens, since the engine was built."""
        return KvUsage(self.pool.nbytes, self.peak_live_tokens * self.model.cfg.kv_bytes_per_token())

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    def check_fits(self, prompt: list[int], max_new_tokens: int, label: str = "request") -> None:
        """Refuse a request that could never run: longer than max_model_len, or more than the pool."""
        total = len(prompt) + max_new_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"{label}: {len(prompt)} prompt tokens + max_new_tokens {max_new_tokens} = {total} "
                f"exceeds max_model_len={self.max_model_len}"
            )
        block_size, pool_blocks = self.allocator.block_size, self.allocator.num_blocks
        if blocks_needed(total, block_size) > pool_blocks:
            raise ValueError(
                f"{label}: {total} tokens need {blocks_needed(total, block_size)} blocks of "
                f"{block_size}, but the pool has only {pool_blocks} blocks"
            )

    def add_request(
        self, prompt_ids: list[int], max_new_tokens: int, *, priority: int = 0, ignore_eos: bool = False
    ) -> Request:
        """Submit one request; it joins the batch at a coming step. Its ``output_ids`` grow as it runs."""
        check_requests([prompt_ids], max_new_tokens, self.model.cfg.vocab_size)
        self.check_fits(prompt_ids, max_new_tokens)
        req = Request(
            next(self._ids), list(prompt_ids), max_new_tokens, ignore_eos=ignore_eos, priority=priority
        )
        self.scheduler.add(req)
        return req

    def abort(self, request_id: int) -> Request:
        return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def prepare(self, batch: Batch) -> tuple[torch.Tensor, ForwardMeta]:
        """Pack the scheduled tokens of every request into one flat batch, and describe it."""
        block_size = self.allocator.block_size
        token_ids, positions, slot_mapping, logits_at = [], [], [], []
        cu_q_lens, context_lens = [0], []
        for req, n in batch:
            start, end = req.num_computed_tokens, req.num_computed_tokens + n
            token_ids += req.all_ids[start:end]
            positions += range(start, end)
            slot_mapping += slots(req.block_table, start, end, block_size)
            cu_q_lens.append(cu_q_lens[-1] + n)
            context_lens.append(end)
            if end == req.num_tokens:  # its last known token runs: that row's logits give the next one
                logits_at.append(cu_q_lens[-1] - 1)
        width = max(len(req.block_table) for req, _ in batch)
        block_tables = [req.block_table + [-1] * (width - len(req.block_table)) for req, _ in batch]
        meta = ForwardMeta(
            positions=torch.tensor(positions),  # (T,)
            slot_mapping=torch.tensor(slot_mapping),  # (T,)
            block_tables=torch.tensor(block_tables),  # (B, width)
            context_lens=torch.tensor(context_lens),  # (B,)
            cu_q_lens=torch.tensor(cu_q_lens),  # (B + 1,)
            logits_at=torch.tensor(logits_at, dtype=torch.long),  # (N,), N may be 0
        )
        return torch.tensor(token_ids), meta

    def step(self) -> list[Request]:
        """Run one forward call over the scheduled batch. Returns the requests it finished."""
        batch = self.scheduler.schedule()
        if not batch:
            return []
        token_ids, meta = self.prepare(batch)
        attend = functools.partial(self.attention, self.pool, meta)
        logits = self.model.forward(token_ids, meta.positions, attend, logits_at=meta.logits_at)  # (N, vocab)
        live = sum(r.num_computed_tokens for r in self.scheduler.running) + len(token_ids)
        self.peak_live_tokens = max(self.peak_live_tokens, live)
        self.num_steps += 1
        return self.scheduler.update(batch, logits.argmax(-1).tolist())

    def generate(
        self, prompts: list[list[int]], max_new_tokens: int | list[int], *, ignore_eos: bool = False
    ) -> list[list[int]]:
        """Submit every prompt at once and step until all requests finish; new tokens in input order."""
        budgets = check_requests(prompts, max_new_tokens, self.model.cfg.vocab_size)
        for i, (prompt, budget) in enumerate(zip(prompts, budgets)):
            self.check_fits(prompt, budget, f"prompt {i}")
        reqs = [self.add_request(p, b, ignore_eos=ignore_eos) for p, b in zip(prompts, budgets)]
        while self.has_unfinished():
            self.step()
        return [req.output_ids for req in reqs]
