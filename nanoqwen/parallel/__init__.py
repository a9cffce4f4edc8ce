"""Tensor parallelism: one model split across ranks (GPUs, or CPU processes).

Read `sharding.py` (which slice of every weight a rank holds, and the collectives),
`workers.py` (starting, watching and stopping the other ranks) and `step_broadcast.py`
(each step's inputs sent from rank 0 to the others).
"""
