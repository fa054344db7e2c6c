"""Where a stage's time goes: ``python -m bench.profile [--stages L3,L4:cpp,L6] [--workload b|a] [--quick]``.

Each stage runs the workload ((b) of ``make bench`` by default, or (a), batch-1 decode) once to warm up,
then once more with timers around the parts of its step. For the torch stages (L3-L5):

- ``schedule + pack``: the scheduler and ``prepare`` (Python, building the flat batch);
- ``matmuls + rest``: the model's forward minus its attention calls (projections, MLP, norms, RoPE, head);
- ``attention``: every layer's attention call, split into the K/V write (``set_kv``), the kernel or
  dense attention (``causal_attention`` in L3, the paged kernel in L4/L5) and what is left: in L3 the
  per-sequence gather (``index_select``) and loop, in L4/L5 the call's own overhead.

Times are whole seconds over the run and milliseconds per decode step (steps whose every row is a
decode token); the timers add a few microseconds per call. The chapters' profile tables come from this.

L6 (JAX) is one compiled call per prefill and one per decode loop (up to ``max_rounds`` steps on the
device), so its parts are the calls themselves, each timed to ``block_until_ready``: prefill, decode
(and its milliseconds per step), the host's reads of the state (``host_state``, device -> host) and
what is left, the host's Python (admission, packing the prefill work, the guard).

Left out on purpose: operator-level detail (``torch.profiler`` and ``jax.profiler`` give that).
"""

from __future__ import annotations

import argparse
import importlib
import time
from collections import defaultdict
from contextlib import ExitStack
from unittest import mock

from bench.measure import stage_options
from bench.workloads import FULL, QUICK, batch1_workload, mixed_workload
from kvcourse.model_store import resolve_model_dir
from kvcourse.stages import STAGES, engine_class

PARTS = ("schedule + pack", "matmuls + rest", "K/V write", "kernel", "gather + loop")


class Timers:
    """Seconds per timed call, for the whole run and for decode-only steps."""

    def __init__(self):
        self.total = defaultdict(float)
        self.decode = defaultdict(float)
        self.decode_steps = 0
        self.in_decode_step = False

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds = time.perf_counter() - t0
                self.total[name] += seconds
                if self.in_decode_step:
                    self.decode[name] += seconds

        return timed

    def parts(self, t: dict) -> dict:
        """Each part exclusive of the parts nested inside it."""
        return {
            "schedule + pack": t["step"] - t["forward"],
            "matmuls + rest": t["forward"] - t["attention"],
            "K/V write": t["K/V write"],
            "kernel": t["kernel"],
            "gather + loop": t["attention"] - t["K/V write"] - t["kernel"],
        }


def profile_stage(name: str, model_dir, prompts, budgets, options: dict) -> dict:
    """Run the workload twice on a fresh engine of stage ``name`` built with ``options``; time the parts of the
    second run."""
    engine = engine_class(name)(model_dir, **options)
    engine.generate(prompts, budgets, ignore_eos=True)  # warm-up
    timers = Timers()
    package = STAGES[name]
    prepare = engine.prepare

    def prepare_and_classify(batch):
        timers.in_decode_step = all(n == 1 for _, n in batch)
        timers.decode_steps += timers.in_decode_step
        return prepare(batch)

    steps_before = engine.stats().steps  # the warm-up's steps are not part of the profile
    with ExitStack() as patches:
        patch = lambda target, attr, name: patches.enter_context(  # noqa: E731
            mock.patch.object(target, attr, timers.wrap(name, getattr(target, attr)))
        )
        engine_module = importlib.import_module(f"{package}.engine")
        patch(engine_module, "attention", "attention")
        patch(engine.pool, "set_kv", "K/V write")
        patch(engine.model, "forward", "forward")
        patch(engine, "step", "step")
        if hasattr(engine, "kernel"):  # L4, L5: the paged kernel
            patch(engine, "kernel", "kernel")
        else:  # L3: dense attention on each sequence's gathered history
            patch(importlib.import_module(f"{package}.attention"), "causal_attention", "kernel")
        patches.enter_context(mock.patch.object(engine, "prepare", prepare_and_classify))
        t0 = time.perf_counter()
        engine.generate(prompts, budgets, ignore_eos=True)
        wall = time.perf_counter() - t0
    return {
        "seconds": wall,
        "steps": engine.stats().steps - steps_before,
        "decode_steps": timers.decode_steps,
        "total_s": timers.parts(timers.total),
        "decode_step_ms": {
            k: 1000 * v / max(timers.decode_steps, 1) for k, v in timers.parts(timers.decode).items()
        },
    }


def profile_l6(model_dir, prompts, budgets, options: dict) -> dict:
    """Run the workload twice on a fresh L6 engine (the first run compiles); time each call of the second."""
    import jax

    engine = engine_class("L6")(model_dir, **options)
    engine.generate(prompts, budgets, ignore_eos=True)  # warm-up, compiles every shape the workload needs
    seconds, calls = defaultdict(float), defaultdict(int)
    call, host_state = engine._call, engine.host_state

    def timed_call(name, fn, *args, **kwargs):
        t0 = time.perf_counter()
        out = jax.block_until_ready(call(name, fn, *args, **kwargs))
        seconds[name] += time.perf_counter() - t0
        calls[name] += 1
        return out

    def timed_host_state():
        t0 = time.perf_counter()
        out = host_state()
        seconds["host_state"] += time.perf_counter() - t0
        calls["host_state"] += 1
        return out

    steps_before = engine.stats().steps
    with (
        mock.patch.object(engine, "_call", timed_call),
        mock.patch.object(engine, "host_state", timed_host_state),
    ):
        t0 = time.perf_counter()
        engine.generate(prompts, budgets, ignore_eos=True)
        wall = time.perf_counter() - t0
    steps = engine.stats().steps - steps_before - calls["prefill"]  # a prefill call is one step
    parts = {name: seconds[name] for name in ("prefill", "decode", "host_state")}
    parts["host Python"] = wall - sum(seconds.values())
    return {"seconds": wall, "parts_s": parts, "calls": dict(calls), "steps": steps,
            "decode_step_ms": 1000 * seconds["decode"] / max(steps, 1)}  # fmt: skip


def l6_table(p: dict) -> str:
    """Markdown: L6's calls, seconds over the run, and ms per decode step."""
    lines = ["| L6 part | s (run) | calls |", "|---|---|---|"]
    lines += [f"| {name} | {sec:.2f} | {p['calls'].get(name, '-')} |" for name, sec in p["parts_s"].items()]
    lines.append(f"| **whole run** | {p['seconds']:.2f} | |")
    lines.append(f"\nL6: {p['steps']} decode steps on the device, {p['decode_step_ms']:.1f} ms each")
    return "\n".join(lines)


def table(profiles: dict) -> str:
    """Markdown: per stage, each part's seconds over the run and ms per decode step."""
    names = list(profiles)
    lines = [
        "| part | " + " | ".join(f"{n} s (run) | {n} ms/decode step" for n in names) + " |",
        "|---|" + "---|---|" * len(names),
    ]
    for part in PARTS:
        cells = [f"{p['total_s'][part]:.2f} | {p['decode_step_ms'][part]:.1f}" for p in profiles.values()]
        lines.append(f"| {part} | " + " | ".join(cells) + " |")
    cells = [f"{p['seconds']:.2f} | {sum(p['decode_step_ms'].values()):.1f}" for p in profiles.values()]
    lines.append("| **whole run / step** | " + " | ".join(cells) + " |")
    steps = [f"{p['steps']} steps | {p['decode_steps']} decode" for p in profiles.values()]
    lines.append("| steps | " + " | ".join(steps) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--stages", default="L3,L4:torch,L4:cpp,L5:cpp,L6",
        help="comma-separated stages, a torch one with an optional :kernel (default L3,L4:torch,L4:cpp,L5:cpp,L6)",
    )  # fmt: skip
    parser.add_argument(
        "--workload",
        choices=("b", "a"),
        default="b",
        help="(b) 32 mixed requests (default) or (a) batch-1 decode",
    )
    parser.add_argument("--quick", action="store_true", help="tiny model and sizes (for tests)")
    parser.add_argument("--model", help="model directory (default: the course model)")
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    if args.quick and not args.model:
        import tempfile

        from kvcourse.tiny import make_tiny_checkpoint

        model_dir = make_tiny_checkpoint("llama", tempfile.mkdtemp(prefix="kvcourse-profile-"))
    else:
        model_dir = resolve_model_dir(args.model)
    from kvcourse.config import ModelConfig

    vocab = ModelConfig.from_dir(model_dir).vocab_size
    if args.workload == "a":
        prompts, budgets = batch1_workload(model_dir, sizes["a_tokens"])
    else:
        prompts, budgets = mixed_workload(vocab, sizes["b_requests"], sizes["b_prompt"], sizes["b_new"])
    max_len = max(sizes["b_prompt"][1] + sizes["b_new"][1], len(prompts[0]) + budgets[0])
    profiles, l6 = {}, None
    for spec in args.stages.split(","):
        name, _, kernel = spec.partition(":")
        cls = engine_class(name)
        if name == "L6":
            l6 = profile_l6(model_dir, prompts, budgets, stage_options(cls, sizes, max_len))
            continue
        if not hasattr(cls, "prepare"):
            raise SystemExit(f"{name} has no scheduler step to profile; profile L3, L4, L5 or L6")
        options = stage_options(cls, sizes, max_len) | ({"kernel": kernel} if kernel else {})
        profiles[spec] = profile_stage(name, model_dir, prompts, budgets, options)
    print("\n\n".join(([table(profiles)] if profiles else []) + ([l6_table(l6)] if l6 else [])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
