"""L4's exercise checkers and hidden cases (``checks.py``), for ``notebooks/L4_paged_kernel.ipynb``: not the lesson."""
