"""L6's statistics, counted on the device: the numbers behind ``Engine.stats()``.

``DeviceStats`` is a pytree of counters that rides in the decode state (``DecodeState.stats``). Each
forward call, a prefill call or one round of the jit'd decode ``while_loop``, adds to it inside the
compiled code (``count_step``): one step, its real tokens, its live and held positions, and the peaks.
So every round is counted exactly, although the host never looks inside the loop. A reset zeroes the
counters with the rest of the state; before it, the host adds them to its running totals
(``Totals.plus``), which ``Engine.stats()`` reports as every stage's ``EngineStats``.

Left out on purpose: per-request numbers (time to first token, latency: the bench measures them on the
host), and counters nothing reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import jax
import jax.numpy as jnp

from kvcourse.stats import UsageMeter

from .page_table import PageBatchInfo


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class DeviceStats:
    """Counters since the last reset, all scalars on the device."""

    steps: jax.Array  # i32[]: forward calls (prefill calls and decode rounds)
    tokens_run: jax.Array  # i32[]: real tokens through the model (padding not counted)
    live_sum: jax.Array  # f32[]: live positions, summed over steps
    held_sum: jax.Array  # f32[]: held positions (pages held x page_size), summed over steps
    peak_live: jax.Array  # i32[]: most live positions at once
    peak_pages_in_use: jax.Array  # i32[]: most pages held at once (a shared page once)
    peak_pages_shared: jax.Array  # i32[]: most pages held by two or more slots at once

    @classmethod
    def init(cls) -> DeviceStats:
        count, total = jnp.zeros((), jnp.int32), jnp.zeros((), jnp.float32)
        return cls(
            steps=count,
            tokens_run=count,
            live_sum=total,
            held_sum=total,
            peak_live=count,
            peak_pages_in_use=count,
            peak_pages_shared=count,
        )


def kv_usage(state) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(live positions, pages held, pages shared) of a ``DecodeState`` right now, as i32[] scalars.

    Live: positions of used, unfinished slots whose K/V are in the pool, a shared page's rows once
    (a finished slot that still holds pages, as with cleanup "none", holds them for nothing). Held:
    pages with a refcount; shared: pages with a refcount above 1.

    Example, page_size 4: slot 0 holds 6 tokens on pages [3, 5], its clone slot 1 holds 5 on [3, 8]
    -> live = 4 (page 3, once) + 2 (page 5) + 1 (page 8) = 7; held 3 pages; shared 1 (page 3).
    """
    seqs, refs = state.sequences, state.page_table.page_ref_counts
    ps, n_pages = seqs.page_size, refs.shape[0]
    live_slot = seqs.used_mask & ~state.finished  # (S,)
    j = jnp.arange(seqs.pages_per_seq)
    rows = jnp.clip(seqs.seq_lens[:, None] - j[None, :] * ps, 0, ps)  # (S, pages_per_seq) filled rows
    page = jnp.where(live_slot[:, None] & (seqs.page_indices >= 0), seqs.page_indices, n_pages)
    filled = jnp.zeros(n_pages, jnp.int32).at[page].max(rows, mode="drop")  # (P,) each page once
    return jnp.sum(filled), jnp.sum(refs > 0), jnp.sum(refs > 1)


def record_peaks(state):
    """The state with its peak counters raised to what ``kv_usage`` finds now."""
    live, held, shared = kv_usage(state)
    s = state.stats
    return replace(
        state,
        stats=replace(
            s,
            peak_live=jnp.maximum(s.peak_live, live),
            peak_pages_in_use=jnp.maximum(s.peak_pages_in_use, held),
            peak_pages_shared=jnp.maximum(s.peak_pages_shared, shared),
        ),
    )


def count_step(state, info: PageBatchInfo):
    """Count one forward call: its real tokens, and live vs held positions once its pages are allocated.

    Call it between ``allocate_for_seq`` and ``update_tokens``: this step's new K/V count as live, and
    a slot that finishes on this step's token still counts (it ran). Example: a decode round over 3
    sequences holding 5 pages of 16 and 70 live positions adds 1 step, 3 tokens, 70 to ``live_sum``
    and 80 to ``held_sum``.
    """
    live, held, _ = kv_usage(state)
    s = state.stats
    counted = replace(
        s,
        steps=s.steps + 1,
        tokens_run=s.tokens_run + info.cu_q_lens[-1],  # padding tokens are in no sequence
        live_sum=s.live_sum + live.astype(jnp.float32),
        held_sum=s.held_sum + (held * state.sequences.page_size).astype(jnp.float32),
    )
    return record_peaks(replace(state, stats=counted))


@dataclass(frozen=True)
class Totals:
    """The host's totals of the device counters, up to the last reset."""

    meter: UsageMeter = field(default_factory=UsageMeter)  # live vs held positions, and peaks
    steps: int = 0
    tokens_run: int = 0

    def plus(self, now: DeviceStats) -> Totals:
        """These totals and a host copy of the counters since the last reset: since the engine was built.

        Example: totals of 6 steps, counters of 6 more -> 12 steps; the peaks are the larger of the two.
        """
        m = self.meter
        meter = UsageMeter(
            live_sum=m.live_sum + int(now.live_sum),  # whole numbers, exact in f32 below 2**24
            held_sum=m.held_sum + int(now.held_sum),
            live_peak=max(m.live_peak, int(now.peak_live)),
            blocks_held_peak=max(m.blocks_held_peak, int(now.peak_pages_in_use)),
            blocks_shared_peak=max(m.blocks_shared_peak, int(now.peak_pages_shared)),
        )
        return Totals(meter, self.steps + int(now.steps), self.tokens_run + int(now.tokens_run))
