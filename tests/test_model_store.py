"""Model preparation: the bundled GGUF is found, converted once, and every override is honoured."""

from __future__ import annotations

import pytest

from kvcourse import model_store
from kvcourse.model_store import MODEL_ENV, find_bundled_gguf, prepare_default_model, resolve_model_dir


def test_bundled_gguf_is_found():
    gguf = find_bundled_gguf()
    assert gguf.suffix == ".gguf" and gguf.stat().st_size > 50_000_000


def test_second_prepare_does_not_convert_again(model_dir, monkeypatch):
    """Once the marker is written, preparing again never touches the GGUF (nor imports torch)."""

    def refuse():
        raise AssertionError("prepare_default_model tried to convert again")

    monkeypatch.setattr(model_store, "find_bundled_gguf", refuse)
    assert prepare_default_model() == model_dir
    for name in ("config.json", "model.safetensors", "tokenizer.json", "kvcourse_prepared.json"):
        assert (model_dir / name).exists(), name


def test_override_order(model_dir, tiny_llama_dir, monkeypatch):
    monkeypatch.delenv(MODEL_ENV, raising=False)
    assert resolve_model_dir() == model_dir
    monkeypatch.setenv(MODEL_ENV, str(tiny_llama_dir))
    assert resolve_model_dir() == tiny_llama_dir
    assert resolve_model_dir(model_dir) == model_dir, "an explicit --model beats the environment"


def test_not_a_model_dir_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a Hugging Face model directory"):
        resolve_model_dir(tmp_path)
