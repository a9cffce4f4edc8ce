"""The Qwen decoder, shaped for serving: a flat batch of tokens from many requests.

Read `config.py` (the model's shape, and the kinds each layer is made of), `layers.py`
(RMSNorm, RoPE, and linear layers that split themselves across ranks, loaded by
`loading.py`) and `qwen.py` (the decoder composed of layer kinds, fused projections,
logits only for the rows that are sampled). The newer kinds: `moe.py` (a mixture of
experts), `gated_attention.py` and `gated_deltanet.py` with its maths in `delta_rule.py`
(the hybrid models' layers). Besides: `rope_scaling.py` (dynamic RoPE, per request) and
`packed.py` (weights prepacked for oneDNN on a CPU, a weight form of the loader).
"""
