"""Speculative decoding: guess a few tokens cheaply, let the model check them in one pass.

Read `proposers.py` (the engine's step hook, n-gram lookup and a draft model) and
`verification.py` (greedy acceptance, and rejection sampling that keeps the output
distribution exact).
"""
