"""nanoqwen: a minimal, readable, fast inference engine for Qwen2 and Qwen3.

Importing it first sets two things torch reads once, as it loads, unless the environment
says otherwise (`PROCESS_DEFAULTS`):

* OpenMP lets torch's threads spin a little (`GOMP_SPINCOUNT`) at the end of each parallel
  region before they sleep: a decode step is a hundred-odd regions microseconds apart, and
  waking a sleeping thread for each cost 25% of a step on 2 cores. Spinning only pays on
  idle cores, so the runner also uses only the cores others leave free
  (`runner/cpu_threads.py` has the figures).
* torch's CPU allocator asks for transparent huge pages (`THP_MEM_ALLOC_ENABLE`) for
  buffers of 2 MB and more, the weights and the KV cache among them: a decode step streams
  every weight through the TLB, 4 KB pages at a time otherwise, and evicts the entries the
  small ops between the matmuls need. Measured on 2 cores, Qwen2.5-1.5B in bfloat16, batch
  1, in 9 pairs of runs a minute apart: faster in 8, by 7% at the median.
"""

import os

PROCESS_DEFAULTS = {"GOMP_SPINCOUNT": "100000", "THP_MEM_ALLOC_ENABLE": "1"}
# What this import set (the rest the environment had chosen): another program started from
# this process, such as a peer engine in bench.py, gets the environment without it.
SET_ON_IMPORT = {name: value for name, value in PROCESS_DEFAULTS.items() if name not in os.environ}
os.environ.update(SET_ON_IMPORT)

from nanoqwen.engine import LLMEngine  # noqa: E402 (torch loads after the defaults are set)
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
