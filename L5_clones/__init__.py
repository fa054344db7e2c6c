"""L5: blocks shared by reference count: parallel sampling with forks (the partial last block copied at fork time), and a prefix cache."""
