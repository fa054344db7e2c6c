"""Maintainer tools: the stage diffs and the L5/L6 names table (``diffs``, ``names``: ``make diffs``), the
measured tables (``numbers``: ``make numbers``), the mutants (``mutants``: ``make mutants``), the student
release and its autograder bundle (``release``: ``make release``), the GPU check (``gpu_check``: ``make
gpu-check``) and the run that spends a lent GPU's minutes (``gpu_run``: ``make gpu-run``). They may name
a stage."""
