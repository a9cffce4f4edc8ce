"""The Qwen2 / Qwen3 decoder, shaped for serving: a flat batch of tokens from many requests.

Read `config.py` (the model's shape) and `qwen.py` (the decoder, fused projections, logits
only for the rows that are sampled).
"""
