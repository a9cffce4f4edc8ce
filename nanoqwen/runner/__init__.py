"""From a step's rows to their new tokens, on the model's device.

Read `runner.py` (lay out, forward, choose tokens: the one runner, and the hooks features
attach at), `startup.py` (load, size the KV cache, allocate it) and `cpu_threads.py` (a CPU
step on the cores others leave free). On a GPU: `cuda_graph.py` (decode steps replayed
from CUDA graphs, padded to buckets) and `memory_profile.py` (measuring what the engine
needs beside the KV cache).
"""
