"""Attention over a paged KV cache: one page-table format, one interface, three kernels.

Read `base.py` (the CSR page table every backend reads, the interface, and the textbook
`ReferenceBackend`, the oracle), `torch_backend.py` (the fast CPU path) with
`torch_layout.py` (how it splits a step into calls that stay within a fixed memory, and
what a step can need), `flashinfer_backend.py` (CUDA kernels) and `registry.py` (which one
serves a model).
"""
