"""L5: blocks shared by reference count: parallel sampling with copy-on-write forks, and a prefix cache."""
