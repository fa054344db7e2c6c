"""L3's checkers and hidden cases (``checks.py``), for ``notebooks/L3_block_tensor.ipynb``."""
