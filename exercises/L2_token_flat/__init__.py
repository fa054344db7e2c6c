"""L2's exercise checkers and hidden cases (``checks.py``), for ``notebooks/L2_token_flat.ipynb``: not the lesson."""
