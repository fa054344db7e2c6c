"""Serve a request stream in real time and measure it as the vLLM paper does.

``serve(engine, requests)`` feeds a paged engine (L3-L5: ``add_request`` + ``step``) in real time: a
request is submitted once the wall clock passes its arrival, the engine steps while anything is
unfinished, and sleeps until the next arrival when nothing is. After every step it records when each
request got new tokens, and the KV memory: positions of the blocks requests hold (held), positions holding K/V
(live), and the pool's positions (pool). ``serve`` returns a ``Timeline``; ``request_metrics`` and
``summary`` turn a timeline into the paper's numbers. Any serving loop that fills a ``Timeline`` (the
HF peers in ``bench/serving.py``) gets the same metrics.

Per request (``request_metrics``), times in seconds from the stream's start:

- TTFT (time to first token) = first token - arrival;
- TPOT (time per output token) = (last token - first token) / (output tokens - 1), for 2+ tokens;
- end-to-end latency = last token - arrival; normalized latency = end-to-end / output tokens (the
  paper's metric: "the mean of every request's end-to-end latency divided by its output length").

Per run (``summary``): mean normalized latency, TTFT and TPOT percentiles, output tokens/s over the
run, requests/s served, and KV memory shares summed over steps: live over held (``kv_utilization``, as
``EngineStats`` counts it), live over the pool (``kv_pool_share``) and held over the pool
(``kv_held_share``).

Left out on purpose: streaming to clients, timeouts and aborts, and warm-up (the caller warms up).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvcourse.harness.stream import Request


@dataclass
class Timeline:
    """What one served stream did, in seconds from its start."""

    arrivals: list[float]
    first_token: list[float | None]  # when each request's first output token came back
    last_token: list[float | None]  # when its last one did
    outputs: list[list[int]]  # its output tokens
    steps: list[dict] = field(default_factory=list)  # per step: t, held, live, pool (positions)
    token_times: dict[int, list[float]] = field(default_factory=dict)  # request -> when each token came
    preemptions: int = 0
    end: float = 0.0  # when the last request finished

    @classmethod
    def empty(cls, requests: list[Request]) -> Timeline:
        n = len(requests)
        return cls([r.arrival for r in requests], [None] * n, [None] * n, [[] for _ in range(n)])

    def tokens(self, i: int, tokens: list[int], now: float) -> None:
        """Request i has these output tokens at ``now``: stamp its first and latest token."""
        if tokens and len(tokens) > len(self.outputs[i]):
            if self.first_token[i] is None:
                self.first_token[i] = now
            self.last_token[i] = now
            self.token_times.setdefault(i, []).extend([now] * (len(tokens) - len(self.outputs[i])))
            self.outputs[i] = list(tokens)

    def gaps(self, i: int) -> list[float]:
        """Request i's inter-token gaps: the time between each output token and the one before."""
        times = self.token_times.get(i, [])
        return [b - a for a, b in zip(times, times[1:], strict=False)]


def serve(engine, requests: list[Request], clock=time.perf_counter, sleep=time.sleep) -> Timeline:
    """Feed ``requests`` (sorted by arrival) to a paged engine in real time; greedy, ``ignore_eos``."""
    timeline, seqs = Timeline.empty(requests), []
    block_size = engine.allocator.block_size
    pool = engine.allocator.num_blocks * block_size
    preempted_before = engine.stats().preemptions
    start = clock()
    while len(seqs) < len(requests) or engine.has_unfinished():
        now = clock() - start
        while len(seqs) < len(requests) and requests[len(seqs)].arrival <= now:
            r = requests[len(seqs)]
            seqs.append(engine.add_request(r.prompt_ids, r.max_new_tokens, ignore_eos=True))
        if not engine.has_unfinished():
            sleep(max(0.0, requests[len(seqs)].arrival - (clock() - start)))
            continue
        engine.step()
        now = clock() - start
        for i, seq in enumerate(seqs):
            timeline.tokens(i, seq.output_ids, now)
        live = sum(seq.num_computed_tokens for seq in engine.scheduler.running)
        timeline.steps.append(
            {"t": now, "held": engine.allocator.num_used * block_size, "live": live, "pool": pool}
        )
    timeline.end = clock() - start
    timeline.preemptions = engine.stats().preemptions - preempted_before
    return timeline


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100), linear between ranks; None for no values.
    Example: ``percentile([1, 2, 3, 4], 50) -> 2.5``; ``percentile([1, 2, 3, 4], 99) -> 3.97``."""
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def request_metrics(timeline: Timeline) -> list[dict]:
    """Per request: TTFT, TPOT (None for one output token), end-to-end and normalized latency."""
    rows = []
    for arrival, first, last, out in zip(
        timeline.arrivals, timeline.first_token, timeline.last_token, timeline.outputs, strict=True
    ):
        if first is None or last is None:
            raise ValueError("a request never produced a token: the stream was not served to the end")
        n = len(out)
        rows.append(
            {
                "ttft": first - arrival,
                "tpot": (last - first) / (n - 1) if n > 1 else None,
                "e2e": last - arrival,
                "normalized": (last - arrival) / n,
                "output_tokens": n,
            }
        )
    return rows


def summary(timeline: Timeline) -> dict:
    """Per run: latency means and percentiles, throughput, preemptions, and KV memory shares."""
    rows = request_metrics(timeline)
    tpots = [r["tpot"] for r in rows if r["tpot"] is not None]
    ttfts = [r["ttft"] for r in rows]
    span = timeline.end - min(timeline.arrivals) if rows else 0.0
    held = sum(s["held"] for s in timeline.steps)
    live = sum(s["live"] for s in timeline.steps)
    pool = sum(s["pool"] for s in timeline.steps)
    return {
        "requests": len(rows),
        "mean_normalized_latency": sum(r["normalized"] for r in rows) / len(rows) if rows else None,
        "mean_e2e": sum(r["e2e"] for r in rows) / len(rows) if rows else None,
        "ttft_p50": percentile(ttfts, 50),
        "ttft_p99": percentile(ttfts, 99),
        "tpot_p50": percentile(tpots, 50),
        "tpot_p99": percentile(tpots, 99),
        "output_tokens_per_s": sum(r["output_tokens"] for r in rows) / span if span > 0 else None,
        "requests_per_s": len(rows) / span if span > 0 else None,
        "preemptions": timeline.preemptions,
        "steps": len(timeline.steps),
        "kv_utilization": live / held if held else None,  # of the memory requests held
        "kv_pool_share": live / pool if pool else None,  # of the whole pool
        "kv_held_share": held / pool if pool else None,
        "duration_s": timeline.end,
    }
