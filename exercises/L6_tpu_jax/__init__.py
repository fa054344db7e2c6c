"""L6's checkers and hidden cases (``checks.py``), for ``notebooks/L6_tpu_jax.ipynb``."""
