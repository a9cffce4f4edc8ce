"""nanoqwen: a minimal, readable, fast inference engine for Qwen2 and Qwen3."""

from nanoqwen.engine import LLMEngine
from nanoqwen.llm import LLM
from nanoqwen.outputs import RequestOutput, StepError
from nanoqwen.sampling.params import SamplingParams

__all__ = ["LLM", "LLMEngine", "RequestOutput", "SamplingParams", "StepError"]
