"""The benchmark's workloads: sizes for a full and a quick run, and seeded random requests.

``FULL`` is what ``make bench`` runs (``bench/README.md``); ``QUICK`` the same parts on tiny sizes, for the
test suite. ``repeats`` is how many timed runs each median takes. Random token ids are fine for speed: with ``ignore_eos`` the text never changes what is
computed.
"""

from __future__ import annotations

import random

FULL = {"repeats": 3, "a_tokens": 128, "b_requests": 32, "b_prompt": (10, 300), "b_new": (16, 128),
        "u_requests": 32, "u_prompt": 128, "u_new": 64, "c_n": 8,
        "c_prompt": 200, "c_new": 64, "d_contexts": [128, 256, 512, 1024, 2048], "d_steps": 32,
        "e_decode_seqs": 32, "e_context": 512, "e_prefill": 512,
        "e_blocks": [(1, 1), (1, 4), (1, 16), (16, 4), (16, 16), (32, 32)], "f_repeats": 9}  # fmt: skip
QUICK = {"repeats": 1, "a_tokens": 8, "b_requests": 4, "b_prompt": (4, 24), "b_new": (2, 6),
         "u_requests": 4, "u_prompt": 12, "u_new": 3, "c_n": 2,
         "c_prompt": 20, "c_new": 4, "d_contexts": [16, 48], "d_steps": 2,
         "e_decode_seqs": 2, "e_context": 40, "e_prefill": 24, "e_blocks": [(1, 1), (16, 16)],
         "f_repeats": 2}  # fmt: skip


def mixed_workload(vocab: int, n: int, prompt_range, new_range, seed: int = 0):
    """n requests of seeded random token ids: ([prompt ids], [max_new_tokens]).

    Random ids are fine for speed: with ``ignore_eos`` the text never changes what is computed.
    """
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_range))] for _ in range(n)]
    return prompts, [rng.randint(*new_range) for _ in range(n)]


def batch1_workload(model_dir, new_tokens: int):
    """(a): one chat prompt (the model's chat template around a request for a story) and its max_new,
    as ([prompt ids], [new_tokens])."""
    from kvcourse.harness.prompts import Prompt, encode, load_tokenizer

    message = "Tell me a long story about a lighthouse keeper."
    return [encode(load_tokenizer(model_dir), Prompt(messages=(("user", message),)))], [new_tokens]
