"""Maintainer tools: the stage diffs (``make diffs``), the mutants (``make mutants``), the GPU check
(``make gpu-check``). They may name a stage."""
