"""Picking each request's next token, every request with its own settings, in one batch.

Read `params.py` (`SamplingParams`, checked once) and `sampler.py` (penalties,
temperature, top-k/top-p/min-p and seeded draws, vectorised across rows).
"""
