"""The independent reference: Hugging Face ``generate``, greedy, fp32, one prompt at a time.

Every stage's smoke check compares against this. Besides the tokens it records, for each generated
position, the gap between the top-2 logits: the comparison report uses it for the numerical-tie rule
(a first difference where HF's own top-2 gap is below 1e-3 is a tie, reported as such).

HF generates one prompt at a time at about 25 tokens/s on the course's 2-core VM (HF batch 1 on
workload (a) of ``make bench``, ``bench/results/bench.json``, commit 92dedf8), so results are cached on disk under ``.cache/reference/``, keyed by
everything that decides them: the full content of the checkpoint's weight, config and tokenizer
files (a sha256 of each file, itself cached by path, size and modification time, so a 500 MB file is
hashed once), the ``torch`` and ``transformers`` versions, the prompt ids and max_new_tokens. The cache
only ever holds what HF itself produced, so it stays an independent reference.

``hf_beams`` does the same for beam search (``generate(num_beams=k, do_sample=False)``): the returned
sequences, and HF's own beams at every step (recorded by a logits processor, which sees the running
sequences and their log-probabilities) with, per step, the smallest gap between neighbouring scores
among the candidates its selection ranks: the beam search tie rule's measure.

HF runs with its own device as torch's default device (``torch.device(device)`` around each run):
its code is not the course's, and ``tests/test_devices.py`` runs the stages' smokes with the default
device set to ``meta`` to catch a stage tensor made without its device; the reference must not trip it.

Left out on purpose: sampling (the course compares greedy outputs) and batching (batched HF with left
padding is a benchmark system, not a reference: padding changes the numerics).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from kvcourse.config import ModelConfig
from kvcourse.devices import resolve_device
from kvcourse.model_store import cache_root
from kvcourse.sampling import BeamParams


@dataclass(frozen=True)
class Reference:
    tokens: list[int]  # the new tokens, eos included when HF stopped on it
    gaps: list[float]  # top-1 minus top-2 logit at each generated position


@dataclass(frozen=True)
class BeamReference:
    sequences: list[list[int]]  # the new tokens of each returned hypothesis, best first (eos included)
    beams: list[list[list[int]]]  # per step: the new tokens of each running beam HF extended there
    gaps: list[float]  # per step: the smallest gap between neighbouring candidate scores HF ranked


FINGERPRINTED = ("*.safetensors", "*.json", "*.jinja", "tokenizer.model")


def file_sha256(path: Path) -> str:
    """sha256 of a file's whole content, remembered in ``.cache/file-hashes.json`` under its path, size
    and modification time: a file that has not changed since it was hashed is not read again."""
    path = path.resolve()
    stat = path.stat()
    index_file = cache_root() / "file-hashes.json"
    index = json.loads(index_file.read_text()) if index_file.exists() else {}
    key = f"{path}:{stat.st_size}:{stat.st_mtime_ns}"
    if key not in index:
        h = hashlib.sha256()
        with path.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 24), b""):
                h.update(chunk)
        index[key] = h.hexdigest()
        write_atomically(index_file, json.dumps(index, indent=0) + "\n")
    return index[key]


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename, so that another process (a
    second notebook, a parallel test worker) reading it never sees half a file. Makes the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)


def model_fingerprint(model_dir: str | Path) -> str:
    """A fingerprint of everything in a checkpoint folder that can change HF's output: the content of
    its weight, config and tokenizer files (marker files the course writes itself excluded)."""
    model_dir = Path(model_dir)
    files = sorted({f for pattern in FINGERPRINTED for f in model_dir.glob(pattern)})
    h = hashlib.sha256()
    for f in files:
        if f.name != "kvcourse_prepared.json":
            h.update(f"{f.name}:{file_sha256(f)}\n".encode())
    return h.hexdigest()[:16]


def _cache_file(setup: str, prompt_ids: list[int], max_new: int) -> Path:
    """Where HF's answer for one prompt is kept; ``setup`` is ``_setup_key``'s value."""
    digest = hashlib.sha256(json.dumps([setup, prompt_ids, max_new]).encode()).hexdigest()[:24]
    return cache_root() / "reference" / f"{digest}.json"


def _setup_key(model_dir: Path, device) -> str:
    """The checkpoint's fingerprint, the library versions and the device that produce the reference.

    A CPU's key names no device (the key the cache had before GPUs ran the course, so that answers
    computed then stay valid); a GPU's names the card, e.g. ``|cuda NVIDIA H100 80GB HBM3``.
    """
    import torch
    import transformers

    key = f"{model_fingerprint(model_dir)}|torch {torch.__version__}|transformers {transformers.__version__}"
    if device.type == "cuda":
        key += f"|cuda {torch.cuda.get_device_name(device)}"
    return key


def hf_greedy(
    model_dir: str | Path, prompts: list[list[int]], max_new_tokens: list[int], device="cpu"
) -> list[Reference]:
    """HF greedy generation for each prompt, on ``device`` (cached per device). ``max_new_tokens[i]`` is prompt
    i's max_new_tokens."""
    model_dir = Path(model_dir)
    device = resolve_device(device)
    setup = _setup_key(model_dir, device)
    out: list[Reference | None] = []
    todo = []
    for i, (ids, max_new) in enumerate(zip(prompts, max_new_tokens, strict=True)):
        f = _cache_file(setup, ids, max_new)
        if f.exists():
            raw = json.loads(f.read_text())
            out.append(Reference(raw["tokens"], raw["gaps"]))
        else:
            out.append(None)
            todo.append(i)
    if todo:
        import torch

        with torch.device(device):  # HF's own tensors: on its device, whatever the default
            hf = _run_hf(model_dir, [prompts[i] for i in todo], [max_new_tokens[i] for i in todo], device)
        for i, ref in zip(todo, hf, strict=True):
            out[i] = ref
            write_atomically(
                _cache_file(setup, prompts[i], max_new_tokens[i]),
                json.dumps({"tokens": ref.tokens, "gaps": ref.gaps}),
            )
    return out


def load_hf_model(model_dir: str | Path, device="cpu", **options):
    """The checkpoint as an HF model in fp32, eval mode, on ``device``; ``options`` go to
    ``from_pretrained`` (e.g. ``attn_implementation="sdpa"``). Built on the CPU and then moved, as
    HF's own examples do, so that buffers it computes at build time (RoPE's frequencies) are the CPU's."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **options)
    return model.to(resolve_device(device)).eval()


def _run_hf(model_dir: Path, prompts: list[list[int]], max_new_tokens: list[int], device) -> list[Reference]:
    import torch
    from transformers.utils import logging

    logging.disable_progress_bar()
    eos = list(ModelConfig.from_dir(model_dir).eos_token_ids)
    model = load_hf_model(model_dir, device)
    refs = []
    for ids, max_new in zip(prompts, max_new_tokens, strict=True):
        inp = torch.tensor([ids], device=device)  # (1, P)
        with torch.inference_mode():
            res = model.generate(
                inp,
                attention_mask=torch.ones_like(inp),
                max_new_tokens=max_new,
                do_sample=False,
                eos_token_id=eos or None,
                pad_token_id=eos[0] if eos else 0,
                output_logits=True,
                return_dict_in_generate=True,
            )
        new = res.sequences[0, len(ids) :].tolist()
        top2 = torch.stack([torch.topk(step[0].float(), 2).values for step in res.logits])  # (new, 2)
        gaps = (top2[:, 0] - top2[:, 1]).tolist()
        refs.append(Reference(new, gaps))
    return refs


def hf_beams(
    model_dir: str | Path,
    prompts: list[list[int]],
    max_new_tokens: list[int],
    params: BeamParams,
    device="cpu",
) -> list[BeamReference]:
    """HF beam search for each prompt, one at a time, on ``device`` (cached like ``hf_greedy``, keyed by
    ``params`` too). ``params.num_beams == 1`` is HF's greedy search, as in ``generate``."""
    model_dir = Path(model_dir)
    device = resolve_device(device)
    setup = f"{_setup_key(model_dir, device)}|beams {params}"
    out = []
    model = None
    for ids, max_new in zip(prompts, max_new_tokens, strict=True):
        f = _cache_file(setup, ids, max_new)
        if not f.exists():
            import torch

            with torch.device(device):  # HF's own tensors: on its device, whatever the default
                model = model or load_hf_model(model_dir, device)
                ref = _run_hf_beams(model, ModelConfig.from_dir(model_dir), ids, max_new, params, device)
            write_atomically(f, json.dumps(ref.__dict__))
        out.append(BeamReference(**json.loads(f.read_text())))
    return out


class BeamRecorder:
    """A logits processor for HF's beam search that changes nothing: at every step it sees HF's running
    sequences (k, length) and their scores (k, vocab), before HF's selection adds the beams' scores, and
    records the beams (``beams``: new tokens per row) and, per step, the smallest gap between
    neighbouring candidate scores among the ``ranked`` best (``gaps``: the beam tie rule's measure).

    Its own tensors live on the CPU whatever device HF runs on or torch's default is (the log-probs are
    copied there; every tensor it makes names ``cpu``): on a GPU, HF runs with CUDA as the default device,
    and a score made without its device met CPU log-probs (``make gpu-run``, 2026-11-28).
    """

    def __init__(self, prompt_len: int, ranked: int):
        self.prompt_len, self.ranked = prompt_len, ranked
        self.beams: list[list[list[int]]] = []
        self.gaps: list[float] = []
        self.prev = None  # (new tokens per row, scores (k,), log-probs (k, vocab)) of the step before

    def __call__(self, input_ids, scores):
        import torch

        rows = [r[self.prompt_len :] for r in input_ids.tolist()]
        logp = torch.log_softmax(scores.float(), dim=-1).cpu()  # (k, vocab); greedy passes logits
        if self.prev is None:  # the prompt, k times over: only the first copy counts (HF: -1e9 on the others)
            score = torch.tensor([0.0] + [-1e9] * (len(rows) - 1), device="cpu")  # (k,)
        else:
            prev_rows, prev_score, prev_logp = self.prev
            index = {tuple(r): i for i, r in reversed(list(enumerate(prev_rows)))}  # first copy wins
            parents = [index[tuple(r[:-1])] for r in rows]
            score = prev_score[parents] + prev_logp[parents, [r[-1] for r in rows]]  # (k,) fp32, as HF adds
        self.beams.append(rows[:1] if self.prev is None else rows)
        top = torch.topk((logp + score[:, None]).flatten(), min(self.ranked + 1, logp.numel())).values
        self.gaps.append(float((top[:-1] - top[1:]).min()))
        self.prev = (rows, score, logp)
        return scores


def _run_hf_beams(model, cfg: ModelConfig, ids: list[int], max_new: int, params: BeamParams, device):
    import torch
    from transformers import LogitsProcessorList
    from transformers.utils import logging

    logging.disable_progress_bar()
    eos = list(cfg.eos_token_ids)
    k = params.num_beams
    ranked = max(2, 1 + len(eos)) * k  # candidates HF's selection keeps per step (its beams_to_keep)
    record = BeamRecorder(len(ids), ranked)

    inp = torch.tensor([ids], device=device)  # (1, P)
    with torch.inference_mode():
        res = model.generate(
            inp,
            attention_mask=torch.ones_like(inp),
            max_new_tokens=max_new,
            do_sample=False,
            num_beams=k,
            num_return_sequences=params.num_return_sequences,
            length_penalty=params.length_penalty,
            early_stopping=params.early_stopping,
            eos_token_id=eos or None,
            pad_token_id=eos[0] if eos else 0,
            logits_processor=LogitsProcessorList([record]),
            return_dict_in_generate=True,
        )
    new = res.sequences[:, len(ids) :].tolist()  # (r, longest): shorter hypotheses padded
    if k > 1:  # a hypothesis's length: the steps its beam_indices fill
        lengths = (res.beam_indices >= 0).sum(dim=1).tolist()
    else:
        lengths = [len(new[0])]
    return BeamReference([s[:n] for s, n in zip(new, lengths, strict=True)], record.beams, record.gaps)
