"""The chat page at `/`: its files and headers over plain HTTP, and the page itself in a
real headless Chromium driven by Playwright (send, stream, stop, conversations kept across
reloads, edit and regenerate, markdown, errors, an over-long conversation, narrow screens).

The browser tests need the `playwright` package (in the `test` extra) and a Chromium
binary: Debian's (`apt-get install chromium`) is found on the PATH, or name one in
NANOQWEN_CHROMIUM. Playwright's own browser downloads are never used. Without both, the
browser tests are skipped.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
from collections.abc import Iterator
from typing import Any

import pytest
from server_helpers import (
    MODEL,
    call,
    client_for,
    no_pages_held,
    running_server,
    slow_down,
    wait_until,
)

from nanoqwen.server import OpenAIServer

CHROMIUM = (
    os.environ.get("NANOQWEN_CHROMIUM") or shutil.which("chromium")
    or shutil.which("chromium-browser")
)
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
]
MAX_TOKENS = 12
LONG_REPLY = 900  # max tokens for a reply that is still running when the test acts on it
STORE_KEY = "nanoqwen.conversations"
PAGE_FILES = {  # what `/` loads, and the type each must be served as
    "/": "text/html", "/static/chat.js": "text/javascript", "/static/chat.css": "text/css",
    "/static/vendor/marked.umd.js": "text/javascript",
    "/static/vendor/purify.min.js": "text/javascript",
}


@pytest.fixture(scope="module")
def server(qwen3_dir: str) -> Iterator[OpenAIServer]:
    with running_server(qwen3_dir) as server:
        yield server


@pytest.fixture(scope="module")
def slow_server(qwen3_dir: str) -> Iterator[OpenAIServer]:
    """A server whose replies take seconds, so a test can act while one streams."""
    with running_server(qwen3_dir) as server:
        slow_down(server)
        yield server


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if CHROMIUM is None:
        pytest.skip("the browser tests need Chromium (apt-get install chromium, "
                    "or set NANOQWEN_CHROMIUM)")
    playwright_api = pytest.importorskip(
        "playwright.sync_api", reason="the browser tests need playwright (pip install playwright)"
    )
    with playwright_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@contextlib.contextmanager
def open_page(
    browser: Any, server: OpenAIServer, width: int = 1280, **options: Any
) -> Iterator[Any]:
    """The chat page in a fresh browser profile (empty localStorage), its model loaded; no
    script on it may raise."""
    context = browser.new_context(viewport={"width": width, "height": 720}, **options)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    host, port = server.server_address[:2]
    try:
        page.goto(f"http://{host}:{port}/")
        wait_for_model(page)
        yield page
    finally:
        context.close()
    assert errors == []


def wait_for_model(page: Any) -> None:
    page.wait_for_selector("#model:not(:empty)", timeout=10_000)


def settings(page: Any, **fields: Any) -> None:
    """Fill in Settings fields by id (max_tokens -> #max-tokens), as a user would."""
    if not page.is_visible("#temperature"):
        page.click("#settings summary")
    for name, value in fields.items():
        selector = "#" + name.replace("_", "-")
        page.fill(selector, str(value))
        page.dispatch_event(selector, "change")


def send(page: Any, text: str) -> None:
    page.fill("#input", text)
    page.press("#input", "Enter")


def wait_until_idle(page: Any) -> None:
    """Until the reply in flight, if any, has finished or failed. (Waits are selectors:
    the page's Content-Security-Policy forbids the eval that wait_for_function needs.)"""
    page.wait_for_selector("body:not(.busy)", timeout=30_000)


def wait_for_first_token(page: Any) -> None:
    page.wait_for_selector(".assistant:last-child .content:not(:has(.thinking))",
                           state="attached", timeout=30_000)


def start_a_long_reply(page: Any) -> None:
    """Ask for a reply long enough to be interrupted, and wait until it has begun."""
    settings(page, max_tokens=LONG_REPLY)
    send(page, "tell me a long story")
    wait_for_first_token(page)


def stored(page: Any) -> dict[str, Any]:
    """The page's conversations as kept in localStorage."""
    return json.loads(page.evaluate(f"localStorage.getItem('{STORE_KEY}')"))


def messages(page: Any) -> list[dict[str, Any]]:
    """The current conversation's messages, as kept."""
    store = stored(page)
    [current] = [c for c in store["conversations"] if c["id"] == store["currentId"]]
    return current["messages"]


def preload(page: Any, conversation_messages: list[dict[str, str]]) -> None:
    """Start the page on one stored conversation holding `conversation_messages`."""
    store = {"conversations": [{"id": "c1", "system": "", "messages": conversation_messages,
                                "updated": 1}], "currentId": "c1"}
    page.evaluate("([key, value]) => localStorage.setItem(key, value)",
                  [STORE_KEY, json.dumps(store)])
    page.reload()
    wait_for_model(page)


def sidebar_titles(page: Any) -> list[str]:
    titles = "nodes => nodes.map(node => node.textContent)"
    return page.eval_on_selector_all("#conversations .open", titles)


def greedy_reply(server: OpenAIServer, chat: list[dict[str, str]]) -> Any:
    """What the API answers for `chat` at temperature 0 (the page must show the same)."""
    with client_for(server) as client:
        return client.chat.completions.create(
            model=MODEL, messages=chat, temperature=0, max_tokens=MAX_TOKENS
        )


def sse_body(text: str) -> str:
    """A whole chat stream carrying `text`, as the server would send it."""
    chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
              {"choices": [{"index": 0, "delta": {"content": text}}]}]
    return "".join(f"data: {json.dumps(chunk)}\n\n" for chunk in chunks) + "data: [DONE]\n\n"


# ---------------------------------------------------------------------------- over HTTP
def test_the_page_and_its_files_are_served_locked_down(server: OpenAIServer) -> None:
    status, _, page = call(server, "GET", "/")
    assert status == 200
    # Everything the page loads is served (no CDN), as the type it is.
    loaded = re.findall(r'(?:src|href)="([^"]+)"', page)
    assert sorted(loaded) == sorted(path for path in PAGE_FILES if path != "/")
    for path, content_type in PAGE_FILES.items():
        status, headers, _ = call(server, "GET", path)
        assert status == 200 and headers["Content-Type"].startswith(content_type), path
        policy = headers["Content-Security-Policy"]
        assert "script-src 'self'" in policy and "frame-ancestors 'none'" in policy
        assert "unsafe-inline" not in policy
        assert headers["X-Frame-Options"] == "DENY"
        assert headers["X-Content-Type-Options"] == "nosniff"


def test_page_files_are_cached_by_their_etag(server: OpenAIServer) -> None:
    status, headers, body = call(server, "GET", "/static/chat.js")
    etag = headers["ETag"]
    assert status == 200 and headers["Cache-Control"] == "no-cache" and body
    status, headers, body = call(server, "GET", "/static/chat.js", None, {"If-None-Match": etag})
    assert (status, body, headers["ETag"]) == (304, "", etag)
    status, _, body = call(server, "GET", "/static/chat.js", None, {"If-None-Match": '"stale"'})
    assert status == 200 and body


@pytest.mark.parametrize("path", [
    "/static/../routes.py", "/static/%2e%2e/routes.py", "/static/page.py", "/static/vendor",
    "/static/", "/static//chat.js", "/chat.js", "/static/vendor/../chat.js",
])
def test_only_the_page_files_are_served(server: OpenAIServer, path: str) -> None:
    status, _, body = call(server, "GET", path)
    assert (status, body["error"]["code"]) == (404, "not_found")


# ---------------------------------------------------------------------------- a reply
def test_the_page_streams_a_reply(browser: Any, server: OpenAIServer) -> None:
    message = "the quick brown fox"
    expected = greedy_reply(server, [{"role": "user", "content": message}])
    assert expected.choices[0].message.content  # a reply that could fail to show
    failed_responses: list[str] = []
    with open_page(browser, server) as page:
        page.on("response", lambda response: response.status >= 400
                and failed_responses.append(f"{response.status} {response.url}"))
        # The model's id, and its default temperature, once loaded.
        assert page.text_content("#model") == MODEL
        defaults = server.engine.tokenizer.sampling_defaults
        assert float(page.input_value("#temperature")) == defaults["temperature"]
        settings(page, temperature=0, max_tokens=MAX_TOKENS)
        send(page, message)
        wait_until_idle(page)
        [user, reply] = messages(page)
        assert user == {"role": "user", "content": message}
        assert reply["role"] == "assistant"
        assert reply["content"] == expected.choices[0].message.content
        stats, usage = reply["stats"], expected.usage
        assert (stats["completionTokens"], stats["promptTokens"]) == (
            usage.completion_tokens, usage.prompt_tokens)
        assert stats["ttft"] > 0 and stats["tokensPerSecond"] > 0
        shown = page.text_content(".assistant .stats")
        assert f"{usage.completion_tokens} tokens" in shown and "tokens/s" in shown
        assert "prompt tokens from cache" in shown
        # A reply that max_tokens ended says so; one that ended by itself doesn't.
        truncated = expected.choices[0].finish_reason == "length"
        assert reply.get("truncated", False) is truncated
        assert page.is_visible(".assistant >> text=max tokens reached") is truncated
        assert page.query_selector(".failed") is None
    assert failed_responses == []


def test_waiting_for_the_first_token_shows_the_time(browser: Any, server: OpenAIServer) -> None:
    with open_page(browser, server) as page:
        held: list[Any] = []  # the request, answered once the test has seen the wait
        page.route("**/v1/chat/completions", lambda route: held.append(route))
        send(page, "hello")
        page.wait_for_selector(".assistant .thinking:has-text('thinking… 1 s')")
        held[0].fulfill(status=200, content_type="text/event-stream", body=sse_body("Hi there"))
        wait_until_idle(page)
        assert page.query_selector(".thinking") is None
        assert page.text_content(".assistant .content p") == "Hi there"


def test_stop_keeps_the_partial_reply_marked_stopped(
    browser: Any, slow_server: OpenAIServer
) -> None:
    with open_page(browser, slow_server) as page:
        start_a_long_reply(page)
        page.click("#stop")
        wait_until_idle(page)
        [_, reply] = messages(page)
        assert reply["stopped"] is True and reply["content"]
        assert page.is_visible(".assistant .stopped")
        assert page.text_content(".assistant .stopped") == "stopped"
        # The server saw the client leave and freed what the reply held.
        wait_until(lambda: no_pages_held(slow_server))
        # The conversation goes on from the stopped reply.
        settings(page, max_tokens=3)
        send(page, "go on")
        wait_until_idle(page)
        assert [m["role"] for m in messages(page)] == ["user", "assistant"] * 2


# ---------------------------------------------------------------------------- history
def test_conversations_are_kept_across_reloads_and_switched(
    browser: Any, server: OpenAIServer
) -> None:
    with open_page(browser, server) as page:
        settings(page, temperature=0, max_tokens=3)
        send(page, "first topic")
        wait_until_idle(page)
        page.click("#new-chat")
        assert page.query_selector(".turn") is None
        send(page, "second topic")
        wait_until_idle(page)
        assert sidebar_titles(page) == ["second topic", "first topic"]

        page.reload()
        wait_for_model(page)
        assert sidebar_titles(page) == ["second topic", "first topic"]
        assert page.text_content(".user .content") == "second topic"
        assert len(page.query_selector_all(".assistant")) == 1
        assert page.input_value("#max-tokens") == "3"  # the settings are kept too

        page.click("#conversations .open >> text=first topic")
        assert page.text_content(".user .content") == "first topic"
        assert [m["content"] for m in messages(page)][0] == "first topic"
        page.once("dialog", lambda dialog: dialog.accept())
        page.click("#conversations li:has-text('second topic') .delete")
        assert sidebar_titles(page) == ["first topic"]
        page.reload()
        wait_for_model(page)
        assert sidebar_titles(page) == ["first topic"]


def test_another_tab_sees_new_conversations(browser: Any, server: OpenAIServer) -> None:
    with open_page(browser, server) as first:
        second = first.context.new_page()
        second.goto(first.url)
        wait_for_model(second)
        settings(first, max_tokens=3)
        send(first, "from the first tab")
        wait_until_idle(first)
        second.wait_for_selector("#conversations .open:has-text('from the first tab')")
        second.click("#new-chat")  # the second tab stays where it is as the first goes on
        send(first, "more")
        wait_until_idle(first)
        assert len(first.query_selector_all(".user")) == 2
        assert second.query_selector(".turn") is None


def test_edit_and_regenerate_reuse_the_prefix(browser: Any, server: OpenAIServer) -> None:
    with open_page(browser, server) as page:
        settings(page, temperature=0, max_tokens=MAX_TOKENS)
        for text in ("the quick brown fox", "jumps over the lazy dog"):
            send(page, text)
            wait_until_idle(page)
        first_replies = [m["content"] for m in messages(page)]

        # Regenerate the last answer: the same prompt again, greedy, so the same reply; the
        # prompt is the one just sent, so the server's prefix cache holds most of it.
        page.click(".assistant:last-child >> text=Regenerate")
        wait_until_idle(page)
        regenerated = messages(page)
        assert [m["content"] for m in regenerated] == first_replies
        assert regenerated[-1]["stats"]["cachedTokens"] > 0

        # Edit the first message: what followed it goes, and the edit is answered.
        page.click(".user >> nth=0 >> text=Edit")
        page.fill(".editor", "a b c")
        page.click("text=Save and regenerate")
        wait_until_idle(page)
        expected = greedy_reply(server, [{"role": "user", "content": "a b c"}])
        assert [(m["role"], m["content"]) for m in messages(page)] == [
            ("user", "a b c"), ("assistant", expected.choices[0].message.content)]
        assert len(page.query_selector_all(".turn")) == 2


# ---------------------------------------------------------------------------- rendering
MARKDOWN_REPLY = (
    "<think>\nFirst, **plan** it.\n</think>\n\n"  # Qwen3's reasoning, before the answer
    "Some **bold** text and [a link](https://example.org).\n\n"
    "```python\nprint('hi')\n```\n\n"
    "<script>window.injected = 1</script><img src=x onerror=\"window.injected = 2\">"
)


def test_markdown_is_rendered_and_sanitized(browser: Any, server: OpenAIServer) -> None:
    with open_page(browser, server, permissions=["clipboard-read", "clipboard-write"]) as page:
        page.route("**/v1/chat/completions", lambda route: route.fulfill(
            status=200, content_type="text/event-stream", body=sse_body(MARKDOWN_REPLY)))
        send(page, "show me markdown")
        wait_until_idle(page)
        reply = ".assistant .content"
        assert page.text_content(f"{reply} > p strong") == "bold"
        # The reasoning is folded away, rendered too.
        assert page.text_content(f"{reply} details.reasoning strong") == "plan"
        assert page.get_attribute(f"{reply} details.reasoning", "open") is None
        assert not page.is_visible(f"{reply} details.reasoning p")
        assert page.get_attribute(f"{reply} a", "rel") == "noopener noreferrer"
        assert page.text_content(f"{reply} pre") == "print('hi')\n"
        # The script neither ran nor stayed in the page; the handler was stripped.
        assert page.evaluate("window.injected") is None
        assert page.query_selector(f"{reply} script") is None
        assert page.get_attribute(f"{reply} img", "onerror") is None
        assert messages(page)[-1]["content"] == MARKDOWN_REPLY  # kept as the model wrote it

        page.click(f"{reply} .copy")
        assert page.evaluate("navigator.clipboard.readText()") == "print('hi')\n"
        assert page.text_content(f"{reply} .copy") == "Copied"


# ---------------------------------------------------------------------------- errors
def test_a_reply_cut_off_is_an_error_and_retry_recovers(
    browser: Any, slow_server: OpenAIServer
) -> None:
    with open_page(browser, slow_server) as page:
        start_a_long_reply(page)
        # As if the server died: its connections close mid-reply, without `data: [DONE]`.
        for connection in list(slow_server._connections):
            connection.shutdown(socket.SHUT_RDWR)
        page.wait_for_selector(".failed .error")
        assert "closed before the reply finished" in page.text_content(".failed .error")
        assert [m["role"] for m in messages(page)] == ["user"]  # no reply kept, empty or cut

        settings(page, max_tokens=3)
        page.click(".failed >> text=Retry")
        wait_until_idle(page)
        assert page.query_selector(".failed") is None
        assert [m["role"] for m in messages(page)] == ["user", "assistant"]


def test_a_server_stopping_mid_reply_says_so(browser: Any, qwen3_dir: str) -> None:
    with running_server(qwen3_dir) as server:
        slow_down(server)
        with open_page(browser, server) as page:
            start_a_long_reply(page)
            server.engine_loop.stop()  # what stopping the server does first
            page.wait_for_selector(".failed .error")
            assert page.text_content(".failed .error") == "the server is shutting down"
            assert [m["role"] for m in messages(page)] == ["user"]


def test_a_proxy_error_page_is_shown_readably(browser: Any, server: OpenAIServer) -> None:
    proxy_page = ("<html><head><style>body { color: red }</style></head><body>"
                  "<h1>502 Bad Gateway</h1><hr><center>nginx</center></body></html>")
    with open_page(browser, server) as page:
        settings(page, max_tokens=3)
        page.route("**/v1/chat/completions", lambda route: route.fulfill(
            status=502, content_type="text/html", body=proxy_page), times=1)
        send(page, "hello")
        page.wait_for_selector(".failed .error")
        error = page.text_content(".failed .error")
        assert "502" in error and "Bad Gateway" in error and "nginx" in error
        assert "JSON" not in error and "color" not in error
        assert [m["role"] for m in messages(page)] == ["user"]
        page.click(".failed >> text=Retry")  # the route answered once; now the server does
        wait_until_idle(page)
        assert [m["role"] for m in messages(page)] == ["user", "assistant"]


def test_a_missing_api_key_is_asked_for(browser: Any, qwen3_dir: str) -> None:
    with running_server(qwen3_dir, api_key="sesame") as server:
        context = browser.new_context()
        try:
            page = context.new_page()
            host, port = server.server_address[:2]
            page.goto(f"http://{host}:{port}/")
            page.wait_for_selector("#notice:has-text('API key')")
            assert page.is_visible("#key")  # Settings opened to it
            send(page, "hello")
            page.wait_for_selector(".failed .error")
            assert "API key" in page.text_content(".failed .error")
            settings(page, key="sesame", max_tokens=3)
            wait_for_model(page)
            page.click(".failed >> text=Retry")
            wait_until_idle(page)
            assert [m["role"] for m in messages(page)] == ["user", "assistant"]
        finally:
            context.close()


def test_an_over_long_conversation_drops_its_oldest_turns(
    browser: Any, server: OpenAIServer
) -> None:
    old_turns = []
    for topic in ("apples", "pears", "plums"):
        old_turns += [{"role": "user", "content": f"tell me about {topic} " * 40},
                      {"role": "assistant", "content": f"{topic} are fruit " * 40}]
    new_message = {"role": "user", "content": "and cherries?"}
    max_tokens = 300

    def prompt_tokens(chat: list[dict[str, str]]) -> int:
        return call(server, "POST", "/tokenize", {"messages": chat})[2]["count"]

    context = server.engine.max_model_len
    assert prompt_tokens(old_turns + [new_message]) + max_tokens > context  # it overflows
    with open_page(browser, server) as page:
        preload(page, old_turns)
        settings(page, max_tokens=max_tokens)
        send(page, new_message["content"])
        page.wait_for_selector(".failed .error")
        assert "too long for the model's context" in page.text_content(".failed .error")
        assert messages(page) == old_turns + [new_message]  # nothing kept of the failure

        page.click("text=Drop the oldest turns and retry")
        page.wait_for_selector("#notice:has-text('oldest messages were dropped')")
        wait_until_idle(page)
        assert page.query_selector(".failed") is None
        kept = messages(page)
        assert kept[-2] == new_message and kept[-1]["role"] == "assistant"
        dropped = len(old_turns) + 2 - len(kept)
        assert dropped > 0 and old_turns[dropped:] == kept[:-2]  # the oldest went, in order
        assert f"{dropped} oldest messages were dropped" in page.text_content("#notice")
        assert prompt_tokens(kept[:-1]) + max_tokens <= context


# ---------------------------------------------------------------------------- layout
LONG_WORD_REPLY = (
    "x" * 400 + " https://example.org/" + "a/" * 150
    + "\n\n```\n" + "y" * 300 + "\n```"
)


def test_narrow_screens_show_everything(browser: Any, server: OpenAIServer) -> None:
    """Nothing runs off-screen at a phone's width; at a tablet's the message box stays on
    one row; the max-tokens field shows its whole placeholder even for a long context."""
    def with_long_context(route: Any) -> None:
        card = route.fetch().json()
        card["data"][0]["max_model_len"] = 1_048_576
        route.fulfill(json=card)

    for width in (390, 700):
        with open_page(browser, server, width=width) as page:
            page.route("**/v1/models", with_long_context)
            preload(page, [{"role": "user", "content": "z" * 300},
                           {"role": "assistant", "content": LONG_WORD_REPLY, "stopped": True}])
            settings(page)  # open, with every field showing
            assert page.get_attribute("#max-tokens", "placeholder") == "up to 1048576"
            assert page.evaluate("document.documentElement.scrollWidth") <= width
            # The conversation scrolls up and down only: long words wrap in their bubble.
            assert page.evaluate("(log => log.scrollWidth <= log.clientWidth)"
                                 "(document.getElementById('log'))")
            for selector in ("#key", "#max-tokens", "#temperature", "#system", "#input",
                             "#send", ".user", ".assistant", ".assistant .stopped"):
                box = bounding_box(page, selector)
                assert box["x"] >= 0 and box["x"] + box["width"] <= width, (width, selector)
            assert page.evaluate(PLACEHOLDER_FITS)
            # The message box and Send side by side: the button within the box's height.
            message_box, send_button = bounding_box(page, "#input"), bounding_box(page, "#send")
            assert message_box["y"] <= send_button["y"]
            assert bottom(send_button) <= bottom(message_box) + 1
            if width < 760:  # the conversations are a drawer, off to the left until opened
                drawer = bounding_box(page, "#sidebar")
                assert drawer["x"] + drawer["width"] <= 0
                page.click("#toggle-sidebar")
                assert bounding_box(page, "#sidebar")["x"] == 0
                log = bounding_box(page, "#log")  # a click beside the drawer closes it
                page.click("#log", position={"x": log["width"] - 5, "y": 5})
                assert bounding_box(page, "#sidebar")["x"] < 0


def bounding_box(page: Any, selector: str) -> dict[str, float]:
    return page.locator(selector).bounding_box()


def bottom(box: dict[str, float]) -> float:
    return box["y"] + box["height"]


# The placeholder's width in the field's own font, against the room the field has for text.
PLACEHOLDER_FITS = """(() => {
  const field = document.getElementById('max-tokens');
  const style = getComputedStyle(field);
  const context = document.createElement('canvas').getContext('2d');
  context.font = style.font;
  const room = field.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
  return context.measureText(field.placeholder).width <= room - 16;  // 16: the spin buttons
})()"""
