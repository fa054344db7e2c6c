"""Beam search: which beams live on after a step, by Hugging Face's rules; the blocks are the scheduler's.

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

The request returns its ``num_return_sequences`` best hypotheses. With k = 1 there is no group:
like HF, the engine decodes greedily.

Survivor i of a step continues beam ``parent`` with ``token``: ``choose`` returns these (parent,
token) pairs, best first, and the scheduler re-points the block tables (``Scheduler._fork``): a beam
that several survivors continue is cloned (its full blocks shared, its partial last block copied);
a beam that none continues is dropped and its blocks go back at once. Most candidates die a step after
they are born, which is why the blocks of their common history must be shared, not copied.

Left out on purpose: beam sampling (``do_sample=True`` with beams), diverse and constrained beam
search, and batching several prompts into one group (each prompt is its own group here; HF's reference
runs one prompt at a time too).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvcourse.sampling import BeamParams


@dataclass(eq=False)
class BeamGroup:
    """The beams of one beam-search request, their scores, and the hypotheses they finished."""

    params: BeamParams
    max_new_tokens: int
    eos_ids: tuple[int, ...]
    beams: list = field(default_factory=list)  # live Sequences, in slot order (the survivors' rank)
    scores: torch.Tensor = field(default_factory=lambda: torch.zeros(1))  # (len(beams),) fp32 sums
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
