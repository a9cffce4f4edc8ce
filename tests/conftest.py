"""Shared fixtures: tiny random Qwen2 and Qwen3 checkpoints, built once per run, and a
server on the Qwen3 one with an openai client, started once per test module that asks
(a module that needs other server options defines its own `server`).

The tests compare against transformers in float32, the CPU's default dtype unless the CPU
multiplies bfloat16 in hardware. Whatever CPU runs them, they run torch's AVX2 kernels
(torch's own `ATEN_CPU_CAPABILITY`, set before torch is imported, and inherited by the
processes the tests start), so the default is float32 everywhere.

A user's CPU runs its own kernels, and bfloat16 by default where it has bf16 units. So the
tests marked `native_kernels` (the learning path's blocks, greedy tokens against
transformers, the prefix cache, preemption) run a second time in CI without the pin:

    NANOQWEN_TEST_KERNELS=native pytest -m native_kernels --no-cov

and hold a bfloat16 engine to the bfloat16-aware oracle (`oracle.assert_greedy_matches`).
"""

import os

if os.environ.get("NANOQWEN_TEST_KERNELS") != "native":
    os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")

from collections.abc import Callable, Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import openai  # noqa: E402
import pytest  # noqa: E402
from server_helpers import client_for, running_server  # noqa: E402

from nanoqwen.server import OpenAIServer  # noqa: E402
from tools.checkpoints import (  # noqa: E402
    build_qwen2,
    build_qwen2_moe,
    build_qwen3,
    build_qwen3_5,
    build_qwen3_5_moe,
    build_qwen3_moe,
    build_qwen3_next,
)


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_qwen2(tmp_path_factory.mktemp("qwen2"))


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_qwen3(tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="session", params=["qwen2", "qwen3"])
def model_dir(request: pytest.FixtureRequest) -> str:
    """Each test using this runs once per architecture."""
    return request.getfixturevalue(f"{request.param}_dir")


@pytest.fixture(scope="session")
def tokenizer_dir(qwen3_dir: str) -> str:
    """Both checkpoints share one tokenizer; any model directory holds it."""
    return qwen3_dir


# The newer kinds: mixture-of-experts and hybrid (linear-attention) decoders.
NEWER_KINDS = {
    "qwen2_moe": build_qwen2_moe, "qwen3_moe": build_qwen3_moe, "qwen3_next": build_qwen3_next,
    "qwen3_5": build_qwen3_5, "qwen3_5_moe": build_qwen3_5_moe,
}


@pytest.fixture(scope="session")
def newer_kind_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A tiny checkpoint of each newer kind, built on first use."""
    return _LazyCheckpoints(tmp_path_factory, lambda kind, directory: NEWER_KINDS[kind](directory))


class _LazyCheckpoints(dict):
    def __init__(self, factory: pytest.TempPathFactory, build: Callable[[str, Path], str]) -> None:
        super().__init__()
        self.factory, self.build = factory, build

    def __missing__(self, kind: str) -> str:
        self[kind] = self.build(kind, self.factory.mktemp(kind))
        return self[kind]


@pytest.fixture(scope="session")
def picture_kind_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The tiny checkpoints the learning path's notes on the newer kinds run and draw from
    (`tools/learn_pictures.py`'s `build_kind`), built on first use."""
    from tools.learn_pictures import build_kind

    return _LazyCheckpoints(tmp_path_factory, build_kind)


@pytest.fixture(scope="module")
def server(qwen3_dir: str) -> Iterator[OpenAIServer]:
    with running_server(qwen3_dir) as server:
        yield server


@pytest.fixture(scope="module")
def client(server: OpenAIServer) -> Iterator[openai.OpenAI]:
    with client_for(server) as client:
        yield client
