"""Where keys and values live: the paged KV cache and the prefix cache that shares it.

Read `kv_pool.py` (one preallocated pool cut into pages, with reference counts) and
`radix_cache.py` (a radix tree of token prefixes whose pages later requests reuse).
"""
