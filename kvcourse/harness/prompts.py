"""Prompt files and the tokenizer: turning the course's JSONL prompt format into token ids.

One prompt per line, either a chat (the model's chat template is applied, with the generation prompt)
or raw text (encoded as is, no template), with an optional per-prompt token max_new::

    {"messages": [{"role": "user", "content": "Name three primes."}], "max_new_tokens": 32}
    {"text": "The KV cache stores"}

Every smoke script, the CLI and the benchmarks read this one format. Left out on purpose: system
prompt defaults, tool calls and anything else a chat template may support beyond role/content.

Two prompt files ship with the course: ``prompts.jsonl``, the default set, and ``prompts_prefix.jsonl``
for the prefix cache (L5's smoke runs it too): raw-text prompts built from three sentences of exactly
16 tokens each with the course tokenizer, in different orders (P Q R, Q R, P R, Q P, then the same
half sentence), so the same 16-token block, block-aligned, follows different prefixes. A cache whose
keys forgot the blocks before a block would share K/V computed after another prefix, and the tokens
would change.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

DEFAULT_PROMPTS = Path(__file__).with_name("prompts.jsonl")
PREFIX_PROMPTS = Path(__file__).with_name("prompts_prefix.jsonl")


@dataclass(frozen=True)
class Prompt:
    messages: tuple[tuple[str, str], ...] | None = None  # ((role, content), ...) for chat prompts
    text: str | None = None  # raw text prompts
    max_new_tokens: int | None = None  # overrides the command-line value when set

    @property
    def label(self) -> str:
        """A one-line description for reports: the last message or the raw text."""
        body = self.messages[-1][1] if self.messages else self.text
        return ("chat: " if self.messages else "text: ") + " ".join(body.split())


KEYS = ("messages", "text", "max_new_tokens")
MESSAGE_KEYS = ("role", "content")


def parse_prompt(obj: dict, where: str = "prompt") -> Prompt:
    """Validate one decoded JSONL object and turn it into a ``Prompt``.

    Every problem is a ValueError that names the line and the value, e.g.
    ``prompts.jsonl:3: unknown key 'max_tokens' (allowed: messages, text, max_new_tokens)``.
    """
    if not isinstance(obj, dict) or ("messages" in obj) == ("text" in obj):
        raise ValueError(f"{where}: need exactly one of 'messages' or 'text', got {obj!r}")
    unknown = [k for k in obj if k not in KEYS]
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r} (allowed: {', '.join(KEYS)})")
    max_new = obj.get("max_new_tokens")
    if max_new is not None and (isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1):
        raise ValueError(f"{where}: max_new_tokens must be a positive integer, got {max_new!r}")
    if "text" in obj:
        if not isinstance(obj["text"], str) or not obj["text"]:
            raise ValueError(f"{where}: 'text' must be a non-empty string, got {obj['text']!r}")
        return Prompt(text=obj["text"], max_new_tokens=max_new)
    messages = obj["messages"]
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: 'messages' must be a non-empty list, got {messages!r}")
    pairs = []
    for m in messages:
        if not isinstance(m, dict) or not all(isinstance(m.get(k), str) for k in MESSAGE_KEYS):
            raise ValueError(f"{where}: each message needs string 'role' and 'content', got {m!r}")
        unknown = [k for k in m if k not in MESSAGE_KEYS]
        if unknown:
            raise ValueError(f"{where}: unknown message key {unknown[0]!r} (allowed: role, content)")
        pairs.append((m["role"], m["content"]))
    return Prompt(messages=tuple(pairs), max_new_tokens=max_new)


def read_prompts(path: str | Path | None = None) -> list[Prompt]:
    """Read a JSONL prompt file (default: the course's prompt set). Blank lines are skipped."""
    path = Path(path) if path else DEFAULT_PROMPTS
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a UTF-8 text file") from None
    prompts = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            prompts.append(parse_prompt(obj, f"{path}:{lineno}"))
    if not prompts:
        raise ValueError(f"{path}: no prompts (one JSON object per line)")
    return prompts


GENERIC_FAST = ("TokenizersBackend", "PreTrainedTokenizerFast")  # one class in transformers 5, two names


def load_tokenizer(model_dir: str | Path):
    """The checkpoint's own HF tokenizer (fast, local files only).

    ``AutoTokenizer`` reads the model's config first to choose the tokenizer class, and that imports
    transformers' modeling code, several times as long as loading the tokenizer itself, in every process
    that starts (``python -X importtime``). Where ``tokenizer_config.json`` names the generic fast class,
    as the course model's prepared copy and the tiny test checkpoints do, that class loads it directly,
    the class ``AutoTokenizer`` would have picked; any other class (a checkpoint of your own), or a file
    that cannot be read, goes through ``AutoTokenizer``, which says what is wrong.
    ``tests/test_prompts_compare.py`` checks both give the same class and ids."""
    try:
        named = json.loads((Path(model_dir) / "tokenizer_config.json").read_text(encoding="utf-8"))["tokenizer_class"]
    except (OSError, ValueError, KeyError, TypeError):
        named = None
    if named in GENERIC_FAST:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(model_dir, local_files_only=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def encode(tokenizer, prompt: Prompt) -> list[int]:
    """Token ids of one prompt: chat template with generation prompt, or the raw text as is."""
    if prompt.messages:
        messages = [{"role": r, "content": c} for r, c in prompt.messages]
        if tokenizer.chat_template is None:
            raise ValueError("this tokenizer has no chat template; use {'text': ...} prompts")
        return list(
            tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
    return list(tokenizer(prompt.text, add_special_tokens=False)["input_ids"])


def max_new_tokens_of(prompts: list[Prompt], default: int) -> list[int]:
    """Per-prompt ``max_new_tokens``: the prompt's own value, else ``default``.

    Example: prompts with max_new_tokens (None, 8) and default 64 -> ``[64, 8]``.
    """
    return [p.max_new_tokens or default for p in prompts]
