"""The systems a benchmark compares, each behind one call: ``run(prompts, max_new_tokens) -> outputs``.

Every run is fixed-length: each request produces exactly its max_new_tokens. HF's models get no
eos token (``generation_config.eos_token_id = None``), so they neither stop on it nor mask it (HF's
``min_new_tokens`` would mask it and pick another token); the engines run with ``ignore_eos``. Both
then compute the same greedy text, which the bench checks token for token.

- ``hf_batch1``: Hugging Face ``generate``, one request at a time. It also keeps, for its last run,
  each position's top-2 logit gap: its outputs are the bench's token reference, with the tie rule;
- ``hf_batched``: HF ``generate`` on all requests at once, left-padded to the longest prompt. It
  runs every request for the largest max_new_tokens; only each request's own max_new_tokens counts as useful output,
  and ``computed`` reports what it really generated;
- ``hf_generate_batch``: transformers' own paged continuous batching (what ``model.generate_batch``
  runs; the model loads with SDPA attention, which it runs over its paged cache), every request with
  its own max_new_tokens;

The three HF peers share one model (``fixed_length_model``): the same weights called three ways.
- the course's stages, by name (``L1`` .. ``L6``), through their ``Engine.generate``.

Every system runs on the bench's device: the HF model and its inputs are put there, the stages get it
as ``device=`` (in ``options``). On a GPU, ``generate_batch`` decides for itself whether to capture CUDA
graphs (its ``use_cuda_graph`` left at None, inferred), as a user calling it would.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvcourse.harness.reference import Reference, load_hf_model
from kvcourse.harness.stages import STAGES, engine_class, engine_options

Run = Callable[[list[list[int]], list[int]], list[list[int]]]
PAGE = 16  # generate_batch's page size: the stages' block size
MAX_BATCH_TOKENS = 2048  # tokens per generate_batch step: the stages' default (their max_model_len)


@dataclass
class System:
    name: str
    run: Run
    engine: object | None = None  # the course engine, for its memory counters
    one_at_a_time: bool = False  # runs its requests one after another (HF batch 1, L1, L2)
    references: list[Reference] = field(default_factory=list)  # HF batch 1: its last run, with gaps
    runs_largest_max_new: bool = False  # HF batched: every row generates the largest max_new_tokens

    def run_samples(self, prompt: list[int], max_new: int, n: int) -> list[list[int]]:
        """n sequences of one prompt: prefilled once and cloned where the stage can (L5, L6), else n requests."""
        if hasattr(self.engine, "generate_samples"):
            return self.engine.generate_samples([prompt], max_new, n=n, ignore_eos=True)[0]
        return self.run([prompt] * n, [max_new] * n)

    def computed(self, prompts, max_new_tokens) -> int:
        """New tokens the system generates for these requests (more than asked when every row runs the
        largest max_new)."""
        return len(max_new_tokens) * max(max_new_tokens) if self.runs_largest_max_new else sum(max_new_tokens)


@functools.cache
def fixed_length_model(model_dir, device: str = "cpu"):
    """The HF model (SDPA attention) on ``device`` that never stops on eos and never masks it, like the
    engines' ``ignore_eos``; one per checkpoint and device, shared by the HF peers.

    Shared, not one copy each, because transformers' continuous batching sizes its cache against the
    memory it thinks is free: on a CPU, its NUMA node's memory minus this process's, times 0.6
    (transformers 5.23, ``resolve_max_memory_percent``). On
    this VM, with every system of a workload built (nine models, five pools), the process held most of
    its node's memory and ``generate_batch`` refused (b)'s cache (found in ``make bench`` at commit
    ebf0f9a; the memory figures were read by hand, not by a committed command). Two fewer copies leave
    it room.
    """
    model = load_hf_model(model_dir, device, attn_implementation="sdpa")
    model.generation_config.eos_token_id = None
    return model


def hf_batch1(model_dir, device: str = "cpu") -> System:
    model = fixed_length_model(model_dir, device)
    references: list[Reference] = []  # refilled by every run

    def run(prompts, max_new_tokens):
        references.clear()
        for ids, max_new in zip(prompts, max_new_tokens, strict=True):
            inp = torch.tensor([ids], device=device)  # (1, P)
            with torch.inference_mode():
                res = model.generate(
                    inp, attention_mask=torch.ones_like(inp), max_new_tokens=max_new, do_sample=False,
                    pad_token_id=0, output_logits=True, return_dict_in_generate=True,
                )  # fmt: skip
            top2 = [torch.topk(step[0], 2).values for step in res.logits]  # one (1, vocab) per position
            references.append(
                Reference(res.sequences[0, len(ids) :].tolist(), [float(t[0] - t[1]) for t in top2])
            )
        return [r.tokens for r in references]

    return System("HF batch 1", run, one_at_a_time=True, references=references)


def hf_batched(model_dir, device: str = "cpu") -> System:
    model = fixed_length_model(model_dir, device)

    def run(prompts, max_new_tokens):
        width, longest = max(map(len, prompts)), max(max_new_tokens)
        padded = [[0] * (width - len(p)) + p for p in prompts]  # left padding
        ids = torch.tensor(padded, device=device)  # (B, W)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)  # (B, W)
        with torch.inference_mode():
            seq = model.generate(
                ids, attention_mask=mask, max_new_tokens=longest, do_sample=False, pad_token_id=0
            )
        return [seq[i, width : width + b].tolist() for i, b in enumerate(max_new_tokens)]

    return System("HF batched", run, runs_largest_max_new=True)


def hf_generate_batch(model_dir, device: str = "cpu") -> System:
    """transformers' continuous batching. ``model.generate_batch`` gives every request one max_new_tokens; the
    manager it wraps (``continuous_batching_context_manager``) takes each request's own."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    model = fixed_length_model(model_dir, device)

    def run(prompts, max_new_tokens):
        config = GenerationConfig(
            do_sample=False, max_new_tokens=max(max_new_tokens), eos_token_id=-1, pad_token_id=0
        )
        hints = WorkloadHints(
            max_prompt_length=max(map(len, prompts)),
            max_generated_length=max(max_new_tokens),
            num_requests=len(prompts),
        )
        # No inference_mode here: the manager's worker thread runs outside it and updates these tensors.
        # warmup=False: its warm-up runs dummy batches at the largest sizes (for CUDA graphs) at every
        # call; the bench gives it an untimed warm-up run instead, like every other system.
        # Its KV cache sized like the stages' pools (16-token pages, enough for every request at once):
        # left to itself it sizes the cache from free accelerator memory, which on a CPU costs seconds.
        pages = sum(-(-(len(p) + b) // PAGE) for p, b in zip(prompts, max_new_tokens, strict=True))
        sizing = ContinuousBatchingConfig(page_size=PAGE, num_blocks=pages, max_batch_tokens=MAX_BATCH_TOKENS)
        with model.continuous_batching_context_manager(
            generation_config=config, continuous_batching_config=sizing, workload_hints=hints, warmup=False
        ) as manager:
            ids = [
                manager.add_request(p, max_new_tokens=b) for p, b in zip(prompts, max_new_tokens, strict=True)
            ]
            done = {}
            while len(done) < len(ids):
                result = manager.get_result(timeout=1)
                if result is None and not manager.is_running():
                    raise RuntimeError(
                        "transformers' continuous batching stopped before finishing its requests"
                    )
                if result is not None and result.error is not None:  # it fails requests, it does not raise
                    raise RuntimeError(f"transformers' continuous batching failed: {result.error}")
                if result is not None and result.is_finished():
                    done[result.request_id] = result
        return [list(done[i].generated_tokens) for i in ids]

    return System("HF generate_batch", run)


def stage(name: str, model_dir, label: str | None = None, **options) -> System:
    """Stage ``name``'s engine built with ``options``, as a system called ``label`` (default: ``name``)."""
    engine = engine_class(name)(model_dir, **options)

    def run(prompts, max_new_tokens):
        return engine.generate(prompts, max_new_tokens, ignore_eos=True)

    batched = "max_num_seqs" in engine_options(engine_class(name))  # L1 and L2 run one request at a time
    return System(label or name, run, engine, one_at_a_time=not batched)


def present_stages() -> list[str]:
    """The stages whose engine imports in this checkout, in course order."""
    names = []
    for name in STAGES:
        try:
            engine_class(name)
        except ValueError:
            continue
        names.append(name)
    return names
