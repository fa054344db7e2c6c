"""L1 engine: prefill the prompt into a contiguous KV cache, then decode one token per step.

    prefill:  all prompt tokens in one forward  -> K/V of positions 0..P-1 cached, logits of the last
    decode:   the newest token alone             -> K/V of position t cached, attends over 0..t

Requests run one after another, each reusing the same preallocated cache (there is no need to clear
it: a request only ever reads positions it wrote itself).

Left out on purpose: batching several requests (L3), paging the cache (L2), sampling (greedy only; L5
adds sampling).
"""

from __future__ import annotations

import functools

import torch

from kvcourse.model import Transformer
from kvcourse.model_store import resolve_model_dir
from kvcourse.requests import check_requests, finished
from kvcourse.stats import KvUsage

from .attention import attention
from .cache import KvCache


class Engine:
    def __init__(self, model_dir=None, max_seq_len: int | None = None):
        self.model_dir = resolve_model_dir(model_dir)
        self.model = Transformer.from_dir(self.model_dir)
        cfg = self.model.cfg
        if max_seq_len is None:
            max_seq_len = min(2048, cfg.max_position_embeddings)
        if max_seq_len > cfg.max_position_embeddings:
            raise ValueError(
                f"max_seq_len={max_seq_len} exceeds the model's max_position_embeddings="
                f"{cfg.max_position_embeddings}"
            )
        self.cache = KvCache(cfg.num_layers, max_seq_len, cfg.num_kv_heads, cfg.head_dim)
        self.usage = KvUsage(self.cache.nbytes, 0)  # peak of the last generate() call

    def prefill(self, prompt: list[int]) -> torch.Tensor:
        """Run the whole prompt, caching positions 0..P-1. Returns the last token's logits (vocab,)."""
        n = len(prompt)
        attend = functools.partial(attention, self.cache, 0)
        logits = self.model.forward(
            torch.tensor(prompt), torch.arange(n), attend, logits_at=torch.tensor([n - 1])
        )
        return logits[0]

    def decode_step(self, token: int, pos: int) -> torch.Tensor:
        """Run one token at position ``pos`` (0..pos-1 already cached). Returns its logits (vocab,)."""
        attend = functools.partial(attention, self.cache, pos)
        return self.model.forward(torch.tensor([token]), torch.tensor([pos]), attend)[0]

    def generate(
        self, prompts: list[list[int]], max_new_tokens: int | list[int], *, ignore_eos: bool = False
    ) -> list[list[int]]:
        """Greedy generation for each prompt in turn; returns the new tokens of each (eos included)."""
        budgets = check_requests(prompts, max_new_tokens, self.model.cfg.vocab_size)
        for i, (prompt, budget) in enumerate(zip(prompts, budgets)):
            if len(prompt) + budget > self.cache.max_seq_len:
                raise ValueError(
                    f"prompt {i}: {len(prompt)} prompt tokens + max_new_tokens {budget} = "
                    f"{len(prompt) + budget} exceeds max_seq_len={self.cache.max_seq_len}"
                )
        eos = self.model.cfg.eos_token_ids
        outputs, peak = [], 0
        for prompt, budget in zip(prompts, budgets):
            token = int(self.prefill(prompt).argmax())
            out = [token]
            pos = len(prompt)  # KV of 0..pos-1 is cached; `token` is not yet
            while not finished(token, len(out), budget, eos, ignore_eos):
                token = int(self.decode_step(token, pos).argmax())
                out.append(token)
                pos += 1
            outputs.append(out)
            peak = max(peak, pos)
        self.usage = KvUsage(self.cache.nbytes, peak * self.model.cfg.kv_bytes_per_token())
        return outputs
