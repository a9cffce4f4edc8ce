"""Picking each request's next token, every request with its own settings, in one batch.

Read `params.py` (`SamplingParams`, checked once by `validation.py`) and `sampler.py` (the
core draw: temperature, top-k/top-p/min-p and seeded draws, vectorised across rows). What a
request may ask for beyond it plugs in when first asked for (`extras.py`): `penalties.py`
(penalties, logit bias, allowed ids), `grammar.py` (structured outputs, their spec in
`structured.py`; a server compiles them first in `grammar_sandbox.py`'s worker process,
`grammar_worker.py`), `logprobs.py` and `pooling.py` (embeddings).
"""
