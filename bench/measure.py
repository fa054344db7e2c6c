"""The benchmark's measurements: each runs one system on one workload and returns plain numbers.

Times come from ``time.perf_counter`` around whole calls; memory from each engine's ``stats()``. Nothing
here knows a stage by name: pools are sized from an engine's constructor signature.
"""

from __future__ import annotations

import functools
import inspect
import platform
import time
from pathlib import Path

from bench import ceilings
from bench.systems import System
from bench.workloads import mixed_workload


def timed(system: System, prompts, budgets) -> dict:
    t0 = time.perf_counter()
    outs = system.run(prompts, budgets)
    seconds = time.perf_counter() - t0
    useful = sum(budgets)
    assert [len(o) for o in outs] == budgets, f"{system.name} did not produce fixed-length outputs"
    return {"seconds": seconds, "new_tokens": useful, "tok_s": useful / seconds}


def timed_samples(system: System, prompt, budget: int, n: int) -> dict:
    t0 = time.perf_counter()
    outs = system.run_samples(prompt, budget, n)
    seconds = time.perf_counter() - t0
    assert [len(o) for o in outs] == [budget] * n, f"{system.name} did not produce {n} x {budget} tokens"
    return {"seconds": seconds, "new_tokens": n * budget, "tok_s": n * budget / seconds}


def kv_stats(engine, run) -> dict:
    """Run a workload on a fresh engine and keep what its ``stats()`` says about the KV memory.

    Every engine reports the same ``EngineStats``: utilization (live / held positions, summed over
    its steps), the most blocks held and shared at once, preemptions. L1 has no blocks (0).
    """
    run(engine)
    s = engine.stats()
    return {
        "utilization": s.kv_utilization,
        "preemptions": s.preemptions,
        "block_size": s.block_size,
        "blocks_held": s.blocks_held,
        "blocks_shared": s.blocks_shared,
        "steps": s.steps,
    }


def block_size_sweep(cfg, sizes: dict) -> dict:
    """(e) L6's reference attention alone, jit'd, for a decode batch and a prefill, per block size.

    ``q_block`` x ``kv_pages_per_block`` only changes how much work each loop step does (and the
    summation order), never which keys a query sees. Milliseconds per call, median of 5.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    from L6_tpu_jax.attention import decode_only_paged_attention, ragged_paged_attention

    rng = np.random.default_rng(0)
    n_heads, n_kv, d, ps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 16
    n_seq, ctx, prefill = sizes["e_decode_seqs"], sizes["e_context"], sizes["e_prefill"]
    per_seq = -(-max(ctx, prefill) // ps)
    n_pages = n_seq * per_seq
    pool = jnp.asarray(rng.standard_normal((n_pages, ps, 2 * n_kv, d), np.float32))
    pages = jnp.asarray(rng.permutation(n_pages).reshape(n_seq, per_seq).astype(np.int32))
    batches = {
        "decode": (n_seq, jnp.full(n_seq, ctx, jnp.int32), jnp.arange(n_seq + 1, dtype=jnp.int32)),
        "prefill": (prefill, jnp.full(n_seq, prefill, jnp.int32).at[1:].set(0),
                    jnp.full(n_seq + 1, prefill, jnp.int32).at[0].set(0)),
    }  # fmt: skip

    def ms(kernel, args) -> float:
        f = jax.jit(kernel)
        return 1000 * ceilings.median_seconds(lambda: f(*args).block_until_ready(), 5)

    rows = {}
    for work, (n_tok, kv_lens, cu) in batches.items():
        q = jnp.asarray(rng.standard_normal((n_tok, n_heads, d), np.float32))
        args = (q, pool, kv_lens, pages, cu, jnp.int32(n_seq if work == "decode" else 1))
        for qb, kb in sizes["e_blocks"]:
            rows[f"{work} ragged q{qb} x kv{kb}"] = ms(
                functools.partial(ragged_paged_attention, q_block=qb, kv_pages_per_block=kb), args
            )
            if work == "decode" and qb == 1:
                rows[f"decode batched kv{kb}"] = ms(
                    functools.partial(decode_only_paged_attention, kv_pages_per_block=kb), args
                )
    return rows


def reset_times(model_dir, options: dict) -> dict:
    """(e) Milliseconds of L6's logical reset (metadata only) and physical reset (also zeroes every page)."""
    from L6_tpu_jax.engine import Engine

    out = {}
    for mode in ("logical", "physical"):
        engine = Engine(model_dir, reset=mode, **options)
        engine.reset()  # compile
        out[mode] = 1000 * ceilings.median_seconds(engine.reset, 5)
        out["pool_MiB"] = sum(pool.nbytes for pool in engine.kv_pages) / 2**20
    return out


def decode_latency(system: System, vocab: int, context: int, steps: int) -> float:
    """Seconds per decode step at ``context``: (time for 1 + steps tokens - time for 1) / steps.

    Both runs prefill the same prompt, so the difference is the decode steps alone.
    """
    prompt = mixed_workload(vocab, 1, (context, context), (1, 1), seed=context)[0]
    short = ceilings.median_seconds(lambda: system.run(prompt, [1]), 2)
    long = ceilings.median_seconds(lambda: system.run(prompt, [1 + steps]), 2)
    return max(long - short, 0.0) / steps


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what ``platform`` knows."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.processor() or platform.machine()


def stage_options(engine_cls, sizes: dict, max_len: int) -> dict:
    """Pool and batch sizes large enough that (b), (c) and (d) run without preemption in every stage,
    and no larger (every block is allocated up front: 3.8 GB per engine if sized for 40 x 2048 tokens).

    Read from the constructor's signature, so no stage is named here: L2-L5 take ``num_blocks`` and
    L3-L5 ``max_num_seqs``; L6 uses Levanter's names, ``num_pages`` and ``max_seqs``.
    """
    params = inspect.signature(engine_cls).parameters
    size = params["block_size"].default if "block_size" in params else 16
    size = params["page_size"].default if "page_size" in params else size
    blocks = max(
        sizes["b_requests"] * -(-(sizes["b_prompt"][1] + sizes["b_new"][1]) // size),  # (b), all at once
        sizes["c_n"] * -(-(sizes["c_prompt"] + sizes["c_new"]) // size),  # (c) without sharing
        -(-max_len // size),  # (d), one long sequence
    )
    options = {"max_model_len": max_len}
    options |= {name: blocks for name in ("num_blocks", "num_pages") if name in params}
    options |= {name: sizes["b_requests"] for name in ("max_num_seqs", "max_seqs") if name in params}
    return options
