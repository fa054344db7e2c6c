"""A request stream: requests that arrive over time, with lengths shaped like the vLLM paper's datasets.

The vLLM paper (Kwon et al., "Efficient Memory Management for Large Language Model Serving with
PagedAttention", SOSP 2023, section 6.1) synthesizes its workloads from the ShareGPT and Alpaca
datasets' input and output lengths, with arrival times drawn from a Poisson process at a given request
rate. Its section 6.1 says ShareGPT has "8.4x longer input prompts and 5.8x longer outputs on average
than the Alpaca dataset, with higher variance"; its Fig. 11 gives the means read here: ShareGPT
161.31 input and 337.99 output tokens, Alpaca 19.31 and 58.45 (8.35x and 5.78x).

The course has neither dataset offline, so ``MIXES`` are **synthetic**: lengths drawn from a lognormal
distribution with the paper's mean for each dataset (``sigma`` sets the spread: ShareGPT's wider, as
the paper says), clipped to [1, ``cap``]. Clipping pulls the mean down a little; ``describe`` reports
the means actually drawn. ``scale`` shrinks every mean for runs a small machine can afford (the bench
says which scale it ran). Prompts are random token ids: with fixed output lengths (``ignore_eos``)
their text changes no timing.

- ``poisson_arrivals(n, rate, seed)``: arrival times with exponential gaps of mean 1/rate;
- ``synthetic_stream(mix, n, rate, seed, ...)``: n requests of a mix arriving at that rate; the same
  seed draws the same requests at every rate (only the gaps scale), so one HF reference checks them all;
- ``read_trace(path)``: a trace file instead, one JSON object per line: ``{"arrival": seconds,
  "prompt_len": n, "output_len": m}`` (or ``"prompt_ids": [...]`` instead of ``prompt_len``).

Left out on purpose: the datasets themselves (no download), multi-turn conversations (the paper's
chatbot workload), and sampling parameters per request (every request is greedy).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, replace
from pathlib import Path

# The paper's means (Fig. 11), the spread of the synthetic draw, and its label.
MIXES = {
    "sharegpt": {
        "input_mean": 161.31,
        "output_mean": 337.99,
        "sigma": 0.9,
        "label": "ShareGPT-like (synthetic)",
    },
    "alpaca": {"input_mean": 19.31, "output_mean": 58.45, "sigma": 0.6, "label": "Alpaca-like (synthetic)"},
}


@dataclass(frozen=True)
class Request:
    arrival: float  # seconds after the stream starts
    prompt_ids: list[int]
    max_new_tokens: int  # the output length: requests run with ignore_eos, so exactly this many


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """n arrival times (seconds) of a Poisson process of ``rate`` requests/s: exponential gaps, the
    first at 0. Example: ``poisson_arrivals(3, 2.0, 0) -> [0.0, 0.9303..., 1.6396...]``."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    rng = random.Random(seed)
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(rate)
    return times


def lognormal_length(rng: random.Random, mean: float, sigma: float, cap: int) -> int:
    """One length from a lognormal of this mean and spread (mu = ln(mean) - sigma^2 / 2), in [1, cap]."""
    mu = math.log(mean) - sigma * sigma / 2
    return max(1, min(cap, round(rng.lognormvariate(mu, sigma))))


def synthetic_stream(
    mix: str,
    n: int,
    rate: float,
    seed: int,
    *,
    vocab_size: int,
    max_model_len: int,
    scale: float = 1.0,
    first_id: int = 3,
) -> list[Request]:
    """n requests of ``MIXES[mix]`` (means times ``scale``), arriving as a Poisson process at ``rate``.

    Each request's prompt + output fits ``max_model_len`` (the output is cut first, to at least 1).
    Token ids are drawn from [first_id, vocab_size) (below first_id: the special tokens).
    """
    if mix not in MIXES:
        raise ValueError(f"mix must be one of {sorted(MIXES)}, got {mix!r}")
    shape, rng = MIXES[mix], random.Random(seed)
    requests = []
    for arrival in poisson_arrivals(n, rate, seed + 1):
        prompt = lognormal_length(rng, shape["input_mean"] * scale, shape["sigma"], max_model_len - 1)
        output = lognormal_length(rng, shape["output_mean"] * scale, shape["sigma"], max_model_len - prompt)
        ids = [rng.randrange(first_id, vocab_size) for _ in range(prompt)]
        requests.append(Request(arrival, ids, output))
    return requests


def at_rate(requests: list[Request], rate: float, seed: int) -> list[Request]:
    """The same requests arriving at another rate (new Poisson arrivals from ``seed``)."""
    times = poisson_arrivals(len(requests), rate, seed)
    return [replace(r, arrival=t) for r, t in zip(requests, times, strict=True)]


def read_trace(path: str | Path, *, vocab_size: int, seed: int = 0, first_id: int = 3) -> list[Request]:
    """Requests from a trace file (JSONL, one request a line, arrivals in seconds, sorted or not):
    ``{"arrival": 0.5, "prompt_len": 12, "output_len": 30}``; ``"prompt_ids"`` may replace
    ``prompt_len``. Prompt ids for a ``prompt_len`` are drawn from ``seed``. Bad lines are refused
    naming the line."""
    rng, requests = random.Random(seed), []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            arrival, output = float(row["arrival"]), int(row["output_len"])
            ids = row.get("prompt_ids") or [
                rng.randrange(first_id, vocab_size) for _ in range(int(row["prompt_len"]))
            ]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(
                f"{path}:{number}: expected arrival, output_len and prompt_len or prompt_ids ({e})"
            ) from None
        if arrival < 0 or output < 1 or not ids:
            raise ValueError(f"{path}:{number}: arrival must be >= 0, output_len >= 1, the prompt non-empty")
        requests.append(Request(arrival, [int(t) for t in ids], output))
    return sorted(requests, key=lambda r: r.arrival)


def describe(requests: list[Request]) -> dict:
    """The stream as drawn: count, span, and mean prompt and output lengths."""
    n = len(requests)
    return {
        "requests": n,
        "span_s": requests[-1].arrival - requests[0].arrival if n else 0.0,
        "mean_prompt": sum(len(r.prompt_ids) for r in requests) / n if n else 0.0,
        "mean_output": sum(r.max_new_tokens for r in requests) / n if n else 0.0,
    }
