"""L1's independent answers (``answers.py``), written apart from the stage, for its hidden cases."""
