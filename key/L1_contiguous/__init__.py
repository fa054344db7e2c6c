"""L1's independent answers (``answers.py``), written apart from the stage: the grader judges L1's hidden cases by them."""
