"""kvcourse: everything the course shares that no lesson is about, in four layers that only look down.

    kvcourse/*.py        what the stages import: the model (torch and JAX), its config and store,
                         devices, request limits, statistics, sampling, the C++ build and decode graphs
    kvcourse/harness/    what runs and compares the stages: smokes, HF reference, comparison, prompts,
                         tiny checkpoints, workloads, kernel cases, the stage list and the CLI
    kvcourse/grading/    what grades the notebooks: check cases, hidden cases, integrity scan, sandbox,
                         gradebook, exercise generation, workspace
    kvcourse/tools/      what maintainers run: stage diffs, mutants, the GPU check

A layer imports only the layers above it in this list (``tests/test_architecture.py`` checks it), and
only the harness and the tools name a stage.

Importing it changes nothing in the environment: which device runs is the caller's choice
(``kvcourse.devices``), and the stages' Triton kernels pick compiled or interpreted execution by the
device of the tensors they are given, not by the machine.
"""
