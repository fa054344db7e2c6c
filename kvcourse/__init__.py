"""kvcourse: everything the course shares that no lesson is about, in four layers that only look down.

    kvcourse/*.py        what the stages import: the model (``model``; in JAX, ``jax_model``), its
                         config (``config``) and store (``model_store``), the engines' shared options
                         (``engine_config``) and the vLLM paper's Orca baselines (``orca``: their
                         reservations and buddy allocator), devices (``devices``), request
                         limits and pool sizing in bytes (``limits``), statistics (``stats``), sampling
                         (``sampling``), the C++ build (``cpp_kernels``) and decode graphs
                         (``decode_graphs``); ``__main__`` is ``python -m kvcourse``
    kvcourse/harness/    what runs and compares the stages: smokes, HF reference, comparison, prompts,
                         tiny checkpoints, workloads, request streams and serving, kernel cases, the
                         stage list, provenance and the CLI
    kvcourse/grading/    what grades the notebooks: check cases, hidden cases, the mutation list and
                         catch-the-bug, integrity scan, sandbox, gradebook, exercise generation, workspace
    kvcourse/tools/      what maintainers run: stage diffs and names, numbers, mutants, the student
                         release, the GPU check and run

A layer imports only the layers above it in this list (``tests/test_architecture.py`` checks it), and
only the harness and the tools name a stage. The stages (``L1_contiguous/`` .. ``L6_tpu_jax/``) hold
nothing of grading: the grading tree beside them, ``exercises/`` (each stage's checkers) and ``key/``
(the answer key: independent answers and reference notebooks), is built on the grading layer.

Importing it sets one thing in the environment, and only where the caller has not:
``OMP_WAIT_POLICY=PASSIVE``. OpenMP threads that spin while they wait would otherwise steal the cores
of any other PyTorch process on the machine (a notebook kernel beside a smoke): on a 2-core machine each
can run several times slower (issue #34, quoted in ``lessons/setup.md``: 3.4 tok/s beside one other torch process,
17.9 tok/s with this setting). The setting must be in place before PyTorch loads its OpenMP library, and
every command of the course (the smokes, ``python -m kvcourse``, the notebooks' first imports, the
bench) imports ``kvcourse`` before ``torch``, so they all get it; ``OMP_WAIT_POLICY=ACTIVE`` in the
environment keeps spinning threads (L1 chapter, section 6, measures both). Everything else is the
caller's choice: which device runs (``kvcourse.devices``), and the stages' Triton kernels pick compiled
or interpreted execution by the device of the tensors they are given, not by the machine.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
