"""A stand-in for vLLM with the slice of its API `tools/peers/vllm_runner.py` uses, so that
`bench.py --compare vllm` can be tested where vLLM is not installed. Its "model" continues
every prompt with the same arithmetic on token ids, one token per request per step."""

import os
import re

__version__ = "0.0-fake"
VOCAB = 600


def check_thread_binding() -> None:
    """Refuse a CPU thread binding as vLLM 0.32 does: `auto`, `nobind`, or lists of cores
    (`0,1`, `0-3`, ranks apart by `|`); anything else (`all`) fails its engine's start."""
    binding = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    if binding not in ("auto", "nobind") and not re.fullmatch(r"[\d,\-|]+", binding):
        raise ValueError(f"invalid literal for int() with base 10: {binding!r}")


class SamplingParams:
    def __init__(self, temperature: float, max_tokens: int, ignore_eos: bool) -> None:
        assert temperature == 0.0 and ignore_eos  # bench compares greedy, EOS ignored
        self.max_tokens = max_tokens


class _Completion:
    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids


class _Output:
    def __init__(self, request_id: str, token_ids: list[int], finished: bool) -> None:
        self.request_id, self.outputs, self.finished = request_id, [_Completion(token_ids)], finished


class _Engine:
    def __init__(self) -> None:
        self.requests: dict[str, tuple[list[int], list[int], int]] = {}

    def add_request(self, request_id: str, prompt: dict, params: SamplingParams) -> None:
        self.requests[request_id] = (list(prompt["prompt_token_ids"]), [], params.max_tokens)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[_Output]:
        outputs = []
        for request_id, (prompt, tokens, max_tokens) in list(self.requests.items()):
            tokens.append(next_token(prompt + tokens))
            finished = len(tokens) == max_tokens
            outputs.append(_Output(request_id, list(tokens), finished))
            if finished:
                del self.requests[request_id]
        return outputs


def next_token(tokens: list[int]) -> int:
    return (tokens[-1] * 7 + 3) % VOCAB


class LLM:
    def __init__(self, model: str, dtype: str, max_model_len: int, max_num_seqs: int,
                 enforce_eager: bool, seed: int) -> None:
        check_thread_binding()
        self.llm_engine = _Engine()

    def generate(self, prompts: list[dict], params: SamplingParams, use_tqdm: bool) -> list:
        for index, prompt in enumerate(prompts):
            self.llm_engine.add_request(f"warm-{index}", prompt, params)
        while self.llm_engine.has_unfinished_requests():
            self.llm_engine.step()
        return []
