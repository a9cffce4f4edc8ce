"""nanoqwen: a minimal, readable, fast inference engine for Qwen2 and Qwen3.

Importing it first sets OpenMP's wait policy to passive (unless the environment says
otherwise), before torch loads OpenMP, which reads it once: torch's threads then sleep at
the end of each parallel region instead of spinning. A decode step is hundreds of small
parallel regions, and spinning threads steal the core a descheduled one needs as soon as
another process shares the cores: measured on 2 cores with one busy process beside
nanoqwen, batch-1 decode kept 56% of its quiet speed passive and 31% spinning, for 2-4%
of quiet speed (docs/benchmarks.md, "On a CPU, beside vLLM and llama.cpp", has the figures
and commands).
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from nanoqwen.engine import LLMEngine  # noqa: E402 (torch loads after the policy is set)
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
