"""L4 kernels against dense masked attention on random paged layouts.

Every case builds a pool with shuffled, non-contiguous block ids, writes random K/V, and compares the
kernel with plain softmax attention over the gathered history (the L3 way), for: lengths 1, exact
multiples of block_size and ragged; block sizes 1, 7, 16; GQA ratios 1, 3, 4; decode queries and mixed
prefill chunks (causal inside the new tokens). The reference kernel (``paged_attention.py``) runs them,
and so do its fast paths (``fast/``): the split-KV extension with 1 and 4 splits and decode rows in
tiles of 1, 3 and 16 blocks, the C++ kernel (built by ``make setup``) and the Triton kernel
(interpreted), whose query tiles also run prompts of 1 to 2,048 rows and chunks after long histories,
and write every output row once, from a program of the row's own sequence.

The Triton kernel is compiled for GPU tensors and interpreted for CPU ones, in one process: on the CPU
the compiled twin is built for NVIDIA GPUs down to a GPU binary (Triton's compiler needs no GPU for
that), and the tests marked ``cuda`` run it against dense attention where there is a GPU.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from cpp_kernel import needs_cpp
from smoke_runs import run_smoke_in_process, smoke_module

from kvcourse.cpp_kernels import CppKernelUnavailable, build_all, build_name, build_problem, load_cpp_kernel
from kvcourse.devices import resolve_device
from kvcourse.harness.kernel_cases import QUERY_TILE_CASES, TRITON_CASES, cases, dense_reference, make_case
from kvcourse.model_store import REPO_ROOT
from L4_paged_kernel import fast as l4_fast
from L4_paged_kernel.engine import Engine
from L4_paged_kernel.fast.cpp_paged_attention import SOURCE, cpp_paged_attention
from L4_paged_kernel.fast.split_kv import merge_partials, split_kv_attention
from L4_paged_kernel.paged_attention import paged_attention


@pytest.mark.parametrize("block_size, n_heads, n_kv, context_lens, q_lens", list(cases()))
def test_torch_kernel_matches_dense(block_size, n_heads, n_kv, context_lens, q_lens):
    """The reference: one sequence at a time, one block at a time."""
    args = make_case(block_size, n_heads, n_kv, context_lens, q_lens)
    assert (paged_attention(*args) - dense_reference(*args)).abs().max().item() < 2e-5


@pytest.mark.parametrize("blocks_per_tile", [1, 3, 16])  # decode rows: tiles of blocks, ragged last tile
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("block_size, n_heads, n_kv, context_lens, q_lens", list(cases()))
def test_split_kv_matches_dense(block_size, n_heads, n_kv, context_lens, q_lens, num_splits, blocks_per_tile):
    args = make_case(block_size, n_heads, n_kv, context_lens, q_lens)
    got = split_kv_attention(*args, num_splits=num_splits, blocks_per_tile=blocks_per_tile)
    assert (got - dense_reference(*args)).abs().max().item() < 2e-5


@needs_cpp
@pytest.mark.parametrize("block_size, n_heads, n_kv, context_lens, q_lens", list(cases()))
def test_cpp_kernel_matches_dense(block_size, n_heads, n_kv, context_lens, q_lens):
    args = make_case(block_size, n_heads, n_kv, context_lens, q_lens)
    assert (cpp_paged_attention(*args) - dense_reference(*args)).abs().max().item() < 2e-5


@needs_cpp
def test_cpp_kernel_long_prefill_and_decode_batch():
    """Hundreds of rows and keys, as in a real step: every row and head is its own work item."""
    args = make_case(16, 9, 3, [300, 77, 512, 1], [300, 1, 1, 1], head_dim=64, seed=3)
    assert (cpp_paged_attention(*args) - dense_reference(*args)).abs().max().item() < 2e-5


@needs_cpp
def test_cpp_kernel_refuses_what_it_cannot_do():
    args = make_case(16, 4, 2, [5], [1])
    with pytest.raises(RuntimeError, match="contiguous fp32"):
        cpp_paged_attention(args[0].double(), *args[1:])
    with pytest.raises(RuntimeError, match="cu_q_lens ends at 1 but q has 2 rows"):
        cpp_paged_attention(torch.cat([args[0], args[0]]), *args[1:])


def test_the_fast_path_seam_docstring_example():
    """``FastPath`` binds the split count into the kernel it hands the engine, names what runs, and adds
    the decode graphs' padding block only when they are on."""
    cpu = torch.device("cpu")
    fast = l4_fast.FastPath(cpu, "torch", 2, False, 32, 2048, 16)
    assert fast.name == "torch, 2 splits" and fast.padding_blocks == 0 and fast.graphs is None
    assert fast.kernel.func is split_kv_attention and fast.kernel.keywords == {"num_splits": 2}
    assert fast.run(lambda token_ids, meta: "forward", None, None, None) == "forward"  # no graphs: forward
    assert l4_fast.load_kernel("torch", cpu) is paged_attention  # one split: the reference itself
    auto = l4_fast.FastPath(cpu, "torch", "auto", False, 32, 2048, 16)  # the engines' default: one split
    assert auto.name == "torch" and auto.kernel is paged_attention  # on a CPU, and for the reference
    auto = l4_fast.FastPath(cpu, "triton", "auto", False, 32, 2048, 16)
    assert auto.name == "triton" and auto.kernel.keywords == {"num_splits": 1}
    graphs = l4_fast.FastPath(cpu, "torch", 1, True, 32, 2048, 16)
    assert graphs.name == "torch, decode graphs" and graphs.padding_blocks == 1
    assert graphs.graphs.sizes == [1, 2, 4, 8, 16, 32] and graphs.graphs.block_tables.shape == (32, 128)


def test_merge_partials_docstring_example():
    m = torch.tensor([0.0, torch.log(torch.tensor(3.0))])
    out = merge_partials(m, torch.tensor([1.0, 1.0]), torch.tensor([[1.0], [5.0]]))
    assert torch.allclose(out, torch.tensor([4.0]))


def test_more_splits_than_blocks():
    """Splits that get no block contribute nothing (m = -inf, l = 0)."""
    args = make_case(16, 4, 2, [5, 20], [1, 1])
    assert (split_kv_attention(*args, num_splits=4) - dense_reference(*args)).abs().max().item() < 2e-5


@pytest.mark.parametrize("launch", ["interpreter's", "GPU decode default", "16 x 32, no prefetch"])
@pytest.mark.parametrize("num_splits", [1, 4, 16])
@pytest.mark.parametrize("block_size, n_heads, n_kv, context_lens, q_lens", TRITON_CASES)
def test_triton_kernel_matches_dense(block_size, n_heads, n_kv, context_lens, q_lens, num_splits, launch):
    """The interpreted kernel, on CPU tensors: on any machine, one with a GPU included. In the launch the
    interpreter gets by default (one key tile holds a whole history here), in the compiled kernel's
    decode default (16 rows x 16 positions, the next tile prefetched: the online softmax rescales across
    key tiles) and in its launch before the prefetch (16 x 32). With 16 splits most splits of the short
    histories get no key: they write m = -inf and exit, and the merge must skip them."""
    l4, _ = triton_kernels()
    args = make_case(block_size, n_heads, n_kv, context_lens, q_lens)
    config = {
        "interpreter's": None,
        "GPU decode default": l4.LaunchConfig(),
        "16 x 32, no prefetch": l4.LaunchConfig(tile_n=32, num_stages=2, prefetch=False, precision="ieee"),
    }[launch]
    got = l4.triton_paged_attention(*args, num_splits=num_splits, config=config)
    assert got.device.type == "cpu"
    assert (got - dense_reference(*args)).abs().max().item() < 2e-5


@pytest.mark.parametrize("launch", ["interpreter's", "small tiles"])
@pytest.mark.parametrize("block_size, n_heads, n_kv, context_lens, q_lens", QUERY_TILE_CASES)
def test_query_tiles_match_dense(block_size, n_heads, n_kv, context_lens, q_lens, launch):
    """Prefill through query tiles: prompts of 1 to 2,048 rows, GQA 1:1 to 4:1 and 32:1, chunks after a
    history, against dense attention. In the interpreter's launch (few large tiles) and in small tiles:
    the compiled kernel's 16 x 32 (5 tokens a tile with G = 3, a history of many key tiles), or 128 x 128
    for the 2,048-row prompt (16 x 32 would take the interpreter a minute there)."""
    l4, _ = triton_kernels()
    args = make_case(block_size, n_heads, n_kv, context_lens, q_lens)
    small = l4.LaunchConfig(128, 128) if max(q_lens) > 1000 else l4.LaunchConfig(max(16, n_heads // n_kv))
    got = l4.triton_paged_attention(*args, config=small if launch == "small tiles" else None)
    assert (got - dense_reference(*args)).abs().max().item() < 2e-5


def test_each_output_row_is_written_once_by_its_own_tile(monkeypatch):
    """The query tiles' contract, read from the stores the interpreted kernel makes: every (token, head)
    of the output is written exactly once, by a program whose tile belongs to the token's sequence and
    whose KV head is the head's. Dense attention alone does not see a tile that runs past its
    sequence's last token into the next sequence: the interpreter runs programs in order, so the next
    sequence's own tile overwrites what the stray one wrote (a GPU runs them in any order). Past the
    last sequence such a tile would write outside the output, so the stores are recorded, not made."""
    from triton.runtime import interpreter

    l4, _ = triton_kernels()
    args = make_case(7, 9, 3, [12, 30, 1, 9], [12, 7, 1, 9])  # prompts ending mid-tile, a decode token
    q, cu_q_lens = args[0], args[5].tolist()
    block_q = 16 // 3  # LaunchConfig()'s 16 rows: 5 tokens x 3 heads a tile
    stores = []  # (program, flat float indices it stored to)
    builder = interpreter.interpreter_builder

    def record(ptrs, value, mask, cache_modifier, eviction_policy):
        stores.append((builder.grid_idx, ptrs.data[np.broadcast_to(mask.data, ptrs.data.shape)]))

    monkeypatch.setattr(builder, "create_masked_store", record)
    out = l4.triton_paged_attention(*args, config=l4.LaunchConfig())
    n_tok, n_heads, d = q.shape
    first_tile = [cu_q_lens[s] // block_q + s for s in range(len(cu_q_lens) - 1)]  # sequence s's first
    written = np.zeros(n_tok * n_heads * d, dtype=int)
    for (tile, kv_head, _), addresses in stores:
        seq = max(s for s, first in enumerate(first_tile) if first <= tile)
        index = (addresses.astype(np.int64) - out.data_ptr()) // 4
        assert ((index >= 0) & (index < written.size)).all(), f"program {tile} stores outside the output"
        token, head = index // (n_heads * d), index // d % n_heads
        assert ((cu_q_lens[seq] <= token) & (token < cu_q_lens[seq + 1])).all(), (
            tile,
            seq,
            sorted(set(token)),
        )
        assert (head // 3 == kv_head).all()
        np.add.at(written, index, 1)
    assert (written == 1).all(), f"{(written == 0).sum()} floats never written, {(written > 1).sum()} twice"


def test_triton_rejects_bad_split_count():
    pytest.importorskip(
        "triton", reason="triton is installed on Linux only; the Triton kernel is not tested here"
    )
    from L4_paged_kernel.fast.triton_paged_attention import triton_paged_attention

    with pytest.raises(ValueError, match="num_splits must be a power of two >= 1 or 'auto', got 3"):
        triton_paged_attention(*make_case(16, 4, 2, [5], [1]), num_splits=3)


@pytest.mark.parametrize("precision", ["ieee", "tf32x3"])
@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(
    "block_size, n_heads, n_kv, context_lens, q_lens",
    [(7, 9, 3, [1, 40, 10], [1, 1, 4]), (16, 8, 2, [1, 70, 23, 33], [1, 1, 1, 1])],
    ids=["GQA 3, block 7, a chunk", "GQA 4, block 16, decode"],
)
def test_every_kernel_variant_matches_dense(
    block_size, n_heads, n_kv, context_lens, q_lens, head_dim, num_splits, prefetch, precision
):
    """Each option of a launch, at the model's head dims (SmolLM2's 64, an 8B model's 128), over ragged
    histories of several 16-position key tiles: the prefetching loop and the one that loads each tile
    where it computes it, both dot precisions (the interpreter computes in fp32 whatever the precision:
    a GPU's run, ``python -m kvcourse.tools.gpu_check``, checks 3xTF32 itself), one split and four."""
    l4, _ = triton_kernels()
    args = make_case(block_size, n_heads, n_kv, context_lens, q_lens, head_dim=head_dim)
    config = l4.LaunchConfig(prefetch=prefetch, precision=precision, num_stages=1 if prefetch else 2)
    got = l4.triton_paged_attention(*args, num_splits=num_splits, config=config)
    assert (got - dense_reference(*args)).abs().max().item() < 2e-5


@pytest.mark.parametrize(
    "config, num_splits",
    [((16, 16, 4, 2), 2), ((32, 64, 8, 3, False, "ieee"), 1), ((16, 32, 4, 2), "auto")],
    ids=["tile 16, 2 splits", "32 rows, tile 64", "tile 32, auto splits"],
)
def test_every_launch_shape_matches_dense(config, num_splits):
    """The launch shapes the kernel bench sweeps compute the same attention: tiles smaller and larger
    than a 7-position block, 32 query rows (a prompt chunk and a decode token in one chunk), and the
    split count chosen by shape."""
    l4, _ = triton_kernels()
    args = make_case(7, 9, 3, [1, 40, 10], [1, 1, 4])
    got = l4.triton_paged_attention(*args, num_splits=num_splits, config=l4.LaunchConfig(*config))
    assert (got - dense_reference(*args)).abs().max().item() < 2e-5


def test_choose_launch_examples():
    """The docstring's examples: compiled, a decode batch gets 16 x 16 with the prefetch and 3xTF32 dots,
    a batch with prompt tokens 16 x 32 with 8 warps and Triton's pipeline; in the interpreter, rows for
    the most tokens one sequence can bring and positions for the longest history, no prefetch."""
    l4, _ = triton_kernels()
    decode = l4.LaunchConfig(16, 16, 4, 1, prefetch=True, precision="tf32x3")
    prompts = l4.LaunchConfig(16, 32, 8, 2, prefetch=False, precision="tf32x3")
    assert l4.choose_launch(8, 8, 3, 304, interpreted=False) == decode == l4.LaunchConfig()
    for shapes in [(300, 1, 3, 320), (40, 2, 3, 48)]:
        assert l4.choose_launch(*shapes, interpreted=False) == prompts
    interpreted = functools.partial(l4.LaunchConfig, prefetch=False)
    assert l4.choose_launch(8, 8, 3, 304, interpreted=True) == interpreted(16, 512)  # decode
    assert l4.choose_launch(300, 1, 3, 320, interpreted=True) == interpreted(512, 512)  # 170 tokens
    assert l4.choose_launch(40, 2, 3, 48, interpreted=True) == interpreted(128, 64)
    assert l4.choose_launch(4, 4, 32, 48, interpreted=False) == l4.LaunchConfig(32)  # 32 heads a token


def test_choose_splits_examples():
    """The docstring's examples, on an H100's 132 multiprocessors: about one wave of resident programs,
    at least 4 tiles a split, at most ``MAX_SPLITS``."""
    l4, _ = triton_kernels()
    assert l4.choose_splits(256 * 3, 4096, 16, 132) == 1  # the grid fills the wave already
    assert l4.choose_splits(400 * 3, 2048, 32, 132) == 1  # a 2,000-token prompt's query tiles fill it too
    assert l4.choose_splits(32 * 3, 4096, 16, 132) == 4  # 528 / 96 = 5.5 fit
    assert l4.choose_splits(32 * 3, 128, 16, 132) == 2  # 8 tiles: 2 splits of 4
    assert l4.choose_splits(32 * 3, 32, 16, 132) == 1  # 2 tiles: splitting them buys nothing
    assert l4.choose_splits(8 * 8, 32768, 16, 132, resident=2) == 4  # 8 x 32,768 at 32/8 heads of 128
    assert l4.choose_splits(1, 32768, 16, 132) == l4.MAX_SPLITS == 16  # one sequence: capped


def test_bad_launch_shapes_and_pools_are_refused():
    l4, _ = triton_kernels()
    with pytest.raises(ValueError, match="tile_n must be a power of two >= 16 .*, got 8"):
        l4.LaunchConfig(tile_n=8)
    with pytest.raises(ValueError, match="block_m must be a power of two >= 16 .*, got 24"):
        l4.LaunchConfig(block_m=24)
    with pytest.raises(ValueError, match="num_warps must be a power of two >= 1, got 3"):
        l4.LaunchConfig(num_warps=3)
    with pytest.raises(ValueError, match="block_m must hold one token's 32 query heads, got 16"):
        l4.triton_paged_attention(*make_case(16, 32, 1, [5], [1]), config=l4.LaunchConfig(16))
    q, k_pool, v_pool, *meta = make_case(16, 4, 2, [5], [1])
    huge = torch.zeros(1, 1, 1, 1).expand(2**27, 16, 1, 1)  # 2**31 floats, none stored
    with pytest.raises(ValueError, match="at most 2\\*\\*31 - 1 floats per layer, got 2147483648"):
        l4.triton_paged_attention(q[:, :1], huge, huge, *meta)


def triton_kernels():
    """The Triton module of L4 and L5 (byte-identical copies), or a skip naming what is missing."""
    pytest.importorskip(
        "triton", reason="triton is installed on Linux only; the Triton kernel is not tested here"
    )
    from L4_paged_kernel.fast import triton_paged_attention as l4
    from L5_clones.fast import triton_paged_attention as l5

    return l4, l5


def test_compiled_and_interpreted_triton_kernels_live_side_by_side(monkeypatch):
    """Each kernel is jit'd twice in one process, whatever TRITON_INTERPRET says around it: a compiled
    one for GPU tensors, an interpreted one for CPU tensors. Nothing looks for a GPU to decide."""
    import triton
    from triton.runtime.interpreter import InterpretedFunction

    for module in triton_kernels():
        for interpret, kernels in module.KERNELS.items():
            kind = InterpretedFunction if interpret else triton.runtime.JITFunction
            assert all(type(k) is kind for k in kernels), (module.__name__, interpret, kernels)
        assert type(module._maximum) is triton.runtime.JITFunction  # called from both
        assert module._maximum is triton.language.standard._elementwise_max  # the interpreter's NumPy path
    l4, _ = triton_kernels()
    for outside in ("1", "0", None):  # jit() puts the variable back as it found it
        if outside is None:
            monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        else:
            monkeypatch.setenv("TRITON_INTERPRET", outside)
        assert type(l4.jit(l4._add.fn, interpret=True)) is InterpretedFunction
        assert type(l4.jit(l4._add.fn, interpret=False)) is triton.runtime.JITFunction
        assert os.environ.get("TRITON_INTERPRET") == outside


def test_the_triton_kernel_runs_whoever_imported_triton_first():
    """HF's modeling code imports triton. In a fresh process where transformers (and triton, for
    compiling: TRITON_INTERPRET unset) are imported before any course module, the interpreted kernel
    still runs on CPU tensors and matches dense attention."""
    triton_kernels()
    code = (
        "import transformers.models.llama.modeling_llama, triton\n"
        "from kvcourse.harness.kernel_cases import make_case, dense_reference\n"
        "from L4_paged_kernel.fast.triton_paged_attention import triton_paged_attention\n"
        "args = make_case(7, 9, 3, [1, 14, 10], [1, 1, 4])\n"
        "print((triton_paged_attention(*args, num_splits=2) - dense_reference(*args)).abs().max().item())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": str(REPO_ROOT)}
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert float(run.stdout.strip().splitlines()[-1]) < 2e-5


def test_the_kernels_build_and_run_where_triton_was_imported_to_interpret():
    """The other way round: a process that imports Triton with ``TRITON_INTERPRET=1`` (Triton's own
    ``tl.max`` and its combine functions are then interpreted ones). The interpreted kernel matches
    dense attention, and the compiled twin still builds for an H100: its combine functions are
    compiled twins of Triton's (``compiled``)."""
    l4, _ = triton_kernels()
    pytest.importorskip("triton.backends.nvidia", reason="this triton has no NVIDIA backend")
    code = (
        "import triton\n"
        "from kvcourse.harness.kernel_cases import make_case, dense_reference\n"
        "from L4_paged_kernel.fast import triton_paged_attention as l4\n"
        "from tests.test_l4_kernels import build_for_nvidia\n"
        "args = make_case(7, 9, 3, [1, 14, 10], [1, 1, 4])\n"
        "print(all(build_for_nvidia(l4, 90, 16, 16)))\n"
        "print((l4.triton_paged_attention(*args, num_splits=2) - dense_reference(*args)).abs().max().item())\n"
    )
    env = os.environ | {
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{REPO_ROOT / 'tests'}",
    }
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    built, error = run.stdout.strip().splitlines()[-2:]
    assert built == "True" and float(error) < 2e-5


@pytest.mark.parametrize("prefetch, precision", [(True, "tf32x3"), (False, "ieee")])
@pytest.mark.parametrize("block_m, tile_n", [(16, 16), (16, 32), (64, 64)])
@pytest.mark.parametrize("capability", [80, 90])  # A100, H100
def test_the_compiled_triton_kernel_builds_for_nvidia_gpus(capability, block_m, tile_n, prefetch, precision):
    """Triton's compiler takes the GPU twin of the kernel down to a GPU binary here, with no GPU: the
    source, its search for a tile's sequence, its prefetching loop and the plain one, its 3xTF32 and
    IEEE dots and its reductions all compile, in the decode default, a larger key tile and a
    prefill's larger query tile. Running it needs a GPU (the cuda tests)."""
    l4, _ = triton_kernels()
    pytest.importorskip("triton.backends.nvidia", reason="this triton has no NVIDIA backend")
    built = build_for_nvidia(l4, capability, block_m, tile_n, prefetch, precision)
    for kernel, binary in zip(l4.KERNELS[False], built, strict=True):
        assert binary.asm["cubin"], f"{kernel.fn.__name__}: no GPU binary"
        assert f"sm_{capability}" in binary.asm["ptx"]


def build_for_nvidia(
    module, capability: int, block_m: int, tile_n: int, prefetch: bool = True, precision: str = "tf32x3"
) -> list:
    """The compiled attention and merge kernels of ``module``, built for ``sm_<capability>`` with SmolLM2's
    heads (9/3 x 64) and 4 splits: Triton's compiled binaries, made without a GPU."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    pointers = ["q_ptr", "k_ptr", "v_ptr", "out_ptr", "m_ptr", "l_ptr", "acc_ptr"]
    ints = ["block_tables_ptr", "context_lens_ptr", "cu_q_lens_ptr"]
    scalars = ["num_seqs", "stride_qt", "stride_qh", "stride_kb", "stride_ks", "stride_kh", "stride_bt",
               "stride_ms", "stride_mt", "stride_as", "stride_at", "stride_ah", "stride_ot", "stride_oh"]  # fmt: skip
    constexprs = {"G": 3, "BLOCK_SIZE": 16, "HEAD_DIM": 64, "NUM_SPLITS": 4, "BLOCK_Q": block_m // 3,
                  "BLOCK_M": block_m, "TILE_N": tile_n, "BLOCK_D": 64, "PREFETCH": prefetch,
                  "PRECISION": precision}  # fmt: skip
    types = {name: "*fp32" for name in pointers} | {name: "*i32" for name in ints} | {"scale": "fp32"}
    types |= {name: "i32" for name in scalars} | dict.fromkeys(constexprs, "constexpr")
    merge_constexprs = {"NUM_SPLITS": 4, "HEAD_DIM": 64, "BLOCK_D": 64}
    binaries = []
    for kernel, constants in zip(module.KERNELS[False], (constexprs, merge_constexprs), strict=True):
        source = ASTSource(kernel, signature={n: types[n] for n in kernel.arg_names}, constexprs=constants)
        target = GPUTarget("cuda", capability, 32)
        binaries.append(triton.compile(source, target=target, options={"enable_fp_fusion": False}))
    return binaries


def gpu():
    """The CUDA device, resolved as every course process resolves it (TF32 off: dense attention in fp32)."""
    return resolve_device("cuda")


@pytest.mark.cuda
@pytest.mark.parametrize(
    "config",
    [(16, 16, 4, 1, True, "tf32x3"), (16, 16, 4, 1, True, "ieee"), (16, 32, 4, 2, False, "ieee"),
     (16, 16, 2, 1, False, "tf32x3"), (32, 64, 8, 3, False, "ieee"), (128, 64, 8, 2, False, "tf32x3")],
    ids=str,
)  # fmt: skip
@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("num_splits", [1, 4, "auto"])
@pytest.mark.parametrize("block_size, n_heads, n_kv, context_lens, q_lens", list(cases()) + QUERY_TILE_CASES)
def test_triton_kernel_on_a_gpu_matches_dense(
    block_size, n_heads, n_kv, context_lens, q_lens, num_splits, head_dim, config
):
    """The compiled kernel of L4 and of L5 on CUDA tensors against dense attention on the same GPU, in the
    decode default (prefetch, 3xTF32) and with IEEE dots, the launch before the prefetch and three the
    kernel bench sweeps, on decode batches and on query tiles."""
    if n_heads // n_kv > config[0]:
        pytest.skip(f"{config[0]} rows cannot hold one token's {n_heads // n_kv} query heads")
    args = make_case(block_size, n_heads, n_kv, context_lens, q_lens, head_dim=head_dim, device=gpu())
    expected = dense_reference(*args)
    for module in triton_kernels():
        got = module.triton_paged_attention(*args, num_splits=num_splits, config=module.LaunchConfig(*config))
        assert got.device.type == "cuda"
        assert (got - expected).abs().max().item() < 2e-5, module.__name__


@pytest.mark.cuda
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("block_size, n_heads, n_kv, context_lens, q_lens", list(cases()))
def test_torch_kernel_on_a_gpu_matches_dense(block_size, n_heads, n_kv, context_lens, q_lens, num_splits):
    """The reference with one split, its split-KV extension with 4."""
    args = make_case(block_size, n_heads, n_kv, context_lens, q_lens, device=gpu())
    got = paged_attention(*args) if num_splits == 1 else split_kv_attention(*args, num_splits=num_splits)
    assert got.device.type == "cuda"
    assert (got - dense_reference(*args)).abs().max().item() < 2e-5


def test_a_kernel_refuses_tensors_on_two_devices():
    """The C++ kernel reads host memory and the Triton kernel follows its inputs: tensors on another
    device, or on two devices, are refused with the devices named (a meta tensor stands in for a GPU's)."""
    args = list(make_case(16, 4, 2, [5], [1]))
    args[1] = args[1].to("meta")
    with pytest.raises(
        ValueError, match=r"the C\+\+ kernel runs on the CPU only; its tensors are on cpu, meta"
    ):
        cpp_paged_attention(*args)
    l4, _ = triton_kernels()
    with pytest.raises(ValueError, match="the Triton kernel's tensors must be on one device, got cpu, meta"):
        l4.triton_paged_attention(*args)


def test_an_edited_kernel_gets_a_new_build_name(tmp_path):
    """The build's name follows the file's text: byte-identical copies share one build, and an edit
    made in the same process changes the name (the hash is kept per version of the file, not per
    path), so the next load builds the edited kernel instead of running the old one."""
    source = tmp_path / "paged_attention.cpp"
    source.write_bytes(SOURCE.read_bytes())
    first = build_name(source)
    assert first == build_name(SOURCE)
    source.write_bytes(SOURCE.read_bytes() + b"// edited\n")
    assert build_name(source) != first


def test_a_kernel_no_compiler_can_build_is_a_reason_not_a_crash(tmp_path, monkeypatch):
    """No working compiler (CXX names a missing program): the build is tried once and its problem is
    one line naming what failed, which loading, build_all (make setup) and the engine all report."""
    source = tmp_path / "L9_copy" / "fast" / "paged_attention.cpp"
    source.parent.mkdir(parents=True)
    source.write_bytes(SOURCE.read_bytes())
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    monkeypatch.setenv("KVCOURSE_CACHE", str(tmp_path / "cache"))
    problem = build_problem(source)
    assert problem.startswith("paged_attention.cpp could not be built here (") and "no-such-c++" in problem
    assert problem.endswith(
        "kernel='cpp' needs a C++ compiler with OpenMP, such as g++, and kernel='torch' needs none"
    )
    with pytest.raises(CppKernelUnavailable) as raised:
        load_cpp_kernel(source)
    assert str(raised.value) == problem
    assert build_all(tmp_path) == [(source, False, None, problem)]


def test_make_setup_reports_a_kernel_it_cannot_build_and_carries_on(model_dir, tmp_path):
    """``make setup``'s last step, ``python -m kvcourse prepare``, on a machine with no working
    compiler: one NOT BUILT line per stage kernel, naming the compiler's complaint, and exit status 0.
    (A fresh kernel cache; the prepared model is linked into it, so nothing is converted again.)"""
    cache = tmp_path / "cache"
    (cache / "models").mkdir(parents=True)
    (cache / "models" / model_dir.name).symlink_to(model_dir)
    env = os.environ | {"KVCOURSE_CACHE": str(cache), "CXX": str(tmp_path / "no-such-c++")}
    run = subprocess.run(
        [sys.executable, "-m", "kvcourse", "prepare"], env=env, cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    kernels = sorted(REPO_ROOT.glob("L[0-9]_*/fast/*.cpp"))
    lines = [x for x in run.stdout.splitlines() if "NOT BUILT" in x]
    assert [x.split(":")[0] for x in lines] == [str(k.relative_to(REPO_ROOT)) for k in kernels]
    assert all("no-such-c++" in x and "the course runs without it" in x.lower() for x in lines), lines


def test_the_engine_refuses_the_cpp_kernel_when_it_is_unavailable(tiny_llama_dir, monkeypatch):
    def unavailable(source):
        raise CppKernelUnavailable(f"{source.name} could not be built here (test)")

    monkeypatch.setattr(l4_fast, "load_cpp_kernel", unavailable)
    with pytest.raises(CppKernelUnavailable, match=r"paged_attention\.cpp could not be built here \(test\)"):
        Engine(tiny_llama_dir, kernel="cpp")
    Engine(tiny_llama_dir, kernel="torch")  # the PyTorch kernel needs no compiler


def test_a_smoke_skips_the_cpp_run_and_says_why(tiny_qwen3_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(smoke_module("L4"), "build_problem", lambda source: "no compiler here (test)")
    prompts = tmp_path / "one.jsonl"
    prompts.write_text('{"text": "The KV cache"}\n', encoding="utf-8")
    argv = ["--model", str(tiny_qwen3_dir), "--prompts", str(prompts), "--max-new-tokens", "3"]
    assert run_smoke_in_process("L4", argv) == 0
    out = capsys.readouterr().out
    assert "-- L4 C++ kernel, chunked prefill 8: SKIPPED, no compiler here (test)\n" in out
    last = out.strip().splitlines()[-1]
    assert last.startswith("L4 smoke: 4/4 prompts match L3 and HF"), last  # 5 runs, the C++ one skipped
    assert last.endswith("; 1 run(s) skipped on this machine, said above)"), last
