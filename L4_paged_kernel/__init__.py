"""L4: attention that walks the block table in place (a PyTorch reference kernel; its fast paths in fast/)."""
