"""What a step hands back: one `RequestOutput` per request that moved, or a `StepError`.

A request's output carries both its whole text so far and what changed in this step
(`delta_text`, `delta_token_ids`): a script reads the last one, a stream sends the deltas
(and the last `len(delta_token_ids)` entries of `logprobs`, when it asked for them).
`finished` is set once, on the last output, with the reason the request ended ("error":
a feature could not go on with it, and it alone ended; `error` says why).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenLogprobs:
    """One position: the token there, its log-probability, and the likeliest tokens'
    (`sampling/logprobs.py` computes them)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, log-probability), most likely first


@dataclass
class RequestOutput:
    """A request's progress after a step; the last one has `finished=True`."""

    request_id: str
    prompt_token_ids: list[int]  # shared with the engine: read, don't modify
    token_ids: list[int]  # every token generated so far
    text: str  # every released character so far (stop strings excluded)
    delta_token_ids: list[int]  # generated this step
    delta_text: str  # released this step: what a stream sends
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" once finished
    num_cached_tokens: int  # prompt tokens whose KV came from the prefix cache (0 until admitted)
    # What the request's params asked for besides text (`sampling/logprobs.py`): one entry
    # per generated token (in `token_ids`' order), and one per prompt token (None for the
    # first, which nothing predicts).
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    embedding: list[float] | None = None  # an embedding request's vector (`sampling/pooling.py`)
    # What ended a request that finished "stop": the stop string, or the stop token's id.
    stop_reason: str | int | None = None
    error: str | None = None  # why a request that finished "error" could not go on


class StepError(RuntimeError):
    """A step failed after its batch was scheduled (a bug, or a failing device).

    The batch's requests are still in the engine, untouched by the failed step: the caller
    decides their fate (a server aborts them and answers 500, then keeps serving). Requests
    the same step had already finished (the scheduler's out-of-memory ones) are in
    `finished`, with their final outputs. The original exception is the `__cause__`.
    """

    def __init__(self, request_ids: list[str], finished: list[RequestOutput]) -> None:
        super().__init__(f"the engine step failed for requests {', '.join(request_ids)}")
        self.request_ids = request_ids
        self.finished = finished
