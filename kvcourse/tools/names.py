"""L5's names and L6's, side by side: the map that stands in for the diff a rewrite cannot have.

L6 rewrites L5 in JAX, with Levanter's names (stanford-crfm/levanter at 9263f81, September 2025), so
``diff L5_clones L6_tpu_jax`` shows nothing a learner can use. ``NAMES`` maps every public name of L5's engine modules to L6's name for the same thing, with a
one-line note on what differs, or to ``""`` with the reason L6 has none. A name is
``"file.py:Qualname"``: a class, a function, a method or property, a dataclass field or enum member, a
public attribute a class sets in ``__init__``, and the options of ``Engine`` as ``Engine(option=)``.
L5's side is its engine modules (``L5_clones/*.py`` and its wings, ``L5_clones/fast/*.py`` and
``L5_clones/beams/*.py``; not the smoke script); L6's names are in ``L6_tpu_jax/*.py``
the same way (its mesh wing's written ``mesh/x.py:Name``), or in the shared ``kvcourse/*.py`` when
written ``kvcourse/x.py:Name``. Several L6 names are separated by ``", "``.

Checked against the code with ``ast`` (``problems``): every L5 name is a key of ``NAMES``, every key is a
name L5 has, and every L6 name it gives is a name L6 has; each failure says which name is missing on
which side. ``make diffs`` (``kvcourse/tools/diffs.py``) writes the table to
``lessons/diffs/L5_L6_names.md`` and into the L6 chapter between its ``names`` markers, and prints what
``problems`` finds; with ``--check`` it writes nothing and exits 1 if either is stale or the table is
wrong. ``tests/test_architecture.py`` checks both.

Left out on purpose: private names (``_preempt``), module constants and type aliases, and parameters of
functions other than ``Engine``'s options.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

from kvcourse.engine_config import ALL_OPTIONS

ROOT = Path(__file__).resolve().parents[2]
L5, L6 = "L5_clones", "L6_tpu_jax"
TABLE = ROOT / "lessons" / "diffs" / "L5_L6_names.md"
CHAPTER = ROOT / "lessons" / "L6_tpu_jax.md"
BEGIN, END = "<!-- names: written by make diffs from kvcourse/tools/names.py -->", "<!-- names: end -->"
OPTIONS_OF = "Engine"  # the class whose constructor parameters are listed, as Engine(option=)
WINGS = ("fast", "beams")  # the stage's folders beside its lesson (``kvcourse.tools.diffs.WINGS``)
BEAMS = "no beam search: L6 serves greedy requests and their clones only"

# L5 name -> (L6 name(s), note). Keys and L6 names are "file.py:Qualname"; "" = L6 has no counterpart,
# and the note says why. Rows in L5's file order.
NAMES: dict[str, tuple[str, str]] = {
    # ---- allocator.py
    "allocator.py:blocks_needed": ("page_table.py:cdiv", "pages of a length: `cdiv(length, page_size)`, inline"),
    "allocator.py:OutOfBlocksError": ("engine.py:OutOfPagesError", "raised by the host after the device flags a shortage: a Python `raise` cannot test a traced value; Levanter (9263f81) stops the program instead, `eqx.error_if(..., \"Out of free pages during allocation\")`"),
    "allocator.py:OutOfBlocksError.needed": ("decode_state.py:DecodeState.pages_needed, page_table.py:PageBatchInfo.pages_needed", "a value on the device; the message carries it"),
    "allocator.py:OutOfBlocksError.free": ("decode_state.py:DecodeState.pages_free, page_table.py:PageBatchInfo.pages_free", "a value on the device; the message carries it"),
    "allocator.py:Block": ("", "no object per page: a page is an index, its books one entry of `page_ref_counts`"),
    "allocator.py:Block.block_id": ("", "a page is its index into the pool"),
    "allocator.py:Block.ref_count": ("page_table.py:PageTable.page_ref_counts", "one i32 array for every page"),
    "allocator.py:Block.hash": ("", "no prefix cache in L6"),
    "allocator.py:Block.token_ids": ("", "no prefix cache in L6"),
    "allocator.py:BlockAllocator": ("page_table.py:PageTable", "refcounts only, no free list: a list that grows and shrinks has no fixed shape"),
    "allocator.py:BlockAllocator.num_blocks": ("page_table.py:PageTable.num_pages", "the array's length"),
    "allocator.py:BlockAllocator.block_size": ("page_table.py:SequenceTable.page_size", "a static field: part of the compiled program"),
    "allocator.py:BlockAllocator.blocks": ("page_table.py:PageTable.page_ref_counts", "the books of every page in one array"),
    "allocator.py:BlockAllocator.free_blocks": ("page_table.py:PageTable.page_ref_counts", "free = count 0; the lowest free ids are taken first, a fixed-size `nonzero`"),
    "allocator.py:BlockAllocator.hash_to_block": ("", "no prefix cache in L6"),
    "allocator.py:BlockAllocator.num_free": ("decode_state.py:occupancy", "its `free_pages`, counted on a host copy"),
    "allocator.py:BlockAllocator.num_used": ("decode_state.py:occupancy", "its `pages_in_use`"),
    "allocator.py:BlockAllocator.num_shared": ("device_stats.py:kv_usage", "its third value, counted on the device"),
    "allocator.py:BlockAllocator.grow": ("", "the pool never grows: its shape is compiled in"),
    "allocator.py:BlockAllocator.alloc_blocks": ("page_table.py:allocate_for_seq", "pages for a whole batch at once, all or nothing"),
    "allocator.py:BlockAllocator.free": ("page_table.py:free_pages_for_finished", "every finished slot at once, by a mask"),
    "allocator.py:BlockAllocator.lookup": ("", "no prefix cache in L6"),
    "allocator.py:BlockAllocator.register": ("", "no prefix cache in L6"),
    "allocator.py:BlockAllocator.clone": ("page_table.py:clone_pages_from, kv_cache.py:copy_page", "one child at a time, inside the prefill call"),
    "allocator.py:BlockAllocator.clone_needs": ("", "no preemption in L6, so nobody asks ahead: a prompt and its clones are admitted only if their pages fit"),
    "allocator.py:BlockAllocator.check_invariants": ("decode_state.py:check_invariants", "on a NumPy copy of the whole state"),
    # ---- attention.py
    "attention.py:ForwardMeta": ("page_table.py:PageBatchInfo", "built by `allocate_for_seq` on the device, not by the host"),
    "attention.py:ForwardMeta.positions": ("decode_state.py:TokenQueue.pos_ids", "a batch's positions come off the queue (`token_pos_ids` of `allocate_for_seq`)"),
    "attention.py:ForwardMeta.slot_mapping": ("page_table.py:PageBatchInfo.new_token_dests", "the same row of the flattened pool, `page * page_size + row`"),
    "attention.py:ForwardMeta.block_tables": ("page_table.py:PageBatchInfo.page_indices", "the batch's rows of `SequenceTable.page_indices`"),
    "attention.py:ForwardMeta.context_lens": ("page_table.py:PageBatchInfo.seq_lens", "Levanter's name; the kernels call it `context_lens`, as L4 and L5 do"),
    "attention.py:ForwardMeta.cu_q_lens": ("page_table.py:PageBatchInfo.cu_q_lens", "the same offsets"),
    "attention.py:ForwardMeta.logits_at": ("", "the step takes each sequence's last row from `cu_q_lens`"),
    "attention.py:attention": ("attention.py:paged_attend", "the model's `attend` callback: write the layer's K/V, then attend"),
    # ---- cache.py
    "cache.py:KvPool": ("kv_cache.py:init_kv_pages", "no class: a tuple of L arrays `[P, page_size, 2 * H_kv, D]`"),
    "cache.py:KvPool.block_size": ("page_table.py:SequenceTable.page_size", "static, in the tables"),
    "cache.py:KvPool.k": ("engine.py:Engine.kv_pages", "K and V interleaved by head in one array per layer (`interleave_kv`)"),
    "cache.py:KvPool.v": ("engine.py:Engine.kv_pages", "K and V interleaved by head in one array per layer (`interleave_kv`)"),
    "cache.py:KvPool.set_kv": ("kv_cache.py:update_kv", "one scatter for every new token; returns the new pool"),
    "cache.py:KvPool.grow": ("", "the pool never grows: its shape is compiled in"),
    "cache.py:KvPool.copy_block": ("kv_cache.py:copy_page", "the clone's partial last page, every layer"),
    "cache.py:KvPool.nbytes": ("engine.py:Engine.stats", "`kv_bytes_pool` sums the pools' `nbytes`"),
    # ---- engine.py
    "engine.py:Engine": ("engine.py:Engine", "the same contract; `mesh.engine.MeshEngine` runs it over a device mesh"),
    "engine.py:Engine(model_dir=)": ("engine.py:Engine(model_dir=)", "the same"),
    "engine.py:Engine(device=)": ("engine.py:Engine(device=)", "a JAX device: `cpu`, `cuda`, `tpu`"),
    "engine.py:Engine(block_size=)": ("engine.py:Engine(page_size=)", "Levanter's name"),
    "engine.py:Engine(num_blocks=)": ("engine.py:Engine(num_pages=)", "Levanter's `PageTable.num_pages` (its config's `max_pages`); never grown"),
    "engine.py:Engine(max_num_seqs=)": ("engine.py:Engine(max_num_seqs=)", "the slots of the tables (Levanter's `max_seqs`)"),
    "engine.py:Engine(max_num_batched_tokens=)": ("engine.py:Engine(max_prefill_tokens=)", "caps a prefill call (Levanter's `max_prefill_size`); a decode round runs one token per sequence"),
    "engine.py:Engine(prefill_chunk_size=)": ("", "no chunked prefill: a prompt is prefilled whole"),
    "engine.py:Engine(max_model_len=)": ("engine.py:Engine(max_model_len=)", "the same; it also fixes the tables' width"),
    "engine.py:Engine(enable_prefix_caching=)": ("", "no prefix cache in L6"),
    "engine.py:Engine(kv_cache_bytes=)": ("engine.py:Engine(kv_cache_bytes=)", "the same: sized into pages, never grown"),
    "engine.py:Engine(gpu_memory_utilization=)": ("engine.py:Engine(gpu_memory_utilization=)", "from JAX's allocator statistics, with no activation profile"),
    "engine.py:Engine(kernel=)": ("engine.py:Engine(attention=)", "`reference` (JAX) or `pallas` (a TPU kernel)"),
    "engine.py:Engine(num_splits=)": ("", "no split-KV: decode batches its sequences instead (`decode_only_paged_attention`)"),
    "engine.py:Engine(cuda_graphs=)": ("", "the jit'd decode loop is one compiled program already"),
    "engine.py:Engine.fast": ("engine.py:Engine.attention, engine.py:Engine.kernel, engine.py:Engine.decode_kernel", "no fast paths apart: `attention=` picks the kernel, one for prefill calls, one for decode rounds"),
    "engine.py:Engine.device": ("engine.py:Engine.device", "a JAX device"),
    "engine.py:Engine.model_dir": ("engine.py:Engine.model_dir", "the same"),
    "engine.py:Engine.model": ("engine.py:Engine.params, engine.py:Engine.cfg", "weights as a pytree; the model is `kvcourse.jax_model.forward`"),
    "engine.py:Engine.OPTIONS": ("", "its options are named in its signature, each checked where it is used"),
    "engine.py:Engine.config": ("engine.py:Engine.max_model_len, engine.py:Engine.sizing_line", "no shared config: the engine keeps what it needs, its length limit and the pool's sizing in bytes line"),
    "engine.py:Engine.allocator": ("decode_state.py:DecodeState.page_table", "on the device, in the state"),
    "engine.py:Engine.pool": ("engine.py:Engine.kv_pages", "a tuple of L arrays"),
    "engine.py:Engine.scheduler": ("", "no scheduler object: the host admits (`generate_samples`), the device's queue and loop run"),
    "engine.py:Engine.meter": ("engine.py:Engine.totals, device_stats.py:DeviceStats", "counted on the device; the host folds the counters in at each reset"),
    "engine.py:Engine.num_steps": ("device_stats.py:DeviceStats.steps, device_stats.py:Totals.steps", "counted on the device"),
    "engine.py:Engine.num_tokens_run": ("device_stats.py:DeviceStats.tokens_run, device_stats.py:Totals.tokens_run", "counted on the device"),
    "engine.py:Engine.stats": ("engine.py:Engine.stats", "the same `EngineStats`; `occupancy()` is the pool right now"),
    "engine.py:Engine.fit_pool": ("", "the pool is sized once; a request that does not fit is refused (`check_fits`)"),
    "engine.py:Engine.add_request": ("", "no request-at-a-time API: `generate` takes every prompt at once"),
    "engine.py:Engine.abort": ("", "no aborts"),
    "engine.py:Engine.has_unfinished": ("", "the loop in `generate_samples` runs until nothing waits or runs"),
    "engine.py:Engine.prepare": ("decode_state.py:pack_next, page_table.py:allocate_for_seq", "the batch is packed and described on the device"),
    "engine.py:Engine.step": ("engine.py:Engine.generate_samples", "one prefill call, or one decode call of up to `max_rounds` steps, per turn of its loop"),
    "engine.py:Engine.forward": ("kvcourse/jax_model.py:forward, attention.py:paged_attend", "inside the jit'd step"),
    "engine.py:Engine.generate": ("engine.py:Engine.generate", "the same"),
    "engine.py:Engine.generate_samples": ("engine.py:Engine.generate_samples", "greedy only, so the clones agree"),
    "engine.py:Engine.generate_beams": ("", BEAMS),
    # ---- paged_attention.py
    "paged_attention.py:online_softmax_update": ("attention.py:online_softmax_update", "the same update, in JAX"),
    "paged_attention.py:attend_blocks": ("attention.py:ragged_paged_attention", "its inner `fori_loop` over blocks of `kv_pages_per_block` pages"),
    "paged_attention.py:paged_attention": ("attention.py:ragged_paged_attention", "static shapes: three `fori_loop`s, blocks of queries and of pages"),
    # ---- prefix_cache.py
    "prefix_cache.py:block_hash": ("", "no prefix cache in L6"),
    "prefix_cache.py:match_prefix": ("", "no prefix cache in L6"),
    "prefix_cache.py:register_full_blocks": ("", "no prefix cache in L6"),
    # ---- scheduler.py
    "scheduler.py:Scheduler": ("", "no scheduler object: the host admits (`generate_samples`), the device's queue and loop run"),
    "scheduler.py:Scheduler.allocator": ("decode_state.py:DecodeState.page_table", "in the state"),
    "scheduler.py:Scheduler.config": ("engine.py:Engine.max_num_seqs, engine.py:Engine.max_prefill_tokens", "the engine's own: slots and a prefill call's tokens; no chunked prefill, no admission policies"),
    "scheduler.py:Scheduler.eos_ids": ("decode_state.py:DecodeState.stop_tokens", "an i32 array"),
    "scheduler.py:Scheduler.enable_prefix_caching": ("", "no prefix cache in L6"),
    "scheduler.py:Scheduler.waiting": ("", "a local deque of prompt indices in `generate_samples`; a waiting prompt holds no slot"),
    "scheduler.py:Scheduler.running": ("page_table.py:SequenceTable.used_mask, decode_state.py:TokenQueue", "used slots, and their next tokens queued"),
    "scheduler.py:Scheduler.finished": ("decode_state.py:DecodeState.finished", "a flag per slot"),
    "scheduler.py:Scheduler.num_preemptions": ("", "no preemption: a prompt is admitted only if its whole length fits"),
    "scheduler.py:Scheduler.num_clones": ("engine.py:Engine.num_clones", "requests split into their n sequences"),
    "scheduler.py:Scheduler.prefix_cache_hits": ("", "no prefix cache in L6"),
    "scheduler.py:Scheduler.groups": ("", "no groups: L6 has no beam search, and a prompt's clones run as separate slots"),
    "scheduler.py:Scheduler.add": ("", "`generate` takes every prompt at once"),
    "scheduler.py:Scheduler.has_unfinished": ("", "the loop in `generate_samples` runs until nothing waits or runs"),
    "scheduler.py:Scheduler.num_running_seqs": ("decode_state.py:occupancy", "its `active_slots`"),
    "scheduler.py:Scheduler.schedule": ("decode_state.py:pack_next, engine.py:Engine.decode_width", "the device packs each round's batch; the host picks its width"),
    "scheduler.py:Scheduler.update": ("decode_state.py:update_tokens", "append, the stopping rule, queue the next token; on the device"),
    "scheduler.py:Scheduler.abort": ("", "no aborts"),
    "scheduler.py:Scheduler.check_invariants": ("decode_state.py:check_invariants", "one check of the whole state"),
    # ---- sequence.py
    "sequence.py:Status": ("page_table.py:SequenceTable.used_mask, decode_state.py:DecodeState.finished", "two masks over the slots"),
    "sequence.py:Status.WAITING": ("", "a waiting prompt has no slot yet: it is an index in the host's deque"),
    "sequence.py:Status.RUNNING": ("page_table.py:SequenceTable.used_mask", "used and not finished"),
    "sequence.py:Status.FINISHED": ("decode_state.py:DecodeState.finished", "its outputs stay readable until the next reset"),
    "sequence.py:FinishReason": ("", "a finished flag only"),
    "sequence.py:FinishReason.EOS": ("decode_state.py:DecodeState.stop_tokens", "the stop tokens `update_tokens` checks"),
    "sequence.py:FinishReason.MAX_TOKENS": ("decode_state.py:DecodeState.max_new_tokens", "the max_new_tokens `update_tokens` checks"),
    "sequence.py:FinishReason.ABORTED": ("", "no aborts"),
    "sequence.py:Sequence": ("page_table.py:SequenceTable", "a sequence is a slot: its row of the tables and of `DecodeState`"),
    "sequence.py:Sequence.request_id": ("", "a prompt is its index in the list `generate` takes"),
    "sequence.py:Sequence.prompt_ids": ("", "the prompt goes straight into the prefill call; nothing keeps it"),
    "sequence.py:Sequence.max_new_tokens": ("decode_state.py:DecodeState.max_new_tokens", "per slot"),
    "sequence.py:Sequence.ignore_eos": ("decode_state.py:DecodeState.ignore_eos", "per slot"),
    "sequence.py:Sequence.priority": ("", "first come, first served"),
    "sequence.py:Sequence.num_samples": ("engine.py:Engine.generate_samples", "its `n`, the same for every prompt of a call"),
    "sequence.py:Sequence.sampling": ("", "greedy only"),
    "sequence.py:Sequence.sample_index": ("", "clone j of prompt i is `result[i][j]`; nothing records who cloned whom"),
    "sequence.py:Sequence.generator": ("", "greedy only"),
    "sequence.py:Sequence.block_table": ("page_table.py:SequenceTable.page_indices", "a fixed-width row, INVALID (-1) after its last page"),
    "sequence.py:Sequence.num_computed_tokens": ("page_table.py:SequenceTable.seq_lens", "also counts the tokens being written this step"),
    "sequence.py:Sequence.output_ids": ("decode_state.py:DecodeState.tokens, decode_state.py:DecodeState.num_generated", "a fixed-width row per slot and its count"),
    "sequence.py:Sequence.status": ("page_table.py:SequenceTable.used_mask, decode_state.py:DecodeState.finished", "two masks over the slots"),
    "sequence.py:Sequence.finish_reason": ("", "a finished flag only"),
    "sequence.py:Sequence.all_ids": ("", "no preemption, so nothing is recomputed"),
    "sequence.py:Sequence.num_tokens": ("page_table.py:SequenceTable.seq_lens", "plus the one token queued"),
    "sequence.py:Sequence.num_seqs": ("engine.py:Engine.check_fits", "a prompt's n clones take n slots; it refuses more than `max_num_seqs`"),
    "sequence.py:Sequence.sort_key": ("", "first come, first served"),
    "sequence.py:allocate_slots": ("page_table.py:allocate_for_seq", "a whole batch at once, on the device, all or nothing"),
    "sequence.py:slots": ("page_table.py:PageBatchInfo.new_token_dests", "computed by `batch_info`"),
    # ---- fast/__init__.py
    "fast/__init__.py:choose_kernel": ("engine.py:Engine(attention=)", "chosen by the caller: `reference` or `pallas`"),
    "fast/__init__.py:load_kernel": ("attention.py:reference_kernel, pallas_attention.py:pallas_kernel", "the kernel with its block sizes bound"),
    "fast/__init__.py:FastPath": ("", "no seam: the jit'd loop is the fast path, and `attention=` picks the kernel"),
    "fast/__init__.py:FastPath.kernel": ("engine.py:Engine.kernel, engine.py:Engine.decode_kernel", "one for prefill calls, one for decode rounds"),
    "fast/__init__.py:FastPath.name": ("engine.py:Engine.attention", "the kernel's name"),
    "fast/__init__.py:FastPath.padding_blocks": ("", "no CUDA graphs, so no padding block"),
    "fast/__init__.py:FastPath.graphs": ("", "no CUDA graphs: the jit'd decode loop is one compiled program already"),
    "fast/__init__.py:FastPath.run": ("engine.py:Engine.generate_samples", "every step runs compiled"),
    # ---- fast/cpp_paged_attention.py
    "fast/cpp_paged_attention.py:cpp_paged_attention": ("", "no C++ kernel: XLA compiles the JAX reference for the CPU"),
    # ---- fast/split_kv.py
    "fast/split_kv.py:merge_partials": ("", "no split-KV"),
    "fast/split_kv.py:attend_decode_batch": ("attention.py:decode_only_paged_attention", "decode rounds: the sequences as a batch axis"),
    "fast/split_kv.py:split_kv_attention": ("", "no split-KV: decode batches its sequences instead (`decode_only_paged_attention`)"),
    # ---- fast/triton_paged_attention.py
    "fast/triton_paged_attention.py:jit": ("pallas_attention.py:interpret_mode", "compiled on a TPU, interpreted on a CPU"),
    "fast/triton_paged_attention.py:LaunchConfig": ("pallas_attention.py:pallas_kernel", "the kernel with its block sizes bound"),
    "fast/triton_paged_attention.py:LaunchConfig.block_m": ("engine.py:Engine(q_block=)", "query rows per block"),
    "fast/triton_paged_attention.py:LaunchConfig.tile_n": ("engine.py:Engine(kv_pages_per_block=)", "pages per KV block"),
    "fast/triton_paged_attention.py:LaunchConfig.num_warps": ("", "a GPU launch setting; Pallas TPU has none"),
    "fast/triton_paged_attention.py:LaunchConfig.num_stages": ("", "a GPU launch setting; Pallas pipelines the block copies itself"),
    "fast/triton_paged_attention.py:LaunchConfig.prefetch": ("", "a GPU loop option; Pallas pipelines the block copies itself"),
    "fast/triton_paged_attention.py:LaunchConfig.precision": ("", "every dot passes `precision=HIGHEST` (fp32 on any backend); no tensor-core option"),
    "fast/triton_paged_attention.py:choose_splits": ("", "no split-KV"),
    "fast/triton_paged_attention.py:choose_launch": ("engine.py:Engine(q_block=), engine.py:Engine(kv_pages_per_block=)", "block sizes are the caller's, bound into the kernel at build time"),
    "fast/triton_paged_attention.py:combine_function": ("", "JAX's reductions compile the same on every backend"),
    "fast/triton_paged_attention.py:triton_paged_attention": ("pallas_attention.py:pallas_ragged_paged_attention", "the same algorithm as a Pallas TPU kernel: a grid, scalar prefetch"),
    # ---- beams/__init__.py (L5's beam search, a wing beside the lesson)
    "beams/__init__.py:recompute_shares": ("", BEAMS),
    "beams/__init__.py:beam_blocks": ("", BEAMS),
    "beams/__init__.py:check_beam_request": ("", BEAMS),
    "beams/__init__.py:add_beam_request": ("", BEAMS),
    "beams/__init__.py:generate_beams": ("", BEAMS),
    # ---- beams/fork.py
    "beams/fork.py:fork": ("", BEAMS),
    "beams/fork.py:fork_needs": ("", BEAMS),
    # ---- beams/group.py
    "beams/group.py:BeamGroup": ("", BEAMS),
    "beams/group.py:BeamGroup.params": ("", BEAMS),
    "beams/group.py:BeamGroup.max_new_tokens": ("", BEAMS),
    "beams/group.py:BeamGroup.eos_ids": ("", BEAMS),
    "beams/group.py:BeamGroup.scores": ("", BEAMS),
    "beams/group.py:BeamGroup.seqs": ("", BEAMS),
    "beams/group.py:BeamGroup.finished": ("", BEAMS),
    "beams/group.py:BeamGroup.rows": ("", BEAMS),
    "beams/group.py:BeamGroup.steps": ("", BEAMS),
    "beams/group.py:BeamGroup.done": ("", BEAMS),
    "beams/group.py:BeamGroup.choose": ("", BEAMS),
    "beams/group.py:BeamGroup.sequences": ("", BEAMS),
    "beams/group.py:BeamGroup.update": ("", BEAMS),
    "beams/group.py:BeamGroup.preempted": ("", BEAMS),
    "beams/group.py:BeamGroup.check_invariants": ("", BEAMS),
}  # fmt: skip


def module_names(path: Path) -> dict[str, int]:
    """The public names one module defines, as qualnames, each with the line it is defined on.

    Example: a module with ``class Block`` (a dataclass with a field ``ref_count``), ``def free(self)``
    in ``class BlockAllocator`` whose ``__init__`` sets ``self.free_blocks``, and ``def slots()`` ->
    ``Block``, ``Block.ref_count``, ``BlockAllocator``, ``BlockAllocator.free_blocks``,
    ``BlockAllocator.free``, ``slots`` (with their lines).
    """
    found: dict[str, int] = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            found[node.name] = node.lineno
        if not isinstance(node, ast.ClassDef) or node.name.startswith("_"):
            continue
        found[node.name] = node.lineno
        for item in node.body:
            if isinstance(item, ast.FunctionDef) and not item.name.startswith("_"):
                found[f"{node.name}.{item.name}"] = item.lineno  # a method or a property
            elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                found[f"{node.name}.{item.target.id}"] = item.lineno  # a dataclass field
            elif isinstance(item, ast.Assign):  # an enum member
                found |= {f"{node.name}.{t.id}": item.lineno for t in item.targets if isinstance(t, ast.Name)}
            elif isinstance(item, ast.FunctionDef) and item.name == "__init__":
                if node.name == OPTIONS_OF:
                    args = item.args.args[1:] + item.args.kwonlyargs
                    found |= {f"{node.name}({a.arg}=)": a.lineno for a in args}
                    if item.args.kwarg:  # **options: the shared ones, checked by kvcourse.engine_config
                        found |= {f"{node.name}({o}=)": item.lineno for o in shared_options(path, node)}
                for sub in ast.walk(item):  # the attributes it sets, self.x = ...
                    if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store):
                        if isinstance(sub.value, ast.Name) and sub.value.id == "self" and sub.attr[0] != "_":
                            found.setdefault(f"{node.name}.{sub.attr}", sub.lineno)
    return dict(sorted(found.items(), key=lambda kv: kv[1]))


def shared_options(path: Path, cls: ast.ClassDef) -> tuple[str, ...]:
    """The shared options a class takes through ``**options``: the ``OPTIONS`` of the class imported
    (L5: all but ``admission_policy``), or all of them for a module outside the repository."""
    if ROOT not in path.resolve().parents:
        return ALL_OPTIONS
    module = importlib.import_module(".".join(path.resolve().relative_to(ROOT).with_suffix("").parts))
    return getattr(module, cls.name).OPTIONS


def stage_names(stage: str, root: Path = ROOT) -> dict[str, list[str]]:
    """Every public name of a stage's engine modules, ``"file.py:Qualname"``, by file, in file order
    (the stage's own folder, then its wings, ``fast/`` and ``beams/``, each with its ``__init__.py``; not
    the stage's ``__init__.py`` or scripts ``lN_*.py``)."""
    folder = root / stage
    out = {}
    for f in [
        *sorted(folder.glob("*.py")),
        *(f for wing in WINGS for f in sorted((folder / wing).glob("*.py"))),
    ]:
        if f == folder / "__init__.py" or (f.name[0] == "l" and f.name[1].isdigit()):
            continue
        rel = f.relative_to(folder).as_posix()
        out[rel] = [f"{rel}:{q}" for q in module_names(f)]
    return out


def l6_has(name: str, root: Path = ROOT) -> bool:
    """Whether L6 (or, for ``kvcourse/x.py:...``, the shared layer) defines ``name``."""
    where, _, qualname = name.partition(":")
    path = root / where if where.startswith("kvcourse/") else root / L6 / where
    return path.is_file() and qualname in module_names(path)


def problems(names: dict[str, tuple[str, str]] = NAMES, root: Path = ROOT) -> list[str]:
    """What is wrong with the table, one line per name, each saying on which side it is missing."""
    l5 = {name for file in stage_names(L5, root).values() for name in file}
    out = [f"L5 has {n}, which NAMES does not map: add a row" for n in sorted(l5 - names.keys())]
    out += [f"NAMES maps {n}, which L5 does not have (renamed or gone?)" for n in sorted(names.keys() - l5)]
    for key, (l6, note) in names.items():
        if not note.strip():
            out.append(f"NAMES maps {key} without a note")
        for name in filter(None, l6.split(", ")):
            if not l6_has(name, root):
                out.append(f"NAMES maps {key} to {name}, which L6 does not have")
    return out


def shown(name: str) -> str:
    """A name as the table shows it: ``page_table.py:PageTable.page_ref_counts`` ->
    ``page_table.PageTable.page_ref_counts``; ``kvcourse/stats.py:UsageMeter`` -> ``kvcourse.stats.UsageMeter``."""
    where, _, qualname = name.partition(":")
    return f"`{where.removesuffix('.py').replace('/', '.')}.{qualname}`"


def table(names: dict[str, tuple[str, str]] = NAMES, root: Path = ROOT) -> str:
    """The markdown table, one section per L5 file, rows in the file's order."""
    lines = []
    for file, keys in stage_names(L5, root).items():
        lines += ["", f"**`{L5}/{file}`**", "", "| L5 | L6 | what differs |", "|---|---|---|"]
        for key in keys:
            l6, note = names.get(key, ("", "(missing from NAMES)"))
            target = ", ".join(shown(n) for n in l6.split(", ")) if l6 else "none"
            lines.append(f"| `{key.partition(':')[2]}` | {target} | {note} |")
    return "\n".join(lines).lstrip("\n") + "\n"


def table_file(root: Path = ROOT) -> str:
    """``lessons/diffs/L5_L6_names.md``: a heading and the table."""
    return (
        "# L5's names and L6's (written by `make diffs` from `kvcourse/tools/names.py`; do not edit)\n\n"
        "Every public name of L5's engine modules, and L6's name for the same thing (Levanter's, where it has\n"
        "one), with what differs; `none` where L6 has no counterpart, and why.\n\n" + table(root=root)
    )


def chapter_with_table(text: str, root: Path = ROOT) -> str:
    """The chapter's text with the table between its markers replaced by the current one."""
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[:start] + "\n\n" + table(root=root) + "\n" + text[end:]


def outputs(root: Path = ROOT) -> list[tuple[Path, str]]:
    """The files this writes, with their text."""
    chapter = root / CHAPTER.relative_to(ROOT)
    return [
        (root / TABLE.relative_to(ROOT), table_file(root)),
        (chapter, chapter_with_table(chapter.read_text(encoding="utf-8"), root)),
    ]
