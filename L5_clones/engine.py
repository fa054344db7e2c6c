"""L5 engine: L4's continuous-batching engine with shared blocks: n samples per prompt and a prefix cache.

    step:  scheduler.schedule()  -> which requests run, and how many tokens each; a new request first
                                    shares the leading blocks the prefix cache holds, and skips them
           prepare()             -> the tokens packed back to back, with positions, slots, block
                                    tables, context lengths and the rows that need logits
           model.forward()       -> one forward call for all of them (L4's paged kernel)
           scheduler.update()    -> sample each finished row's next token (a request with n > 1 is
                                    first forked into n sequences), finish who is done

``generate`` is L3/L4's greedy call. ``generate_samples`` asks for ``n`` samples per prompt with
``SamplingParams`` (temperature, top-k, top-p, seed): with ``share=True`` each prompt is one request
that prefills once and forks; with ``share=False`` its samples are n independent requests (sample i
seeded seed + i, as a fork seeds it), which is what the forked samples must equal token for token.
An engine built with ``enable_prefix_caching=False`` and asked with ``share=False`` shares nothing.

The memory side of the lesson is counted: ``peak_blocks_used``, ``peak_blocks_shared``,
``num_cached_blocks``/``num_cached_tokens`` (prefix-cache hits and the prefill they skipped),
``num_tokens_run``, ``num_forks`` and ``num_preemptions``; ``usage`` counts a shared block's tokens
once.

Left out on purpose: streaming, stop strings, beam search, returning logprobs, and everything L3 and
L4 leave out.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import replace

import torch

from kvcourse.model import Transformer
from kvcourse.model_store import resolve_model_dir
from kvcourse.requests import check_requests
from kvcourse.sampling import SamplingParams
from kvcourse.stats import KvUsage
from L4_paged_kernel.attention import attention
from L4_paged_kernel.engine import load_kernel

from .cache import BlockManager, ForwardMeta, KvPool, Request, blocks_needed, slots
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
        enable_prefix_caching: bool = True,
        kernel: str = "torch",
        num_splits: int = 1,
    ):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {num_splits}")
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
        self.manager = BlockManager(num_blocks, block_size)
        self.pool = KvPool(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.scheduler = Scheduler(
            self.manager,
            self.pool,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            prefill_chunk_size=prefill_chunk_size,
            eos_ids=cfg.eos_token_ids,
            enable_prefix_caching=enable_prefix_caching,
        )
        self.attention = functools.partial(attention, kernel=load_kernel(kernel), num_splits=num_splits)
        self.num_steps = 0
        self.num_tokens_run = 0  # tokens through the model: prefills (what the cache did not skip), decodes
        self.peak_live_tokens = 0  # most positions whose K/V were in the pool at once (shared: once)
        self.peak_blocks_used = 0  # most blocks held by running sequences at once
        self.peak_blocks_shared = 0  # most blocks held by two or more sequences at once
        self._ids = itertools.count()

    @property
    def usage(self) -> KvUsage:
        """Pool bytes versus the peak bytes holding live tokens, since the engine was built."""
        return KvUsage(self.pool.nbytes, self.peak_live_tokens * self.model.cfg.kv_bytes_per_token())

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    @property
    def num_forks(self) -> int:
        return self.scheduler.num_forks

    @property
    def num_cached_blocks(self) -> int:
        """Prefix-cache hits: blocks a new (or recomputing) request shared instead of computing."""
        return self.scheduler.num_cached_blocks

    @property
    def num_cached_tokens(self) -> int:
        """Prefill tokens the prefix cache skipped."""
        return self.scheduler.num_cached_blocks * self.manager.block_size

    def check_fits(self, prompt: list[int], max_new_tokens: int, label: str = "request", n: int = 1) -> None:
        """Refuse a request that could never run: longer than max_model_len, more than the pool, more
        samples than max_num_seqs, or a fork whose copies cannot fit beside the prompt."""
        total = len(prompt) + max_new_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"{label}: {len(prompt)} prompt tokens + max_new_tokens {max_new_tokens} = {total} "
                f"exceeds max_model_len={self.max_model_len}"
            )
        block_size, pool_blocks = self.manager.block_size, self.manager.num_blocks
        if blocks_needed(total, block_size) > pool_blocks:
            raise ValueError(
                f"{label}: {total} tokens need {blocks_needed(total, block_size)} blocks of "
                f"{block_size}, but the pool has only {pool_blocks} blocks"
            )
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"{label}: n must be an integer >= 1, got {n!r}")
        if n > self.scheduler.max_num_seqs:
            raise ValueError(f"{label}: n={n} samples exceed max_num_seqs={self.scheduler.max_num_seqs}")
        fork_blocks = blocks_needed(len(prompt), block_size) + (n - 1) * (len(prompt) % block_size > 0)
        if fork_blocks > pool_blocks:
            raise ValueError(
                f"{label}: forking {n} samples needs {fork_blocks} blocks (the prompt's, plus a copy of "
                f"its last partial block per extra sample), but the pool has only {pool_blocks} blocks"
            )

    def add_request(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        *,
        priority: int = 0,
        ignore_eos: bool = False,
        n: int = 1,
        sampling: SamplingParams | None = None,
    ) -> Request:
        """Submit one request for ``n`` samples (greedy by default); it joins the batch at a coming step.
        Its ``output_ids`` grow as it runs; with n > 1 it is sample 0, and its forks (same request_id)
        appear in the scheduler's queues when its prefill ends."""
        check_requests([prompt_ids], max_new_tokens, self.model.cfg.vocab_size)
        self.check_fits(prompt_ids, max_new_tokens, n=n)
        req = Request(
            next(self._ids),
            list(prompt_ids),
            max_new_tokens,
            ignore_eos=ignore_eos,
            priority=priority,
            n=n,
            sampling=sampling or SamplingParams(),
        )
        self.scheduler.add(req)
        return req

    def abort(self, request_id: int) -> list[Request]:
        return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def prepare(self, batch: Batch) -> tuple[torch.Tensor, ForwardMeta]:
        """Pack the scheduled tokens of every request into one flat batch, and describe it."""
        block_size = self.manager.block_size
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
        """Run one forward call over the scheduled batch. Returns the sequences it finished."""
        batch = self.scheduler.schedule()
        if not batch:
            return []
        token_ids, meta = self.prepare(batch)
        attend = functools.partial(self.attention, self.pool, meta)
        logits = self.model.forward(token_ids, meta.positions, attend, logits_at=meta.logits_at)  # (N, vocab)
        self._track_memory(batch)
        self.num_steps += 1
        self.num_tokens_run += len(token_ids)
        return self.scheduler.update(batch, logits)

    def _track_memory(self, batch: Batch) -> None:
        """After a forward: update the peaks of blocks used, blocks shared and live tokens, counting each
        position of a shared block once."""
        block_size = self.manager.block_size
        scheduled = dict(batch)  # request -> tokens it just computed
        filled: dict[int, int] = {}  # block id -> rows holding K/V
        for req in self.scheduler.running:
            length = req.num_computed_tokens + scheduled.get(req, 0)
            for i, block in enumerate(req.block_table):
                filled[block] = max(filled.get(block, 0), min(block_size, length - i * block_size))
        self.peak_live_tokens = max(self.peak_live_tokens, sum(filled.values()))
        self.peak_blocks_used = max(self.peak_blocks_used, self.manager.num_used)
        self.peak_blocks_shared = max(self.peak_blocks_shared, self.manager.num_shared)

    def generate(
        self, prompts: list[list[int]], max_new_tokens: int | list[int], *, ignore_eos: bool = False
    ) -> list[list[int]]:
        """Submit every prompt at once and step until all requests finish; new tokens in input order
        (greedy, one sample per prompt)."""
        return [s[0] for s in self.generate_samples(prompts, max_new_tokens, ignore_eos=ignore_eos)]

    def generate_samples(
        self,
        prompts: list[list[int]],
        max_new_tokens: int | list[int],
        *,
        n: int = 1,
        sampling: SamplingParams | None = None,
        share: bool = True,
        ignore_eos: bool = False,
    ) -> list[list[list[int]]]:
        """``n`` samples of every prompt: result[i][j] is the new tokens of sample j of prompt i.

        share=True: one request per prompt, prefilled once and forked into n sequences. share=False:
        n independent requests per prompt, request j seeded ``sampling.seed_of(j)``, the seed a fork
        gives sample j, so both ways must produce the same tokens.
        """
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an integer >= 1, got {n!r}")
        sampling = sampling or SamplingParams()
        budgets = check_requests(prompts, max_new_tokens, self.model.cfg.vocab_size)
        for i, (prompt, budget) in enumerate(zip(prompts, budgets)):
            self.check_fits(prompt, budget, f"prompt {i}", n=n if share else 1)
        if share:
            reqs = [
                self.add_request(p, b, ignore_eos=ignore_eos, n=n, sampling=sampling)
                for p, b in zip(prompts, budgets)
            ]
        else:
            reqs = [
                self.add_request(
                    p, b, ignore_eos=ignore_eos, sampling=replace(sampling, seed=sampling.seed_of(j))
                )
                for p, b in zip(prompts, budgets)
                for j in range(n)
            ]
        while self.has_unfinished():
            self.step()
        if not share:
            return [[r.output_ids for r in reqs[i * n : (i + 1) * n]] for i in range(len(prompts))]
        samples: dict[int, list[Request]] = {r.request_id: [] for r in reqs}
        for seq in self.scheduler.finished:
            if seq.request_id in samples:
                samples[seq.request_id].append(seq)
        return [[s.output_ids for s in sorted(samples[r.request_id], key=Request.sort_key)] for r in reqs]
