"""L5's exercise checkers and hidden cases (``checks.py``), for ``notebooks/L5_clones.ipynb``: not the lesson."""
