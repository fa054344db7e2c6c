"""L5: blocks shared by reference count: a prefix cache, then clones (n samples, the partial last block copied at clone time).

    engine            L4's engine with blocks shared between sequences; ``generate_samples``
    prefix_cache      chained block hashes: a new request shares the full blocks already computed
    allocator         ``BlockAllocator`` with reference counts, ``lookup``/``register`` and ``clone``
    scheduler         L4's, with prefix-cache hits at admission, clones when a prefill ends, groups
                      served as a unit; it returns the block copies, the engine makes them
    sequence          a sequence's life, ``n`` samples of one request, ``allocate_slots()`` and ``slots()``
    cache             ``KvPool``, and ``copy_block`` for a clone's partial block
    attention         L4's, unchanged; ``paged_attention`` too
    paged_attention   the reference kernel
    l5_smoke          the smoke check: L5 against L4 and Hugging Face
    fast/             L4's fast paths, byte for byte (not the lesson)
    beams/            beam search on shared blocks, as HF's ``num_beams``: an optional wing (not the lesson)
"""
