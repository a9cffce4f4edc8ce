"""nanoqwen: a minimal, readable, fast inference engine for Qwen2 and Qwen3."""

from nanoqwen.engine import LLMEngine, RequestOutput, StepError
from nanoqwen.llm import LLM
from nanoqwen.sampler import SamplingParams

__all__ = ["LLM", "LLMEngine", "RequestOutput", "SamplingParams", "StepError"]
