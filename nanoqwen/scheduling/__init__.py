"""Who runs this step, and how many tokens each: continuous batching.

Read `request.py` (one request's state from arrival to last token), `waiting_queue.py`
(arrival order, or priority aged by waiting time), `scheduler.py` (the token budget,
chunked prefill, admission, preemption by recompute) and `batch.py` (the decision one
`schedule()` call hands the runner).
"""
