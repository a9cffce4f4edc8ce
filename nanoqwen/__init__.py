"""nanoqwen: a minimal, readable, fast inference engine for the Qwen model families.

Importing it first tells OpenMP, before torch loads it (it reads its settings once), to let
torch's threads spin a little (`GOMP_SPINCOUNT`, unless the environment says otherwise) at
the end of each parallel region before they sleep: a decode step is a hundred-odd regions
microseconds apart, and waking a sleeping thread for each is a large share of a step on a
few cores (docs/benchmarks.md has the figures). Spinning only pays on idle cores, so the
runner also uses only the cores others leave free (`runner/cpu_threads.py`).

The teaching core, and the order to read it in: docs/learn/00-core.md.
"""

import os

PROCESS_DEFAULTS = {"GOMP_SPINCOUNT": "100000"}
# What this import set (the rest the environment had chosen): another program started from
# this process, such as a peer engine in bench.py, gets the environment without it.
SET_ON_IMPORT = {name: value for name, value in PROCESS_DEFAULTS.items() if name not in os.environ}
os.environ.update(SET_ON_IMPORT)

from nanoqwen.engine import LLMEngine  # noqa: E402 (torch loads after the defaults are set)
from nanoqwen.llm import LLM  # noqa: E402
from nanoqwen.outputs import RequestOutput, StepError, TokenLogprobs  # noqa: E402
from nanoqwen.sampling.params import PoolingParams, SamplingParams  # noqa: E402
from nanoqwen.sampling.structured import StructuredOutput  # noqa: E402

__all__ = [
    "LLM", "LLMEngine", "PoolingParams", "RequestOutput", "SamplingParams", "StepError",
    "StructuredOutput", "TokenLogprobs",
]
