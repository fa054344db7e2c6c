"""The scheduler (from L3 on): which sequences take part in the next step, and how many of their tokens each.

Three queues: ``waiting`` (submitted or preempted; no blocks), ``running`` (admitted; blocks for
every computed position) and ``finished``. ``schedule()`` plans ONE forward call over a flat batch:

1. running sequences, most important first, each get their next tokens: 1 for a sequence that is
   decoding, the next chunk for one still prefilling. Their block tables grow with ``allocate_slots()``.
   When the free list runs dry, the least important running sequence (lowest priority, then newest)
   is preempted: it frees all its blocks and goes back to waiting. When it is admitted again it
   recomputes its prompt and the tokens it had already generated ("preemption by recompute");
2. if nobody was preempted in this step, waiting sequences are admitted in order (priority, then
   arrival) while there is room: fewer than ``max_num_seqs`` running, token budget left, free blocks.

The prefix cache: at admission a waiting sequence first looks up its leading full blocks
(``match_prefix``), shares them and starts its prefill after them; a preempted sequence so recomputes
only what the cache no longer holds. Preemption only ever takes back blocks that are already
computed: the victims come from the back of ``running``, behind the sequence being served, so they
are not in the batch yet, and nothing is admitted after a preemption. So a block registered in the
prefix cache this step is always filled by this step, whoever else shares it.

A step runs at most ``max_num_batched_tokens`` tokens. With ``prefill_chunk_size`` a long prompt is
fed a chunk per step, alongside the decode tokens of the others, instead of stalling them for a
whole step. ``update()`` takes the step's logits, samples each sequence's next token with its own
generator, and finishes the sequences that are done (eos, max_new_tokens); a finished sequence frees
its blocks at once, so the next step can hand them out.
These options come from the engine's config (``kvcourse.engine_config.EngineConfig``), checked.

Clones: a sequence with n samples takes n seats of ``max_num_seqs`` until it clones. When its prefill
ends, ``update()`` first clones it (``BlockAllocator.clone``): its n sequences all sample their first
token from the one row of logits its prefill produced, and then decode as separate sequences. A clone
that finds no free block preempts too, in ``update()``, after the step's forward has run: it also
takes back computed blocks only. The scheduler never touches K/V: ``update()`` returns the copies.

Groups, the seam of an optional wing (``beams/``, beam search): a request may run as a group of
sequences (``add(seq, group)``), served and preempted as one unit (``_make_room`` makes room for every
path), that picks their tokens itself from the rows of logits it is handed (``group.update``).

Left out on purpose: swapping KV to CPU memory instead of recomputing it, keeping a reserve of free
blocks so that running sequences rarely need preempting, preempting running sequences to admit
a higher-priority arrival, and the vLLM paper's Orca baselines, which reserve a request's memory at
admission (L3's and L4's ``admission_policy``: a reservation is one sequence's, and L5's blocks are shared).
"""

from __future__ import annotations

from bisect import insort
from dataclasses import replace

import torch

from kvcourse.engine_config import EngineConfig
from kvcourse.limits import finished
from kvcourse.sampling import sample

from .allocator import BlockAllocator, OutOfBlocksError, blocks_needed
from .prefix_cache import match_prefix
from .sequence import FinishReason, Sequence, Status, allocate_slots

Batch = list[tuple[Sequence, int]]  # the sequences of one step, each with the number of tokens it runs
Copies = list[tuple[int, int]]  # (src, dst): blocks whose K/V the engine copies before the next forward


class Scheduler:
    def __init__(
        self,
        allocator: BlockAllocator,
        config: EngineConfig,
        eos_ids: tuple[int, ...] = (),
        enable_prefix_caching: bool = True,
    ):
        self.allocator, self.config, self.eos_ids = allocator, config, eos_ids
        self.enable_prefix_caching = enable_prefix_caching
        self.waiting: list[Sequence] = []  # in Sequence.sort_key order
        self.running: list[Sequence] = []  # in Sequence.sort_key order: the last one is preempted first
        self.finished: list[Sequence] = []
        self.prefix_cache_hits = 0  # prefix-cache hits: blocks shared at admission instead of computed
        self.num_preemptions = 0
        self.num_clones = 0  # sequences split into their n samples
        self.groups: dict[int, object] = {}  # request_id -> the group its sequences run as (beams/)

    def add(self, seq: Sequence, group=None) -> None:
        if group is not None:  # its sequences run as one group, this one first (``groups``)
            self.groups[seq.request_id], group.seqs = group, [seq]
        seq.status = Status.WAITING
        insort(self.waiting, seq, key=Sequence.sort_key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def num_running_seqs(self) -> int:
        """Sequences running, counting a sequence with n samples as n until it is cloned."""
        return sum(r.num_seqs for r in self.running)

    def schedule(self) -> Batch:
        """Plan the next step: (sequence, number of new tokens) pairs, running sequences first."""
        batch: Batch = []
        token_budget = self.config.max_num_batched_tokens
        preemptions_before = self.num_preemptions
        bs = self.allocator.block_size
        i = 0  # 1. running sequences, most important first; a preemption removes one from the back
        while i < len(self.running) and token_budget > 0:
            unit, plan, need = self._unit(self.running[i]), [], 0  # a sequence, or its group's: served whole
            for seq in unit:
                left = token_budget - sum(m for _, m in plan)
                num_new = self._num_new_tokens(seq, left, seq.num_computed_tokens)
                plan += [(seq, num_new)] if num_new else []
                need += max(0, blocks_needed(seq.num_computed_tokens + num_new, bs) - len(seq.block_table))
            if self._make_room(need, unit):  # others preempted from the back first, perhaps this unit
                for seq, num_new in plan:
                    allocate_slots(seq, self.allocator, seq.num_computed_tokens + num_new)
                batch += plan
                token_budget -= sum(num_new for _, num_new in plan)
                i += len(unit)
        if self.num_preemptions > preemptions_before:
            return batch  # memory is tight: admit nobody this step
        # 2. waiting sequences, in order
        while self.waiting and self.num_running_seqs() + self.waiting[0].num_seqs <= self.config.max_num_seqs:
            seq = self.waiting[0]
            cached = match_prefix(seq.all_ids, self.allocator) if self.enable_prefix_caching else []
            start = len(cached) * self.allocator.block_size  # positions the prefix cache already holds
            num_new = self._num_new_tokens(seq, token_budget, start)
            if num_new == 0:
                break  # the step's token budget is spent
            try:  # its first tokens' blocks
                allocate_slots(seq, self.allocator, start + num_new, cached)
            except OutOfBlocksError:
                break  # wait until running sequences give blocks back; nobody jumps the queue
            seq.num_computed_tokens = start  # its prefill skips the prefix-cache hits
            self.prefix_cache_hits += len(cached)
            self.waiting.pop(0)
            seq.status = Status.RUNNING
            insort(self.running, seq, key=Sequence.sort_key)
            batch.append((seq, num_new))
            token_budget -= num_new
        return batch

    def update(self, batch: Batch, logits: torch.Tensor) -> tuple[list[Sequence], Copies]:
        """Record a step and sample: each sequence computed its scheduled tokens; each that ran its
        last known token samples the next one from its row of ``logits`` (N, vocab), rows in batch
        order. A sequence with num_samples > 1 whose prefill just ended is cloned first, and all its
        sequences sample from that row, each with its own generator; a group's sequences hand it their row.
        Returns the sequences finished, and the block copies the engine makes before the next forward."""
        rows = iter(logits)
        ended = []  # each sequence that ran its last known token, with its row of logits
        for seq, num_new in batch:
            seq.num_computed_tokens += num_new
            if seq.num_computed_tokens < seq.num_tokens:
                continue  # a prefill chunk that does not end the prompt: no new token yet
            ended.append((seq, next(rows)))
        done, copies = [], []
        for first, row in ended:
            if first.status is not Status.RUNNING:
                continue  # preempted by a clone earlier in this loop: it recomputes later
            seqs = self._clone(first, copies) if first.num_seqs > 1 else [first]
            if first.request_id in self.groups:  # its group picks their tokens (beams/)
                done += self.groups[first.request_id].update(seqs, row, self, copies)
                continue
            for seq in seqs:
                token = sample(row, seq.sampling, seq.generator)
                seq.output_ids.append(token)
                if finished(token, len(seq.output_ids), seq.max_new_tokens, self.eos_ids, seq.ignore_eos):
                    eos = token in self.eos_ids and not seq.ignore_eos
                    self._finish(seq, FinishReason.EOS if eos else FinishReason.MAX_TOKENS)
                    done.append(seq)
        return done, copies

    def abort(self, request_id: int) -> list[Sequence]:
        """Cancel a request: its waiting or running sequences, every sample cloned from it included
        (between steps), and its group; their blocks are dropped at once."""
        seqs = [seq for seq in self.waiting + self.running if seq.request_id == request_id]
        if not seqs:
            raise ValueError(f"no unfinished request with id {request_id}")
        for seq in seqs:
            self._finish(seq, FinishReason.ABORTED)
        self.groups.pop(request_id, None)
        return seqs

    def check_invariants(self) -> None:
        """Between steps, raise AssertionError unless queues, statuses and blocks agree.

        Every sequence is in the queue its status names, each queue in scheduling order; waiting and
        finished sequences hold no blocks; a running sequence holds exactly the blocks of its computed
        positions; at most ``max_num_seqs`` run; and the allocator's books balance, each block's reference
        count the number of running sequences holding it.
        """
        for queue, status in ((self.waiting, Status.WAITING), (self.running, Status.RUNNING)):
            assert all(r.status is status for r in queue), f"a sequence in {status.value} has another status"
            assert queue == sorted(queue, key=Sequence.sort_key), f"{status.value} is out of order"
        assert all(r.status is Status.FINISHED and not r.block_table for r in self.finished)
        assert all(not r.block_table and r.num_computed_tokens == 0 for r in self.waiting)
        for r in self.running:
            assert len(r.block_table) == blocks_needed(r.num_computed_tokens, self.allocator.block_size), (
                f"sequence {r.request_id} holds {len(r.block_table)} blocks for {r.num_computed_tokens} tokens"
            )
        assert self.num_running_seqs() <= self.config.max_num_seqs
        ids = [(r.request_id, r.sample_index) for r in self.waiting + self.running + self.finished]
        assert len(ids) == len(set(ids)), "a sequence is in two queues"
        for group in self.groups.values():
            group.check_invariants()
        self.allocator.check_invariants(r.block_table for r in self.running)

    def _num_new_tokens(self, seq: Sequence, token_budget: int, computed: int) -> int:
        """Tokens ``seq`` runs this step when ``computed`` of its positions are in the pool: all the
        others, cut to the prefill chunk and the token budget; without chunking, all of them or nothing (0)."""
        num_new = seq.num_tokens - computed
        if self.config.prefill_chunk_size is None:
            return num_new if num_new <= token_budget else 0
        return min(num_new, self.config.prefill_chunk_size, token_budget)

    def _unit(self, seq: Sequence) -> list[Sequence]:
        """What is served and preempted as one: ``seq``, or every running sequence of its group."""
        group = self.groups.get(seq.request_id)
        return [s for s in group.seqs if s.status is Status.RUNNING] if group else [seq]

    def _make_room(self, need: int, keep: list[Sequence]) -> bool:
        """Preempt running sequences from the back (lowest priority, newest) until ``need`` blocks are
        free for ``keep`` (a sequence, or a group's). False if that reached ``keep``: it went too."""
        while self.allocator.num_free < need:
            victim = self.running[-1]
            self._preempt(victim)
            if victim in keep:
                return False
        return True

    def _clone(self, parent: Sequence, copies: Copies) -> list[Sequence]:
        """Split a sequence whose prefill just ended into its n samples: [parent, child 1, .., child n-1],
        sharing its full blocks, each child with a copy of its partial one (added to ``copies``), its
        sample_index i and a generator seeded for sample i. [] if making room preempted the parent."""
        num_computed, num_children = parent.num_computed_tokens, parent.num_samples - 1
        need = self.allocator.clone_needs(num_computed, num_children)
        if not self._make_room(need, [parent]):
            return []  # it clones when its recompute ends
        tables, more = self.allocator.clone(parent.block_table, num_computed, num_children)
        copies += more
        children = [
            replace(parent, num_samples=1, sample_index=i, generator=None, block_table=table, output_ids=[])
            for i, table in enumerate(tables, start=1)
        ]
        for child in children:
            insort(self.running, child, key=Sequence.sort_key)
        self.num_clones += 1
        return [parent, *children]

    def _preempt(self, seq: Sequence) -> None:
        """Send a running sequence back to waiting, with its group's as one unit: free their blocks
        and forget what they computed (a group forgets the rows of logits it kept)."""
        for s in self._unit(seq):
            self.running.remove(s)
            self.allocator.free(s.block_table)
            s.block_table = []
            s.num_computed_tokens = 0
            self.add(s)
        if seq.request_id in self.groups:
            self.groups[seq.request_id].preempted()
        self.num_preemptions += 1

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        (self.running if seq.status is Status.RUNNING else self.waiting).remove(seq)
        self.allocator.free(seq.block_table)
        seq.block_table = []
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        self.finished.append(seq)
