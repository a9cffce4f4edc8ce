"""The test suite passes wherever it is started: from a terminal or a background job, on a
machine with a GPU or without."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanoqwen import LLM

REPO = Path(__file__).resolve().parents[1]
# Set for the run started below, which alone runs the test that reads it.
INNER_RUN = "NANOQWEN_SUITE_INNER_RUN"


@pytest.mark.skipif(INNER_RUN not in os.environ, reason="run by the test below")
def test_ctrl_c_raises_in_a_test_and_in_the_processes_it_starts() -> None:
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
    child = ("import signal, sys; "
             "sys.exit(signal.getsignal(signal.SIGINT) is not signal.default_int_handler)")
    assert subprocess.run([sys.executable, "-c", child]).returncode == 0


def test_a_run_started_with_ctrl_c_ignored_sees_it_as_from_a_terminal() -> None:
    """A background job (`pytest … &`) starts with SIGINT ignored, which Ctrl-C tests (chat's,
    tensor parallelism's) rely on reaching them; the suite installs Python's own handler."""
    inner = f"{Path(__file__)}::test_ctrl_c_raises_in_a_test_and_in_the_processes_it_starts"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "--no-cov", inner],
        cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, INNER_RUN: "1"},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    assert result.returncode == 0 and "1 passed" in result.stdout, result.stdout + result.stderr


def test_an_engine_without_a_device_is_refused(qwen3_dir: str) -> None:
    """Left to choose, an engine would take a GPU where there is one; tests say which."""
    with pytest.raises(ValueError, match="a test names its engine's device"):
        LLM(qwen3_dir)
    assert LLM(qwen3_dir, device="cpu").engine.device == torch.device("cpu")
