"""L5's checkers and hidden cases (``checks.py``), for ``notebooks/L5_clones.ipynb``."""
