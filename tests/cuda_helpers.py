"""What the CUDA-path tests share: skip conditions, a head_dim-64 model, random steps.

The tiny test models have a head size (16) flashinfer has no kernels for, so tests of the
flashinfer path build their own: a Qwen2 with head_dim 64, with one KV head per query
head ("mha") or groups of 4 ("gqa4", where decode runs on tensor cores).

Each test says what it needs with `needs_cuda` (a GPU; torch alone) or `needs_flashinfer`
(a GPU and flashinfer), so a machine without them reports every skipped test by name.
"""

import gc
import importlib.util
import random
import re
import threading
from pathlib import Path

import pytest
import torch
from oracle import greedy, run_to_completion
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from steps import step_of

from nanoqwen import LLMEngine
from nanoqwen.memory.kv_cache import KVCache
from nanoqwen.runner.runner import StepInputs
from tools.checkpoints import build_qwen2

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_flashinfer = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("flashinfer") is None,
    reason="needs a CUDA GPU and flashinfer (pip install -e \".[cuda]\")",
)

# The first flashinfer release that reads FLASHINFER_DISABLE_JIT (a host that cannot compile).
FLASHINFER_DISABLE_JIT_SINCE = Version("0.4.0")
PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def declared_flashinfer_range() -> SpecifierSet:
    """The flashinfer-python versions pyproject's `cuda` extra declares."""
    match = re.search(r'"flashinfer-python([^";]*)"', PYPROJECT.read_text())
    assert match, "pyproject.toml declares no flashinfer-python"
    return SpecifierSet(match.group(1))


# (cached tokens, new tokens) per request of a step.
PREFILL_WITH_PREFIX = [(0, 37), (33, 20), (64, 16), (5, 120)]
DECODE = [(0, 1), (15, 1), (16, 1), (200, 1), (47, 1)]
MIXED = [(40, 1), (0, 25), (100, 1), (17, 9)]


@pytest.fixture
def empty_gpu():
    """Tests measure the GPU as the one before left it: give memory back after each."""
    yield
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def build_model_64(directory, num_key_value_heads: int, **overrides) -> str:
    return build_qwen2(
        directory, hidden_size=256, num_attention_heads=4,
        num_key_value_heads=num_key_value_heads, **overrides,
    )


@pytest.fixture(scope="module", params=[4, 1], ids=["mha", "gqa4"])
def model_64(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_model_64(tmp_path_factory.mktemp(f"qwen2_kv{request.param}"), request.param)


def random_step(pool: KVCache, rows: list[tuple[int, int]], seed: int) -> StepInputs:
    """A step over `rows` (cached tokens, new tokens), each request on distinct random
    pages of `pool`, every row sampled."""
    rng = random.Random(seed)
    free = list(range(1, pool.num_pages))
    rng.shuffle(free)
    hand_rows = []
    for cached, new in rows:
        pages = [free.pop() for _ in range(-(-(cached + new) // pool.page_size))]
        hand_rows.append((cached, [0] * new, pages, 1))
    return step_of(hand_rows, pool.page_size, pool.kv.device)


def greedy_outputs(
    engine: LLMEngine, prompts: list[list[int]], max_tokens: int, in_thread: bool = False
) -> list[list[int]]:
    """Greedy outputs of `prompts`, stepped from this thread or from a new one (as a
    server's engine thread steps an engine built elsewhere)."""
    outputs: list[list[int]] = []

    def generate() -> None:
        ids = [engine.add_request(prompt, greedy(max_tokens)) for prompt in prompts]
        final = run_to_completion(engine)
        outputs.extend(final[i].token_ids for i in ids)

    if not in_thread:
        generate()
        return outputs
    thread = threading.Thread(target=generate)
    thread.start()
    thread.join()
    return outputs
