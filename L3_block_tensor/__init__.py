"""L3: a block-tensor KV pool with block tables, and a scheduler running many requests at once."""
