"""L4: attention that walks the block table in place (PyTorch reference and Triton kernels)."""
