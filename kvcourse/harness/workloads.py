"""Ways of feeding requests to an engine that batches (L3 on), shared by smoke checks, tests and benches.

``all_at_once`` is ``engine.generate``; ``staggered`` submits the prompts one by one while the engine
is already running, so requests join a batch that is mid-generation and leave it at different times.
Both return the new tokens of each prompt in input order, like ``generate``.
"""

from __future__ import annotations


def all_at_once(engine, prompts: list[list[int]], max_new_tokens: list[int]) -> list[list[int]]:
    """Submit everything, run to completion: ``engine.generate(prompts, max_new_tokens)``."""
    return engine.generate(prompts, max_new_tokens)


def staggered(engine, prompts: list[list[int]], max_new_tokens: list[int], every: int = 2) -> list[list[int]]:
    """Submit prompt i before engine step i * ``every`` and step until every request is done.

    Needs the engine's ``add_request(prompt, max_new_tokens) -> Request``, ``step()`` and
    ``has_unfinished()``. Example with every=2: prompt 0 joins at step 0, prompt 1 at step 2 (while
    prompt 0 decodes), prompt 2 at step 4, ...; steps with nothing to run still count.
    """
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    requests = []
    step = 0
    while len(requests) < len(prompts) or engine.has_unfinished():
        if step % every == 0 and len(requests) < len(prompts):
            i = len(requests)
            requests.append(engine.add_request(prompts[i], max_new_tokens[i]))
        engine.step()
        step += 1
    return [req.output_ids for req in requests]
