"""Who runs this step, and how many tokens each: continuous batching.

Read `request.py` (one request's state from arrival to last token), `waiting_queue.py`
(arrival order, or priority aged by waiting time) and `scheduler.py` (the token budget,
chunked prefill, admission, preemption by recompute, and the rows one `schedule()` call
hands the runner).
"""
