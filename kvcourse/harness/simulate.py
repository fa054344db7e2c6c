"""Serving at the vLLM paper's scale on a simulated clock: the real scheduler and allocator, a step-cost
model in place of the model.

``SimulatedEngine(config, cost)`` builds the same books an L3 engine builds, from the same code:
``kvcourse.orca.make_allocator(config, BlockAllocator, OutOfBlocksError)`` with L3's free list and
error, as L3's engine calls it (paging's free list, or the buddy allocator of the paper's Orca
baselines), and L3's ``Scheduler``. It takes
requests through ``config.check_requests``, as the engine's ``add_request`` does, and each ``step()``
does what the engine's does, without the forward:

    batch = scheduler.schedule()          the same decisions: who runs, how many tokens, who waits
    clock += cost.seconds(batch)          the time the step would have taken (``StepCost``)
    scheduler.update(batch, tokens)       a token for each row that ran its last known token

Every request runs with ``ignore_eos`` and the scheduler is given no eos ids, so the token's value
changes no decision: a request finishes after exactly ``max_new_tokens``. The tokens are one id
repeated (``update`` takes one for each row that needs one, in batch order). ``serve`` (the real-time loop
of ``kvcourse.harness.serving``) measures it unchanged, given the engine's ``clock`` and ``sleep``, so
``summary`` reports the same metrics as for a real engine, at thousands of requests a point in seconds.

**The step-cost model** (``StepCost``): a step's seconds = tokens(T) + per_seq x (sequences in the
step) + per_context x (context tokens the step's attention reads: each sequence's computed tokens plus
its new ones), where T is the tokens computed in the step and ``tokens`` is a curve through measured
points (token count, seconds), straight between them and along its end segments beyond them. A line
(``StepCost.line(base, per_token, ...)``: two points) is the simplest curve; a CPU needs more, because
its matrix library changes kernels with the row count, so the cost jumps between neighbouring counts
(``bench/results/step-cost-cpu.json``, the course's 2-core Intel VM: 73 ms at 3 tokens, 128 at 4, 237
at 32 and 224 at 64). ``StepCost.fit`` puts the curve's points at 1, 2, 3, 4, 6, 8, 12, ..., 64, then
128, 256, ... (``token_points``) up to the largest T it is given, and
finds them and the two other coefficients, none negative, by least squares on the error relative to
the model's own prediction (a step of 40 ms and one of 2 s count alike); ``StepCost.load`` reads a
profile ``bench.simulate`` wrote. Example: ``StepCost.line(0.04, 0.002, 0.0, 1e-6)`` prices a decode
step of 32 sequences, each reading 512 positions (511 computed and its new one), at 0.04 + 32 x 0.002 +
16,384 x 1e-6 = 0.1204 s.

Left out on purpose: the forward itself (the simulator says when, not what), the spread of real step
times around the model (a real run on a shared machine drifts), time spent between steps (scheduling
and the serving loop, which the calibration counts inside each step), and anything a step's time
depends on beyond these three counts (prompt lengths inside a batch, the kernel's launch shapes).
"""

from __future__ import annotations

import bisect
import importlib
import itertools
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvcourse.engine_config import EngineConfig
from kvcourse.harness.serving import Timeline, serve
from kvcourse.harness.stages import STAGES
from kvcourse.harness.stream import Request
from kvcourse.orca import make_allocator

MODULES = ("allocator", "scheduler", "sequence")  # L3's: BlockAllocator and OutOfBlocksError, Scheduler, Sequence


def step_features(batch) -> tuple[int, int, int]:
    """(tokens computed, sequences, context tokens read) of a step's batch of (sequence, num_new), taken
    before the step runs. Example: one sequence decoding at 100 computed positions and one running a
    prefill chunk of 32 after 64 -> (33, 2, 101 + 96 = 197)."""
    tokens = context = 0
    for seq, num_new in batch:
        tokens += num_new
        context += seq.num_computed_tokens + num_new
    return tokens, len(batch), context


def token_points(largest: int) -> list[int]:
    """Where a fitted token curve may have its points: 1, 2, 3, 4, 6, 8, 12, ... 48, 64 (each power of two
    and one and a half times it, where a CPU's matrix library switches kernels), then 128, 256, ... (the
    powers of two), up to the first at or above ``largest``. Example: 20 -> [1, 2, 3, 4, 6, 8, 12, 16, 24];
    200 -> [..., 48, 64, 128, 256]."""
    points = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
    while points[-1] < largest:
        points.append(2 * points[-1])
    return points[: next(i for i, p in enumerate(points) if p >= largest) + 1]


def hats(points: list[int], t: float) -> list[float]:
    """The weights that read a curve through ``points`` at ``t``: two neighbours share it linearly, and
    beyond the ends the end segment goes on. Example: points [1, 2, 4], t 3 -> [0, 0.5, 0.5]; t 6 ->
    [0, -1, 2] (the segment from 2 to 4, one length further)."""
    out = [0.0] * len(points)
    j = max(1, min(len(points) - 1, bisect.bisect_left(points, t)))  # the segment (points[j - 1], points[j])
    share = (t - points[j - 1]) / (points[j] - points[j - 1])
    out[j - 1], out[j] = 1.0 - share, share
    return out


@dataclass(frozen=True)
class StepCost:
    """Seconds a step takes: the ``tokens`` curve at its tokens + per_seq x sequences + per_context x
    context (the module docstring)."""

    tokens: tuple[tuple[int, float], ...]  # (token count, seconds) points, token counts increasing
    per_seq: float
    per_context: float

    def __post_init__(self):
        points = tuple((int(t), float(s)) for t, s in self.tokens)  # JSON gives lists
        if len(points) < 2 or any(a[0] >= b[0] for a, b in zip(points, points[1:], strict=False)):
            raise ValueError(f"a token curve needs 2 or more points with increasing token counts, got {points}")
        object.__setattr__(self, "tokens", points)

    @classmethod
    def line(cls, base: float, per_token: float, per_seq: float, per_context: float) -> StepCost:
        """The straight curve base + per_token x T (through T = 0 and T = 1)."""
        return cls(((0, base), (1, base + per_token)), per_seq, per_context)

    def predict(self, tokens: int, seqs: int, context: int) -> float:
        weights = hats([t for t, _ in self.tokens], tokens)
        curve = sum(w * s for w, (_, s) in zip(weights, self.tokens, strict=True))
        return curve + self.per_seq * seqs + self.per_context * context

    def scaled(self, factor: float) -> StepCost:
        """Every price times ``factor``: the same shape on a machine ``factor`` times slower. Example:
        ``StepCost.line(0.01, 0.001, 0, 0).scaled(2).predict(10, 1, 0)`` is 0.04 (0.02 unscaled)."""
        return StepCost(tuple((t, s * factor) for t, s in self.tokens), self.per_seq * factor, self.per_context * factor)

    def seconds(self, batch) -> float:
        """The modelled time of one step's batch (``step_features``)."""
        return self.predict(*step_features(batch))

    @classmethod
    def fit(cls, samples: list[dict], rounds: int = 4) -> StepCost:
        """The curve's points (at ``token_points`` of the largest sample's tokens, those some sample
        reads) and per_seq and per_context, none negative, from timed steps (each a dict of ``tokens``,
        ``seqs``, ``context`` and ``seconds``). Least squares on the relative error, each residual
        divided by the model's prediction of the previous round (the first round: by the measured
        time). Dividing by the measured time instead favours the steps that ran fast, and the fit comes
        out low: fitted to each real run's own steps, 0.92-0.99 of their total in the committed
        ``bench/results/serving.json`` (``in_sample``), against 1.00 this way. Needs as many samples
        as coefficients."""
        if not samples:
            raise ValueError("fitting a step cost needs timed steps, got none")
        from scipy.optimize import nnls

        points = token_points(max(s["tokens"] for s in samples))
        x = np.array([hats(points, s["tokens"]) + [s["seqs"], s["context"]] for s in samples])  # (N, P + 2)
        read = np.abs(x).sum(axis=0) > 0  # a point no sample reads has nothing to fit
        read[-2:] = True
        points = [p for p, keep in zip(points, read[:-2], strict=True) if keep]
        x = x[:, read]
        if len(samples) < x.shape[1]:
            raise ValueError(f"fitting {x.shape[1]} coefficients needs at least {x.shape[1]} samples, "
                             f"got {len(samples)}")  # fmt: skip
        y = np.array([s["seconds"] for s in samples])  # (N,)
        if (y <= 0).any():
            raise ValueError("every sample's seconds must be > 0")
        scale = np.abs(x).max(axis=0)  # columns to 1 at most: the solver sees numbers of one size
        x = x / scale
        weight = 1.0 / y
        for _ in range(rounds):
            coef, _ = nnls(x * weight[:, None], y * weight)
            weight = 1.0 / np.maximum(x @ coef, 1e-3 * y.min())
        coef = coef / scale
        return cls(tuple(zip(points, (float(c) for c in coef[:-2]), strict=True)), float(coef[-2]), float(coef[-1]))

    def quality(self, samples: list[dict]) -> dict:
        """How well the model predicts ``samples``: R^2 of the seconds, the mean and largest relative
        error |predicted - measured| / measured, and the predicted total over the measured total."""
        y = np.array([s["seconds"] for s in samples])
        p = np.array([self.predict(s["tokens"], s["seqs"], s["context"]) for s in samples])
        relative = np.abs(p - y) / y
        r2 = 1 - ((p - y) ** 2).sum() / ((y - y.mean()) ** 2).sum() if len(y) > 1 else None
        return {"r2": float(r2) if r2 is not None else None, "mean_relative_error": float(relative.mean()),
                "max_relative_error": float(relative.max()), "total_ratio": float(p.sum() / y.sum())}  # fmt: skip

    def as_json(self) -> dict:
        """The profile's ``coefficients`` as ``bench.simulate`` writes them (what ``load`` reads)."""
        return {"tokens": [list(p) for p in self.tokens], "per_seq": self.per_seq, "per_context": self.per_context}

    @classmethod
    def from_json(cls, coefficients: dict) -> StepCost:
        """The cost ``as_json`` wrote."""
        return cls(coefficients["tokens"], float(coefficients["per_seq"]), float(coefficients["per_context"]))

    @classmethod
    def load(cls, path: str | Path) -> StepCost:
        """A profile's coefficients, from the JSON ``bench.simulate`` wrote (``bench/results/step-cost-cpu.json``,
        ``step-cost-gpu.json``: its ``coefficients``, in seconds)."""
        return cls.from_json(json.loads(Path(path).read_text(encoding="utf-8"))["coefficients"])


@dataclass(frozen=True)
class SimulatedStats:
    """What ``serve`` and a report read of a run: the counters an engine's ``stats()`` has."""

    steps: int
    tokens_run: int
    preemptions: int


class SimulatedEngine:
    """The L3 engine's scheduler and allocator, stepped on a simulated clock (the module docstring).

    Example: ``engine = SimulatedEngine(EngineConfig(max_model_len=64, num_blocks=8, max_num_batched_tokens=64,
    vocab_size=100), StepCost.line(0.01, 0.001, 0, 0))``; ``engine.add_request([5] * 10, 3)``; the first ``step()`` runs the
    10-token prompt (0.01 + 10 x 0.001 = 0.02 s) and the next two decode one token each (0.011 s):
    ``engine.now`` is 0.042 after them and the request has finished.
    """

    TOKEN = 0  # every generated token: with ignore_eos and no eos ids its value decides nothing

    def __init__(self, config: EngineConfig, cost: StepCost):
        # the stage's modules, looked up by name when used, as ``kvcourse.harness.stages`` does: shared code
        # names a stage but imports none
        allocator, scheduler, sequence = (importlib.import_module(f"{STAGES['L3']}.{m}") for m in MODULES)
        missing = [name for name in ("max_model_len", "num_blocks", "max_num_batched_tokens", "vocab_size")
                   if not getattr(config, name)]  # fmt: skip
        if missing:
            raise ValueError(
                f"a simulated engine needs {', '.join(missing)} in its config (an engine's build sets them)"
            )
        self.config, self.cost, self._sequence = config, cost, sequence.Sequence
        self.allocator = make_allocator(config, allocator.BlockAllocator, allocator.OutOfBlocksError)
        self.scheduler = scheduler.Scheduler(self.allocator, config, eos_ids=())
        self.now = 0.0  # the simulated clock, in seconds
        self.num_steps = self.num_tokens_run = 0
        self._ids = itertools.count()

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(0.0, seconds)

    def add_request(self, prompt_ids: list[int], max_new_tokens: int, *, ignore_eos: bool = True):
        """Submit one request, checked as the engine's ``add_request`` checks it; returns its sequence."""
        [max_new_tokens] = self.config.check_requests([prompt_ids], max_new_tokens, label="request")
        seq = self._sequence(next(self._ids), list(prompt_ids), max_new_tokens, ignore_eos)
        self.scheduler.add(seq)
        return seq

    def step(self) -> list:
        """Schedule one step, advance the clock by its modelled time, record it. Returns the sequences
        it finished."""
        batch = self.scheduler.schedule()
        if not batch:
            return []
        tokens, seqs, context = step_features(batch)
        self.now += self.cost.predict(tokens, seqs, context)
        self.num_steps += 1
        self.num_tokens_run += tokens
        return self.scheduler.update(batch, itertools.repeat(self.TOKEN))  # it takes one per row that needs one

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> SimulatedStats:
        return SimulatedStats(self.num_steps, self.num_tokens_run, self.scheduler.num_preemptions)


def simulate(requests: list[Request], config: EngineConfig, cost: StepCost) -> Timeline:
    """Serve ``requests`` on a fresh simulated engine; the timeline ``serve`` records, in simulated seconds."""
    engine = SimulatedEngine(config, cost)
    return serve(engine, requests, clock=engine.clock, sleep=engine.sleep)
