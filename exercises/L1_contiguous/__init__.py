"""L1's exercise checkers and hidden cases (``checks.py``), for ``notebooks/L1_contiguous.ipynb``: not the lesson."""
