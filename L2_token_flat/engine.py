"""L2 engine: L1's prefill/decode loop, with K/V kept in a paged pool instead of a contiguous cache.

    prefill:  reserve blocks for the prompt, write its K/V to their slots, read them back by slot
    decode:   reserve (a new block only every block_size tokens), write one slot, read 0..t by slot

Requests still run one after another. A request owns blocks only while it runs and gives them back to
the free list when it finishes, so the next request reuses them.

Left out on purpose: running several requests at once (L3; with one request at a time the default
pool is just L1's cache cut into blocks, so memory use does not change yet), sampling (greedy only).
"""

from __future__ import annotations

import functools

import torch

from kvcourse.model import Transformer
from kvcourse.model_store import resolve_model_dir
from kvcourse.requests import check_requests, finished
from kvcourse.stats import KvUsage

from .attention import attention
from .cache import BlockAllocator, ForwardMeta, KvPool, Request, blocks_needed, reserve


class Engine:
    def __init__(
        self,
        model_dir=None,
        block_size: int = 16,
        num_blocks: int | None = None,
        max_seq_len: int | None = None,
    ):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.model_dir = resolve_model_dir(model_dir)
        self.model = Transformer.from_dir(self.model_dir)
        cfg = self.model.cfg
        self.max_seq_len = min(2048, cfg.max_position_embeddings) if max_seq_len is None else max_seq_len
        if self.max_seq_len < 1:
            raise ValueError(f"max_seq_len must be >= 1, got {self.max_seq_len}")
        if self.max_seq_len > cfg.max_position_embeddings:
            raise ValueError(
                f"max_seq_len={self.max_seq_len} exceeds the model's max_position_embeddings="
                f"{cfg.max_position_embeddings}"
            )
        if num_blocks is None:  # room for one request of max_seq_len: the same bytes as L1's cache
            num_blocks = blocks_needed(self.max_seq_len, block_size)
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.pool = KvPool(cfg.num_layers, num_blocks * block_size, cfg.num_kv_heads, cfg.head_dim)
        self.usage = KvUsage(self.pool.nbytes, 0)  # peak of the last generate() call

    def prefill(self, req: Request) -> torch.Tensor:
        """Run the whole prompt, caching positions 0..P-1 in the request's blocks. Returns (vocab,)."""
        n = len(req.prompt_ids)
        reserve(req, self.allocator, n)
        slots = torch.tensor(req.slot_indices[:n])  # (P,) write set == read set
        meta = ForwardMeta(positions=torch.arange(n), slot_mapping=slots, kv_indices=slots, is_prefill=True)
        attend = functools.partial(attention, self.pool, meta)
        logits = self.model.forward(
            torch.tensor(req.prompt_ids), meta.positions, attend, logits_at=torch.tensor([n - 1])
        )
        req.cur_len = n
        return logits[0]

    def decode_step(self, req: Request, token: int) -> torch.Tensor:
        """Run ``token`` at position req.cur_len (0..cur_len-1 already cached). Returns (vocab,)."""
        pos = req.cur_len
        reserve(req, self.allocator, pos + 1)
        meta = ForwardMeta(
            positions=torch.tensor([pos]),
            slot_mapping=torch.tensor([req.slot_indices[pos]]),  # (1,)
            kv_indices=torch.tensor(req.slot_indices[: pos + 1]),  # (pos + 1,)
            is_prefill=False,
        )
        attend = functools.partial(attention, self.pool, meta)
        logits = self.model.forward(torch.tensor([token]), meta.positions, attend)[0]
        req.cur_len = pos + 1
        return logits

    def generate(
        self, prompts: list[list[int]], max_new_tokens: int | list[int], *, ignore_eos: bool = False
    ) -> list[list[int]]:
        """Greedy generation for each prompt in turn; returns the new tokens of each (eos included)."""
        budgets = check_requests(prompts, max_new_tokens, self.model.cfg.vocab_size)
        block_size, pool_blocks = self.allocator.block_size, self.allocator.num_blocks
        for i, (prompt, budget) in enumerate(zip(prompts, budgets)):
            total = len(prompt) + budget
            if total > self.max_seq_len:
                raise ValueError(
                    f"prompt {i}: {len(prompt)} prompt tokens + max_new_tokens {budget} = "
                    f"{total} exceeds max_seq_len={self.max_seq_len}"
                )
            if blocks_needed(total, block_size) > pool_blocks:
                raise ValueError(
                    f"prompt {i}: {total} tokens need {blocks_needed(total, block_size)} blocks of "
                    f"{block_size}, but the pool has only {pool_blocks} blocks"
                )
        eos = self.model.cfg.eos_token_ids
        outputs, peak = [], 0
        for prompt, budget in zip(prompts, budgets):
            req = Request(prompt)
            token = int(self.prefill(req).argmax())
            req.output_ids.append(token)
            while not finished(token, len(req.output_ids), budget, eos, ignore_eos):
                token = int(self.decode_step(req, token).argmax())
                req.output_ids.append(token)
            self.allocator.free(req.blocks)  # back to the free list: the next request reuses them
            outputs.append(req.output_ids)
            peak = max(peak, req.cur_len)
        self.usage = KvUsage(self.pool.nbytes, peak * self.model.cfg.kv_bytes_per_token())
        return outputs
