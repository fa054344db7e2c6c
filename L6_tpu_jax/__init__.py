"""L6: a JAX engine with Levanter-style device state, ragged paged attention and a Pallas TPU kernel.

    engine             Levanter's paged KV design on one device: cleanup wired in, reset made explicit
    page_table         ``PageTable`` (refcounts) and ``SequenceTable``: the tables on the device
    decode_state       ``DecodeState``: the work queue, per-slot outputs, stopping, cloning, reset
    kv_cache           ``kv_pages``: one page pool per layer, K and V interleaved by head
    attention          write the new K/V into the pages; ragged paged attention reads them in place
    pallas_attention   the same attention as a Pallas TPU kernel (TPU interpret mode off a TPU)
    device_stats       the statistics, counted on the device
    l6_smoke           the smoke check: L6 against L5 and Hugging Face
    mesh/              the wing: the engine over a device mesh, each device holding a share of slots
                       and pages, and across hosts (``mesh/__init__.py`` lists its modules)
    l6_multihost       the multi-host smoke: the mesh engine as several JAX processes
"""
