"""Maintainer tools: the stage diffs (``make diffs``), the mutants (``make mutants``), the GPU check
(``make gpu-check``) and the run that spends a lent GPU's minutes (``make gpu-run``). They may name a
stage."""
