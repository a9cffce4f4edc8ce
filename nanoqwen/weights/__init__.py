"""Checkpoints into the model: safetensors, GGUF and GPTQ/AWQ files, and weight forms.

Read `checkpoint.py` (what a model name points to, and its config), `loader.py` (weights
streamed into the fused model, then kept in a weight form), `formats.py` (how a checkpoint
stores its weights), then the formats it reads besides plain safetensors: `gguf.py`
(llama.cpp files), `gptq_awq.py` (packed integer checkpoints), and `quantization.py`
(linear weights kept as int8/int4), with `gguf_codes.py` (a 4-bit GGUF file loaded
straight into its codes).
"""
