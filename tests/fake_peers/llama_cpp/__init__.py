"""A stand-in for llama-cpp-python with the slice of its API
`tools/peers/llamacpp_runner.py` uses, so that `bench.py --compare llamacpp` can be tested
where llama.cpp is not installed: the same arithmetic "model" as the fake vLLM's."""

import os

__version__ = "0.0-fake"
VOCAB = 600


class Llama:
    def __init__(self, model_path: str, n_ctx: int, n_batch: int, n_threads: int,
                 n_threads_batch: int, verbose: bool) -> None:
        assert os.path.isfile(model_path) and model_path.endswith(".gguf")
        self.tokens: list[int] = []

    def reset(self) -> None:
        self.tokens = []

    def eval(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)

    def sample(self, top_k: int, temp: float) -> int:
        assert top_k == 1  # greedy
        return (self.tokens[-1] * 7 + 3) % VOCAB
