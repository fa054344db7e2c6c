"""Shared fixtures: the prepared course model and seeded tiny random checkpoints (built once per run).

Tests marked ``cuda`` need a CUDA GPU: where torch sees none they are skipped, saying so. Every other
test runs on the CPU (the default device), GPU or not. Tests marked ``slow`` (tens of seconds each) run
first.
"""

from __future__ import annotations

import pytest
import torch

from kvcourse.harness.tiny import make_tiny_checkpoint
from kvcourse.model_store import default_model_dir


def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow`` run first (each keeps its place among them, as do the others), so that with
    ``make test``'s two workers, each handed one test at a time (``--maxschedchunk 1``), the longest
    ones are shared out at the start and no worker is left running one alone at the end. Tests marked
    ``cuda`` are skipped, saying why, where torch sees no GPU."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
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
