"""The independent reference: Hugging Face ``generate``, greedy, fp32, one prompt at a time.

Every stage's smoke check compares against this. Besides the tokens it records, for each generated
position, the gap between the top-2 logits: the comparison report uses it for the numerical-tie rule
(a first difference where HF's own top-2 gap is below 1e-3 is a tie, reported as such).

HF runs at ~11 tokens/s here, so results are cached on disk under ``.cache/reference/``, keyed by a
fingerprint of the checkpoint, the ``transformers`` version, the prompt ids and the budget. The cache
only ever holds what HF itself produced, so it stays an independent reference.

Left out on purpose: sampling (the course compares greedy outputs) and batching (batched HF with left
padding is a benchmark system, not a reference: padding changes the numerics).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from kvcourse.config import ModelConfig
from kvcourse.model_store import cache_root


@dataclass(frozen=True)
class Reference:
    tokens: list[int]  # the new tokens, eos included when HF stopped on it
    gaps: list[float]  # top-1 minus top-2 logit at each generated position


def model_fingerprint(model_dir: str | Path) -> str:
    """A cheap content fingerprint: config files plus the size and both ends of each weight file."""
    model_dir = Path(model_dir)
    h = hashlib.sha256()
    for name in ("config.json", "generation_config.json"):
        if (model_dir / name).exists():
            h.update((model_dir / name).read_bytes())
    for f in sorted(model_dir.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with f.open("rb") as fh:
            h.update(fh.read(1 << 20))
            fh.seek(max(0, size - (1 << 20)))
            h.update(fh.read(1 << 20))
    return h.hexdigest()[:16]


def _cache_file(model_dir: Path, prompt_ids: list[int], budget: int) -> Path:
    import transformers

    key = json.dumps([model_fingerprint(model_dir), transformers.__version__, prompt_ids, budget])
    digest = hashlib.sha256(key.encode()).hexdigest()[:24]
    return cache_root() / "reference" / f"{digest}.json"


def hf_greedy(model_dir: str | Path, prompts: list[list[int]], budgets: list[int]) -> list[Reference]:
    """HF greedy generation for each prompt (cached). ``budgets[i]`` is prompt i's max_new_tokens."""
    model_dir = Path(model_dir)
    out: list[Reference | None] = []
    todo = []
    for i, (ids, budget) in enumerate(zip(prompts, budgets, strict=True)):
        f = _cache_file(model_dir, ids, budget)
        if f.exists():
            raw = json.loads(f.read_text())
            out.append(Reference(raw["tokens"], raw["gaps"]))
        else:
            out.append(None)
            todo.append(i)
    if todo:
        for i, ref in zip(todo, _run_hf(model_dir, [prompts[i] for i in todo], [budgets[i] for i in todo])):
            out[i] = ref
            f = _cache_file(model_dir, prompts[i], budgets[i])
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(json.dumps({"tokens": ref.tokens, "gaps": ref.gaps}))
    return out


def load_hf_model(model_dir: str | Path):
    """The checkpoint as an HF model in fp32, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _run_hf(model_dir: Path, prompts: list[list[int]], budgets: list[int]) -> list[Reference]:
    import torch
    from transformers.utils import logging

    logging.disable_progress_bar()
    eos = list(ModelConfig.from_dir(model_dir).eos_token_ids)
    model = load_hf_model(model_dir)
    refs = []
    for ids, budget in zip(prompts, budgets, strict=True):
        inp = torch.tensor([ids])
        with torch.inference_mode():
            res = model.generate(
                inp,
                attention_mask=torch.ones_like(inp),
                max_new_tokens=budget,
                do_sample=False,
                eos_token_id=eos or None,
                pad_token_id=eos[0] if eos else 0,
                output_logits=True,
                return_dict_in_generate=True,
            )
        new = res.sequences[0, len(ids) :].tolist()
        gaps = []
        for step_logits in res.logits:  # one (1, vocab) tensor per generated position
            top2 = torch.topk(step_logits[0].float(), 2).values
            gaps.append(float(top2[0] - top2[1]))
        refs.append(Reference(new, gaps))
    return refs
