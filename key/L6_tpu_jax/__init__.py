"""L6's independent answers (``answers.py``), written apart from the stage: the grader judges L6's hidden cases by them."""
