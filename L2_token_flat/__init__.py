"""L2: a paged, token-flat KV pool handed out in blocks by a free list, one request at a time."""
