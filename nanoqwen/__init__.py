"""nanoqwen: a minimal, readable, fast inference engine for Qwen2 and Qwen3.

Importing it first tells OpenMP, before torch loads it (it reads its settings once), to let
torch's threads spin a little (`GOMP_SPINCOUNT`, unless the environment says otherwise) at
the end of each parallel region before they sleep: a decode step is a hundred-odd regions
microseconds apart, and waking a sleeping thread for each cost 25% of a step on 2 cores.
Spinning only pays on idle cores, so the runner also uses only the cores other processes
leave free (`runner/cpu_threads.py` has the figures).
"""

import os

os.environ.setdefault("GOMP_SPINCOUNT", "100000")

from nanoqwen.engine import LLMEngine  # noqa: E402 (torch loads after the spin count is set)
from nanoqwen.llm import LLM  # noqa: E402
from nanoqwen.outputs import RequestOutput, StepError  # noqa: E402
from nanoqwen.sampling.grammar import StructuredOutput  # noqa: E402
from nanoqwen.sampling.logprobs import TokenLogprobs  # noqa: E402
from nanoqwen.sampling.params import SamplingParams  # noqa: E402
from nanoqwen.sampling.pooling import PoolingParams  # noqa: E402

__all__ = [
    "LLM", "LLMEngine", "PoolingParams", "RequestOutput", "SamplingParams", "StepError",
    "StructuredOutput", "TokenLogprobs",
]
