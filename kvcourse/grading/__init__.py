"""Grading, module by module: the check cases a notebook's checkers are built from (``cases``), the
hidden cases (``hidden``) and the fresh process they run in (``isolated``), the mutation list and the catch-the-bug exercises built on it
(``mutations``), the integrity scan (``integrity``), the sandbox (``sandbox``), the gradebook and its
nbval plugin (``gradebook``, ``nbval_report``), the generated exercise notebooks (``exercises``, with
``generated``) and the learner's workspace (``workspace``). It names no stage: it finds them through the
harness. What it runs lives outside kvcourse, in the grading tree: each stage's checkers in
``exercises/<stage>/checks.py``, the answer key (independent answers, reference notebooks) in ``key/``."""

import sys

# jsonschema, under nbformat, imports rfc3987_syntax where it is installed (jupyterlab brings it, through
# jupyter-events) for its "iri" string format, and that module builds a Lark grammar as it loads: 2.4 s
# of every grading process's start on this course's VM (``python -X importtime -c "import nbformat"``).
# No notebook schema uses the format, so the grader and its nbval run (which loads ``nbval_report``
# first) go without it; a process that imported it already keeps it.
sys.modules.setdefault("rfc3987_syntax", None)
