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

Every engine a test builds names its device (`device="cpu"`, or "cuda" in a test marked
`cuda`; `--device` for the commands it starts): left to choose, an engine takes the GPU
where there is one, and a test written for the CPU (float32 against transformers, ranks
as CPU processes) fails there. `tests_name_their_device` refuses an engine that does not
say, on any machine, so a test that forgets fails here too, not only on a GPU. Code written
for readers names no device; a test that runs it asks for `a_machine_without_a_gpu`.

Under xdist each worker takes its share of the cores for torch's threads (OMP_NUM_THREADS,
set before torch is imported, and inherited by the processes the tests start): two workers
of two threads on a 2-core machine keep descheduling each other's threads in the middle of
parallel regions, which then wait for them: tests that compute took about twice as long.
A test that needs a thread count sets it.

Ctrl-C raises `KeyboardInterrupt` in the tests and in the processes they start, as from a
terminal, whatever the run inherited: a job started in the background (`pytest … &`, as
many CI runners start one) comes with SIGINT ignored, which every child would inherit.
"""

import os
import signal

if os.environ.get("NANOQWEN_TEST_KERNELS") != "native":
    os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:  # set by xdist in its workers
    cores_each = (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores_each)))

from collections.abc import Callable, Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import openai  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from server_helpers import client_for, running_server  # noqa: E402

from nanoqwen import config  # noqa: E402
from nanoqwen.server import OpenAIServer  # noqa: E402
from nanoqwen.weights import loader  # noqa: E402
from tools.checkpoints import (  # noqa: E402
    build_qwen2,
    build_qwen2_moe,
    build_qwen3,
    build_qwen3_5,
    build_qwen3_5_moe,
    build_qwen3_moe,
    build_qwen3_next,
)


@pytest.fixture(scope="session", autouse=True)
def ctrl_c_raises() -> Iterator[None]:
    """Python's own SIGINT handler for the run (a handler, unlike an ignored signal, is
    not inherited: the processes the tests start begin with the default and install it
    too); what was inherited comes back at the end."""
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    if inherited is not None:  # None: set outside Python, and so left as it is now
        signal.signal(signal.SIGINT, inherited)


CHOOSE_DEVICE = config.resolve_device  # the engine's own choice, before the suite refuses it


@pytest.fixture(scope="session", autouse=True)
def tests_name_their_device() -> Iterator[None]:
    """An engine built with no device is refused (see the module docstring)."""

    def named(device: object) -> torch.device:
        if device is None:
            raise ValueError(
                "a test names its engine's device: device='cpu', or 'cuda' in a test marked cuda"
            )
        return CHOOSE_DEVICE(device)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(config, "resolve_device", named)
        yield


@pytest.fixture
def a_machine_without_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine left to choose takes the CPU, as on a reader's machine without a GPU: for
    code written for readers (the learning path's blocks), which names no device."""
    monkeypatch.setattr(
        config, "resolve_device", lambda device: CHOOSE_DEVICE("cpu" if device is None else device)
    )


@pytest.fixture
def weights_as_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Models keep their linear weights as the checkpoint gave them, not prepacked for
    oneDNN as a CPU's float32 model is (`model/packed.py`): for tests that read `.weight`
    (a packed weight is an opaque tensor only oneDNN's matmul reads)."""
    chosen = loader.weight_form

    def unpacked(*args: object) -> str | None:
        form = chosen(*args)
        return None if form == "onednn_packed" else form

    monkeypatch.setattr(loader, "weight_form", unpacked)


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
