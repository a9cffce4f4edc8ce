"""Tensor parallelism: one model split across ranks (GPUs, or CPU processes).

How each weight splits lives with the layers that split it (`model/layers.py`), so the
decoder reads like the one-device model; this room is what runs around it. Read
`launch.py` (checks, then starting the ranks), `split_runner.py` (rank 0's runner, which
sends each step to the others), `worker.py` (a worker process's life), `workers.py` (rank
0's handle on them: steps, deaths, shutdown) and `step_broadcast.py` (each step's inputs
sent from rank 0 to the others). The story, with a picture of the split:
docs/learn/13-tensor-parallelism.md.
"""
