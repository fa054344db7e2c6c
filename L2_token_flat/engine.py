"""L2 engine: L1's prefill/decode loop, with K/V kept in a paged pool instead of a contiguous cache.

    prefill:  allocate blocks for the prompt, write its K/V to their slots, read them back by slot
    decode:   allocate_slots (a new block only every block_size tokens), write one slot, read 0..t by slot

Sequences still run one after another. A sequence owns blocks only while it runs and gives them back
to the free list when it finishes, so the next one reuses them.

``device`` ("cpu", "cuda", ...) is where the weights and the pool live; every tensor the engine makes
(slots, positions) is made there. A step's one trip back to the host is its greedy token, which the
Python loop needs to decide whether to stop and what to feed next.

Its options (``OPTIONS``) are checked, and the pool sized, once, in ``kvcourse.engine_config``: a pool
left to its default holds one ``max_model_len`` sequence, L1's bytes.

Left out on purpose: running several sequences at once (L3; with one at a time the default pool is
just L1's cache cut into blocks, so memory use does not change yet), sampling (greedy only).
"""

from __future__ import annotations

import functools

import torch

from kvcourse.devices import resolve_device
from kvcourse.engine_config import EngineConfig
from kvcourse.limits import finished
from kvcourse.model import Transformer
from kvcourse.model_store import resolve_model_dir
from kvcourse.stats import EngineStats, UsageMeter

from .allocator import BlockAllocator
from .attention import ForwardMeta, attention
from .cache import KvPool
from .sequence import Sequence, allocate_slots


class Engine:
    OPTIONS = ("max_model_len", "block_size", "num_blocks")  # the shared options it takes

    def __init__(self, model_dir=None, device="cpu", **options):
        self.device = resolve_device(device)
        self.model_dir = resolve_model_dir(model_dir)
        self.model = Transformer.from_dir(self.model_dir, self.device)
        self.config = config = EngineConfig.build(self.model, options, self.OPTIONS)
        cfg = self.model.cfg
        num_blocks, block_size = config.num_blocks, config.block_size  # checked; the pool sized
        self.allocator = BlockAllocator(num_blocks, block_size)
        num_slots = num_blocks * block_size
        self.pool = KvPool(cfg.num_layers, num_slots, cfg.num_kv_heads, cfg.head_dim, self.device)
        self.meter = UsageMeter()  # live vs held positions, step by step
        self.num_steps = self.num_tokens_run = 0

    def prefill(self, seq: Sequence) -> torch.Tensor:
        """Run the whole prompt, caching positions 0..P-1 in the sequence's blocks. Returns (vocab,)."""
        n, device = len(seq.prompt_ids), self.device
        allocate_slots(seq, self.allocator, n)
        slots = torch.tensor(seq.slot_indices[:n], device=device)  # (P,) write set == read set
        meta = ForwardMeta(
            positions=torch.arange(n, device=device), slot_mapping=slots, kv_indices=slots, is_prefill=True
        )
        attend = functools.partial(attention, self.pool, meta)
        logits = self.model.forward(
            torch.tensor(seq.prompt_ids, device=device),  # (P,)
            meta.positions,
            attend,
            logits_at=torch.tensor([n - 1], device=device),
        )
        seq.num_computed_tokens = n
        self._count(seq, n)
        return logits[0]

    def decode_step(self, seq: Sequence, token: int) -> torch.Tensor:
        """Run ``token`` at position seq.num_computed_tokens (all before it cached). Returns (vocab,)."""
        pos, device = seq.num_computed_tokens, self.device
        allocate_slots(seq, self.allocator, pos + 1)
        meta = ForwardMeta(
            positions=torch.tensor([pos], device=device),
            slot_mapping=torch.tensor([seq.slot_indices[pos]], device=device),  # (1,)
            kv_indices=torch.tensor(seq.slot_indices[: pos + 1], device=device),  # (pos + 1,)
            is_prefill=False,
        )
        attend = functools.partial(attention, self.pool, meta)
        token_ids = torch.tensor([token], device=device)  # (1,)
        logits = self.model.forward(token_ids, meta.positions, attend)[0]
        seq.num_computed_tokens = pos + 1
        self._count(seq, 1)
        return logits

    def _count(self, seq: Sequence, tokens: int) -> None:
        """One forward call ran ``tokens`` tokens of ``seq``, which holds its blocks."""
        self.num_steps += 1
        self.num_tokens_run += tokens
        held = len(seq.block_table)
        self.meter.step(seq.num_computed_tokens, held * self.allocator.block_size, held)

    def stats(self) -> EngineStats:
        """KV pool vs live, blocks held and the step counters, since the engine was built."""
        per_token = self.model.cfg.kv_bytes_per_token()
        return EngineStats(
            kv_bytes_pool=self.pool.nbytes,
            kv_bytes_live=self.meter.live_peak * per_token,
            kv_utilization=self.meter.utilization,
            block_size=self.allocator.block_size,
            num_blocks=self.allocator.num_blocks,
            blocks_held=self.meter.blocks_held_peak,
            steps=self.num_steps,
            tokens_run=self.num_tokens_run,
            device=str(self.device),
        )

    def generate(
        self, prompts: list[list[int]], max_new_tokens: int | list[int], *, ignore_eos: bool = False
    ) -> list[list[int]]:
        """Greedy generation for each prompt in turn; returns the new tokens of each (eos included)."""
        max_new_tokens = self.config.check_requests(prompts, max_new_tokens)  # and each fits the pool
        eos = self.model.cfg.eos_token_ids
        outputs = []
        for prompt, max_new in zip(prompts, max_new_tokens, strict=True):
            seq = Sequence(prompt)
            token = int(self.prefill(seq).argmax())  # the token back to the host: the loop needs it
            seq.output_ids.append(token)
            while not finished(token, len(seq.output_ids), max_new, eos, ignore_eos):
                token = int(self.decode_step(seq, token).argmax())
                seq.output_ids.append(token)
            self.allocator.free(seq.block_table)  # back to the free list: the next sequence reuses them
            outputs.append(seq.output_ids)
        return outputs
