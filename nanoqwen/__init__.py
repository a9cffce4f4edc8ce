"""nanoqwen: a minimal, readable, fast inference engine for Qwen2 and Qwen3."""

from nanoqwen.engine import LLMEngine
from nanoqwen.llm import LLM
from nanoqwen.outputs import RequestOutput, StepError
from nanoqwen.sampling.grammar import StructuredOutput
from nanoqwen.sampling.logprobs import TokenLogprobs
from nanoqwen.sampling.params import SamplingParams
from nanoqwen.sampling.pooling import PoolingParams

__all__ = [
    "LLM", "LLMEngine", "PoolingParams", "RequestOutput", "SamplingParams", "StepError",
    "StructuredOutput", "TokenLogprobs",
]
