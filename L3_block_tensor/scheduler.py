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

``admission_policy`` picks what admission holds (``hold_len``): ``"on_demand"`` nothing ahead; the
vLLM paper's Orca baselines a request's whole reservation, one run of a buddy allocator (``kvcourse.orca``),
to its end: nothing is preempted, and a request waits until a run of its size is free.

A step runs at most ``max_num_batched_tokens`` tokens. With ``prefill_chunk_size`` a long prompt is
fed a chunk per step, alongside the decode tokens of the others, instead of stalling them for a
whole step. ``update()`` takes the model's next tokens and finishes the sequences that are done (eos,
max_new_tokens); a finished sequence frees its blocks at once, so the next step can hand them out.
These options come from the engine's config (``kvcourse.engine_config.EngineConfig``), checked.

Left out on purpose: swapping KV to CPU memory instead of recomputing it, keeping a reserve of free
blocks so that running sequences rarely need preempting, preempting running sequences to admit a
higher-priority arrival, and sharing blocks between sequences (L5).
"""

from __future__ import annotations

from bisect import insort

from kvcourse.engine_config import EngineConfig
from kvcourse.limits import finished

from .allocator import BlockAllocator, OutOfBlocksError, blocks_needed
from .sequence import FinishReason, Sequence, Status, allocate_slots

Batch = list[tuple[Sequence, int]]  # the sequences of one step, each with the number of tokens it runs


class Scheduler:
    def __init__(self, allocator: BlockAllocator, config: EngineConfig, eos_ids: tuple[int, ...] = ()):
        self.allocator, self.config, self.eos_ids = allocator, config, eos_ids
        self.waiting: list[Sequence] = []  # in Sequence.sort_key order
        self.running: list[Sequence] = []  # in Sequence.sort_key order: the last one is preempted first
        self.finished: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        insort(self.waiting, seq, key=Sequence.sort_key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch:
        """Plan the next step: (sequence, number of new tokens) pairs, running sequences first."""
        batch: Batch = []
        token_budget = self.config.max_num_batched_tokens
        preemptions_before = self.num_preemptions
        i = 0  # 1. running sequences, most important first; a preemption removes one from the back
        while i < len(self.running) and token_budget > 0:
            seq = self.running[i]
            num_new = self._num_new_tokens(seq, token_budget)
            if self._allocate_or_preempt(seq, seq.num_computed_tokens + num_new):
                batch.append((seq, num_new))
                token_budget -= num_new
                i += 1
        if self.num_preemptions > preemptions_before:
            return batch  # memory is tight: admit nobody this step
        while self.waiting and len(self.running) < self.config.max_num_seqs:  # 2. waiting ones, in order
            seq = self.waiting[0]
            num_new = self._num_new_tokens(seq, token_budget)
            if num_new == 0:
                break  # the step's token budget is spent
            try:  # its first tokens' blocks, or an admission policy's whole reservation
                target = max(seq.num_computed_tokens + num_new, self.hold_len(seq))
                allocate_slots(seq, self.allocator, target)
            except OutOfBlocksError:
                break  # wait until running sequences give blocks back; nobody jumps the queue
            self.waiting.pop(0)
            seq.status = Status.RUNNING
            insort(self.running, seq, key=Sequence.sort_key)
            batch.append((seq, num_new))
            token_budget -= num_new
        return batch

    def update(self, batch: Batch, next_tokens: list[int]) -> list[Sequence]:
        """Record a step: each sequence computed its scheduled tokens; each that ran its last known
        token gets the next one from ``next_tokens`` (in batch order). Returns the sequences finished."""
        tokens = iter(next_tokens)
        done = []
        for seq, num_new in batch:
            seq.num_computed_tokens += num_new
            if seq.num_computed_tokens < seq.num_tokens:
                continue  # a prefill chunk that does not end the prompt: no new token yet
            token = next(tokens)
            seq.output_ids.append(token)
            if finished(token, len(seq.output_ids), seq.max_new_tokens, self.eos_ids, seq.ignore_eos):
                eos = token in self.eos_ids and not seq.ignore_eos
                self._finish(seq, FinishReason.EOS if eos else FinishReason.MAX_TOKENS)
                done.append(seq)
        return done

    def abort(self, request_id: int) -> Sequence:
        """Cancel a waiting or running sequence (between steps); its blocks are freed at once."""
        for seq in self.waiting + self.running:
            if seq.request_id == request_id:
                self._finish(seq, FinishReason.ABORTED)
                return seq
        raise ValueError(f"no unfinished request with id {request_id}")

    def check_invariants(self) -> None:
        """Between steps, raise AssertionError unless queues, statuses and blocks agree.

        Every sequence is in the queue its status names, each queue in scheduling order; waiting and
        finished sequences hold no blocks; a running sequence holds exactly the blocks of its computed
        positions, or of its reservation if that is longer; at most ``max_num_seqs`` run; and the
        allocator's books balance, with the running sequences owning exactly the blocks handed out.
        """
        for queue, status in ((self.waiting, Status.WAITING), (self.running, Status.RUNNING)):
            assert all(r.status is status for r in queue), f"a sequence in {status.value} has another status"
            assert queue == sorted(queue, key=Sequence.sort_key), f"{status.value} is out of order"
        assert all(r.status is Status.FINISHED and not r.block_table for r in self.finished)
        assert all(not r.block_table and r.num_computed_tokens == 0 for r in self.waiting)
        for r in self.running:
            held = max(r.num_computed_tokens, self.hold_len(r))
            assert len(r.block_table) == blocks_needed(held, self.allocator.block_size), (
                f"sequence {r.request_id} holds {len(r.block_table)} blocks for {r.num_computed_tokens} tokens"
            )
        assert len(self.running) <= self.config.max_num_seqs
        ids = [r.request_id for r in self.waiting + self.running + self.finished]
        assert len(ids) == len(set(ids)), "a sequence is in two queues"
        self.allocator.check_invariants(r.block_table for r in self.running)

    def hold_len(self, seq: Sequence) -> int:
        """Positions ``seq`` holds blocks for from admission to finish (``EngineConfig.hold_len``)."""
        return self.config.hold_len(len(seq.prompt_ids), seq.max_new_tokens)

    def _num_new_tokens(self, seq: Sequence, token_budget: int) -> int:
        """Tokens ``seq`` runs this step: all it has not computed yet, cut to the prefill chunk and the
        step's token budget; without chunking, all of them or nothing (0)."""
        num_new = seq.num_tokens - seq.num_computed_tokens
        if self.config.prefill_chunk_size is None:
            return num_new if num_new <= token_budget else 0
        return min(num_new, self.config.prefill_chunk_size, token_budget)

    def _allocate_or_preempt(self, seq: Sequence, target_len: int) -> bool:
        """Reserve blocks for ``seq``, preempting from the back of ``running`` until they fit.
        False if ``seq`` itself had to go."""
        while True:
            try:
                allocate_slots(seq, self.allocator, target_len)
                return True
            except OutOfBlocksError:
                victim = self.running[-1]  # lowest priority, newest
                self._preempt(victim)
                if victim is seq:
                    return False

    def _preempt(self, seq: Sequence) -> None:
        """Send a running sequence back to waiting: free its blocks and forget what it computed."""
        self.running.remove(seq)
        self.allocator.free(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0
        self.add(seq)
        self.num_preemptions += 1

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        (self.running if seq.status is Status.RUNNING else self.waiting).remove(seq)
        self.allocator.free(seq.block_table)
        seq.block_table = []
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        self.finished.append(seq)
