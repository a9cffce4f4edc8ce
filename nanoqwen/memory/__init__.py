"""Where keys and values live: the paged KV cache, and who holds which page.

Read `page_allocator.py` (pages handed out on the host: a free list and reference
counts), `kv_cache.py` (the K/V tensors on the device, in pages), `radix_cache.py` (a
radix tree of token prefixes whose pages later requests reuse), and, for a cache that
stores one byte per number, `kv_quant.py`; for a model with recurrent layers, the state
pool beside the pages, `state_pool.py`; for preemption by swapping, the host memory pages
wait in, `swap.py`.
"""
