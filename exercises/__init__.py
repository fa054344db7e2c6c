"""The notebooks' exercise checkers, one package per stage, outside the stages' folders (not the lesson).

    exercises/L1_contiguous/checks.py .. exercises/L6_tpu_jax/checks.py

Each ``checks.py`` holds its stage's checkers (what a notebook's check cell calls: ``checks.check_free``),
their visible cases and the exercises' hidden cases (``HIDDEN``), built on ``kvcourse/grading``. A
checker's reference is the stage's own code, imported by name (``from L2_token_flat.allocator import
BlockAllocator``). They ship in a student release; the answers they are judged against do not: those
are the answer key's (``key/``), which nothing here imports.
"""
