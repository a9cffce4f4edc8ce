"""From a scheduled batch to sampled tokens, on the model's device.

Read `step_inputs.py` (a batch flattened into the tensors the model reads), `runner.py`
(the model, its KV pool, the backend and the sampler behind one `run(batch)`),
`cuda_graph.py` (decode steps replayed from CUDA graphs, padded to buckets) and
`memory_profile.py` (measuring what a GPU needs beside the KV cache).
"""
