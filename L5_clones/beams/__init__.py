"""L5's beam search, kept apart from the lesson: a wing beside it, behind one seam, as ``fast/`` is.

Optional: the lesson's engine runs without it, and its scheduler knows nothing of beams. What the
scheduler knows is a *group* (``Scheduler.groups``): a request whose sequences run as one unit,
served and preempted together, and whose tokens the group picks itself. A beam search is one:

    add_beam_request(engine, prompt, max_new_tokens, BeamParams(k))
                       one search, checked once, submitted as a request for k seats with its group;
                       its prompt runs once, and the scheduler clones it into the k beams when its
                       prefill ends, as it clones n samples
    BeamGroup          (``group.py``) HF's rules (``choose``, pure), and the seam: each step it takes
                       the beams' rows of logits, chooses, and re-points the block tables with
    fork               (``fork.py``) the books only: dropped beams' tables freed, further survivors
                       cloned; the (src, dst) block copies go back to the engine with the step's others
    Engine.generate_beams   every prompt at once, as HF ``generate(num_beams=k, do_sample=False)``

``beam_blocks`` is the most a search can hold at once; ``check_beam_request`` refuses a width that
could never run, in one line naming the value.

Left out on purpose: streaming a search's hypotheses as they finish.
"""

from __future__ import annotations

import torch

from kvcourse.sampling import BeamParams, SamplingParams

from ..allocator import blocks_needed
from .fork import fork, fork_needs
from .group import BeamGroup

__all__ = ["BeamGroup", "add_beam_request", "beam_blocks", "fork", "fork_needs", "generate_beams"]


def recompute_shares(scheduler) -> bool:
    """Whether sequences recomputed side by side after a preemption find each other's full blocks
    again: with the prefix cache on, and each prompt run whole (a chunk registers only the blocks it
    fills, so a sequence admitted beside it may compute the rest a second time)."""
    return scheduler.enable_prefix_caching and scheduler.config.prefill_chunk_size is None


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


def check_beam_request(beam: BeamParams, label: str, prompt_len: int, max_new_tokens: int, scheduler) -> None:
    """Refuse a beam search (num_beams > 1) that could never run, in one line naming the value: more
    beams than ``max_num_seqs``, or beams that could outgrow the pool (``beam_blocks``)."""
    k = beam.num_beams
    if k < 2:
        raise ValueError(f"{label}: num_beams={k} is greedy search, not a beam search: use add_request")
    if k > scheduler.config.max_num_seqs:
        raise ValueError(f"{label}: num_beams={k} exceeds max_num_seqs={scheduler.config.max_num_seqs}")
    allocator = scheduler.allocator
    need = beam_blocks(prompt_len, max_new_tokens, k, allocator.block_size, recompute_shares(scheduler))
    if need > allocator.num_blocks:
        raise ValueError(
            f"{label}: beam search of width {k} may hold up to {need} blocks (the prompt's full blocks "
            f"shared, the rest once per beam), but the pool has only {allocator.num_blocks} blocks"
        )


def add_beam_request(
    engine, prompt: list[int], max_new_tokens: int, beam: BeamParams, label: str = "request"
) -> BeamGroup:
    """Submit one beam search (num_beams > 1) to ``engine``, checked once: a request for num_beams
    seats whose sequences run as a ``BeamGroup``. Returns the group; once it is ``done``, its
    ``sequences()`` hold the result."""
    [max_new_tokens] = engine.config.check_requests([prompt], max_new_tokens, label=label)
    check_beam_request(beam, label, len(prompt), max_new_tokens, engine.scheduler)
    return _submit(engine, prompt, max_new_tokens, beam)


def _submit(engine, prompt: list[int], max_new_tokens: int, beam: BeamParams) -> BeamGroup:
    """The request, already checked, its group registered with it (``Engine._submit(group=)``)."""
    scores = torch.zeros(1, device=engine.device)  # the prompt is the one beam, its score 0
    group = BeamGroup(beam, max_new_tokens, engine.model.cfg.eos_token_ids, scores)
    engine._submit(prompt, max_new_tokens, n=beam.num_beams, group=group)  # the seats, until it forks
    return group


def generate_beams(
    engine,
    prompts: list[list[int]],
    max_new_tokens: int | list[int],
    sampling: SamplingParams | None,
    beam: BeamParams,
) -> list[list[list[int]]]:
    """``Engine.generate_beams``: every prompt checked, then submitted at once and stepped to the end;
    result[i][j] is the new tokens of hypothesis j of prompt i, best first. num_beams 1 is greedy
    search, as in HF. A ``sampling`` that samples is refused (HF's beam sampling is left out)."""
    if sampling is not None and not sampling.greedy:
        raise ValueError(
            f"beam search keeps the best beams, it samples nothing: num_beams={beam.num_beams} cannot "
            f"be combined with temperature={sampling.temperature}"
        )
    if beam.num_beams == 1:
        return [[tokens] for tokens in engine.generate(prompts, max_new_tokens)]
    max_new_tokens = engine.config.check_requests(prompts, max_new_tokens)
    for i, (p, b) in enumerate(zip(prompts, max_new_tokens, strict=True)):
        check_beam_request(beam, f"prompt {i}", len(p), b, engine.scheduler)
    engine.fit_pool([len(p) + b for p, b in zip(prompts, max_new_tokens, strict=True)] * beam.num_beams)  # each beam grows
    groups = [_submit(engine, p, b, beam) for p, b in zip(prompts, max_new_tokens, strict=True)]
    while engine.has_unfinished():
        engine.step()
    return [group.sequences() for group in groups]
