"""The scheduler (from L3 on): which sequences take part in the next step, and how many of their tokens each.

Three queues: ``waiting`` (submitted or preempted; no blocks), ``running`` (admitted; blocks for
every computed position) and ``finished``. ``schedule()`` plans ONE forward call over a flat batch:

1. running sequences, most important first, each get their next tokens: 1 for a sequence that is
   decoding, the next chunk for one still prefilling. Their block tables grow with ``reserve()``.
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

``reservation`` picks what admission holds (``sequence.reservation_len``): ``"paged"`` takes blocks as
positions are computed; ``"oracle"``, ``"pow2"`` and ``"max"`` (the vLLM paper's baselines) hold a
request's whole reservation from admission to finish, so a running sequence never needs a block and
nothing is preempted: a request waits until its reservation fits.

A step runs at most ``max_num_batched_tokens`` tokens. With ``prefill_chunk_size`` a long prompt is
fed a chunk per step, alongside the decode tokens of the others, instead of stalling them for a
whole step. ``update()`` takes the step's logits, samples each sequence's next token with its own
generator, and finishes the sequences that are done (eos, max_new_tokens); a finished sequence frees
its blocks at once, so the next step can hand them out.

Clones: a sequence with n samples takes n seats of ``max_num_seqs`` until it clones. When its prefill
ends, ``update()`` first clones it (``BlockAllocator.clone``): its n sequences all sample their first
token from the one row of logits its prefill produced, and then decode as separate sequences. A clone
that finds no free block preempts too, in ``update()``, after the step's forward has run: it also
takes back computed blocks only.

Beam search (``beam.py``): a request with num_beams = k prefills once, taking k seats, and its
group then chooses k survivors after every step. ``update()`` keeps each beam's row of logits until
every beam of the group has one, then lets the group choose and re-points the block tables
(``_fork``): a beam nobody continues is dropped and frees its blocks at once; a beam continued by m
survivors is cloned m - 1 times (full blocks shared, the partial last block copied). ``schedule()``
reserves a group's blocks all at once, preempting others from the back first, and preempts a group
as one unit: all its beams go back to waiting and recompute their histories, sharing again the
full blocks they have in common (``recompute_shares``).

Left out on purpose: swapping KV to CPU memory instead of recomputing it, keeping a reserve of free
blocks so that running sequences rarely need preempting, and preempting running sequences to admit
a higher-priority arrival.
"""

from __future__ import annotations

from bisect import insort
from collections import Counter
from dataclasses import replace

import torch

from kvcourse.limits import finished
from kvcourse.sampling import sample

from .allocator import BlockAllocator, OutOfBlocksError, blocks_needed
from .cache import KvPool
from .prefix_cache import match_prefix
from .sequence import RESERVATIONS, FinishReason, Sequence, Status, reservation_len, reserve

Batch = list[tuple[Sequence, int]]  # the sequences of one step, each with the number of tokens it runs


class Scheduler:
    def __init__(
        self,
        allocator: BlockAllocator,
        pool: KvPool,  # clones copy their partial block in it
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        prefill_chunk_size: int | None = None,
        eos_ids: tuple[int, ...] = (),
        enable_prefix_caching: bool = True,
        reservation: str = "paged",
        max_model_len: int | None = None,
    ):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        if prefill_chunk_size is not None and prefill_chunk_size < 1:
            raise ValueError(
                f"prefill_chunk_size must be >= 1 or None (no chunking), got {prefill_chunk_size}"
            )
        if reservation not in RESERVATIONS:
            raise ValueError(f"reservation must be one of {RESERVATIONS}, got {reservation!r}")
        if reservation == "max" and max_model_len is None:
            raise ValueError("reservation 'max' needs max_model_len")
        self.allocator = allocator
        self.pool = pool  # clones copy a partial block's K/V in it
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefill_chunk_size = prefill_chunk_size
        self.eos_ids = eos_ids
        self.enable_prefix_caching = enable_prefix_caching
        self.reservation, self.max_model_len = reservation, max_model_len
        self.waiting: list[Sequence] = []  # in Sequence.sort_key order
        self.running: list[Sequence] = []  # in Sequence.sort_key order: the last one is preempted first
        self.finished: list[Sequence] = []
        self.num_cached_blocks = 0  # prefix-cache hits: blocks shared at admission instead of computed
        self.num_preemptions = 0
        self.num_clones = 0  # sequences split into their n samples

    def add(self, seq: Sequence) -> None:
        if seq.n > 1 and self.reservation != "paged":  # clones share blocks; a reservation is one sequence's
            raise ValueError(f"n={seq.n} samples need reservation='paged', got {self.reservation!r}")
        seq.status = Status.WAITING
        insort(self.waiting, seq, key=Sequence.sort_key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def recompute_shares(self) -> bool:
        """Whether sequences recomputed side by side after a preemption find each other's full blocks
        again: with the prefix cache on, and each prompt run whole (a chunk registers only the blocks
        it fills, so a sequence admitted beside it may compute the rest a second time)."""
        return self.enable_prefix_caching and self.prefill_chunk_size is None

    def num_running_seqs(self) -> int:
        """Sequences running, counting a sequence with n samples as n until it is cloned."""
        return sum(r.num_seqs for r in self.running)

    def schedule(self) -> Batch:
        """Plan the next step: (sequence, number of new tokens) pairs, running sequences first."""
        batch: Batch = []
        token_budget = self.max_num_batched_tokens
        preemptions_before = self.num_preemptions
        i = 0  # 1. running sequences, most important first; a preemption removes one from the back
        while i < len(self.running) and token_budget > 0:
            seq = self.running[i]
            if seq.group is not None:  # a beam: its whole group at once, or none of it
                planned = self._schedule_group(seq.group, token_budget)
                if planned is not None:
                    batch += planned
                    token_budget -= sum(n for _, n in planned)
                    i += sum(b.status is Status.RUNNING for b in seq.group.beams)
                continue
            n = self._num_new_tokens(seq, token_budget, seq.num_computed_tokens)
            if self._reserve_or_preempt(seq, seq.num_computed_tokens + n):
                batch.append((seq, n))
                token_budget -= n
                i += 1
        if self.num_preemptions > preemptions_before:
            return batch  # memory is tight: admit nobody this step
        # 2. waiting sequences, in order
        while self.waiting and self.num_running_seqs() + self.waiting[0].num_seqs <= self.max_num_seqs:
            seq = self.waiting[0]
            cached = match_prefix(seq.all_ids, self.allocator) if self.enable_prefix_caching else []
            start = len(cached) * self.allocator.block_size  # positions the prefix cache already holds
            n = self._num_new_tokens(seq, token_budget, start)
            if n == 0:
                break  # the step's token budget is spent
            try:
                reserve(seq, self.allocator, start + n, cached)
            except OutOfBlocksError:
                break  # wait until running sequences give blocks back; nobody jumps the queue
            seq.num_computed_tokens = start  # its prefill skips the prefix-cache hits
            self.num_cached_blocks += len(cached)
            ahead = self._held_blocks(seq) - len(seq.block_table)  # a reservation policy's; checked to fit
            seq.block_table.extend(self.allocator.alloc_blocks(max(0, ahead)))
            self.waiting.pop(0)
            seq.status = Status.RUNNING
            insort(self.running, seq, key=Sequence.sort_key)
            batch.append((seq, n))
            token_budget -= n
        return batch

    def update(self, batch: Batch, logits: torch.Tensor) -> list[Sequence]:
        """Record a step and sample: each sequence computed its scheduled tokens; each that ran its
        last known token samples the next one from its row of ``logits`` (N, vocab), rows in batch
        order. A sequence with n > 1 whose prefill just ended is cloned first, and all its n sequences
        sample from that row, each with its own generator. Returns the sequences finished."""
        rows = iter(logits)
        ended = []  # each sequence that ran its last known token, with its row of logits
        for seq, n in batch:
            seq.num_computed_tokens += n
            if seq.num_computed_tokens < seq.num_tokens:
                continue  # a prefill chunk that does not end the prompt: no new token yet
            ended.append((seq, next(rows)))
        done = []
        for first, row in ended:
            if first.status is not Status.RUNNING:
                continue  # preempted by a clone earlier in this loop: it recomputes later
            if first.group is not None:
                done += self._beam_step(first, row)
                continue
            for seq in self._clone(first) if first.num_seqs > 1 else [first]:
                token = sample(row, seq.sampling, seq.generator)
                seq.output_ids.append(token)
                if finished(token, len(seq.output_ids), seq.max_new_tokens, self.eos_ids, seq.ignore_eos):
                    eos = token in self.eos_ids and not seq.ignore_eos
                    self._finish(seq, FinishReason.EOS if eos else FinishReason.MAX_TOKENS)
                    done.append(seq)
        return done

    def abort(self, request_id: int) -> list[Sequence]:
        """Cancel a request: its waiting or running sequences, every sample cloned from it included
        (between steps); their blocks are dropped at once."""
        seqs = [seq for seq in self.waiting + self.running if seq.request_id == request_id]
        if not seqs:
            raise ValueError(f"no unfinished request with id {request_id}")
        for seq in seqs:
            self._finish(seq, FinishReason.ABORTED)
            if seq.group is not None:  # a beam: its search ends too
                seq.group.done = True
        return seqs

    def check_invariants(self) -> None:
        """Between steps, raise AssertionError unless queues, statuses and blocks agree.

        Every sequence is in the queue its status names, each queue in scheduling order; waiting and
        finished sequences hold no blocks; a running sequence holds exactly the blocks of its computed
        positions, or of its reservation if that is longer; at most ``max_num_seqs`` sequences run; and
        the block allocator's books balance, with every block's reference count equal to the number of
        running sequences holding it.
        """
        for queue, status in ((self.waiting, Status.WAITING), (self.running, Status.RUNNING)):
            assert all(r.status is status for r in queue), f"a sequence in {status.value} has another status"
            assert queue == sorted(queue, key=Sequence.sort_key), f"{status.value} is out of order"
        assert all(r.status is Status.FINISHED and not r.block_table for r in self.finished)
        assert all(not r.block_table and r.num_computed_tokens == 0 for r in self.waiting)
        for r in self.running:
            held = max(r.num_computed_tokens, self.hold_len(len(r.prompt_ids) + r.max_new_tokens))
            assert len(r.block_table) == blocks_needed(held, self.allocator.block_size), (
                f"sequence {r.request_id} holds {len(r.block_table)} blocks for {r.num_computed_tokens} tokens"
            )
        assert self.num_running_seqs() <= self.max_num_seqs
        ids = [(r.request_id, r.sample_index) for r in self.waiting + self.running + self.finished]
        assert len(ids) == len(set(ids)), "a sequence is in two queues"
        for g in {id(r.group): r.group for r in self.waiting + self.running if r.group}.values():
            k = g.params.num_beams
            assert not g.done and len(g.beams) == (k if g.steps else 1), (
                f"a live group has {len(g.beams)} beams"
            )
            assert all(b.status is not Status.FINISHED for b in g.beams), (
                "a live group's beam left the queues"
            )
            assert [b.sample_index for b in g.beams] == list(range(len(g.beams))), "beams out of slot order"
            assert sum(b.num_seqs for b in g.beams) == k, "a beam group does not take num_beams seats"
            assert all(b.status is Status.RUNNING and b.num_computed_tokens == b.num_tokens for b in g.rows)
        assert all(r in r.group.beams for r in self.waiting + self.running if r.group), "a lost beam"
        self.allocator.check_invariants(r.block_table for r in self.running)

    def _held_blocks(self, seq: Sequence) -> int:
        """Blocks ``seq`` holds from admission under the reservation policy (0 for paged)."""
        return blocks_needed(
            self.hold_len(len(seq.prompt_ids) + seq.max_new_tokens), self.allocator.block_size
        )

    def hold_len(self, length: int) -> int:
        """Positions a request of ``length`` (prompt + max_new_tokens) holds blocks for from admission,
        under this scheduler's reservation policy (0 for paged)."""
        return reservation_len(self.reservation, length, self.max_model_len)

    def _num_new_tokens(self, seq: Sequence, token_budget: int, computed: int) -> int:
        """Tokens ``seq`` runs this step when ``computed`` of its positions are in the pool: all the
        others, cut to the prefill chunk and the token budget; without chunking, all of them or nothing (0).
        Also 0 while a reservation policy's blocks for it do not fit the free list."""
        if self._held_blocks(seq) - len(seq.block_table) > self.allocator.num_free:
            return 0  # its whole reservation must fit first (paged holds none ahead)
        n = seq.num_tokens - computed
        if self.prefill_chunk_size is None:
            return n if n <= token_budget else 0
        return min(n, self.prefill_chunk_size, token_budget)

    def _schedule_group(self, group, token_budget: int) -> Batch | None:
        """The running beams of a group that have tokens to run, each with its count, their blocks
        reserved. The blocks are counted first and, if they are not free, others are preempted from
        the back of ``running`` (never a beam already in the batch: the group is served whole). None
        if the group itself had to go. A beam that has run its last token and waits for the others
        (its row is kept in ``group.rows``) runs nothing."""
        plan: Batch = []
        for beam in group.beams:
            n = self._num_new_tokens(beam, token_budget, beam.num_computed_tokens)
            if beam.status is Status.RUNNING and n > 0:
                plan.append((beam, n))
                token_budget -= n
        bs = self.allocator.block_size
        need = sum(max(0, blocks_needed(b.num_computed_tokens + n, bs) - len(b.block_table)) for b, n in plan)
        while self.allocator.num_free < need:
            victim = self.running[-1]  # lowest priority, newest
            self._preempt(victim)
            if victim.group is group:
                return None
        for beam, n in plan:
            reserve(beam, self.allocator, beam.num_computed_tokens + n)
        return plan

    def _beam_step(self, beam: Sequence, row: torch.Tensor) -> list[Sequence]:
        """Keep ``beam``'s row of logits; once every beam of its group has one, the group chooses its
        survivors and the block tables follow (``_fork``). Returns the beams finished, if the search ended."""
        group = beam.group
        group.rows[beam] = row
        if len(group.rows) < len(group.beams):
            return []  # the other beams have not run their last token yet
        logits = torch.stack([group.rows.pop(b) for b in group.beams])  # (B, vocab), slot order
        survivors = group.choose(logits, [b.output_ids for b in group.beams])
        if group.done:
            for b in group.beams:
                self._finish(b, FinishReason.BEAM_SEARCH_DONE)
            return list(group.beams)
        self._fork(group, survivors)
        return []

    def _fork(self, group, survivors: list[tuple[int, int]]) -> None:
        """Re-point the block tables after a step: survivor i continues beam ``parent`` with ``token``.

        A beam no survivor continues is dropped: its blocks go back at once (a block another beam
        shares only loses a reference). A beam m survivors continue becomes the first of them itself
        and is cloned for the others: its full blocks shared, its partial last block copied. Example,
        block_size 4, beams 0 and 1 with 10 computed positions each in [3, 5, 8] and [3, 5, 9] (ref
        counts 2, 2, 1, 1), survivors [(0, t), (0, u)]: beam 1 is dropped and frees 9 (3 and 5 go
        down to 1); beam 0 is survivor 0 and keeps [3, 5, 8]; survivor 1 is a clone holding [3, 5, x],
        8's rows copied into a fresh x (3 and 5 back up to 2). Each then appends its token.

        If the copies find no free blocks, others are preempted from the back; if that reaches this
        group, its survivors go back to waiting as they are (no blocks), and recompute.
        """
        old = group.beams
        counts = Counter(parent for parent, _ in survivors)
        for j, beam in enumerate(old):
            if not counts[j]:
                self._drop(beam)
        extra = {j: c - 1 for j, c in counts.items() if c > 1}  # clones each kept beam needs
        need = sum(self.allocator.clone_needs(old[j].num_computed_tokens, c) for j, c in extra.items())
        while self.allocator.num_free < need and old[survivors[0][0]].status is Status.RUNNING:
            self._preempt(self.running[-1])  # lowest priority, newest; perhaps this very group
        clones = {}
        for j, c in extra.items():
            parent = old[j]
            tables = [[] for _ in range(c)]  # the group was preempted: its beams will recompute
            if parent.status is Status.RUNNING:
                tables, copies = self.allocator.clone(parent.block_table, parent.num_computed_tokens, c)
                for src, dst in copies:
                    self.pool.copy_block(src, dst)
            clones[j] = [
                replace(parent, n=1, generator=None, block_table=t, output_ids=list(parent.output_ids))
                for t in tables
            ]
            for child in clones[j]:
                (self.running if child.status is Status.RUNNING else self.waiting).append(child)
        group.beams = []
        for slot, (j, token) in enumerate(survivors):
            beam = old[j] if not any(b is old[j] for b in group.beams) else clones[j].pop()
            beam.output_ids.append(token)
            beam.sample_index = slot
            group.beams.append(beam)
        self.running.sort(key=Sequence.sort_key)  # the beams' slots changed
        self.waiting.sort(key=Sequence.sort_key)

    def _drop(self, beam: Sequence) -> None:
        """A beam no survivor continues: out of the running set, its blocks freed at once."""
        self.running.remove(beam)
        self.allocator.free(beam.block_table)
        beam.block_table = []
        beam.status = Status.FINISHED

    def _reserve_or_preempt(self, seq: Sequence, target_len: int) -> bool:
        """Reserve blocks for ``seq``, preempting from the back of ``running`` until they fit.
        False if ``seq`` itself had to go."""
        while True:
            try:
                reserve(seq, self.allocator, target_len)
                return True
            except OutOfBlocksError:
                victim = self.running[-1]  # lowest priority, newest
                self._preempt(victim)
                if victim is seq:
                    return False

    def _clone(self, parent: Sequence) -> list[Sequence]:
        """Split a sequence whose prefill just ended into its n samples: [parent, child 1, .., child n-1].

        The children share every full block and get their own copy of the partial one; each has
        sample_index i and a generator seeded for sample i. If the copies find no free blocks,
        running sequences are preempted from the back, as for a reservation; [] if the parent itself
        had to go (it clones when its recompute ends).
        """
        while True:
            try:
                tables, copies = self.allocator.clone(
                    parent.block_table, parent.num_computed_tokens, parent.n - 1
                )
                break
            except OutOfBlocksError:
                victim = self.running[-1]  # lowest priority, newest
                self._preempt(victim)
                if victim is parent:
                    return []
        for src, dst in copies:
            self.pool.copy_block(src, dst)
        children = [
            replace(parent, n=1, sample_index=i, generator=None, block_table=table, output_ids=[])
            for i, table in enumerate(tables, start=1)
        ]
        for child in children:
            insort(self.running, child, key=Sequence.sort_key)
        self.num_clones += 1
        return [parent, *children]

    def _preempt(self, seq: Sequence) -> None:
        """Send a running sequence back to waiting: free its blocks and forget what it computed. A
        beam goes back with every running beam of its group, as one unit, and the rows of logits the
        group kept are forgotten (the recompute produces them again)."""
        for s in seq.group.beams if seq.group is not None else [seq]:
            if s.status is Status.RUNNING:
                self.running.remove(s)
                self.allocator.free(s.block_table)
                s.block_table = []
                s.num_computed_tokens = 0
                self.add(s)
        if seq.group is not None:
            seq.group.rows.clear()
        self.num_preemptions += 1

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        (self.running if seq.status is Status.RUNNING else self.waiting).remove(seq)
        self.allocator.free(seq.block_table)
        seq.block_table = []
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        self.finished.append(seq)
