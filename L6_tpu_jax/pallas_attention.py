"""L6's Pallas TPU kernel: the same ragged paged attention as ``attention.py``, written as a grid.

Same arguments and output as the JAX reference ``ragged_paged_attention``; the algorithm (online
softmax over blocks of pages, causal mask, GQA) is unchanged. What changes is who walks the loops:
instead of three ``fori_loop``s, Pallas runs one kernel body per point of a 4-D grid::

    grid = (S, H_kv, n_q_blocks, n_kv_blocks)      # sequence, KV head, query block, KV block
           step (s, h, b, j): q rows b*q_block.. of sequence s for the G query heads of KV head h,
                              against pages j*kv_pages_per_block.. of sequence s (K_h and V_h only)

The KV axis is last and "arbitrary": consecutive steps of one (s, h, b) carry the online-softmax state
(m, l, acc) in VMEM scratch; step j == 0 resets it, the last step writes ``acc / l`` to the output block.

Scalar prefetch. ``context_lens``, ``page_indices``, ``cu_q_lens`` and ``num_seqs`` are passed with
``pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=4)``: they land in SMEM before the grid starts, and
every ``index_map`` receives them after the grid indices. The KV ``BlockSpec`` of page i in a block uses
them to name a page of the pool::

    index_map(s, h, b, j, context_lens, page_indices, ...) = (page_indices[s, j' * N + i], 0, h, 0)

with block shape ``(one page, page_size, 2, D)``: block h of the head axis is rows ``2h, 2h + 1``, which
the interleaved layout makes ``K_h, V_h``. A block of N = ``kv_pages_per_block`` pages is N inputs, the
same pool passed N times, page i of the block in input i. ``j'`` is j clamped to the last KV block this
query block can see (causal, context_len): steps past it name the same pages again, so the pipeline skips the
copy, and ``pl.when`` skips their compute. Pages past the end are INVALID and read as page 0, always masked.

Queries. A BlockSpec cuts fixed blocks, but a sequence's rows start anywhere (``cu_q_lens``). So a
plain-JAX gather before the kernel lays q out per sequence, padded to a static max of T rows (the batch
size): ``(S, H_kv, T_pad * G, D)``, row ``i * G + g`` = query i, head h * G + g; a scatter after it puts
the output back in (T, H, D) rows. Rows past a sequence's q_len, and sequences past ``num_seqs``, come
back 0, like the reference.

Where it runs (``interpret_mode``): compiled by Mosaic on a TPU, in TPU interpret mode on a CPU, and
nowhere else: a Pallas TPU kernel does not compile for a GPU, so an engine on a GPU refuses
``attention="pallas"`` with a clear error (use the reference there, the default).

Verified here: CPU only, in Pallas's TPU interpret mode (``pltpu.force_tpu_interpret_mode()`` or
``interpret=pltpu.InterpretParams()``), which simulates VMEM/SMEM and the block copies; the tests check
it against dense attention and the JAX reference. Not run on a TPU: it has never been compiled by
Mosaic, and layouts Mosaic wants (m and l 128 lanes wide, head_dim a multiple of 128, blocks of
(8, 128)-aligned shapes) are not attempted. Left out on purpose: manual double-buffered DMA from HBM
(the upstream kernel does this instead of N page inputs), packing several sequences' queries in one
block, sliding windows, soft-capping, quantized KV, and bf16.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kvcourse.jax_model import HIGHEST

from .attention import check_block_sizes, pad_to_kv_blocks
from .page_table import cdiv


def interpret_mode(platform: str):
    """How this kernel runs on a JAX platform: compiled by Mosaic on ``"tpu"`` (``False``), in Pallas's
    TPU interpret mode on ``"cpu"`` (``pltpu.InterpretParams()``); anything else (``"gpu"``) is refused.

    A Pallas *TPU* kernel (``pltpu`` grid spec, VMEM/SMEM scratch) does not compile for a GPU, and its
    interpret mode is a CPU simulation of a TPU's memories, never run on a GPU here.

    Example: ``interpret_mode("gpu")`` raises ``ValueError: attention='pallas' is a Pallas TPU kernel: ...``.
    """
    if platform == "tpu":
        return False
    if platform == "cpu":
        return pltpu.InterpretParams()
    raise ValueError(
        f"attention='pallas' is a Pallas TPU kernel: it compiles only for a TPU and runs interpreted "
        f"(TPU interpret mode) only on a CPU, not on {platform!r}; use attention='reference' there, "
        "or device='cpu' to run the kernel interpreted"
    )


def _kernel(
    context_lens_ref,  # SMEM (S,)
    pages_ref,  # SMEM (S, n_kv_blocks * N)
    cu_ref,  # SMEM (S + 1,)
    num_seqs_ref,  # SMEM (1,)
    q_ref,  # VMEM (q_block * G, D)
    *refs,  # N page refs, each (page_size, 2, D); then o_ref; then m, l, acc scratch
    n_pages: int,
    q_block: int,
    g: int,
    scale: float,
):
    kv_refs, o_ref, (m_ref, l_ref, acc_ref) = refs[:n_pages], refs[n_pages], refs[n_pages + 1 :]
    s, b, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    ps = kv_refs[0].shape[0]
    span = n_pages * ps  # keys per KV block
    context_len, q_len = context_lens_ref[s], cu_ref[s + 1] - cu_ref[s]
    newest = context_len - q_len + jnp.minimum((b + 1) * q_block, q_len) - 1  # last key this block can see

    @pl.when(j == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    live = (s < num_seqs_ref[0]) & (b * q_block < q_len) & (j * span <= newest)

    @pl.when(live)
    def _step():
        kv = jnp.concatenate([r[...] for r in kv_refs], axis=0)  # (span, 2, D): K_h, V_h of N pages
        k, v = kv[:, 0, :], kv[:, 1, :]  # (span, D) each
        q = q_ref[...]  # (QB * G, D)
        sc = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=HIGHEST) * scale  # (QB * G, span)
        rows = jax.lax.broadcasted_iota(jnp.int32, sc.shape, 0)  # (QB * G, span)
        q_pos = context_len - q_len + b * q_block + rows // g  # absolute position of each row's query
        k_pos = j * span + jax.lax.broadcasted_iota(jnp.int32, sc.shape, 1)
        sc = jnp.where((k_pos <= q_pos) & (k_pos < context_len), sc, -jnp.inf)
        m = m_ref[...]  # (QB * G, 1)
        m_new = jnp.maximum(m, sc.max(axis=-1, keepdims=True))
        base = jnp.where(jnp.isinf(m_new), 0.0, m_new)  # rows with nothing visible yet stay at 0
        p = jnp.exp(sc - base)  # (QB * G, span)
        alpha = jnp.exp(m - base)  # (QB * G, 1)
        l_ref[...] = alpha * l_ref[...] + p.sum(axis=-1, keepdims=True)
        acc_ref[...] = alpha * acc_ref[...] + jnp.dot(p, v, precision=HIGHEST)  # (QB * G, D)
        m_ref[...] = m_new

    @pl.when(j == pl.num_programs(3) - 1)
    def _done():
        l = l_ref[...]
        o_ref[...] = (acc_ref[...] / jnp.where(l == 0, 1.0, l)).astype(o_ref.dtype)


def pallas_ragged_paged_attention(
    q: jax.Array,
    kv_pages: jax.Array,
    context_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    q_block: int = 16,
    kv_pages_per_block: int = 16,
    scale: float | None = None,
    interpret=None,
) -> jax.Array:
    """The Pallas version of ``attention.ragged_paged_attention``: same arguments, same (T, H, D) output.

    ``interpret``: passed to ``pl.pallas_call``; None (the default) asks ``interpret_mode`` for JAX's
    default backend: ``False`` (compiled by Mosaic) on a TPU, TPU interpret mode on a CPU, refused on a
    GPU. Under ``pltpu.force_tpu_interpret_mode()`` even ``interpret=False`` runs interpreted.

    Example, page_size 4, kv_pages_per_block 2, q_block 2, H=H_kv=1: one sequence, context_len 6, q_len 3,
    page_indices [[5, 0, -1]] -> grid (1, 1, 2, 2). Step (0, 0, 0, 0) loads pages 5 and 0 and queries 0..1
    (positions 3, 4); step (0, 0, 1, 1) loads the same pages again (block 1 is clamped to block 0: nothing
    past key 5 exists), so it is skipped, and query 2 (position 5) finishes after block 0.
    """
    check_block_sizes(q_block=q_block, kv_pages_per_block=kv_pages_per_block)
    n_tok, n_heads, d = q.shape
    ps, n_kv = kv_pages.shape[1], kv_pages.shape[2] // 2
    g, n_seq, per_seq = n_heads // n_kv, page_indices.shape[0], page_indices.shape[1]
    scale = d**-0.5 if scale is None else scale
    n_pb, span = kv_pages_per_block, kv_pages_per_block * ps
    n_qb, n_kvb = cdiv(n_tok, q_block), cdiv(per_seq, n_pb)
    t_pad = n_qb * q_block
    if interpret is None:
        interpret = interpret_mode(jax.default_backend())

    # Queries per sequence: (S, H_kv, T_pad * G, D), padding rows point at an all-zero row n_tok.
    i = jnp.arange(t_pad)  # (T_pad,) query index within a sequence
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]  # (S,)
    ok = (i[None, :] < q_lens[:, None]) & (jnp.arange(n_seq) < num_seqs)[:, None]  # (S, T_pad)
    rows = jnp.where(ok, cu_q_lens[:-1, None] + i[None, :], n_tok)  # (S, T_pad) rows of q
    q_seq = jnp.pad(q, ((0, 1), (0, 0), (0, 0)))[rows]  # (S, T_pad, H, D)
    q_seq = q_seq.reshape(n_seq, t_pad, n_kv, g, d).transpose(0, 2, 1, 3, 4)  # (S, H_kv, T_pad, G, D)
    q_seq = q_seq.reshape(n_seq, n_kv, t_pad * g, d)  # (S, H_kv, T_pad * G, D)
    pages = pad_to_kv_blocks(page_indices, n_pb)  # (S, n_kvb * N)

    def q_map(s, h, b, j, *prefetch):
        return s, h, b, 0

    def page_map(i):
        def index_map(s, h, b, j, context_lens_ref, pages_ref, cu_ref, num_seqs_ref):
            context_len, q_len = context_lens_ref[s], cu_ref[s + 1] - cu_ref[s]
            newest = context_len - q_len + jnp.minimum((b + 1) * q_block, q_len) - 1
            jj = jnp.minimum(j, jnp.maximum(newest, 0) // span)  # past what b can see: same block again
            return jnp.maximum(pages_ref[s, jj * n_pb + i], 0), 0, h, 0

        return index_map

    q_spec = pl.BlockSpec((None, None, q_block * g, d), q_map)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4,
        grid=(n_seq, n_kv, n_qb, n_kvb),
        in_specs=[q_spec] + [pl.BlockSpec((None, ps, 2, d), page_map(i)) for i in range(n_pb)],
        out_specs=q_spec,
        scratch_shapes=[
            pltpu.VMEM((q_block * g, 1), jnp.float32),  # m
            pltpu.VMEM((q_block * g, 1), jnp.float32),  # l
            pltpu.VMEM((q_block * g, d), jnp.float32),  # acc
        ],
    )
    out = pl.pallas_call(
        functools.partial(_kernel, n_pages=n_pb, q_block=q_block, g=g, scale=scale),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(q_seq.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")
        ),
        interpret=interpret,
    )(
        context_lens.astype(jnp.int32),
        pages.astype(jnp.int32),
        cu_q_lens.astype(jnp.int32),
        jnp.reshape(num_seqs, (1,)).astype(jnp.int32),
        q_seq,
        *([kv_pages] * n_pb),
    )  # (S, H_kv, T_pad * G, D)
    out = out.reshape(n_seq, n_kv, t_pad, g, d).transpose(0, 2, 1, 3, 4).reshape(n_seq, t_pad, n_heads, d)
    return jnp.zeros((n_tok + 1, n_heads, d), q.dtype).at[rows].set(out)[:n_tok]  # padding -> row n_tok


def pallas_kernel(q_block: int = 16, kv_pages_per_block: int = 16, interpret=None):
    """``pallas_ragged_paged_attention`` with these block sizes (and ``interpret``), ready for
    ``paged_attend``."""
    return functools.partial(
        pallas_ragged_paged_attention,
        q_block=q_block,
        kv_pages_per_block=kv_pages_per_block,
        interpret=interpret,
    )
