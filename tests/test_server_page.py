"""The chat page at `/`, in a real headless Chromium driven by Playwright: type a message,
watch the reply stream into the page.

It needs the `playwright` package (in the `test` extra) and a Chromium binary: Debian's
(`apt-get install chromium`) is found on the PATH, or name one in NANOQWEN_CHROMIUM.
Playwright's own browser downloads are never used. Without both, the test is skipped.
"""

from __future__ import annotations

import os
import shutil

import pytest
from server_helpers import ENGINE_OPTIONS, MODEL, running_server

from nanoqwen import LLM, SamplingParams

CHROMIUM = (
    os.environ.get("NANOQWEN_CHROMIUM") or shutil.which("chromium")
    or shutil.which("chromium-browser")
)
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
]
MAX_TOKENS = 12

playwright_api = pytest.importorskip(
    "playwright.sync_api", reason="the browser test needs playwright (pip install playwright)"
)
pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="the browser test needs Chromium (apt-get install chromium, or set NANOQWEN_CHROMIUM)",
)


def test_the_page_streams_a_reply(qwen3_dir: str) -> None:
    message = "the quick brown fox"
    with running_server(qwen3_dir) as server:
        defaults = server.engine.tokenizer.sampling_defaults
        greedy = SamplingParams(**{**defaults, "temperature": 0, "max_tokens": MAX_TOKENS})
        expected = LLM(qwen3_dir, **ENGINE_OPTIONS).chat(
            [{"role": "user", "content": message}], greedy
        )[0].text
        assert expected  # a reply that could fail to show

        host, port = server.server_address[:2]
        failed_responses: list[str] = []
        with playwright_api.sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page()
                page.on("response", lambda response: response.status >= 400
                        and failed_responses.append(f"{response.status} {response.url}"))
                page.goto(f"http://{host}:{port}/")
                # The page shows the model's id and its default temperature once loaded.
                page.wait_for_function(
                    "document.getElementById('model').textContent !== ''", timeout=10_000
                )
                assert page.text_content("#model") == MODEL
                assert float(page.input_value("#temperature")) == defaults["temperature"]

                page.fill("#temperature", "0")
                page.fill("#max-tokens", str(MAX_TOKENS))
                page.fill("#input", message)
                page.press("#input", "Enter")
                page.wait_for_function(
                    "document.querySelector('.assistant') !== null"
                    " && !document.getElementById('send').disabled",
                    timeout=30_000,
                )
                assert page.text_content(".assistant") == expected
                assert page.query_selector(".error") is None
            finally:
                browser.close()
        assert failed_responses == []
