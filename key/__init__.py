"""The answer key, in one folder that a student release leaves out (``make release``).

    key/notebooks/LN_*.ipynb       the reference notebooks: prose, runs, the exercises' solutions, executed
                                   (``make exercises`` makes the learner's ``notebooks/LN_*.ipynb`` from them)
    key/L1_contiguous/answers.py   each stage's independent answers, which the grader judges the hidden
    .. key/L6_tpu_jax/answers.py   cases against (``kvcourse/grading/hidden.py``)

The grader imports it in its own process only; a submission's sandbox cannot see it.
"""
