"""Grading, module by module: the check cases a notebook's checkers are built from (``cases``), the
hidden cases (``hidden``) and the fresh process they run in (``isolated``), the mutation list and the catch-the-bug exercises built on it
(``mutations``), the integrity scan (``integrity``), the sandbox (``sandbox``), the gradebook and its
nbval plugin (``gradebook``, ``nbval_report``), the generated exercise notebooks (``exercises``, with
``generated``) and the learner's workspace (``workspace``). It names no stage: it finds them through the
harness. What it runs lives outside kvcourse, in the grading tree: each stage's checkers in
``exercises/<stage>/checks.py``, the answer key (independent answers, reference notebooks) in ``key/``."""
