"""L6 over a device mesh: ``../engine.py``'s engine, every device holding a share of the slots and pages.

``MeshEngine`` is ``Engine`` changed for a mesh with one axis named ``data`` (``multihost.data_mesh``),
in one process or in several (``../l6_multihost.py``): ``lessons/diffs/L6_mesh.diff`` is what changes.
``mesh`` takes the place of ``device``; without one, the mesh is every device of every process.

- Every device holds an equal share of the slots and of every layer's KV pages (``SPECS["kv_pages"]``),
  plus a whole copy of the params and of the ``DecodeState`` (``SPECS``; ``specs=`` overrides them, for
  exercise L6.4). A slot only ever gets pages of its own device (``tables.py``).
- Each jit'd call is one ``shard_map`` program: every device computes the same page allocation for
  the whole batch (the tables are small), then runs the model only on its own block of the batch
  against its own pages, and the devices exchange just the tokens they picked (one ``psum`` of
  ``max_num_seqs`` int32 per forward call), so every copy of the state takes the same update.
- The host gives each prompt, with its clones, to one device (``_admit``), lays out each batch in one
  block per device, and reads its own copy of the state (``multihost.local_copy``).
- With ``guard=True`` every host checks, before each jit call, that all hosts are about to make the
  same call (``multihost.check_same_call``).

The multi-host rules hold by construction: every host makes the same jit calls in the same order with
the same shapes, host-only code reads local copies, and reset is never skipped.

Left out on purpose: sharding heads over a ``model`` axis, ``Engine``'s ``scan_layers`` and
``autotune_level`` (the layers stay a loop here, and the pools a tuple sharded by pages), and what
``../engine.py`` leaves out.
"""

from __future__ import annotations

import zlib
from collections import Counter, deque
from dataclasses import replace
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kvcourse.devices import jax_kv_bytes_for_fraction
from kvcourse.jax_model import forward, load_params
from kvcourse.limits import (
    blocks_for_bytes,
    bytes_note,
    check_requests,
    describe_sizing,
    resolve_max_model_len,
)
from kvcourse.model_store import resolve_model_dir
from kvcourse.stats import EngineStats

from .. import decode_state as ds
from ..attention import paged_attend, reference_decode_kernel, reference_kernel
from ..device_stats import Totals, count_step, record_peaks
from ..engine import ATTENTIONS, CLEANUPS, RESETS, OutOfPagesError, bucket
from ..kv_cache import copy_page, init_kv_pages
from ..page_table import INVALID, cdiv, pages_for
from ..pallas_attention import interpret_mode, pallas_kernel
from .multihost import DATA, check_same_call, data_mesh, local_copy
from .tables import (
    allocate_on_shards,
    clone_pages_on_shard,
    pack_on_shards,
    shard_batch_info,
    shard_block,
)

REPLICATED = P()  # a whole copy on every device
# How each input of a jit'd call is laid out over the mesh (``specs=`` overrides them, for the notebook).
SPECS = {
    "params": REPLICATED,  # every device runs the whole model on its own sequences
    "decode_state": REPLICATED,  # the tables: small, and every device needs every slot's row
    "kv_pages": P(DATA),  # each layer's pool (P, page_size, 2 * H_kv, D): pages split over devices
}


class MeshEngine:
    def __init__(
        self,
        model_dir=None,
        mesh: Mesh | None = None,
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
        guard: bool = False,
        specs: dict[str, P] | None = None,
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
        self.mesh = data_mesh() if mesh is None else mesh
        if self.mesh.axis_names != (DATA,):
            raise ValueError(f"mesh must have one axis, {DATA!r}, got axes {self.mesh.axis_names}")
        self.platform = self.mesh.devices.flat[0].platform  # "cpu", "gpu" or "tpu"
        self.num_shards = shards = self.mesh.shape[DATA]
        self.model_dir = resolve_model_dir(model_dir)
        here = [d for d in self.mesh.devices.flat if d.process_index == jax.process_index()][0]
        with jax.default_device(here):  # made where they will live, not on JAX's default device
            self.cfg, params = load_params(self.model_dir)
        cfg = self.cfg
        self.max_model_len = resolve_max_model_len(max_model_len, cfg)
        self.page_size, self.max_num_seqs, self.max_rounds = page_size, max_num_seqs, max_rounds
        self.pages_per_seq = cdiv(self.max_model_len, page_size)
        if gpu_memory_utilization is not None:  # vLLM's way, from JAX's allocator; the share of every device
            kv_cache_bytes = jax_kv_bytes_for_fraction(here, gpu_memory_utilization) * shards
        self.kv_cache_bytes = kv_cache_bytes
        if kv_cache_bytes is not None:  # bytes for the whole mesh: sized into pages once, never grown
            num_pages = blocks_for_bytes(kv_cache_bytes, page_size, cfg, num_pages) // shards * shards
        self.num_pages = self.pages_per_seq * shards if num_pages is None else num_pages
        if self.num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {self.num_pages}")
        for name, value in (("max_num_seqs", max_num_seqs), ("num_pages", self.num_pages)):
            if value % shards:
                raise ValueError(f"{name}={value} must be a multiple of the mesh's {shards} {DATA!r} devices")
        self.seqs_per_shard, self.pages_per_shard = max_num_seqs // shards, self.num_pages // shards
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
        self.specs = spec = {**SPECS, **(specs or {})}
        self.params = jax.device_put(params, NamedSharding(self.mesh, spec["params"]))
        with jax.default_device(here):
            state = ds.DecodeState.init(
                max_num_seqs, self.pages_per_seq, self.num_pages, page_size, self.max_model_len, stop
            )
        self.state = jax.device_put(state, NamedSharding(self.mesh, spec["decode_state"]))
        self.kv_pages = jax.jit(
            partial(init_kv_pages, cfg.num_layers, self.num_pages, page_size, cfg.num_kv_heads, cfg.head_dim),
            out_shardings=NamedSharding(self.mesh, spec["kv_pages"]),
        )()  # each device allocates only its own pages
        self.traces: Counter[str] = Counter()  # how often each jit'd function was traced (= compiled)
        self.guard, self.num_calls = guard, 0  # jit calls made, the guard's running index
        per_device = partial(
            jax.shard_map,
            mesh=self.mesh,
            out_specs=(spec["decode_state"], spec["kv_pages"]),
            # The state comes out REPLICATED because every device computes the same update from the
            # same inputs and the psum'd picks. check_vma would prove that by typing every value
            # (varying per device or not); its proof would need casts inside the attention loops.
            check_vma=False,
        )
        # Donated pools (argument 2): XLA writes the new pools into the old buffers, so a call holds one
        # pool, not two; the old arrays are deleted, hence self.kv_pages = the call's output at once.
        self._prefill = jax.jit(
            per_device(
                self._prefill_fn,
                in_specs=(spec["params"], spec["decode_state"], spec["kv_pages"], REPLICATED),
            ),
            donate_argnums=(2,),
        )
        self._decode = jax.jit(
            lambda params, state, kv_pages, width: per_device(
                partial(self._decode_fn, width=width),
                in_specs=(spec["params"], spec["decode_state"], spec["kv_pages"]),
            )(params, state, kv_pages),
            donate_argnums=(2,),
            static_argnums=(3,),
        )
        self._free = jax.jit(ds.free_finished)
        self._reset_logical = jax.jit(ds.reset_logical)
        self._zero = jax.jit(lambda pools: jax.tree.map(jnp.zeros_like, pools))
        self.totals = Totals()  # the device counters up to the last reset (device_stats.py)
        self.num_clones = 0  # requests split into their n sequences

    # ---- device functions (traced once per shape) ----

    def _step(self, params, state, kv_pages, tokens, slot_ids, pos_ids, kernel):
        """Allocate pages for a flat batch, run the model, pick each sequence's next token, update.

        Runs on every device (inside ``shard_map``): ``kv_pages`` is this device's slice of the
        pool, everything else is a whole copy. The batch (T,) is one block per device.
        """
        n = self.num_shards
        seqs, pages, info = allocate_on_shards(state.sequences, state.page_table, slot_ids, pos_ids, n)
        state = count_step(replace(state, sequences=seqs, page_table=pages), info)  # whole batch, alike
        shard = jax.lax.axis_index(DATA)
        mine = shard_batch_info(seqs, pages, info, slot_ids, pos_ids, shard, n)  # my block, my page ids
        my_tokens = shard_block(tokens, shard, n)  # (T / devices,)
        my_pos = shard_block(pos_ids, shard, n)
        n_out = min(my_tokens.shape[0], self.seqs_per_shard)  # a block holds at most that many sequences
        logits_at = jnp.maximum(mine.cu_q_lens[1 : n_out + 1] - 1, 0)  # (n_out,) each sequence's last row
        logits, kv_pages = forward(
            self.cfg,
            params,
            jnp.maximum(my_tokens, 0),
            jnp.maximum(my_pos, 0),
            paged_attend(mine, kernel),
            kv_pages,
            logits_at,
        )  # (n_out, vocab)
        picked = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # (n_out,) greedy, my sequences
        my_slots = jnp.where(mine.slot_ids[:n_out] >= 0, mine.slot_ids[:n_out], self.max_num_seqs)  # (n_out,)
        by_slot = jnp.zeros(self.max_num_seqs, jnp.int32).at[my_slots].set(picked, mode="drop")  # (S,) mine
        by_slot = jax.lax.psum(by_slot, DATA)  # (S,) every device's picks
        sampled = by_slot[jnp.maximum(info.slot_ids, 0)]  # (S,) in batch order; padding rows ignored
        return ds.update_tokens(state, info, sampled), kv_pages, info

    def _prefill_fn(self, params, state, kv_pages, work):
        self.traces["prefill"] += 1
        state = ds.admit(state, work["new"], work["max_new"], work["ignore_eos"])
        new, kv_pages, info = self._step(
            params, state, kv_pages, work["tokens"], work["slots"], work["pos"], self.kernel
        )
        state = ds.record_shortage(ds.keep_if(~info.out_of_pages, new, state), info)
        first_page = jax.lax.axis_index(DATA) * self.pages_per_shard  # my slice of the pool starts here

        def on_this_device(page):  # a page id in my slice of the pool; INVALID where another device holds it
            here = (page >= first_page) & (page < first_page + self.pages_per_shard)
            return jnp.where(here, page - first_page, INVALID)

        def clone_one(i, carry):
            state, kv_pages = carry
            parent, child = work["parents"][i], work["children"][i]
            seqs, pages, src, dst, ok = clone_pages_on_shard(
                state.sequences, state.page_table, parent, child, self.num_shards
            )
            kv_pages = copy_page(kv_pages, on_this_device(src), on_this_device(dst))  # only where it lives
            return ds.start_clone(state, seqs, pages, parent, child, ok), kv_pages

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
            queue, tokens, slots, pos = pack_on_shards(state.tqueue, width, self.num_shards)  # (width,) each
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

    def _call(self, name: str, fn, *args, shapes: str = ""):
        """Make jit call ``fn(*args)``; with the guard on, first check every host makes the same one."""
        if self.guard:
            check_same_call(self.num_calls, f"{name}({shapes})")
        self.num_calls += 1
        return fn(*args)

    def reset(self) -> None:
        """Back to the baseline state. Always runs (never skipped, on any host); physical also zeroes KV.

        The device counters go back to zero too, after their values are added to the engine's totals.
        """
        self.totals = self.totals.plus(local_copy(self.state.stats))
        self.state = self._call("reset_logical", self._reset_logical, self.state)
        if self.reset_mode == "physical":
            self.kv_pages = self._call("zero_kv_pages", self._zero, self.kv_pages)

    def host_state(self) -> ds.DecodeState:
        """A NumPy copy of the device state, read from this host's own copy (no collective)."""
        return local_copy(self.state)

    def stats(self) -> EngineStats:
        """KV pool vs live, pages held and shared, steps, tokens, clones and compiles, since the
        engine was built, counted on the device (``device_stats.py``)."""
        totals = self.totals.plus(local_copy(self.state.stats))
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
            device=f"{self.num_shards} {self.platform} devices",
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

        Example: ``L6 on 4 cpu devices (a 'data' mesh), JAX 0.10.2: reference attention, 30 layers``.
        """
        kernel = "reference attention"
        if self.attention == "pallas":
            kernel = "Pallas TPU kernel" + (", TPU interpret mode" if self.platform != "tpu" else "")
        where = f"{self.num_shards} {self.platform} devices (a {DATA!r} mesh)"
        return f"L6 on {where}, JAX {jax.__version__}: {kernel}, {self.cfg.num_layers} layers"

    def occupancy(self) -> dict[str, int]:
        """Active slots, pages in use, free pages and the largest refcount right now."""
        return ds.occupancy(self.host_state())

    def check_invariants(self, *, after_reset: bool = False) -> None:
        ds.check_invariants(self.host_state(), after_reset=after_reset)

    def check_fits(self, prompt: list[int], max_new_tokens: int, label: str = "request", n: int = 1) -> int:
        """Refuse a request that could never run (bad ids, longer than max_model_len, more clones than
        slots, more pages than the pool). Returns its max_new_tokens. A request and its clones live on one
        device, so the limits are one device's share of the slots and pages."""
        [max_new] = check_requests([prompt], max_new_tokens, self.cfg.vocab_size, self.max_model_len)
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"{label}: n must be an integer >= 1, got {n!r}")
        share = f" per device ({self.num_shards} {DATA!r} devices)"
        if n > self.seqs_per_shard:
            limit = f"max_num_seqs={self.max_num_seqs}, {self.seqs_per_shard}{share}"
            raise ValueError(f"{label}: n={n} sequences exceed {limit}")
        need = pages_for(len(prompt), max_new, n, self.page_size)
        if need > self.pages_per_shard:
            raise ValueError(
                f"{label}: needs {need} pages of {self.page_size} tokens, but the pool has only "
                f"{self.pages_per_shard}{share}{self.bytes_note(need)}"
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
                f"{int(host.pages_free)} of {self.pages_per_shard} were free on its device "
                f"({self.num_pages} pages over {self.num_shards})"
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
                self.state = self._call("free_finished", self._free, self.state)
                host = self.host_state()
            if not waiting and not running:
                if self.guard:  # an extra call on one host meets the others here at the latest
                    check_same_call(self.num_calls, "generate returns")
                return results
            work = self._admit(host, waiting, running, prompts, max_new_tokens, n, ignore_eos)
            if work is not None:
                # Prefill, then collect again before admitting more (a prompt can finish on its prefill
                # token and free its slot): everything that fits is admitted before the next decode.
                crc = zlib.crc32(b"".join(np.asarray(a).tobytes() for a in work.values()))
                shapes = f"tokens={work['tokens'].shape[0]}, inputs crc32 {crc:08x}"
                args = (self.params, self.state, self.kv_pages, work)  # work: NumPy, copied inside the call
                self.state, self.kv_pages = self._call("prefill", self._prefill, *args, shapes=shapes)
                continue
            if not running:
                free = ds.occupancy(host)["free_pages"]
                kept = " (finished sequences keep their pages until the next generate())"
                why = f"cleanup={self.cleanup!r}" + (kept if self.cleanup == "none" else "")
                raise RuntimeError(f"prompt {waiting[0]} cannot be admitted: {free} pages free with {why}")
            width = self.decode_width(host)
            if width:
                args = (self.params, self.state, self.kv_pages, width)
                self.state, self.kv_pages = self._call("decode", self._decode, *args, shapes=f"width={width}")

    def decode_width(self, host: ds.DecodeState) -> int:
        """The decode batch's width: one block per device, as wide as the most tokens one device has
        queued (one per running sequence), rounded up to a power of two; 0 when nothing is queued.

        Example: two devices with 3 and 1 sequences running -> 2 x 4 = 8.
        """
        slots = host.tqueue.slot_ids[: int(host.tqueue.num_queued)]
        if not len(slots):
            return 0
        most = int(np.bincount(slots // self.seqs_per_shard).max())
        return self.num_shards * min(self.seqs_per_shard, bucket(most, smallest=1))

    def _admit(self, host, waiting, running, prompts, max_new_tokens, n, ignore_eos):
        """Give waiting prompts (in order) free slots while the pool can hold them to their max_new_tokens.

        Each prompt goes, with its clones, to one device: the one with the most pages to spare among
        those with n free slots, room for its pages and for its tokens in this call (the lowest
        device on a tie), so every host picks the same. Returns the prefill work, the tokens laid out
        as one block per device, each padded to the same power-of-two bucket; or None.
        """
        ps, seqs, per = self.page_size, host.sequences, self.seqs_per_shard
        shards = range(self.num_shards)
        free_slots = [[s for s in range(k * per, (k + 1) * per) if not seqs.used_mask[s]] for k in shards]
        held = (seqs.page_indices >= 0).sum(axis=1)  # (S,)
        free_pages = (host.page_table.page_ref_counts == 0).reshape(self.num_shards, -1).sum(axis=1)
        spare = [int(f) for f in free_pages]  # pages each device can still promise
        for slots in running.values():
            for s in slots:
                if not host.finished[s]:  # pages a running sequence may still take on its device
                    left = int(host.max_new_tokens[s] - host.num_generated[s])
                    spare[s // per] -= cdiv(int(seqs.seq_lens[s]) + left, ps) - int(held[s])
        blocks = [{"tokens": [], "slots": [], "pos": []} for _ in shards]
        pairs = []
        new = np.zeros(self.max_num_seqs, bool)
        seq_max_new = np.zeros(self.max_num_seqs, np.int32)
        while waiting:
            i = waiting[0]
            need = pages_for(len(prompts[i]), max_new_tokens[i], n, ps)
            room = [
                not b["tokens"] or len(b["tokens"]) + len(prompts[i]) <= self.max_prefill_tokens
                for b in blocks
            ]
            fits = [k for k in shards if len(free_slots[k]) >= n and need <= spare[k] and room[k]]
            if not fits:
                break
            k = max(fits, key=lambda k: (spare[k], -k))
            waiting.popleft()
            mine = [free_slots[k].pop(0) for _ in range(n)]
            running[i] = mine
            spare[k] -= need
            blocks[k]["tokens"] += prompts[i]
            blocks[k]["slots"] += [mine[0]] * len(prompts[i])
            blocks[k]["pos"] += range(len(prompts[i]))
            new[mine[0]], seq_max_new[mine[0]] = True, max_new_tokens[i]
            pairs += [(mine[0], child) for child in mine[1:]]
            self.num_clones += n > 1  # one request split into its n sequences
        if not any(b["tokens"] for b in blocks):
            return None
        width = bucket(max(len(b["tokens"]) for b in blocks))

        def laid_out(key: str, pad: int) -> np.ndarray:
            return np.concatenate(
                [np.asarray(b[key] + [pad] * (width - len(b[key])), np.int32) for b in blocks]
            )

        pairs += [(0, INVALID)] * (self.max_num_seqs - len(pairs))
        return {
            "tokens": laid_out("tokens", 0),  # (devices * width,)
            "slots": laid_out("slots", INVALID),  # (devices * width,)
            "pos": laid_out("pos", 0),  # (devices * width,)
            "new": new,  # (S,)
            "max_new": seq_max_new,  # (S,)
            "ignore_eos": np.full(self.max_num_seqs, ignore_eos),  # (S,)
            "parents": np.asarray([p for p, _ in pairs], np.int32),  # (S,)
            "children": np.asarray([c for _, c in pairs], np.int32),  # (S,)
        }
