"""L2's independent answers (``answers.py``), written apart from the stage: the grader judges L2's hidden cases by them."""
