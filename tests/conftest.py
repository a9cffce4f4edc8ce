"""Session-wide fixtures: tiny random Qwen2 and Qwen3 checkpoints, built once per run."""

import pytest

from tools.checkpoints import build_qwen2, build_qwen3


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
