"""L1: a contiguous KV cache, one request at a time.

    engine      prefill the prompt, then decode one token per step
    cache       ``KvCache``: one contiguous K and V tensor per layer, sized for the longest request
    attention   write this step's K/V into the cache, then attend over the prefix
    l1_smoke    the smoke check: L1's greedy tokens against Hugging Face's
"""
