"""Who runs this step, and how many tokens each: continuous batching.

Read `request.py` (one request's state from arrival to last token), `waiting_queue.py`
(arrival order, or priority aged by waiting time) and `scheduler.py` (the token budget,
chunked prefill, admission, preemption by recompute, and the rows one `schedule()` call
hands the runner). Beside them, used only when an engine asks: `policies.py` (earliest
deadline, shortest prompt, fair turns between users, a cap per user) and `swapping.py`
(preemption that keeps a host copy of the pages).
"""
