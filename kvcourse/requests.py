"""Checks and stopping rules every engine applies the same way (not lesson material).

``check_requests`` validates what a caller hands ``Engine.generate``; ``finished`` is HF's stopping
rule: the eos token is kept in the output, then generation stops; otherwise stop at the budget.
"""

from __future__ import annotations


def check_requests(prompts: list[list[int]], max_new_tokens: int | list[int], vocab_size: int) -> list[int]:
    """Validate prompts and budgets; return one budget per prompt.

    Example: ``check_requests([[1, 2], [3]], 8, 100) -> [8, 8]``;
    ``check_requests([[]], 8, 100)`` raises ``ValueError: prompt 0 is empty``.
    """
    budgets = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(budgets) != len(prompts):
        raise ValueError(f"got {len(budgets)} max_new_tokens values for {len(prompts)} prompts")
    for i, (ids, budget) in enumerate(zip(prompts, budgets)):
        if len(ids) == 0:
            raise ValueError(f"prompt {i} is empty")
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt {i}: token id {bad} is outside the vocabulary [0, {vocab_size})")
        if budget < 1:
            raise ValueError(f"prompt {i}: max_new_tokens must be >= 1, got {budget}")
    return budgets


def finished(token: int, num_generated: int, budget: int, eos_ids: tuple[int, ...], ignore_eos: bool) -> bool:
    """True once ``token`` (the newest of ``num_generated``) ends the request.

    Example with eos 2 and budget 4: token 2 after 1 step -> True; token 7 after 4 steps -> True.
    """
    return num_generated >= budget or (not ignore_eos and token in eos_ids)
