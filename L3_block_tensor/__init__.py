"""L3: a block-tensor KV pool with block tables, and a scheduler running many requests at once.

    engine      many sequences in flight, one flat batch per step (continuous batching)
    scheduler   which sequences run next, how many tokens each; preemption by recompute
    allocator   ``BlockAllocator``: the free list of block ids
    sequence    a sequence's life (waiting, running, finished), ``allocate_slots()`` and ``slots()``
    cache       ``KvPool``: a block-tensor pool per layer, indexed by block tables
    attention   write every new token's K/V by slot, then attend per sequence
    l3_smoke    the smoke check: L3 against L2 and Hugging Face
"""
