"""L2's checkers and hidden cases (``checks.py``), for ``notebooks/L2_token_flat.ipynb``."""
