"""L1's attention step: write this step's K/V into the contiguous cache, then attend over the prefix.

The model (``kvcourse.model.Transformer``) computes q, k, v for the new tokens and calls this; what
happens to K and V is the whole lesson. During prefill the new tokens are the whole prompt
(start = 0); during decode there is one new token at position start = tokens already cached.
"""

from __future__ import annotations

import torch

from kvcourse.model import causal_attention

from .cache import KvCache


def attention(
    cache: KvCache, start: int, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:
    """q: (T, H, D), k/v: (T, H_kv, D) for positions start .. start + T - 1. Returns (T, H, D)."""
    cache.write(layer, start, k, v)
    k_all, v_all = cache.read(layer, start + q.shape[0])  # (S, H_kv, D), S = start + T
    return causal_attention(q, k_all, v_all, q_start=start)
