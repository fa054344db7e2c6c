"""L5's scheduler: L3's, with blocks shared through a prefix cache and requests forked into n samples.

Three queues: ``waiting`` (submitted or preempted; no blocks), ``running`` (admitted; blocks for
every computed position) and ``finished``. ``schedule()`` plans ONE forward call over a flat batch:

1. running requests, most important first, each get their next tokens: 1 for a request that is
   decoding, the next chunk for one still prefilling. Their block tables grow with ``reserve()``.
   When the free list runs dry, the least important running request (lowest priority, then newest)
   is preempted: it drops its blocks and goes back to waiting. When it is admitted again it
   recomputes its prompt and the tokens it had already generated ("preemption by recompute"),
   except for the leading blocks the prefix cache still holds;
2. if nobody was preempted in this step, waiting requests are admitted in order (priority, then
   arrival) while there is room: fewer than ``max_num_seqs`` sequences running (a request with n
   samples counts n), budget left, free blocks. Each first looks up its leading full blocks in the
   prefix cache (``match_prefix``): it shares those and its prefill starts after them.

A step runs at most ``max_num_batched_tokens`` tokens. With ``prefill_chunk_size`` a long prompt is
fed a chunk per step, alongside the decode tokens of the others, instead of stalling them for a
whole step. ``update()`` takes the step's logits, samples each sequence's next token with its own
generator, and finishes the sequences that are done (eos, max_new_tokens); a finished sequence drops
its blocks at once, so the next step can hand them out. A request with n > 1 whose prefill just
ended is first forked (``BlockManager.fork``): its n sequences all sample their first token from
the one row of logits its prefill produced, and then decode as separate sequences.

Preemption only ever takes back blocks that are already computed: in ``schedule()`` the victims come
from the back of ``running``, behind the request being served, so they are not in the batch yet, and
nothing is admitted after a preemption; in ``update()`` (a fork that finds no free block) the step's
forward has already run. So a block registered in the prefix cache this step is always filled by
this step, whoever else shares it.

Left out on purpose: swapping KV to CPU memory instead of recomputing it, keeping a reserve of free
blocks so that running requests rarely need preempting, preempting running requests to admit a
higher-priority arrival, and beam search (forks that also drop sequences).
"""

from __future__ import annotations

from bisect import insort
from dataclasses import replace

import torch

from kvcourse.requests import finished
from kvcourse.sampling import sample

from .cache import (
    BlockManager,
    FinishReason,
    KvPool,
    OutOfBlocks,
    Request,
    Status,
    blocks_needed,
    match_prefix,
    reserve,
)

Batch = list[tuple[Request, int]]  # the requests of one step, each with the number of tokens it runs


class Scheduler:
    def __init__(
        self,
        manager: BlockManager,
        pool: KvPool,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        prefill_chunk_size: int | None = None,
        eos_ids: tuple[int, ...] = (),
        enable_prefix_caching: bool = True,
    ):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        if prefill_chunk_size is not None and prefill_chunk_size < 1:
            raise ValueError(
                f"prefill_chunk_size must be >= 1 or None (no chunking), got {prefill_chunk_size}"
            )
        self.manager = manager
        self.pool = pool  # forks copy a partial block's K/V in it
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefill_chunk_size = prefill_chunk_size
        self.eos_ids = eos_ids
        self.enable_prefix_caching = enable_prefix_caching
        self.waiting: list[Request] = []  # in Request.sort_key order
        self.running: list[Request] = []  # in Request.sort_key order: the last one is preempted first
        self.finished: list[Request] = []
        self.num_preemptions = 0
        self.num_forks = 0  # requests split into their n samples
        self.num_cached_blocks = 0  # prefix-cache hits: blocks shared at admission instead of computed

    def add(self, req: Request) -> None:
        req.status = Status.WAITING
        insort(self.waiting, req, key=Request.sort_key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def num_running_seqs(self) -> int:
        """Sequences running, counting an unforked request with n samples as n."""
        return sum(r.num_seqs for r in self.running)

    def schedule(self) -> Batch:
        """Plan the next step: (request, number of new tokens) pairs, running requests first."""
        batch: Batch = []
        budget = self.max_num_batched_tokens
        preemptions_before = self.num_preemptions
        i = 0  # 1. running requests, most important first; a preemption removes one from the back
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._num_new_tokens(req, budget, req.num_computed_tokens)
            if self._reserve_or_preempt(req, req.num_computed_tokens + n):
                batch.append((req, n))
                budget -= n
                i += 1
        if self.num_preemptions > preemptions_before:
            return batch  # memory is tight: admit nobody this step
        while self.waiting and self.num_running_seqs() + self.waiting[0].num_seqs <= self.max_num_seqs:
            req = self.waiting[0]  # 2. waiting requests, in order
            cached = match_prefix(req, self.manager) if self.enable_prefix_caching else []
            start = len(cached) * self.manager.block_size  # positions the prefix cache already holds
            n = self._num_new_tokens(req, budget, start)
            if n == 0:
                break  # the step's token budget is spent
            try:
                reserve(req, self.manager, start + n, cached)
            except OutOfBlocks:
                break  # wait until running requests give blocks back; nobody jumps the queue
            req.num_computed_tokens = start  # its prefill skips the shared blocks
            self.num_cached_blocks += len(cached)
            self.waiting.pop(0)
            req.status = Status.RUNNING
            insort(self.running, req, key=Request.sort_key)
            batch.append((req, n))
            budget -= n
        return batch

    def update(self, batch: Batch, logits: torch.Tensor) -> list[Request]:
        """Record a step: each request computed its scheduled tokens; each that ran its last known
        token samples the next one from its row of ``logits`` (N, vocab), rows in batch order. A
        request with n > 1 whose prefill just ended is forked first, and all its n sequences sample
        from that row, each with its own generator. Returns the sequences finished."""
        rows = iter(logits)
        ended = []  # each request that ran its last known token, with its row of logits
        for req, n in batch:
            req.num_computed_tokens += n
            if req.num_computed_tokens < req.num_tokens:
                continue  # a prefill chunk that does not end the prompt: no new token yet
            ended.append((req, next(rows)))
        done = []
        for req, row in ended:
            if req.status is not Status.RUNNING:
                continue  # preempted by a fork earlier in this loop: it recomputes later
            seqs = self._fork(req) if req.num_seqs > 1 else [req]
            for seq in seqs:
                token = sample(row, seq.sampling, seq.generator)
                seq.output_ids.append(token)
                if finished(token, len(seq.output_ids), seq.max_new_tokens, self.eos_ids, seq.ignore_eos):
                    eos = token in self.eos_ids and not seq.ignore_eos
                    self._finish(seq, FinishReason.EOS if eos else FinishReason.MAX_TOKENS)
                    done.append(seq)
        return done

    def abort(self, request_id: int) -> list[Request]:
        """Cancel a waiting or running request and every sample forked from it (between steps); their
        blocks are dropped at once."""
        seqs = [req for req in self.waiting + self.running if req.request_id == request_id]
        if not seqs:
            raise ValueError(f"no unfinished request with id {request_id}")
        for req in seqs:
            self._finish(req, FinishReason.ABORTED)
        return seqs

    def check_invariants(self) -> None:
        """Between steps, raise AssertionError unless queues, statuses and blocks agree.

        Every sequence is in the queue its status names, each queue in scheduling order; waiting and
        finished sequences hold no blocks; a running sequence holds exactly the blocks of its computed
        positions; at most ``max_num_seqs`` sequences run; and the block manager's books balance, with
        every block's reference count equal to the number of running sequences holding it.
        """
        for queue, status in ((self.waiting, Status.WAITING), (self.running, Status.RUNNING)):
            assert all(r.status is status for r in queue), f"a request in {status.value} has another status"
            assert queue == sorted(queue, key=Request.sort_key), f"{status.value} is out of order"
        assert all(r.status is Status.FINISHED and not r.block_table for r in self.finished)
        assert all(not r.block_table and r.num_computed_tokens == 0 for r in self.waiting)
        for r in self.running:
            assert len(r.block_table) == blocks_needed(r.num_computed_tokens, self.manager.block_size), (
                f"request {r.request_id} holds {len(r.block_table)} blocks for {r.num_computed_tokens} tokens"
            )
        assert self.num_running_seqs() <= self.max_num_seqs
        ids = [(r.request_id, r.sample_index) for r in self.waiting + self.running + self.finished]
        assert len(ids) == len(set(ids)), "a sequence is in two queues"
        self.manager.check_invariants(r.block_table for r in self.running)

    def _num_new_tokens(self, req: Request, budget: int, computed: int) -> int:
        """Tokens ``req`` runs this step when ``computed`` of its positions are in the pool: all the
        others, cut to the prefill chunk and the budget; without chunking, all of them or nothing (0)."""
        n = req.num_tokens - computed
        if self.prefill_chunk_size is None:
            return n if n <= budget else 0
        return min(n, self.prefill_chunk_size, budget)

    def _reserve_or_preempt(self, req: Request, target_len: int) -> bool:
        """Reserve blocks for ``req``, preempting from the back of ``running`` until they fit.
        False if ``req`` itself had to go."""
        while True:
            try:
                reserve(req, self.manager, target_len)
                return True
            except OutOfBlocks:
                victim = self.running[-1]  # lowest priority, newest
                self._preempt(victim)
                if victim is req:
                    return False

    def _fork(self, parent: Request) -> list[Request]:
        """Split a request whose prefill just ended into its n samples: [parent, child 1, .., child n-1].

        The children share every full block and get their own copy of the partial one; each has
        sample_index i and a generator seeded for sample i. If the copies find no free blocks,
        running requests are preempted from the back, as for a reservation; [] if the parent itself
        had to go (it forks when its recompute ends).
        """
        while True:
            try:
                tables = self.manager.fork(
                    parent.block_table, parent.num_computed_tokens, parent.n - 1, self.pool
                )
                break
            except OutOfBlocks:
                victim = self.running[-1]  # lowest priority, newest
                self._preempt(victim)
                if victim is parent:
                    return []
        children = [
            replace(parent, n=1, sample_index=i, generator=None, block_table=table, output_ids=[])
            for i, table in enumerate(tables, start=1)
        ]
        for child in children:
            insort(self.running, child, key=Request.sort_key)
        self.num_forks += 1
        return [parent, *children]

    def _preempt(self, req: Request) -> None:
        """Send a running request back to waiting: drop its blocks and forget what it computed."""
        self.running.remove(req)
        self.manager.free(req.block_table)
        req.block_table = []
        req.num_computed_tokens = 0
        self.add(req)
        self.num_preemptions += 1

    def _finish(self, req: Request, reason: FinishReason) -> None:
        (self.running if req.status is Status.RUNNING else self.waiting).remove(req)
        self.manager.free(req.block_table)
        req.block_table = []
        req.status = Status.FINISHED
        req.finish_reason = reason
        self.finished.append(req)
