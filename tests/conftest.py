"""Shared fixtures: the prepared course model and seeded tiny random checkpoints (built once per run).

Tests marked ``cuda`` need a CUDA GPU: where torch sees none they are skipped, saying so. Every other
test runs on the CPU (the default device), GPU or not.
"""

from __future__ import annotations

import pytest
import torch

from kvcourse.harness.tiny import make_tiny_checkpoint
from kvcourse.model_store import default_model_dir


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False on this machine")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)


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
    from kvcourse.harness.prompts import DEFAULT_PROMPTS

    lines = DEFAULT_PROMPTS.read_text(encoding="utf-8").splitlines()
    chosen = [lines[0], max(lines, key=len), *[x for x in lines if '"system"' in x][:1], lines[-1]]
    path = tmp_path_factory.mktemp("prompts") / "subset.jsonl"
    path.write_text("".join(f"{x}\n" for x in dict.fromkeys(chosen)), encoding="utf-8")
    return path
