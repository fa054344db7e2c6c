"""L1's checkers and hidden cases (``checks.py``), for ``notebooks/L1_contiguous.ipynb``."""
