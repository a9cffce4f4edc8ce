"""What a request may ask for beyond the core draw, and where each feature plugs in.

A plain request is sampled by the core draw alone (`sampler.py`). Anything more is a
feature with a module of its own, added to the engine the first time a request asks for
it and imported only then:

| a request asks for | plugs in as | module |
|---|---|---|
| repetition / presence / frequency penalties, `logit_bias`, `allowed_token_ids` | logits processors of the sampler | `penalties.py` |
| `structured_output` | a logits processor (the grammar's mask) and a matcher on the request | `grammar.py` |
| `logprobs` | the sampler's final copy, which brings them along | `logprobs.py` |
| `prompt_logprobs` | an output hook of the runner (extra rows of logits) | `logprobs.py` |
| an embedding (`PoolingParams`) | an output hook of the runner (the final hidden state) | `pooling.py` |

Invariant: a feature, once plugged in, leaves the rows that do not ask for it exactly as
the core draw would have them.
"""

from __future__ import annotations

from typing import Any

from nanoqwen.sampling.params import PoolingParams


def plug_in(request: Any, engine: Any) -> None:
    """Check what `request`'s params ask for beyond the core draw (`asks_for_more`), and plug
    in each feature it needs that `engine` (an `LLMEngine`) does not have yet."""
    from nanoqwen.sampling import penalties

    params, sampler = request.params, engine.runner.sampler
    params.check_token_ids(engine.model_config.vocab_size)
    for processor in penalties.for_params(params):
        sampler.add_processor(processor)
    if params.structured_output is not None:
        from nanoqwen.sampling.grammar import GrammarMasks, compiler_for

        request.grammar = compiler_for(engine).matcher(params.structured_output)
        sampler.add_processor(GrammarMasks)
    if params.logprobs is not None or params.prompt_logprobs is not None:
        from nanoqwen.sampling.logprobs import PromptScorer, with_logprobs

        request.logprobs = [] if params.logprobs is not None else None
        request.prompt_logprobs = [] if params.prompt_logprobs is not None else None
        sampler.to_host = with_logprobs
        plug_once(engine.runner.output_hooks, PromptScorer)


def plug_in_pooling(params: object, output_hooks: list[Any]) -> PoolingParams:
    """`params`, checked to be `PoolingParams`, with the pooling output hook plugged in."""
    from nanoqwen.sampling.pooling import Pooler

    if not isinstance(params, PoolingParams):
        raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
    plug_once(output_hooks, Pooler)
    return params


def plug_once(hooks: list[Any], hook_class: type) -> None:
    """Add a `hook_class` to `hooks` unless one is there already."""
    if not any(type(hook) is hook_class for hook in hooks):
        hooks.append(hook_class())
