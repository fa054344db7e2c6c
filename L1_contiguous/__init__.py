"""L1: a contiguous KV cache, one request at a time."""
