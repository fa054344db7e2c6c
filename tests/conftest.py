"""Shared fixtures: the prepared course model and seeded tiny random checkpoints (built once per run).

Tests marked ``cuda`` need a CUDA GPU: where torch sees none they are skipped, saying so. Every other
test runs on the CPU (the default device), GPU or not.

Under pytest-xdist (``make test`` runs two workers) each worker's torch computes on its share of the
cores: without that, each worker starts one OpenMP thread per core, and on two cores the four threads
take turns at every parallel region. Measured here (2-core Intel Xeon, ``pytest -n 2`` of
tests/test_l4.py, test_l5.py and test_l5_beams.py): 285 s with torch's default threads, 198 s with one
each. XLA's own thread pool is left alone: single-threaded (``--xla_cpu_multi_thread_eigen=false``)
L6's engine tests ran 10% faster alone, but the whole suite's L6 tests took longer (its compile-time
tests most). An ``OMP_NUM_THREADS`` set by hand is left as it is.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvcourse.harness.tiny import make_tiny_checkpoint
from kvcourse.model_store import default_model_dir


def worker_threads() -> int | None:
    """The compute threads for this pytest-xdist worker: its share of the cores this process may use,
    at least one; None outside xdist or where ``OMP_NUM_THREADS`` was set by hand. Two workers on a
    2-core machine: 1; on 16 cores: 8."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if "PYTEST_XDIST_WORKER" not in os.environ or workers < 2 or "OMP_NUM_THREADS" in os.environ:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // workers)  # (macOS has no sched_getaffinity)


# Set before any test runs, so that the notebook kernels and smokes the tests start inherit it.
WORKER_THREADS = worker_threads()
if WORKER_THREADS is not None:
    os.environ["OMP_NUM_THREADS"] = str(WORKER_THREADS)
    torch.set_num_threads(WORKER_THREADS)


@pytest.fixture(autouse=True)
def keep_the_workers_threads():
    """A test that sets torch's threads (``bench.serving.main`` takes every core) gives them back."""
    yield
    if WORKER_THREADS is not None and torch.get_num_threads() != WORKER_THREADS:
        torch.set_num_threads(WORKER_THREADS)


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
