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
