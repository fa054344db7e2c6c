"""L5: blocks shared by reference count: a prefix cache, then clones (n samples, the partial last block copied at clone time)."""
