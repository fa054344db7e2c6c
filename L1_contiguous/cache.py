"""L1's KV cache: one contiguous tensor per layer for K and for V, sized for the longest request.

Shape per layer: (max_model_len, H_kv, D). Token t of the request keeps its key at ``k[layer, t]``; the
cache is just a big preallocated array, written at increasing positions and read as a prefix.

Left out on purpose (and why later stages exist):
- it holds ONE request: two requests would need two caches, or a padded batch (L3 batches);
- it reserves ``max_model_len`` tokens up front even if the request stops after 10 (L2 pages it);
- nothing is shared between requests with the same prefix (L5).
"""

from __future__ import annotations

import torch


class KvCache:
    """Per-layer K and V, each (num_layers, max_model_len, H_kv, D), fp32, zeroed, on ``device``."""

    def __init__(self, num_layers: int, max_model_len: int, num_kv_heads: int, head_dim: int, device="cpu"):
        self.max_model_len = max_model_len
        shape = (num_layers, max_model_len, num_kv_heads, head_dim)  # (L, S_max, H_kv, D)
        self.k = torch.zeros(shape, device=device)  # (L, S_max, H_kv, D)
        self.v = torch.zeros_like(self.k)  # (L, S_max, H_kv, D)

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the K/V of T new tokens at positions start .. start + T - 1.

        Example: after a 5-token prefill (start=0) the next decode token writes at start=5.
        """
        end = start + k.shape[0]
        if end > self.max_model_len:
            raise ValueError(
                f"writing positions {start}..{end - 1} overflows max_model_len={self.max_model_len}"
            )
        self.k[layer, start:end] = k  # (T, H_kv, D)
        self.v[layer, start:end] = v

    def read(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions 0 .. length - 1, each (length, H_kv, D): a view, no copy."""
        return self.k[layer, :length], self.v[layer, :length]

    @property
    def nbytes(self) -> int:
        """Bytes of the cache, whether or not they hold tokens."""
        return self.k.nbytes + self.v.nbytes
