"""Serve a request stream in real time and measure it as the vLLM paper does.

``serve(engine, requests)`` feeds a paged engine (L3-L5: ``add_request`` + ``step``) in real time: a
request is submitted once the clock passes its arrival, the engine steps while anything is
unfinished, and sleeps until the next arrival when nothing is. After every step it records when the
running and just-finished requests got new tokens (work per step grows with the running sequences,
not with the stream), and the KV memory (``memory_now``). ``serve`` returns a ``Timeline``;
``request_metrics`` and ``summary`` turn a timeline into the paper's numbers. Any serving loop that
fills a ``Timeline`` (the HF peers in ``bench/serving.py``) gets the same latency metrics; any clock
does too: ``kvcourse.harness.simulate`` passes a simulated one.

Per request (``request_metrics``), times in seconds from the stream's start:

- TTFT (time to first token) = first token - arrival;
- TPOT (time per output token) = (last token - first token) / (output tokens - 1), for 2+ tokens;
- end-to-end latency = last token - arrival; normalized latency = end-to-end / output tokens (the
  paper's metric: "the mean of every request's end-to-end latency divided by its output length").

Per run (``summary``): mean normalized latency, TTFT and TPOT percentiles, output tokens/s over the
run, requests/s served, KV memory shares summed over steps: live over held (``kv_utilization``, as
``EngineStats`` counts it), live over the pool (``kv_pool_share``) and held over the pool
(``kv_held_share``), and ``memory_breakdown``, the paper's Fig. 2 measured here.

**The memory breakdown.** The paper's Fig. 2 ("Average percentage of memory wastes in different LLM
serving systems during the experiment in section 6.2") splits KV memory into token states,
reservation, internal fragmentation, and external fragmentation & others: Orca (Max) 20.4 / 13.3 /
57.3 / 8.9 %, Orca (Pow2) 26.8 / 17.9 / 13.6 / 41.6 %, Orca (Oracle) 38.2 / 25.2 / - / 36.6 %, and
vLLM 96.3 % token states. The paper does not say how it weighted its average. Here, after each step
(``memory_now``, in positions): ``live`` = K/V computed of the running sequences; ``fill`` = over the
running sequences, min(blocks held x block_size, prompt + max_new_tokens), the positions they hold
that will hold a token; ``held`` = the allocator's used blocks x block_size (a buddy run's unused tail
included); ``external`` = the free positions, when the head of the waiting queue is blocked only by
contiguity (its run fits the free blocks but not the largest free run, and a sequence slot is free;
always 0 on the paged free list); ``pool``; and the number waiting. ``memory_breakdown`` averages the
shares of the pool over the steps after which at least one request waits (memory is what binds
then), each step weighted by its duration: token states = live, reservation = fill - live, internal
fragmentation = held - fill, external fragmentation = external, other free = the rest; they sum to 1.
The paper's fourth bar ("external frag. & others") is this external plus other free.

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
    steps: list[dict] = field(default_factory=list)  # per step: t, dt, memory_now's counts (positions)
    token_times: dict[int, list[float]] = field(default_factory=dict)  # request -> when each token came
    preemptions: int = 0
    end: float = 0.0  # when the last request finished

    @classmethod
    def empty(cls, requests: list[Request]) -> Timeline:
        n = len(requests)
        return cls([r.arrival for r in requests], [None] * n, [None] * n, [[] for _ in range(n)])

    def tokens(self, i: int, tokens: list[int], now: float) -> None:
        """Request i has these output tokens at ``now`` (its earlier ones and maybe new ones): stamp its
        first and latest token. Only the new tokens are copied, so a call costs what it adds."""
        new = len(tokens) - len(self.outputs[i])
        if new > 0:
            if self.first_token[i] is None:
                self.first_token[i] = now
            self.last_token[i] = now
            self.token_times.setdefault(i, []).extend([now] * new)
            self.outputs[i].extend(tokens[-new:])

    def gaps(self, i: int) -> list[float]:
        """Request i's inter-token gaps: the time between each output token and the one before."""
        times = self.token_times.get(i, [])
        return [b - a for a, b in zip(times, times[1:], strict=False)]


def serve(engine, requests: list[Request], clock=time.perf_counter, sleep=time.sleep) -> Timeline:
    """Feed ``requests`` (sorted by arrival) to a paged engine in real time; greedy, ``ignore_eos``.
    ``clock`` and ``sleep`` may be a simulated clock's (``kvcourse.harness.simulate``)."""
    timeline, submitted = Timeline.empty(requests), {}  # sequence -> its request's index
    preempted_before = engine.stats().preemptions
    start = clock()
    while len(submitted) < len(requests) or engine.has_unfinished():
        now = clock() - start
        while len(submitted) < len(requests) and requests[len(submitted)].arrival <= now:
            r = requests[len(submitted)]
            submitted[engine.add_request(r.prompt_ids, r.max_new_tokens, ignore_eos=True)] = len(submitted)
        if not engine.has_unfinished():
            sleep(max(0.0, requests[len(submitted)].arrival - (clock() - start)))
            continue
        began = clock() - start
        finished = engine.step()
        now = clock() - start
        for seq in [*engine.scheduler.running, *finished]:  # only they can have new tokens
            timeline.tokens(submitted[seq], seq.output_ids, now)
        timeline.steps.append({"t": now, "dt": now - began, **memory_now(engine)})
    timeline.end = clock() - start
    timeline.preemptions = engine.stats().preemptions - preempted_before
    return timeline


def memory_now(engine) -> dict:
    """The KV memory between steps, in positions: ``live``, ``fill``, ``held``, ``external``, ``pool``
    and the number ``waiting`` (the module docstring defines them), and ``tables``, the positions of the
    running sequences' block tables (held - tables: the unused tails of buddy runs).

    Example, blocks of 16, an Orca (Oracle) engine of 8 blocks: one running request of prompt 20 and
    output 25 (45 positions: 3 blocks, a buddy run of 4) that has computed 30 positions, and a waiting
    one of 50 positions (4 blocks): live 30, fill min(3 x 16, 45) = 45, held 64, and the waiting one's
    run of 4 fits the 4 free blocks and the free run of 4, so external 0 (were the 4 free blocks two
    runs of 2, it would be 4 x 16 = 64).
    """
    allocator, scheduler, config = engine.allocator, engine.scheduler, engine.config
    block_size = allocator.block_size
    live = fill = tables = 0
    for seq in scheduler.running:
        live += seq.num_computed_tokens
        tables += len(seq.block_table) * block_size
        fill += min(len(seq.block_table) * block_size, len(seq.prompt_ids) + seq.max_new_tokens)
    external = 0
    if config.admission_policy != "on_demand" and scheduler.waiting and len(scheduler.running) < config.max_num_seqs:
        head = scheduler.waiting[0]
        reserve = max(len(head.prompt_ids), config.hold_len(len(head.prompt_ids), head.max_new_tokens))
        run = config.run_blocks(-(-reserve // block_size))
        if allocator.largest_free_run < run <= allocator.num_free:
            external = allocator.num_free * block_size
    return {
        "live": live,
        "fill": fill,
        "tables": tables,
        "held": allocator.num_used * block_size,
        "external": external,
        "pool": allocator.num_blocks * block_size,
        "waiting": len(scheduler.waiting),
    }


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
    """Per run: latency means and percentiles, throughput, preemptions, KV memory shares, and the
    memory breakdown (``memory_breakdown``)."""
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
        "memory_breakdown": memory_breakdown(timeline.steps),
        "duration_s": timeline.end,
    }


def memory_breakdown(steps: list[dict]) -> dict | None:
    """The pool's shares (Fig. 2 of the paper), averaged over the steps after which a request waits,
    each weighted by its duration ``dt``; None when no request ever waited.

    Example, a pool of 100 positions and two steps after which one request waits, of 1 s and 3 s: live
    20 and 40, fill 30 and 50, held 60 and 80, external 0 and 20. Token states (20 x 1 + 40 x 3) / 400
    = 0.35, reservation (10 + 30) / 400 = 0.1, internal fragmentation (30 + 90) / 400 = 0.3, external
    (0 + 60) / 400 = 0.15, other free (40 + 0) / 400 = 0.1. ``internal_of_which_buddy_rounding``: the
    part of internal fragmentation that is buddy runs' unused tails (held - ``tables``), the rest being
    what the policy reserved past the request's length and its last block's rounding.
    """
    busy = [s for s in steps if s["waiting"] > 0]
    total = sum(s["pool"] * s["dt"] for s in busy)
    if not total:
        return None

    def share(part) -> float:
        return sum(part(s) * s["dt"] for s in busy) / total

    shares = {
        "token_states": share(lambda s: s["live"]),
        "reservation": share(lambda s: s["fill"] - s["live"]),
        "internal_fragmentation": share(lambda s: s["held"] - s["fill"]),
        "external_fragmentation": share(lambda s: s["external"]),
        "other_free": share(lambda s: s["pool"] - s["held"] - s["external"]),
    }
    rounding = share(lambda s: s["held"] - s["tables"])  # of internal: the buddy runs' unused tails
    return shares | {"internal_of_which_buddy_rounding": rounding, "steps": len(busy),
                     "seconds": sum(s["dt"] for s in busy)}  # fmt: skip
