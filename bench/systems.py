"""The systems a benchmark compares, each behind one call: ``run(prompts, budgets) -> outputs``.

Every run is fixed-length (``ignore_eos``): each request produces exactly its budget of tokens, so
tokens/s compares like with like.

- ``hf_batch1``: Hugging Face ``generate``, one request at a time (what the smoke checks use);
- ``hf_batched``: HF ``generate`` on all requests at once, left-padded to the longest prompt; it
  runs every request for the largest budget, and only each request's own budget counts as useful
  output (the rest is the price of static batching);
- the course's stages, by name (``L1`` .. ``L6``), through their ``Engine.generate``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvcourse.config import ModelConfig
from kvcourse.reference import load_hf_model
from kvcourse.stages import STAGES, engine_class

Run = Callable[[list[list[int]], list[int]], list[list[int]]]


@dataclass
class System:
    name: str
    run: Run
    engine: object | None = None  # the course engine, for its memory counters

    def run_samples(self, prompt: list[int], budget: int, n: int) -> list[list[int]]:
        """n sequences of one prompt: prefilled once and forked where the stage can (L5, L6), else n requests."""
        if hasattr(self.engine, "generate_samples"):
            return self.engine.generate_samples([prompt], budget, n=n, ignore_eos=True)[0]
        return self.run([prompt] * n, [budget] * n)


def hf_batch1(model_dir) -> System:
    model = load_hf_model(model_dir)

    def run(prompts, budgets):
        outs = []
        for ids, budget in zip(prompts, budgets, strict=True):
            inp = torch.tensor([ids])
            with torch.inference_mode():
                seq = model.generate(
                    inp, attention_mask=torch.ones_like(inp), max_new_tokens=budget, min_new_tokens=budget,
                    do_sample=False, pad_token_id=0,
                )  # fmt: skip
            outs.append(seq[0, len(ids) :].tolist())
        return outs

    return System("HF batch 1", run)


def hf_batched(model_dir) -> System:
    model = load_hf_model(model_dir)

    def run(prompts, budgets):
        width, longest = max(map(len, prompts)), max(budgets)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode():
            seq = model.generate(
                ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                do_sample=False, pad_token_id=0,
            )  # fmt: skip
        return [seq[i, width : width + b].tolist() for i, b in enumerate(budgets)]

    return System("HF batched", run)


def stage(name: str, model_dir, **options) -> System:
    engine = engine_class(name)(model_dir, **options)

    def run(prompts, budgets):
        return engine.generate(prompts, budgets, ignore_eos=True)

    return System(name, run, engine)


def present_stages() -> list[str]:
    """The stages whose engine imports in this checkout, in course order."""
    names = []
    for name in STAGES:
        try:
            engine_class(name)
        except ValueError:
            continue
        names.append(name)
    return names


def kv_bytes_per_token(model_dir) -> int:
    return ModelConfig.from_dir(model_dir).kv_bytes_per_token()
