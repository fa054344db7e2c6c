"""Which fast path moves a token away from HF batch 1: ``python -m bench.agreement [--device auto|cpu|cuda]
[--quick] [--model DIR] [--out FILE]``.

On the H200 of 2026-11-28 (``bench/gpu-runs/2026-11-28/``) every L4 and L5 row of workload (b) left
HF batch 1 on one request, at a position where HF's top-2 logit gap was 0.0051, beyond the tie rule.
The rows shared the Triton kernel's defaults of that commit (3xTF32 dots, automatic splits) and
differed in decode graphs, so this runs (b) once with HF batch 1 (``bench.systems.hf_batch1``: fixed
length, its per-position gaps kept) and then L4 once per way of running its attention, each on a
fresh engine with the bench's options (``bench.measure.stage_options``):

- on a GPU: the Triton kernel's dots in IEEE fp32 or 3xTF32 (``LaunchConfig.precision``, forced on
  every launch the engine makes, ``FULL_GRID_DECODE`` included), each eager and with decode graphs,
  and the PyTorch reference kernel (``kernel="torch"``, no Triton at all);
- on a CPU: the C++ kernel and the PyTorch reference kernel (the interpreter has one precision).

Per way: the requests that match HF batch 1, the ties, and each mismatch with its position and HF's
gap there (``bench.measure.agreement``). A way that matches where another does not names the change
that moved the token. ``--out`` writes the JSON with the command, commit and machine.

Left out on purpose: L5 (it runs L4's kernel and graphs), timing (``bench.run`` times), and any
fix: this only says where to look.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from unittest import mock

import torch

from bench.measure import (
    add_device_option,
    agreement,
    chosen_device,
    cpp_kernel_problem,
    provenance,
    stage_options,
)
from bench.systems import hf_batch1, stage
from bench.workloads import FULL, QUICK, mixed_workload
from kvcourse.harness.stages import engine_class


def ways(gpu: bool) -> dict[str, tuple[dict, str | None]]:
    """Each way of running L4's attention: (engine options, the Triton dots' precision or None)."""
    if not gpu:
        cpp = {} if cpp_kernel_problem(engine_class("L4")) else {"C++ kernel": ({"kernel": "cpp"}, None)}
        return cpp | {"PyTorch reference kernel": ({"kernel": "torch"}, None)}
    return {
        f"Triton, {precision} dots, {mode}": ({"kernel": "triton", "cuda_graphs": graphs}, precision)
        for precision in ("ieee", "tf32x3")
        for mode, graphs in (("eager", False), ("decode graphs", True))
    } | {"PyTorch reference kernel, eager": ({"kernel": "torch", "cuda_graphs": False}, None)}


def forced(precision: str | None):
    """A context in which every Triton launch L4 makes uses ``precision`` (nothing changed for None)."""
    if precision is None:
        return contextlib.nullcontext()
    from L4_paged_kernel.fast import triton_paged_attention as tpa

    choose = tpa.choose_launch

    def choose_launch(*args, **kwargs):
        return replace(choose(*args, **kwargs), precision=precision)

    full_grid = replace(tpa.FULL_GRID_DECODE, precision=precision)
    return mock.patch.multiple(tpa, choose_launch=choose_launch, FULL_GRID_DECODE=full_grid)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.agreement", description=__doc__.splitlines()[0])
    add_device_option(parser, "HF and L4")
    parser.add_argument("--quick", action="store_true", help="tiny model and sizes (for tests)")
    parser.add_argument("--model", help="model directory (default: the course model)")
    parser.add_argument("--out", help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    device = chosen_device(args.device)
    if device is None:
        return 2
    from kvcourse.config import ModelConfig
    from kvcourse.harness.tiny import make_tiny_checkpoint
    from kvcourse.model_store import resolve_model_dir

    sizes = QUICK if args.quick else FULL
    if args.quick and not args.model:
        args.model = make_tiny_checkpoint("llama", Path(tempfile.mkdtemp(prefix="kvcourse-agreement-")) / "m")
    model_dir = resolve_model_dir(args.model)
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    prompts, max_new = mixed_workload(vocab, sizes["b_requests"], sizes["b_prompt"], sizes["b_new"])
    reference = hf_batch1(model_dir, str(device))
    reference.run(prompts, max_new)
    refs = list(reference.references)
    options = stage_options(engine_class("L4"), sizes, sizes["b_prompt"][1] + sizes["b_new"][1], device)
    rows = {}
    for name, (extra, precision) in ways(device.type == "cuda").items():
        with forced(precision):
            system = stage("L4", model_dir, label=name, **(options | extra))
            rows[name] = agreement(system.run(prompts, max_new), refs) | {"kernel": system.engine.stats().kernel}
        print(f"{name:<34} {rows[name]['match']}/{len(prompts)} = HF batch 1; ties {rows[name]['ties']}; "
              f"mismatches {rows[name]['mismatches']} (HF gaps {rows[name]['hf_gaps']})", flush=True)  # fmt: skip
    if args.out:
        command = "python -m bench.agreement " + " ".join(argv if argv is not None else sys.argv[1:])
        results = {"command": command.strip(), **provenance(), "device": str(device),
                   "torch": torch.__version__, "rows": rows}  # fmt: skip
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
