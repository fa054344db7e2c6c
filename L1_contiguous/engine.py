"""L1 engine: prefill the prompt into a contiguous KV cache, then decode one token per step.

    prefill:  all prompt tokens in one forward  -> K/V of positions 0..P-1 cached, logits of the last
    decode:   the newest token alone             -> K/V of position t cached, attends over 0..t

Requests run one after another, each reusing the same preallocated cache (there is no need to clear
it: a request only ever reads positions it wrote itself).

``device`` ("cpu", "cuda", ...) is where the weights and the cache live; every tensor the engine makes
is made there. A step's one trip back to the host is its greedy token, which the Python loop needs to
decide whether to stop and what to feed next.

Its one option (``OPTIONS``), ``max_model_len``, is checked in ``kvcourse.engine_config``, where the
later stages' options are too.

Left out on purpose: batching several requests (L3), paging the cache (L2), sampling (greedy only; L5
adds sampling).
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

from .attention import attention
from .cache import KvCache


class Engine:
    OPTIONS = ("max_model_len",)  # the shared options it takes (kvcourse.engine_config)

    def __init__(self, model_dir=None, device="cpu", **options):
        self.device = resolve_device(device)
        self.model_dir = resolve_model_dir(model_dir)
        self.model = Transformer.from_dir(self.model_dir, self.device)
        self.config = config = EngineConfig.build(self.model, options, self.OPTIONS)
        cfg = self.model.cfg
        self.max_model_len = config.max_model_len  # checked
        self.cache = KvCache(cfg.num_layers, self.max_model_len, cfg.num_kv_heads, cfg.head_dim, self.device)
        self.meter = UsageMeter()  # live vs held positions, step by step
        self.num_steps = self.num_tokens_run = 0

    def prefill(self, prompt: list[int]) -> torch.Tensor:
        """Run the whole prompt, caching positions 0..P-1. Returns the last token's logits (vocab,)."""
        n, device = len(prompt), self.device
        attend = functools.partial(attention, self.cache, 0)
        logits = self.model.forward(
            torch.tensor(prompt, device=device),  # (P,)
            torch.arange(n, device=device),  # (P,)
            attend,
            logits_at=torch.tensor([n - 1], device=device),
        )
        self._count(n, n)
        return logits[0]

    def decode_step(self, token: int, pos: int) -> torch.Tensor:
        """Run one token at position ``pos`` (0..pos-1 already cached). Returns its logits (vocab,)."""
        attend = functools.partial(attention, self.cache, pos)
        token_ids = torch.tensor([token], device=self.device)  # (1,)
        logits = self.model.forward(token_ids, torch.tensor([pos], device=self.device), attend)[0]
        self._count(1, pos + 1)
        return logits

    def _count(self, tokens: int, cached: int) -> None:
        """One forward call ran ``tokens`` tokens; ``cached`` positions now hold K/V of max_model_len."""
        self.num_steps += 1
        self.num_tokens_run += tokens
        self.meter.step(live=cached, held=self.max_model_len)

    def stats(self) -> EngineStats:
        """KV pool vs live and the step counters, since the engine was built (see kvcourse.stats)."""
        per_token = self.model.cfg.kv_bytes_per_token()
        return EngineStats(
            kv_bytes_pool=self.cache.nbytes,
            kv_bytes_live=self.meter.live_peak * per_token,
            kv_utilization=self.meter.utilization,
            steps=self.num_steps,
            tokens_run=self.num_tokens_run,
            device=str(self.device),
        )

    def generate(
        self, prompts: list[list[int]], max_new_tokens: int | list[int], *, ignore_eos: bool = False
    ) -> list[list[int]]:
        """Greedy generation for each prompt in turn; returns the new tokens of each (eos included)."""
        max_new_tokens = self.config.check_requests(prompts, max_new_tokens)
        eos = self.model.cfg.eos_token_ids
        outputs = []
        for prompt, max_new in zip(prompts, max_new_tokens, strict=True):
            token = int(self.prefill(prompt).argmax())  # the token back to the host: the loop needs it
            out = [token]
            pos = len(prompt)  # KV of 0..pos-1 is cached; `token` is not yet
            while not finished(token, len(out), max_new, eos, ignore_eos):
                token = int(self.decode_step(token, pos).argmax())
                out.append(token)
                pos += 1
            outputs.append(out)
        return outputs
