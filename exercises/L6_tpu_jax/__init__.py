"""L6's exercise checkers and hidden cases (``checks.py``), for ``notebooks/L6_tpu_jax.ipynb``: not the lesson."""
