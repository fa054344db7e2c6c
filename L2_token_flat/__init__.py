"""L2: a paged, token-flat KV pool handed out in blocks by a free list, one request at a time.

    engine      L1's loop, with K/V kept in a paged pool
    allocator   ``BlockAllocator``: the free list of block ids
    sequence    ``Sequence`` and ``allocate_slots()``, which grows its blocks as it grows
    cache       ``KvPool``: one token-flat pool per layer, read and written by slot
    attention   write this step's K/V by slot, gather the history by slot, attend
    l2_smoke    the smoke check: L2 against L1 and Hugging Face
"""
