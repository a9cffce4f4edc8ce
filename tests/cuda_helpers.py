"""What the CUDA-path tests share: skip conditions, a head_dim-64 model, random steps.

The tiny test models have a head size (16) flashinfer has no kernels for, so tests of the
flashinfer path build their own: a Qwen2 with head_dim 64, with one KV head per query
head ("mha") or groups of 4 ("gqa4", where decode runs on tensor cores).

Each test says what it needs with `needs_cuda` (a GPU; torch alone) or `needs_flashinfer`
(a GPU and flashinfer), so a machine without them reports every skipped test by name.
"""

import importlib.util
import random

import pytest
import torch

from checkpoints import build_qwen2
from nanoqwen.batch import StepInputs, StepInputsBuilder
from nanoqwen.kv_pool import KVPool

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_flashinfer = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("flashinfer") is None,
    reason="needs a CUDA GPU and flashinfer (pip install -e \".[cuda]\")",
)


def build_model_64(directory, num_key_value_heads: int, **overrides) -> str:
    return build_qwen2(
        directory, hidden_size=256, num_attention_heads=4,
        num_key_value_heads=num_key_value_heads, **overrides,
    )


@pytest.fixture(scope="module", params=[4, 1], ids=["mha", "gqa4"])
def model_64(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_model_64(tmp_path_factory.mktemp(f"qwen2_kv{request.param}"), request.param)


def random_step(pool: KVPool, rows: list[tuple[int, int]], seed: int) -> StepInputs:
    """A step over `rows` (cached tokens, new tokens), each request on distinct random
    pages of `pool`, every row sampled."""
    rng = random.Random(seed)
    free = list(range(1, pool.num_pages))
    rng.shuffle(free)
    builder = StepInputsBuilder(pool.page_size)
    for cached, new in rows:
        pages = [free.pop() for _ in range(-(-(cached + new) // pool.page_size))]
        builder.add_row([0] * new, cached, pages, sample=True)
    return builder.build(pool.kv.device, [])
