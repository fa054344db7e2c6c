"""Small random checkpoints, built locally from a config and a seed: no download.

``make_tiny_checkpoint("qwen3", dir)`` writes an ordinary HF directory (config, safetensors, and the
default model's tokenizer so chat prompts work) that every smoke script and test can run like any
other model. Qwen3 exercises the per-head q/k norms; the tiny Llama exercises untied embeddings.

The weights are drawn with a larger spread than HF's default init (std 0.02 gives a near-uniform
next-token distribution, so almost every step would be a numerical tie); with std 0.5 the top-2 logit
gaps are large and exact comparisons are meaningful.
"""

from __future__ import annotations

import shutil
from pathlib import Path

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)


def make_tiny_checkpoint(arch: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Write a seeded random 2-layer ``arch`` ("qwen3" or "llama") checkpoint to ``out_dir``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM
    from transformers.utils import logging

    from kvcourse.model_store import default_model_dir

    common = dict(
        vocab_size=49152,  # the default model's tokenizer, so the same prompt files work
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        initializer_range=0.5,
    )
    if arch == "qwen3":
        config, cls = Qwen3Config(tie_word_embeddings=False, **common), Qwen3ForCausalLM
    elif arch == "llama":
        config, cls = LlamaConfig(tie_word_embeddings=False, **common), LlamaForCausalLM
    else:
        raise ValueError(f"arch must be 'qwen3' or 'llama', got {arch!r}")
    logging.disable_progress_bar()
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    src = default_model_dir()
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, out_dir / name)
    return out_dir
