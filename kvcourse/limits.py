"""Checks and stopping rules every engine applies the same way (not lesson material); the engines of
L1-L4 reach them through their ``EngineConfig`` (``kvcourse/engine_config.py``).

``resolve_max_model_len`` picks an engine's length limit; ``check_requests`` validates what a caller
hands ``Engine.generate`` (prompts, max_new_tokens, the length limit); ``check_context`` what a script reads
from a prompt file (the model's context limit); ``check_blocks`` refuses a request a
pool could never hold (naming bytes needed and given when the pool was sized in bytes); ``blocks_for_bytes``
sizes ``kv_cache_bytes`` into blocks, and ``describe_sizing`` shows that arithmetic; ``finished`` is HF's
stopping rule: the eos token is kept in the output, then generation stops; otherwise stop at
max_new_tokens. Every message names the value and the limit.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcourse.config import ModelConfig

DEFAULT_MAX_MODEL_LEN = 2048


def resolve_max_model_len(max_model_len: int | None, cfg: ModelConfig) -> int:
    """The longest sequence (prompt + new tokens) an engine accepts.

    None means ``min(2048, cfg.max_position_embeddings)``. Example with max_position_embeddings 8192:
    ``None -> 2048``, ``512 -> 512``, ``0`` raises ``max_model_len must be in [1, 8192], got 0``.
    """
    limit = cfg.max_position_embeddings
    if max_model_len is None:
        return min(DEFAULT_MAX_MODEL_LEN, limit)
    if not isinstance(max_model_len, int) or not 1 <= max_model_len <= limit:
        raise ValueError(
            f"max_model_len must be in [1, {limit}] (the model's max_position_embeddings), got {max_model_len!r}"
        )
    return max_model_len


def check_requests(
    prompts: list[list[int]],
    max_new_tokens: int | list[int],
    vocab_size: int,
    max_model_len: int,
    label: str = "prompt {i}",
) -> list[int]:
    """Validate prompts and their max_new_tokens; return one max_new_tokens per prompt. ``label`` names
    request i in the errors (``"request"`` for one submitted alone).

    Example: ``check_requests([[1, 2], [3]], 8, 100, 64) -> [8, 8]``;
    ``check_requests([[]], 8, 100, 64)`` raises ``ValueError: prompt 0 is empty``;
    ``check_requests([[1] * 60], 8, 100, 64)`` raises
    ``prompt 0: 60 prompt tokens + max_new_tokens 8 = 68 exceeds max_model_len=64``.
    """
    max_new = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(max_new) != len(prompts):
        raise ValueError(f"got {len(max_new)} max_new_tokens values for {len(prompts)} prompts")
    for i, (ids, n) in enumerate(zip(prompts, max_new, strict=True)):
        name = label.format(i=i)
        if len(ids) == 0:
            raise ValueError(f"{name} is empty")
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"{name}: token id {bad} is outside the vocabulary [0, {vocab_size})")
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"{name}: max_new_tokens must be an integer >= 1, got {n!r}")
        total = len(ids) + n
        if total > max_model_len:
            raise ValueError(
                f"{name}: {len(ids)} prompt tokens + max_new_tokens {n} = {total} "
                f"exceeds max_model_len={max_model_len}"
            )
    return max_new


def check_context(ids: list[list[int]], max_new_tokens: list[int], cfg: ModelConfig) -> int:
    """For the scripts (smokes, CLI): refuse a prompt file the model cannot run; return the longest
    request (prompt + max_new_tokens), which sizes the engines' ``max_model_len``.

    Prompts are numbered from 1, like the lines of their file. Example with max_position_embeddings
    2048: a 2,100-token prompt and max_new_tokens 64 raises ``prompt 1: 2100 prompt tokens + max_new_tokens
    64 = 2164 exceeds the model's context limit (max_position_embeddings=2048)``.
    """
    limit = cfg.max_position_embeddings
    for i, (p, b) in enumerate(zip(ids, max_new_tokens, strict=True), start=1):
        if not p:
            raise ValueError(f"prompt {i}: it encodes to no tokens")
        if len(p) + b > limit:
            raise ValueError(
                f"prompt {i}: {len(p)} prompt tokens + max_new_tokens {b} = {len(p) + b} exceeds the "
                f"model's context limit (max_position_embeddings={limit})"
            )
    return max(len(p) + b for p, b in zip(ids, max_new_tokens, strict=True))


def check_blocks(
    label: str, num_tokens: int, needed: int, block_size: int, num_blocks: int, sizing: KvSizing | None = None
) -> None:
    """Refuse a request whose ``num_tokens`` need more blocks than the whole pool has; for a pool sized
    in bytes (``size_pool``), the message also names the bytes needed and given.

    Example: ``check_blocks("prompt 5", 272, 17, 16, 16)`` raises
    ``prompt 5: 272 tokens need 17 blocks of 16, but the pool has only 16 blocks``; with
    kv_cache_bytes 12,000,000 for SmolLM2-135M fp32 (737,280 bytes a block of 16) the message goes on
    ``: 12,533,760 bytes of KV needed, kv_cache_bytes=12,000,000 given``.
    """
    if needed > num_blocks:
        note = bytes_note(needed, sizing.block_bytes, sizing.kv_cache_bytes) if sizing else ""
        raise ValueError(
            f"{label}: {num_tokens} tokens need {needed} blocks of {block_size}, "
            f"but the pool has only {num_blocks} blocks{note}"
        )


@dataclass(frozen=True)
class KvSizing:
    """A pool sized in bytes: ``kv_cache_bytes``, a block's bytes, and the set-up line that shows the sizing."""

    kv_cache_bytes: int
    block_bytes: int
    line: str


def size_pool(
    num_blocks: int | None,
    kv_cache_bytes: int | None,
    gpu_memory_utilization: float | None,
    block_size: int,
    model,
    max_step_tokens: int,
) -> tuple[int | None, KvSizing | None]:
    """An engine's pool size: ``num_blocks`` as given when no bytes are; else the blocks ``kv_cache_bytes``
    holds (``blocks_for_bytes``), with its ``KvSizing``. ``gpu_memory_utilization`` makes the bytes that share of
    a CUDA device, after the weights and a profiled step of ``max_step_tokens`` tokens
    (``kvcourse.devices.kv_bytes_for_fraction``)."""
    if gpu_memory_utilization is not None:
        from kvcourse.devices import kv_bytes_for_fraction, profile_forward

        profile = lambda: profile_forward(model, max_step_tokens)  # noqa: E731
        kv_cache_bytes = kv_bytes_for_fraction(model.device, gpu_memory_utilization, profile)
    if kv_cache_bytes is None:
        return num_blocks, None
    cfg = model.cfg
    blocks = blocks_for_bytes(kv_cache_bytes, block_size, cfg, num_blocks)
    line = describe_sizing(kv_cache_bytes, block_size, cfg)
    return blocks, KvSizing(kv_cache_bytes, block_size * cfg.kv_bytes_per_token(), line)


def bytes_note(needed: int, block_bytes: int, kv_cache_bytes: int | None) -> str:
    """What a refusal adds when the pool was sized in bytes: the bytes needed and given ("" without one).

    Example: ``bytes_note(17, 737_280, 12_000_000) -> ': 12,533,760 bytes of KV needed,
    kv_cache_bytes=12,000,000 given'``.
    """
    if kv_cache_bytes is None:
        return ""
    return f": {needed * block_bytes:,} bytes of KV needed, kv_cache_bytes={kv_cache_bytes:,} given"


def blocks_for_bytes(
    kv_cache_bytes: int,
    block_size: int,
    cfg: ModelConfig,
    num_blocks: int | None = None,
    dtype_bytes: int = 4,
) -> int:
    """The blocks ``kv_cache_bytes`` hold: bytes // (block_size x bytes per token), where
    a token's K and V take 2 x H_kv x D x layers x dtype bytes (``ModelConfig.kv_bytes_per_token``).

    Example, SmolLM2-135M in fp32 (2 x 3 x 64 x 30 x 4 = 46,080 bytes a token), block_size 16 (737,280
    bytes a block): ``64 MiB -> 91 blocks``; ``500_000`` raises ``kv_cache_bytes=500,000 holds no block:
    one block of 16 tokens takes 737,280 bytes``. A ``num_blocks`` given as well is refused: the pool
    has one size.
    """
    if num_blocks is not None:
        raise ValueError(
            f"give num_blocks or kv_cache_bytes, not both (got {num_blocks} and {kv_cache_bytes})"
        )
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    block_bytes = block_size * cfg.kv_bytes_per_token(dtype_bytes)
    if not isinstance(kv_cache_bytes, int):
        raise ValueError(f"kv_cache_bytes must be a whole number of bytes, got {kv_cache_bytes!r}")
    if kv_cache_bytes < block_bytes:
        raise ValueError(
            f"kv_cache_bytes={kv_cache_bytes:,} holds no block: one block of {block_size} tokens takes "
            f"{block_bytes:,} bytes"
        )
    return kv_cache_bytes // block_bytes


def describe_sizing(kv_cache_bytes: int, block_size: int, cfg: ModelConfig, dtype_bytes: int = 4) -> str:
    """How ``kv_cache_bytes`` were sized into blocks, for an engine's set-up line.

    Example, SmolLM2-135M fp32, 64 MiB, block_size 16: ``kv_cache_bytes 67,108,864 / (2 x 3 KV heads x
    64 dims x 30 layers x 4 bytes = 46,080 bytes a token, x 16 a block) = 91 blocks``.
    """
    per_token = cfg.kv_bytes_per_token(dtype_bytes)
    blocks = blocks_for_bytes(kv_cache_bytes, block_size, cfg, dtype_bytes=dtype_bytes)
    return (
        f"kv_cache_bytes {kv_cache_bytes:,} / (2 x {cfg.num_kv_heads} KV heads x {cfg.head_dim} dims x "
        f"{cfg.num_layers} layers x {dtype_bytes} bytes = {per_token:,} bytes a token, x {block_size} a block)"
        f" = {blocks} blocks"
    )


def finished(token: int, num_generated: int, max_new: int, eos_ids: tuple[int, ...], ignore_eos: bool) -> bool:
    """True once ``token`` (the newest of ``num_generated``) ends the request.

    Example with eos 2 and max_new 4: token 2 after 1 step -> True; token 7 after 4 steps -> True.
    """
    return num_generated >= max_new or (not ignore_eos and token in eos_ids)
