"""L5's independent answers (``answers.py``), written apart from the stage: the grader judges L5's hidden cases by them."""
