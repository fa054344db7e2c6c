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

from kvcourse.limits import check_requests
from kvcourse.sampling import BeamParams, SamplingParams

from .allocator import blocks_needed


@dataclass(eq=False)
class BeamGroup:
    """The beams of one beam-search request, their scores, and the hypotheses they finished."""

    params: BeamParams
    max_new_tokens: int
    eos_ids: tuple[int, ...]
    scores: torch.Tensor  # (len(beams),) fp32 sums, on the engine's device (the logits' device)
    beams: list = field(default_factory=list)  # live Sequences, in slot order (the survivors' rank)
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


def beam_blocks(
    prompt_len: int, max_new_tokens: int, num_beams: int, block_size: int, recompute_shares: bool
) -> int:
    """The most blocks a beam search can hold at once: the prompt's full blocks, shared, plus, per
    beam, every block after them (beams that part right after the prompt share nothing more). Where
    preempted beams, recomputed, may not find each other's blocks again (``recompute_shares`` False),
    num_beams whole copies.

    Example, block_size 16, a 40-token prompt, 30 new tokens, 4 beams: 2 + 4 * (5 - 2) = 14 blocks.
    """
    total = blocks_needed(prompt_len + max_new_tokens, block_size)
    if not recompute_shares:
        return num_beams * total
    shared = prompt_len // block_size
    return shared + num_beams * (total - shared)


def add_beam_request(
    engine, prompt: list[int], max_new_tokens: int, beam: BeamParams, label: str = "request"
):
    """Submit one beam search to ``engine``: a request whose prompt runs once, taking num_beams seats,
    and leads its ``group`` (num_beams 1: a plain greedy request, as HF decodes it). Returns it; when
    it finishes, ``seq.group.sequences()`` holds the result."""
    if beam.num_beams > 1:
        check_beam_request(beam, label, len(prompt), max_new_tokens, engine.scheduler)
    seq = engine.add_request(prompt, max_new_tokens, n=beam.num_beams)  # the seats, until it forks
    if beam.num_beams > 1:
        scores = torch.zeros(1, device=engine.device)  # the prompt is the one beam, its score 0
        seq.group = BeamGroup(beam, max_new_tokens, engine.model.cfg.eos_token_ids, scores, beams=[seq])
    return seq


def check_beam_request(beam: BeamParams, label: str, prompt_len: int, max_new_tokens: int, scheduler) -> None:
    """Refuse a beam search (num_beams > 1) that could never run, in one line naming the value: more
    beams than ``max_num_seqs``, or beams that could outgrow the pool (``beam_blocks``)."""
    k = beam.num_beams
    if k > scheduler.max_num_seqs:
        raise ValueError(f"{label}: num_beams={k} exceeds max_num_seqs={scheduler.max_num_seqs}")
    allocator = scheduler.allocator
    need = beam_blocks(prompt_len, max_new_tokens, k, allocator.block_size, scheduler.recompute_shares)
    if need > allocator.num_blocks:
        raise ValueError(
            f"{label}: beam search of width {k} may hold up to {need} blocks (the prompt's full blocks "
            f"shared, the rest once per beam), but the pool has only {allocator.num_blocks} blocks"
        )


def generate_beams(
    engine,
    prompts: list[list[int]],
    max_new_tokens: int | list[int],
    *,
    sampling: SamplingParams | None = None,
    **beam,
) -> list[list[list[int]]]:
    """``Engine.generate_beams``: beam search on every prompt, as HF ``generate(num_beams=...,
    do_sample=False)``; result[i][j] is the new tokens of hypothesis j of prompt i, best first.
    ``beam``: ``BeamParams``' fields. Every prompt is one request, all submitted at once. A
    ``sampling`` that samples is refused (HF's beam sampling is left out)."""
    params = BeamParams(**beam)
    if sampling is not None and not sampling.greedy:
        raise ValueError(
            f"beam search keeps the best beams, it samples nothing: num_beams={params.num_beams} cannot "
            f"be combined with temperature={sampling.temperature}"
        )
    max_new_tokens = check_requests(
        prompts, max_new_tokens, engine.model.cfg.vocab_size, engine.max_model_len
    )
    for i, (p, b) in enumerate(zip(prompts, max_new_tokens, strict=True)):
        if params.num_beams > 1:
            check_beam_request(params, f"prompt {i}", len(p), b, engine.scheduler)
        engine.check_fits(p, b, f"prompt {i}", n=params.num_beams)
    if engine.grows_pool and not engine.has_unfinished():  # each beam grows on its own
        engine.fit_pool(
            [
                len(p) + b
                for p, b in zip(prompts, max_new_tokens, strict=True)
                for _ in range(params.num_beams)
            ]
        )
    requests = [add_beam_request(engine, p, b, params) for p, b in zip(prompts, max_new_tokens, strict=True)]
    while engine.has_unfinished():
        engine.step()
    return [r.group.sequences() if r.group else [r.output_ids] for r in requests]
