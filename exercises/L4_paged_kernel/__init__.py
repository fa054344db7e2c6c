"""L4's checkers and hidden cases (``checks.py``), for ``notebooks/L4_paged_kernel.ipynb``."""
