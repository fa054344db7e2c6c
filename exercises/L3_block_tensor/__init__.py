"""L3's exercise checkers and hidden cases (``checks.py``), for ``notebooks/L3_block_tensor.ipynb``: not the lesson."""
