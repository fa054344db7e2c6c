"""L4's independent answers (``answers.py``), written apart from the stage: the grader judges L4's hidden cases by them."""
