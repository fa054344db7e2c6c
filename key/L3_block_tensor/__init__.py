"""L3's independent answers (``answers.py``), written apart from the stage: the grader judges L3's hidden cases by them."""
