"""Turning one row of logits into the next token: greedy, or sampled with temperature, top-k and top-p.

``SamplingParams`` holds a request's rules; ``sample(logits, params, generator)`` applies them in the
order Hugging Face and vLLM use (transformers 5.23's ``_get_logits_processor``; vLLM V1's
``vllm/v1/sample/sampler.py``): divide by the temperature, keep the top-k logits, keep the smallest
set of tokens whose probability reaches top-p, then draw with ``torch.multinomial`` from the caller's
``torch.Generator``. Temperature 0 means greedy (argmax), which is what every stage is compared on.

Each sequence draws from a generator of its own, seeded once (``make_generator``). Its tokens then
depend only on its own logits and its own seed, never on which other sequences share the batch, the
KV blocks, or the step: that is what lets L5 check that n cloned samples equal n independent runs.
Generators live on the CPU whatever device computed the logits, and the draw happens there (one row
of probabilities comes back, as the token would anyway): a seed then names the same random stream
on every machine.
Sample i of a request seeded s uses seed s + i (vLLM V1's rule for ``n > 1``: ``ParentRequest`` in
``vllm/v1/engine/parallel_sampling.py``).

``BeamParams`` holds the rules of beam search (L5), which picks no token at random: it keeps the
num_beams best continuations by their summed log-probabilities.

Left out on purpose: repetition/frequency penalties, min-p, logit bias, stop strings and logprobs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens. The defaults are greedy decoding.

    temperature: 0 = greedy (argmax); otherwise logits are divided by it (below 1 sharpens).
    top_k: keep the k largest logits (0 = off). top_p: keep the smallest set of most likely tokens
    whose probabilities add up to at least top_p (1.0 = off). seed: the generator's seed (None: a
    fresh random seed per sequence, not reproducible).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if not (isinstance(self.temperature, int | float) and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not (isinstance(self.top_p, int | float) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def seed_of(self, index: int) -> int | None:
        """The seed of sample ``index`` of a request: seed + index, so every sample has its own stream.

        Example: ``SamplingParams(temperature=1.0, seed=10).seed_of(2) -> 12``; no seed stays None.
        """
        return None if self.seed is None else self.seed + index


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator seeded with ``seed`` (None: a non-deterministic seed, so two never match)."""
    generator = torch.Generator(device="cpu")
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def allowed_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The logits after temperature, top-k and top-p, with every excluded token set to -inf.

    logits: (vocab,). Ties at the k-th largest value are all kept (as in HF). Top-p keeps a token
    while the probability of the tokens strictly more likely than it is below top_p. Example with
    probabilities [0.5, 0.3, 0.15, 0.05] (temperature 1): top_p 0.7 keeps tokens {0, 1}
    (0.5 < 0.7, then 0.5 + 0.3 >= 0.7); top_k 3 keeps {0, 1, 2}; both keep {0, 1}.
    """
    x = logits / params.temperature  # (vocab,)
    if params.top_k:
        kth = torch.topk(x, min(params.top_k, x.numel())).values[-1]  # the k-th largest value
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1:
        sorted_x, order = torch.sort(x)  # (vocab,) ascending, as HF's TopPLogitsWarper
        cumulative = sorted_x.softmax(-1).cumsum(-1)  # (vocab,) mass of this token and all less likely
        drop = cumulative <= 1 - params.top_p  # the unlikely tail holding at most 1 - top_p
        drop[-1] = False  # the most likely token always stays
        x = x.masked_fill(drop.scatter(0, order, drop), float("-inf"))  # back to vocabulary order
    return x


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> int:
    """The next token from one row of logits (vocab,): argmax when greedy, else a seeded draw.

    Example: ``sample(torch.tensor([1.0, 3.0, 2.0]), SamplingParams())`` -> 1. With temperature 1,
    top_k 2 and any generator, the result is 1 or 2, never 0.
    """
    if params.greedy:
        return int(logits.argmax())
    probs = allowed_logits(logits, params).softmax(-1)  # (vocab,) excluded tokens have probability 0
    if generator is not None:
        probs = probs.to(generator.device)  # the draw runs where the generator lives (the CPU)
    return int(torch.multinomial(probs, 1, generator=generator))


@dataclass(frozen=True)
class BeamParams:
    """Beam search as Hugging Face ``generate(num_beams=..., do_sample=False)`` runs it.

    num_beams: beams kept per step (1 = greedy, as in HF). num_return_sequences: how many of the
    finished hypotheses come back, best first (at most num_beams). length_penalty: a finished
    hypothesis scores sum(log-probs) / length ** length_penalty. early_stopping: False (HF's default:
    stop once no running beam can beat the worst kept hypothesis, judged at the current length), True
    (stop as soon as num_beams hypotheses are finished) or "never" (judged at the longest length when
    length_penalty > 0).
    """

    num_beams: int = 1
    num_return_sequences: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self):
        if not isinstance(self.num_beams, int) or isinstance(self.num_beams, bool) or self.num_beams < 1:
            raise ValueError(f"num_beams must be an integer >= 1, got {self.num_beams!r}")
        r = self.num_return_sequences
        if not isinstance(r, int) or isinstance(r, bool) or not 1 <= r <= self.num_beams:
            raise ValueError(f"num_return_sequences must be in [1, num_beams={self.num_beams}], got {r!r}")
        if not (isinstance(self.length_penalty, int | float) and math.isfinite(self.length_penalty)):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")
