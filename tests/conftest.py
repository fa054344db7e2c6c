"""Shared fixtures: the prepared course model and seeded tiny random checkpoints (built once per run)."""

from __future__ import annotations

import pytest

# Importing kvcourse (here, before any test module) puts Triton in interpreter mode on a machine
# without a GPU, which has to happen before anything (HF's modeling code included) imports triton.
from kvcourse.model_store import default_model_dir
from kvcourse.tiny import make_tiny_checkpoint


@pytest.fixture(scope="session")
def model_dir():
    """The prepared SmolLM2-135M-Instruct directory (converted on first use)."""
    return default_model_dir()


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory):
    """A seeded random 2-layer Qwen3 checkpoint (q/k norms, untied head)."""
    return make_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A seeded random 2-layer Llama checkpoint (untied head)."""
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def course_prompts_subset(tmp_path_factory):
    """Four lines of the course prompt set (the first, the longest, the first with a system prompt, the
    last), for the course-model smokes of make test that are slowest; make smoke runs all of them."""
    from kvcourse.prompts import DEFAULT_PROMPTS

    lines = DEFAULT_PROMPTS.read_text(encoding="utf-8").splitlines()
    chosen = [lines[0], max(lines, key=len), *[x for x in lines if '"system"' in x][:1], lines[-1]]
    path = tmp_path_factory.mktemp("prompts") / "subset.jsonl"
    path.write_text("".join(f"{x}\n" for x in dict.fromkeys(chosen)), encoding="utf-8")
    return path
