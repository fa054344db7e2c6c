"""The decode-graph fast path (``cuda_graphs=True``, ``kvcourse.decode_graphs``) of L4 and L5.

On the CPU the padded, static-buffer step runs eagerly, so these tests check everything but the CUDA
recording itself: the buckets, what padding rows are given, the padding block, recording again after
the pool grows, and the tokens against HF and the readable path. The tests marked ``cuda`` record and
replay real CUDA graphs where there is a GPU.
"""

from __future__ import annotations

import pytest
import torch

from kvcourse.decode_graphs import DecodeGraphs, buckets
from kvcourse.devices import resolve_device
from kvcourse.harness.reference import hf_greedy
from L4_paged_kernel.attention import ForwardMeta
from L4_paged_kernel.engine import Engine as L4Engine
from L5_clones.engine import Engine as L5Engine

ENGINES = {"L4": L4Engine, "L5": L5Engine}
PROMPTS = [[5, 17, 300, 42, 7], list(range(200, 237)), [9] * 20]  # decode batches of 3, then fewer
MAX_NEW = [24, 9, 16]


def test_buckets():
    assert buckets(32) == [1, 2, 4, 8, 16, 32]
    assert buckets(24) == [1, 2, 4, 8, 16, 24]
    assert buckets(1) == [1]
    assert DecodeGraphs(32, 4, 16, torch.device("cpu")).bucket(27) == 32


def test_padding_rows_live_in_the_padding_block():
    """A batch of 3 replays bucket 4: the real rows get the step's inputs, the padding row one token at
    position 0 of the padding block, and the engine gets the real rows' logits only."""
    graphs = DecodeGraphs(max_num_seqs=8, max_blocks=5, block_size=16, device=torch.device("cpu"))
    seen = []

    def forward(token_ids, meta):  # stands in for the model: logits row i = 100 * token id + slot
        seen.append((token_ids.clone(), meta))
        return (100 * token_ids + meta.slot_mapping).float()[:, None].repeat(1, 2)  # (rows, vocab=2)

    meta = ForwardMeta(
        positions=torch.tensor([20, 3, 40]),
        slot_mapping=torch.tensor([52, 19, 104]),  # block 3 row 4, block 1 row 3, block 6 row 8
        block_tables=torch.tensor([[2, 3], [1, -1], [4, 6]]),  # the batch's width: 2 blocks
        context_lens=torch.tensor([21, 4, 41]),
        cu_q_lens=torch.tensor([0, 1, 2, 3]),
        logits_at=torch.tensor([0, 1, 2]),
    )
    pool = torch.zeros(1)  # stands in for the pool tensor the graphs write to
    logits = graphs.run(forward, torch.tensor([7, 8, 9]), meta, pool=pool, padding_block=11)
    assert logits[:, 0].tolist() == [752.0, 819.0, 1004.0]  # 3 rows: the padding row's is not returned
    token_ids, static = seen[-1]
    assert token_ids.tolist() == [7, 8, 9, 0]
    assert static.positions.tolist() == [20, 3, 40, 0]
    assert static.slot_mapping.tolist() == [52, 19, 104, 11 * 16]  # the padding row writes block 11
    assert static.block_tables.tolist() == [[2, 3, -1, -1, -1], [1, -1, -1, -1, -1], [4, 6, -1, -1, -1],
                                            [11, -1, -1, -1, -1]]  # fmt: skip
    assert static.context_lens.tolist() == [21, 4, 41, 1]
    assert static.cu_q_lens.tolist() == [0, 1, 2, 3, 4] and static.logits_at.tolist() == [0, 1, 2, 3]
    # a batch of 1 later: bucket 1 is recorded, and row 0 of the wider buffers is overwritten
    graphs.run(forward, torch.tensor([5]), meta_of_one(), pool=pool, padding_block=11)
    assert sorted(graphs.graphs) == [1, 4]
    graphs.run(forward, torch.tensor([5]), meta_of_one(), pool=torch.zeros(1), padding_block=11)
    assert sorted(graphs.graphs) == [1]  # a new pool tensor: what was recorded on the old one is dropped


def meta_of_one() -> ForwardMeta:
    return ForwardMeta(
        positions=torch.tensor([2]),
        slot_mapping=torch.tensor([2]),
        block_tables=torch.tensor([[0]]),
        context_lens=torch.tensor([3]),
        cu_q_lens=torch.tensor([0, 1]),
        logits_at=torch.tensor([0]),
    )


@pytest.mark.parametrize("stage", ["L4", "L5"])
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"max_num_seqs": 3},
        {"block_size": 7, "num_blocks": 12},
    ],  # buckets 1, 2, 3; a tight pool: preemption
    ids=["default", "buckets of 3", "tight pool"],
)
def test_decode_graphs_equal_hf_and_the_readable_path(tiny_qwen3_dir, stage, options):
    expected = [r.tokens for r in hf_greedy(tiny_qwen3_dir, PROMPTS, MAX_NEW)]
    readable = ENGINES[stage](tiny_qwen3_dir, **options).generate(PROMPTS, MAX_NEW)
    engine = ENGINES[stage](tiny_qwen3_dir, cuda_graphs=True, **options)
    assert engine.generate(PROMPTS, MAX_NEW) == readable == expected
    assert engine.fast.graphs.num_replayed > 0 and set(engine.fast.graphs.graphs) <= set(
        engine.fast.graphs.sizes
    )
    assert (
        4 not in engine.fast.graphs.sizes or 4 in engine.fast.graphs.graphs
    )  # 3 sequences decode in bucket 4
    assert engine.pool.k.shape[1] == engine.allocator.num_blocks + 1  # the padding block, past the ids
    engine.allocator.check_invariants()
    assert engine.allocator.num_free == engine.allocator.num_blocks
    assert "decode graphs" in engine.stats().kernel


def test_a_grown_pool_is_recorded_again(tiny_llama_dir):
    """generate() grows a default-sized pool to fit its requests: a new tensor, so the graphs recorded on
    the old one are dropped and recorded again, and the tokens stay HF's."""
    engine = L4Engine(tiny_llama_dir, cuda_graphs=True, max_model_len=64)
    engine.generate(PROMPTS[:1], 4)
    first_pool, recorded = engine.fast.graphs.recorded_for, engine.fast.graphs.num_recorded
    many = [[i + 3, 40, 41, 42] * 8 for i in range(12)]  # 12 x 36 positions: more than the pool held
    expected = [r.tokens for r in hf_greedy(tiny_llama_dir, many, [4] * len(many))]
    assert engine.generate(many, 4) == expected
    assert engine.fast.graphs.recorded_for is engine.pool.k and engine.pool.k is not first_pool
    assert engine.fast.graphs.num_recorded > recorded


@pytest.mark.cuda
@pytest.mark.parametrize("stage", ["L4", "L5"])
def test_cuda_graphs_on_a_gpu_equal_hf(tiny_qwen3_dir, stage):
    """Real CUDA graphs, recorded and replayed, with the compiled Triton kernel."""
    gpu = resolve_device("cuda")
    expected = [r.tokens for r in hf_greedy(tiny_qwen3_dir, PROMPTS, MAX_NEW, device=gpu)]
    engine = ENGINES[stage](tiny_qwen3_dir, device=gpu, cuda_graphs=True)
    assert engine.generate(PROMPTS, MAX_NEW) == expected
    assert engine.fast.graphs.memory_pool is not None and engine.fast.graphs.num_replayed > 0


@pytest.mark.cuda
def test_cuda_graphs_on_a_gpu_need_the_triton_kernel(tiny_qwen3_dir):
    with pytest.raises(ValueError, match="cuda_graphs=True needs kernel='triton' on a GPU"):
        L4Engine(tiny_qwen3_dir, device="cuda", kernel="torch", cuda_graphs=True)


def test_decode_graphs_are_off_by_default_on_a_cpu(tiny_llama_dir):
    """``cuda_graphs=None``, the default, turns them on only for a GPU's Triton kernel: on a CPU a step is
    the readable one, with no padding block."""
    engine = L4Engine(tiny_llama_dir, kernel="torch", max_model_len=64)
    assert engine.fast.graphs is None and engine.fast.padding_blocks == 0
    assert "decode graphs" not in engine.stats().kernel


@pytest.mark.cuda
@pytest.mark.parametrize("stage", ["L4", "L5"])
def test_decode_graphs_are_on_by_default_on_a_gpu(tiny_qwen3_dir, stage):
    """On a GPU the default kernel is Triton's and decode steps replay graphs; the reference kernel,
    which reads lengths back to the host, runs without them."""
    gpu = resolve_device("cuda")
    expected = [r.tokens for r in hf_greedy(tiny_qwen3_dir, PROMPTS, MAX_NEW, device=gpu)]
    engine = ENGINES[stage](tiny_qwen3_dir, device=gpu)
    assert engine.stats().kernel.endswith("decode graphs")
    assert engine.generate(PROMPTS, MAX_NEW) == expected
    assert engine.fast.graphs.num_replayed > 0
    assert ENGINES[stage](tiny_qwen3_dir, device=gpu, kernel="torch").fast.graphs is None
