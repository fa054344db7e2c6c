"""L6 engine: Levanter's paged KV design in JAX on one device, with cleanup wired in and reset made explicit.

    generate():  reset()           -> jit'd: logical (metadata only) or physical (also zeroes the pages)
                 loop on the host:
                   collect          -> read finished slots' tokens (host_state: a NumPy copy)
                   admit + prefill  -> waiting prompts that fit get slots; one jit'd call allocates
                                      their pages, runs the prompts (padded to a power of two),
                                      picks each first token, and clones n - 1 copies sharing full pages
                   decode           -> ONE jit'd lax.while_loop of up to max_rounds steps: pack the
                                      token queue, allocate_for_seq, forward (KV write + ragged paged
                                      attention), greedy pick, update_tokens, free what finished
                                      (cleanup="incremental"); as wide as the running sequences,
                                      rounded up to a power of two (one compile per width)

The weights, the state and the pages live on ``device``. ``scan_layers`` runs the model's layers as one
``lax.scan`` over stacked weights (one layer compiled, not thirty: ``kvcourse/jax_model.py``); by
default on a GPU or TPU, where compiling is the first run's main cost, and not on a CPU, where the
scan copies each layer's weights every forward (chapter, section 13). ``autotune_level``, on a GPU
only, is XLA's ``xla_gpu_autotune_level`` for this engine's programs (0: no GEMM autotuning; None:
XLA's default). ``cleanup`` says when a finished sequence's
pages go back: ``"incremental"`` in the decode loop, ``"end"`` after each host call, ``"none"`` at the
next ``generate`` (Levanter's behaviour as its February 2026 notes describe it). The host admits a
prompt only if the pool can hold it to its full max_new_tokens beside what running sequences may still grow
into; the device still checks every allocation, and a shortage raises ``OutOfPagesError``, never a
wrong answer. ``stats()`` is counted on the device (``device_stats.py``).

Left out on purpose: sampling (greedy), preemption (L3), a prefix cache (L5), streaming, and more
than one device (``mesh/engine.py`` is this engine over a device mesh, and across hosts).
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np

from kvcourse.devices import describe_jax_device, jax_device, jax_kv_bytes_for_fraction
from kvcourse.jax_model import forward, load_params, stack_layers
from kvcourse.limits import (
    blocks_for_bytes,
    bytes_note,
    check_requests,
    describe_sizing,
    resolve_max_model_len,
)
from kvcourse.model_store import resolve_model_dir
from kvcourse.stats import EngineStats

from . import decode_state as ds
from .attention import paged_attend, reference_decode_kernel, reference_kernel
from .device_stats import Totals, count_step, record_peaks
from .kv_cache import init_kv_pages
from .page_table import INVALID, allocate_for_seq, cdiv, pages_for
from .pallas_attention import interpret_mode, pallas_kernel

CLEANUPS = ("incremental", "end", "none")
RESETS = ("logical", "physical")
ATTENTIONS = ("reference", "pallas")  # pallas: TPU interpret mode off-TPU (slow; tests and smoke only)


class OutOfPagesError(RuntimeError):
    """The device could not allocate the pages a step needed."""


def bucket(n: int, smallest: int = 16) -> int:
    """The padded length a batch of n tokens compiles for: the next power of two, at least ``smallest``.

    Examples: ``bucket(5) -> 16``, ``bucket(17) -> 32``, ``bucket(64) -> 64``.
    """
    return max(smallest, 1 << (n - 1).bit_length())


class Engine:
    def __init__(
        self,
        model_dir=None,
        device: str = "cpu",
        page_size: int = 16,
        num_pages: int | None = None,
        kv_cache_bytes: int | None = None,
        gpu_memory_utilization: float | None = None,
        max_num_seqs: int = 16,
        max_rounds: int = 32,
        max_model_len: int | None = None,
        max_prefill_tokens: int = 1024,
        cleanup: str = "incremental",
        reset: str = "logical",
        attention: str = "reference",
        q_block: int = 16,
        kv_pages_per_block: int = 16,
        decode_kv_pages_per_block: int = 4,
        scan_layers: bool | None = None,
        autotune_level: int | None = None,
    ):
        for name, value, choices in (
            ("cleanup", cleanup, CLEANUPS),
            ("reset", reset, RESETS),
            ("attention", attention, ATTENTIONS),
        ):
            if value not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {value!r}")
        sizes = {"page_size": page_size, "max_num_seqs": max_num_seqs, "max_rounds": max_rounds}
        for name, value in sizes.items():
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.device = jax_device(device)
        self.platform = self.device.platform  # "cpu", "gpu" or "tpu"
        self.model_dir = resolve_model_dir(model_dir)
        with jax.default_device(self.device):  # made where they will live, not on JAX's default device
            self.cfg, params = load_params(self.model_dir)
            self.scan_layers = self.platform != "cpu" if scan_layers is None else scan_layers
            if self.scan_layers:
                params = stack_layers(params)  # each weight (L, ...)
        cfg = self.cfg
        self.max_model_len = resolve_max_model_len(max_model_len, cfg)
        self.page_size, self.max_num_seqs, self.max_rounds = page_size, max_num_seqs, max_rounds
        self.pages_per_seq = cdiv(self.max_model_len, page_size)
        if gpu_memory_utilization is not None:  # vLLM's way, from JAX's allocator (kvcourse/devices.py)
            kv_cache_bytes = jax_kv_bytes_for_fraction(self.device, gpu_memory_utilization)
        self.kv_cache_bytes = kv_cache_bytes
        if kv_cache_bytes is not None:  # bytes: sized into pages once, never grown
            num_pages = blocks_for_bytes(kv_cache_bytes, page_size, cfg, num_pages)
        self.num_pages = self.pages_per_seq if num_pages is None else num_pages
        if self.num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {self.num_pages}")
        self.max_prefill_tokens = max_prefill_tokens
        self.cleanup, self.reset_mode = cleanup, reset
        # Prefill rounds bring many queries per sequence; decode rounds exactly one, so the reference
        # batches its sequences (and the Pallas kernel uses one-row query blocks, not 15 rows of
        # padding). Decode has its own KV block size: on this CPU small blocks win there (chapter, §7).
        self.attention = attention
        if attention == "pallas":  # compiled by Mosaic on a TPU, interpreted on a CPU, refused on a GPU
            interpret = interpret_mode(self.platform)
            self.kernel = pallas_kernel(q_block, kv_pages_per_block, interpret)
            self.decode_kernel = pallas_kernel(1, decode_kv_pages_per_block, interpret)
        else:
            self.kernel = reference_kernel(q_block, kv_pages_per_block)
            self.decode_kernel = reference_decode_kernel(decode_kv_pages_per_block)
        stop = list(cfg.eos_token_ids) or [INVALID]
        with jax.default_device(self.device):
            state = ds.DecodeState.init(
                max_num_seqs, self.pages_per_seq, self.num_pages, page_size, self.max_model_len, stop
            )
            kv_pages = init_kv_pages(
                cfg.num_layers, self.num_pages, page_size, cfg.num_kv_heads, cfg.head_dim, self.scan_layers
            )
        # Committed to the device: every jit'd call runs there, and copies its NumPy inputs there.
        self.params, self.state, self.kv_pages = jax.device_put((params, state, kv_pages), self.device)
        self.traces: Counter[str] = Counter()  # how often each jit'd function was traced (= compiled)
        # Donated pools (argument 2): XLA writes the new pools into the old buffers, so a call holds one
        # pool, not two; the old arrays are deleted, hence self.kv_pages = the call's output at once.
        gpu_options = {"xla_gpu_autotune_level": autotune_level} if autotune_level is not None else None
        options = gpu_options if self.platform == "gpu" else None  # a GPU flag: other backends ignore it
        self._prefill = jax.jit(self._prefill_fn, donate_argnums=(2,), compiler_options=options)
        self._decode = jax.jit(
            self._decode_fn, donate_argnums=(2,), static_argnums=(3,), compiler_options=options
        )
        self._free = jax.jit(ds.free_finished)
        self._reset_logical = jax.jit(ds.reset_logical)
        self._zero = jax.jit(lambda pools: jax.tree.map(jnp.zeros_like, pools))
        self.totals = Totals()  # the device counters up to the last reset (device_stats.py)
        self.num_clones = 0  # requests split into their n sequences

    # ---- device functions (traced once per shape) ----

    def _step(self, params, state, kv_pages, tokens, slot_ids, pos_ids, kernel):
        """Allocate pages for a flat batch (T,), run the model, pick each sequence's next token, update."""
        seqs, pages, info = allocate_for_seq(state.sequences, state.page_table, slot_ids, pos_ids)
        state = count_step(replace(state, sequences=seqs, page_table=pages), info)
        n_out = min(tokens.shape[0], self.max_num_seqs)  # a batch holds at most that many sequences
        logits_at = jnp.maximum(info.cu_q_lens[1 : n_out + 1] - 1, 0)  # (n_out,) each sequence's last row
        logits, kv_pages = forward(
            self.cfg,
            params,
            jnp.maximum(tokens, 0),
            jnp.maximum(pos_ids, 0),
            paged_attend(info, kernel),
            kv_pages,
            logits_at,
        )  # (n_out, vocab)
        picked = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # (n_out,) greedy, in batch order
        sampled = jnp.pad(picked, (0, self.max_num_seqs - n_out))  # (S,) padding rows are ignored
        return ds.update_tokens(state, info, sampled), kv_pages, info

    def _prefill_fn(self, params, state, kv_pages, work):
        self.traces["prefill"] += 1
        state = ds.admit(state, work["new"], work["max_new"], work["ignore_eos"])
        new, kv_pages, info = self._step(
            params, state, kv_pages, work["tokens"], work["slots"], work["pos"], self.kernel
        )
        state = ds.record_shortage(ds.keep_if(~info.out_of_pages, new, state), info)

        def clone_one(i, carry):
            return ds.clone_sequence(*carry, work["parents"][i], work["children"][i])

        state, kv_pages = jax.lax.fori_loop(0, self.max_num_seqs, clone_one, (state, kv_pages))
        state = record_peaks(state)  # the clones' pages, before anything frees them
        if self.cleanup == "incremental":
            state = ds.free_finished(state)  # a sequence can end on its prefill token (eos, max_new_tokens 1)
        return state, kv_pages

    def _decode_fn(self, params, state, kv_pages, width):
        self.traces["decode"] += 1

        def go_on(carry):
            state, _, i = carry
            return (i < self.max_rounds) & (state.tqueue.num_queued > 0) & (state.pages_needed == 0)

        def one_round(carry):
            state, kv_pages, i = carry
            queue, tokens, slots, pos = ds.pack_next(state.tqueue, width)  # (width,) each
            new, kv_pages, info = self._step(
                params, replace(state, tqueue=queue), kv_pages, tokens, slots, pos, self.decode_kernel
            )
            if self.cleanup == "incremental":
                new = ds.free_finished(new)  # pages return the step a sequence finishes
            state = ds.record_shortage(ds.keep_if(~info.out_of_pages, new, state), info)
            return state, kv_pages, i + 1

        state, kv_pages, _ = jax.lax.while_loop(go_on, one_round, (state, kv_pages, jnp.int32(0)))
        return state, kv_pages

    # ---- host side ----

    def reset(self) -> None:
        """Back to the baseline state. Always runs (never skipped); physical also zeroes the KV pages.

        The device counters go back to zero too, after their values are added to the engine's totals.
        """
        self.totals = self.totals.plus(jax.device_get(self.state.stats))
        self.state = self._reset_logical(self.state)
        if self.reset_mode == "physical":
            self.kv_pages = self._zero(self.kv_pages)

    def host_state(self) -> ds.DecodeState:
        """A NumPy copy of the device state."""
        return jax.device_get(self.state)

    def stats(self) -> EngineStats:
        """KV pool vs live, pages held and shared, steps, tokens, clones and compiles, since the
        engine was built, counted on the device (``device_stats.py``)."""
        totals = self.totals.plus(jax.device_get(self.state.stats))
        meter = totals.meter
        return EngineStats(
            kv_bytes_pool=sum(pool.nbytes for pool in self.kv_pages),
            kv_bytes_live=meter.live_peak * self.cfg.kv_bytes_per_token(),
            kv_utilization=meter.utilization,
            block_size=self.page_size,
            num_blocks=self.num_pages,
            blocks_held=meter.blocks_held_peak,
            blocks_shared=meter.blocks_shared_peak,
            steps=totals.steps,
            tokens_run=totals.tokens_run,
            clones=self.num_clones,
            compiles=dict(self.traces),
            device=f"{self.platform}:{self.device.id}",
            kernel=self.attention,
            max_num_seqs=self.max_num_seqs,
            kv_sizing=self.sizing_line(),
        )

    def sizing_line(self) -> str:
        """How kv_cache_bytes were sized into pages, or "" for a pool sized in pages."""
        if self.kv_cache_bytes is None:
            return ""
        return describe_sizing(self.kv_cache_bytes, self.page_size, self.cfg)

    def describe(self) -> str:
        """Where and how this engine runs, in one line.

        Example: ``L6 on cpu:0 (cpu), JAX 0.10.2: reference attention, 30 layers`` (``, scanned`` when
        ``scan_layers``).
        """
        kernel = "reference attention"
        if self.attention == "pallas":
            kernel = "Pallas TPU kernel" + (", TPU interpret mode" if self.platform != "tpu" else "")
        where = describe_jax_device(self.device)
        layers = f"{self.cfg.num_layers} layers" + (", scanned" if self.scan_layers else "")
        return f"L6 on {where}, JAX {jax.__version__}: {kernel}, {layers}"

    def occupancy(self) -> dict[str, int]:
        """Active slots, pages in use, free pages and the largest refcount right now."""
        return ds.occupancy(self.host_state())

    def check_invariants(self, *, after_reset: bool = False) -> None:
        ds.check_invariants(self.host_state(), after_reset=after_reset)

    def check_fits(self, prompt: list[int], max_new_tokens: int, label: str = "request", n: int = 1) -> int:
        """Refuse a request that could never run (bad ids, longer than max_model_len, more clones than
        slots, more pages than the pool). Returns its max_new_tokens."""
        [max_new] = check_requests([prompt], max_new_tokens, self.cfg.vocab_size, self.max_model_len)
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"{label}: n must be an integer >= 1, got {n!r}")
        if n > self.max_num_seqs:
            raise ValueError(f"{label}: n={n} sequences exceed max_num_seqs={self.max_num_seqs}")
        need = pages_for(len(prompt), max_new, n, self.page_size)
        if need > self.num_pages:
            raise ValueError(
                f"{label}: needs {need} pages of {self.page_size} tokens, but the pool has only {self.num_pages}"
                + self.bytes_note(need)
            )
        return max_new

    def bytes_note(self, pages: int) -> str:
        """The bytes ``pages`` pages take and kv_cache_bytes give, for a refusal ("" for a pool sized in pages)."""
        return bytes_note(pages, self.page_size * self.cfg.kv_bytes_per_token(), self.kv_cache_bytes)

    def raise_if_short(self, host: ds.DecodeState) -> None:
        """Raise OutOfPagesError if the device recorded a failed allocation."""
        if int(host.pages_needed) > 0:
            raise OutOfPagesError(
                f"out of KV pages: a step needed {int(host.pages_needed)} new pages but only "
                f"{int(host.pages_free)} of {self.num_pages} were free"
            )

    def generate(
        self, prompts: list[list[int]], max_new_tokens: int | list[int], *, ignore_eos: bool = False
    ) -> list[list[int]]:
        """Greedy new tokens of every prompt, in input order (eos included, then stop, as HF)."""
        return [s[0] for s in self.generate_samples(prompts, max_new_tokens, ignore_eos=ignore_eos)]

    def generate_samples(
        self,
        prompts: list[list[int]],
        max_new_tokens: int | list[int],
        *,
        n: int = 1,
        ignore_eos: bool = False,
    ) -> list[list[list[int]]]:
        """``n`` sequences per prompt, prefilled once and cloned: result[i][j] is clone j of prompt i.

        Greedy, so the clones agree; what differs is memory: they share the prompt's full pages.
        """
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an integer >= 1, got {n!r}")
        max_new_tokens = check_requests(prompts, max_new_tokens, self.cfg.vocab_size, self.max_model_len)
        for i, (prompt, max_new) in enumerate(zip(prompts, max_new_tokens, strict=True)):
            self.check_fits(prompt, max_new, f"prompt {i}", n)
        self.reset()
        waiting = deque(range(len(prompts)))
        running: dict[int, list[int]] = {}  # prompt index -> its slots (parent first)
        results: list[list[list[int]] | None] = [None] * len(prompts)
        while True:
            host = self.host_state()
            self.raise_if_short(host)
            for i, slots in list(running.items()):
                if all(host.finished[s] for s in slots):
                    results[i] = [host.tokens[s, : host.num_generated[s]].tolist() for s in slots]
                    del running[i]
            if self.cleanup == "end" and (host.finished & host.sequences.used_mask).any():
                self.state = self._free(self.state)
                host = self.host_state()
            if not waiting and not running:
                return results
            work = self._admit(host, waiting, running, prompts, max_new_tokens, n, ignore_eos)
            if work is not None:
                # Prefill, then collect again before admitting more (a prompt can finish on its prefill
                # token and free its slot): everything that fits is admitted before the next decode.
                self.state, self.kv_pages = self._prefill(self.params, self.state, self.kv_pages, work)
                continue
            if not running:
                free = ds.occupancy(host)["free_pages"]
                kept = " (finished sequences keep their pages until the next generate())"
                why = f"cleanup={self.cleanup!r}" + (kept if self.cleanup == "none" else "")
                raise RuntimeError(f"prompt {waiting[0]} cannot be admitted: {free} pages free with {why}")
            width = self.decode_width(host)
            if width:
                self.state, self.kv_pages = self._decode(self.params, self.state, self.kv_pages, width)

    def decode_width(self, host: ds.DecodeState) -> int:
        """The decode batch's width: the tokens queued (one per running sequence), rounded up to a
        power of two; 0 when nothing is queued. Example: 3 sequences running -> 4."""
        queued = int(host.tqueue.num_queued)
        return min(self.max_num_seqs, bucket(queued, smallest=1)) if queued else 0

    def _admit(self, host, waiting, running, prompts, max_new_tokens, n, ignore_eos):
        """Give waiting prompts (in order) free slots while the pool can hold them to their max_new_tokens.

        Returns the prefill work, the tokens padded to a power-of-two bucket; or None.
        """
        ps, seqs = self.page_size, host.sequences
        free_slots = [s for s in range(self.max_num_seqs) if not seqs.used_mask[s]]
        held = (seqs.page_indices >= 0).sum(axis=1)  # (S,)
        spare = int((host.page_table.page_ref_counts == 0).sum())  # pages the pool can still promise
        for slots in running.values():
            for s in slots:
                if not host.finished[s]:  # pages a running sequence may still take
                    left = int(host.max_new_tokens[s] - host.num_generated[s])
                    spare -= cdiv(int(seqs.seq_lens[s]) + left, ps) - int(held[s])
        tokens, slot_ids, pos, pairs = [], [], [], []
        new = np.zeros(self.max_num_seqs, bool)
        seq_max_new = np.zeros(self.max_num_seqs, np.int32)
        while waiting:
            i = waiting[0]
            need = pages_for(len(prompts[i]), max_new_tokens[i], n, ps)
            room = not tokens or len(tokens) + len(prompts[i]) <= self.max_prefill_tokens  # in this call
            if len(free_slots) < n or need > spare or not room:
                break
            waiting.popleft()
            mine = [free_slots.pop(0) for _ in range(n)]
            running[i] = mine
            spare -= need
            tokens += prompts[i]
            slot_ids += [mine[0]] * len(prompts[i])
            pos += range(len(prompts[i]))
            new[mine[0]], seq_max_new[mine[0]] = True, max_new_tokens[i]
            pairs += [(mine[0], child) for child in mine[1:]]
            self.num_clones += n > 1  # one request split into its n sequences
        if not tokens:
            return None
        pad = bucket(len(tokens)) - len(tokens)
        pairs += [(0, INVALID)] * (self.max_num_seqs - len(pairs))
        return {
            "tokens": np.asarray(tokens + [0] * pad, np.int32),  # (T,)
            "slots": np.asarray(slot_ids + [INVALID] * pad, np.int32),  # (T,)
            "pos": np.asarray(pos + [0] * pad, np.int32),  # (T,)
            "new": new,  # (S,)
            "max_new": seq_max_new,  # (S,)
            "ignore_eos": np.full(self.max_num_seqs, ignore_eos),  # (S,)
            "parents": np.asarray([p for p, _ in pairs], np.int32),  # (S,)
            "children": np.asarray([c for _, c in pairs], np.int32),  # (S,)
        }
