"""Steps laid out by hand: rows of requests that hold given pages, as the runner lays them out.

The attention and graph tests build page tables directly (random pages, odd lengths) rather
than through a scheduler; `step_of` hands them to the runner's own layout (`lay_out`), so
they read exactly the tensors a real step would.
"""

from types import SimpleNamespace

import torch

from nanoqwen.runner.runner import StepInputs, lay_out
from nanoqwen.scheduling.scheduler import Row

# (position of the first new token, the new tokens, the request's pages, rows sampled)
HandRow = tuple[int, list[int], list[int], int]


def step_of(
    rows: list[HandRow], page_size: int, device: torch.device = torch.device("cpu"),
    pad_to: int = 0,
) -> StepInputs:
    """A step of `rows`, padded with scratch-page rows up to `pad_to` requests."""
    laid = [Row(SimpleNamespace(pages=pages), start, tokens, num_sampled)  # type: ignore[arg-type]
            for start, tokens, pages, num_sampled in rows]
    return lay_out(laid, page_size, device, pad_to)
