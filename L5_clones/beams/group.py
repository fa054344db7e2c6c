"""A beam search as one group of sequences: which beams live on after a step, by Hugging Face's rules.

A beam-search request keeps ``num_beams`` (k) sequences, its beams, each with a score: the sum of the
log-probabilities of the tokens it generated. Every step each live beam produces one row of logits,
and the group chooses (``BeamGroup.choose``), exactly as transformers 5.23.0's ``_beam_search`` does:

1. every continuation of every beam is scored: beam score + log_softmax(logits)[token];
2. the best ``2k`` (``(1 + number of eos tokens) * k`` with several eos tokens) are ranked;
3. a ranked continuation that ends (an eos token, or the max_new_tokens-th token) and ranks in the
   first k becomes a *finished hypothesis*, scored sum / length ** length_penalty; the group keeps the
   k best hypotheses;
4. the first k ranked continuations that do not end are the survivors: the next step's beams;
5. the search stops when every ranked continuation ended, or (``early_stopping=True``) as soon as k
   hypotheses are finished, or when no running beam can beat the worst kept hypothesis any more:
   with ``early_stopping=False`` (the default), when k are finished and the best beam's score divided
   by its current length ** length_penalty is no better than the worst kept one ("never": divided by
   max_new_tokens ** length_penalty when length_penalty > 0).

The request returns its ``num_return_sequences`` best hypotheses (``sequences()``).

The group is also what the scheduler meets (``Scheduler.groups``, the wing's one seam): it serves and
preempts the group's sequences (``seqs``) as one unit, and hands each row of logits they produce to
``update``. The group keeps the rows until every beam has one, lets ``choose`` pick the survivors and
re-points the block tables (``fork.py``): beam i takes survivor i's tokens and block table. The
beams are k ``Sequence`` objects from the first step to the last (the prompt and the k - 1 clones the
scheduler made of it when its prefill ended, as it clones n samples): a step changes what they hold,
never who they are, so the scheduler's queues need no change. When the search ends, the group aborts
its live beams: their blocks go back, and they are not results.

Left out on purpose: beam sampling (``do_sample=True`` with beams), diverse and constrained beam
search, and batching several prompts into one group (each prompt is its own group here; HF's reference
runs one prompt at a time too).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvcourse.sampling import BeamParams

from ..sequence import Sequence, Status
from .fork import fork, fork_needs


@dataclass(eq=False)
class BeamGroup:
    """The beams of one beam-search request, their scores, and the hypotheses they finished."""

    params: BeamParams
    max_new_tokens: int
    eos_ids: tuple[int, ...]
    scores: torch.Tensor  # (len(seqs),) fp32 sums, on the engine's device (the logits' device)
    seqs: list[Sequence] = field(default_factory=list)  # the live beams, in slot order (the survivors' rank)
    finished: list[tuple[float, list[int]]] = field(default_factory=list)  # (score, new tokens), best first
    rows: dict = field(default_factory=dict)  # beam -> its logits (vocab,), until every beam has one
    steps: list[list[tuple[int, int]]] = field(default_factory=list)  # per step: survivors' (parent, token)
    done: bool = False

    def choose(self, logits: torch.Tensor, generated: list[list[int]]) -> list[tuple[int, int]]:
        """One step of beam search: the survivors (parent slot, token), best first, from ``logits``
        (B, vocab), row j the logits of live beam j whose new tokens are ``generated[j]``. Records the
        hypotheses that finish and whether the search is done.

        Example, k = 2, one eos token (7), beams [a] and [b] with scores -1.0 and -1.5, and each
        beam's best log-probs a: {7: -0.1, 3: -0.2, 4: -2.0}, b: {5: -0.3, ...}: the 4 ranked
        continuations are a+7 (-1.1), a+3 (-1.2), b+5 (-1.8), a+4 (-3.0); a+7 ends and ranks first, so
        it is finished with score -1.1 / 2; the survivors are a+3 and b+5: ``[(0, 3), (1, 5)]``.
        """
        k, lp = self.params.num_beams, self.params.length_penalty
        logp = torch.log_softmax(logits.float(), dim=-1) + self.scores[:, None]  # (B, vocab)
        vocab = logp.shape[-1]
        ranked = max(2, 1 + len(self.eos_ids)) * k
        top, index = torch.topk(logp.flatten(), ranked)  # (2k,) best first, and where in (B, vocab)
        length = len(generated[0]) + 1  # new tokens of every candidate: beams all grow in step
        survivors, survivor_scores = [], []
        for rank, (score, i) in enumerate(zip(top, index.tolist(), strict=True)):
            parent, token = divmod(i, vocab)
            if token in self.eos_ids or length == self.max_new_tokens:  # this continuation ends
                if rank < k:  # only the first k may finish (HF: the others only back the beams up)
                    self.finished.append((float(score / length**lp), [*generated[parent], token]))
            elif len(survivors) < k:
                survivors.append((parent, token))
                survivor_scores.append(score)
        self.finished = sorted(self.finished, key=lambda h: -h[0])[:k]  # stable: the earlier first
        self.steps.append(survivors)
        if not survivors:  # every ranked continuation ended (max_new_tokens)
            self.done = True
            return survivors
        self.scores = torch.stack(survivor_scores)  # (k,) fp32
        full = len(self.finished) == k
        longest = self.params.early_stopping == "never" and lp > 0
        best = float(self.scores[0] / (self.max_new_tokens if longest else length) ** lp)
        cannot_improve = full and best <= self.finished[-1][0]
        self.done = cannot_improve or (full and self.params.early_stopping is True)
        return survivors

    def sequences(self) -> list[list[int]]:
        """The new tokens of the ``num_return_sequences`` best hypotheses, best first."""
        return [tokens for _, tokens in self.finished[: self.params.num_return_sequences]]

    # ---- the scheduler's seam (``Scheduler.groups``)

    def update(self, seqs: list[Sequence], row: torch.Tensor, scheduler, copies: list) -> list[Sequence]:
        """``seqs`` ran their last token, ``row`` (vocab,) its logits: a beam, or, at the first step, the
        prompt and the num_beams - 1 clones the scheduler made of it (``[]`` if it could not: the prompt
        was preempted). Once every beam has its row, the group chooses, and beam i takes survivor i's
        tokens and block table (``fork``), after the scheduler made room (``_make_room``: if that
        preempted this group, the beams take the tokens only and recompute them). The block copies go
        into ``copies``. Returns the beams, aborted, if the search ended, else []."""
        if seqs and not self.steps:
            self.seqs = seqs  # the prompt and its clones: the beams from now on
        self.rows.update(dict.fromkeys(seqs, row))
        if not seqs or len(self.rows) < len(self.seqs):
            return []  # the other beams have not run their last token yet
        first = not self.steps  # every beam holds the prompt: survivor i continues beam i
        logits = torch.stack([self.rows.pop(b) for b in self.seqs])[: len(self.scores)]  # (B, vocab)
        history = [list(b.output_ids) for b in self.seqs]
        survivors = self.choose(logits, history[: len(logits)])  # at the first step, the prompt's one row
        if self.done:
            return scheduler.abort(self.seqs[0].request_id)
        parents = list(range(len(survivors))) if first else [j for j, _ in survivors]
        tables, num_tokens = [b.block_table for b in self.seqs], self.seqs[0].num_computed_tokens
        if scheduler._make_room(fork_needs(scheduler.allocator, tables, num_tokens, parents), self.seqs):
            tables, new = fork(scheduler.allocator, tables, num_tokens, parents)
            copies += new
        else:  # this group went back to waiting, its blocks freed: the beams recompute what they take
            tables = [[] for _ in self.seqs]
        for beam, (j, token), table in zip(self.seqs, survivors, tables, strict=True):
            beam.output_ids, beam.block_table = history[j] + [token], table
        return []

    def preempted(self) -> None:
        """The scheduler sent the beams back to waiting: the rows they had are forgotten (their
        recompute produces them again)."""
        self.rows.clear()

    def check_invariants(self) -> None:
        """Raise AssertionError unless a live group holds num_beams beams (one prompt before its first
        step), all in the scheduler's queues, taking num_beams seats, with rows kept only for running
        beams that ran their last token."""
        k = self.params.num_beams
        assert not self.done and len(self.seqs) == (k if self.steps else 1), f"{len(self.seqs)} beams"
        assert all(b.status is not Status.FINISHED for b in self.seqs), "a live group's beam left the queues"
        assert sum(b.num_seqs for b in self.seqs) == k, "a beam group does not take num_beams seats"
        assert all(b.status is Status.RUNNING and b.num_computed_tokens == b.num_tokens for b in self.rows)
