"""kvcourse: everything the course shares that no lesson is about, in four layers that only look down.

    kvcourse/*.py        what the stages import: the model (torch and JAX), its config and store,
                         the engines' shared options (engine_config), devices, request limits,
                         statistics, sampling, the C++ build and decode graphs
    kvcourse/harness/    what runs and compares the stages: smokes, HF reference, comparison, prompts,
                         tiny checkpoints, workloads, kernel cases, the stage list and the CLI
    kvcourse/grading/    what grades the notebooks: check cases, hidden cases, integrity scan, sandbox,
                         gradebook, exercise generation, workspace
    kvcourse/tools/      what maintainers run: stage diffs, mutants, the GPU check

A layer imports only the layers above it in this list (``tests/test_architecture.py`` checks it), and
only the harness and the tools name a stage.

Importing it sets one thing in the environment, and only where the caller has not:
``OMP_WAIT_POLICY=PASSIVE``. OpenMP threads that spin while they wait would otherwise steal the cores
of any other PyTorch process on the machine (a notebook kernel beside a smoke): on a 2-core machine each
can run several times slower (issue #34, quoted in the README: 3.4 tok/s beside one other torch process,
17.9 tok/s with this setting). The setting must be in place before PyTorch loads its OpenMP library, and
every command of the course (the smokes, ``python -m kvcourse``, the notebooks' first imports, the
bench) imports ``kvcourse`` before ``torch``, so they all get it; ``OMP_WAIT_POLICY=ACTIVE`` in the
environment keeps spinning threads (L1 chapter, section 6, measures both). Everything else is the
caller's choice: which device runs (``kvcourse.devices``), and the stages' Triton kernels pick compiled
or interpreted execution by the device of the tensors they are given, not by the machine.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
