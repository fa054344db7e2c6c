"""The few numbers of a checkpoint's config.json that the from-scratch models need.

Supports the two architectures the course runs: Llama (SmolLM2 is one) and Qwen3 (Llama plus a per-head
RMSNorm on q and k before RoPE). Left out on purpose: RoPE scaling variants (llama3, yarn, ...), sliding
windows and biases other than the optional attention bias; a checkpoint that needs them is refused with
a clear error instead of being run subtly wrong.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SUPPORTED = ("llama", "qwen3")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    attention_bias: bool = False

    @property
    def qk_norm(self) -> bool:
        """Qwen3 normalizes each head of q and k (RMSNorm over head_dim) before RoPE."""
        return self.model_type == "qwen3"

    def kv_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        """Bytes one token's K and V take across all layers.

        SmolLM2-135M in fp32: 2 (K and V) * 3 heads * 64 dims * 30 layers * 4 bytes = 46,080 bytes.
        """
        return 2 * self.num_kv_heads * self.head_dim * self.num_layers * dtype_bytes

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        model_dir = Path(model_dir)
        raw = json.loads((model_dir / "config.json").read_text())
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED:
            raise ValueError(f"model_type {model_type!r} is not supported (supported: {SUPPORTED})")
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"rope_type {rope_type!r} is not supported (only 'default')")
        theta = rope.get("rope_theta", raw.get("rope_theta"))
        if theta is None:
            raise ValueError(f"{model_dir}/config.json has no rope_theta")
        if raw.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported")
        num_heads = raw["num_attention_heads"]
        return cls(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            rms_norm_eps=raw["rms_norm_eps"],
            rope_theta=float(theta),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            eos_token_ids=_eos_ids(model_dir, raw),
            attention_bias=bool(raw.get("attention_bias", False)),
        )


def _eos_ids(model_dir: Path, raw: dict) -> tuple[int, ...]:
    """The stop tokens, as HF ``generate`` sees them: generation_config.json first, then config.json."""
    gen_path = model_dir / "generation_config.json"
    eos = None
    if gen_path.exists():
        eos = json.loads(gen_path.read_text()).get("eos_token_id")
    if eos is None:
        eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)
