"""L4: attention that walks the block table in place (a PyTorch reference kernel; its fast paths in fast/).

    engine            L3's engine, attention done by a kernel that reads blocks in place
    paged_attention   the reference kernel: online softmax over each sequence's blocks
    attention         write the new K/V by slot, then hand the whole batch to the kernel
    scheduler         L3's, unchanged; ``allocator``, ``sequence`` and ``cache`` too
    allocator         ``BlockAllocator``: the free list of block ids
    sequence          a sequence's life, ``allocate_slots()`` and ``slots()``
    cache             ``KvPool``: a block-tensor pool per layer
    l4_smoke          the smoke check: L4 against L3 and Hugging Face
    fast/             the fast paths (not the lesson): compiled kernels, split-KV, decode graphs
"""
