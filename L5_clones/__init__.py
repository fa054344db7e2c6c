"""L5: blocks shared by reference count: parallel sampling with clones (the partial last block copied at clone time), and a prefix cache."""
